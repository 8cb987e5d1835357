"""K-FAC / EK-FAC scoring of the training samples from per-layer outer products
(attnaudit.analyses.influence.kfac.layer_gradient_scores) against the per-sample gradients
over all parameters (``InfluenceConfig(fast_path=False)``) and against torch.func's own
per-sample gradients.

The influence of K-FAC is -g_train . (F + lambda I)^-1 g_test with the preconditioned test
gradient zero outside the covered layers, so only the covered layers' gradients enter; the
fast path forms them layer by layer as sum_t s_t a_t^T and must give the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnaudit.analyses.influence.influence import InfluenceConfig, influence_sweep
from attnaudit.analyses.influence.kfac import layer_gradient_scores, linear_blocks, shared_weights
from attnaudit.core import Engine
from attnaudit.core.task import Task

from layer_models import AttentionNet, ConvNet

F64 = torch.float64


class _Tied(nn.Module):
    """A linear layer whose weight is also used, transposed, by the output layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 6, bias=False, dtype=F64)
        self.mid = nn.Linear(6, 16, dtype=F64)
        self.mid.weight = nn.Parameter(self.inp.weight.detach().T.contiguous())
        self.out = nn.Linear(16, 3, dtype=F64)
        self.out2 = self.mid  # the same module under a second name: its weight is shared

    def forward(self, x):
        return self.out(torch.tanh(self.out2(torch.tanh(self.inp(x)))))


def _data(n, d=16, classes=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=F64), torch.randint(0, classes, (n,), generator=gen)


def _vit():
    from attnaudit.models.vit import ViT, ViTSpec

    return ViT(ViTSpec("vit", (1, 8, 8), 3, depth=2, dim=8, heads=2, patch=4, mlp_ratio=2), dtype=F64)


CASES = {
    "attention": (lambda: AttentionNet(), 16, "ce"),
    "conv": (lambda: ConvNet(), 64, "ce"),
    "vit": (_vit, 64, "mse"),
}


@pytest.mark.parametrize("estimator", ["kfac", "ekfac"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_layer_scores_equal_the_per_sample_gradient_path(case, estimator):
    build, d, loss = CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    X, y = _data(30, d)
    task = Task(model, 3, loss, inputs=model.audit_inputs()) if hasattr(model, "audit_inputs") else Task(model, 3, loss)
    cfg = InfluenceConfig(estimator=estimator, per_test=True, chunk_size=7)  # several chunks
    dampings = [0.1, "1x"]
    fast = influence_sweep(task, X[:20], y[:20], X[20:], y[20:], cfg, dampings=dampings)
    slow = influence_sweep(
        task, X[:20], y[:20], X[20:], y[20:], InfluenceConfig(**{**cfg.__dict__, "fast_path": False}), dampings=dampings
    )
    for f, s in zip(fast, slow):
        assert f.diagnostics["train_gradients"] == "per-layer outer products"
        assert s.diagnostics["train_gradients"] == "per-sample gradients"
        assert float(s.per_test.abs().max()) > 1e-8  # not a comparison of zeros
        torch.testing.assert_close(f.per_test, s.per_test, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(f.total, s.total, rtol=1e-9, atol=1e-12)
    if case == "attention":  # the LayerNorm is tracked but not covered: it must not enter either path
        assert {"norm.weight", "norm.bias"} <= set(fast[0].diagnostics["excluded_parameters"])


def test_layer_scores_are_the_products_of_torch_func_per_sample_gradients():
    """Against per-sample gradients written out here with torch.func (not the engine's code),
    with random vectors on the covered layers and zeros elsewhere."""
    torch.manual_seed(0)
    model = AttentionNet().eval()
    X, y = _data(9, 16)
    eng = Engine(Task(model, 3, "ce"), dtype=F64)
    blocks, excluded = linear_blocks(eng)
    assert excluded  # the LayerNorm
    gen = torch.Generator().manual_seed(3)
    V = torch.randn(eng.n_params, 4, generator=gen, dtype=F64)
    start = 0
    for name, k in zip(eng.names, eng.numels):
        if name in excluded:
            V[start : start + k] = 0.0
        start += k
    ours = layer_gradient_scores(eng, blocks, V, X, eng.targets(y))

    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in eng.names}

    def loss(p, x, t):
        logits = torch.func.functional_call(model, p, (x[None],))
        return torch.nn.functional.cross_entropy(logits, t[None], reduction="sum")

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, X, y)
    G = torch.cat([grads[n].reshape(X.shape[0], -1) for n in eng.names], 1)
    torch.testing.assert_close(ours, G @ V, rtol=1e-10, atol=1e-12)


def test_tied_weights_fall_back_to_per_sample_gradients():
    torch.manual_seed(0)
    model = _Tied().eval()
    eng = Engine(Task(model, 3, "ce"), dtype=F64)
    blocks, _ = linear_blocks(eng)
    assert shared_weights(model, blocks)
    X, y = _data(12)
    res = influence_sweep(Task(model, 3, "ce"), X[:8], y[:8], X[8:], y[8:], InfluenceConfig(estimator="ekfac"))
    assert res[0].diagnostics["train_gradients"] == "per-sample gradients"
    assert not shared_weights(AttentionNet(), linear_blocks(Engine(Task(AttentionNet(), 3, "ce"), dtype=F64))[0])


def test_the_planner_sizes_kfac_chunks_by_its_largest_layer_not_by_all_parameters():
    """K-FAC forms one layer's per-sample gradients at a time, so a chunk reserves the
    largest covered layer (50 x 21 = 1,050 entries per row here), not all 1,203 parameters,
    plus what the fit and the scores capture per row: each layer's inputs with the bias column
    and its output gradients, each twice (as captured and rotated), one token per flat row:
    2 (21 + 50) + 2 (51 + 3) = 250; with fast_path=False (per-sample gradients over
    everything) it is P again."""
    import torch
    from torch import nn

    from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 50), nn.Tanh(), nn.Linear(50, 3)).double()
    X, y = torch.randn(40, 20, dtype=torch.float64), torch.randint(0, 3, (40,))
    for fast, per_row in ((True, 50 * 21 + 250), (False, 50 * 21 + 3 * 51)):
        cfg = InfluenceConfig(estimator="ekfac", params="all", damping=1e-3, fast_path=fast)
        res = compute_influence(model, X, y, X[:5], y[:5], cfg, loss="ce")
        mem, chunk = res.diagnostics["memory_estimate_bytes"], res.diagnostics["chunk_size"]
        assert mem["gradient_chunk"] == min(chunk, 40) * per_row * 8  # a chunk never exceeds the 40 rows


