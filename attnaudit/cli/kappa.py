"""`attnaudit kappa`: options -> :class:`attnaudit.analyses.kappa.run.KappaRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.kappa.run import KappaRequest
from attnaudit.cli.options import OutputBundle, RequestOptions, emit_run, request_command
from attnaudit.analyses.kappa.layer_report import PNG_NAME
from attnaudit.analyses.kappa.run import run


def register(app: typer.Typer) -> None:
    @request_command(app, KappaRequest, "Example: attnaudit kappa --dataset digits --json kappa.json")
    def kappa_command(request: RequestOptions, out: OutputBundle) -> None:
        """Gram spectrum, condition numbers, linearized-attention amplification (direct check with a
        calibrated round-off budget) and the paper's width requirement kappa^6 n ln n against 1e12;
        with --checkpoint, the same per attention layer of a trained transformer."""

        emit_run(request, out, run, lambda req: PNG_NAME if req.model_given else "kappa.png")
