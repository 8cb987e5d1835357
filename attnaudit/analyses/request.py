"""Requests and results: what an analysis is asked to do, and what it answers.

Every command is one frozen request dataclass, one ``run(request, *, progress=None,
executor=None)`` and one result. The request holds the data, the model and the protocol;
its defaults, presets and validation live on the class, so the Python API, the command
line, ``attnaudit audit`` and ``attnaudit claims`` run the same protocol under the same
name. Each protocol field carries its :class:`Option` (flags, help text, help panel), which
makes the request class the one table from flag to field:

* the CLI builds its options from those fields and a request from the parsed options;
* an audit file's ``options:`` keys are the same flags (``top-k``, ``--top-k`` or ``top_k``);
* :meth:`Request.to_argv` derives the command line that reproduces a request, so
  argv -> request -> argv round-trips (tests/analyses/test_requests.py).

Errors about a field are :class:`FieldError`: the message names the field as the caller
spelled it (``seeds`` from Python, ``--seeds`` on the command line, ``checks[0].options.seeds``
in an audit file).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import numbers
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from attnaudit.core.precision import check_precision
from attnaudit.errors import AuditError, FieldError, check_seed, clip_text, field_check, literal

# The panels of every command's --help, in this order (docs/cli.md says what goes where).
DATA = "Data"
MODEL = "Model / checkpoint"
PROTOCOL = "Protocol"
ANALYSIS = "Attack / analysis"
OUTPUT = "Output"
EXECUTION = "Execution"
PANELS = (DATA, MODEL, PROTOCOL, ANALYSIS, OUTPUT, EXECUTION)

_OPTION = "attnaudit_option"
_DEFINED: dict[str, type] = {}  # command -> the first request class defined for it (audit, claims register here)
R = TypeVar("R", bound="Request")


@dataclass(frozen=True)
class Option:
    """How a request field appears on the command line and in an audit file.

    ``kind`` is the value's type there: ``str``, ``int``, ``float`` or ``bool`` (a flag, with
    ``negative`` as its ``--no-...`` form when the default is true); ``parse`` turns a value
    from the command line (text) or from YAML (any scalar or list) into the field's value,
    ``show`` turns the field's value back into command-line text.
    """

    flags: tuple[str, ...]
    help: str
    panel: str
    kind: type = str
    negative: str | None = None
    multiple: bool = False
    metavar: str | None = None
    parse: Callable[[Any, str], Any] | None = None
    show: Callable[[Any], str] | None = None
    deprecated: tuple[
        str, ...
    ] = ()  # older spellings accepted with a warning during a rename (hidden from --help); the release that removes them is named in CHANGELOG.md

    @property
    def flag(self) -> str:
        return self.flags[0]


def option(
    default: Any,
    *flags: str,
    help: str,
    panel: str,
    kind: type | None = None,
    negative: str | None = None,
    multiple: bool = False,
    metavar: str | None = None,
    parse: Callable[[Any, str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    deprecated: tuple[str, ...] = (),
) -> Any:
    """A request field with its command-line option (see :class:`Option`)."""
    if kind is None:
        kind = type(default) if isinstance(default, (bool, int, float)) else str
    meta = Option(
        flags=tuple(flags),
        help=help,
        panel=panel,
        kind=kind,
        negative=negative,
        multiple=multiple,
        metavar=metavar,
        parse=parse,
        show=show,
        deprecated=tuple(deprecated),
    )
    if isinstance(default, (list, dict, set)):
        raise TypeError("request defaults are immutable (use a tuple)")
    return field(default=default, metadata={_OPTION: meta})


_KEEP: Any = object()


def redefault(owner: type, name: str, default: Any = _KEEP, *, help: str | None = None) -> Any:
    """The option field ``name`` of ``owner`` (a request or a part of one: its flags, help and
    panel) with another default and/or help text, for a request that inherits it."""
    inherited = {f.name: f for f in dataclasses.fields(owner)}[name]
    metadata: Mapping[str, Any] = inherited.metadata
    if help is not None:
        metadata = {_OPTION: dataclasses.replace(metadata[_OPTION], help=help)}
    return field(default=inherited.default if default is _KEEP else default, metadata=metadata)


def internal(default: Any = None) -> Any:
    """A request field with no command-line option (a loaded object from Python, say)."""
    return field(default=default, compare=False, metadata={})


# --------------------------------------------------------------------------- value parsers


def _scalar(value: Any, kind: type, name: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise FieldError(name, "{name} takes true or false, got " + clip_text(repr(value), 60))
    if isinstance(value, bool):
        raise FieldError(name, "{name} takes a value, not true/false")
    if kind is str:
        if isinstance(value, (dict, list, tuple)):
            raise FieldError(name, "{name} takes one value, got " + clip_text(repr(value), 60))
        return str(value)
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        return float(value)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise FieldError(name, "{name}: " + f"{clip_text(repr(value), 60)} is not {what}") from None


def list_of(kind: type) -> Callable[[Any, str], tuple]:
    """Parser for a list field: ``"16,64,256"`` (command line) or ``[16, 64, 256]`` / ``16`` (YAML)."""

    def parse(value: Any, name: str) -> tuple:
        if isinstance(value, (list, tuple)):
            items = list(value)
        elif isinstance(value, str):
            items = [t.strip() for t in value.split(",") if t.strip()]
            if not items:
                raise FieldError(name, "{name} is empty; give a comma-separated list such as {name} 1,2,3")
        else:
            items = [value]
        out = []
        for item in items:
            try:
                out.append(_scalar(item, kind, name))
            except FieldError:
                what = {int: "an integer", float: "a number"}.get(kind, "a value")
                raise FieldError(
                    name,
                    "{name}: " + f"{clip_text(repr(item), 60)} is not {what}; "
                    "give a comma-separated list such as {name} 1,2,3",
                ) from None
        return tuple(out)

    return parse


def show_list(values: Any) -> str:
    """``(16, 64)`` -> ``"16,64"`` (floats as repr, so they parse back exactly)."""
    return ",".join(_show_scalar(v) for v in values)


def _show_scalar(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def normalise_key(key: Any) -> str:
    """An option key as written (eps, top-k, top_k, --top-k) -> its python spelling."""
    return str(key).strip().lstrip("-").replace("-", "_")


def hint(word: str, choices) -> str:
    """'; did you mean 'x'?' for a close match, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Request:
    """Base of every analysis request: option table, parsing, validation, reproduction."""

    COMMAND: ClassVar[str] = ""
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.COMMAND:
            _DEFINED.setdefault(cls.COMMAND, cls)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse values the protocol cannot run (raise :class:`FieldError`)."""

    # ---- the option table
    @classmethod
    def options(cls) -> dict[str, Option]:
        """field name -> its :class:`Option`, in declaration order."""
        return {f.name: f.metadata[_OPTION] for f in dataclasses.fields(cls) if _OPTION in f.metadata}

    @classmethod
    def flag_of(cls, name: str) -> str:
        """The flag of field ``name`` (``top_k`` -> ``--top-k``)."""
        opt = cls.options().get(name)
        return opt.flag if opt is not None else f"--{name.replace('_', '-')}"

    @classmethod
    def field_of(cls, key: Any) -> str | None:
        """The field a key names: field name, any flag (with or without ``--``), or None."""
        wanted = normalise_key(key)
        for name, opt in cls.options().items():
            spellings = {name, *(normalise_key(f) for f in (*opt.flags, *opt.deprecated))}
            if opt.negative:
                spellings.add(normalise_key(opt.negative))
            if wanted in spellings:
                return name
        return None

    @classmethod
    def parse_value(cls, name: str, value: Any) -> Any:
        """A value from the command line or YAML -> the field's value (``None`` stays None)."""
        opt = cls.options()[name]
        if value is None:
            return None
        if opt.parse is not None:
            return opt.parse(value, name)
        if opt.multiple:
            values = value if isinstance(value, (list, tuple)) else [value]
            return tuple(_scalar(v, opt.kind, name) for v in values)
        return _scalar(value, opt.kind, name)

    @classmethod
    def from_options(cls: type[R], options: Mapping[str, Any], **objects: Any) -> R:
        """A request from option values keyed by field name or flag; ``objects`` fill fields
        without options (loaded data or models). Unknown keys are refused with a hint."""
        values: dict[str, Any] = {}
        for key, value in options.items():
            name = cls.field_of(key)
            if name is None:
                known = [n.replace("_", "-") for n in cls.options()]
                raise AuditError(
                    f"{cls.COMMAND} has no option --{normalise_key(key).replace('_', '-')}"
                    f"{hint(normalise_key(key).replace('_', '-'), known)}"
                )
            negated = cls.options()[name].negative
            if negated and normalise_key(key) == normalise_key(negated) and isinstance(value, bool):
                value = not value
            values[name] = cls.parse_value(name, value)
        return cls(**values, **objects)

    @classmethod
    def from_argv(cls: type[R], argv: list[str], **objects: Any) -> R:
        """A request from command-line options (``--flag value``, ``--flag=value``, ``--flag``
        for a switch, ``--no-...``, a repeatable option repeated): the command line without
        the CLI, for audit files and claims that state runs as command lines."""
        table: dict[str, tuple[str, bool]] = {}
        for name, opt in cls.options().items():
            table.update({flag: (name, True) for flag in (*opt.flags, *opt.deprecated)})
            if opt.negative:
                table[opt.negative] = (name, False)
        values: dict[str, Any] = {}
        i = 0
        while i < len(argv):
            flag, eq, text = str(argv[i]).partition("=")
            if flag not in table:
                known = sorted(table)
                raise AuditError(f"{cls.COMMAND} has no option {clip_text(flag, 60)}{hint(flag, known)}")
            name, positive = table[flag]
            opt = cls.options()[name]
            i += 1
            if opt.kind is bool and opt.parse is None:
                values[name] = positive
                continue
            if not eq:
                if i >= len(argv):
                    raise AuditError(f"{flag} needs a value")
                text = str(argv[i])
                i += 1
            if opt.multiple:
                values.setdefault(name, []).append(text)
            else:
                values[name] = text
        try:
            return cls.from_options(values, **objects)
        except FieldError as exc:  # the caller wrote flags: the error names the flag
            raise fields_named(exc, cls) from None

    def resolve(self) -> Any:
        """The one configuration the analysis runs from: presets filled, derived settings (a
        projection, attack settings) made, everything validated, once. ``run`` calls it once and
        passes the result down; an analysis without derived settings runs from the request itself."""
        return self

    def built_once(self, build: Callable[[], Any]) -> Any:
        """``build()`` the first time, the same object after: how a frozen request keeps the
        configuration :meth:`resolve` built at construction (a replaced copy builds its own)."""
        if "_built" not in self.__dict__:
            object.__setattr__(self, "_built", build())
        return self.__dict__["_built"]

    def check(self) -> None:
        """Check what can be checked before any computation (an audit's dry run): the
        fields (already checked at construction), then model files and data, read but not
        analysed (the data and model mix-ins extend this)."""

    # ---- reproduction
    def to_argv(self) -> list[str]:
        """The options that reproduce this request: every field that differs from its default,
        in declaration order. A request holding an in-memory object has none."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _OPTION not in f.metadata:
                if value is not None and value is not defaults[f.name]:
                    raise AuditError(
                        f"this {self.COMMAND} request holds an in-memory {f.name} "
                        f"({type(value).__name__}); no command line reproduces it"
                    )
                continue
            if value == defaults[f.name]:
                continue
            opt: Option = f.metadata[_OPTION]
            if opt.kind is bool and opt.parse is None:
                if value:
                    argv.append(opt.flag)
                elif opt.negative:
                    argv.append(opt.negative)
                continue
            if opt.multiple:
                for item in value:
                    argv.extend([opt.flag, _show_scalar(item)])
                continue
            text = (
                opt.show(value) if opt.show else (show_list(value) if isinstance(value, tuple) else _show_scalar(value))
            )
            argv.extend([opt.flag, text])
        return argv

    def command_line(self) -> str:
        """The shell command that reproduces this request."""
        return shlex.join(["attnaudit", self.COMMAND, *self.to_argv()])

    def to_dict(self) -> dict[str, Any]:
        """The request's option fields (JSON-able: tuples as lists)."""
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in self.options()}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """Inverse of :meth:`to_dict`."""
        return cls.from_options(dict(data))

    def replace(self: R, **changes: Any) -> R:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def fields_named(error: FieldError, request_type: type[Request]) -> AuditError:
    """A :class:`FieldError` as the command line shows it: naming the field's flag."""
    return error.named(request_type.flag_of(error.field))