def test_factors_fitted_without_covariances_precondition_the_same_and_hold_less():
    import torch
    from torch import nn

    from attnaudit.analyses.influence.kfac import fit_factors, kfac_memory_bytes, linear_blocks
    from attnaudit.core.engine import Engine
    from attnaudit.core.task import Task

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)).double()
    X = torch.randn(30, 6, dtype=torch.float64)
    eng = Engine(Task(model, 3, "ce"), dtype=torch.float64)
    kept = fit_factors(eng, X, "ekfac", chunk=8)
    freed = fit_factors(eng, X, "ekfac", chunk=8, keep_covariances=False)
    assert all(b.A is None and b.S is None for b in freed.blocks)
    G = torch.randn(4, eng.n_params, dtype=torch.float64)
    assert torch.equal(kept.precondition(G, eng, 1e-3), freed.precondition(G, eng, 1e-3))
    # peak bytes: (7^2 + 9^2 + 10^2 + 3^2) eigenvectors + max(7^2 + 9^2, 10^2 + 3^2) in flight
    # + (9 x 7 + 3 x 10) corrected eigenvalues, against twice the squares when A and S are kept
    blocks = linear_blocks(eng)[0]
    assert kfac_memory_bytes(blocks, keep_covariances=False) == 8 * (239 + 130 + 93)
    assert kfac_memory_bytes(blocks) == 8 * (2 * 239 + 93)


def test_a_refusal_names_a_memory_budget_that_then_runs():
    import re

    import pytest
    import torch
    from torch import nn

    from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
    from attnaudit.errors import AuditError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 3)).double()
    X, y = torch.randn(40, 30, dtype=torch.float64), torch.randint(0, 3, (40,))
    cfg = dict(estimator="ekfac", params="all", damping=1e-3)
    with pytest.raises(AuditError, match="memory budget") as refused:
        compute_influence(model, X, y, X[:5], y[:5], InfluenceConfig(**cfg, memory_budget_mb=0.01), loss="ce")
    needed = int(re.search(r"memory budget to (\d+) MiB or more", str(refused.value)).group(1))
    res = compute_influence(model, X, y, X[:5], y[:5], InfluenceConfig(**cfg, memory_budget_mb=needed), loss="ce")
    assert res.diagnostics["memory_estimate_bytes"]["total"] <= needed * 2**20
    with pytest.raises(AuditError, match="positive number of MiB"):
        InfluenceConfig(**cfg, memory_budget_mb=-1)


def test_float32_scores_over_a_wide_layer_are_summed_in_float64():
    """One 2048 x 2048 linear layer (4.2 M weights): the float32 scores against the float64 ones of
    the same model and vectors. The gradients agree to float32's round-off; a float32 product over
    the 4.2 M weights had put them 4.0e-5 apart (measured), float64 sums keep them within 5e-6."""
    gen = torch.Generator().manual_seed(5)
    model = nn.Linear(2048, 2048, bias=False).eval()
    with torch.no_grad():
        model.weight.copy_(torch.randn(2048, 2048, generator=gen) / 45)
    X = torch.rand(4, 2048, generator=gen)
    y = torch.randint(0, 2048, (4,), generator=gen)
    V = torch.rand(2048 * 2048, 2, generator=gen)  # positive: no cancellation hides the error
    scores = {}
    for dtype in (torch.float32, F64):
        eng = Engine(Task(model, 2048, "mse"), dtype=dtype)
        blocks, _ = linear_blocks(eng)
        scores[dtype] = layer_gradient_scores(eng, blocks, V.to(dtype), X.to(dtype), eng.targets(y))
    low, exact = scores[torch.float32].double(), scores[F64]
    assert float((low - exact).norm() / exact.norm()) < 5e-6
