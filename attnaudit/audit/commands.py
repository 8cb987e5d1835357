"""The bridge from an audit check to the request it runs: option names and argument lists.

A check's options are the command's own options (without ``--``): the fields of the
command's request (:mod:`attnaudit.analyses.request`), spelled as field names or flags.
They become the argument list that reproduces the run (shown on every row) and the request
the library runs (:func:`attnaudit.analyses.registry.run_argv`): no command line is parsed
by the CLI and nothing runs in-process through it.
"""

from __future__ import annotations

from typing import Any

from attnaudit.analyses.registry import request_type
from attnaudit.analyses.request import Option, hint, normalise_key, show_list
from attnaudit.errors import AuditError

ANALYSES = ("kappa", "ntk-distance", "malleability", "landscape")
DATA_OPTIONS = (
    "dataset",
    "data",
    "data_dir",
    "split",
    "classes",
    "preprocess",
    "download",
    "text_field",
    "label_field",
    "tokenizer",
    "max_length",
)
OUTPUT_OPTIONS = ("json", "png", "out_dir", "quiet", "overwrite", "debug")
MODEL_OPTIONS = ("checkpoint", "factory", "weights", "trust_pickle", "inputs")
# options a check may not set, and why
REFUSED = {
    **{name: "the audit writes one combined report (its --json / --junit)" for name in OUTPUT_OPTIONS},
    **{name: "give the model in the file's model: section" for name in MODEL_OPTIONS},
    "max_flip_rate": "a check states its limit with max: (and stat: ci_high for the interval's upper end)",
    "out_path": "the audit places the trained model itself (model.save keeps a copy)",
}

normalise = normalise_key


def option_params(name: str) -> dict[str, Option]:
    """python name -> :class:`Option` of the command's request fields."""
    return request_type(name).options()


def field_name(command: str, key: Any) -> str | None:
    """The request field an option key names (field name or flag, with or without ``--``)."""
    return request_type(command).field_of(key)


def to_values(command: str, options: dict[str, Any], where: str) -> dict[str, Any]:
    """field name -> the value a command line carries for ``options`` of ``command``: text, a list
    of texts for a repeatable option, True/False for a switch (what
    :meth:`~attnaudit.analyses.request.Request.from_argv` reads from :func:`argv_of` of it, so
    ``Request.from_options`` of these values is the request of that command line). ``where`` is
    the key path for errors."""
    params = option_params(command)
    values: dict[str, Any] = {}
    for key, value in options.items():
        name = field_name(command, key)
        if name is None:
            names = [n.replace("_", "-") for n in params if n not in REFUSED]
            shown = normalise(key).replace("_", "-")
            raise AuditError(f"{where}.{shown}: {command} has no option --{shown}{hint(shown, names)}")
        if value is None:
            continue
        opt = params[name]
        if opt.kind is bool and opt.parse is None:
            if not isinstance(value, bool):
                raise AuditError(f"{where}.{key}: expected true or false (the flag {opt.flag}), got {value!r}")
            if value or opt.negative:
                values[name] = value
            continue
        items = value if isinstance(value, list) and opt.multiple else [value]
        texts = []
        for item in items:
            if isinstance(item, dict) or (isinstance(item, list) and any(isinstance(v, (dict, list)) for v in item)):
                raise AuditError(f"{where}.{key}: expected a value or a list of values for {opt.flag}, got a mapping")
            if isinstance(item, bool):
                raise AuditError(f"{where}.{key}: {opt.flag} takes a value, not true/false")
            texts.append(show_list(item) if isinstance(item, (list, tuple)) else _text(item))
        values[name] = [*values.get(name, []), *texts] if opt.multiple else texts[-1]
    return values


def argv_of(command: str, values: dict[str, Any]) -> list[str]:
    """The command line of :func:`to_values`' ``values``."""
    params = option_params(command)
    args: list[str] = []
    for name, value in values.items():
        opt = params[name]
        if isinstance(value, bool):
            args.append(opt.flag if value else str(opt.negative))
        else:
            for text in value if isinstance(value, list) else [value]:
                args.extend([opt.flag, text])
    return args


def to_args(command: str, options: dict[str, Any], where: str) -> list[str]:
    """The argument list for ``options`` of ``command``; ``where`` is the key path for errors."""
    return argv_of(command, to_values(command, options, where))


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)
