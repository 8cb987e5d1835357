"""One cell of the 2-layer width sweep: a model x width x seed trained and measured against its kernel predictor.

:class:`SweepRows` holds one sweep's rows and what its cells share (per model: the attention
context, the inputs Z of the MLP, the analytic NTK parts and its spectrum; per width: Theta_inf,
the lr, the kernel predictor's settings and the top eigenvector), built once per process.
:func:`ntk_cell` is the cell function the executor runs; :func:`train_cell` trains the network
and measures it (:mod:`attnaudit.analyses.ntk_distance.widths` states the protocol).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast
import torch

from attnaudit.analyses.ntk_distance.aggregate import rms_rows, strict_json
from attnaudit.analyses.ntk_distance.config import NTKDistanceConfig
from attnaudit.analyses.ntk_distance.planning import kernel_row_indices
from attnaudit.core.ntk import (
    AnalyticNTKParts,
    LinearizedGDConfig,
    TwoLayerState,
    analytic_ntk_parts,
    entk_two_layer_blocks,
    kernel_gd_predict,
)
from attnaudit.core.training import TrainConfig, accuracy, loss_value, one_hot_targets, train
from attnaudit.data import HoldoutRecipe
from attnaudit.models.builtin import ModelSpec, TwoLayerNet, attention_context
from attnaudit.runtime.sweep import cached

F64 = torch.float64


@dataclass
class Cell:
    """One trained network (model x width x seed) and its kernel predictor."""

    model: str
    width: int
    seed: int
    lr: float
    train_dtype: str
    steps_run: int
    diverged: bool
    distance_rms: float
    distance_rel: float
    ntk_output_rms: float
    distance_train_rms: float
    kernel_movement: float
    kernel_init_error: float
    kernel_movement_complement: float
    kernel_init_error_complement: float
    kernel_movement_trace: float
    net_train_loss: float
    net_initial_loss: float
    net_train_acc: float
    net_test_acc: float
    kernel_train_loss: float
    kernel_train_acc: float
    kernel_test_acc: float
    predictor: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


@dataclass
class ArchContext:
    """What every cell of one model shares: its attention context (attn), the MLP's inputs Z
    (train) and Zt (held-out), the analytic NTK parts and the reference kernel's spectrum."""

    context: torch.Tensor | None
    Z: torch.Tensor
    Zt: torch.Tensor
    parts_tr: AnalyticNTKParts
    parts_te: AnalyticNTKParts
    spec_diag: dict


@dataclass
class WidthContext:
    """What every cell of one model and width shares: Theta_inf on train (and held-out x train),
    its top eigenvalue, the lr, Theta_inf on the kernel rows and its top eigenvector, the predictor's settings."""

    kinf: torch.Tensor
    kinf_test: torch.Tensor
    lam_max: float
    lr: float
    kin_k: torch.Tensor
    v_top: torch.Tensor
    gd_cfg: LinearizedGDConfig


