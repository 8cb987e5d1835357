"""Pieces every CLI command shares: option types, error handling, output and progress.

The CLI is a thin layer: commands parse options, call one analysis function and hand the
result to :func:`emit`. No maths lives here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Sequence

import typer
from rich.console import Console
from rich.text import Text

from attnaudit.analyses.request import FieldError, fields_named
from attnaudit.errors import AuditError
from attnaudit.runtime.atomic import StagedFiles
from attnaudit.report.envelope import check_target, dumps, folder_problem
from attnaudit.report.html import RunPage, png_bytes, render_run

# Models already saved by --save-models are complete files (each saved atomically), so the
# promise is about the report and figure only.
INTERRUPTED = "stopped by Ctrl-C (SIGINT); no report or figure was written"


def path_option(flag: str, help: str, panel: str = "Output") -> Any:
    """A ``--flag PATH`` typer option (no default shown) in ``panel``."""
    return typer.Option(flag, help=help, metavar="PATH", show_default=False, rich_help_panel=panel)


def switch(flag: str, help: str, panel: str = "Output", short: str | None = None) -> Any:
    """A ``--flag`` switch (default off) in ``panel``."""
    return typer.Option(flag, *([short] if short else []), help=help, rich_help_panel=panel)


#: The switches of the commands that do not take a request's options (audit, report).
Debug = Annotated[bool, switch("--debug", "Show the full traceback on errors.")]


def error_line(label: str, message: str) -> None:
    """Print ``label: message`` as one line on stderr, the message as plain text.

    User strings (paths, data set names, device names) can contain rich markup such as
    ``[/x]`` or emoji codes such as ``:x:``; a :class:`~rich.text.Text` is never parsed,
    so they are shown exactly as typed.
    """
    err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)
    one_line = " ".join(str(message).split())
    err.print(Text.assemble((f"{label}:", "bold red"), " ", one_line))


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or exc.__class__.__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


@contextlib.contextmanager
def cli_errors(debug: bool = False, request_type: type | None = None) -> Iterator[None]:
    """Map failures to one stderr line and an exit code.

    :class:`AuditError` -> exit 2; out of memory -> exit 2 with a hint; Ctrl-C -> exit 130
    with "interrupted"; anything else -> exit 3 (an internal error to report). An error
    about a field of ``request_type`` names the field's flag.
    """
    try:
        try:
            yield
        except FieldError as exc:
            if request_type is None:
                raise
            raise fields_named(exc, request_type) from None
    except BaseException:
        _exit_for(debug)


def _exit_for(debug: bool) -> None:
    """Turn the exception being handled into one stderr line and typer.Exit (see cli_errors)."""
    try:
        raise
    except AuditError as exc:
        if debug:
            traceback.print_exc()
        error_line("error", str(exc))
        raise typer.Exit(exc.exit_code) from None
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        error_line("interrupted", INTERRUPTED)
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - last resort, keep the one-line promise
        if debug:
            traceback.print_exc()
        if _is_out_of_memory(exc):
            error_line("error", "out of memory; use a smaller --n / --n-train / --widths, or --device cuda")
            raise typer.Exit(2) from None
        first = str(exc).splitlines()[0] if str(exc) else ""
        error_line(
            "internal error",
            f"{exc.__class__.__name__}: {first} (rerun with --debug for the traceback and report it)",
        )
        raise typer.Exit(3) from None


@dataclass
class OutputOptions:
    """Where a command's outputs go; :meth:`check_writable` vets every target before compute."""

    json: str | None = None
    png: str | None = None
    out_dir: str | None = None
    quiet: bool = False
    overwrite: bool = False
    html: str | None = None

    def __post_init__(self) -> None:
        # With --json - standard output carries the JSON alone, so everything human goes to stderr.
        # markup/emoji off: tables hold user strings (file and data set names) that must print as typed.
        kwargs: dict[str, Any] = dict(stderr=self.json == "-", highlight=False, markup=False, emoji=False)
        if not Console(**kwargs).is_terminal and "COLUMNS" not in os.environ:
            # Piped output (logs, CI) would otherwise be cut at 80 columns and wide tables
            # truncated to "…"; a log file has no width limit worth respecting.
            kwargs["width"] = 200
        self.console = Console(**kwargs)

    def progress_bar(self, description: str, total: int, unit: str = "") -> contextlib.AbstractContextManager:
        """:func:`progress` on these outputs: what a run's ``progress`` takes."""
        return progress(self, description, total, unit)

    def json_targets(self) -> list[str]:
        targets = []
        if self.json:
            targets.append(self.json)
        if self.out_dir:
            targets.append(str(Path(self.out_dir) / "report.json"))
        return targets

    def html_targets(self) -> list[Path]:
        targets = [Path(self.html)] if self.html else []
        if self.out_dir:
            targets.append(Path(self.out_dir) / "report.html")
        return targets

    def png_target(self, default_name: str = "figure.png") -> Path | None:
        if self.png:
            return Path(self.png)
        if self.out_dir:
            return Path(self.out_dir) / default_name
        return None

    def _targets(self, png_names: tuple[str, ...]) -> list[tuple[str, Path]]:
        """(flag, path) of every file this command will write."""
        targets: list[tuple[str, Path]] = []
        if self.json and self.json != "-":
            targets.append(("--json", Path(self.json)))
        if self.png:
            targets.append(("--png", Path(self.png)))
        if self.html:
            targets.append(("--html", Path(self.html)))
        if self.out_dir:
            targets.append(("--out-dir", Path(self.out_dir) / "report.json"))
            targets.append(("--out-dir", Path(self.out_dir) / "report.html"))
            if not self.png:
                targets.extend(("--out-dir", Path(self.out_dir) / name) for name in png_names)
        return targets

    def check_writable(
        self, png_names: tuple[str, ...] = ("figure.png",), extra: Sequence[tuple[str, Path]] = ()
    ) -> None:
        """Fail before compute if any output could not be written, or would clobber a file or another output.

        ``extra`` adds (flag, path) targets a command writes besides the report and figure.
        Nothing is created here: the --out-dir folder is made when the outputs are written.
        """
        if self.png and not self.png.lower().endswith(".png"):
            raise AuditError(f"--png {self.png}: the figure is a PNG; give a path ending in .png")
        if self.html and not self.html.lower().endswith((".html", ".htm")):
            raise AuditError(f"--html {self.html}: the report is an HTML page; give a path ending in .html")
        out_missing = False
        if self.out_dir:
            out = Path(self.out_dir)
            if out.exists() and not out.is_dir():
                raise AuditError(f"--out-dir {out} is a file; give a folder")
            if not out.exists():
                out_missing = True
                ancestor = out.parent
                while not ancestor.exists() and ancestor != ancestor.parent:
                    ancestor = ancestor.parent
                if not ancestor.is_dir():
                    raise AuditError(
                        f"--out-dir {out}: {ancestor} is a file, so the folder cannot be created; choose another folder"
                    )
                problem = folder_problem(ancestor)
                if problem:
                    raise AuditError(f"--out-dir {out}: {problem}")
        targets = self._targets(png_names) + list(extra)
        seen: dict[str, tuple[str, Path]] = {}
        for flag, path in targets:
            key = os.path.realpath(path)
            if key in seen:
                other_flag, other = seen[key]
                raise AuditError(
                    f"{flag} {path} and {other_flag} {other} name the same file; give each output its own path"
                )
            seen[key] = (flag, path)
        for flag, path in targets:
            if out_missing and flag == "--out-dir":
                continue  # the folder does not exist yet, so nothing in it can be clobbered
            check_target(path, self.overwrite)

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
    """Print the tables, then write the JSON report(s) and the figure, as the options ask.

    Files are staged under temporary names and renamed into place together at the end,
    so an error or Ctrl-C leaves either every output or none (no half-written file).
    """
    if opts.show_table:
        for item in renderables:
            opts.console.print(item)
    text = dumps(report) + "\n"
    written: list[str] = []
    if opts.out_dir:
        Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
    with StagedFiles(overwrite=opts.overwrite) as files:
        for target in opts.json_targets():
            if target == "-":
                continue
            check_target(target, opts.overwrite)
            files.stage(target, lambda path: Path(path).write_text(text, encoding="utf-8"))
            written.append(f"JSON report written to {target}")
        png = opts.png_target(png_name)
        if plot is not None and png is not None:
            import matplotlib

            matplotlib.use("Agg")
            check_target(png, opts.overwrite)
            files.stage(png, plot)
            written.append(f"figure written to {png}")
        html_targets = opts.html_targets()
        if html_targets:
            figures = [(png_name, png_bytes(plot, png_name))] if plot is not None else []
            page = render_run(RunPage(report, list(renderables), figures))
            for html_target in html_targets:
                check_target(html_target, opts.overwrite)
                files.stage(html_target, lambda path: Path(path).write_text(page, encoding="utf-8"))
                written.append(f"HTML report written to {html_target}")
        files.commit()
    if "-" in opts.json_targets():
        sys.stdout.write(text)
        sys.stdout.flush()
    if opts.show_table:
        for line in written:
            opts.console.print(line)


