"""How many CPU threads torch gets: an explicit request, ``ATTNAUDIT_THREADS``, or the idle cores.

torch's default is one thread per core. On a machine whose cores are already busy that
oversubscribes them: OpenMP threads wait at every barrier for a thread that is not running,
and a quick preset took 149 s instead of 14 s (issue 15). So the command line's default
(``attnaudit --threads 0``) asks :func:`choose_threads` for a count, by this rule, first
match wins:

1. an explicit request ``N >= 1`` (``attnaudit --threads N``, ``choose_threads(N)``): N;
2. the environment variable ``ATTNAUDIT_THREADS`` (a positive integer; empty = unset): that
   count, as given; anything else is an :class:`~attnaudit.errors.AuditError`;
3. auto: ``max(1, min(usable, torch_default, idle))`` where

   * ``usable`` = ``len(os.sched_getaffinity(0))`` (the cores this process may run on;
     ``os.cpu_count()`` where affinity is not available),
   * ``torch_default`` = ``torch.get_num_threads()`` as read at the first call of
     :func:`choose_threads` in this process (before anything here changed it),
   * ``idle`` = ``usable - os.getloadavg()[0]`` rounded to the nearest integer (the one-minute
     load average, which counts a core busy for part of the minute as partly busy; where
     ``os.getloadavg`` is missing or fails, ``idle = usable``).

The auto decision is taken once per process and cached, so every in-process run (for example
repeated ``attnaudit.cli.main([...])`` calls) uses the same count and gives bit-identical
numbers; separate processes may decide differently when the load differs, so pin ``--threads
N`` (or ``ATTNAUDIT_THREADS``) to reproduce a run to the last bit. :func:`apply_threads` sets
torch's count (only if it differs) and remembers the choice, whose rule the JSON reports
record as ``environment.threads_rule`` (:func:`threads_rule`). Nothing here runs at import.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

from attnaudit.errors import AuditError

ENV_VAR = "ATTNAUDIT_THREADS"

_lock = threading.Lock()
_torch_default: int | None = None  # torch.get_num_threads() at the first choose_threads() call
_auto: ThreadChoice | None = None  # the auto decision of this process
_applied: ThreadChoice | None = None  # the last choice apply_threads() made in this process


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why: ``rule`` is one human-readable line (recorded in JSON reports);
    ``requested`` is the explicit request (``None`` when the count came from the environment
    variable or the auto rule)."""

    threads: int
    rule: str
    requested: int | None = None


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _load() -> float | None:
    """The one-minute load average, or None where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _from_env() -> ThreadChoice | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise AuditError(
            f"{ENV_VAR}={raw!r} is not a positive integer; set it to a thread count such as "
            f"{ENV_VAR}=1, or unset it for the automatic choice (idle cores)"
        )
    return ThreadChoice(n, f"{ENV_VAR}={n}")


def _decide_auto(torch_default: int) -> ThreadChoice:
    usable = _usable_cores()
    load = _load()
    if load is None:
        idle = usable
        why = f"{usable} usable cores, no load average on this platform -> {idle} idle"
    else:
        idle = math.floor(usable - load + 0.5)  # to the nearest core: a load of 0.3 leaves the core free
        why = f"{usable} usable cores, load {load:.2f} -> {max(idle, 0)} idle"
    n = max(1, min(usable, torch_default, idle))
    return ThreadChoice(n, f"auto: {why}, torch default {torch_default} -> {n} thread{'s' if n != 1 else ''}")


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count for this process (see the module docstring for the rule).

    ``requested`` ``N >= 1`` wins; ``0`` or ``None`` means ``ATTNAUDIT_THREADS`` if set, else
    the auto rule ``max(1, min(usable cores, torch's default, round(usable - load)))``, decided
    once per process and cached. Raises :class:`AuditError` for a negative request or an
    invalid ``ATTNAUDIT_THREADS``. Changes nothing; :func:`apply_threads` applies the choice.
    """
    global _torch_default, _auto
    if isinstance(requested, bool) or (requested is not None and int(requested) != requested):
        raise AuditError(f"threads must be a whole number >= 0 (0 = automatic), got {requested!r}")
    with _lock:
        if _torch_default is None:
            import torch

            _torch_default = max(1, torch.get_num_threads())
        if requested is not None and requested < 0:
            raise AuditError(f"threads must be >= 0 (0 = automatic), got {requested}")
        if requested:
            n = int(requested)
            return ThreadChoice(n, f"explicit request: --threads {n}", n)
        env = _from_env()
        if env is not None:
            return env
        if _auto is None:
            _auto = _decide_auto(_torch_default)
        return _auto


def apply_threads(choice: ThreadChoice) -> int:
    """Set torch's thread count to ``choice.threads`` (only if it differs) and remember the
    choice for :func:`threads_rule`. Returns the count torch had before."""
    global _applied
    import torch

    before = torch.get_num_threads()
    if before != choice.threads:
        torch.set_num_threads(choice.threads)
    _applied = choice
    return before


def threads_rule() -> str:
    """Why torch has its current thread count: the rule of the choice applied in this process,
    or ``"torch default"`` when none was (library use without the command line)."""
    import torch

    choice = _applied
    if choice is None:
        return "torch default"
    now = torch.get_num_threads()
    if now != choice.threads:
        return f"{choice.rule}; since changed to {now} in this process"
    return choice.rule


def _reset_for_tests() -> None:
    """Forget the cached torch default, auto decision and applied choice (tests only)."""
    global _torch_default, _auto, _applied
    with _lock:
        _torch_default = None
        _auto = None
        _applied = None
