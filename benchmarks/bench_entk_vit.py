"""Benchmark: the eNTK Gram of the MNIST-sized ViT through the engine vs materialized Jacobians.

Model: ``attnaudit.models.vit.ViT`` ``vit``, image (1, 28, 28), patch 7 (16 tokens), dim 64, depth 2,
4 heads, MLP ratio 2, 10 classes: 71,946 parameters, float64 (the dtype every kernel
analysis of attnaudit computes in). Data: 256 images of the real MNIST test split
(../shared/data; uniform noise of the same shape when it is absent, said on stderr).

Two methods, each in its own fresh process (so each peak memory is its own), one thread,
one warm-up call on 8 rows, best of ``--repeats`` timed calls:

* ``engine``: :meth:`attnaudit.core.engine.Engine.entk` with a memory budget
  (``--memory-mb``, default 1024): per-sample Jacobians in panels, columns cached when they
  fit, one matrix product per block, only the blocks on and above the diagonal of the
  symmetric kernel.
* ``jacobian`` (the baseline): ``empirical_ntk_jacobian_contraction`` of PyTorch's NTK
  tutorial ("Neural Tangent Kernels", torch.func), as written there, called with x1 = x2 = X:
  ``vmap(jacrev(f_single))`` over the whole batch with the parameters as a dict, once for x1
  and once for x2, which materializes every per-sample Jacobian (256 x 10 x 71,946 numbers:
  1.47 GB in float64) of both at once, then ``einsum('Naf,Mbf->NMab')`` per parameter
  tensor, stacked and summed. ``--single-pass`` computes the Jacobians once instead (the
  baseline's favour; about 2 s less).

``--form full`` (default; the tutorial's default ``compute='full'``) is the (n, n, c, c)
kernel whose Frobenius movement ``ntk-distance --checkpoint`` reports; ``--form trace`` the
n x n Gram K = (1/c) sum_a J_a J_a^T (the tutorial's ``'Naf,Maf->NM'`` divided by c, the
"eNTK Gram" of ``kappa --gram entk`` and of the centred kernel alignment). ``--form both``
runs both; the RATIO line is the full form's.

The two kernels are compared (max abs difference relative to the largest entry). Printed:
``RATIO entk_engine_vs_jacobian=<baseline time / engine time>`` and ``PEAK_MB engine=...
jacobian=...`` (peak resident memory above the process's level after warm-up).

Run: ``python benchmarks/bench_entk_vit.py [--n 256] [--form trace|full|both] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _rss_mb() -> float:
    """Current resident set size (MB), from /proc (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _data(n: int):
    import torch

    try:
        from attnaudit.data import DataSpec, load_dataset

        X = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n, seed=0)).X
        return X.to(torch.float64), "real MNIST test split"
    except Exception:  # noqa: BLE001 - noise of the same shape keeps the benchmark runnable
        return torch.rand(n, 784, generator=torch.Generator().manual_seed(0), dtype=torch.float64), "uniform noise"


def _model():
    import torch

    from attnaudit.models.vit import ViT, ViTSpec

    spec = ViTSpec("vit", (1, 28, 28), 10, depth=2, dim=64, heads=4, patch=7, mlp_ratio=2, seed=0)
    return ViT(spec, dtype=torch.float64)


def _engine_kernel(model, X, form: str, memory_bytes: int):
    from attnaudit.core.engine import Engine
    from attnaudit.core.task import Task

    engine = Engine(Task(model, 10, inputs=model.audit_inputs()), dtype=model.head.weight.dtype)
    return engine.entk(X, form=form, memory_bytes=memory_bytes)