def emit_result(opts: OutputOptions, result: Any) -> None:
    """:func:`emit` for an :class:`attnaudit.analyses.result.Result`."""
    emit(opts, result.to_dict(), result.tables(), plot=result.plot, png_name=result.png_name)


def exit_if_cells_failed(failed: list[dict]) -> None:
    """After the partial report is written: one line per failed sweep cell (up to 5) and exit 1."""
    if not failed:
        return
    message = (
        f"{len(failed)} sweep cell(s) failed; the report holds the others and lists these under failed_cells: "
        + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:5])
    )
    error_line("error", message)
    raise typer.Exit(1)


_OPEN_BARS: dict[int, Any] = {}  # id(OutputOptions) -> its live rich Progress, while one is shown


@contextlib.contextmanager
def progress(opts: OutputOptions, description: str, total: int, unit: str = "") -> Iterator[Callable[[int], None]]:
    """A rich progress bar on a terminal; a no-op when quiet, piped, or writing JSON to stdout.
    ``unit`` names what is counted (shown after the count), e.g. "cells"."""
    interactive = opts.console.is_terminal and not opts.quiet and os.environ.get("CI") is None
    if not interactive:

        def skip(k: int = 1) -> None:
            pass

        yield skip
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    open_bar = _OPEN_BARS.get(id(opts))
    if open_bar is not None:  # a bar inside a run's bar (the gradient store's rows): a second line of it
        inner = open_bar.add_task(description, total=total)

        def advance_inner(k: int = 1) -> None:
            open_bar.advance(inner, k)

        try:
            yield advance_inner
        finally:
            open_bar.remove_task(inner)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}" + (f" {unit}" if unit else "")),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=opts.console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        _OPEN_BARS[id(opts)] = bar  # rich shows one live display at a time: inner bars join this one
        try:

            def advance(k: int = 1) -> None:
                bar.advance(task, k)

            yield advance
        finally:
            _OPEN_BARS.pop(id(opts), None)
