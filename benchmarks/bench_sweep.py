"""Benchmark: one ntk-distance width sweep on the local executor, on 2 worker processes, and on Ray.

Sweep: digits (embedded), 2L-ReLU and MLP-Attn, widths 256, 1024, 2048, 2 seeds (12 cells),
300 training / 200 held-out rows, 300 full-batch GD steps. Every cell runs with one torch
thread under every executor (so the three give identical numbers, checked here), the same
setting as ``attnaudit --threads 1``. Wall time includes everything a user waits for:
spawning the worker processes (each imports torch) and starting and stopping a local Ray.

Prints ``RATIO sweep_jobs2_vs_local=<local time / jobs-2 time>`` and
``RATIO sweep_ray_vs_local=<local time / Ray time>`` (skipped without Ray).

Run: ``python benchmarks/bench_sweep.py [--widths 256,1024,2048] [--seeds 2]`` (about 35 s of cells on one core;
``--widths 64,256,1024`` is a 15 s sweep, where the fixed start-up costs weigh more: see docs/scaling.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time


def main() -> None:
    import torch

    from attnaudit.data import DataSpec, HoldoutRecipe
    from attnaudit.analyses.ntk_distance.config import NTKDistanceConfig
    from attnaudit.analyses.ntk_distance.widths import run_ntk_distance
    from attnaudit.runtime.sweep import ExecutorConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="256,1024,2048")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = HoldoutRecipe.of(DataSpec("digits", n=args.n_train + 200), args.n_train, 200, seed=0)
    train, test = recipe.load()
    config = NTKDistanceConfig(
        widths=tuple(int(w) for w in args.widths.split(",")), seeds=tuple(range(args.seeds)), steps=args.steps
    )

    def run(executor: ExecutorConfig):
        t0 = time.perf_counter()
        result = run_ntk_distance(
            train.X, train.y, test.X, test.y, train.n_classes, config, executor=executor, data=recipe
        )
        seconds = time.perf_counter() - t0
        cells = [{k: v for k, v in c.to_dict().items() if k != "seconds"} for c in result.cells]
        return seconds, json.dumps(cells, sort_keys=True)

    n_cells = len(config.models) * len(config.widths) * len(config.seeds)
    t_local, ref = run(ExecutorConfig(threads=1))
    print(f"local:            {t_local:6.1f} s  ({n_cells} cells, 1 thread)")
    t_jobs, got = run(ExecutorConfig(jobs=2, threads=1))
    print(f"--jobs 2:         {t_jobs:6.1f} s  identical numbers: {got == ref}")
    print(f"RATIO sweep_jobs2_vs_local={t_local / t_jobs:.2f}")
    if importlib.util.find_spec("ray") is None:
        print("ray not installed: pip install 'attnaudit[ray]' to time --executor ray")
        return
    t_ray, got = run(ExecutorConfig(kind="ray", jobs=2, threads=1))
    print(f"--executor ray:   {t_ray:6.1f} s  identical numbers: {got == ref} (includes starting a local Ray)")
    print(f"RATIO sweep_ray_vs_local={t_local / t_ray:.2f}")


if __name__ == "__main__":
    main()
