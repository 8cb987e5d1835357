"""Option bundles and request options: how the command line is declared.

A command's protocol options are its request's fields (:mod:`attnaudit.analyses.request`):
:func:`with_request` turns them into typer options (one flag table, defaults shown) and
hands the command a :class:`RequestOptions` that builds the request. What a request does
not hold, because it says where results go or where cells run, are bundles: dataclasses
whose fields carry their ``typer.Option`` (:class:`OutputBundle`, :class:`ExecutorOptions`),
spliced into the command's signature by :func:`bundled`::

    @app.command("kappa")
    @bundled(out=OutputBundle)
    @with_request(KappaRequest)
    def kappa_command(request: RequestOptions, out: OutputBundle) -> None: ...
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Iterator, Optional, Protocol, get_args

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from attnaudit.analyses.request import EXECUTION, OUTPUT, PANELS
from attnaudit.analyses.request import show_list
from attnaudit.cli.common import OutputOptions, cli_errors, emit_result
from attnaudit.runtime.sweep import ExecutorConfig
from attnaudit.analyses.request import FieldError, Request, fields_named

_OPTION = "typer_option"

_METAVARS = {str: "TEXT", int: "INTEGER", float: "FLOAT"}


class _Bundle(Protocol):
    """An option bundle: a dataclass whose fields carry their options, shown in its ``PANEL``."""

    PANEL: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


def _field(default: Any, annotation: Any, *decls: str, help: str, metavar: Optional[str] = None) -> Any:
    """A bundle field; its option lands in the bundle's ``PANEL`` of --help."""
    return dataclasses.field(
        default=default, metadata={_OPTION: (annotation, typer.Option(*decls, help=help, metavar=metavar))}
    )


def _path_field(flag: str, help: str) -> Any:
    """An optional ``flag PATH`` (default None)."""
    return _field(None, Optional[str], flag, metavar="PATH", help=help)


@dataclass
class OutputBundle:
    """Where results go (``--json``, ``--png``, ``--html``, ``--out-dir``), how much is printed, and ``--debug``."""

    PANEL: ClassVar[str] = OUTPUT

    json: Optional[str] = _path_field(
        "--json", help="Write the JSON report here ('-' = standard output, nothing else printed there)."
    )
    png: Optional[str] = _path_field("--png", help="Write the figure here (PNG).")
    html: Optional[str] = _path_field(
        "--html",
        help="Write a self-contained HTML report here: verdicts first, then tables, figures, the protocol and the command that reproduces the run.",
    )
    out_dir: Optional[str] = _path_field(
        "--out-dir", help="Write report.json, report.html and figures into this folder."
    )
    quiet: bool = _field(False, bool, "--quiet", "-q", help="No table and no progress bar.")
    overwrite: bool = _field(False, bool, "--overwrite", help="Allow replacing existing output files.")
    debug: bool = _field(False, bool, "--debug", help="Show the full traceback on errors.")

    def options(self):
        """The :class:`attnaudit.cli.common.OutputOptions` these flags describe."""

        return OutputOptions(**{name: value for name, value in dataclasses.asdict(self).items() if name != "debug"})


@dataclass
class ExecutorOptions:
    """Where a sweep's cells run (``--executor``, ``--jobs``, ``--ray-address``, ``--gpus-per-cell``, ``--resume``)."""

    PANEL: ClassVar[str] = EXECUTION

    executor: str = _field(
        "local",
        str,
        "--executor",
        help="local (cells in this process, or --jobs N worker processes) or ray (Ray tasks; needs attnaudit[ray]).",
    )
    jobs: int = _field(1, int, "--jobs", help="Local worker processes (or the CPUs of a Ray started for the run).")
    ray_address: Optional[str] = _field(
        None,
        Optional[str],
        "--ray-address",
        help="Join this running Ray cluster (default: start a local Ray for the run).",
    )
    gpus_per_cell: float = _field(0.0, float, "--gpus-per-cell", help="GPUs Ray reserves for each cell.")
    resume: Optional[str] = _path_field(
        "--resume",
        help="Folder that keeps every finished cell; a rerun skips the cells already there (same configuration and version).",
    )

    def config(self):
        """The :class:`attnaudit.runtime.sweep.ExecutorConfig` these flags describe (validated)."""

        return ExecutorConfig(
            kind=self.executor,
            jobs=self.jobs,
            ray_address=self.ray_address,
            gpus_per_cell=self.gpus_per_cell,
            resume_dir=self.resume,
        )


def _parameters(bundle: type[_Bundle]) -> list[inspect.Parameter]:
    params = []
    for f in dataclasses.fields(bundle):
        annotation, option = f.metadata[_OPTION]
        option = copy.copy(option)
        option.rich_help_panel = bundle.PANEL
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=Annotated[annotation, option]
            )
        )
    return params


