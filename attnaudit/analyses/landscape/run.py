"""The two-model comparison end to end: train (or take saved) models, analyse each, compare.

:func:`run_landscape` is what ``attnaudit landscape`` calls: options -> this one call ->
report. It builds every model and resolves the parameter selector on each before any
training or analysis, so a selector that matches nothing fails at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from attnaudit.core.task import Task
from attnaudit.errors import AuditError
from attnaudit.analyses.landscape.analysis import LandscapeConfig, LandscapeResult, analyze_landscape
from attnaudit.analyses.landscape.compare import compare_landscapes
from attnaudit.analyses.landscape.setup import landscape_task, parameter_names

Progress = Callable[[int], None] | None
ARCHS = ("relu", "attn")

# Training and analysis sizes per preset; explicit options override every entry.
PRESETS: dict[str, dict] = {
    # digits, both models trained and analysed in well under 2 minutes on 2 CPU cores
    # compared at matched training loss (auto: the larger of the models' losses after the budget),
    # since with fixed steps MLP-Attn ends at ~5x 2L-ReLU's loss and the comparison gate refuses
    "quick": dict(dataset="digits", split="train", n_train=500, width=256, steps=1000, lr=4.0, match_loss="auto",
                  seeds=3),
    # real MNIST, training split like every paper preset (pass --split test where only the
    # test split exists, as in ../shared/data); about 5 minutes on 2 CPU cores
    # the paper's protocol: GD for a fixed time (its losses may not be comparable: the gate says so)
    "paper": dict(dataset="mnist", split="train", n_train=2000, width=256, steps=1000, lr=4.0, match_loss=None,
                  seeds=1),
}


def build_reference_model(arch: str, X: torch.Tensor, n_classes: int, *, width: int, seed: int) -> nn.Module:
    """2L-ReLU / MLP-Attn of ``width`` initialised from ``seed`` (MLP-Attn's context from X), in X's dtype and device."""
    from attnaudit.models.builtin import ModelSpec, build_model

    spec = ModelSpec(arch, int(X.shape[1]), int(width), int(n_classes), seed=int(seed))
    return build_model(spec, X, dtype=X.dtype, device=X.device)


def train_reference_model(
    arch: str, X: torch.Tensor, y: torch.Tensor, n_classes: int, *, width: int, seed: int, train_config
):
    """Build 2L-ReLU / MLP-Attn with ``seed`` and train it with the project's full-batch GD.

    Uses the same training path as every command (:func:`attnaudit.core.training.train`).
    Returns (model, TrainResult).
    """
    from attnaudit.core.training import train

    model = build_reference_model(arch, X, n_classes, width=width, seed=seed)
    return model, train(model, X, y.long(), train_config)


def run_work_units(config: LandscapeConfig, n_models: int, train_steps: int = 0) -> int:
    """Progress units of :func:`run_landscape`: each model's training steps and analysis."""
    return n_models * (config.work_units() + train_steps)


SEED_FIELDS = ("loss", "accuracy", "lambda_max", "trace", "trace_stderr", "basin_width", "basin_stderr")


def seed_record(seed: int, r: LandscapeResult) -> dict:
    """The headline numbers of one seed's analysis (per-seed values of the per-model JSON)."""
    return {
        "seed": seed, "loss": r.loss, "accuracy": r.accuracy,
        "lambda_max": r.eigen.eigenvalues[0] if r.eigen.eigenvalues else float("nan"),
        "top_eigenvalues": list(r.eigen.eigenvalues), "trace": r.trace.estimate, "trace_stderr": r.trace.stderr,
        "basin_width": r.basin.width, "basin_stderr": r.basin.stderr, "basin_censored": r.basin.censored,
    }


def seed_summary(records: Sequence[dict]) -> dict:
    """Per-seed values with mean and sd (ddof 1; 0 for one seed) of each headline number."""
    import math

    mean, sd = {}, {}
    for key in SEED_FIELDS:
        vals = [float(rec[key]) for rec in records if rec.get(key) is not None and math.isfinite(rec[key])]
        if not vals:
            mean[key] = sd[key] = None
            continue
        m = sum(vals) / len(vals)
        mean[key] = m
        sd[key] = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"n_seeds": len(records), "values": list(records), "mean": mean, "sd": sd,
            "note": "the model's other fields (loss, accuracy, top_eigenvalues, trace, basin, surfaces) are the first "
                    "seed's; the comparison uses the mean over seeds with its standard error"}


