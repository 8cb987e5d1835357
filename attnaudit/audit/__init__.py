"""``attnaudit audit``: an audit file of checks (analysis, options, metric, thresholds) run as
one CI gate with a combined JSON report, JUnit XML and baselines. See docs/audit.md.

    from attnaudit.audit import load_audit_file, run_audit, write_junit
    plan = load_audit_file("audit.yaml")
    result = run_audit(plan)
    write_junit(result, "report.xml")
    raise SystemExit(result.exit_code)
"""

from attnaudit.audit.file import FILE_SCHEMA, AuditPlan, CheckSpec, load_audit_file, parse_audit
from attnaudit.audit.junit import junit_xml, write_junit
from attnaudit.audit.metrics import METRICS
from attnaudit.audit.runner import (
    BASELINE_SCHEMA,
    SCHEMA,
    AuditResult,
    CheckResult,
    baseline_payload,
    read_baseline,
    run_audit,
)

__all__ = [
    "FILE_SCHEMA",
    "SCHEMA",
    "BASELINE_SCHEMA",
    "AuditPlan",
    "CheckSpec",
    "AuditResult",
    "CheckResult",
    "METRICS",
    "load_audit_file",
    "parse_audit",
    "run_audit",
    "junit_xml",
    "write_junit",
    "baseline_payload",
    "read_baseline",
]
