"""Target alignment: does the attention kernel lower the approximation error on targets that
follow the data's principal modes? (The paper's "dual implication": the data-dependent
kernel that raises influence malleability also reduces bias on aligned targets.)

Protocol (one run per seed; the seed sets the train/test split, the target's random weights
and directions, and the networks' initialisation):

1. **Rows.** A seeded, class-stratified holdout split of the loaded data into ``n_train``
   training and ``n_test`` test rows (:func:`attnaudit.data.holdout_split`).
2. **Targets** (regression, one real output per row, fitted with MSE; nothing is turned into
   classes). With X_c the training rows centred at their mean mu, X_c = U S V^T, and the test
   rows centred at the same mu:

   * ``principal``: y = X_c V_k w, V_k the top-k right singular vectors;
   * ``trailing``: the same with the last k of the first r right singular vectors, r the
     numerical rank of X_c (singular values above max(n, d) * eps * s_max, numpy's
     ``matrix_rank`` rule); null-space directions (round-off) are never used;
   * ``random``: the same with k random orthonormal directions of R^d (QR of a Gaussian);
   * ``labels``: the real labels, one-hot over the classes present, centred at the training
     mean (c outputs).

   One seeded Gaussian w (k entries) serves the three designed targets of a seed, so they
   differ only in their directions. Every target is scaled by one factor (taken on the
   training rows) so that the mean of ||y_i||^2 over the training rows is 1 (``target_norm``):
   unit variance for the designed targets, unit total variance for the labels.
3. **Kernel error** (the infinite-width models). Kernel ridge regression with each model's
   analytic NTK (:func:`attnaudit.core.ntk.analytic_ntk`, NTK parametrization): 2L-ReLU on the
   rows X, MLP-Attn on f_att(X) = X C with C = s X^T X the training set's attention context
   (:func:`attnaudit.models.builtin.attention_context`, the same ``rms`` scaling the MLP-Attn model
   uses), test points mapped with the same training context, f_att(x) = C x. Prediction
   f = K(test, train) (K + lambda I)^{-1} Y with lambda = ridge * trace(K) / n (``ridge``
   relative to the kernel's mean eigenvalue). Error: relative test MSE
   ||f - y||^2 / ||y||^2 over the test rows (Frobenius norms for several outputs).
4. **Net error** (finite width, matched training loss). Both reference nets
   (:func:`attnaudit.models.builtin.build_model`, NTK parametrization, antisymmetric init so
   f_0 = 0 as in the kernel predictor, the seed's init) are trained by the project's
   full-batch GD (:func:`attnaudit.core.training.train`, loss 1/(2n) sum ||f - y||^2) until the
   relative training MSE reaches ``match_loss`` (``loss_tol`` = match_loss * target_norm / 2)
   or ``steps`` run out. Learning rate: ``lr``, or ``lr_fraction`` * 2n / lambda_max of the
   model's analytic NTK on the training rows (the rule of ``ntk-distance``; GD's stability
   bound is 2n / lambda_max). A net that did not reach the loss keeps its numbers in the
   per-seed rows but is flagged (``net_reached_loss`` false) and its seed is left out of every
   net comparison, never silently compared.
5. **Kernel-target alignment** of each kernel on the training rows: centred kernel alignment
   CKA(K, Y Y^T) = <H K H, H Y Y^T H>_F / (||H K H||_F ||H Y Y^T H||_F)
   (:func:`attnaudit.core.linalg.centered_kernel_alignment`).

Sign conventions (every summary and contrast row):

* ``*_error_advantage_attn`` = err_relu - err_attn per seed: **positive = MLP-Attn has the
  lower error**;
* ``kernel_log_error_ratio_attn`` = ln(err_relu / err_attn) per seed (kernel ridge): **positive =
  MLP-Attn has the lower error**, as a factor (the errors of different targets differ by
  orders of magnitude, so a difference alone hides a large factor on a small error);
* ``cka_advantage_attn`` = CKA_attn - CKA_relu: **positive = the attention kernel is better
  aligned with the target**;
* ``*_contrast`` (target "principal-random" or "principal-trailing") = advantage on the
  principal target - advantage on the other target, per seed: **positive = attention's
  advantage is larger on the principal target** (the paper's claim).

Each is summarised by the paired Student-t interval over seeds
(:func:`attnaudit.core.stats.difference_interval`, 95 %) and a verdict by
:func:`attnaudit.core.stats.decide` against the null value 0 (claim side: above).
"""

from __future__ import annotations

from attnaudit.errors import is_int, is_real

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import torch
from torch import nn

