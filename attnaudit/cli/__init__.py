"""The `attnaudit` command line: a thin Typer layer; each command lives in its own module here."""

from __future__ import annotations

import contextlib
import signal
import sys

import typer

from attnaudit import __version__
from attnaudit.cli.common import INTERRUPTED, error_line
from attnaudit.cli import alignment, audit, claims, kappa, landscape, malleability, ntk_distance, report, train
from attnaudit.cli.options import RequestOptions
from attnaudit.errors import AuditError
from attnaudit.runtime.threads import apply_threads, choose_threads

from attnaudit.cli.options import ManualGroup  # noqa: E402 - the command modules above import it too

app = typer.Typer(
    name="attnaudit",
    cls=ManualGroup,
    help="Audit attention models through the neural tangent kernel (NTK) lens.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

#: Options of the whole program that may also be written after the command name
#: (``attnaudit kappa --threads 1``); they are moved in front of it before parsing.
GLOBAL_VALUE_OPTIONS = ("--threads",)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    threads: int = typer.Option(
        0,
        "--threads",
        help="CPU threads for torch. 0 = auto (idle cores, see docs/performance.md#threads; "
        "ATTNAUDIT_THREADS=N overrides it); N pins N threads.",
    ),
) -> None:
    """Audit attention models through the neural tangent kernel (NTK) lens."""
    if threads < 0:
        error_line("error", "--threads must be >= 0 (0 = auto: the idle cores)")
        raise typer.Exit(2)

    try:
        apply_threads(choose_threads(threads or None))
    except AuditError as exc:
        error_line("error", str(exc))
        raise typer.Exit(exc.exit_code) from None


for module in (kappa, ntk_distance, malleability, landscape, train, audit, claims, report):
    module.register(app)
alignment.register(app)


def _exit_quietly(code: int) -> None:
    """Flush and exit; SIGINT is ignored from here on so a late Ctrl-C cannot break interpreter shutdown."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread / no signal support
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.exit(code)


def _hoist_global_options(args: list[str]) -> list[str]:
    """Move global options written after the command name in front of it, so
    ``attnaudit kappa --threads 1`` means ``attnaudit --threads 1 kappa``. Arguments after
    ``--`` are left alone; a global option without its value stays where it is (the parser
    then reports it)."""
    command_at = next(
        (
            i
            for i, a in enumerate(args)
            if not a.startswith("-") and (i == 0 or args[i - 1] not in GLOBAL_VALUE_OPTIONS)
        ),
        None,
    )
    if command_at is None:
        return args
    head, rest, moved = args[: command_at + 1], [], []
    tail = args[command_at + 1 :]
    i = 0
    while i < len(tail):
        a = tail[i]
        if a == "--":
            rest.extend(tail[i:])
            break
        name = a.split("=", 1)[0]
        if name in GLOBAL_VALUE_OPTIONS and ("=" in a or i + 1 < len(tail)):
            take = 1 if "=" in a else 2
            moved.extend(tail[i : i + take])
            i += take
            continue
        rest.append(a)
        i += 1
    return head[:command_at] + moved + head[command_at:] + rest


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``attnaudit`` and ``python -m attnaudit``).

    Runs the Typer app without click's standalone handling so that usage errors become
    one ``error:`` line (exit 2) like every other bad input, and Ctrl-C anywhere exits 130.
    """
    args = _hoist_global_options(list(sys.argv[1:] if argv is None else argv))
    try:
        result = app(args=args, prog_name="attnaudit", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        error_line("interrupted", INTERRUPTED)
        code = 130
    except Exception as exc:  # click's exceptions, matched by shape (click is vendored by newer typer)
        if exc.__class__.__name__ == "Abort":
            error_line("interrupted", INTERRUPTED)
            code = 130
        elif exc.__class__.__name__ == "NoArgsIsHelpError" or not hasattr(exc, "format_message"):
            if not hasattr(exc, "show"):
                raise
            exc.show()
            code = getattr(exc, "exit_code", 2)
        else:
            ctx = getattr(exc, "ctx", None)
            where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            error_line("error", f"{exc.format_message()}{where}")
            code = getattr(exc, "exit_code", 2)
    _exit_quietly(code)


def request_of(argv: list[str]):
    """The request the command line ``attnaudit <argv>`` builds, parsed exactly as the shell's
    (nothing runs): for the argv -> request -> argv round trip (tests/analyses/test_requests.py)."""

    name, *rest = argv
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    request_type = command.callback.request_type
    ctx = command.make_context(f"attnaudit {name}", list(rest))
    values = {field: ctx.params[field] for field in command.callback.request_fields}
    return RequestOptions(request_type, values).build()
