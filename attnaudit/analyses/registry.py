"""Which request answers which command, and the one ``run`` that dispatches on a request.

Each analysis module defines its request class and a module-level ``run(request, *,
progress=None, executor=None) -> Result``; this table names them (imported on first use,
so the command line starts without torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from attnaudit.analyses.request import COMMANDS as COMMANDS, Request, request_type
from attnaudit.analyses.result import Progress, Result
from attnaudit.errors import AuditError


def run(request: Request, *, progress: Progress | None = None, executor: Any = None) -> Result:
    """Run any analysis request (dispatch to its module's ``run``)."""
    module = importlib.import_module(type(request).__module__)
    return module.run(request, progress=progress, executor=executor)


# ---- runs stated as command lines (audit files and the claims scorecard state them so,
# because a row's reproduction is a command line); parsed by the request, never by the CLI


def shell_line(command: str, args: list[str]) -> str:
    """The shell command that reproduces a run."""
    import shlex

    return shlex.join(["attnaudit", command, *args])


def request_from_argv(command: str, args: list[str]) -> Request:
    """The request ``attnaudit <command> <args>`` stands for."""
    return request_type(command).from_argv(list(args))


def check_argv(command: str, args: list[str]) -> None:
    """Validate a run before anything computes: its options, then its model files and data."""
    request_from_argv(command, args).check()


def run_argv(command: str, args: list[str], progress: Progress | None = None) -> dict:
    """Run ``attnaudit <command> <args>`` in the library and return its report."""
    result = run(request_from_argv(command, args), progress=progress)
    if result.failed_cells:
        failed = result.failed_cells
        raise AuditError(
            f"{len(failed)} sweep cell(s) failed; the report holds the others and lists these under "
            "failed_cells: " + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:5])
        )
    return result.to_dict()


def run_cell(config: dict) -> dict:
    """One run as a sweep cell (:mod:`attnaudit.runtime.sweep`): {"report": ...} or {"error": ..., "kind": "input"}.

    Internal errors propagate (the executor records them with their class name)."""
    try:
        return {"report": run_argv(config["analysis"], list(config["args"]))}
    except AuditError as exc:
        return {"error": str(exc), "kind": "input"}
