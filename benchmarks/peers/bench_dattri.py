"""Peer benchmark: exact influence against dattri 0.3.0 ``IFAttributorExplicit`` on the same
model, data, loss and damping.

Both sides: the Hessian H of the mean training loss (1/n) sum_i 0.5 ||f(x_i) - onehot(y_i)||^2
over all parameters, built densely, float64, damping lambda = 1e-2 (absolute; the damped Hessian is positive definite); the score
of training sample i for test sample j is g_train_i^T (H + lambda I)^-1 g_test_j.
attnaudit reports influence = -(that score) (up-weighting a sample that lowers the test loss
is helpful, negative): ``compute_influence(..., InfluenceConfig(estimator="exact",
per_test=True, damping=1e-2))``; dattri: ``IFAttributorExplicit(task, regularization=1e-2)``,
one batch for the training set and one for the test set (dattri rebuilds the Hessian per
pair of batches).

Agreement: max |attnaudit + dattri| / max |dattri| over the (n_train, n_test) matrix.

Tolerance: ``influence_rel_diff`` <= 1e-12 (measured 1.5e-15 and 4.0e-16 on digits, 5.7e-16
and 2.5e-16 on MNIST: both solve the same damped system in float64); the script prints
``AGREEMENT <workload>/influence_rel_diff=<value> tol=1e-12 ok=<true|false>`` and exits 1
after its RATIO lines when it is exceeded.

Workloads: digits (1,437 training x 360 test rows, d = 64, width 32, P = 2,368) and MNIST
(the first 1,000 test-split rows for training, the next 200 as test rows, d = 784, width 4,
P = 3,176; skipped when ../shared/data is absent). Prints
``RATIO influence_exact_vs_dattri=<x>`` per workload.
Run: python benchmarks/peers/bench_dattri.py [--workload digits|mnist|both]
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from _common import SHARED, best_time, check, finish, rel_err, report, require, workload_args
from attnaudit.data import DataSpec, load_dataset
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, train

require("dattri", "dattri")
from dattri.algorithm.influence_function import IFAttributorExplicit  # noqa: E402
from dattri.task import AttributionTask  # noqa: E402

# above -lambda_min of both trained nets: a positive definite, well-posed system
DAMPING = 1e-2
TOL = 1e-12  # see the docstring


def dattri_scores(model, X, y, Xt, yt, c):
    def loss_func(params, data):
        xb, tb = data  # one-hot targets (one_hot itself cannot run under dattri's vmap)
        out = torch.func.functional_call(model, params, (xb,))
        return 0.5 * ((out - tb) ** 2).sum(-1).mean()

    task = AttributionTask(loss_func=loss_func, model=model, checkpoints=model.state_dict())
    attributor = IFAttributorExplicit(task=task, device="cpu", regularization=DAMPING)
    T, Tt = (torch.nn.functional.one_hot(v, c).to(X.dtype) for v in (y, yt))
    train_loader = DataLoader(TensorDataset(X, T), batch_size=X.shape[0], shuffle=False)
    test_loader = DataLoader(TensorDataset(Xt, Tt), batch_size=Xt.shape[0], shuffle=False)
    attributor.cache(train_loader)
    # dattri allocates its damping identity and its output matrix in the default dtype;
    # float64 for the duration of the call, so its scores are not rounded to float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            return attributor.attribute(train_loader, test_loader)
    finally:
        torch.set_default_dtype(previous)


def run(name: str, X, y, Xt, yt, c: int, width: int, repeats: int) -> None:
    model = build_model(ModelSpec("relu", X.shape[1], width, c, seed=0), X).to(torch.float64)
    train(model, X, y, TrainConfig(loss="mse", lr=1.0, steps=50))
    model.eval()
    P = sum(p.numel() for p in model.parameters())
    print(
        f"{name}: n_train={X.shape[0]} n_test={Xt.shape[0]} d={X.shape[1]} width={width} P={P} "
        f"threads={torch.get_num_threads()}"
    )
    config = InfluenceConfig(estimator="exact", per_test=True, damping=DAMPING)
    t_ours, ours = best_time(lambda: compute_influence(model, X, y, Xt, yt, config, loss="mse", n_classes=c), repeats)
    t_peer, theirs = best_time(lambda: dattri_scores(model, X, y, Xt, yt, c), repeats)
    agree = rel_err(-ours.per_test, theirs)
    report(
        "influence_exact_vs_dattri",
        t_ours,
        t_peer,
        f"max |attnaudit + dattri| / max |dattri| = {agree:.1e} (solver: {ours.diagnostics.get('solver', 'eigh')})",
    )
    check(f"{name}/influence_rel_diff", agree, TOL)


def main() -> None:
    args = workload_args(__doc__, repeats=2)
    if args.workload in ("digits", "both"):
        tr = load_dataset(DataSpec(dataset="digits", split="train"))
        te = load_dataset(DataSpec(dataset="digits", split="test"))
        run("digits", tr.X.double(), tr.y, te.X.double(), te.y, tr.n_classes, 32, args.repeats)
    if args.workload in ("mnist", "both"):
        if not (SHARED / "MNIST").exists():
            print(f"SKIP mnist workload: no MNIST under {SHARED}")
            return
        ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=1200, seed=0))
        X, y = ds.X.double(), ds.y
        run("mnist", X[:1000], y[:1000], X[1000:], y[1000:], ds.n_classes, 4, args.repeats)


if __name__ == "__main__":
    main()
    finish()
