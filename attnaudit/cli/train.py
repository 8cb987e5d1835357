"""`attnaudit train`: options -> :class:`attnaudit.analyses.training.run.TrainRequest` -> run -> tables, JSON, figure."""

from __future__ import annotations

import typer

from attnaudit.analyses.training.run import TrainRequest
from attnaudit.cli.common import cli_errors, emit_result, progress
from attnaudit.cli.options import ManualCommand, OutputBundle, RequestOptions, bundled, with_request
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


def register(app: typer.Typer) -> None:
    @app.command(
        "train",
        help=HELP,
        cls=ManualCommand,
        epilog="Example: attnaudit train --arch vit --dataset digits --out vit.safetensors",
    )
    @bundled(out=OutputBundle)
    @with_request(TrainRequest)
    def train_command(request: RequestOptions, out: OutputBundle) -> None:

        with cli_errors(out.debug, TrainRequest):
            req = request.build(overwrite=out.overwrite)
            opts = out.options()
            target, sidecar = req.checkpoint_paths()
            opts.check_writable((PNG_NAME,), extra=[("--out", target), ("--out", sidecar)])
            emit_result(opts, run(req, progress=lambda *a: progress(opts, *a)))
