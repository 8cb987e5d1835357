"""Sweeps as independent cells, run in process, in local worker processes, or on Ray, with resume.

A cell is a pure function of its configuration: ``fn`` (``"package.module:function"``) called
with a JSON-able ``config`` returns a picklable result record. Cells ship their configuration,
not tensors: a cell loads its data through the data layer (:func:`cached` keeps one copy per
worker process), so nothing large crosses the wire.

Executors (:class:`ExecutorConfig`):

* ``local`` (default): cells one after the other in this process.
* ``jobs = N``: N local worker processes (spawned, so no forked torch/OpenMP state).
* ``ray``: Ray tasks; ``ray_address`` joins a running cluster, otherwise a local Ray is
  started for the run (``jobs`` CPUs, default all) and shut down afterwards. ``gpus_per_cell``
  asks Ray for accelerators.

Same numbers everywhere: every cell runs with the same number of torch threads under every
executor (``threads``; default the driver's own ``torch.get_num_threads()``), because torch's
parallel reductions sum in a thread-dependent order. So ``--jobs 2`` on 2 cores wants
``attnaudit --threads 1``. Results stream back as cells finish; a failing cell is reported
with its configuration and error while the others complete. ``resume_dir`` stores each
finished cell as ``<key>.json`` (written atomically; the key hashes the function, the
configuration and the toolkit version; the result is stored with the sha256 of its JSON text)
and skips cells already there. A damaged entry (unreadable, truncated, or not matching its
sha256) is reported in one warning line and recomputed, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from attnaudit.errors import AuditError, FieldError, literal
from attnaudit import __version__
from attnaudit.runtime.atomic import write_text_atomic

EXECUTORS = ("local", "ray")
RAY_INSTALL = 'pip install "attnaudit[ray]"'
RESUME_SCHEMA = "attnaudit.cell/2"  # /2: the result stored as JSON text with its sha256

_CACHE: dict[str, Any] = {}  # per worker process: loaded data sets and other shared inputs


def cached(key: str, build: Callable[[], Any]) -> Any:
    """The value stored under ``key`` in this process, built on first use (a per-worker cache)."""
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def clear_cache() -> None:
    _CACHE.clear()


@dataclass(frozen=True)
class CellTask:
    """One cell: ``fn(config)``; ``label`` names it for people (progress, errors)."""

    fn: str
    config: dict
    label: str
    cost: float = 1.0  # relative run time: parallel executors start the costliest cells first

    @property
    def key(self) -> str:
        """Hash of the function, the configuration and the toolkit version (the resume key)."""

        text = json.dumps(
            {"fn": self.fn, "config": self.config, "version": __version__}, sort_keys=True, default=_json_default
        )
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class CellOutcome:
    task: CellTask
    result: Any = None
    error: str | None = None
    seconds: float = 0.0
    resumed: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def failure(self) -> dict:
        return {"cell": self.task.label, "config": self.task.config, "error": self.error}


@dataclass
class ExecutorConfig:
    """Where cells run (see the module docstring)."""

    kind: str = "local"
    jobs: int = 1
    ray_address: str | None = None
    gpus_per_cell: float = 0.0
    threads: int | None = None
    resume_dir: str | None = None

    def __post_init__(self) -> None:
        self.kind = str(self.kind).strip().lower()
        if self.kind not in EXECUTORS:
            raise FieldError(
                "executor",
                "unknown {name} " + literal(repr(self.kind)) + "; use local (default; jobs > 1 for worker processes) "
                "or ray",
            )
        if isinstance(self.jobs, bool) or int(self.jobs) != self.jobs or self.jobs < 1:
            raise FieldError("jobs", "{name} must be a positive integer, got " + literal(self.jobs))
        if self.gpus_per_cell < 0:
            raise FieldError("gpus_per_cell", "{name} must be >= 0, got " + literal(self.gpus_per_cell))
        if self.gpus_per_cell and self.kind != "ray":
            raise FieldError("gpus_per_cell", "{name} asks Ray for accelerators; use it with the ray executor")
        if self.ray_address is not None and self.kind != "ray":
            raise FieldError("ray_address", "{name} joins a Ray cluster; use it with the ray executor")
        if self.threads is not None and self.threads < 1:
            raise AuditError(f"threads per cell must be >= 1, got {self.threads}")
        if self.resume_dir is not None:
            p = Path(self.resume_dir)
            if p.exists() and not p.is_dir():
                raise FieldError("resume", "{name} " + literal(p) + " is a file; give a folder (created if missing)")

    @property
    def name(self) -> str:
        if self.kind == "ray":
            return "ray" + (f" ({self.ray_address})" if self.ray_address else " (local)")
        return f"local, {self.jobs} worker processes" if self.jobs > 1 else "local"

    def check_available(self) -> None:
        """Exit-2 line with the install command when Ray is asked for but absent."""
        if self.kind == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise FieldError(
                    "executor", "{name} ray needs Ray, which is not installed; install it with " + literal(RAY_INSTALL)
                )

    def to_dict(self) -> dict:
        return {
            "executor": self.kind,
            "jobs": self.jobs,
            "ray_address": self.ray_address,
            "gpus_per_cell": self.gpus_per_cell,
            "threads_per_cell": self.threads,
            "resume_dir": self.resume_dir,
        }


# ----------------------------------------------------------------------------- the worker side
def execute_cell(fn: str, config: dict, threads: int | None) -> tuple[Any, str | None, float]:
    """Run one cell: (result, None, seconds) or (None, 'ErrorClass: message', seconds)."""
    import importlib

    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        module, _, name = fn.partition(":")
        result = getattr(importlib.import_module(module), name)(config)
        return result, None, time.perf_counter() - t0
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one failed cell must not lose the others
        kind = "" if isinstance(exc, AuditError) else f"{exc.__class__.__name__}: "
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        return None, kind + first, time.perf_counter() - t0


def _worker_init(threads: int | None) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    if threads is not None:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- resume files
def _resume_path(folder: Path, task: CellTask) -> Path:
    return folder / f"{task.key}.json"


def _content_sha256(result_text: str) -> str:
    return hashlib.sha256(result_text.encode("utf-8")).hexdigest()


def _load_resumed(
    folder: Path, task: CellTask, decode: Callable[[Any], Any], warn: Callable[[str], None]
) -> CellOutcome | None:
    """The stored outcome of ``task``, or None (absent, from another version or configuration, or
    damaged: a damaged entry -- unreadable, truncated, or whose result does not match its
    sha256 -- is reported through ``warn`` in one line and recomputed, never trusted)."""

    path = _resume_path(folder, task)
    if not path.is_file():
        return None

    def damaged(why: str) -> None:
        warn(f"resume entry {path.name} for cell {task.label} is damaged ({why}); recomputing it")

    try:
        outer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as exc:
        damaged(f"unreadable: {exc.__class__.__name__}")
        return None
    schema = outer.get("schema") if isinstance(outer, dict) else None
    if isinstance(schema, str) and schema.startswith("attnaudit.cell/") and schema != RESUME_SCHEMA:
        return None  # written by an older attnaudit: recomputed quietly
    if not isinstance(outer, dict) or schema != RESUME_SCHEMA:
        damaged("not an attnaudit cell record")
        return None
    if outer.get("key") != task.key or outer.get("fn") != task.fn or outer.get("version") != __version__:
        return None  # another configuration or toolkit version under this name: recomputed quietly
    text = outer.get("result_json")
    if not isinstance(text, str) or _content_sha256(text) != outer.get("sha256"):
        damaged("its content does not match its sha256")
        return None
    try:
        result = json.loads(text, object_hook=_json_hook)
        seconds = float(outer.get("seconds", 0.0))
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        damaged(f"unreadable result: {exc.__class__.__name__}")
        return None
    return CellOutcome(task, decode(result), None, seconds, resumed=True)


def _save_resumed(folder: Path, outcome: CellOutcome, encode: Callable[[Any], Any]) -> None:

    task = outcome.task
    # NaN / inf kept as JSON's NaN / Infinity tokens: this file is read back by Python only. The
    # result is stored as its JSON text with the text's sha256, so any damage to it is detected.
    result_json = json.dumps(encode(outcome.result), allow_nan=True, default=_json_default)
    payload = {
        "schema": RESUME_SCHEMA,
        "key": task.key,
        "fn": task.fn,
        "version": __version__,
        "label": task.label,
        "config": task.config,
        "seconds": outcome.seconds,
        "sha256": _content_sha256(result_json),
        "result_json": result_json,
    }
    write_text_atomic(_resume_path(folder, task), json.dumps(payload, allow_nan=True, default=_json_default))


def _warn_stderr(text: str) -> None:
    import sys

    print(f"warning: {text}", file=sys.stderr)


def _json_default(obj: Any) -> Any:
    """Arrays and numpy scalars in a cell's result, kept exactly (float64 repr round-trips)."""
    import numpy as np

    if hasattr(obj, "detach"):  # a torch tensor
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def _json_hook(obj: dict) -> Any:
    if "__ndarray__" in obj and "dtype" in obj:
        import numpy as np

        return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
    return obj


