"""Fast path: structured surface evaluation of the built-in two-layer nets.

**When it applies** (:func:`unavailable` returns None): the task's module is a
:class:`~attnaudit.models.builtin.TwoLayerNet` whose ``forward``, ``mlp``, ``hidden``,
``features_in`` and ``preactivation_scale`` are TwoLayerNet's own (no subclass overrides),
the tracked parameters are among ``W`` and ``a``, and the inputs are flat rows passed
positionally. Anything else takes the generic engine path, which gives the same numbers
(tested to float64 round-off on both built-in models).

**What it does.** The first-layer preactivation is linear in the grid coordinates:
preact(c) = s_in F (W + sum_j c_j DW_j)^T = Z0 + sum_j c_j Z_j, exactly. F W^T is formed
once per direction (D + 1 products of size n x d x m) instead of once per point; each point
then costs O(n m c).
"""

from __future__ import annotations

import torch

from attnaudit.core.engine import Engine
from attnaudit.models.builtin import TwoLayerNet, two_layer_fast_path_blocker

FAST_PATH = "fast: TwoLayerNet structured evaluation"


def unavailable(engine: Engine) -> str | None:
    """None when the structured evaluation applies to ``engine``'s task, else the reason it does not."""

    blocker = two_layer_fast_path_blocker(engine.module, engine.inputs)
    if blocker:
        return blocker
    if not set(engine.names) <= {"W", "a"}:
        return f"tracked parameters {engine.names} are not among W and a"
    return None


def sizes(engine: Engine, n_dirs: int) -> tuple[float, float, float]:
    """(activations per sample and point, preactivation tables per sample, fixed elements per point)."""
    module = engine.module
    assert isinstance(module, TwoLayerNet)  # the fast path applies (unavailable(engine) is None)
    m = module.W.shape[0]
    c = engine.n_classes
    return m + c, (n_dirs + 1) * m, module.a.numel()


def chunk(engine: Engine, theta0: torch.Tensor, D: torch.Tensor, Xc: torch.Tensor, Tc: torch.Tensor, yc: torch.Tensor):
    """Evaluator over one sample chunk: coefficients (B, k) -> (summed losses (B,), correct counts (B,)).

    Preactivations are kept transposed (m, n), so a batch of points is one addmm (a single
    pass over memory) with the ReLU in place, and the output layer is a (c x m) @ (m x n)
    product per point, the faster layout for small c (measured). Uses the engine's copies
    of the parameters and the attention context, never the module's own tensors.
    """
    module = engine.module
    assert isinstance(module, TwoLayerNet)  # the fast path applies (unavailable(engine) is None)
    s_in, s_out = module.preactivation_scale()
    state = {**engine.frozen, **engine.unflatten(theta0)}
    k = D.shape[0]
    stack = {
        name: part.reshape(k, *shape).contiguous()
        for name, part, shape in zip(engine.names, torch.split(D, engine.numels, dim=1), engine.shapes)
    }
    context = state.get("context")
    F = Xc if context is None else Xc @ context  # TwoLayerNet.features_in (the context is symmetric)
    W0, a0 = state["W"], state["a"]
    n, m, c = F.shape[0], W0.shape[0], a0.shape[1]
    Z0 = (W0 @ F.T * s_in).reshape(1, m * n)
    # [Z0; Z_1..Z_D] with coefficients [1, c]: one mm per batch, no broadcast copy of Z0
    ZD = torch.cat([Z0, torch.einsum("nd,jmd->jmn", F, stack["W"]).reshape(-1, m * n) * s_in]) if "W" in stack else None
    DA = stack["a"].transpose(1, 2).reshape(-1, c * m) if "a" in stack else None
    aT = a0.T.contiguous()
    aT_flat = aT.reshape(1, c * m)
    per_sample = engine.loss.per_sample

    def run(coef: torch.Tensor, batched: bool):
        cb = coef if batched else coef[None]
        B = cb.shape[0]
        if ZD is not None:
            ones = torch.ones(B, 1, dtype=cb.dtype, device=cb.device)
            HT = torch.mm(torch.cat([ones, cb], 1), ZD).clamp_min_(0).view(B, m, n)
        else:
            HT = Z0.clamp_min(0).view(1, m, n).expand(B, m, n)
        if DA is not None:
            outT = torch.bmm(torch.addmm(aT_flat, cb, DA).view(B, c, m), HT)
        else:
            outT = torch.matmul(aT, HT)
        out = (outT * s_out).transpose(1, 2).contiguous()  # (B, n, c); small, and argmax wants it contiguous
        ls = per_sample(out, Tc).sum(-1)
        cs = (out.argmax(-1) == yc).sum(-1)
        return (ls, cs) if batched else (ls[0], cs[0])

    return run