class SweepRows:
    """One sweep's rows and the per-model / per-width quantities its cells share (cached per process)."""

    def __init__(self, key: str, X_train, y_train, X_test, y_test, c: int) -> None:
        device = X_train.device
        self.key = key
        self.X = X_train.to(F64)
        self.Xt = X_test.to(device, F64)
        self.y, self.yt = y_train.to(device).long(), y_test.to(device).long()
        self.c = c
        self.Y = one_hot_targets(self.y, c).to(device)
        self._arch: dict = {}
        self._width: dict = {}

    def kernel_rows(self, config: NTKDistanceConfig) -> torch.Tensor:
        """The rows of the kernel metrics (:func:`~attnaudit.analyses.ntk_distance.planning.kernel_row_indices`)."""
        return kernel_row_indices(self.X.shape[0], config.kernel_points).to(self.X.device)

    def arch_context(self, arch: str, config: NTKDistanceConfig) -> ArchContext:
        """The model's shared quantities on these rows (built once per process)."""
        key = (arch, config.attn_scaling, config.parametrization, max(config.widths))
        if key not in self._arch:
            X, Xt = self.X, self.Xt
            if arch == "attn":
                context = attention_context(X, config.attn_scaling).to(X.device, F64)
                Z, Zt = X @ context, Xt @ context
            else:
                context, Z, Zt = None, X, Xt
            parts_tr = analytic_ntk_parts(Z)
            parts_te = analytic_ntk_parts(Zt, Z)
            ref_kernel = parts_tr.kernel(config.parametrization, max(config.widths))
            self._arch[key] = ArchContext(context, Z, Zt, parts_tr, parts_te, spectrum_diagnostics(ref_kernel))
        return self._arch[key]

    def width_context(self, arch: str, width: int, config: NTKDistanceConfig) -> WidthContext:
        """The model and width's shared quantities on these rows (built once per process)."""
        key = (
            arch,
            width,
            config.attn_scaling,
            config.parametrization,
            config.lr,
            config.lr_fraction,
            config.steps,
            config.predictor,
            config.loss,
            config.kernel_points,
        )
        if key not in self._width:
            ctx = self.arch_context(arch, config)
            n = self.X.shape[0]
            kinf = ctx.parts_tr.kernel(config.parametrization, width)
            kinf_test = ctx.parts_te.kernel(config.parametrization, width)
            lam_max = torch.linalg.eigvalsh(0.5 * (kinf + kinf.T))[-1].item()
            lr = config.lr if config.lr is not None else config.lr_fraction * 2 * n / lam_max
            kidx = self.kernel_rows(config)
            kin_k = kinf[kidx][:, kidx]
            evals, evecs = torch.linalg.eigh(0.5 * (kin_k + kin_k.T))
            gd_cfg = LinearizedGDConfig(lr=lr, steps=config.steps, mode=config.predictor, loss=config.loss)
            self._width[key] = WidthContext(kinf, kinf_test, lam_max, lr, kin_k, evecs[:, -1], gd_cfg)
        return self._width[key]


def sweep_rows_for(payload: dict) -> SweepRows:
    """This process's :class:`SweepRows` for a cell: the driver's own, or rebuilt from the data recipe."""

    def build() -> SweepRows:
        recipe = HoldoutRecipe(**payload["data"])
        train_ds, test_ds = recipe.load()
        dev = torch.device(payload["device"])
        return SweepRows(
            payload["memory_key"],
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            payload["n_classes"],
        )

    return cached(f"ntk-sweep:{payload['memory_key']}", build)


def seed_rows(shared: "SweepRows", payload: dict) -> "SweepRows":
    """A seed's :class:`SweepRows`: the shared one when the payload names its rows, else built (and
    cached for the in-process cells) from the payload's recipe."""
    return shared if payload["memory_key"] == shared.key else sweep_rows_for(payload)


def config_key(raw: dict) -> str:
    """The process cache key of a sweep configuration (its ``to_dict``)."""
    return "ntk-config:" + json.dumps(raw, sort_keys=True)


def config_of(payload: dict) -> NTKDistanceConfig:
    """A cell's configuration: the driver's own object in this process, built once per worker elsewhere."""
    raw = payload["config"]
    return cached(config_key(raw), lambda: NTKDistanceConfig.from_dict(raw))


def ntk_cell(payload: dict) -> dict:
    """One model x width x seed cell of the sweep (a pure function of ``payload``): the Cell as a dict."""
    hook = cached(payload["hook"], lambda: None) if payload.get("hook") else None
    arch, width, seed = payload["model"], int(payload["width"]), int(payload["seed"])
    cell = train_cell(arch, width, seed, config_of(payload), sweep_rows_for(payload), hook)
    return asdict(cell)


