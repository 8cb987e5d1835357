"""How a command is being run: from the shell, or in-process by ``attnaudit audit``.

``attnaudit audit`` runs each check by calling the command itself (same option parsing, same
validation, same library calls, so the same numbers as the shell). Two switches change only
what happens at the edges of a command:

* :func:`capturing`: :func:`attnaudit.cli.common.emit` hands the report to the audit instead
  of printing tables and writing files, and errors propagate as exceptions instead of
  becoming an ``error:`` line and an exit code.
* :func:`dry_run`: the command stops with :class:`DryRunStop` once its data are loaded, i.e.
  after every option has been checked and before any training or analysis, so a whole audit
  file is validated before anything runs.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

_CAPTURED: ContextVar[list | None] = ContextVar("attnaudit_captured_reports", default=None)
_DRY_RUN: ContextVar[bool] = ContextVar("attnaudit_dry_run", default=False)
_COMMAND: ContextVar[str | None] = ContextVar("attnaudit_command_line", default=None)


class DryRunStop(Exception):
    """Raised where a dry-run command would start loading data: its options passed."""


@contextlib.contextmanager
def capturing() -> Iterator[list]:
    """Collect the reports commands emit in this block (see module docstring)."""
    reports: list = []
    token = _CAPTURED.set(reports)
    try:
        yield reports
    finally:
        _CAPTURED.reset(token)


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """Commands in this block stop (DryRunStop) after validating their options and loading data."""
    token = _DRY_RUN.set(True)
    try:
        yield
    finally:
        _DRY_RUN.reset(token)


def captured_reports() -> list | None:
    """The list collecting emitted reports, or None when the command runs from the shell."""
    return _CAPTURED.get()


def stop_if_dry_run() -> None:
    """End a dry run here (called when the data have been loaded)."""
    if _DRY_RUN.get():
        raise DryRunStop()


@contextlib.contextmanager
def command_line(argv: list[str]) -> Iterator[None]:
    """Record the shell command being run (``attnaudit`` + ``argv``) for the reports."""
    import shlex

    token = _COMMAND.set(shlex.join(["attnaudit", *argv]))
    try:
        yield
    finally:
        _COMMAND.reset(token)


def current_command() -> str | None:
    """The command line that reproduces this run: None when run in-process by an audit (each
    audit run records its own command) or through the Python API."""
    if _CAPTURED.get() is not None:
        return None
    return _COMMAND.get()
