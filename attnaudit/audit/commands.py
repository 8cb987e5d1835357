"""The bridge from an audit check to the command it runs: option names, argument lists, invocation.

A check's options are the command's own CLI options (without ``--``); they become an
argument list that the command parses exactly as from the shell, so the audit cannot drift
from the CLI. The command runs in-process with its report captured
(:mod:`attnaudit.runtime.invocation`).
"""

from __future__ import annotations

import difflib
import shlex
from typing import Any

from attnaudit.errors import AuditError

ANALYSES = ("kappa", "ntk-distance", "malleability", "landscape")
DATA_OPTIONS = ("dataset", "data", "data_dir", "split", "classes", "preprocess", "download")
OUTPUT_OPTIONS = ("json", "png", "out_dir", "quiet", "overwrite", "debug")
MODEL_OPTIONS = ("checkpoint", "factory", "weights", "trust_pickle", "inputs")
# options a check may not set, and why
REFUSED = {
    **{name: "the audit writes one combined report (its --json / --junit)" for name in OUTPUT_OPTIONS},
    **{name: "give the model in the file's model: section" for name in MODEL_OPTIONS},
    "max_flip_rate": "a check states its limit with max: (and stat: ci_high for the interval's upper end)",
    "out_path": "the audit places the trained model itself (model.save keeps a copy)",
}


def hint(word: str, choices) -> str:
    """'; did you mean 'x'?' for a close match, else ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def cli_command(name: str):
    """The click command of ``attnaudit <name>`` (the same object the shell runs)."""
    import typer

    from attnaudit.cli import app

    group = typer.main.get_command(app)
    return group.commands[name]


def option_params(name: str) -> dict[str, Any]:
    """python name -> click parameter of the command's options."""
    return {p.name: p for p in cli_command(name).params}


def normalise(key: Any) -> str:
    """An option key as written in the file (eps, top-k, top_k, --top-k) -> its python name."""
    return str(key).strip().lstrip("-").replace("-", "_")


def to_args(command: str, options: dict[str, Any], where: str) -> list[str]:
    """The argument list for ``options`` (python names) of ``command``; ``where`` is the key path for errors."""
    params = option_params(command)
    args: list[str] = []
    for key, value in options.items():
        param = params.get(key)
        if param is None:
            names = [n.replace("_", "-") for n in params if n not in REFUSED]
            raise AuditError(f"{where}.{key.replace('_', '-')}: {command} has no option --{key.replace('_', '-')}"
                             f"{hint(key.replace('_', '-'), names)}")
        if value is None:
            continue
        flag = param.opts[0]
        if param.is_flag:
            if not isinstance(value, bool):
                raise AuditError(f"{where}.{key}: expected true or false (the flag {flag}), got {value!r}")
            if value:
                args.append(flag)
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
            continue
        values = value if isinstance(value, list) and param.multiple else [value]
        for item in values:
            if isinstance(item, dict) or (isinstance(item, list) and any(isinstance(v, (dict, list)) for v in item)):
                raise AuditError(f"{where}.{key}: expected a value or a list of values for {flag}, got a mapping")
            if isinstance(item, bool):
                raise AuditError(f"{where}.{key}: {flag} takes a value, not true/false")
            text = ",".join(_text(v) for v in item) if isinstance(item, list) else _text(item)
            args.extend([flag, text])
    return args


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def shell_line(command: str, args: list[str]) -> str:
    """The shell command that reproduces a run."""
    return shlex.join(["attnaudit", command, *args])


def invoke(command: str, args: list[str]) -> dict:
    """Run ``attnaudit <command> <args> --quiet`` in-process and return the report it emits.

    Errors propagate: :class:`AuditError` (bad input), :class:`attnaudit.runtime.invocation.DryRunStop`
    (a dry run ended after validation), anything else (an internal error). click's own parse
    errors become AuditError with click's message.
    """
    from attnaudit.runtime.invocation import capturing

    cmd = cli_command(command)
    with capturing() as reports:
        try:
            code = cmd.main(args=[*args, "--quiet"], prog_name=f"attnaudit {command}", standalone_mode=False)
        except AuditError:
            raise
        except Exception as exc:  # click's exceptions, matched by shape (typer vendors click)
            if hasattr(exc, "format_message") and exc.__class__.__name__ not in ("Exit", "Abort"):
                raise AuditError(" ".join(exc.format_message().split())) from None
            raise
    if isinstance(code, int) and code != 0:
        raise AuditError(f"attnaudit {command} exited with code {code}")
    if not reports:
        raise RuntimeError(f"attnaudit {command} produced no report")
    return reports[-1]


def run_cell(config: dict) -> dict:
    """An audit run as a sweep cell (:mod:`attnaudit.runtime.sweep`): {"report": ...} or {"error": ..., "kind": "input"}.

    Internal errors propagate (the executor records them with their class name)."""
    try:
        return {"report": invoke(config["analysis"], list(config["args"]))}
    except AuditError as exc:
        return {"error": str(exc), "kind": "input"}
