"""The `attnaudit` command line: a thin Typer layer; each command lives in attnaudit/commands/."""

from __future__ import annotations

import typer

from . import __version__
from .commands import kappa, landscape, malleability, ntk_distance

app = typer.Typer(
    name="attnaudit",
    help="Audit attention models through the neural tangent kernel (NTK) lens.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnaudit {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    threads: int = typer.Option(
        0, "--threads", help="CPU threads for torch (0 = torch's default). On a shared machine 1 avoids OpenMP oversubscription."
    ),
) -> None:
    """Audit attention models through the neural tangent kernel (NTK) lens."""
    if threads < 0:
        typer.echo("error: --threads must be >= 0 (0 keeps torch's default)", err=True)
        raise typer.Exit(2)
    if threads:
        import torch

        torch.set_num_threads(threads)


for module in (kappa, ntk_distance, malleability, landscape):
    module.register(app)
