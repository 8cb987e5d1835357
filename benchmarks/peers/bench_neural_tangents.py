"""Peer benchmark: the analytic (infinite-width) NTK of the 2-layer ReLU net against
neural-tangents 0.6.5 (``stax`` kernel_fn, jit-compiled, CPU, float64).

The same kernel on both sides: f(x) = a^T relu(W x / sqrt(d)) / sqrt(m), NTK
parametrisation, no biases, so

    Theta(x, x') = (x.x'/d) kappa0(theta) + (|x||x'|/d) kappa1(theta)

(neural-tangents: ``serial(Dense(w, W_std=1, b_std=None), Relu(), Dense(1, W_std=1,
b_std=None))``, ``kernel_fn(X, None, "ntk")``). attnaudit: ``attnaudit.core.ntk.analytic_ntk``
(matrix-product form, near-collinear pairs recomputed from explicit differences).

Agreement: the two kernels against each other, and both against a 200-bit mpmath
reference on 400 pairs (the 200 most nearly collinear ones, where cancellation bites, and
200 at random).

Tolerances (the script exits 1 after its RATIO lines when one is exceeded; each check prints
``AGREEMENT <workload>/<measure>=<value> tol=<tol> ok=<true|false>``):

* ``ntk_attnaudit_vs_reference`` <= 1e-13: attnaudit's max relative error against the 200-bit
  reference on the 400 pairs (measured 5.4e-16 digits, 1.2e-15 / 1.1e-15 MNIST; the unit
  tests hold it to 4e-15);
* ``ntk_rel_diff`` <= 1e-7: max |attnaudit - neural-tangents| / max |neural-tangents| over
  the whole kernel (measured 5.5e-16 digits; 7.3e-9 / 6.9e-9 on MNIST, where neural-tangents'
  arccos of a dot product near 1 loses half the digits at near-duplicate images, an error of
  order sqrt(machine epsilon) = 1.5e-8 at most).

Workloads: digits (1,437 x 64) and the MNIST test split (n = 2,000 and 10,000, d = 784;
skipped when ../shared/data is absent). Prints ``RATIO analytic_ntk_vs_neural_tangents=<x>``
per workload.
Run: python benchmarks/peers/bench_neural_tangents.py [--workload digits|mnist|both]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import torch

from _common import SHARED, best_time, check, finish, report, require, workload_args
from attnaudit.data import DataSpec, load_dataset
from attnaudit.core.ntk import analytic_ntk

jax = require("jax", "jax")
jax.config.update("jax_enable_x64", True)
nt = require("neural_tangents", "neural-tangents")
mpmath = require("mpmath", "mpmath")

TOL_REFERENCE, TOL_MUTUAL = 1e-13, 1e-7  # see the docstring


def reference(X: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Theta on the given (i, j) pairs in 200-bit arithmetic."""
    mpmath.mp.prec = 200
    d = X.shape[1]
    out = []
    for i, j in pairs:
        u = [mpmath.mpf(float(v)) for v in X[i]]
        w = [mpmath.mpf(float(v)) for v in X[j]]
        dot = mpmath.fsum(a * b for a, b in zip(u, w))
        nu, nw = mpmath.sqrt(mpmath.fsum(a * a for a in u)), mpmath.sqrt(mpmath.fsum(b * b for b in w))
        diff = mpmath.sqrt(mpmath.fsum((a / nu - b / nw) ** 2 for a, b in zip(u, w)))
        summ = mpmath.sqrt(mpmath.fsum((a / nu + b / nw) ** 2 for a, b in zip(u, w)))
        th = 2 * mpmath.atan2(diff, summ)
        k0 = (mpmath.pi - th) / (2 * mpmath.pi)
        k1 = (mpmath.sin(th) + (mpmath.pi - th) * mpmath.cos(th)) / (2 * mpmath.pi)
        out.append(float(dot / d * k0 + nu * nw / d * k1))
    return np.array(out)


def run(name: str, X: torch.Tensor, repeats: int) -> None:
    X = X.to(torch.float64).contiguous()
    Xn = np.asarray(X.numpy())
    print(f"{name}: n={X.shape[0]} d={X.shape[1]} threads={torch.get_num_threads()}")
    _, _, kernel_fn = nt.stax.serial(
        nt.stax.Dense(512, W_std=1.0, b_std=None), nt.stax.Relu(), nt.stax.Dense(1, W_std=1.0, b_std=None)
    )
    kfn = jax.jit(kernel_fn, static_argnames="get")

    def peer():
        return np.asarray(kfn(Xn, None, get="ntk").block_until_ready())

    t_ours, ours = best_time(lambda: analytic_ntk(X), repeats)
    t_peer, theirs = best_time(peer, repeats)
    ours = ours.numpy()
    mutual = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    # pairs: the most nearly collinear off-diagonal ones, and random ones
    rng = np.random.default_rng(0)
    U = Xn / np.linalg.norm(Xn, axis=1, keepdims=True)
    sub = rng.choice(X.shape[0], size=min(X.shape[0], 1500), replace=False)
    cos = U[sub] @ U[sub].T
    np.fill_diagonal(cos, -2)
    top = np.argsort(cos, axis=None)[::-1][:400:2]  # symmetric: every other one
    close = np.stack(np.unravel_index(top, cos.shape), 1)
    close = np.stack([sub[close[:, 0]], sub[close[:, 1]]], 1)
    rand = rng.integers(0, X.shape[0], size=(200, 2))
    pairs = np.concatenate([close, rand])
    ref = reference(Xn, pairs)
    e_ours = float(np.max(np.abs(ours[pairs[:, 0], pairs[:, 1]] - ref) / np.abs(ref)))
    e_peer = float(np.max(np.abs(theirs[pairs[:, 0], pairs[:, 1]] - ref) / np.abs(ref)))
    report(
        "analytic_ntk_vs_neural_tangents",
        t_ours,
        t_peer,
        f"max rel diff between them {mutual:.1e}; vs 200-bit reference on {len(pairs)} pairs: "
        f"attnaudit {e_ours:.1e}, neural-tangents {e_peer:.1e}",
    )
    check(f"{name}/ntk_attnaudit_vs_reference", e_ours, TOL_REFERENCE)
    check(f"{name}/ntk_rel_diff", mutual, TOL_MUTUAL)


def main() -> None:
    args = workload_args(__doc__, repeats=5)
    if args.workload in ("digits", "both"):
        run("digits", load_dataset(DataSpec(dataset="digits", split="train")).X, args.repeats)
    if args.workload in ("mnist", "both"):
        if not (SHARED / "MNIST").exists():
            print(f"SKIP mnist workload: no MNIST under {SHARED}")
            return
        for n in (2000, 10000):
            X = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n, seed=0)).X
            run(f"mnist-{n}", X, max(1, args.repeats - 2))


if __name__ == "__main__":
    main()
    finish()
