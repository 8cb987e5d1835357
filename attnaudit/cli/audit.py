"""`attnaudit audit FILE`: thin CLI over :mod:`attnaudit.audit` (checks from a YAML file, one
combined JSON report, JUnit XML, baselines; exit 0 pass, 1 a check failed, 2 bad input, 3 internal)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attnaudit.cli.common import Debug, cli_errors, emit_result, path_option, switch
from attnaudit.cli.options import ExecutorOptions, ManualCommand, bundled
from attnaudit.audit import baseline_payload, junit_xml
from attnaudit.audit.request import AuditRequest, run
from attnaudit.cli.common import OutputOptions
from attnaudit.report.envelope import dumps
from attnaudit.runtime.atomic import write_text_atomic
from attnaudit.audit import load_audit_file

HELP = (
    "Run the checks of an audit file (YAML: the model, the data, and checks that each name an analysis, its CLI "
    "options, a metric and thresholds) as one CI gate. Exit 0 when every check passes, 1 when one fails, 2 for a "
    "bad file or input, 3 for an internal error. Every check is validated (a dry run of its command) before "
    "anything trains. See docs/audit.md."
)


def register(app: typer.Typer) -> None:
    @app.command(
        "audit",
        help=HELP,
        cls=ManualCommand,
        epilog="Example: attnaudit audit examples/audit_digits.yaml --junit audit-junit.xml --json audit.json",
    )
    @bundled(execution=ExecutorOptions)
    def audit_command(
        execution: ExecutorOptions,
        file: Annotated[str, typer.Argument(help="The audit file (YAML).", show_default=False, metavar="AUDIT.yaml")],
        json: Annotated[
            Optional[str],
            path_option(
                "--json", "Write the combined JSON report (schema attnaudit.audit/1) here ('-' = standard output)."
            ),
        ] = None,
        junit: Annotated[
            Optional[str], path_option("--junit", "Write JUnit XML here: one test case per check.")
        ] = None,
        html: Annotated[
            Optional[str],
            path_option(
                "--html",
                "Write a self-contained HTML report here: one row per check (pass/fail, value, threshold) linking to its section.",
            ),
        ] = None,
        save_baseline: Annotated[
            Optional[str],
            path_option("--save-baseline", "Store every check's measured value here (JSON), for a later --baseline."),
        ] = None,
        baseline: Annotated[
            Optional[str],
            path_option(
                "--baseline",
                "Fail a check whose value got worse than in this baseline file by more than its tolerance.",
                panel="Attack / analysis",
            ),
        ] = None,
        fail_fast: Annotated[
            bool,
            switch(
                "--fail-fast", "Stop at the first failed check (the rest are reported as skipped).", panel="Execution"
            ),
        ] = False,
        quiet: Annotated[bool, switch("--quiet", "No table, no progress.", short="-q")] = False,
        overwrite: Annotated[bool, switch("--overwrite", "Allow replacing existing output files.")] = False,
        debug: Debug = False,
    ) -> None:

        with cli_errors(debug, AuditRequest):
            request = AuditRequest(file=file, baseline=baseline, fail_fast=fail_fast, overwrite=overwrite)
            opts = OutputOptions(json=json, quiet=quiet, overwrite=overwrite, html=html)
            extra = [(flag, Path(p)) for flag, p in (("--junit", junit), ("--save-baseline", save_baseline)) if p]
            opts.check_writable((), extra=extra)
            executor = execution.config()
            if not opts.quiet:
                plan = load_audit_file(file)
                opts.console.print(
                    f"audit {plan.name}: {len(plan.checks)} checks from {file}; validating each "
                    "(a dry run of its command) before anything runs",
                    highlight=False,
                )

            def done(check) -> None:
                if not opts.quiet and not opts.console.is_terminal:
                    opts.console.print(f"{check.status.upper():7} {check.name}: {check.message}", highlight=False)

            outcome = run(request, progress=opts.progress_bar, executor=executor, on_check=done)
            result = outcome.audit
            report = outcome.to_dict()
            report["inputs"].update({"junit": junit, "save_baseline": save_baseline})
            emit_result(opts, outcome)

            if junit:
                write_text_atomic(junit, junit_xml(result))
            if save_baseline:
                write_text_atomic(save_baseline, dumps(baseline_payload(result)) + "\n")
            if not opts.quiet and (junit or save_baseline):
                for flag, p in (("JUnit XML", junit), ("baseline", save_baseline)):
                    if p:
                        opts.console.print(f"{flag} written to {p}", highlight=False)
        if result.exit_code:
            raise typer.Exit(result.exit_code)
