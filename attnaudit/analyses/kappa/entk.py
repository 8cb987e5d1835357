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
from attnaudit.core.precision import PrecisionCheck, compare, resolve_precision
from attnaudit.core.spectral import ConditionReport, WidthEstimate, condition_report, width_rows
from attnaudit.core.task import Inputs, Task, as_task
from attnaudit.errors import AuditError
from attnaudit.models.checkpoints import LoadedModel
from attnaudit.models.vit import n_parameters


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
    precision: dict = field(default_factory=dict)
    precision_check: dict | None = None

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
            "precision": self.precision,
            "precision_check": self.precision_check,
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
    task: Any,
    X: torch.Tensor,
    memory_bytes: int = 1 << 30,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[np.ndarray, int, int, int]:
    """(K, P, c, chunk): the empirical NTK Gram K = (1/c) sum_a J_a J_a^T (n x n, float64) of all
    trainable parameters, from the engine's per-sample Jacobians (:meth:`Engine.jacobian`) in
    ``dtype`` (the precision policy; their contraction is accumulated in that dtype, K kept in float64).

    Memory plan: a Jacobian takes c P 8 bytes per sample; rows go in chunks such that two
    chunks fit ``memory_bytes``. When all n Jacobians fit the budget they are computed once;
    otherwise only the upper block triangle is formed (chunk i against chunks j >= i), so
    m chunks cost m (m + 1) / 2 Jacobian passes instead of m + m^2.
    """

    task = layer_task(task, X)
    engine = Engine(task, dtype=dtype, device=device, probe=X[:1].to(torch.float64))
    rows = engine.rows(X)
    n = rows.shape[0]
    c = int(engine.logits(rows[:1]).shape[1])
    P = engine.n_params
    per_sample = max(1, c * P * engine.theta.element_size())
    if 2 * per_sample > memory_bytes:
        raise FieldError(
            "gram",
            "{name} entk: one sample's Jacobian "
            + f"({c} outputs x {P:,} parameters, {str(dtype).replace('torch.', '')}) takes {per_sample / 2**30:.3g} GiB and two must fit the "
            + f"{memory_bytes / 2**30:.3g} GiB budget; the eNTK Gram of this model is out of reach here -- use "
            + "{name} tokens",
        )
    chunk = max(1, int(memory_bytes // (2 * per_sample)))
    blocks = list(ranges(n, chunk))
    K = torch.empty(n, n, dtype=torch.float64)

    def gram(J1: torch.Tensor, J2: torch.Tensor) -> torch.Tensor:
        return (torch.einsum("iap,jap->ij", J1, J2) / c).detach().cpu().to(torch.float64)

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
    task: Task,
    X: torch.Tensor,
    memory_bytes: int,
    device: torch.device | str | None,
    rank_tol: float | None,
    precision: str = "float64",
) -> EntkResult:
    """Spectrum, rank (tolerance ``max(n, c P) eps lambda_max``, or ``rank_tol``), condition numbers
    and width scale (n = samples) of the eNTK Gram of ``task`` on ``X`` (:func:`entk_gram`), the
    Jacobians at ``precision`` (``auto`` resolved on the model's parameter count); below float64 the
    Gram of the first :data:`CHECK_ROWS` rows is recomputed in float64 and its spectrum compared."""
    te = time.perf_counter()
    task = layer_task(task, X)
    n_params = n_parameters(task.module)
    policy = resolve_precision(precision, n_params, device or "cpu", ENTK_HEAVY)
    K, P, c, chunk = entk_gram(task, X, memory_bytes, device, policy.dtype)
    check = spectrum_precision_check(task, X, memory_bytes, device, policy.dtype) if policy.lowered else None
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
        precision=policy.to_dict(),
        precision_check=None if check is None else check.to_dict(),
    )


#: rows of the eNTK Gram the float64 spot check recomputes
CHECK_ROWS = 16
#: what ``precision`` sets in the eNTK Gram (the layers' token Grams are captured in float64 always:
#: their condition numbers reach 1e10 and beyond, which float32 activations cannot resolve)
ENTK_HEAVY = ("per-sample Jacobians of the eNTK Gram and their contraction",)


def spectrum_precision_check(
    task: Task, X: torch.Tensor, memory_bytes: int, device: torch.device | str | None, dtype: torch.dtype
) -> PrecisionCheck:
    """The eigenvalues of the eNTK Gram of the first :data:`CHECK_ROWS` rows at ``dtype`` against
    float64, with both condition numbers."""
    t0 = time.perf_counter()
    rows = X[:CHECK_ROWS]
    spectra = [
        np.linalg.eigvalsh(entk_gram(task, rows, memory_bytes, device, d)[0])[::-1] for d in (dtype, torch.float64)
    ]
    check = compare(
        torch.from_numpy(spectra[0].copy()),
        torch.from_numpy(spectra[1].copy()),
        quantity="eNTK Gram eigenvalues",
        precision=str(dtype).replace("torch.", ""),
        subsample={"rows": int(rows.shape[0])},
        seconds=time.perf_counter() - t0,
    )
    kappas = [float(s[0] / s[-1]) if s[-1] > 0 else None for s in spectra]  # None: singular at that precision
    k_low, k_ref = kappas
    k_err = abs(k_low / k_ref - 1.0) if k_low is not None and k_ref is not None else None
    check.extra = {"kappa": k_low, "kappa_float64": k_ref, "kappa_relative_error": k_err}
    # the condition number is what kappa reports: it must agree too (the spectrum's relative error
    # is dominated by the largest eigenvalue and says little about the smallest)
    if (k_low is None) != (k_ref is None) or (k_err is not None and k_err > check.tolerance["relative_error_max"]):
        check.agrees = False
    return check
