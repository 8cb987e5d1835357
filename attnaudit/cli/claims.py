"""`attnaudit claims`: options -> :class:`attnaudit.claims.run.ClaimsRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.claims.run import PNG_NAME, ClaimsRequest
from attnaudit.cli.common import emit_result
from attnaudit.cli.options import ExecutorOptions, OutputBundle, RequestOptions, built, request_command
from attnaudit.claims.run import run

HELP = (
    "Test the paper's claims on one data set: runs kappa, ntk-distance, malleability and landscape with documented "
    "protocols (the commands' quick or paper presets) and prints one verdict per claim (supported / contradicted / "
    "not resolved / not testable here, with why), plus the malleability comparison under protocol variants. "
    "Every row states its null hypothesis and minimum effect, the interval and tests it is read from (valid for any "
    "seed distribution; Holm-adjusted across rows), the seeds it would need when unresolved, and the warnings of its "
    "run. --preset quick: digits, a few minutes; --preset paper: MNIST-size presets (an hour or more "
    "on 2 cores with --jobs 2). --keep-reports DIR keeps every run's report; --reports DIR scores kept reports again "
    "without running anything."
)


EPILOG = "Example: attnaudit claims --preset quick --json claims.json"


def register(app: typer.Typer) -> None:
    @request_command(app, ClaimsRequest, EPILOG, help=HELP, execution=True)
    def claims_command(request: RequestOptions, out: OutputBundle, execution: ExecutorOptions) -> None:

        with built(request, out, overwrite=out.overwrite) as (req, opts):
            opts.check_writable((PNG_NAME,))
            if req.reports_dir is not None:  # nothing runs: the executor options do not matter
                if not opts.quiet:
                    opts.console.print(
                        f"claims: scoring the reports in {req.reports_dir} (nothing runs)", highlight=False
                    )
                result = run(req)
            else:
                executor = execution.config()
                executor.check_available()
                if not opts.quiet:
                    opts.console.print(
                        f"claims ({req.mode}): on {' '.join(req.data_args())}, executor {executor.name}",
                        highlight=False,
                    )
                result = run(req, progress=opts.progress_bar, executor=executor)
            emit_result(opts, result)
        if result.failed_cells:
            raise typer.Exit(1)