def bundled(**bundles: type[_Bundle]) -> Callable[[Callable], Callable]:
    """Decorator: replace each named parameter of the command by the fields of its bundle class.

    The command receives one instance per bundle. Option names must not clash between
    bundles and the command's own parameters.
    """

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name not in bundles]
        spliced = list(own)
        taken = {p.name for p in own}
        fields_of: dict[str, list[str]] = {}
        for name, bundle in bundles.items():
            extra = _parameters(bundle)
            clash = taken & {p.name for p in extra}
            if clash:
                raise TypeError(f"option(s) {sorted(clash)} of bundle {name!r} clash with {fn.__name__}'s own")
            taken |= {p.name for p in extra}
            fields_of[name] = [p.name for p in extra]
            spliced.extend(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra)
        spliced = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in spliced]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for name, bundle in bundles.items():
                kwargs[name] = bundle(**{field: kwargs.pop(field) for field in fields_of[name]})
            return fn(**kwargs)

        command.__signature__ = signature.replace(parameters=spliced)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in spliced}
        return command

    return decorate


class ManualCommand(TyperCommand):
    """A command whose ``--help`` reads like a manual (``@app.command(..., cls=ManualCommand)``).

    Options are listed in the panels of :data:`PANELS`, in that order (each option names its
    panel with ``rich_help_panel``); an option that takes a value shows a plain metavar (TEXT,
    INTEGER, FLOAT, or the PATH it declares) and a flag shows none, where typer would print
    ``<str>``/``<bool>``; help texts are shown as written (``attnaudit[hf]`` is not Rich markup).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rank: dict[str | None, int] = {name: i for i, name in enumerate(PANELS)}
        # stable: arguments keep their order, options keep theirs within a panel
        self.params.sort(
            key=lambda p: rank.get(getattr(p, "rich_help_panel", None), -1) if isinstance(p, TyperOption) else -1
        )
        for param in self.params:
            if isinstance(param, (TyperOption, TyperArgument)) and param.help:
                from rich.markup import escape

                param.help = escape(param.help)
            _plain_metavar(param)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            _plain_metavar(option)
        return option


class ManualGroup(TyperGroup):
    """The root ``attnaudit --help``: the same plain metavars as :class:`ManualCommand`
    (applied when help is shown, so the completion options typer adds later are covered)."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)
        for param in params:
            _plain_metavar(param)
        return params

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            _plain_metavar(option)
        return option


def _plain_metavar(param: Any) -> None:
    """TEXT/INTEGER/FLOAT for an option that takes a value, nothing for a flag; a declared metavar wins.
    A positional argument shows its metavar (PATH, PATH... when it takes several) instead of
    typer's ``<str>`` / ``<list[str]>``."""
    if isinstance(param, TyperArgument):
        label = (param.metavar or "PATH") + ("..." if param.nargs != 1 else "")
        usage = label if param.required else f"[{label}]"

        def display_type_rich(ctx: Any) -> str:
            return label

        def usage_display_name() -> str:  # the usage line as click writes it (AUDIT.yaml, [RUN.json]...)
            return usage

        # per instance: typer has no hook (and typer's usage would read {AUDIT.yaml})
        param.display_type_rich = display_type_rich  # type: ignore[method-assign]
        param._usage_display_name = usage_display_name  # type: ignore[method-assign]
        return
    if not isinstance(param, TyperOption) or param.metavar is not None:
        return
    if param.is_flag:
        param.metavar = ""
        return
    annotation = param.type_descriptor.annotation
    if param.type_descriptor.is_list:
        annotation = get_args(annotation)[0]
    if annotation in _METAVARS:
        param.metavar = _METAVARS[annotation]


# --------------------------------------------------------------------------- requests as options


def request_parameters(request_type: type[Request]) -> list[inspect.Parameter]:
    """The typer parameters of a request class's option fields (the one flag table).

    A field with a parser (lists, free text) is text on the command line; a bool field is a
    flag (with its ``--no-...`` form when it has one); a ``multiple`` field is repeatable.
    Every default is shown in ``--help``.
    """
    params = []
    defaults = {f.name: f.default for f in dataclasses.fields(request_type)}
    for name, opt in request_type.options().items():
        default = defaults[name]
        decls = list(opt.flags)
        if opt.kind is bool and opt.parse is None:
            annotation: Any = bool
            if opt.negative:
                decls = [f"{opt.flag}/{opt.negative}", *opt.flags[1:]]
        elif opt.multiple:
            annotation = Optional[list[opt.kind]]  # type: ignore[name-defined]  # built at run time
        elif opt.parse is not None:
            annotation = Optional[str]
            if isinstance(default, tuple):
                default = show_list(default)
        else:
            annotation = Optional[opt.kind] if default is None else opt.kind
        option = typer.Option(
            *decls,
            help=opt.help,
            rich_help_panel=opt.panel,
            metavar=opt.metavar,
            show_default=default is not None and default is not False,
        )
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, option]
            )
        )
        for i, old in enumerate(opt.deprecated):  # hidden: accepted, warned about, never shown
            hidden = typer.Option(
                old,
                hidden=True,
                help=f"Deprecated spelling of {opt.flag}.",
                rich_help_panel=opt.panel,
                metavar=opt.metavar,
            )
            old_annotation = bool if annotation is bool else (annotation if opt.multiple else Optional[str])
            params.append(
                inspect.Parameter(
                    f"{name}{_DEPRECATED}{i}",
                    inspect.Parameter.KEYWORD_ONLY,
                    default=False if annotation is bool else None,
                    annotation=Annotated[old_annotation, hidden],
                )
            )
    return params


