"""`attnaudit ntk-distance`: options -> :class:`attnaudit.analyses.ntk_distance.run.NtkDistanceRequest` -> run
-> tables, JSON, figure (the 2-layer width sweep; ``--checkpoint``: a trained model against its initialization;
``--arch vit,vit-linear``: the width sweep of the built-in transformers)."""

from __future__ import annotations

import typer

from attnaudit.analyses.ntk_distance.run import NtkDistanceRequest, run
from attnaudit.cli.common import cli_errors, emit_result, exit_if_cells_failed
from attnaudit.cli.options import ExecutorOptions, OutputBundle, RequestOptions, request_command

EPILOG = "Example: attnaudit ntk-distance --dataset digits --preset quick --json ntk.json --png ntk.png"


def register(app: typer.Typer) -> None:
    @request_command(app, NtkDistanceRequest, EPILOG, execution=True)
    def ntk_distance_command(request: RequestOptions, out: OutputBundle, execution: ExecutorOptions) -> None:
        """Distance of finite 2L-ReLU / MLP-Attn networks from their NTK predictor across widths; with
        --checkpoint, how far training moved a trained model from the kernel regime; with --arch
        vit,vit-linear, the same across widths of the built-in transformers."""

        with cli_errors(out.debug, NtkDistanceRequest):
            executor = execution.config()  # where the cells run: checked first
            req = request.build()
            opts = out.options()
            opts.check_writable((req.png_name,))
            result = run(req, progress=opts.progress_bar, executor=executor, overwrite=out.overwrite)
            emit_result(opts, result)
            exit_if_cells_failed(result.failed_cells)