# ----------------------------------------------------------------------------- the driver side
def run_cells(
    tasks: Sequence[CellTask],
    executor: ExecutorConfig | None = None,
    *,
    on_done: Callable[[CellOutcome], None] | None = None,
    encode: Callable[[Any], Any] = lambda r: r,
    decode: Callable[[Any], Any] = lambda r: r,
    warn: Callable[[str], None] | None = None,
) -> list[CellOutcome]:
    """Run every task on the executor; outcomes in task order. ``on_done`` sees each as it finishes
    (resumed ones first). ``encode``/``decode`` map a result to and from JSON for resume files.
    ``warn`` receives one line per damaged resume entry (default: ``warning: ...`` on stderr)."""
    import torch

    ex = executor or ExecutorConfig()
    ex.check_available()
    threads = ex.threads if ex.threads is not None else torch.get_num_threads()
    outcomes: dict[int, CellOutcome] = {}
    folder = Path(ex.resume_dir) if ex.resume_dir else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        for i, task in enumerate(tasks):
            got = _load_resumed(folder, task, decode, warn or _warn_stderr)
            if got is not None:
                outcomes[i] = got
                if on_done:
                    on_done(got)
    # longest first, so one wide cell does not run alone at the end (outcomes keep the task order)
    todo = sorted(((i, t) for i, t in enumerate(tasks) if i not in outcomes), key=lambda it: -it[1].cost)

    def finished(i: int, outcome: CellOutcome) -> None:
        outcomes[i] = outcome
        if folder is not None and outcome.ok:
            _save_resumed(folder, outcome, encode)
        if on_done:
            on_done(outcome)

    if todo:
        if ex.kind == "ray":
            _run_ray(todo, ex, threads, finished)
        elif ex.jobs > 1:
            _run_processes(todo, ex, threads, finished)
        else:
            before = torch.get_num_threads()
            try:
                for i, task in sorted(todo):  # in process: in order
                    result, error, seconds = execute_cell(task.fn, task.config, ex.threads)
                    finished(i, CellOutcome(task, result, error, seconds))
            finally:
                torch.set_num_threads(before)
    return [outcomes[i] for i in range(len(tasks))]