from attnaudit.core.linalg import centered_kernel_alignment
from attnaudit.analyses.request import FieldError, field_check, literal, unknown_preset
from attnaudit.errors import AuditError, check_seed
from attnaudit.models.builtin import attention_context
from attnaudit.models.builtin import ModelSpec, TwoLayerNet, build_model
from attnaudit.core.training import TrainConfig, train
from attnaudit.data import holdout_split
from attnaudit.core.ntk import analytic_ntk
from attnaudit.core.stats import decide, difference_interval
from attnaudit.core.stats import mean_interval
from attnaudit.models.builtin import ATTN_SCALINGS
from attnaudit.report.envelope import Record

SCHEMA = "attnaudit.alignment/1"
TARGETS = ("principal", "trailing", "random", "labels")
DESIGNED = ("principal", "trailing", "random")
MODELS: tuple[Literal["relu", "attn"], ...] = ("relu", "attn")
MODEL_LABELS = {"relu": "2L-ReLU", "attn": "MLP-Attn"}
TARGET_NORM = 1.0  # mean ||y_i||^2 over the training rows, every target
F64 = torch.float64

SIGN_CONVENTION = {
    "kernel_error_advantage_attn": "err_relu - err_attn (kernel ridge, relative test MSE); positive = MLP-Attn lower error",
    "net_error_advantage_attn": "err_relu - err_attn (trained nets at matched training loss, relative test MSE); "
    "positive = MLP-Attn lower error; only seeds where both nets reached the loss",
    "kernel_log_error_ratio_attn": "ln(err_relu / err_attn) (kernel ridge); positive = MLP-Attn lower error, as a "
    "factor: reads errors of very different sizes (principal ~1e-4, random ~1e-1) alike",
    "cka_advantage_attn": "CKA_attn - CKA_relu (training rows); positive = attention kernel better aligned",
    "contrast": "advantage on principal - advantage on the other target (random or trailing), per seed; positive = "
    "attention's advantage is larger on the principal target (the paper's claim)",
}

# Sizes per preset; explicit options override every entry (see docs/alignment.md).
PRESETS: dict[str, dict] = {
    # digits (embedded), 5 seeds, about a minute on 2 CPU cores
    "quick": dict(dataset="digits", split="train", n_train=500, n_test=300, width=256, steps=2000, match_loss=0.1),
    # real MNIST (pass --split test where only the test split exists, as in ../shared/data)
    "paper": dict(dataset="mnist", split="train", n_train=1000, n_test=1000, width=256, steps=4000, match_loss=0.1),
}


# ----------------------------------------------------------------------------- the request


def _check_targets(targets: Any) -> tuple[str, ...]:
    """The targets (a subset of :data:`TARGETS`, each once) in canonical order, else a FieldError on ``targets``."""
    given = tuple(targets) if not isinstance(targets, str) else (targets,)
    if not given:
        raise FieldError("targets", "{name} is empty; give some of " + ", ".join(TARGETS))
    bad = [t for t in given if not isinstance(t, str) or t not in TARGETS]
    if bad:
        raise FieldError(
            "targets", "{name}: unknown target " + literal(repr(bad[0])) + "; use some of " + ", ".join(TARGETS)
        )
    if len(set(given)) != len(given):
        raise FieldError("targets", "{name} lists a target twice; give each once")
    return tuple(t for t in TARGETS if t in given)


