"""Directions in parameter space for the loss surfaces and the basin width.

A random Gaussian direction d is *filter-normalized* (Li et al. 2018): for every parameter
with two or more axes, each first-axis slice ("filter") d[i] is rescaled to the norm of the
matching slice theta[i] of the weights. For the reference two-layer nets, W (m, d) has one
row per hidden neuron (its input filter) and a (m, c) one row per neuron (its output
weights a[j, :]), so both are normalized neuron by neuron; for a convolution each output
channel is a filter, for a linear layer each output unit. One-axis parameters (biases, norm
scales) are zeroed by default; with ``keep_1d=True`` the whole vector is one filter.
Because every filter of d has the norm of the matching filter of theta, ||d|| = ||theta||
over the perturbed parameters and the step alpha is a *relative* distance: alpha = 1 moves
each filter by its own size. Hessian directions are the top eigenvectors, scaled to
||theta|| so the same reading holds.

Directions are dicts name -> tensor over the tracked parameters (``Engine.unflatten`` of
theta gives the matching parameter dict); the evaluator flattens them with the engine.
"""

from __future__ import annotations

import math

import torch

from attnaudit.errors import AuditError

Params = dict[str, torch.Tensor]
DIRECTION_KINDS = ("random", "hessian")


def params_norm(params: Params) -> float:
    """Euclidean norm of all parameters together."""
    return math.sqrt(sum(float(p.double().pow(2).sum()) for p in params.values()))


def filter_normalize(direction: Params, params: Params, keep_1d: bool = False) -> Params:
    """Rescale each first-axis slice of ``direction`` to the norm of the same slice of ``params``.

    Parameters with <= 1 axis are zeroed, or (``keep_1d``) rescaled as one filter. A zero
    filter of the weights gives a zero filter of the direction.
    """
    out: Params = {}
    for name, p in params.items():
        d = direction[name]
        if d.shape != p.shape:
            raise AuditError(f"direction for {name!r} has shape {tuple(d.shape)}, parameter has {tuple(p.shape)}")
        if p.dim() <= 1:
            if keep_1d:
                dn = d.norm()
                out[name] = d * (p.norm() / dn) if dn > 0 else torch.zeros_like(d)
            else:
                out[name] = torch.zeros_like(d)
            continue
        axes = tuple(range(1, p.dim()))
        pn = torch.linalg.vector_norm(p, dim=axes, keepdim=True)
        dn = torch.linalg.vector_norm(d, dim=axes, keepdim=True)
        # where the random row happens to be exactly zero there is no direction to rescale
        out[name] = torch.where(dn > 0, d * pn / dn.clamp_min(torch.finfo(d.dtype).tiny), torch.zeros_like(d))
    return out


def random_direction(params: Params, seed: int, keep_1d: bool = False) -> Params:
    """A filter-normalized Gaussian direction drawn from a CPU generator seeded with ``seed``.

    The draw is in float64 on the CPU whatever the device, so a seed gives the same
    direction on CPU and CUDA; every parameter is drawn (also the zeroed 1-D ones) so the
    stream does not depend on ``keep_1d``.
    """
    gen = torch.Generator().manual_seed(int(seed))
    raw = {
        k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
        for k, p in params.items()
    }
    return filter_normalize(raw, params, keep_1d)


def eigenvector_direction(vector: torch.Tensor, params: Params) -> torch.Tensor:
    """A flat Hessian eigenvector (P,) as a flat direction scaled to ||theta|| (alpha = relative distance)."""
    ref = next(iter(params.values()))
    v = vector.to(device=ref.device, dtype=ref.dtype)
    return (v / v.norm() * params_norm(params)).clone()
