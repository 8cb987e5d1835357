"""`attnaudit train`: options -> :class:`attnaudit.analyses.training.run.TrainRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.training.run import TrainRequest
from attnaudit.cli.common import emit_result
from attnaudit.cli.options import OutputBundle, RequestOptions, built, request_command
from attnaudit.analyses.training.run import PNG_NAME, run

HELP = (
    "Train a built-in model and save it as an auditable checkpoint (safetensors + JSON side-car recording the "
    "training data, its held-out split and the recipe).\n\n"
    "Defaults per architecture. vit, vit-linear: adam, --lr 1e-3, --batch-size 64, 5 epochs, cross-entropy, float32; "
    "depth 2, dim 64, 4 heads, MLP ratio 2, and the largest patch that leaves at least 16 tokens (7 for 28x28, 8 for "
    "32x32, 2 for 8x8). relu, attn: full-batch gradient descent, --lr 4.0, 300 steps, mse, float64, width 64 (how "
    "the other commands train them). Another --optimizer than the default needs an explicit --lr.\n\n"
    "--seed fixes the initialisation, the order of the mini-batches and the held-out split."
)


EPILOG = "Example: attnaudit train --arch vit --dataset digits --out vit.safetensors"


def register(app: typer.Typer) -> None:
    @request_command(app, TrainRequest, EPILOG, help=HELP)
    def train_command(request: RequestOptions, out: OutputBundle) -> None:

        with built(request, out, overwrite=out.overwrite) as (req, opts):
            target, sidecar = req.checkpoint_paths()
            opts.check_writable((PNG_NAME,), extra=[("--out", target), ("--out", sidecar)])
            emit_result(opts, run(req, progress=opts.progress_bar))