@dataclass(frozen=True)
class AlignmentConfig:
    """The whole protocol (module docstring), validated on construction; errors name the field.

    ``k``: directions per designed target. ``ridge``: kernel ridge relative to the kernel's
    mean eigenvalue. ``targets``: which targets (subset of :data:`TARGETS`). ``seeds``: one
    run per seed. ``width``/``steps``/``lr``/``lr_fraction``/``match_loss``: the trained nets
    (``lr`` None = ``lr_fraction`` * 2n / lambda_max; ``match_loss``: relative training MSE at
    which GD stops). ``nets``: train the nets at all (False = kernels only). ``attn_scaling``:
    MLP-Attn's context scaling. ``rank_tol``: relative tolerance of the numerical rank
    (None = max(n, d) * eps).
    """

    k: int = 5
    ridge: float = 1e-3
    targets: tuple[str, ...] = TARGETS
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    n_train: int = 500
    n_test: int = 300
    width: int = 256
    steps: int = 2000
    lr: float | None = None
    lr_fraction: float = 0.5
    match_loss: float = 0.1
    nets: bool = True
    attn_scaling: str = "rms"
    rank_tol: float | None = None
    confidence: float = 0.95

    def __post_init__(self) -> None:
        for name, low in (("k", 1), ("n_train", 2), ("n_test", 1), ("width", 1), ("steps", 0)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise FieldError(name, "{name} must be an integer >= " + f"{low}, got " + literal(repr(value)))
            object.__setattr__(self, name, int(value))
        for name in ("ridge", "lr_fraction", "match_loss", "lr"):
            value = getattr(self, name)
            if value is None and name == "lr":
                continue
            if not is_real(value) or not math.isfinite(value) or not value > 0:
                raise FieldError(name, "{name} must be a positive number, got " + literal(repr(value)))
            object.__setattr__(self, name, float(value))
        if self.lr_fraction >= 1:
            raise FieldError(
                "lr_fraction",
                "{name} must be below 1 (GD diverges at lr = 2n / lambda_max), got " + f"{self.lr_fraction:g}",
            )
        if self.match_loss >= 1:
            raise FieldError(
                "match_loss",
                "{name} is a relative training MSE and must be below 1 (the loss at f = 0), "
                "got " + f"{self.match_loss:g}",
            )
        if self.rank_tol is not None:
            if not is_real(self.rank_tol) or not math.isfinite(self.rank_tol) or not 0 < self.rank_tol < 1:
                raise FieldError("rank_tol", "{name} must be a number in (0, 1), got " + literal(repr(self.rank_tol)))
            object.__setattr__(self, "rank_tol", float(self.rank_tol))
        object.__setattr__(self, "targets", _check_targets(self.targets))
        seeds = tuple(self.seeds)
        if not seeds:
            raise FieldError("seeds", "{name} must be >= 1")
        for s in seeds:
            field_check("seed", check_seed, s)
        if len(set(seeds)) != len(seeds):
            raise FieldError("seeds", "a seed is listed twice in {name}; give each seed once")
        object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        if not isinstance(self.attn_scaling, str) or self.attn_scaling not in ATTN_SCALINGS:
            raise FieldError(
                "attn_scaling",
                "unknown {name} " + literal(repr(self.attn_scaling)) + "; use one of " + ", ".join(ATTN_SCALINGS),
            )
        if not isinstance(self.nets, bool):
            raise FieldError("nets", "{name} must be true or false, got " + literal(repr(self.nets)))
        if not is_real(self.confidence) or not 0 < self.confidence < 1:
            raise FieldError("confidence", "{name} must be in (0, 1), got " + literal(repr(self.confidence)))

    @property
    def loss_tol(self) -> float:
        """The absolute training loss 1/(2n) sum ||f - y||^2 at which GD stops: match_loss * target_norm / 2."""
        return 0.5 * self.match_loss * TARGET_NORM

    @classmethod
    def preset(cls, name: str, **overrides) -> "AlignmentConfig":
        """The config of a preset (sizes from :data:`PRESETS`), explicit ``overrides`` winning."""
        key = str(name).strip().lower()
        if key not in PRESETS:
            raise unknown_preset(name, PRESETS)
        sizes = {k: v for k, v in PRESETS[key].items() if k in ("n_train", "n_test", "width", "steps", "match_loss")}
        return cls(**{**sizes, **overrides})

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            loss_tol=self.loss_tol,
            target_norm=TARGET_NORM,
            task="regression (MSE), no classes",
            lr_rule="lr, else lr_fraction * 2 n / lambda_max(analytic NTK of the model on the training rows)",
            ridge_rule="lambda = ridge * trace(K) / n_train (ridge relative to the kernel's mean eigenvalue)",
            parametrization="ntk",
            init="antisymmetric (f_0 = 0)",
        )
        return out


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class CenteredSpectrum:
    """SVD of the centred training rows: X - mu = U diag(s) V^T, and the numerical rank."""

    mean: torch.Tensor  # (d,)
    singular_values: torch.Tensor  # (min(n, d),), descending
    Vt: torch.Tensor  # (min(n, d), d)
    rank: int
    tolerance: float


def centered_spectrum(X_train: torch.Tensor, rank_tol: float | None = None) -> CenteredSpectrum:
    """Right singular vectors of the training rows centred at their mean, with the numerical
    rank (singular values above ``tol * s_max``, tol = ``rank_tol`` or max(n, d) * eps)."""
    X = X_train.to(F64)
    mu = X.mean(0)
    _, s, Vt = torch.linalg.svd(X - mu, full_matrices=False)
    top = float(s[0]) if s.numel() else 0.0
    rel = rank_tol if rank_tol is not None else max(X.shape) * torch.finfo(F64).eps
    tol = rel * top
    rank = int((s > tol).sum()) if top > 0 else 0
    return CenteredSpectrum(mu, s, Vt, rank, tol)


@dataclass
class Target:
    """One regression target on the training and test rows (already scaled)."""

    kind: str
    Y: torch.Tensor  # (n_train, c)
    Y_test: torch.Tensor  # (n_test, c)
    scale: float  # the factor applied (raw target * scale)
    directions: torch.Tensor | None = None  # (d, k) for the designed targets
    singular_values: list[float] | None = None  # of the directions (principal / trailing)

    @property
    def n_outputs(self) -> int:
        return int(self.Y.shape[1])


