"""Peer benchmark: top-5 Hessian eigenvalues (Lanczos, 20 steps) and Hutchinson's trace
(30 probes) against hessian-eigenthings 1.0.0a5 on the same model, data and loss.

Both sides apply the Hessian of the mean MSE loss (1/n) sum_i 0.5 ||f(x_i) - onehot(y_i)||^2
over all parameters, float64, full batch. attnaudit: ``Engine.hvp_operator`` with
``lanczos_top_eigen`` / ``hutchinson_trace`` (what ``attnaudit landscape`` runs);
peer: ``HessianOperator`` (autograd double-backward) with ``lanczos(which="LA")`` /
``hutchinson`` (Rademacher probes).

Agreement: Lanczos from the same start vector (both draw ``torch.randn`` from a generator
seeded 0), so the Ritz values must agree to round-off; Hutchinson draws its own probes on
each side, so each estimate is compared with the exact trace (dense Hessian) in standard
errors, and one Hessian-vector product is compared directly.

Tolerances (the script exits 1 after its RATIO lines when one is exceeded; each check prints
``AGREEMENT <workload>/<measure>=<value> tol=<tol> ok=<true|false>``):

* ``hvp_rel_diff`` <= 1e-10: one Hessian-vector product, max |difference| / max |peer|
  (measured bitwise equal; the engine's two AD modes agree to 5e-16);
* ``lanczos_ritz_rel_diff`` <= 1e-6: the top-5 Ritz values, max |difference| / max |peer|
  (measured 2.0e-8 digits, 2.9e-8 MNIST: the two re-orthogonalise differently);
* ``hutchinson_diff_se`` <= 4: |attnaudit - peer| / sqrt(SE_attnaudit^2 + SE_peer^2)
  (measured 0: the same probes give identical estimates; 4 standard errors would also
  hold for independent probes, 30 probes: P(|t| > 4) < 1e-3);
* ``hutchinson_se_from_exact`` <= 4 (digits, where the dense Hessian is built): attnaudit's
  estimate against the exact trace in its own standard errors (measured -0.65).

Workloads: digits (1,437 x 64, width 32, P = 2,368) and MNIST (n = 2,000 x 784, width 256,
P = 203,786; skipped when ../shared/data is absent).

Prints ``RATIO lanczos_vs_hessian_eigenthings=<x>`` and
``RATIO hutchinson_vs_hessian_eigenthings=<x>`` per workload (the digits line first).
Run: python benchmarks/peers/bench_hessian_eigenthings.py [--workload digits|mnist|both]
"""

from __future__ import annotations

import torch

from _common import best_time, check, finish, rel_err, report, require, workload, workload_args
from attnaudit.core import Engine, as_task, hutchinson_trace, lanczos_top_eigen

he = require("hessian_eigenthings", "hessian-eigenthings")

TOL_HVP, TOL_RITZ, TOL_SE = 1e-10, 1e-6, 4.0  # see the docstring


def peer_operator(model, X, y, c):
    T = torch.nn.functional.one_hot(y, c).to(X.dtype)

    def loss_fn(m, batch):
        xb, tb = batch
        return 0.5 * ((m(xb) - tb) ** 2).sum(1).mean()

    return he.HessianOperator(model, [(X, T)], loss_fn)


def run(name: str, n: int | None, width: int, repeats: int) -> None:
    w = workload(name, n=n, width=width)
    if w is None:
        return
    print(w.describe(), f"threads={torch.get_num_threads()}")
    eng = Engine(as_task(w.model, loss="mse", n_classes=w.n_classes))
    T = eng.targets(w.y)
    P = eng.n_params

    def ours_hvp():
        return eng.hvp_operator(w.X, T)

    op = peer_operator(w.model, w.X, w.y, w.n_classes)
    v = torch.randn(P, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    hv_err = rel_err(ours_hvp().matvec(v), op.matvec(v))
    print(f"  one Hessian-vector product: max rel diff {hv_err:.1e}")
    check(f"{name}/hvp_rel_diff", hv_err, TOL_HVP)

    # --- Lanczos: top 5, exactly 20 steps on each side (tol 1e-300 never stops early)
    t_ours, ours = best_time(lambda: lanczos_top_eigen(ours_hvp(), P, 5, max_steps=20, tol=1e-300, seed=0), repeats)
    t_peer, peer = best_time(lambda: he.lanczos(op, k=5, max_iter=20, which="LA", seed=0, tol=1e-300), repeats)
    agree = rel_err(torch.tensor(ours.eigenvalues), peer.eigenvalues)
    print(f"  Lanczos top-5: attnaudit {['%.6g' % e for e in ours.eigenvalues]}")
    report("lanczos_vs_hessian_eigenthings", t_ours, t_peer, f"Ritz values max rel diff {agree:.1e}")
    check(f"{name}/lanczos_ritz_rel_diff", agree, TOL_RITZ)

    # --- Hutchinson: 30 Rademacher probes each, no deflation
    t_ours, tr = best_time(lambda: hutchinson_trace(ours_hvp(), P, 30, seed=0), repeats)
    t_peer, ptr = best_time(lambda: he.hutchinson(op, num_samples=30, seed=0), repeats)
    exact = None
    if P <= 5000:
        exact = float(torch.diagonal(ours_hvp().dense(block=64)).sum())
        z_ours, z_peer = (tr.estimate - exact) / tr.stderr, (ptr.estimate - exact) / ptr.stderr
        agreement = (
            f"exact trace {exact:.6g}; attnaudit {tr.estimate:.6g} +- {tr.stderr:.2g} ({z_ours:+.2f} SE), "
            f"peer {ptr.estimate:.6g} +- {ptr.stderr:.2g} ({z_peer:+.2f} SE)"
        )
    else:
        agreement = f"attnaudit {tr.estimate:.6g} +- {tr.stderr:.2g}, peer {ptr.estimate:.6g} +- {ptr.stderr:.2g}; HVP rel diff {hv_err:.1e}"
    report("hutchinson_vs_hessian_eigenthings", t_ours, t_peer, agreement)
    check(f"{name}/hutchinson_diff_se", abs(tr.estimate - ptr.estimate) / (tr.stderr**2 + ptr.stderr**2) ** 0.5, TOL_SE)
    if exact is not None:
        check(f"{name}/hutchinson_se_from_exact", abs(z_ours), TOL_SE)


def main() -> None:
    args = workload_args(__doc__, repeats=5)
    if args.workload in ("digits", "both"):
        run("digits", None, 32, args.repeats)
    if args.workload in ("mnist", "both"):
        run("mnist", 2000, 256, max(1, args.repeats - 2))


if __name__ == "__main__":
    main()
    finish()
