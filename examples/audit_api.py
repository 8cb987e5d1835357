"""The digits audit (examples/audit_digits.yaml) through the library API instead of the CLI.

Run: python examples/audit_api.py [AUDIT.yaml] [--junit report.xml]   (about a minute on 2 cores)
Same checks, same command lines, same numbers as `attnaudit audit examples/audit_digits.yaml`;
exits with the audit's code: 0 every check passed, 1 a check failed, 2 a bad file or input.
"""

import argparse
import sys
from pathlib import Path

from attnaudit import AuditError
from attnaudit.audit import load_audit_file, run_audit, write_junit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("file", nargs="?", default=str(Path(__file__).with_name("audit_digits.yaml")))
parser.add_argument("--junit", help="also write JUnit XML here")
args = parser.parse_args()

try:
    plan = load_audit_file(args.file)  # keys, types, option and metric names; nothing runs yet
    result = run_audit(plan)  # dry-run validation of every check, then the runs (shared where identical)
except AuditError as exc:  # a bad file or option value: nothing ran
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)

for check in result.checks:
    value = "n/a" if check.value is None else f"{check.value:.4g}"
    shared = f" (shared run with {', '.join(check.shared_with)})" if check.shared_with else ""
    print(f"{check.status.upper():7} {check.name}: {value}{shared}")
    if check.status in ("fail", "error"):
        print(f"        {check.message}")
summary = result.to_dict()["summary"]
print(f"{summary['passed']} of {summary['checks']} checks passed; exit {result.exit_code}")
if args.junit:
    write_junit(result, args.junit)
sys.exit(result.exit_code)
