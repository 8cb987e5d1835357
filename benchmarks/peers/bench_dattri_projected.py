"""Peer benchmark: projected influence (LoGra / TRAK-style) against dattri 0.3.0's
``LoGraAttributor`` on the same model, data, loss and projection dimension.

Model: an MLP of ``nn.Linear`` layers (d -> 32 -> tanh -> 10), trained 300 steps of full-batch
GD on cross-entropy, float64; the score of training sample i for test sample j.

* attnaudit: ``compute_influence(..., InfluenceConfig(estimator="projected", curvature="empirical",
  proj_dim=2 * 64, damping="0.1x", per_test=True))``: both layers' gradients projected through
  their inputs and output gradients (orthonormal seeded factors, the 128 dimensions split in
  proportion to the layers' sizes), the empirical Fisher in the projected space over both
  layers (one k x k matrix), damping 0.1 x its largest eigenvalue; influence = -(score).
* dattri: ``LoGraAttributor(task, hessian="eFIM", proj_dim=64, damping=0.1)``: per layer 8 x 8
  Gaussian factors (64 dimensions a layer, 128 in all), the empirical Fisher of each layer on
  its own (block diagonal), damping 0.1 x its trace / dimension, float32 inverse.

The two differ by design in the random matrices, the split of k between layers, the
block-diagonal curvature and the damping rule, so they agree only as far as the projections
preserve the scores: the check is on Pearson's correlation of the (n_train, n_test) matrices,
``AGREEMENT <workload>/one_minus_pearson=<value> tol=0.5`` (measured: see
docs/malleability.md). Prints ``RATIO projected_vs_dattri=<ours / theirs>`` per workload
(best of ``--repeats`` after a warm-up, one thread each).

Run: python benchmarks/peers/bench_dattri_projected.py [--workload digits|mnist|both]
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import SHARED, best_time, check, finish, report, require, workload_args
from attnaudit.analyses.influence.estimators.projected import clear_row_cache
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.core.training import TrainConfig, train
from attnaudit.data import DataSpec, load_dataset

require("dattri", "dattri")
from dattri.algorithm.logra import LoGraAttributor  # noqa: E402
from dattri.task import AttributionTask  # noqa: E402

PER_LAYER = 64  # dattri's proj_dim (per layer, 8 x 8); ours: the same total, 2 x 64
TOL = 0.5  # 1 - Pearson


def dattri_scores(model, X, y, Xt, yt):
    def loss_func(m, batch, device):  # summed: per-sample gradients at unit weight
        xb, yb = batch
        return nn.functional.cross_entropy(m(xb.to(device)), yb.to(device), reduction="sum")

    # dattri 0.3.0 sizes its projections on the first row of the first batch (``sample_inputs[0]``),
    # which is 1-D for flat rows; rows of shape (1, d) and a Flatten in front of the same layers
    # make that row (1, d) and leave every computation unchanged
    wrapped = nn.Sequential(nn.Flatten(), *model)
    task = AttributionTask(loss_func=loss_func, model=wrapped, checkpoints=wrapped.state_dict())
    attributor = LoGraAttributor(  # cache_dir: dattri writes batch_metadata.json there (default: the current folder)
        task,
        hessian="eFIM",
        damping=0.1,
        device="cpu",
        proj_dim=PER_LAYER,
        offload="none",
        cache_dir=tempfile.mkdtemp(prefix="bench-dattri-logra-"),
    )
    train_loader = DataLoader(TensorDataset(X[:, None], y), batch_size=64, shuffle=False)
    test_loader = DataLoader(TensorDataset(Xt[:, None], yt), batch_size=Xt.shape[0], shuffle=False)
    attributor.cache(train_loader)
    return attributor.attribute(train_loader, test_loader)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def run(name: str, X, y, Xt, yt, repeats: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(X.shape[1], 32), nn.Tanh(), nn.Linear(32, 10)).to(torch.float64)
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=300))
    model.eval()
    P = sum(p.numel() for p in model.parameters())
    print(f"{name}: n_train={X.shape[0]} n_test={Xt.shape[0]} d={X.shape[1]} P={P} threads={torch.get_num_threads()}")
    config = InfluenceConfig(
        estimator="projected", curvature="empirical", proj_dim=2 * PER_LAYER, damping="0.1x", per_test=True
    )

    def ours():
        clear_row_cache()  # no reuse between repeats: every run projects every row
        return compute_influence(model, X, y, Xt, yt, config, loss="ce").per_test

    t_ours, mine = best_time(ours, repeats)
    t_peer, theirs = best_time(lambda: dattri_scores(model, X, y, Xt, yt), repeats)
    r = pearson(-mine, theirs)
    report("projected_vs_dattri", t_ours, t_peer, f"Pearson {r:.3f} (sign flipped: dattri scores = -influence)")
    check(f"{name}/one_minus_pearson", 1 - r, TOL)


def main() -> None:
    args = workload_args(__doc__, repeats=3)
    if args.workload in ("digits", "both"):
        ds = load_dataset(DataSpec(dataset="digits", split="train"))
        X, y = ds.X.to(torch.float64), ds.y
        run("digits", X[:1000], y[:1000], X[1000:1200], y[1000:1200], args.repeats)
    if args.workload in ("mnist", "both"):
        if not (SHARED / "MNIST").exists():
            print(f"SKIP mnist workload: no MNIST under {SHARED}")
        else:
            ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=1200, seed=0))
            X, y = ds.X.to(torch.float64), ds.y
            run("mnist", X[:1000], y[:1000], X[1000:], y[1000:], args.repeats)
    finish()


if __name__ == "__main__":
    main()