@dataclass(frozen=True)
class LandscapeRun:
    """Landscapes of several models on the same data, with the comparison's verdicts and warnings.

    ``training[label]``: how the model came to be (trained here: steps run, final loss,
    loss curve, seed; saved: its source and spec). ``lr``: the GD learning rate when the
    models were trained here with full-batch GD (GD's stability bound is 2 / lr), else None.
    ``results``: the first seed's analysis per model; ``seed_results``: every seed's (``seeds``
    lists them; one seed unless ``--seeds``). ``status[label]``: the untrained rule (chance,
    threshold, mean training accuracy, ``untrained``).
    """

    results: dict[str, LandscapeResult]
    training: dict[str, dict]
    verdicts: tuple[str, ...]
    warnings: tuple[str, ...]
    lr: float | None = None
    timings: dict = field(default_factory=dict)
    seed_results: dict[str, list[LandscapeResult]] = field(default_factory=dict)
    seed_training: dict[str, list[dict]] = field(default_factory=dict)
    seeds: tuple[int, ...] = ()
    status: dict[str, dict] = field(default_factory=dict)
    optimizer: dict | None = None
    #: ``match_loss_auto``: the rule, each model's and seed's loss after the step budget, and
    #: the common target L* every model was then trained to (None otherwise)
    match_loss_resolution: dict | None = None

    @property
    def labels(self) -> list[str]:
        return list(self.results)

    def model_dict(self, label: str) -> dict:
        out = {"training": self.training[label], **self.results[label].to_dict()}
        st = self.status.get(label)
        if st is not None:
            out.update({"untrained": st["untrained"], "chance": st["chance"], "untrained_threshold": st["threshold"]})
        runs = self.seed_results.get(label)
        if runs:
            seeds = self.seeds or tuple(range(len(runs)))
            out["seeds"] = seed_summary([seed_record(s, r) for s, r in zip(seeds, runs)])
            if self.seed_training.get(label):
                out["seeds"]["training"] = self.seed_training[label]
        return out

    def to_dict(self) -> dict:
        return {
            "models": {k: self.model_dict(k) for k in self.results},
            "gd_stability_bound": None if self.lr is None else 2.0 / self.lr,
            "optimizer": self.optimizer,
            "verdicts": list(self.verdicts),
            "warnings": list(self.warnings),
        }


def _saved_checks(label: str, net: nn.Module | Task, X: torch.Tensor, y: torch.Tensor) -> None:
    spec = getattr(net.module if isinstance(net, Task) else net, "spec", None)
    if spec is None:
        return
    if getattr(spec, "d_in", X.shape[1]) != X.shape[1]:
        raise AuditError(f"saved model {label} takes {spec.d_in} input features but the data have {X.shape[1]}; use the data it was trained on")
    if int(y.max()) >= getattr(spec, "n_out", int(y.max()) + 1):
        raise AuditError(f"saved model {label} has {spec.n_out} outputs but the labels go up to {int(y.max())}; select matching classes")


