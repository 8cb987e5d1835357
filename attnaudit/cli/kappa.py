"""`attnaudit kappa`: options -> :class:`attnaudit.analyses.kappa.run.KappaRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.kappa.run import KappaRequest
from attnaudit.cli.common import cli_errors, emit_result, progress
from attnaudit.cli.options import ManualCommand, OutputBundle, RequestOptions, bundled, with_request
from attnaudit.analyses.kappa.layers import PNG_NAME
from attnaudit.analyses.kappa.run import run


def register(app: typer.Typer) -> None:
    @app.command("kappa", cls=ManualCommand, epilog="Example: attnaudit kappa --dataset digits --json kappa.json")
    @bundled(out=OutputBundle)
    @with_request(KappaRequest)
    def kappa_command(request: RequestOptions, out: OutputBundle) -> None:
        """Gram spectrum, condition numbers, linearized-attention amplification (direct check with a
        calibrated round-off budget) and the paper's width requirement kappa^6 n ln n against 1e12;
        with --checkpoint, the same per attention layer of a trained transformer."""

        with cli_errors(out.debug, KappaRequest):
            req = request.build()
            opts = out.options()
            opts.check_writable((PNG_NAME if req.model_given else "kappa.png",))
            emit_result(opts, run(req, progress=lambda *a: progress(opts, *a)))
