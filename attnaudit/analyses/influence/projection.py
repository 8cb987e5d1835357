"""A random sign projection R (P x k) that is never stored whole: its columns are drawn in
blocks from a seeded generator, one block at a time, each time it is needed.

R has independent entries +-1/sqrt(k). ``apply(G)`` gives G R for rows of per-sample
gradients G (m, P) block by block; ``columns(j0, j1)`` gives R[:, j0:j1]. The same seed and
block size give the same R everywhere (the blocks are drawn from their own generators, so a
block does not depend on which other blocks were drawn before it).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from attnaudit.errors import AuditError


class SignProjection:
    """R in R^{P x k}, entries +-1/sqrt(k), drawn in column blocks of ``block``."""

    def __init__(
        self,
        P: int,
        k: int,
        seed: int = 0,
        block: int = 64,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ):
        if k < 1:
            raise AuditError(f"--proj-dim must be >= 1, got {k}")
        self.P, self.k, self.seed, self.block = int(P), int(k), int(seed), max(1, int(block))
        self.dtype, self.device = dtype, torch.device(device)

    def blocks(self) -> Iterator[tuple[int, int]]:
        for j0 in range(0, self.k, self.block):
            yield j0, min(self.k, j0 + self.block)

    def columns(self, j0: int, j1: int) -> torch.Tensor:
        """R[:, j0:j1] (P, j1 - j0); ``j0`` must start a block."""
        if j0 % self.block:
            raise ValueError("a column range must start at a block boundary")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + j0 // self.block)
        signs = torch.randint(0, 2, (self.P, j1 - j0), generator=gen, dtype=torch.int8)
        return (signs.to(self.dtype) * 2 - 1).div_(math.sqrt(self.k)).to(self.device)

    def apply(self, G: torch.Tensor) -> torch.Tensor:
        """G R for G (m, P) -> (m, k)."""
        out = torch.empty(G.shape[0], self.k, dtype=G.dtype, device=G.device)
        for j0, j1 in self.blocks():
            out[:, j0:j1] = G @ self.columns(j0, j1).to(G.dtype)
        return out
