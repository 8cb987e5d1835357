"""The precision policy: the dtype of an analysis' heavy computations, and the float64 spot check
that says what a lower precision cost.

``--precision`` (every analysis) takes ``float64``, ``float32``, ``bfloat16`` or ``auto``. It sets
the dtype of the engine's parameter copies and everything computed through them: per-sample
gradients, projections, factor fits, Hessian-vector products, Jacobian contractions, forward
passes whose activations are captured. Reductions (curvature sums, kernel sums), small
eigendecompositions, solves in a projected space and every statistic stay float64.

``auto`` picks float64 for models of at most :data:`AUTO_FLOAT64_MAX_PARAMS` parameters (the
built-in reference models, the MNIST ViT: exact numbers cost little there) and float32 above
(DeiT-tiny's 5.7 M, BERT-mini's 11 M: float64 is 2-4x slower on CPUs and far slower on GPUs).
bfloat16 is never picked by ``auto``: its 8-bit mantissa moves influence rankings measurably.
On a CPU without native bfloat16 arithmetic (no AVX-512-BF16 or AMX: oneDNN says so) torch
emulates it: a GPT-2-small forward and backward pass took 87.8 s per document against 1.81 s
in float32 on this project's AVX2 machine, so an explicit bfloat16 there is kept (it was asked)
with a warning and the reason recorded in the report.

Every lower-precision run recomputes one of its quantities in float64 on a subsample
(:class:`PrecisionCheck`: influence scores of a few test rows, the top Hessian eigenvalues, a
kernel block, layer Gram spectra) and warns when the two disagree beyond :data:`TOLERANCES`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnaudit.errors import FieldError, literal

PRECISIONS = ("auto", "float64", "float32", "bfloat16")
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
#: ``auto``: float64 up to this many parameters, float32 above
AUTO_FLOAT64_MAX_PARAMS = 1_000_000
#: agreement a lower precision must keep with float64 on the check's subsample before a warning:
#: (smallest Spearman correlation, largest relative error ||low - f64|| / ||f64||)
TOLERANCES = {"float32": (0.99, 1e-2), "bfloat16": (0.9, 0.1)}
#: why an explicit bfloat16 on a CPU without native bfloat16 arithmetic is a poor choice
EMULATED_BFLOAT16 = (
    "this CPU has no native bfloat16 arithmetic (no AVX-512-BF16 or AMX), so torch emulates it: "
    "far slower than float32 (a GPT-2-small gradient: 87.8 s against 1.81 s per document on an AVX2 CPU) "
    "and less precise; use --precision float32"
)
FLOAT64_PARTS = "reductions, small eigendecompositions, projected-space solves and statistics"


def check_precision(value: Any, name: str = "precision") -> str:
    """``value`` as one of :data:`PRECISIONS` (lower case); a :class:`FieldError` on ``name`` otherwise."""
    text = str(value).strip().lower()
    if text not in PRECISIONS:
        raise FieldError(name, "unknown {name} " + literal(repr(value)) + f"; use one of {', '.join(PRECISIONS)}")
    return text


@dataclass(frozen=True)
class Precision:
    """What ``--precision`` resolved to: ``used`` (float64/float32/bfloat16) for the ``heavy``
    computations named, ``asked`` as given, ``reason`` why."""

    asked: str
    used: str
    reason: str
    heavy: tuple[str, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.used]

    @property
    def lowered(self) -> bool:
        """True when the heavy computations ran below float64 (a spot check is due)."""
        return self.used != "float64"

    def to_dict(self) -> dict:
        return {
            "asked": self.asked,
            "used": self.used,
            "reason": self.reason,
            "heavy_computations": list(self.heavy),
            "float64": FLOAT64_PARTS,
        }


def native_bfloat16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` does bfloat16 arithmetic in hardware: a CUDA device that supports it, a
    CPU with AVX-512-BF16 or AMX (oneDNN's check); other devices are taken at their word."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if dev.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bfloat16 path either
            return False
    return True


def resolve_precision(
    asked: str, n_params: int | None, device: torch.device | str = "cpu", heavy: tuple[str, ...] = ()
) -> Precision:
    """``asked`` for a model of ``n_params`` parameters on ``device`` (see the module docstring;
    None: the built-in reference models, all far below the threshold). bfloat16 on a CUDA device
    that lacks it is refused (FieldError on ``precision``); on a CPU without native bfloat16 it is
    kept with a warning (:data:`EMULATED_BFLOAT16`, also the recorded reason)."""
    asked = check_precision(asked)
    if asked == "auto":
        if n_params is None:
            used, reason = "float64", "auto: the built-in reference models are small"
        elif n_params <= AUTO_FLOAT64_MAX_PARAMS:
            used, reason = "float64", f"auto: {n_params:,} parameters <= {AUTO_FLOAT64_MAX_PARAMS:,}"
        else:
            used, reason = "float32", f"auto: {n_params:,} parameters > {AUTO_FLOAT64_MAX_PARAMS:,}"
        return Precision(asked, used, reason, heavy)
    dev = torch.device(device)
    if asked == "bfloat16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise FieldError("precision", "{name} bfloat16 is not supported by this GPU; use float32")
    if asked == "bfloat16" and dev.type == "cpu" and not native_bfloat16(dev):
        warnings.warn(f"precision bfloat16: {EMULATED_BFLOAT16}", RuntimeWarning, stacklevel=2)
        return Precision(asked, asked, f"asked; {EMULATED_BFLOAT16}", heavy)
    return Precision(asked, asked, "asked", heavy)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array on the CPU with the same bytes (bfloat16, which numpy lacks, as its
    int16 bits): for hashing and storing, never for arithmetic."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equally long vectors (average ranks for ties); nan when
    either is constant."""
    from scipy.stats import rankdata

    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float(ra @ ra) * float(rb @ rb))
    return float(ra @ rb) / den if den > 0 else float("nan")


