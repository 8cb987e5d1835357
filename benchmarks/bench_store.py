"""Benchmark: the on-disk gradient store of ``--estimator projected`` (``InfluenceConfig.store``),
built in this process or sharded on Ray, and what it saves a later audit of the same model.

Workloads (float64, damping 1e-3, all parameters tracked, torch on one thread):

* reuse: the checkpoint of ``attnaudit train --arch vit --dataset mnist --split test`` (trained
  here into a temporary folder unless ``--checkpoint`` is given), ``--n-train`` (1,000) rows of
  the MNIST test split, cross-entropy, proj_dim 512 (Gauss-Newton). The first audit builds the
  store against one set of ``--n-test`` (100) test rows; the second, with the in-process state
  cleared (``clear_row_cache``: no cached rows, no remembered checksums) as another process
  would start, uses another 100 test rows and reads the training rows from the store.
* score: a small MLP (64 -> 32 -> 10, tanh, cross-entropy) on ``--score-rows`` (100,000)
  Gaussian rows, proj_dim 64: the store is built once, then 100 test rows are scored against
  every stored row in a fresh in-process state (fingerprint, row keys, checksums of every
  file, reading r and the segments' curvature sums, the solve and the scores).
* Ray: the MNIST ViT on ``--ray-rows`` (16,384) rows (the MNIST test split and its images
  shifted one pixel right), proj_dim
  ``--ray-proj-dim`` (256), segments of ``--segment-rows`` (1,024) rows: the store built in
  this process, then on a local Ray with 1 and with 2 workers (one torch thread each; the
  time is ``store_build_seconds``, Ray's start included), and once more on 2 workers while a
  thread SIGKILLs ``--kills`` (1) worker processes in the middle of a segment task (found by
  their process title ``ray::_store_task`` in /proc); Ray reruns the task (``MAX_RETRIES``).

Prints each time and::

    RATIO store_reuse=<second audit / first audit>           (goal <= 0.3)
    STORE_SCORE rows=<stored rows> test=100 seconds=<s>
    RATIO ray_store_2workers=<2-worker build / 1-worker build>  (goal <= 0.65)
    STORE workers=2 kills=<kills that landed> identical=true|false

``identical``: the killed build's folder (every segment file and the manifest) equals the
local build's byte for byte (the 1- and 2-worker folders are compared too). Skips the MNIST
parts (exit 0) without MNIST under ../shared/data, and the Ray parts without ray (or without /proc).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_store.py [--checkpoint vit.safetensors] [--skip-ray]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from attnaudit.analyses.influence import store as store_module
from attnaudit.analyses.influence.estimators.projected import clear_row_cache
from attnaudit.analyses.influence.influence import InfluenceConfig, influence_sweep
from attnaudit.core import Task
from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.checkpoints import load_model_source

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def audit(task: Task, X, y, Xt, yt, store: Path, proj_dim: int, **kw) -> tuple[float, dict]:
    """One influence run in a fresh in-process state: (seconds, diagnostics)."""
    clear_row_cache()
    cfg = InfluenceConfig(params="all", estimator="projected", damping=1e-3, proj_dim=proj_dim, store=str(store), **kw)
    t0 = time.perf_counter()
    res = influence_sweep(task, X, y, Xt, yt, cfg, loss="ce")[0]
    return time.perf_counter() - t0, res.diagnostics


def folder_bytes(root: Path) -> dict[str, bytes]:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def vit_task(checkpoint: str | None, work: Path) -> Task:
    if checkpoint is None:
        from attnaudit.cli import main as cli

        checkpoint = str(work / "vit.safetensors")
        data = ["--dataset", "mnist", "--split", "test", "--data-dir", str(SHARED)]
        try:
            cli(["--threads", "1", "train", "--arch", "vit", *data, "--out", checkpoint, "-q"])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
    loaded = load_model_source(checkpoint)
    return Task(loaded.module.eval(), loaded.n_classes, "ce", loaded.inputs)


def reuse(task: Task, work: Path, n: int, m: int) -> None:
    ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n + 2 * m, seed=1))
    X, y = ds.X.to(torch.float64), ds.y
    first, d1 = audit(task, X[:n], y[:n], X[n : n + m], y[n : n + m], work / "reuse", 512)
    second, d2 = audit(task, X[:n], y[:n], X[n + m :], y[n + m :], work / "reuse", 512)
    print(
        f"reuse (MNIST ViT, {n} train, 2 x {m} test, k 512): first audit {first:.2f} s "
        f"({d1['store_rows_computed']} rows computed, store {d1['store_bytes'] / 2**20:.1f} MiB, "
        f"estimate {d1['store_bytes_estimate'] / 2**20:.1f} MiB), second {second:.2f} s "
        f"({d2['store_rows_reused']} rows read, {d2['store_rows_computed']} computed)"
    )
    print(f"RATIO store_reuse={second / first:.3f}")


def score(work: Path, rows: int, m: int) -> None:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(torch.float64).eval()
    task = Task(module, 10, "ce")
    X = torch.randn(rows + m, 64, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (rows + m,), generator=g)
    build, d = audit(task, X[:rows], y[:rows], X[rows:], y[rows:], work / "score", 64)
    seconds, d2 = audit(task, X[:rows], y[:rows], X[rows:], y[rows:], work / "score", 64)
    assert d2["store_rows_computed"] == 0
    print(
        f"score (MLP 64-32-10, k {d['proj_dim_used']}): build {rows:,} rows {build:.1f} s, "
        f"store {d['store_bytes'] / 2**20:.0f} MiB"
    )
    print(f"STORE_SCORE rows={rows} test={m} seconds={seconds:.2f}")
    shutil.rmtree(work / "score")


def task_workers() -> set[int]:
    """Pids of the Ray workers running a segment task now: Ray titles a busy worker
    ``ray::<function>`` (``ray::IDLE`` between tasks), read from /proc/<pid>/cmdline."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].strip()
            except OSError:
                continue
            if title == b"ray::_store_task":
                found.add(int(entry.name))
    return found