def _scaled(kind: str, Y: torch.Tensor, Yt: torch.Tensor, **extra) -> Target:
    ms = float(Y.pow(2).sum(1).mean())
    if not ms > 0:
        raise AuditError(
            f"the {kind} target is zero on every training row; there is nothing to fit "
            "(check the data and --preprocess)"
        )
    scale = math.sqrt(TARGET_NORM / ms)
    return Target(kind, Y * scale, Yt * scale, scale, **extra)


def design_targets(
    X_train: torch.Tensor,
    X_test: torch.Tensor,
    kinds: tuple[str, ...],
    k: int,
    seed: int,
    *,
    y_train: torch.Tensor | None = None,
    y_test: torch.Tensor | None = None,
    classes: list[int] | None = None,
    spectrum: CenteredSpectrum | None = None,
    rank_tol: float | None = None,
) -> dict[str, Target]:
    """The targets of one seed (module docstring, step 2), each scaled to mean ||y_i||^2 = 1 on the
    training rows. ``classes``: the label values that get a one-hot column (default: those in
    ``y_train``)."""
    spec = spectrum if spectrum is not None else centered_spectrum(X_train, rank_tol)
    X = X_train.to(F64)
    Xt = X_test.to(device=X.device, dtype=F64)
    Xc, Xtc = X - spec.mean, Xt - spec.mean
    d = X.shape[1]
    if any(t in DESIGNED for t in kinds) and k > spec.rank:
        raise FieldError(
            "k",
            "{name} " + f"{k} exceeds the numerical rank {spec.rank} of the centred training rows; "
            "lower {name} to at most " + f"{spec.rank}",
        )
    rng = np.random.default_rng([int(seed), 0xA11])
    w = torch.from_numpy(rng.standard_normal(k)).to(X.device, F64)
    Q, _ = np.linalg.qr(rng.standard_normal((d, k)))
    out: dict[str, Target] = {}
    for kind in kinds:
        if kind == "labels":
            if y_train is None or y_test is None:
                raise FieldError("targets", "the labels target needs labelled data; drop labels from {name}")
            present = sorted(set(int(c) for c in (classes if classes is not None else y_train.tolist())))
            index = {c: i for i, c in enumerate(present)}
            ytr = [index.get(int(c), -1) for c in y_train.tolist()]
            yte = [index.get(int(c), -1) for c in y_test.tolist()]
            eye = torch.eye(len(present), dtype=F64, device=X.device)
            zero = torch.zeros(1, len(present), dtype=F64, device=X.device)
            Y = torch.cat([eye, zero])[torch.tensor(ytr, device=X.device)]  # an unseen class -> zero row
            Yt = torch.cat([eye, zero])[torch.tensor(yte, device=X.device)]
            mean = Y.mean(0)
            out[kind] = _scaled(kind, Y - mean, Yt - mean)
            continue
        if kind == "principal":
            V, sv = spec.Vt[:k].T, spec.singular_values[:k]
        elif kind == "trailing":
            V, sv = spec.Vt[spec.rank - k : spec.rank].T, spec.singular_values[spec.rank - k : spec.rank]
        elif kind == "random":
            V, sv = torch.from_numpy(Q).to(X.device, F64), None
        else:
            raise AuditError(f"unknown target {kind!r}; use some of {', '.join(TARGETS)}")
        proj = V @ w
        out[kind] = _scaled(
            kind,
            (Xc @ proj)[:, None],
            (Xtc @ proj)[:, None],
            directions=V,
            singular_values=None if sv is None else [float(v) for v in sv],
        )
    return out


# ----------------------------------------------------------------------------- kernels


