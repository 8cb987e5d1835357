"""Pieces every CLI command shares: option types, error handling, output and progress.

The CLI is a thin layer: commands parse options, call one analysis function and hand the
result to :func:`emit`. No maths lives here.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer
from rich.console import Console

from .errors import AuditError
from .report import check_target, write_json

# ---- option types (typing.Annotated aliases, so every command spells them the same way)
DatasetOpt = Annotated[
    str, typer.Option("--dataset", help="Built-in data set: digits (embedded, offline), mnist, fashion-mnist, cifar10, synthetic.")
]
DataOpt = Annotated[
    Optional[str],
    typer.Option("--data", help="User data: .npz, .npy, .safetensors, .pt, .csv (label column) or an image folder (one sub-folder per class)."),
]
DataDirOpt = Annotated[
    Optional[str],
    typer.Option("--data-dir", help="Root of torchvision-format data sets (default: $ATTNAUDIT_DATA_DIR, else ~/.cache/attnaudit/data)."),
]
SplitOpt = Annotated[str, typer.Option("--split", help="train or test.")]
ClassesOpt = Annotated[Optional[str], typer.Option("--classes", help="Keep only these labels, e.g. 0,1,7.")]
PreprocessOpt = Annotated[str, typer.Option("--preprocess", help="raw, center, standardize or unit-norm.")]
DownloadOpt = Annotated[bool, typer.Option("--download", help="Allow torchvision to download a missing data set (needs a network).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Base random seed (recorded in the report).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:<i>.")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", help="Write the JSON report here ('-' = standard output, nothing else printed there).")]
PngOpt = Annotated[Optional[str], typer.Option("--png", help="Write the figure here (PNG).")]
OutDirOpt = Annotated[Optional[str], typer.Option("--out-dir", help="Write report.json and figures into this folder.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No table and no progress bar.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Allow replacing existing output files.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")]


def data_spec_from_options(
    dataset: str,
    data: str | None,
    data_dir: str | None,
    split: str,
    classes: str | None,
    preprocess: str,
    seed: int,
    download: bool,
    n: int | None = None,
    stratify: bool = False,
):
    """Build a validated :class:`attnaudit.data.DataSpec` from the shared CLI options."""
    from .data import DataSpec, parse_classes

    return DataSpec(
        dataset=dataset,
        data=data,
        data_dir=data_dir,
        split=split,
        n=n,
        classes=parse_classes(classes),
        preprocess=preprocess,
        seed=seed,
        stratify=stratify,
        download=download,
    )


def parse_list(text: str | int | float | None, kind: type, option: str) -> list:
    """Parse ``"16,64,256"`` into ``[16, 64, 256]`` (``kind`` int, float or str)."""
    if text is None:
        raise AuditError(f"{option} needs a value, e.g. {option} 1,2,3")
    if isinstance(text, (int, float)):
        return [kind(text)]
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise AuditError(f"{option} is empty; give a comma-separated list such as {option} 1,2,3")
    out = []
    for item in items:
        try:
            out.append(kind(item))
        except ValueError:
            name = {int: "an integer", float: "a number"}.get(kind, "a value")
            raise AuditError(f"{option}: {item!r} is not {name}; give a comma-separated list such as {option} 1,2,3") from None
    return out


def preset_value(value, preset: dict, key: str, default=None):
    """An explicit option beats the preset, which beats ``default``."""
    if value is not None:
        return value
    return preset.get(key, default)


def refuse_training_options_for_saved_model(**options) -> None:
    """``--model`` audits a saved model as it is: options that only shape training do not apply."""
    given = [f"--{name.replace('_', '-')}" for name, value in options.items() if value is not None]
    if given:
        raise AuditError(f"{', '.join(given)} set how new models are trained and do not apply to --model; drop them")


@contextlib.contextmanager
def cli_errors(debug: bool = False) -> Iterator[None]:
    """Turn :class:`AuditError` into one line on stderr and exit 2; other failures into exit 3."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        yield
    except AuditError as exc:
        if debug:
            traceback.print_exc()
        err.print(f"[bold red]error:[/] {exc}", markup=True)
        raise typer.Exit(exc.exit_code) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except MemoryError:
        if debug:
            traceback.print_exc()
        err.print("[bold red]error:[/] out of memory; use a smaller --n or --device cuda", markup=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - last resort, keep the one-line promise
        if debug:
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        err.print(
            f"[bold red]internal error:[/] {exc.__class__.__name__}: {first} (rerun with --debug for the traceback and report it)",
            markup=True,
        )
        raise typer.Exit(3) from None


@dataclass
class OutputOptions:
    """Where a command's outputs go; checks targets before any compute starts."""

    json: str | None = None
    png: str | None = None
    out_dir: str | None = None
    quiet: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        # With --json - standard output carries the JSON alone, so everything human goes to stderr.
        self.console = Console(stderr=self.json == "-", highlight=False)
        if not self.console.is_terminal and "COLUMNS" not in os.environ:
            # Piped output (logs, CI) would otherwise be cut at 80 columns and wide tables
            # truncated to "…"; a log file has no width limit worth respecting.
            self.console = Console(stderr=self.json == "-", highlight=False, width=200)

    def json_targets(self) -> list[str]:
        targets = []
        if self.json:
            targets.append(self.json)
        if self.out_dir:
            targets.append(str(Path(self.out_dir) / "report.json"))
        return targets

    def png_target(self, default_name: str = "figure.png") -> Path | None:
        if self.png:
            return Path(self.png)
        if self.out_dir:
            return Path(self.out_dir) / default_name
        return None

    def check_writable(self, png_names: tuple[str, ...] = ("figure.png",)) -> None:
        """Fail before compute if an output would overwrite a user's file or its folder is missing."""
        if self.out_dir:
            out = Path(self.out_dir)
            if out.exists() and not out.is_dir():
                raise AuditError(f"--out-dir {out} is a file; give a folder")
            out.mkdir(parents=True, exist_ok=True)
        for target in self.json_targets():
            if target != "-":
                check_target(target, self.overwrite)
        if self.png:
            if not self.png.lower().endswith(".png"):
                raise AuditError(f"--png {self.png}: the figure is a PNG; give a path ending in .png")
            check_target(self.png, self.overwrite)
        elif self.out_dir:
            for name in png_names:
                check_target(Path(self.out_dir) / name, self.overwrite)

    @property
    def show_table(self) -> bool:
        return not self.quiet


def emit(
    opts: OutputOptions,
    report: dict,
    renderables: list,
    plot: Callable[[Path], None] | None = None,
    png_name: str = "figure.png",
) -> None:
    """Print the tables, write the JSON report(s) and the figure, as the options ask."""
    if opts.show_table:
        for item in renderables:
            opts.console.print(item)
    for target in opts.json_targets():
        write_json(report, target, overwrite=opts.overwrite)
        if target != "-" and opts.show_table:
            opts.console.print(f"JSON report written to {target}")
    png = opts.png_target(png_name)
    if plot is not None and png is not None:
        import matplotlib

        matplotlib.use("Agg")
        check_target(png, opts.overwrite)
        plot(png)
        if opts.show_table:
            opts.console.print(f"figure written to {png}")


@contextlib.contextmanager
def progress(opts: OutputOptions, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on a terminal; a no-op when quiet, piped, or writing JSON to stdout."""
    interactive = opts.console.is_terminal and not opts.quiet and os.environ.get("CI") is None
    if not interactive:
        yield lambda k=1: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=opts.console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda k=1: bar.advance(task, k)
