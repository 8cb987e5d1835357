"""`attnaudit malleability`: options -> :class:`attnaudit.analyses.malleability.run.MalleabilityRequest` -> run ->
tables, JSON, figure; exit 1 when sweep cells failed or a flip rate exceeds --max-flip-rate."""

from __future__ import annotations

import typer

from attnaudit.analyses.malleability.run import MalleabilityRequest
from attnaudit.cli.common import emit_result, exit_if_cells_failed
from attnaudit.cli.options import ExecutorOptions, OutputBundle, RequestOptions, built, request_command
from attnaudit.analyses.malleability.run import exceeded_message, run


EPILOG = "Example: attnaudit malleability --preset quick --json malleability.json"


def register(app: typer.Typer) -> None:
    @request_command(app, MalleabilityRequest, EPILOG, execution=True)
    def malleability_command(request: RequestOptions, out: OutputBundle, execution: ExecutorOptions) -> None:
        """Influence malleability: do influence scores flip sign when the training data is perturbed?"""

        with built(request, out, overwrite=out.overwrite) as (req, opts):
            extra = [] if req.save_perturbed is None else [("--save-perturbed", req.save_perturbed)]
            opts.check_writable(("malleability.png",), extra=extra)
            notice = None if opts.quiet else (lambda text: opts.console.print(text, highlight=False))
            result = run(req, progress=opts.progress_bar, executor=execution.config(), notice=notice)
            emit_result(opts, result)
            exit_if_cells_failed(result.failed_cells)
            message = exceeded_message(result)
            if message:
                typer.echo(message, err=True)
                raise typer.Exit(1)
