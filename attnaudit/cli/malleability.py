"""`attnaudit malleability`: options -> :class:`attnaudit.analyses.malleability.run.MalleabilityRequest` -> run ->
tables, JSON, figure; exit 1 when sweep cells failed or a flip rate exceeds --max-flip-rate."""

from __future__ import annotations

import typer

from attnaudit.analyses.malleability.run import MalleabilityRequest
from attnaudit.cli.common import cli_errors, emit_result, exit_if_cells_failed, progress
from attnaudit.cli.options import ExecutorOptions, ManualCommand, OutputBundle, RequestOptions, bundled, with_request
from attnaudit.analyses.malleability.run import exceeded_message, run


def register(app: typer.Typer) -> None:
    @app.command(
        "malleability",
        cls=ManualCommand,
        epilog="Example: attnaudit malleability --preset quick --json malleability.json",
    )
    @bundled(out=OutputBundle, execution=ExecutorOptions)
    @with_request(MalleabilityRequest)
    def malleability_command(request: RequestOptions, out: OutputBundle, execution: ExecutorOptions) -> None:
        """Influence malleability: do influence scores flip sign when the training data is perturbed?"""

        with cli_errors(out.debug, MalleabilityRequest):
            req = request.build()
            opts = out.options()
            opts.check_writable(("malleability.png",))
            notice = None if opts.quiet else (lambda text: opts.console.print(text, highlight=False))
            result = run(req, progress=lambda *a: progress(opts, *a), executor=execution.config(), notice=notice)
            emit_result(opts, result)
            exit_if_cells_failed(result.failed_cells)
            message = exceeded_message(result)
            if message:
                typer.echo(message, err=True)
                raise typer.Exit(1)