def run_landscape(
    data,
    config: LandscapeConfig,
    *,
    models: Sequence[str] | None = None,
    width: int = 256,
    train_config=None,
    seed: int = 0,
    saved: Mapping[str, nn.Module | Task] | None = None,
    saved_info: Mapping[str, dict] | None = None,
    progress: Progress = None,
    seeds: Sequence[int] | None = None,
    recipe=None,
    loss_ratio: float | None = None,
    match_loss_auto: bool = False,
) -> LandscapeRun:
    """Train the reference models ``models`` (default relu, attn) on ``data``, or take the
    ``saved`` ones (label -> module or Task), analyse each with ``config`` and compare them.

    ``data``: anything with ``X`` (n, d), ``y`` (n,) and ``n_classes`` (an
    :class:`attnaudit.data.Dataset`). ``train_config``: a :class:`attnaudit.core.training.TrainConfig`
    (its ``loss_tol`` is the match-loss target). ``saved_info``: provenance recorded under
    each saved model's ``training`` (e.g. its file). Saved models carrying a training-data
    fingerprint that differs from ``data`` get a warning.

    ``seeds``: built-in models only; one independent initialisation, training and analysis
    (random directions, Lanczos start, probes: ``config.seed`` + the seed's offset from the
    first) per seed, default ``(seed,)``. ``results`` holds the first seed's analysis, so a
    one-seed run is unchanged; the comparison uses the mean over seeds. ``recipe``: an
    :class:`attnaudit.core.fit.Recipe` (``sgd``/``adam`` with a batch size) trains the built-in
    models with :func:`attnaudit.core.fit.fit` instead of full-batch GD (``train_config`` then only
    names the loss); its ``seed`` (data order) is replaced by each model seed.

    ``match_loss_auto`` (full-batch GD): every model and seed is first trained for the whole
    step budget; the largest final loss L* becomes ``train_config.loss_tol``, so every model
    is then trained until its loss first reaches L* (the slowest one runs its whole budget).
    """
    from attnaudit.core import training as gd  # looked up at call time (tests replace gd.train)

    X, y = data.X, data.y
    if y is None:
        raise AuditError("the loss landscape needs labelled data")
    y = y.to(X.device).long()
    if saved and models:
        raise AuditError("give reference models to train or saved models to analyse, not both")
    timings: dict[str, float] = {}
    training: dict[str, dict] = {}
    provenance: list[str] = []
    if saved:
        nets = dict(saved)
        for label, net in nets.items():
            _saved_checks(label, net, X, y)
            module = net.module if isinstance(net, Task) else net
            spec = getattr(module, "spec", None)
            training[label] = {**(saved_info or {}).get(label, {})}
            if dataclasses.is_dataclass(spec):
                training[label]["spec"] = dataclasses.asdict(spec)
        # models whose audited rows were drawn from their own recorded training split need no warning
        own_rows = {label for label, info in (saved_info or {}).items()
                    if (info.get("audit_rows") or {}).get("rows") == "checkpoint split"}
        provenance = _provenance({k: v for k, v in nets.items() if k not in own_rows}, X, y)
        train_config = None
    else:
        archs = tuple(models) if models is not None else ARCHS
        bad = [a for a in archs if a not in ARCHS]
        if bad:
            raise AuditError(f"unknown reference model {bad[0]!r}; use relu, attn or both")
        if len(set(archs)) != len(archs) or not archs:
            raise AuditError("list each reference model once (relu, attn)")
        train_config = train_config or gd.TrainConfig(loss=config.loss or "mse")
        nets = {a: build_reference_model(a, X, data.n_classes, width=width, seed=seed) for a in archs}
    seed_list = tuple(int(s) for s in seeds) if seeds is not None else (int(seed),)
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise AuditError("give at least one seed, each once")
    if saved and len(seed_list) > 1:
        raise AuditError("--seeds trains independent copies of the built-in models; a saved model is one model")
    if recipe is not None and saved:
        raise AuditError("--optimizer and --batch-size say how to train the built-in models; a saved model is trained already")
    for net in nets.values():  # a selector that matches nothing fails now, before training or analysis
        parameter_names(landscape_task(net, X, config.loss, config.params), X)

    resolution = None
    if match_loss_auto:
        if train_config is None or recipe is not None:
            raise AuditError("--match-loss auto trains the built-in models with full-batch GD; drop it for saved models "
                             "or --optimizer sgd/adam")
        budget = dataclasses.replace(train_config, loss_tol=None)
        runs = []
        for label in nets:
            for s in seed_list:
                tr = gd.train(build_reference_model(label, X, data.n_classes, width=width, seed=s), X, y, budget)
                if tr.diverged:
                    raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
                runs.append({"model": label, "seed": s, "final_loss": float(tr.final_loss), "steps_run": tr.steps_run})
        slowest = max(runs, key=lambda r: r["final_loss"])
        train_config = dataclasses.replace(train_config, loss_tol=slowest["final_loss"])
        resolution = {"rule": "auto: the largest training loss any model reaches within the step budget",
                      "target": slowest["final_loss"], "set_by": f"{slowest['model']} seed {slowest['seed']}",
                      "budget_steps": budget.steps, "budget_runs": runs}

    results: dict[str, LandscapeResult] = {}
    seed_results: dict[str, list[LandscapeResult]] = {label: [] for label in nets}
    seed_training: dict[str, list[dict]] = {label: [] for label in nets}
    for label in list(nets):
        for i, s in enumerate(seed_list):
            net = nets[label] if i == 0 else build_reference_model(label, X, data.n_classes, width=width, seed=s)
            cfg = config if i == 0 else dataclasses.replace(config, seed=config.seed + (s - seed_list[0]))
            t1 = time.perf_counter()
            if train_config is not None:
                info = _train_one(label, net, X, y, train_config, recipe, s, gd)
                seed_training[label].append(info)
                if i == 0:
                    training[label] = info
                if progress is not None:
                    progress(info.pop("_units"))
            timings[f"{label}.train"] = timings.get(f"{label}.train", 0.0) + time.perf_counter() - t1
            t1 = time.perf_counter()
            res = analyze_landscape(net, X, y, cfg, progress=progress)
            timings[f"{label}.analysis"] = timings.get(f"{label}.analysis", 0.0) + time.perf_counter() - t1
            seed_results[label].append(res)
            if i == 0:
                results[label] = res

    lr = None if train_config is None or recipe is not None else train_config.lr
    n_present = int(torch.unique(y).numel())
    verdicts, warnings = compare_landscapes(
        results, training if train_config is not None else {}, lr=lr,
        match_loss=None if train_config is None else train_config.loss_tol, saved=bool(saved),
        seed_results=seed_results, n_classes=n_present,
        **({} if loss_ratio is None else {"loss_ratio": loss_ratio}),
    )
    from attnaudit.analyses.landscape.compare import untrained_status

    status = untrained_status({k: [r.accuracy for r in v] for k, v in seed_results.items()}, n_present, int(X.shape[0]))
    return LandscapeRun(
        results=results, training=training, verdicts=tuple(verdicts), warnings=tuple(provenance + list(warnings)),
        lr=lr, timings=timings, seed_results=seed_results if not saved else {},
        seed_training=seed_training if len(seed_list) > 1 else {}, seeds=seed_list, status=status,
        match_loss_resolution=resolution,
        optimizer=None if train_config is None else (
            recipe.to_dict() if recipe is not None else {"optimizer": "gd", "lr": train_config.lr, "batch_size": None,
                                                         "steps": train_config.steps, "loss": train_config.loss}),
    )