@dataclass
class PrecisionCheck:
    """One quantity computed at the run's precision and again in float64 on a subsample.

    ``spearman``: rank correlation of the two (over all compared entries; for a matrix of
    per-row scores, ``spearman_min_row`` is the worst row's); ``relative_error``: ||low - f64|| /
    ||f64|| (Frobenius); ``agrees``: both within :data:`TOLERANCES` of the precision used."""

    quantity: str
    precision: str
    subsample: dict
    spearman: float
    relative_error: float
    max_abs_error: float
    tolerance: dict
    agrees: bool
    seconds: float = 0.0
    spearman_min_row: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def warning(self) -> str | None:
        if self.agrees:
            return None
        kappa = self.extra.get("kappa_relative_error")
        residuals = self.extra.get("relative_residual_float64")
        also = f", condition number off by {kappa:.3g}" if kappa is not None else ""
        if residuals:
            also += f", largest float64 Ritz residual {max(residuals):.3g}"
        return (
            f"precision check: {self.quantity} in {self.precision} disagrees with float64 on a subsample "
            f"(Spearman {self.spearman:.4f}, relative error {self.relative_error:.3g}{also}; tolerance Spearman >= "
            f"{self.tolerance['spearman_min']}, relative error <= {self.tolerance['relative_error_max']:g}); "
            "rerun with a higher --precision"
        )

    def to_dict(self) -> dict:
        out = {
            "quantity": self.quantity,
            "precision": self.precision,
            "subsample": self.subsample,
            "spearman": self.spearman,
            "relative_error": self.relative_error,
            "max_abs_error": self.max_abs_error,
            "tolerance": self.tolerance,
            "agrees": self.agrees,
            "seconds": self.seconds,
        }
        if self.spearman_min_row is not None:
            out["spearman_min_row"] = self.spearman_min_row
        if self.warning is not None:
            out["warning"] = self.warning
        return out | self.extra


def compare(
    low: Any,
    reference: Any,
    *,
    quantity: str,
    precision: str,
    subsample: dict,
    rows: bool = False,
    seconds: float = 0.0,
) -> PrecisionCheck:
    """The agreement of ``low`` (computed at ``precision``) with ``reference`` (float64), both
    arrays of one shape. ``rows``: the first axis lists separate score vectors (test rows), whose
    worst Spearman is reported as well."""
    a = np.asarray(torch.as_tensor(low).detach().to("cpu", torch.float64).numpy(), dtype=np.float64)
    b = np.asarray(torch.as_tensor(reference).detach().to("cpu", torch.float64).numpy(), dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"precision check of {quantity}: shapes {a.shape} and {b.shape} differ")
    ref_norm = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a - b))
    rel = diff / ref_norm if ref_norm > 0 else (0.0 if diff == 0 else float("inf"))
    rho = spearman(a.ravel(), b.ravel()) if a.size > 1 else float("nan")
    worst = None
    if rows and a.ndim == 2 and a.shape[1] > 1:
        worst = min(spearman(a[i], b[i]) for i in range(a.shape[0]))
    rho_min, rel_max = TOLERANCES.get(precision, (1.0, 0.0))
    ranks_ok = all(math.isnan(r) or r >= rho_min for r in (rho, worst if worst is not None else rho))
    return PrecisionCheck(
        quantity=quantity,
        precision=precision,
        subsample=subsample,
        spearman=rho,
        relative_error=rel,
        max_abs_error=float(np.max(np.abs(a - b))) if a.size else 0.0,
        tolerance={"spearman_min": rho_min, "relative_error_max": rel_max},
        agrees=bool(ranks_ok and rel <= rel_max),
        seconds=seconds,
        spearman_min_row=worst,
    )


def not_needed(precision: Precision) -> dict:
    """The ``precision_check`` of a run whose heavy computations ran in float64."""
    return {"status": "not needed", "why": f"the heavy computations ran in {precision.used}"}


def closed_forms(asked: str, what: str, applies_to: str) -> dict:
    """The ``precision`` and ``precision_check`` entries of a run whose quantities are closed forms
    computed in float64 at every precision: ``what`` they are, ``applies_to`` where the option acts."""
    return {
        "precision": {
            "asked": asked,
            "used": "float64",
            "reason": f"{what} are closed forms computed in float64 (--precision sets {applies_to})",
        },
        "precision_check": {"status": "not needed", "why": "everything is computed in float64"},
    }