def train_cell(
    arch: str,
    width: int,
    seed: int,
    config: NTKDistanceConfig,
    rows: SweepRows,
    on_model: Callable[[str, int, int, TwoLayerNet], None] | None = None,
) -> Cell:
    """Train one network on the MLP's inputs Z (``rows``' context of ``arch``) and compare it with
    the kernel predictor; ``on_model`` gets the trained network."""
    ctx = rows.arch_context(arch, config)
    w = rows.width_context(arch, width, config)
    kidx = rows.kernel_rows(config)
    t_cell = time.perf_counter()
    Z, Zt, y, yt = ctx.Z, ctx.Zt, rows.y, rows.yt
    dtype_name = config.dtype_for(width)
    tdt = torch.float32 if dtype_name == "float32" else F64
    # The MLP is trained on precomputed f_att(X): identical maths to MLP-Attn's forward,
    # without re-applying the (d x d) context every step.
    spec = model_spec("relu", Z.shape[1], width, rows.c, config, seed)
    net = TwoLayerNet(spec, dtype=tdt).to(Z.device)
    state0 = TwoLayerState.from_model(net)
    with torch.no_grad():
        f0 = net(Z.to(tdt)).to(F64)
        f0t = net(Zt.to(tdt)).to(F64)
    result = train(net, Z.to(tdt), y, TrainConfig(loss=config.loss, lr=w.lr, steps=config.steps))
    stateT = TwoLayerState.from_model(net)
    W64, a64 = stateT.W.to(F64), stateT.a.to(F64)

    def forward64(inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(inputs @ W64.T * stateT.s_in) @ a64 * stateT.s_out

    f_tr, f_te = forward64(Z), forward64(Zt)
    initial_loss = result.loss_curve[0] if result.loss_curve else float("nan")
    final_loss = loss_value(f_tr, y, config.loss).item()
    diverged = bool(result.diverged or not math.isfinite(final_loss) or final_loss > initial_loss)

    pred = kernel_gd_predict(w.kinf, rows.Y, w.gd_cfg, K_test=w.kinf_test, f0_train=f0, f0_test=f0t)
    pred_test = pred.f_test
    assert pred_test is not None  # K_test given
    dist = rms_rows(f_te - pred_test)
    ref = rms_rows(pred_test)
    if diverged or not torch.isfinite(f_tr).all():
        km = dict.fromkeys(KERNEL_METRICS, float("nan"))
    else:
        km = kernel_metrics(as_float64(state0), as_float64(stateT), Z[kidx], w.kin_k, w.v_top)
    if on_model is not None:
        on_model(arch, width, seed, reference_model(arch, spec, ctx.context, stateT))
    return Cell(
        model=arch,
        width=width,
        seed=seed,
        lr=w.lr,
        train_dtype=dtype_name,
        steps_run=result.steps_run,
        diverged=diverged,
        distance_rms=dist,
        distance_rel=dist / ref if ref > 0 else float("nan"),
        ntk_output_rms=ref,
        distance_train_rms=rms_rows(f_tr - pred.f_train),
        net_train_loss=final_loss,
        net_initial_loss=initial_loss,
        net_train_acc=accuracy(f_tr, y),
        net_test_acc=accuracy(f_te, yt),
        kernel_train_loss=loss_value(pred.f_train, y, config.loss).item(),
        kernel_train_acc=accuracy(pred.f_train, y),
        kernel_test_acc=accuracy(pred_test, yt),
        predictor={"stability_ratio": pred.stability_ratio, "diverges": pred.diverges, "method": pred.method},
        seconds=time.perf_counter() - t_cell,
        **km,
    )


# the kernel-movement metrics of a cell (NaN when its training diverged)
KERNEL_METRICS = (
    "kernel_movement",
    "kernel_init_error",
    "kernel_movement_complement",
    "kernel_init_error_complement",
    "kernel_movement_trace",
)


def kernel_metrics(
    state0: TwoLayerState, stateT: TwoLayerState, Z: torch.Tensor, kinf: torch.Tensor, v: torch.Tensor
) -> dict:
    """Frobenius ratios on the full (n c)^2 kernel, streamed block by output pair (k <= l)."""
    gram = Z @ Z.T
    n = Z.shape[0]

    def project(B: torch.Tensor) -> torch.Tensor:
        # (I - v v^T) B (I - v v^T) without forming the projector
        Bv, vB = B @ v, v @ B
        return B - torch.outer(Bv, v) - torch.outer(v, vB) + (v @ Bv) * torch.outer(v, v)

    acc = dict.fromkeys(("t0", "ainf", "move", "init", "t0_q", "ainf_q", "move_q", "init_q"), 0.0)
    trace0 = torch.zeros(n, n, dtype=Z.dtype, device=Z.device)
    traceT = torch.zeros_like(trace0)
    kinf_q = project(kinf)
    for (k, l, B0), (_, _, BT) in zip(
        entk_two_layer_blocks(state0, Z, gram=gram), entk_two_layer_blocks(stateT, Z, gram=gram)
    ):
        w = 1.0 if k == l else 2.0  # Theta_lk = Theta_kl^T has the same norm
        A = kinf if k == l else None
        dM = BT - B0
        dI = B0 - A if A is not None else B0
        B0q, dMq, dIq = project(B0), project(dM), project(dI)
        acc["t0"] += w * B0.pow(2).sum().item()
        acc["move"] += w * dM.pow(2).sum().item()
        acc["init"] += w * dI.pow(2).sum().item()
        acc["t0_q"] += w * B0q.pow(2).sum().item()
        acc["move_q"] += w * dMq.pow(2).sum().item()
        acc["init_q"] += w * dIq.pow(2).sum().item()
        if k == l:
            acc["ainf"] += kinf.pow(2).sum().item()
            acc["ainf_q"] += kinf_q.pow(2).sum().item()
            trace0 += B0
            traceT += BT

    def ratio(a: str, b: str) -> float:
        return math.sqrt(acc[a] / acc[b]) if acc[b] > 0 else float("nan")

    return {
        "kernel_movement": ratio("move", "t0"),
        "kernel_init_error": ratio("init", "ainf"),
        "kernel_movement_complement": ratio("move_q", "t0_q"),
        "kernel_init_error_complement": ratio("init_q", "ainf_q"),
        "kernel_movement_trace": ((traceT - trace0).norm() / trace0.norm()).item(),
    }


def spectrum_diagnostics(K: torch.Tensor) -> dict:
    """Spectrum of a symmetric kernel: top eigenvalue, condition number and numerical rank (eigenvalues
    above n eps max|lambda|), and the top eigenvalue's share of the trace."""
    lam = torch.linalg.eigvalsh(0.5 * (K + K.T))
    top = lam[-1].item()
    tol = K.shape[0] * torch.finfo(K.dtype).eps * max(abs(top), abs(lam[0].item()))
    pos = lam[lam > tol]
    total = lam.clamp_min(0).sum().item()
    return {
        "lam_max": top,
        "condition_number": top / pos[0].item() if pos.numel() else float("inf"),
        "numerical_rank": int(pos.numel()),
        "top_eig_share": top / total if total > 0 else float("nan"),
    }


def mean_pairwise_cosine(Z: torch.Tensor) -> float:
    """Mean cosine between distinct rows of Z (NaN for fewer than two rows)."""
    n = Z.shape[0]
    if n < 2:
        return float("nan")
    U = Z / Z.norm(dim=1, keepdim=True).clamp_min(torch.finfo(Z.dtype).tiny)
    s = U.sum(0)
    # sum over i != j of cos = |sum u|^2 - sum |u|^2
    return ((s @ s - U.pow(2).sum()) / (n * (n - 1))).item()


def model_spec(arch: str, d_in: int, width: int, n_out: int, config: NTKDistanceConfig, seed: int) -> ModelSpec:
    """The :class:`ModelSpec` of one cell's network (the configuration's choices, validated against ModelSpec's)."""
    choices: dict[str, Any] = {
        "parametrization": config.parametrization,
        "init": config.init,
        "attn_scaling": config.attn_scaling,
    }
    return ModelSpec(cast(Any, arch), d_in, width, n_out, seed=seed, **choices)


def as_float64(state: TwoLayerState) -> TwoLayerState:
    """The state's weights in float64 (the kernels are float64 whatever the training dtype)."""
    return TwoLayerState(state.W.to(F64), state.a.to(F64), state.s_in, state.s_out)


def reference_model(arch: str, spec: ModelSpec, context: torch.Tensor | None, state: TwoLayerState) -> TwoLayerNet:
    """The trained weights as an attnaudit model of the requested architecture (attn keeps its context)."""
    full_spec = dataclasses.replace(spec, arch=cast(Any, arch), extra={})
    net = TwoLayerNet(full_spec, context=None if context is None else context.cpu(), dtype=state.W.dtype)
    with torch.no_grad():
        net.W.copy_(state.W.cpu())
        net.a.copy_(state.a.cpu())
    return net
