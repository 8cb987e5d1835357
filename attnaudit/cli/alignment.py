"""`attnaudit alignment`: options -> :class:`attnaudit.analyses.alignment.run.AlignmentRequest` -> run -> tables, JSON, figure.

Sign conventions of the report (see attnaudit/analyses/alignment/alignment.py and docs/alignment.md): every
``*_advantage_attn`` is relu minus attn for errors and attn minus relu for CKA, so a
positive value always means attention does better; a ``*_contrast`` is the advantage on the
principal target minus that on the random (or trailing) one, positive = the paper's claim.
"""

from __future__ import annotations

import typer

from attnaudit.analyses.alignment.run import AlignmentRequest
from attnaudit.cli.options import OutputBundle, RequestOptions, emit_run, request_command
from attnaudit.analyses.alignment.report import PNG_NAME
from attnaudit.analyses.alignment.run import run

EPILOG = "Example: attnaudit alignment --preset quick --json alignment.json --png alignment.png"


def register(app: typer.Typer) -> None:
    @request_command(app, AlignmentRequest, EPILOG)
    def alignment_command(request: RequestOptions, out: OutputBundle) -> None:
        """Does the attention kernel lower the approximation error on targets aligned with the data's
        principal modes? Kernel ridge and trained-net errors, and CKA, of 2L-ReLU and MLP-Attn."""

        emit_run(request, out, run, lambda req: PNG_NAME)
