"""`attnaudit landscape`: options -> :class:`attnaudit.analyses.landscape.run.LandscapeRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.landscape.run import LandscapeRequest
from attnaudit.cli.common import cli_errors, emit_result, progress
from attnaudit.cli.options import ManualCommand, OutputBundle, RequestOptions, bundled, with_request
from attnaudit.analyses.landscape.report import PNG_NAME
from attnaudit.analyses.landscape.run import run


def register(app: typer.Typer) -> None:
    @app.command(
        "landscape",
        cls=ManualCommand,
        epilog="Example: attnaudit landscape --preset quick --json landscape.json --png landscape.png",
    )
    @bundled(out=OutputBundle)
    @with_request(LandscapeRequest)
    def landscape_command(request: RequestOptions, out: OutputBundle) -> None:
        """Loss landscape: top Hessian eigenvalues, trace, basin width and 1-D/2-D loss surfaces."""

        with cli_errors(out.debug, LandscapeRequest):
            req = request.build()
            opts = out.options()
            opts.check_writable((PNG_NAME,))
            emit_result(opts, run(req, progress=lambda *a: progress(opts, *a)))