def attention_inputs(
    X_train: torch.Tensor, X_test: torch.Tensor, scaling: str = "rms"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(f_att(X_train), f_att(X_test)) with the training set as context: rows x -> C x, C = s X^T X
    (:func:`attnaudit.models.builtin.attention_context`, as MLP-Attn's ``features_in``)."""

    X = X_train.to(F64)
    C = attention_context(X, scaling).to(X.device, F64)
    return X @ C, X_test.to(X.device, F64) @ C


def model_inputs(
    arch: str, X_train: torch.Tensor, X_test: torch.Tensor, scaling: str = "rms"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's inputs of ``arch`` on the training and test rows (float64)."""
    if arch == "attn":
        return attention_inputs(X_train, X_test, scaling)
    if arch == "relu":
        return X_train.to(F64), X_test.to(X_train.device, F64)
    raise AuditError(f"unknown model {arch!r}; use relu or attn")


@dataclass
class RidgeSolver:
    """Kernel ridge regression with a fixed kernel, factorised once: f = K_test (K + lambda I)^{-1} Y."""

    K: torch.Tensor
    K_test: torch.Tensor
    ridge: float
    lam: float = field(init=False)
    method: str = field(init=False)

    def __post_init__(self) -> None:
        K = 0.5 * (self.K + self.K.T)
        n = K.shape[0]
        self.lam = self.ridge * float(K.diagonal().sum()) / n
        if not self.lam > 0:
            raise AuditError(
                "the kernel is zero on the training rows (all-zero inputs?); check the data and --preprocess"
            )
        A = K + self.lam * torch.eye(n, dtype=K.dtype, device=K.device)
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) == 0:
            self._L, self.method = L, "cholesky"
        else:  # numerically indefinite after round-off: eigen-decomposition, negative eigenvalues clipped
            evals, evecs = torch.linalg.eigh(K)
            self._eig = (evals.clamp_min(0.0) + self.lam, evecs)
            self.method = "eigh (clipped)"

    def coefficients(self, Y: torch.Tensor) -> torch.Tensor:
        Y = Y.to(self.K)
        if self.method == "cholesky":
            return torch.cholesky_solve(Y, self._L)
        evals, evecs = self._eig
        return evecs @ ((evecs.T @ Y) / evals[:, None])

    def predict(self, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f on the training rows, f on the test rows)."""
        alpha = self.coefficients(Y)
        return self.K @ alpha, self.K_test @ alpha


def kernel_ridge_predict(
    K: torch.Tensor, K_test: torch.Tensor, Y: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, float]:
    """Test predictions K_test (K + lambda I)^{-1} Y with lambda = ridge * trace(K) / n, and lambda."""
    solver = RidgeSolver(K.to(F64), K_test.to(F64), ridge)
    return solver.predict(Y.to(F64))[1], solver.lam


def relative_error(F: torch.Tensor, Y: torch.Tensor) -> float:
    """||F - Y||_F^2 / ||Y||_F^2 (nan when Y is zero)."""
    den = float(Y.pow(2).sum())
    return float((F.to(Y) - Y).pow(2).sum()) / den if den > 0 else float("nan")


def kernel_alignment(K: torch.Tensor, Y: torch.Tensor) -> float:
    """Centred kernel alignment CKA(K, Y Y^T) (:func:`attnaudit.core.linalg.centered_kernel_alignment`)."""
    return centered_kernel_alignment(K, Y)


# ----------------------------------------------------------------------------- trained nets


class _RegressionResidual(nn.Module):
    """Lets :func:`attnaudit.core.training.train` fit a real-valued target T with its own loss.

    ``train`` minimises the mean of 0.5 ||g(z) - onehot(label)||^2; with g(z) = net.mlp(z) - T + e_0
    (rows in training order) and every label 0, that is exactly 1/(2n) sum ||f(x_i) - T_i||^2: the
    project's full-batch GD, loss normalisation and ``loss_tol`` stopping rule, on a regression
    target. The parameters are the net's own (W, a), trained in place.
    """

    offset: torch.Tensor  # a buffer

    def __init__(self, net: TwoLayerNet, T: torch.Tensor) -> None:
        super().__init__()
        self.net = net
        E = torch.zeros_like(T)
        E[:, 0] = 1.0
        self.register_buffer("offset", T - E)

    def forward(self, Z: torch.Tensor) -> torch.Tensor:
        return self.net.mlp(Z) - self.offset


@dataclass
class NetFit:
    """One trained net: relative train/test MSE, whether it reached the matched loss, how it ran."""

    train_error: float
    test_error: float
    reached: bool
    diverged: bool
    steps_run: int
    lr: float
    final_loss: float
    seconds: float


def train_matched(
    arch: Literal["relu", "attn"],
    X_train: torch.Tensor,
    X_test: torch.Tensor,
    target: Target,
    *,
    width: int,
    seed: int,
    lr: float,
    steps: int,
    loss_tol: float,
    attn_scaling: str = "rms",
) -> NetFit:
    """Build the reference net ``arch`` (NTK parametrization, antisymmetric init, ``seed``) and train it
    by full-batch GD on MSE until its training loss is <= ``loss_tol`` or ``steps`` ran."""

    t0 = time.perf_counter()
    X = X_train.to(F64)
    spec = ModelSpec(
        arch,
        X.shape[1],
        width,
        target.n_outputs,
        parametrization="ntk",
        init="antisymmetric",
        attn_scaling=attn_scaling,  # type: ignore[arg-type]  # ModelSpec checks it is one of ATTN_SCALINGS
        seed=seed,
    )
    net = build_model(spec, X, dtype=F64, device=X.device)
    with torch.no_grad():
        Z = net.features_in(X)  # MLP-Attn: f_att of the rows with the training context (a fixed buffer)
    labels = torch.zeros(X.shape[0], dtype=torch.long, device=X.device)
    result = train(
        _RegressionResidual(net, target.Y.to(X)),
        Z,
        labels,
        TrainConfig(loss="mse", lr=lr, steps=steps, loss_tol=loss_tol, record_every=max(1, steps)),
    )
    with torch.no_grad():
        f_train = net(X)
        f_test = net(X_test.to(X))
    train_err = relative_error(f_train, target.Y.to(X))
    test_err = relative_error(f_test, target.Y_test.to(X))
    diverged = bool(result.diverged or not math.isfinite(train_err))
    return NetFit(
        train_error=train_err,
        test_error=test_err if not diverged else float("nan"),
        reached=bool(result.reached_tol) and not diverged,
        diverged=diverged,
        steps_run=result.steps_run,
        lr=lr,
        final_loss=result.final_loss,
        seconds=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------- one run


@dataclass
class SeedRow(Record):
    """One (seed, target, model) measurement; ``flagged``: the net did not reach the matched loss."""

    seed: int
    target: str
    model: str
    kernel_error: float
    kernel_train_error: float
    cka: float
    ridge_lambda: float
    net_error: float | None = None
    net_train_error: float | None = None
    net_reached_loss: bool | None = None
    net_diverged: bool | None = None
    net_steps: int | None = None
    net_lr: float | None = None
    flagged: bool = False
    flag: str | None = None


@dataclass
class TargetRow(Record):
    """Diagnostics of one seed's target: alignment with the data's own linear kernel X X^T, the
    ratio of test to training variance, the directions' singular values, the numerical rank."""

    seed: int
    target: str
    n_outputs: int
    cka_linear: float
    test_variance_ratio: float
    singular_values: list[float] | None
    numerical_rank: int
    top_singular_value: float


@dataclass
class SummaryRow(Record):
    """A per-seed difference summarised over seeds (sign conventions: module docstring)."""

    quantity: str
    target: str
    estimate: float | None
    interval: list
    interval_method: str
    confidence: float
    n_seeds: int
    per_seed: list
    null_value: float
    claim_side: str
    verdict: str
    reason: str
    meaning: str
    seeds: list
    excluded_seeds: list = field(default_factory=list)

    def sentence(self) -> str:
        return f"alignment {self.quantity} [{self.target}]: {self.verdict.upper()}: {self.reason} ({self.meaning})"


@dataclass
class LevelRow(Record):
    """Mean of one model's error or CKA on one target over seeds, with its Student-t interval."""

    metric: str
    target: str
    model: str
    estimate: float | None
    interval: list
    n_seeds: int
    per_seed: list


@dataclass
class AlignmentResult:
    config: AlignmentConfig
    per_seed: list[SeedRow]
    targets: list[TargetRow]
    summary: list[SummaryRow]
    contrast: list[SummaryRow]
    levels: list[LevelRow]
    warnings: list[str]
    timings: dict[str, float]
    n_features: int

    def verdicts(self) -> list[str]:
        """Headline first: the kernel contrast principal - random (the paper's claim), then every row."""
        rows = self.contrast + self.summary
        head = [
            r
            for r in self.contrast
            if r.quantity == "kernel_error_advantage_attn_contrast" and r.target == "principal-random"
        ]
        rest = [r for r in rows if r not in head]
        return [r.sentence() for r in head + rest]

    def to_dict(self) -> dict:
        return {
            "protocol": self.config.to_dict(),
            "n_features": self.n_features,
            "sign_convention": SIGN_CONVENTION,
            "per_seed": [r.to_dict() for r in self.per_seed],
            "targets": [r.to_dict() for r in self.targets],
            "summary": [r.to_dict() for r in self.summary],
            "contrast": [r.to_dict() for r in self.contrast],
            "levels": [r.to_dict() for r in self.levels],
        }


def auto_lr(K: torch.Tensor, n: int, fraction: float) -> float:
    """fraction * 2n / lambda_max(K): the ``ntk-distance`` rule (GD on 1/(2n) sum ||f - y||^2 is stable below 2n / lambda_max)."""
    top = float(torch.linalg.eigvalsh(0.5 * (K + K.T))[-1])
    return fraction * 2.0 * n / top


def run_alignment(
    ds,
    config: AlignmentConfig,
    *,
    device: torch.device | str | None = None,
    progress: Callable[[int], None] | None = None,
) -> AlignmentResult:
    """The protocol of the module docstring on the rows of ``ds`` (an :class:`attnaudit.data.Dataset`).

    ``progress(1)`` after each (seed, target). Every number is float64."""

    if config.n_train + config.n_test > ds.n:
        raise FieldError(
            "n_train",
            "{name} " + f"{config.n_train} + n_test {config.n_test} = {config.n_train + config.n_test} rows, "
            f"but {literal(ds.name)} has {ds.n}; lower {{name}} or n_test",
        )
    warnings: list[str] = []
    kinds = config.targets
    if "labels" in kinds and ds.y is None:
        kinds = tuple(t for t in kinds if t != "labels")
        warnings.append(f"{ds.name} has no labels: the labels target is left out")
        if not kinds:
            raise FieldError(
                "targets",
                f"{literal(ds.name)} has no labels, and {{name}} asks only for labels; add principal, trailing or random",
            )
    classes = sorted(set(ds.y.tolist())) if ds.y is not None else None
    dev = torch.device(device) if device is not None else ds.X.device
    timings = {"targets": 0.0, "kernels": 0.0, "nets": 0.0}
    per_seed: list[SeedRow] = []
    target_rows: list[TargetRow] = []
    overlap_warned = False
    for seed in config.seeds:
        train_ds, test_ds = holdout_split(ds, config.n_train, config.n_test, seed, stratify=True)
        X, Xt = train_ds.X.to(dev, F64), test_ds.X.to(dev, F64)
        t0 = time.perf_counter()
        spec = centered_spectrum(X, config.rank_tol)
        if spec.rank < 2 * config.k and "trailing" in kinds and "principal" in kinds and not overlap_warned:
            warnings.append(
                f"the numerical rank {spec.rank} is below 2k = {2 * config.k}: the principal and trailing "
                "directions overlap; lower --k"
            )
            overlap_warned = True
        targets = design_targets(
            X, Xt, kinds, config.k, seed, y_train=train_ds.y, y_test=test_ds.y, classes=classes, spectrum=spec
        )
        lin = X @ X.T
        for kind, tg in targets.items():
            ratio = float(tg.Y_test.pow(2).sum(1).mean()) / float(tg.Y.pow(2).sum(1).mean())
            target_rows.append(
                TargetRow(
                    seed,
                    kind,
                    tg.n_outputs,
                    kernel_alignment(lin, tg.Y),
                    ratio,
                    tg.singular_values,
                    spec.rank,
                    float(spec.singular_values[0]),
                )
            )
        timings["targets"] += time.perf_counter() - t0
        for arch in MODELS:
            t1 = time.perf_counter()

            Z, Zt = model_inputs(arch, X, Xt, config.attn_scaling)
            K = analytic_ntk(Z)
            solver = RidgeSolver(K, analytic_ntk(Zt, Z), config.ridge)
            lr = config.lr if config.lr is not None else auto_lr(K, X.shape[0], config.lr_fraction)
            for kind, tg in targets.items():
                f_tr, f_te = solver.predict(tg.Y)
                per_seed.append(
                    SeedRow(
                        seed=seed,
                        target=kind,
                        model=arch,
                        kernel_error=relative_error(f_te, tg.Y_test),
                        kernel_train_error=relative_error(f_tr, tg.Y),
                        cka=kernel_alignment(K, tg.Y),
                        ridge_lambda=solver.lam,
                    )
                )
            timings["kernels"] += time.perf_counter() - t1
            if config.nets:
                t2 = time.perf_counter()
                for kind, tg in targets.items():
                    fit = train_matched(
                        arch,
                        X,
                        Xt,
                        tg,
                        width=config.width,
                        seed=seed,
                        lr=lr,
                        steps=config.steps,
                        loss_tol=config.loss_tol,
                        attn_scaling=config.attn_scaling,
                    )
                    row = next(r for r in per_seed if r.seed == seed and r.target == kind and r.model == arch)
                    row.net_error, row.net_train_error = fit.test_error, fit.train_error
                    row.net_reached_loss, row.net_diverged = fit.reached, fit.diverged
                    row.net_steps, row.net_lr = fit.steps_run, fit.lr
                    if not fit.reached:
                        row.flagged = True
                        row.flag = (
                            "diverged"
                            if fit.diverged
                            else f"did not reach the matched training loss (relative training MSE {fit.train_error:.3g} > "
                            f"{config.match_loss:g} after {fit.steps_run} steps); left out of the net comparison"
                        )
                timings["nets"] += time.perf_counter() - t2
        if progress is not None:
            progress(1)
    summary, contrast, levels = summarise(per_seed, config, kinds)
    warnings.extend(_flag_warnings(per_seed, config))
    return AlignmentResult(config, per_seed, target_rows, summary, contrast, levels, warnings, timings, int(ds.d))


def _flag_warnings(rows: list[SeedRow], config: AlignmentConfig) -> list[str]:
    out = []
    for kind in config.targets:
        for arch in MODELS:
            mine = [r for r in rows if r.target == kind and r.model == arch and r.net_reached_loss is not None]
            missed = [r.seed for r in mine if not r.net_reached_loss]
            if missed:
                out.append(
                    f"{MODEL_LABELS[arch]} did not reach the matched training loss (relative MSE {config.match_loss:g}) "
                    f"on the {kind} target in {len(missed)} of {len(mine)} seeds ({', '.join(map(str, missed))}, "
                    f"{config.steps} steps); those seeds are left out of the net comparisons"
                )
    return out


# ----------------------------------------------------------------------------- summaries


def _value(rows: list[SeedRow], seed: int, target: str, model: str, key: str, reached_only: bool = False):
    for r in rows:
        if r.seed == seed and r.target == target and r.model == model:
            if reached_only and not r.net_reached_loss:
                return None
            v = getattr(r, key)
            return None if v is None or not math.isfinite(v) else float(v)
    return None


def _sub(a, b):
    return None if a is None or b is None else a - b


def _summary_row(
    quantity: str, target: str, a: list, b: list, seeds: tuple, meaning: str, confidence: float
) -> SummaryRow:
    """The paired interval of mean(a_i - b_i) over the seeds where both exist, and its verdict (null 0, above)."""

    per_seed = [_sub(x, y) for x, y in zip(a, b)]
    iv = difference_interval(a, b, confidence)
    verdict, reason = decide(iv, 0.0, "above", iv.n)
    return SummaryRow(
        quantity=quantity,
        target=target,
        estimate=iv.estimate,
        interval=iv.bounds,
        interval_method=iv.method,
        confidence=confidence,
        n_seeds=iv.n,
        per_seed=per_seed,
        null_value=0.0,
        claim_side="above",
        verdict=verdict,
        reason=reason,
        meaning=meaning,
        seeds=list(seeds),
        excluded_seeds=[s for s, v in zip(seeds, per_seed) if v is None],
    )


def _log(v):
    return math.log(v) if v is not None and v > 0 else None


def _pairs(rows: list[SeedRow], seeds: tuple, target: str, quantity: str) -> tuple[list, list]:
    """(a, b) per seed with a - b the quantity's advantage (sign conventions: module docstring)."""
    if quantity == "kernel_error_advantage_attn":
        key, first, second, reached = "kernel_error", "relu", "attn", False
    elif quantity == "kernel_log_error_ratio_attn":
        a = [_log(_value(rows, s, target, "relu", "kernel_error")) for s in seeds]
        b = [_log(_value(rows, s, target, "attn", "kernel_error")) for s in seeds]
        return a, b
    elif quantity == "net_error_advantage_attn":
        key, first, second, reached = "net_error", "relu", "attn", True
    else:
        key, first, second, reached = "cka", "attn", "relu", False
    a = [_value(rows, s, target, first, key, reached) for s in seeds]
    b = [_value(rows, s, target, second, key, reached) for s in seeds]
    if reached:  # a seed enters the net comparison only when both nets reached the matched loss
        both = [x is not None and y is not None for x, y in zip(a, b)]
        a = [x if ok else None for x, ok in zip(a, both)]
        b = [y if ok else None for y, ok in zip(b, both)]
    return a, b


_MEANING = {
    "kernel_error_advantage_attn": "err_relu - err_attn, kernel ridge; > 0: MLP-Attn lower error",
    "net_error_advantage_attn": "err_relu - err_attn, trained nets at matched loss; > 0: MLP-Attn lower error",
    "kernel_log_error_ratio_attn": "ln(err_relu / err_attn), kernel ridge; > 0: MLP-Attn lower error (as a factor)",
    "cka_advantage_attn": "CKA_attn - CKA_relu; > 0: attention kernel better aligned",
}


def summarise(rows: list[SeedRow], config: AlignmentConfig, kinds: tuple[str, ...]) -> tuple[list, list, list]:
    """(summary, contrast, levels) rows from the per-seed rows; every interval via
    :func:`attnaudit.core.stats.difference_interval` (paired over seeds) or :func:`~attnaudit.core.stats.mean_interval`."""

    seeds = config.seeds
    quantities = ["kernel_error_advantage_attn", "kernel_log_error_ratio_attn", "cka_advantage_attn"]
    if config.nets:
        quantities.insert(1, "net_error_advantage_attn")
    summary, contrast = [], []
    adv: dict[tuple[str, str], list] = {}
    for kind in kinds:
        for q in quantities:
            a, b = _pairs(rows, seeds, kind, q)
            adv[(q, kind)] = [_sub(x, y) for x, y in zip(a, b)]
            summary.append(_summary_row(q, kind, a, b, seeds, _MEANING[q], config.confidence))
    if "principal" in kinds:
        for other in ("random", "trailing"):
            if other not in kinds:
                continue
            for q in quantities:
                meaning = (
                    f"({_MEANING[q].split(';')[0]}) on principal minus on {other}; > 0: attention's advantage "
                    "larger on the principal target"
                )
                contrast.append(
                    _summary_row(
                        f"{q}_contrast",
                        f"principal-{other}",
                        adv[(q, "principal")],
                        adv[(q, other)],
                        seeds,
                        meaning,
                        config.confidence,
                    )
                )
    levels = []
    metrics = ["kernel_error", "cka"] + (["net_error"] if config.nets else [])
    for metric in metrics:
        for kind in kinds:
            for arch in MODELS:
                per = [_value(rows, s, kind, arch, metric, reached_only=metric == "net_error") for s in seeds]
                iv = mean_interval(per, config.confidence)
                levels.append(LevelRow(metric, kind, arch, iv.estimate, iv.bounds, iv.n, per))
    return summary, contrast, levels
