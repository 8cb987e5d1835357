"""1-D and 2-D loss surfaces: L(theta + alpha d1) on a line, L(theta + a d1 + b d2) on a grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnaudit.errors import AuditError
from attnaudit.analyses.landscape.evaluate import Direction, Progress, SurfaceEvaluator


def symmetric_grid(points: int, span: float) -> torch.Tensor:
    """``points`` evenly spaced values on [-span, span], exactly antisymmetric (0 exact for odd counts)."""
    half = (points - 1) / 2
    return span * (torch.arange(points, dtype=torch.float64) - half) / half


@dataclass(frozen=True)
class Surface1D:
    """Loss and accuracy at theta + alpha d for alpha on a uniform grid over [-span, span]
    (accuracy None for a language model)."""

    alphas: tuple[float, ...]
    loss: tuple[float, ...]
    accuracy: tuple[float, ...] | None

    def to_dict(self) -> dict:
        return {
            "alphas": list(self.alphas),
            "loss": list(self.loss),
            "accuracy": None if self.accuracy is None else list(self.accuracy),
        }


@dataclass(frozen=True)
class Surface2D:
    """loss[i][j] = L(theta + alphas[i] d1 + betas[j] d2) (rows: first direction; accuracy None
    for a language model)."""

    alphas: tuple[float, ...]
    betas: tuple[float, ...]
    loss: tuple[tuple[float, ...], ...]
    accuracy: tuple[tuple[float, ...], ...] | None

    def to_dict(self) -> dict:
        return {
            "alphas": list(self.alphas),
            "betas": list(self.betas),
            "loss": [list(r) for r in self.loss],
            "accuracy": None if self.accuracy is None else [list(r) for r in self.accuracy],
        }


def loss_surface_1d(
    evaluate: SurfaceEvaluator, direction: Direction, points: int = 51, span: float = 1.0, progress: Progress = None
) -> Surface1D:
    """L(theta + alpha d) for ``points`` values of alpha evenly spaced on [-span, span]."""
    if points < 2:
        raise AuditError(f"a 1-D surface needs at least 2 points, got {points}")
    alphas = symmetric_grid(points, span)
    ev = evaluate([direction], alphas[:, None], progress)
    accuracy = None if ev.accuracy is None else tuple(ev.accuracy.tolist())
    return Surface1D(tuple(alphas.tolist()), tuple(ev.loss.tolist()), accuracy)


def loss_surface_2d(
    evaluate: SurfaceEvaluator,
    dir1: Direction,
    dir2: Direction,
    grid: int = 31,
    span: float = 1.0,
    progress: Progress = None,
) -> Surface2D:
    """L(theta + a d1 + b d2) on a ``grid`` x ``grid`` mesh over [-span, span]^2."""
    if grid < 2:
        raise AuditError(f"a 2-D surface needs a grid of at least 2, got {grid}")
    ax = symmetric_grid(grid, span)
    A, B = torch.meshgrid(ax, ax, indexing="ij")
    coeffs = torch.stack([A.reshape(-1), B.reshape(-1)], 1)
    ev = evaluate([dir1, dir2], coeffs, progress)
    L = ev.loss.reshape(grid, grid)
    acc = None if ev.accuracy is None else tuple(tuple(r) for r in ev.accuracy.reshape(grid, grid).tolist())
    return Surface2D(tuple(ax.tolist()), tuple(ax.tolist()), tuple(tuple(r) for r in L.tolist()), acc)
