"""`audit` as a request and a run: the checks of an audit file as one CI gate.

``AuditRequest(file="audit.yaml")`` names the file (and a baseline to compare with);
``run(request)`` validates every check, runs each distinct request once through the library
and returns a :class:`~attnaudit.analyses.result.Result` whose report is the combined audit
report (``results.summary.exit_code``: 0 every check passed, 1 one failed, 2 bad input, 3 internal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from attnaudit.analyses.request import ANALYSIS, EXECUTION, FieldError, Request, internal, option
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.audit.file import load_audit_file
from attnaudit.audit.runner import SCHEMA, AuditResult, run_audit
from attnaudit.report.envelope import build_report
from attnaudit.runtime.sweep import ExecutorConfig


@dataclass(frozen=True)
class AuditRequest(Request):
    """What ``attnaudit audit FILE`` runs. ``file`` is the command's argument, not an option."""

    COMMAND = "audit"

    file: str = internal("")
    baseline: str | None = option(
        None,
        "--baseline",
        panel=ANALYSIS,
        metavar="PATH",
        help="Fail a check whose value got worse than in this baseline file by more than its tolerance.",
    )
    fail_fast: bool = option(
        False, "--fail-fast", panel=EXECUTION, help="Stop at the first failed check (the rest are reported as skipped)."
    )
    overwrite: bool = internal(False)  # model.save may replace an existing file

    def validate(self) -> None:
        if not self.file:
            raise FieldError("file", "{name}: give the audit file (YAML)")

    def to_argv(self) -> list[str]:
        # file is positional; internal fields are not reproduced by super().to_argv()
        argv: list[str] = []
        for name, value in (("baseline", self.baseline),):
            if value is not None:
                argv += [self.flag_of(name), str(value)]
        if self.fail_fast:
            argv.append(self.flag_of("fail_fast"))
        return [self.file, *argv]


@dataclass
class AuditRunResult(Result):
    """The audit's :class:`Result`, with the typed :class:`AuditResult` it reports (JUnit, baselines)."""

    audit: AuditResult = field(kw_only=True, repr=False, compare=False)


def run(
    request: AuditRequest,
    *,
    progress: Progress | None = None,
    executor: Any = None,
    on_check: Callable[[Any], None] | None = None,
) -> AuditRunResult:
    """Run the audit; ``on_check(check)`` is called as each check is judged."""

    executor = executor or ExecutorConfig()
    t0 = time.perf_counter()
    plan = load_audit_file(request.file)
    with progress_or_silent(progress)("audit", len(plan.checks), "checks") as advance:

        def done(check: Any) -> None:
            advance(1)
            if on_check is not None:
                on_check(check)

        result = run_audit(
            plan,
            baseline=request.baseline,
            fail_fast=request.fail_fast,
            overwrite=request.overwrite,
            progress=done,
            executor=executor,
        )
    report = build_report(
        SCHEMA,
        inputs={
            "file": request.file,
            "baseline": request.baseline,
            "fail_fast": request.fail_fast,
            "execution": executor.to_dict(),
        },
        seeds={"seed": plan.seed, "checks": {c.name: _seed_of(c) for c in result.checks}},
        device=None,
        dtype="as each command records in its report",
        timings={"total": time.perf_counter() - t0, **{f"run:{r.id}": r.seconds for r in result.runs}},
        results=result.to_dict(),
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    return AuditRunResult(report, request, renderables=_tables(result), audit=result)


def _seed_of(check: Any) -> int | None:
    """The --seed a check's command ran with (from its argument list)."""
    args = check.command.split()
    return int(args[args.index("--seed") + 1]) if "--seed" in args else None


def _tables(result: Any) -> list:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"attnaudit audit: {result.plan.name}", title_justify="left")
    for col in ("check", "analysis", "metric", "value", "threshold", "baseline", "result", "run"):
        table.add_column(col)
    style = {"pass": "green", "fail": "bold red", "error": "bold red", "skipped": "yellow"}
    for c in result.checks:
        d = c.to_dict()
        base = "" if c.baseline is None else f"{c.baseline['value_text']} ({'ok' if c.baseline['passed'] else 'worse'})"
        run_text = c.run + (f" (shared with {', '.join(c.shared_with)})" if c.shared_with else "")
        table.add_row(
            c.name,
            c.spec.analysis,
            c.spec.metric_label,
            d["value_text"],
            c.threshold_text,
            base,
            Text(c.status.upper(), style=style[c.status]),
            run_text,
        )
    lines: list = [table]
    for c in result.checks:
        if c.status in ("fail", "error"):
            lines.append(Text(f"{c.status.upper()} {c.name}: {c.message}"))
    for w in result.warnings:
        lines.append(Text(f"warning: {w}"))
    lines.append(Text(result.verdicts()[0]))
    return lines
