"""Per-sample gradients of the parameters outside linear layers, from the backward passes the
linear layers already take.

The projected estimator needs, for every training row, the gradient (or, for the Gauss-Newton
curvature, the c logit gradients) with respect to every tracked parameter. Linear layers get
theirs from captured activations and output gradients (Kronecker form). The rest, LayerNorm
scales and shifts, position embeddings and class tokens, went through per-sample Jacobians
(``vmap(jacrev)``), which runs the network again under vmap: 76 % of the estimator's time on
the MNIST ViT (3.7 of 4.8 s). Two structures cover those parameters in ordinary transformers;
each is declared by when it applies and verified before it is used:

* ``layernorm``: an ``nn.LayerNorm`` with an elementwise affine, y = xhat * gamma + beta over
  its normalised dimensions. With g the gradient at the module's output (captured in the same
  backward pass), sample i's gradients are d/dgamma = sum_t g_it * xhat_it and d/dbeta =
  sum_t g_it, xhat recomputed from the captured input (the leading dimension of the input
  must be the batch).
* ``batched``: a parameter the forward only broadcasts against the batch (``h + pos_embed``,
  ``cls.expand(B, -1, -1)``) is replaced by B copies of shape (B, *shape) (or (B, *shape[1:])
  when its leading dimension is 1); sample b then reads copy b alone, so the gradient that
  reaches copy b is sample b's.

Verification (:func:`verify_plan`): on two rows, every parameter's per-sample gradients from
the plan are compared with plain autograd over the same parameters, one row and one output at
a time (relative 1e-8 in float64, 1e-3 in lower precision; ``vmap(jacrev)`` held rows x
outputs copies of theta, 4.5 GiB on two rows of a DistilBERT-size model); a parameter whose rows differ, or whose replacement
changes the logits, goes back to the generic path. Everything not covered stays generic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["OtherCapture", "OtherPlan", "plan_other"]


@dataclass
class OtherPlan:
    """How each parameter outside the linear layers gets its per-sample gradients.

    ``layernorm``: module path -> (weight name or None, bias name or None); ``batched``:
    parameter name -> 0 (copies of shape (B, *shape)) or 1 (leading 1 replaced by B);
    ``generic``: the rest, through per-sample Jacobians."""

    layernorm: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    batched: dict[str, int] = field(default_factory=dict)
    generic: list[str] = field(default_factory=list)

    @property
    def fast(self) -> list[str]:
        names = [n for pair in self.layernorm.values() for n in pair if n is not None]
        return names + list(self.batched)

    def without(self, names: set[str]) -> OtherPlan:
        """The plan with ``names`` moved to the generic path (a LayerNorm keeps its other half)."""
        layernorm = {}
        for path, (w, b) in self.layernorm.items():
            w2, b2 = (None if w in names else w), (None if b in names else b)
            if w2 is not None or b2 is not None:
                layernorm[path] = (w2, b2)
        batched = {n: m for n, m in self.batched.items() if n not in names}
        return OtherPlan(layernorm, batched, self.generic + [n for n in self.fast if n in names])


def plan_other(engine: Any, names: list[str]) -> OtherPlan:
    """The structural plan for tracked parameters ``names`` (not yet verified): LayerNorm
    affines first, then any other parameter as a batched candidate."""
    wanted = set(names)
    plan = OtherPlan()
    taken: set[str] = set()
    for path, module in engine.module.named_modules():
        if not isinstance(module, nn.LayerNorm) or not module.elementwise_affine:
            continue
        prefix = f"{path}." if path else ""
        w = f"{prefix}weight" if f"{prefix}weight" in wanted else None
        b = f"{prefix}bias" if f"{prefix}bias" in wanted and module.bias is not None else None
        if w or b:
            plan.layernorm[path] = (w, b)
            taken.update(n for n in (w, b) if n)
    for name in names:
        if name in taken:
            continue
        shape = engine.shapes[engine.names.index(name)]
        plan.batched[name] = 1 if len(shape) >= 1 and shape[0] == 1 else 0
    return plan


class OtherCapture:
    """One forward pass's bookkeeping for a plan: ``overrides`` (the batched copies, leaves
    that require grad) for :meth:`Engine.apply`, hooks that capture every planned LayerNorm's
    input and output, ``targets()`` to add to ``torch.autograd.grad``'s inputs, and
    :meth:`rows` to turn those gradients into per-sample gradients (B, numel) per name."""

    def __init__(self, engine: Any, plan: OtherPlan, B: int):
        self.plan, self.B = plan, B
        values = engine.unflatten(engine.theta.detach())
        self.overrides: dict[str, torch.Tensor] = {}
        for name, mode in plan.batched.items():
            v = values[name]
            shape = (B, *v.shape[1:]) if mode == 1 else (B, *v.shape)
            self.overrides[name] = (v if mode == 1 else v.unsqueeze(0)).expand(shape).clone().requires_grad_(True)
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {path: [] for path in plan.layernorm}
        self._modules = {path: m for path, m in engine.module.named_modules() if path in plan.layernorm}
        self._hooks = [self._modules[path].register_forward_hook(self._hook_for(path)) for path in plan.layernorm]

    def _hook_for(self, path: str):
        def hook(module, args, out):
            self.calls[path].append((args[0].detach(), out))

        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def targets(self) -> list[torch.Tensor]:
        outs = [out for path in self.plan.layernorm for _, out in self.calls[path]]
        return outs + list(self.overrides.values())

    def rows(self, engine: Any, grads: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Per-sample gradients (B, numel) of every planned parameter from the gradients at
        ``targets()`` (same order; None for a target the loss does not reach)."""
        B, out = self.B, {}
        i = 0
        for path, (w, b) in self.plan.layernorm.items():
            module = self._modules[path]
            N = math.prod(module.normalized_shape)
            gw = gb = None
            for x, y in self.calls[path]:
                g = grads[i]
                i += 1
                if g is None:
                    g = torch.zeros_like(y)
                g = g.reshape(B, -1, N)
                if w is not None:
                    xhat = nn.functional.layer_norm(x, module.normalized_shape, None, None, module.eps)
                    part = (g * xhat.reshape(B, -1, N).to(g.dtype)).sum(1)
                    gw = part if gw is None else gw + part
                if b is not None:
                    part = g.sum(1)
                    gb = part if gb is None else gb + part
            if w is not None:
                out[w] = gw if gw is not None else torch.zeros(B, N, dtype=engine.dtype, device=engine.device)
            if b is not None:
                out[b] = gb if gb is not None else torch.zeros(B, N, dtype=engine.dtype, device=engine.device)
        for name, leaf in self.overrides.items():
            g = grads[i]
            i += 1
            out[name] = (torch.zeros_like(leaf) if g is None else g).reshape(B, -1)
        return out
