"""The empirical NTK Gram of a whole model on a batch (`attnaudit kappa --checkpoint --gram entk`).

K = (1/c) sum_a J_a J_a^T (n x n, the mean over the c outputs of the logits' Jacobian
products, from :meth:`attnaudit.core.engine.Engine.jacobian`, chunked to a memory budget),
its spectrum, rank (tolerance ``max(n, c P) eps lambda_max``, P tracked parameters: K is the
Gram of the n x cP stacked Jacobian) and condition numbers, and the width scale with
**n = the number of samples**.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from attnaudit.analyses.request import FieldError
from attnaudit.core.engine import Engine, ranges
from attnaudit.core.spectral import ConditionReport, WidthEstimate, condition_report, width_rows
from attnaudit.core.task import Inputs, Task, as_task
from attnaudit.errors import AuditError
from attnaudit.models.checkpoints import LoadedModel


@dataclass
class EntkResult:
    """Conditioning of the empirical NTK Gram K = (1/c) sum_a J_a J_a^T of the whole model on the batch."""

    n: int
    n_params: int
    n_outputs: int
    report: ConditionReport
    widths: list[WidthEstimate]
    seconds: float
    chunk: int  # samples per Jacobian chunk (memory plan)
    matrix: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {
            "form": "K = (1/c) sum_a J_a J_a^T: mean over the c outputs of the logits' Jacobian Grams (n x n, float64)",
            "n": self.n,
            "parameters": self.n_params,
            "outputs": self.n_outputs,
            "rank_tolerance_dims": "max(n, c * parameters) (K is the Gram of the n x cP stacked Jacobian)",
            "gram": self.report.to_dict(),
            "width_estimates": [w.to_dict() for w in self.widths],
            "seconds": self.seconds,
            "jacobian_chunk_samples": self.chunk,
        }


def layer_task(model: Any, X: torch.Tensor) -> Task:
    """The :class:`~attnaudit.core.task.Task` of a LoadedModel, a Task or a module (its declared inputs, else flat rows)."""
    if isinstance(model, LoadedModel):
        return model.task()
    if isinstance(model, Task):
        return model
    if isinstance(model, nn.Module):
        declare = getattr(model, "audit_inputs", None)  # a model's optional declaration of its inputs
        declared = declare() if callable(declare) else None
        return as_task(model, inputs=declared if declared is not None else Inputs(), probe=X[:1].to(torch.float64))
    raise AuditError(f"expected a Task, a LoadedModel or a torch.nn.Module, got {type(model).__name__}")


def entk_gram(
    task: Any, X: torch.Tensor, memory_bytes: int = 1 << 30, device: str | torch.device | None = None
) -> tuple[np.ndarray, int, int, int]:
    """(K, P, c, chunk): the empirical NTK Gram K = (1/c) sum_a J_a J_a^T (n x n, float64) of all
    trainable parameters, from the engine's per-sample Jacobians (:meth:`Engine.jacobian`).

    Memory plan: a Jacobian takes c P 8 bytes per sample; rows go in chunks such that two
    chunks fit ``memory_bytes``. When all n Jacobians fit the budget they are computed once;
    otherwise only the upper block triangle is formed (chunk i against chunks j >= i), so
    m chunks cost m (m + 1) / 2 Jacobian passes instead of m + m^2.
    """

    task = layer_task(task, X)
    engine = Engine(task, dtype=torch.float64, device=device, probe=X[:1].to(torch.float64))
    rows = engine.rows(X)
    n = rows.shape[0]
    c = int(engine.logits(rows[:1]).shape[1])
    P = engine.n_params
    per_sample = max(1, c * P * 8)
    if 2 * per_sample > memory_bytes:
        raise FieldError(
            "gram",
            "{name} entk: one sample's Jacobian "
            + f"({c} outputs x {P:,} parameters, float64) takes {per_sample / 2**30:.3g} GiB and two must fit the "
            + f"{memory_bytes / 2**30:.3g} GiB budget; the eNTK Gram of this model is out of reach here -- use "
            + "{name} tokens",
        )
    chunk = max(1, int(memory_bytes // (2 * per_sample)))
    blocks = list(ranges(n, chunk))
    K = torch.empty(n, n, dtype=torch.float64)

    def gram(J1: torch.Tensor, J2: torch.Tensor) -> torch.Tensor:
        return (torch.einsum("iap,jap->ij", J1, J2) / c).detach().cpu()

    if n * per_sample <= memory_bytes:
        J = [engine.jacobian(rows[a:b]) for a, b in blocks]
        for i, (a1, b1) in enumerate(blocks):
            for j, (a2, b2) in enumerate(blocks[i:], start=i):
                block = gram(J[i], J[j])
                K[a1:b1, a2:b2] = block
                K[a2:b2, a1:b1] = block.T
    else:
        for i, (a1, b1) in enumerate(blocks):
            J1 = engine.jacobian(rows[a1:b1])
            K[a1:b1, a1:b1] = gram(J1, J1)
            for a2, b2 in blocks[i + 1 :]:
                block = gram(J1, engine.jacobian(rows[a2:b2]))
                K[a1:b1, a2:b2] = block
                K[a2:b2, a1:b1] = block.T
    K = 0.5 * (K + K.T)
    return K.numpy(), P, c, chunk


def entk_result(
    task: Task, X: torch.Tensor, memory_bytes: int, device: torch.device | str | None, rank_tol: float | None
) -> EntkResult:
    """Spectrum, rank (tolerance ``max(n, c P) eps lambda_max``, or ``rank_tol``), condition numbers
    and width scale (n = samples) of the eNTK Gram of ``task`` on ``X`` (:func:`entk_gram`)."""
    te = time.perf_counter()
    K, P, c, chunk = entk_gram(task, X, memory_bytes, device)
    lam = np.linalg.eigvalsh(K)[::-1]
    n = K.shape[0]
    rep = condition_report(lam, n, c * P, rank_tol)
    return EntkResult(
        n=n,
        n_params=P,
        n_outputs=c,
        report=rep,
        widths=width_rows(
            rep,
            "eNTK Gram kappa_d: kappa^6 n ln n (n = samples)",
            "eNTK Gram at numerical rank (n = samples)",
            "m ~ kappa_d(K)^6 n ln n: the paper's formula evaluated on the eNTK Gram K (the paper's kappa is "
            "the input Gram's); Omega constant omitted",
            "m ~ kappa_r(K)^6 n ln n at the numerical rank r of K; Omega constant omitted",
            what="K",
        ),
        seconds=time.perf_counter() - te,
        chunk=chunk,
        matrix=K,
    )
