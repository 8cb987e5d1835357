"""Planning of the width sweeps: their cells, the memory of the widest cell, the rows each seed uses.

A sweep is one cell per name (model or arch) x width x seed (:func:`cell_grid`), run by an
executor (:mod:`attnaudit.runtime.sweep`). Executors other than the in-process one rebuild
their rows from a data recipe (:func:`require_data_recipe`); with ``resample_data`` each seed's
recipe is the caller's with every seed replaced by its own (:func:`seed_recipe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from attnaudit.analyses.request import FieldError, literal
from attnaudit.data import HoldoutRecipe
from attnaudit.errors import AuditError
from attnaudit.runtime.device import refuse_if_too_big
from attnaudit.runtime.sweep import CellOutcome, CellTask, ExecutorConfig

ProgressFn = Callable[[], None]


def cell_grid(
    function: str,
    base: dict,
    grid: tuple[str, Sequence[str], Sequence[int], Sequence[int]],
    label: Callable[[str, int, int], str],
    cost: Callable[[int], float],
    per_seed: Callable[[int], dict] | None = None,
) -> list[CellTask]:
    """A width sweep's cells: one per name, width and seed of ``grid`` (the key the names go
    under, the names, the widths, the seeds), each calling ``function`` on ``base`` and the three.
    ``per_seed(seed)``: payload entries that replace ``base``'s for that seed's cells (its own data)."""
    by, names, widths, seeds = grid
    return [
        CellTask(
            function,
            {**base, **(per_seed(seed) if per_seed is not None else {}), by: name, "width": width, "seed": seed},
            label(name, width, seed),
            cost=cost(width),
        )
        for name in names
        for width in widths
        for seed in seeds
    ]


def cell_memory_bytes(
    width: int, n_train: int, n_test: int, d: int, n_classes: int, kernel_points: int | None = None
) -> int:
    """Peak bytes of one width-``width`` cell of the 2-layer sweep, estimated before any compute.

    Counts float64 copies of the parameters (network, initial and final states, gradients:
    6 x m(d + c)), the training and test activations (4 n m + 2 n_test m) and the
    kernel-movement features (4 kp m); the n x n kernels are shared by all widths and small.
    """
    m, kp = int(width), int(n_train if kernel_points is None else min(n_train, kernel_points))
    return 8 * (6 * m * (d + n_classes) + (4 * n_train + 2 * n_test + 4 * kp) * m)


def refuse_too_wide(
    widths: Sequence[int], n_train: int, n_test: int, d: int, n_classes: int, kernel_points: int | None, device
) -> None:
    """Refuse (field ``widths``) a sweep whose widest cell (:func:`cell_memory_bytes`) does not fit the free memory."""
    widest = max(widths)
    try:
        refuse_if_too_big(
            cell_memory_bytes(widest, n_train, n_test, d, n_classes, kernel_points),
            device,
            f"one network of width {widest} with its activations and kernel features",
            "use smaller widths, or fewer training rows or kernel points",
        )
    except AuditError as exc:
        raise FieldError("widths", "{name}: " + literal(exc)) from None


def check_sweep_rows(X_train: torch.Tensor, X_test: torch.Tensor) -> None:
    """Refuse rows a width sweep cannot use: not (n, d) matrices of one d, fewer than 2 training or 1 held-out rows."""
    if X_train.ndim != 2 or X_test.ndim != 2 or X_train.shape[1] != X_test.shape[1]:
        raise AuditError("training and test inputs must be (n, d) matrices with the same d")
    if X_train.shape[0] < 2 or X_test.shape[0] < 1:
        raise AuditError(f"need at least 2 training and 1 held-out rows, got {X_train.shape[0]} and {X_test.shape[0]}")


def is_remote(ex: ExecutorConfig) -> bool:
    """Whether cells run outside this process (worker processes or Ray)."""
    return ex.kind != "local" or ex.jobs > 1


def require_data_recipe(ex: ExecutorConfig, data: HoldoutRecipe | None) -> None:
    """Refuse a sweep on worker processes or Ray without the recipe its workers rebuild the rows from."""
    if is_remote(ex) and data is None:
        raise AuditError(
            "cells on worker processes or Ray rebuild their data from a recipe; pass data=HoldoutRecipe(...) "
            "(the CLI does), or run with the local executor"
        )


def kernel_row_indices(n: int, kernel_points: int | None) -> torch.Tensor:
    """The kernel metrics' rows among ``n`` (CPU indices): all, or a fixed random subset of
    ``kernel_points`` (seed 0, sorted), since rows arrive in source order, which may be sorted by class."""
    kp = n if kernel_points is None else min(n, kernel_points)
    if kp == n:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))[:kp].sort().values


def seed_recipe(recipe: HoldoutRecipe, seed: int) -> HoldoutRecipe:
    """``recipe`` with every seed replaced by ``seed`` (the rows' subset and their split): the rows
    a run whose base seed is ``seed`` trains and is measured on (``resample_data``)."""
    return dataclasses.replace(recipe, seed=int(seed), spec={**recipe.spec, "seed": int(seed)})


def failed_cells_warning(failed: list[dict], total: int) -> list[str]:
    """The warning that lists the first failed cells (none when every cell finished)."""
    if not failed:
        return []
    return [
        f"{len(failed)} of {total} cells failed (listed in failed_cells): "
        + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:3])
    ]


def execution_record(ex: ExecutorConfig, tasks: Sequence[CellTask], outcomes: Sequence[CellOutcome]) -> dict:
    """How a sweep ran (the executor, its cells and how many were resumed; not a result)."""
    return {**ex.to_dict(), "cells": len(tasks), "resumed": sum(o.resumed for o in outcomes)}
