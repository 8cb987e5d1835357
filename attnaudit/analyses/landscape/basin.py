"""Basin width: how far the loss stays below ``factor`` x its minimum along random half-lines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnaudit.errors import AuditError
from attnaudit.analyses.landscape.evaluate import Direction, Progress, SurfaceEvaluator


@dataclass(frozen=True)
class BasinResult:
    """Distance alpha along filter-normalized half-lines at which L first reaches ``threshold``.

    ``radii`` lists one value per (direction, sign); a half-line that never reaches the
    threshold within ``max_radius`` counts as ``max_radius`` (a lower bound, ``censored``).
    ``width`` is their mean, ``stderr`` its standard error over half-lines.
    """

    width: float
    stderr: float
    radii: tuple[float, ...]
    censored: int
    base_loss: float
    threshold: float
    factor: float
    max_radius: float
    direction_seeds: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "width": self.width,
            "stderr": self.stderr,
            "radii": list(self.radii),
            "censored": self.censored,
            "base_loss": self.base_loss,
            "threshold": self.threshold,
            "factor": self.factor,
            "max_radius": self.max_radius,
            "direction_seeds": list(self.direction_seeds),
        }


def basin_width(
    evaluate: SurfaceEvaluator,
    directions: Sequence[Direction],
    *,
    factor: float = 2.0,
    max_radius: float = 1.0,
    points: int = 24,
    refine: int = 2,
    direction_seeds: Sequence[int] = (),
    progress: Progress = None,
) -> BasinResult:
    """Mean first distance at which L(theta +/- alpha d) >= factor * L(theta).

    A geometric grid of ``points`` radii on [1e-4, 1] * max_radius brackets each crossing;
    ``refine`` rounds of 8 evenly spaced points inside every bracket narrow it, and the
    crossing is linearly interpolated in the final bracket. All half-lines are evaluated
    together in one batched call per round.
    """
    if not factor > 1:
        raise AuditError(f"basin factor must be > 1, got {factor}")
    if not max_radius > 0:
        raise AuditError(f"basin max radius must be positive, got {max_radius}")
    D = len(directions)
    H = 2 * D  # half-lines: +d_j, -d_j
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(D)
    which = torch.arange(D).repeat_interleave(2)

    def eval_radii(r: torch.Tensor) -> torch.Tensor:
        """r: (H, G) radii -> (H, G) losses."""
        G = r.shape[1]
        C = torch.zeros(H * G, D, dtype=torch.float64)
        rows = torch.arange(H * G)
        C[rows, which.repeat_interleave(G)] = (signs[:, None] * r).reshape(-1)
        ev = evaluate(directions, C, progress)
        return ev.loss.reshape(H, G)

    zero_coeff = torch.zeros(1, D, dtype=torch.float64)
    base = float(evaluate(directions, zero_coeff).loss[0])
    threshold = factor * base
    grid = max_radius * torch.logspace(-4, 0, points, dtype=torch.float64)
    r = torch.cat([torch.zeros(1, dtype=torch.float64), grid]).expand(H, -1)
    Lr = torch.cat([torch.full((H, 1), base, dtype=torch.float64), eval_radii(r[:, 1:].contiguous())], 1)
    lo, hi, llo, lhi, censored = _brackets(r, Lr, threshold)
    for _ in range(refine):
        live = ~censored
        if not bool(live.any()):
            break
        t = torch.linspace(0, 1, 10, dtype=torch.float64)[1:-1]  # 8 interior points
        inner = lo[:, None] + (hi - lo)[:, None] * t[None, :]
        Li = eval_radii(inner)
        rr = torch.cat([lo[:, None], inner, hi[:, None]], 1)
        LL = torch.cat([llo[:, None], Li, lhi[:, None]], 1)
        nlo, nhi, nllo, nlhi, _ = _brackets(rr, LL, threshold)
        lo = torch.where(live, nlo, lo)
        hi = torch.where(live, nhi, hi)
        llo = torch.where(live, nllo, llo)
        lhi = torch.where(live, nlhi, lhi)
    # linear interpolation of the crossing inside [lo, hi]
    frac = ((threshold - llo) / (lhi - llo).clamp_min(torch.finfo(torch.float64).tiny)).clamp(0, 1)
    radii = torch.where(censored, torch.full_like(lo, max_radius), lo + frac * (hi - lo))
    width = float(radii.mean())
    stderr = float(radii.std(unbiased=True)) / math.sqrt(H) if H > 1 else float("nan")
    return BasinResult(
        width=width,
        stderr=stderr,
        radii=tuple(radii.tolist()),
        censored=int(censored.sum()),
        base_loss=base,
        threshold=threshold,
        factor=factor,
        max_radius=max_radius,
        direction_seeds=tuple(int(s) for s in direction_seeds),
    )


def _brackets(r: torch.Tensor, L: torch.Tensor, threshold: float):
    """For each row, the first grid interval [r_{i-1}, r_i] with L(r_i) >= threshold."""
    above = L >= threshold
    above[:, 0] = False  # the minimum itself is below threshold (factor > 1)
    hit = above.any(1)
    first = torch.where(hit, above.float().argmax(1), torch.full_like(hit, r.shape[1] - 1, dtype=torch.long))
    first = first.clamp_min(1)
    rows = torch.arange(r.shape[0])
    return r[rows, first - 1], r[rows, first], L[rows, first - 1], L[rows, first], ~hit