def _tutorial_kernel(model, X, form: str, single_pass: bool = False):
    """PyTorch's NTK tutorial, Jacobian contraction, called with x1 = x2 = X."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    from attnaudit.core.engine import math_attention

    params = {k: v.detach() for k, v in model.named_parameters()}
    images = X.reshape(-1, 1, 28, 28)

    def fnet_single(p, x):
        return functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)

    with math_attention():
        jac1 = vmap(jacrev(fnet_single), (None, 0))(params, images)
        jac2 = jac1 if single_pass else vmap(jacrev(fnet_single), (None, 0))(params, images)
    jac1 = [j.flatten(2) for j in jac1.values()]
    jac2 = [j.flatten(2) for j in jac2.values()]
    if form == "trace":
        c = jac1[0].shape[1]
        return torch.stack([torch.einsum("Naf,Maf->NM", j1, j2) for j1, j2 in zip(jac1, jac2)]).sum(0) / c
    return torch.stack([torch.einsum("Naf,Mbf->NMab", j1, j2) for j1, j2 in zip(jac1, jac2)]).sum(0)


def _worker(method: str, n: int, form: str, repeats: int, memory_bytes: int, single_pass: bool, queue) -> None:
    import torch

    torch.set_num_threads(1)
    X, source = _data(n)
    model = _model().eval()

    def run(rows):
        if method == "engine":
            return _engine_kernel(model, rows, form, memory_bytes)
        return _tutorial_kernel(model, rows, form, single_pass)

    run(X[:8])  # warm-up: torch.func tracing, allocator
    base = _rss_mb()
    times = []
    K = None
    for _ in range(repeats):
        K = None
        t = time.perf_counter()
        K = run(X)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    queue.put(
        {
            "method": method,
            "times": times,
            "peak_mb": peak - base,
            "source": source,
            "params": sum(p.numel() for p in model.parameters()),
            "kernel": K.cpu().numpy(),
        }
    )


def measure(method: str, n: int, form: str, repeats: int, memory_bytes: int, single_pass: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(method, n, form, repeats, memory_bytes, single_pass, queue))
    proc.start()
    import queue as queue_module

    while True:
        try:
            out = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                raise SystemExit(
                    f"the {method} worker ended without a result (exit code {proc.exitcode}; killed for memory?)"
                ) from None
    proc.join()
    return out


def bench(form: str, n: int, repeats: int, memory_mb: int, single_pass: bool) -> tuple[float, float, float]:
    budget = memory_mb * 2**20
    eng = measure("engine", n, form, repeats, budget)
    base = measure("jacobian", n, form, repeats, budget, single_pass)
    t_eng, t_base = min(eng["times"]), min(base["times"])
    K1, K2 = eng["kernel"], base["kernel"]
    rel = float(abs(K1 - K2).max() / abs(K2).max())
    print(
        f"[{form}] data: {eng['source']}, n={n}; ViT {eng['params']:,} parameters, float64, 1 thread; "
        f"kernel shape {tuple(K1.shape)}",
        file=sys.stderr,
    )
    print(
        f"[{form}] engine (Engine.entk, budget {memory_mb} MB): best {t_eng:.2f} s of "
        f"{', '.join(f'{t:.2f}' for t in eng['times'])}; peak +{eng['peak_mb']:.0f} MB",
        file=sys.stderr,
    )
    how = "one Jacobian pass" if single_pass else "Jacobians of x1 and x2, as written"
    print(
        f"[{form}] materialized Jacobians (PyTorch NTK tutorial, {how}): best {t_base:.2f} s of "
        f"{', '.join(f'{t:.2f}' for t in base['times'])}; peak +{base['peak_mb']:.0f} MB",
        file=sys.stderr,
    )
    print(f"[{form}] agreement: max |K_engine - K_jacobian| / max |K| = {rel:.2e}", file=sys.stderr)
    if rel > 1e-10:
        print(f"[{form}] WARNING: the two kernels disagree", file=sys.stderr)
    return t_base / t_eng, eng["peak_mb"], base["peak_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--form", choices=("trace", "full", "both"), default="full")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-mb", type=int, default=2048, help="the engine's memory budget (Jacobians + transients)")
    ap.add_argument("--single-pass", action="store_true", help="the baseline computes the Jacobians once (x1 = x2)")
    args = ap.parse_args()
    forms = ("full", "trace") if args.form == "both" else (args.form,)
    results = {form: bench(form, args.n, args.repeats, args.memory_mb, args.single_pass) for form in forms}
    if "trace" in results:
        ratio, pe, pb = results["trace"]
        print(f"trace-form (n x n) Gram: engine {ratio:.2f}x faster; peak engine {pe:.0f} MB, jacobian {pb:.0f} MB")
    main_form = "full" if "full" in results else "trace"
    ratio, pe, pb = results[main_form]
    print(f"PEAK_MB engine={pe:.0f} jacobian={pb:.0f}")
    print(f"RATIO entk_engine_vs_jacobian={ratio:.2f}")


if __name__ == "__main__":
    main()
