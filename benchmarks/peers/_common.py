"""Shared set-up for the peer benchmarks: the same data, model and timing rules for both sides.

Workloads (float64 throughout; the peers run on exactly the tensors attnaudit sees):

* ``digits``: sklearn's bundled digits, train split (1,437 rows, d = 64), 2-layer ReLU
  net (NTK parametrisation) of width 32, trained 50 steps of full-batch GD on MSE;
* ``mnist``: the real MNIST test split in ../shared/data (skipped with a message when
  absent), the first ``n`` rows (each benchmark states n and the width).

Timing: each side is run once to warm up (imports, allocator, jit), then ``repeats``
times; the best time is kept. ``RATIO <name>=<attnaudit time / peer time>``: below 1 means
attnaudit is faster. A peer that is not installed is skipped with a message (exit 0).

Agreement: each script states its tolerances in its docstring and checks every agreement
measure with :func:`check`, which prints ``AGREEMENT <name>=<value> tol=<tol> ok=<true|false>``
(``ok`` when value <= tol; a NaN fails); :func:`finish`, called after the last RATIO line,
exits 1 when any check failed and 0 otherwise (also when a workload was skipped).
Every script pins itself to one core and one thread on import of this module (see
:func:`_one_core`), so both sides run single-threaded: ``python benchmarks/peers/<file>.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, train

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _one_core() -> None:
    """Pin this process to one core and one torch thread (before any peer is imported):
    OMP_NUM_THREADS does not reach XLA's own thread pool, which used a second core when it
    was idle and halved neural-tangents' time, so only pinning makes the ratio one thread
    against one thread. Set ATTNAUDIT_BENCH_ALL_CORES=1 to compare multi-threaded runs."""
    import os

    if os.environ.get("ATTNAUDIT_BENCH_ALL_CORES"):
        return
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)


_one_core()


@dataclass
class Workload:
    name: str
    X: torch.Tensor  # (n, d) float64
    y: torch.Tensor  # (n,) int64
    model: torch.nn.Module  # float64, eval mode
    n_classes: int

    def describe(self) -> str:
        P = sum(p.numel() for p in self.model.parameters())
        return f"{self.name}: n={self.X.shape[0]} d={self.X.shape[1]} width={self.model_width} P={P}"

    @property
    def model_width(self) -> int:
        return int(next(p for p in self.model.parameters() if p.dim() == 2).shape[0])


def workload_args(doc: str, repeats: int) -> argparse.Namespace:
    """The command line every peer script shares: ``--workload digits|mnist|both`` and
    ``--repeats`` (``doc``'s first line is the description)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--workload", choices=("digits", "mnist", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap.parse_args()


def require(module: str, package: str):
    """Import a peer or exit 0 with a message (a missing peer is skipped, never a failure)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is unusable here
        print(
            f"SKIP {package} is not importable ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"install the peers with: pip install -e '.[bench]'"
        )
        sys.exit(0)


def workload(name: str, n: int | None = None, width: int = 32, steps: int = 50, lr: float = 1.0) -> Workload | None:
    """The named workload, or None (with a message) when its data are absent."""
    if name == "digits":
        spec = DataSpec(dataset="digits", split="train", n=n)
    elif name == "mnist":
        if not (SHARED / "MNIST").exists():
            print(f"SKIP mnist workload: no MNIST under {SHARED}")
            return None
        spec = DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n, seed=0)
    else:
        raise ValueError(name)
    ds = load_dataset(spec)
    X, y = ds.X.to(torch.float64), ds.y
    model = build_model(ModelSpec("relu", X.shape[1], width, ds.n_classes, seed=0), X).to(torch.float64)
    train(model, X, y, TrainConfig(loss="mse", lr=lr, steps=steps))
    model.eval()
    return Workload(name, X, y, model, ds.n_classes)


def best_time(fn, repeats: int = 3, warmup: int = 1, min_total: float = 0.5, max_runs: int = 2000):
    """(best seconds over at least ``repeats`` runs after ``warmup`` runs, last result).

    Calls of a millisecond are timed over more runs, until ``min_total`` seconds have been
    spent (at most ``max_runs``): the minimum of 7 such runs moved by +-15 % between
    processes, which is the size of the differences being measured."""
    out = None
    for _ in range(warmup):
        out = fn()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or (spent < min_total and runs < max_runs):
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best, out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def report(name: str, ours: float, peer: float, agreement: str) -> None:
    print(f"  attnaudit {ours:.4f} s   peer {peer:.4f} s   agreement: {agreement}")
    print(f"RATIO {name}={ours / peer:.3f}")


_CHECKS: list[tuple[str, float, float, bool]] = []


def check(name: str, value: float, tol: float) -> bool:
    """Compare one agreement measure (smaller is better) with its tolerance: print
    ``AGREEMENT <name>=<value> tol=<tol> ok=<true|false>`` and remember the outcome for
    :func:`finish`. ``ok`` is ``value <= tol``; a NaN value fails."""
    value = float(value)
    ok = value <= tol  # False for NaN
    print(f"AGREEMENT {name}={value:.3g} tol={tol:g} ok={'true' if ok else 'false'}")
    _CHECKS.append((name, value, tol, ok))
    return ok


def finish() -> None:
    """End the script: exit 1 (naming the failed checks) when any :func:`check` failed, else 0.
    Call it after the last RATIO line, so every timing is printed even when a check fails."""
    failed = [name for name, _, _, ok in _CHECKS if not ok]
    if failed:
        print(f"FAIL {len(failed)} of {len(_CHECKS)} agreement checks beyond tolerance: {', '.join(failed)}")
        sys.exit(1)
    print(f"OK {len(_CHECKS)} agreement checks within tolerance")
    sys.exit(0)
