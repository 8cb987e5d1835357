"""Benchmark: last-layer and CG influence against an explicit dense-Hessian solve.

The reference ("dense") is the textbook computation: the Hessian of the mean training
loss built with ``torch.autograd.functional.hessian`` (reverse-over-reverse on the whole
model), then ``torch.linalg.solve((H + damping I), g_test)`` and a per-sample-gradient
loop. It is run on the same trained model and data as the fast methods:

* last-layer vs dense over the output layer only (the same parameter set);
* cg vs dense over all parameters;
* the last-layer fast path (TwoLayerNet head, cached features) vs the generic engine path
  (``InfluenceConfig(fast_path=False)``) on the same parameters.

Prints ``RATIO influence_lastlayer_vs_dense=<x>``, ``RATIO influence_cg_vs_dense=<x>`` and
``RATIO influence_fastpath_vs_generic=<x>`` (speed-up = reference time / method time) and
the agreement (Pearson correlation, max relative error) of the influence of every training
sample on the summed test loss.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_influence.py [--n 400 --width 24]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from attnaudit.data import DataSpec, holdout_split, load_dataset
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, per_sample_loss, train


def dense_influence(model, names, X, y, Xt, yt, damping, loss):
    """Textbook influence: autograd Hessian over ``names``, dense solve, per-sample grad loop."""
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    frozen = {k: v.detach() for k, v in params.items() if k not in names}
    buffers = {k: v for k, v in model.named_buffers()}

    def unflat(theta):
        out, i = {}, 0
        for n, s, k in zip(names, shapes, sizes):
            out[n] = theta[i : i + k].view(s)
            i += k
        return out

    def f(theta, xs, ys):
        out = torch.func.functional_call(model, {**frozen, **buffers, **unflat(theta)}, (xs,))
        return per_sample_loss(out, ys, loss)

    theta = torch.cat([params[n].detach().reshape(-1) for n in names])
    H = torch.autograd.functional.hessian(lambda t: f(t, X, y).mean(), theta)
    g_test = torch.autograd.functional.jacobian(lambda t: f(t, Xt, yt).sum(), theta)
    s = torch.linalg.solve(H + damping * torch.eye(len(theta), dtype=H.dtype), g_test)
    infl = torch.empty(len(X), dtype=H.dtype)
    for i in range(len(X)):
        g = torch.autograd.functional.jacobian(lambda t: f(t, X[i : i + 1], y[i : i + 1]).sum(), theta)
        infl[i] = -(g @ s)
    return infl, float(torch.linalg.eigvalsh(H)[0])


def timed(fn, repeats: int):
    """(result, median seconds) over ``repeats`` calls (after the caller's warm-up)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times))


def agreement(a, b) -> str:
    a, b = a.numpy(), b.numpy()
    corr = float(np.corrcoef(a, b)[0, 1])
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    return f"pearson={corr:.10f} max_rel_err={rel:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--width", type=int, default=24)
    ap.add_argument("--arch", default="relu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    ds = load_dataset(DataSpec(dataset="digits", split="train"))
    tr, te = holdout_split(ds, args.n, args.n_test, seed=0)
    X, y, Xt, yt = tr.X, tr.y, te.X, te.y
    model = build_model(ModelSpec(args.arch, X.shape[1], args.width, 10, seed=0), X)
    train(model, X, y, TrainConfig(lr=4.0, steps=300))
    P_all = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.arch} width {args.width} on digits: n_train={args.n}, n_test={args.n_test}, params={P_all}, last layer={model.a.numel()}"
    )

    # Warm-up: the first torch.func / autograd call in a process pays a one-off start-up
    # cost (~2 s here); it is reported separately and kept out of the timed runs.
    t0 = time.perf_counter()
    compute_influence(model, X[:20], y[:20], Xt[:5], yt[:5], InfluenceConfig(estimator="cg", damping=1.0))
    compute_influence(model, X[:20], y[:20], Xt[:5], yt[:5], InfluenceConfig(estimator="last-layer", damping=1.0))
    dense_influence(model, ["a"], X[:20], y[:20], Xt[:5], yt[:5], 1.0, "mse")
    print(f"one-off warm-up (torch.func start-up, not timed below): {time.perf_counter() - t0:.2f}s")

    damping_ll = 1e-3
    dense_ll, t_dense_ll = timed(
        lambda: dense_influence(model, ["a"], X, y, Xt, yt, damping_ll, "mse")[0], args.repeats
    )
    ll, t_ll = timed(
        lambda: compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=damping_ll)),
        args.repeats,
    )
    print(
        f"last-layer ({model.a.numel()} params): dense {t_dense_ll:.3f}s, last-layer {t_ll:.3f}s, {agreement(ll.total, dense_ll)}"
    )
    generic_cfg = InfluenceConfig(estimator="last-layer", damping=damping_ll, fast_path=False)
    gen, t_gen = timed(lambda: compute_influence(model, X, y, Xt, yt, generic_cfg), args.repeats)
    print(f"last-layer paths: {ll.path} {t_ll:.3f}s, {gen.path} {t_gen:.3f}s, {agreement(ll.total, gen.total)}")

    # A damping that makes H + damping I positive definite (CG needs it): from the dense Hessian.
    H_full = dense_influence(model, ["W", "a"], X, y, Xt[:1], yt[:1], 1.0, "mse")[1]
    damping = max(0.0, -H_full) + 1e-2
    dense_all, t_dense_all = timed(
        lambda: dense_influence(model, ["W", "a"], X, y, Xt, yt, damping, "mse")[0], max(1, args.repeats - 2)
    )
    cg, t_cg = timed(
        lambda: compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=damping, cg_tol=1e-10)),
        args.repeats,
    )
    d = cg.diagnostics
    print(
        f"all {P_all} params (lambda_min(H)={H_full:.3g}, damping={damping:.3g}): dense {t_dense_all:.3f}s, cg {t_cg:.3f}s "
        f"({d['iterations']} iterations, residual {d['relative_residual_max']:.1e}, converged {d['converged']}), "
        f"{agreement(cg.total, dense_all)}"
    )
    print(f"RATIO influence_lastlayer_vs_dense={t_dense_ll / t_ll:.2f}")
    print(f"RATIO influence_cg_vs_dense={t_dense_all / t_cg:.2f}")
    print(f"RATIO influence_fastpath_vs_generic={t_gen / t_ll:.2f}")


if __name__ == "__main__":
    main()