def _run_processes(todo, ex: ExecutorConfig, threads: int, finished) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        max_workers=min(ex.jobs, len(todo)), mp_context=ctx, initializer=_worker_init, initargs=(threads,)
    )
    try:
        pending = {pool.submit(execute_cell, task.fn, task.config, threads): (i, task) for i, task in todo}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i, task = pending.pop(fut)
                try:
                    result, error, seconds = fut.result()
                except Exception as exc:  # noqa: BLE001 - a worker died (e.g. killed for memory)
                    result, error, seconds = None, f"worker process failed: {exc.__class__.__name__}: {exc}", 0.0
                finished(i, CellOutcome(task, result, error, seconds))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


@contextlib.contextmanager
def ray_session(address: str | None, cpus: int) -> Iterator[Any]:
    """Ray, initialised for the block: joined at ``address`` (``auto``: a running cluster), else a
    local Ray of ``cpus`` CPUs shut down after; an already initialised Ray is used as it is."""
    import logging

    import ray

    started = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
                configure_logging=False,
            )
        started = True
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def _run_ray(todo, ex: ExecutorConfig, threads: int, finished) -> None:
    cpus = ex.jobs if ex.jobs > 1 else (os.cpu_count() or 1)
    with ray_session(ex.ray_address, cpus) as ray:
        remote = ray.remote(execute_cell).options(
            num_cpus=min(threads, _ray_cpus(ray)), num_gpus=ex.gpus_per_cell, max_retries=0
        )
        refs = {remote.remote(task.fn, task.config, threads): (i, task) for i, task in todo}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i, task = refs[ref]
                try:
                    result, error, seconds = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the task or its worker failed inside Ray
                    result, error, seconds = (
                        None,
                        f"ray task failed: {exc.__class__.__name__}: {str(exc).splitlines()[0]}",
                        0.0,
                    )
                finished(i, CellOutcome(task, result, error, seconds))


def _ray_cpus(ray) -> float:
    return max(1.0, float(ray.cluster_resources().get("CPU", 1.0)))


def check_cell(config: dict) -> dict:
    """A cheap cell for checking an executor set-up (and for the tests): a seeded float64 sum
    of a random matrix product, computed with torch's threads; raises AuditError when
    ``config['fail']`` is true."""
    import torch

    if config.get("fail"):
        raise AuditError(f"cell {config.get('i')} was asked to fail")
    g = torch.Generator().manual_seed(int(config.get("seed", 0)))
    A = torch.randn(int(config.get("n", 64)), int(config.get("n", 64)), generator=g, dtype=torch.float64)
    return {"i": config.get("i"), "value": float((A @ A.T).sum()), "pid": os.getpid()}


def failures(outcomes: Iterable[CellOutcome]) -> list[dict]:
    return [o.failure() for o in outcomes if not o.ok]


def finite_or_nan(x: Any) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else float("nan")