def check_seeds(seed: Any, count: Any, *, rule: str = ">= 1", integer: bool = False) -> None:
    """Refuse a seed count (field ``seeds``) below 1, or not an integer when ``integer`` ("{name}
    must be ``rule``"), and a base ``seed`` whose ``count`` consecutive seeds leave the valid range."""
    if (integer and not (isinstance(count, numbers.Integral) and not isinstance(count, bool))) or count < 1:
        raise FieldError("seeds", "{name} must be " + rule + ", got " + literal(count))
    field_check("seed", check_seed, seed, count=count)


def unknown_preset(value: Any, presets: Iterable[str]) -> FieldError:
    """The error for a ``preset`` that names none of ``presets``."""
    return FieldError("preset", "unknown {name} " + literal(repr(value)) + f"; use {' or '.join(presets)}")


def unset(request: Any, values: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The entries of ``values`` (of ``names`` only, when given) whose field of ``request`` is
    None: what a preset fills (an explicit value beats the preset)."""
    return {name: values[name] for name in (values if names is None else names) if getattr(request, name) is None}


class Preset:
    """Mixed into a request whose ``preset`` field names one of its ``PRESETS`` (sizes and
    choices that fill the fields left None; an explicit value beats the preset)."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]]
    preset: Any

    @property
    def preset_key(self) -> str:
        """The preset as given, stripped and in lower case."""
        return str(self.preset).strip().lower()

    def preset_values(self) -> dict:
        """The values of :attr:`preset` (an unknown preset was refused at construction)."""
        return dict(self.PRESETS[self.preset_key])

    def check_preset(self, key: str | None = None) -> None:
        """Refuse a preset (``key``: as the request reads it; default :attr:`preset_key`) that names none of ``PRESETS``."""
        if (self.preset_key if key is None else key) not in self.PRESETS:
            raise unknown_preset(self.preset, self.PRESETS)


# --------------------------------------------------------------------------- shared options
# Declared once and mixed into the requests that take them; a request that needs another
# default or help text redeclares the field with :func:`redefault`.


@dataclass(frozen=True)
class SeedField:
    """``seed``: the base random seed, recorded in every report (``--seed``)."""

    seed: int = option(0, "--seed", panel=PROTOCOL, help="Base random seed (recorded in the report).")


@dataclass(frozen=True)
class DeviceField:
    """``device``: where the computation runs (``--device``)."""

    device: str = option("auto", "--device", panel=EXECUTION, help="auto, cpu, cuda or cuda:<i>.")


@dataclass(frozen=True)
class PrecisionField:
    """``precision``: the dtype of the analysis' heavy computations (``--precision``;
    :mod:`attnaudit.core.precision`), checked against float64 on a subsample when lower."""

    precision: str = option(
        "auto",
        "--precision",
        panel=EXECUTION,
        help="Dtype of the heavy computations (gradients, projections, factor fits, Hessian-vector products, "
        "Jacobians): float64, float32, bfloat16 or auto (float64 up to 1,000,000 parameters, float32 above). "
        "Sums, small eigendecompositions and statistics stay float64; a lower precision is checked against "
        "float64 on a subsample (precision_check in the report).",
    )

    def check_precision_field(self) -> None:
        check_precision(self.precision)


@dataclass(frozen=True)
class LossField:
    """``loss``: the training loss of the models a command trains (``--loss``: mse or ce)."""

    loss: str | None = option(None, "--loss", panel=PROTOCOL, help="mse or ce.")


@dataclass(frozen=True)
class BatchSize:
    """``batch_size``: rows per step of a mini-batch optimizer (``--batch-size``; None: the command's default)."""

    batch_size: int | None = option(
        None, "--batch-size", panel=PROTOCOL, kind=int, help="Rows per step of sgd/adam (default: full batch)."
    )


@dataclass(frozen=True)
class TrainingRecipe(LossField, BatchSize):
    """How a command trains its built-in models: ``optimizer``, ``steps``, ``resample_data``, ``batch_size``
    and ``loss`` (the defaults None come from the command's preset)."""

    optimizer: str | None = option(
        None,
        "--optimizer",
        panel=PROTOCOL,
        help="How built-in models are trained: gd (full batch, default), sgd or adam.",
    )
    steps: int | None = option(
        None, "--steps", panel=PROTOCOL, kind=int, help="Optimizer steps (default from --preset)."
    )
    resample_data: bool = option(
        False,
        "--resample-data",
        panel=PROTOCOL,
        negative="--fixed-data",
        help="Each seed draws its own training rows (the rows a run with that --seed uses), so intervals include "
        "the choice of training rows.",
    )


@dataclass(frozen=True)
class PresetField:
    """``preset``: the named sizes and choices that fill the fields left None (``--preset``)."""

    preset: str | None = option(
        "quick",
        "--preset",
        panel=PROTOCOL,
        help="quick (default) or paper (MNIST-size). Explicit options override it.",
    )


@dataclass(frozen=True)
class BuiltinModels:
    """``models``: the built-in 2-layer nets a command trains and compares (``--models``)."""

    models: tuple[str, ...] | None = option(
        None,
        "--models",
        panel=PROTOCOL,
        parse=list_of(str),
        help="Models to train and compare: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).",
    )


@dataclass(frozen=True)
class TrainRows:
    """``n_train``: how many training rows (``--n-train``; None: the command's default)."""

    n_train: int | None = option(None, "--n-train", panel=PROTOCOL, kind=int, help="Training rows.")


@dataclass(frozen=True)
class SplitRows(TrainRows):
    """``n_train`` and ``n_test``: the training and held-out rows (``--n-train``, ``--n-test``)."""

    n_test: int | None = option(None, "--n-test", panel=PROTOCOL, kind=int, help="Held-out rows.")


@dataclass(frozen=True)
class LearningRate:
    """``lr``: the learning rate of the models a command trains (``--lr``; None: the command's rule)."""

    lr: float | None = option(None, "--lr", panel=PROTOCOL, kind=float, help="Learning rate.")


@dataclass(frozen=True)
class Epochs:
    """``epochs``: passes over the training rows of a mini-batch optimizer (``--epochs``)."""

    epochs: int | None = option(None, "--epochs", panel=PROTOCOL, kind=int, help="Passes over the training rows.")


@dataclass(frozen=True)
class SeedCount:
    """``seeds``: how many consecutive seeds (``seed``, ``seed + 1``, ...) a command repeats over (``--seeds``)."""

    seeds: int | None = option(
        None, "--seeds", panel=PROTOCOL, kind=int, help="Number of seeds: seed, seed+1, ... (default from --preset)."
    )


@dataclass(frozen=True)
class HiddenWidth:
    """``width``: the hidden width m of the built-in 2-layer nets (``--width``; None: the preset's)."""

    width: int | None = option(
        None, "--width", panel=PROTOCOL, kind=int, help="Hidden width m (default from --preset)."
    )


@dataclass(frozen=True)
class LrFraction:
    """``lr_fraction``: the share of gradient descent's stable step 2n/lambda_max used when no ``lr`` is given."""

    lr_fraction: float | None = option(
        None,
        "--lr-fraction",
        panel=PROTOCOL,
        kind=float,
        help="Fraction of the stable step 2n/lambda_max used when --lr is not given.",
    )


@dataclass(frozen=True)
class TrainingDtype:
    """``dtype``: the floating-point type the models are trained in (``--dtype``: float32 or float64)."""

    dtype: str | None = option(None, "--dtype", panel=PROTOCOL, help="Training dtype: float32 or float64.")


@dataclass(frozen=True)
class BuiltinNets(TrainingRecipe, PresetField, BuiltinModels, SeedCount):
    """What a command that trains the built-in 2-layer nets takes: which ``models``, the ``preset``
    filling the sizes left None, the number of ``seeds`` and the :class:`TrainingRecipe`."""


# --------------------------------------------------------------------------- the commands

# command -> (module, request class); the module holds ``run``
COMMANDS: dict[str, tuple[str, str]] = {
    "kappa": ("attnaudit.analyses.kappa.run", "KappaRequest"),
    "ntk-distance": ("attnaudit.analyses.ntk_distance.run", "NtkDistanceRequest"),
    "malleability": ("attnaudit.analyses.malleability.run", "MalleabilityRequest"),
    "landscape": ("attnaudit.analyses.landscape.run", "LandscapeRequest"),
    "alignment": ("attnaudit.analyses.alignment.run", "AlignmentRequest"),
    "train": ("attnaudit.analyses.training.run", "TrainRequest"),
}


def request_type(command: str) -> type[Request]:
    """The request class of ``command`` (e.g. ``"kappa"`` -> KappaRequest)."""
    if command not in COMMANDS:
        raise AuditError(f"no analysis named {command!r}; choose from {', '.join(COMMANDS)}")
    module, name = COMMANDS[command]
    return getattr(importlib.import_module(module), name)


def request_from_report(report: dict) -> Request | None:
    """The request a report records (None for reports written before requests existed)."""
    recorded = report.get("request")
    if not isinstance(recorded, dict):
        return None
    command = recorded.get("command")
    if command in COMMANDS:
        cls = request_type(command)
    elif command in _DEFINED:
        cls = _DEFINED[command]
    else:
        return None
    return cls.from_dict(recorded.get("options") or {})
