"""Compare the numbers of two JSON reports of the same command (before and after a refactor).

Every number must agree to ``--tol`` (relative, or absolute below 1); strings, lists and keys
must match; timings, the environment, versions, paths and memory counters are left out (they
change from run to run). Prints one line per difference, then ``RATIO differences=<count>``.

    PYTHONPATH=/path/to/old/checkout python -m attnaudit kappa --seed 0 --json before.json
    python -m attnaudit kappa --seed 0 --json after.json
    python benchmarks/compare_reports.py before.json after.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

IGNORED = re.compile(
    r"timing|time|seconds|elapsed|wall|_s$|duration|created|timestamp|host|python|torch|version|peak|rss|memory"
    r"|threads|path|command|cache|platform|cpu|date|environment",
    re.I,
)


def differences(a: Any, b: Any, where: str = "", tol: float = 1e-4) -> list[str]:
    """Where ``a`` and ``b`` differ (numbers beyond ``tol``), as ``path: a vs b`` lines."""
    out: list[str] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if IGNORED.search(str(key)):
                continue
            if key not in a or key not in b:
                out.append(f"{where}/{key}: only in {'the first' if key in a else 'the second'}")
            else:
                out += differences(a[key], b[key], f"{where}/{key}", tol)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{where}[{i}]", tol)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not (math.isnan(a) and math.isnan(b)) and not abs(a - b) <= tol * max(1.0, abs(a), abs(b)):
            out.append(f"{where}: {a!r} vs {b!r}")
    elif a != b:
        out.append(f"{where}: {str(a)[:80]!r} vs {str(b)[:80]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance (absolute below 1); default 1e-4")
    args = ap.parse_args(argv)
    with open(args.first) as f, open(args.second) as g:
        found = differences(json.load(f), json.load(g), tol=args.tol)
    for line in found:
        print(line)
    print(f"RATIO differences={len(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