_DEPRECATED = "__deprecated_"


@dataclass
class RequestOptions:
    """The parsed options of a command, ready to become its request (:meth:`build`)."""

    request_type: type[Request]
    values: dict

    def build(self, **objects: Any) -> Any:
        """The request; an error about a field names the flag the user typed."""

        defaults = {f.name: f.default for f in dataclasses.fields(self.request_type)}
        given = {k: (defaults[k] if v in ((), []) else v) for k, v in self.values.items() if _DEPRECATED not in k}
        for key, value in self.values.items():
            if _DEPRECATED not in key or value in (None, False, (), []):
                continue
            name, _, index = key.partition(_DEPRECATED)
            opt = self.request_type.options()[name]
            import sys

            print(
                f"warning: {opt.deprecated[int(index)]} is deprecated; use {opt.flag} (the old spelling goes in the "
                "next release)",
                file=sys.stderr,
            )
            if given.get(name) == defaults[name]:
                given[name] = value
        try:
            return self.request_type.from_options(given, **objects)
        except FieldError as exc:
            raise fields_named(exc, self.request_type) from None


def with_request(request_type: type[Request], name: str = "request") -> Callable[[Callable], Callable]:
    """Decorator: the command's options are ``request_type``'s option fields; the command
    receives them as one :class:`RequestOptions` (parameter ``name``) and builds the request
    inside its error handling."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for n, p in signature.parameters.items() if n != name]
        extra = request_parameters(request_type)
        clash = {p.name for p in own} & {p.name for p in extra}
        if clash:
            raise TypeError(f"option(s) {sorted(clash)} of {request_type.__name__} clash with {fn.__name__}'s own")
        fields = [p.name for p in extra]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            kwargs[name] = RequestOptions(request_type, {f: kwargs.pop(f) for f in fields})
            return fn(**kwargs)

        spliced = own + extra
        command.__signature__ = signature.replace(parameters=spliced)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in spliced}
        command.request_type = request_type  # type: ignore[attr-defined]
        command.request_fields = fields  # type: ignore[attr-defined]
        return command

    return decorate


def request_command(
    app: typer.Typer, request_type: type[Request], epilog: str, *, help: str | None = None, execution: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` becomes the command ``request_type.COMMAND`` of ``app`` (a
    :class:`ManualCommand`; ``help``: its help, default ``fn``'s docstring), whose options are
    the request's fields (:func:`with_request`: parameter ``request``), the :class:`OutputBundle`
    (``out``) and, with ``execution``, the :class:`ExecutorOptions` (``execution``)."""
    bundles: dict[str, type[_Bundle]] = {"out": OutputBundle}
    if execution:
        bundles["execution"] = ExecutorOptions

    def decorate(fn: Callable) -> Callable:
        command = bundled(**bundles)(with_request(request_type)(fn))
        return app.command(request_type.COMMAND, help=help, cls=ManualCommand, epilog=epilog)(command)

    return decorate


@contextlib.contextmanager
def built(request: RequestOptions, out: OutputBundle, **objects: Any) -> Iterator[tuple[Any, OutputOptions]]:
    """The command's request (built; ``objects`` as :meth:`RequestOptions.build` takes) and its
    output options, inside the command's error handling (:func:`attnaudit.cli.common.cli_errors`)."""
    with cli_errors(out.debug, request.request_type):
        yield request.build(**objects), out.options()


def emit_run(
    request: RequestOptions, out: OutputBundle, run: Callable[..., Any], png_name: Callable[[Any], str]
) -> None:
    """The whole of a command that builds its request, vets its outputs (the figure's default
    name: ``png_name(request)``) before any compute, runs the request and writes the result."""
    with built(request, out) as (req, opts):
        opts.check_writable((png_name(req),))
        emit_result(opts, run(req, progress=opts.progress_bar))
