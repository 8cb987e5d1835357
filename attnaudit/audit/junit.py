"""JUnit XML for an audit: one ``<testcase>`` per check, the format CI systems (GitHub Actions
reporters, GitLab ``artifacts:reports:junit``, Jenkins) show natively.

``<testsuites><testsuite name tests failures errors skipped time timestamp><testcase
classname="attnaudit.<analysis>" name="<check>" time>``; a failed check holds ``<failure
message type="threshold|baseline">`` (value, threshold and the command that reproduces it),
an errored one ``<error>``, a skipped one ``<skipped>``; ``<system-out>`` carries the value.
"""

from __future__ import annotations

import datetime as _dt
import xml.etree.ElementTree as ET
from pathlib import Path

from attnaudit.audit.runner import AuditResult
from attnaudit.runtime.atomic import write_text_atomic


def junit_xml(result: AuditResult) -> str:
    """The JUnit document as text."""
    counts = result.counts
    run_seconds = {r.id: r.seconds for r in result.runs}
    suites = ET.Element(
        "testsuites",
        name="attnaudit audit",
        tests=str(len(result.checks)),
        failures=str(counts["fail"]),
        errors=str(counts["error"]),
        skipped=str(counts["skipped"]),
        time=f"{result.seconds:.3f}",
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=result.plan.name,
        tests=str(len(result.checks)),
        failures=str(counts["fail"]),
        errors=str(counts["error"]),
        skipped=str(counts["skipped"]),
        time=f"{result.seconds:.3f}",
        timestamp=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("audit_file", result.plan.path),
        ("audit_file_sha256", result.plan.sha256),
        ("seed", str(result.plan.seed)),
        ("exit_code", str(result.exit_code)),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    seen_runs: set[str] = set()
    for c in result.checks:
        # a shared run's time is counted once, on the first check it served
        seconds = run_seconds.get(c.run, 0.0) if c.run not in seen_runs and c.status != "skipped" else 0.0
        seen_runs.add(c.run)
        case = ET.SubElement(
            suite, "testcase", classname=f"attnaudit.{c.spec.analysis}", name=c.name, time=f"{seconds:.3f}"
        )
        if c.status == "fail":
            node = ET.SubElement(case, "failure", message=c.message, type=c.failure_type or "threshold")
            node.text = c.message
        elif c.status == "error":
            node = ET.SubElement(case, "error", message=c.message, type=c.error_kind or "error")
            node.text = c.message
        elif c.status == "skipped":
            ET.SubElement(case, "skipped", message=c.message or "skipped")
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(
            filter(
                None,
                [
                    f"metric: {c.spec.metric_label}",
                    f"value: {c.to_dict()['value_text']}",
                    f"threshold: {c.threshold_text}",
                    f"status: {c.status}",
                    f"command: {c.command}",
                    f"shared run with: {', '.join(c.shared_with)}" if c.shared_with else "",
                ],
            )
        )
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(result: AuditResult, path: str | Path) -> None:
    """Write the JUnit XML atomically (an existing file is replaced: vet it with check_target first)."""

    write_text_atomic(path, junit_xml(result))