def _killer(stop: threading.Event, wanted: int, landed: list[int]) -> None:
    """SIGKILL a Ray worker that has been running a segment task for a second, ``wanted`` times."""
    busy_since: dict[int, float] = {}
    while not stop.is_set() and len(landed) < wanted:
        now = time.monotonic()
        running = task_workers()
        for pid in running:
            busy_since.setdefault(pid, now)
        for pid in list(busy_since):
            if pid not in running:
                del busy_since[pid]
            elif now - busy_since[pid] > 1.0:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                landed.append(pid)
                busy_since.clear()
                stop.wait(3.0)  # let Ray notice and rerun the task before the next kill
                break
        stop.wait(0.1)


def ray_builds(task: Task, work: Path, n: int, k: int, kills: int) -> None:
    ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=10_000, seed=2))
    images = ds.X.to(torch.float64).reshape(-1, 28, 28)
    # the test split's 10,000 images and the same shifted one pixel right: 20,000 distinct rows
    X = torch.cat([images, images.roll(1, dims=2)]).reshape(-1, 28 * 28)
    y = torch.cat([ds.y, ds.y])
    if n + 10 > X.shape[0]:
        raise SystemExit(f"--ray-rows {n} is more than the {X.shape[0] - 10} rows this benchmark makes")
    Xtr, ytr, Xte, yte = X[:n], y[:n], X[n:], y[n:]
    _, local = audit(task, Xtr, ytr, Xte, yte, work / "local", k)
    load = [os.getloadavg()[0]]  # other jobs on a shared machine take cores the second worker needs
    _, one = audit(task, Xtr, ytr, Xte, yte, work / "ray1", k, store_executor="ray", store_workers=1)
    load.append(os.getloadavg()[0])
    _, two = audit(task, Xtr, ytr, Xte, yte, work / "ray2", k, store_executor="ray", store_workers=2)
    load.append(os.getloadavg()[0])
    reference = folder_bytes(work / "local")
    same = folder_bytes(work / "ray1") == reference and folder_bytes(work / "ray2") == reference
    print(
        f"Ray (MNIST ViT, {n:,} train rows, k {k}, {local['store_bytes'] / 2**20:.0f} MiB): local build "
        f"{local['store_build_seconds']:.1f} s, Ray 1 worker {one['store_build_seconds']:.1f} s, "
        f"2 workers {two['store_build_seconds']:.1f} s; 1- and 2-worker folders identical to local: {same}; "
        f"1-minute load average before / after each: {', '.join(f'{v:.2f}' for v in load)} on {os.cpu_count()} CPUs"
    )
    print(f"RATIO ray_store_2workers={two['store_build_seconds'] / one['store_build_seconds']:.3f}")
    shutil.rmtree(work / "ray1")
    shutil.rmtree(work / "ray2")

    stop, landed = threading.Event(), []
    thread = threading.Thread(target=_killer, args=(stop, kills, landed), daemon=True)
    thread.start()
    try:
        _, killed = audit(task, Xtr, ytr, Xte, yte, work / "killed", k, store_executor="ray", store_workers=2)
    finally:
        stop.set()
        thread.join()
    identical = folder_bytes(work / "killed") == reference
    print(f"killed build: {killed['store_build_seconds']:.1f} s, worker pids killed {landed}")
    print(f"STORE workers=2 kills={len(landed)} identical={'true' if identical else 'false'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--score-rows", type=int, default=100_000)
    ap.add_argument("--ray-rows", type=int, default=16_384)
    ap.add_argument("--ray-proj-dim", type=int, default=256)
    ap.add_argument("--segment-rows", type=int, default=1024)
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--only", choices=("reuse", "score", "ray"), default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    store_module.SEGMENT_ROWS = args.segment_rows
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    mnist = (SHARED / "MNIST").exists()
    try:
        task = None
        if args.only in (None, "reuse", "ray"):
            if mnist:
                task = vit_task(args.checkpoint, work)
            else:
                print(f"SKIP reuse and Ray: no MNIST under {SHARED}")
        if task is not None and args.only in (None, "reuse"):
            reuse(task, work, args.n_train, args.n_test)
        if args.only in (None, "score"):
            score(work, args.score_rows, args.n_test)
        if task is not None and args.only in (None, "ray") and not args.skip_ray:
            if importlib.util.find_spec("ray") is None or not Path("/proc/self/cmdline").exists():
                print("SKIP Ray: ray is not installed (or no /proc to find its workers in)")
            else:
                ray_builds(task, work, args.ray_rows, args.ray_proj_dim, args.kills)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