def _train_one(label: str, net: nn.Module, X: torch.Tensor, y: torch.Tensor, train_config, recipe, seed: int, gd) -> dict:
    """Train one built-in model (full-batch GD, or :func:`attnaudit.core.fit.fit` with ``recipe``); its training record."""
    if recipe is None:
        tr = gd.train(net, X, y, train_config)
        if tr.diverged:
            raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
        return {
            "steps_run": tr.steps_run, "final_loss": tr.final_loss, "reached_match_loss": tr.reached_tol,
            "loss_curve_every_10": tr.loss_curve, "model_seed": seed, "optimizer": "gd", "_units": train_config.steps,
        }
    from attnaudit.core.fit import fit

    rec = dataclasses.replace(recipe, seed=int(seed))
    res = fit(net, X, y, rec)
    if res.diverged:
        raise AuditError(f"training {label} diverged ({res.notes[0] if res.notes else 'non-finite loss'}); lower --lr")
    reached = None if train_config.loss_tol is None else bool(res.final_train_loss <= train_config.loss_tol)
    return {
        "steps_run": res.steps_run, "final_loss": res.final_train_loss, "reached_match_loss": reached,
        "loss_curve_every_10": res.loss_curve[::10], "model_seed": seed, "optimizer": rec.optimizer,
        "batch_size": rec.batch_size, "lr": rec.lr, "train_accuracy": res.train_accuracy, "path": res.path,
        "_units": rec.total_steps(int(X.shape[0])),
    }


def _provenance(nets: Mapping[str, nn.Module | Task], X: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Warnings for saved models whose recorded training data differ from ``(X, y)``."""
    from attnaudit.data import data_fingerprint
    from attnaudit.models.builtin import training_data_mismatch

    fingerprint = None
    out = []
    for label, net in nets.items():
        module = net.module if isinstance(net, Task) else net
        if not getattr(module, "metadata", None):
            continue
        fingerprint = fingerprint or data_fingerprint(X.cpu(), y.cpu())
        warning = training_data_mismatch(module, label, fingerprint)
        if warning:
            out.append(warning)
    return out
