"""`attnaudit landscape`: options -> :class:`attnaudit.analyses.landscape.run.LandscapeRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.landscape.run import LandscapeRequest
from attnaudit.cli.options import OutputBundle, RequestOptions, emit_run, request_command
from attnaudit.analyses.landscape.report import PNG_NAME
from attnaudit.analyses.landscape.run import run

EPILOG = "Example: attnaudit landscape --preset quick --json landscape.json --png landscape.png"


def register(app: typer.Typer) -> None:
    @request_command(app, LandscapeRequest, EPILOG)
    def landscape_command(request: RequestOptions, out: OutputBundle) -> None:
        """Loss landscape: top Hessian eigenvalues, trace, basin width and 1-D/2-D loss surfaces."""

        emit_run(request, out, run, lambda req: PNG_NAME)
