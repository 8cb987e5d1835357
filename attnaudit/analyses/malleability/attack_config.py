"""What an attack is asked to do and what it returns: the attack names, :class:`AttackConfig`
and :class:`AttackResult` (kept apart from :mod:`.attacks`, which runs them, so the attacks on
language models in :mod:`.lm_attacks` can build results without importing the runner)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnaudit.errors import AuditError

if TYPE_CHECKING:
    from attnaudit.core.engine import Engine

ATTACKS = ("fgsm", "pgd", "mim", "sign", "random", "hotflip", "swap", "none")
#: attacks that draw nothing from their seed (pgd too when it starts from the clean rows)
SEEDLESS_ATTACKS = ("none", "fgsm", "mim", "hotflip")
TOKEN_ATTACKS = ("hotflip", "swap")  # text: eps is the number of tokens swapped per text
ADVERSARIAL = ("fgsm", "pgd", "mim", "hotflip")  # gradient attacks: the ones the verdicts and gates read
RANDOM_CONTROLS = ("sign", "random")  # noise controls of the continuous attacks, the strongest first
TOKEN_CONTROL = "swap"  # hotflip's control: the same token budget at random
NORMS = ("linf", "l2")


@dataclass(frozen=True)
class AttackConfig:
    """One perturbation; validated on construction (bad values fail before any compute)."""

    method: str = "pgd"
    eps: float = 0.3
    norm: str = "linf"
    steps: int = 10
    step_size: float | None = None
    random_start: bool = True
    momentum: float = 1.0
    clip_min: float | None = None
    clip_max: float | None = None
    seed: int = 0
    chunk_size: int = 4096
    # MiB one chunk's forward/backward graph may take (gradient attacks on continuous inputs;
    # measured per row on a probe of 4 rows): None keeps chunk_size rows
    memory_mb: float | None = None

    def embedding_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~.embedding_attacks.perturb_embeddings` this attack sets."""
        return {
            "method": self.method,
            "eps": self.eps,
            "norm": self.norm,
            "steps": self.steps,
            "step_size": self.step_size,
            "random_start": self.random_start,
            "momentum": self.momentum,
            "seed": self.seed,
            "memory_mb": self.memory_mb,
        }

    @property
    def draws_randomness(self) -> bool:
        """Whether the perturbation depends on ``seed`` (random starts, noise, random swaps); a
        seedless attack on the same model and rows gives the same perturbation for every seed."""
        return self.method not in SEEDLESS_ATTACKS and not (self.method == "pgd" and not self.random_start)

    def __post_init__(self) -> None:
        if self.method not in ATTACKS:
            raise AuditError(f"unknown attack {self.method!r}; use one of {', '.join(ATTACKS)}")
        if self.norm not in NORMS:
            raise AuditError(f"unknown norm {self.norm!r}; use linf or l2")
        if self.method != "none" and not (math.isfinite(self.eps) and self.eps > 0):
            raise AuditError(f"attack radius eps must be a positive number, got {self.eps}")
        if self.steps < 1:
            raise AuditError(f"attack steps must be >= 1, got {self.steps}")
        if self.step_size is not None and not (math.isfinite(self.step_size) and self.step_size > 0):
            raise AuditError(f"attack step size must be a positive number, got {self.step_size}")
        if not (math.isfinite(self.momentum) and self.momentum >= 0):
            raise AuditError(f"MIM momentum must be >= 0, got {self.momentum}")
        if (self.clip_min is None) != (self.clip_max is None):
            raise AuditError("give both ends of the valid range (clip_min and clip_max) or neither")
        if self.clip_min is not None and self.clip_max is not None and not self.clip_min < self.clip_max:
            raise AuditError(f"valid range must have clip_min < clip_max, got [{self.clip_min}, {self.clip_max}]")
        if self.chunk_size < 1:
            raise AuditError("attack chunk size must be >= 1")
        if self.memory_mb is not None and not (math.isfinite(self.memory_mb) and self.memory_mb > 0):
            raise AuditError(f"attack memory budget must be a positive number of MiB, got {self.memory_mb}")

    def rows_per_chunk(self, engine: Engine, X: torch.Tensor) -> int:
        """Rows attacked at once: ``chunk_size``, fewer when ``memory_mb`` holds fewer rows'
        graphs (autograd's saved tensors for the input gradient, measured on the model)."""
        n = max(1, int(X.shape[0]))
        if self.memory_mb is None or self.method not in ("fgsm", "pgd", "mim") or n <= 1:
            return min(self.chunk_size, n)
        return rows_in_budget(min(self.chunk_size, n), self.memory_mb, engine.probe_bytes_per_sample(X, wrt="inputs"))

    @property
    def resolved_step_size(self) -> float | None:
        """Step size actually used: given, else 2.5 eps/steps (PGD), eps/steps (MIM), eps (FGSM)."""
        if self.method in ("random", "sign", "none"):
            return None
        if self.method == "fgsm":
            return self.eps
        if self.step_size is not None:
            return self.step_size
        return (2.5 if self.method == "pgd" else 1.0) * self.eps / self.steps


@dataclass
class AttackResult:
    """Perturbed inputs and what the attack did to the attacked model (its strength)."""

    X_adv: torch.Tensor
    config: AttackConfig
    loss_before: float | None  # None: perturb(..., evaluate=False)
    loss_after: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    radius_mean: float | None = None  # perturbation norms: None with evaluate=False
    radius_max: float | None = None
    linf_mean: float | None = None
    linf_max: float | None = None
    l2_mean: float | None = None
    l2_max: float | None = None
    chunk_rows: int | None = None  # rows attacked at once (the memory plan); None on paths without one
    # a language model's documents: the targets rebuilt from swapped tokens (None: the targets are
    # unchanged) and the perplexity of the counted tokens before and after (None for a classifier)
    y_adv: torch.Tensor | None = None
    perplexity_before: float | None = None
    perplexity_after: float | None = None

    def to_dict(self) -> dict:
        return {
            "method": self.config.method,
            "eps": self.config.eps if self.config.method != "none" else 0.0,
            "norm": self.config.norm,
            "steps": self.config.steps
            if self.config.method in ("pgd", "mim")
            else (1 if self.config.method == "fgsm" else 0),
            "step_size": self.config.resolved_step_size,
            "random_start": self.config.random_start if self.config.method == "pgd" else None,
            "momentum": self.config.momentum if self.config.method == "mim" else None,
            "valid_range": None if self.config.clip_min is None else [self.config.clip_min, self.config.clip_max],
            "seed": self.config.seed,
            "model_loss_before": self.loss_before,
            "model_loss_after": self.loss_after,
            "model_accuracy_before": self.accuracy_before,
            "model_accuracy_after": self.accuracy_after,
            "perturbation_norm_mean": self.radius_mean,
            "perturbation_norm_max": self.radius_max,
            "perturbation_linf_mean": self.linf_mean,
            "perturbation_linf_max": self.linf_max,
            "perturbation_l2_mean": self.l2_mean,
            "perturbation_l2_max": self.l2_max,
            "chunk_rows": self.chunk_rows,
        } | (
            {"model_perplexity_before": self.perplexity_before, "model_perplexity_after": self.perplexity_after}
            if self.perplexity_before is not None
            else {}
        )


def rows_in_budget(most: int, memory_mb: float, bytes_per_row: int) -> int:
    """Rows whose ``bytes_per_row`` fit ``memory_mb`` MiB, between 1 and ``most``."""
    return int(max(1, min(most, memory_mb * 2**20 // max(1, bytes_per_row))))
