"""attnaudit: audit attention models through the neural tangent kernel (NTK) lens.

Every command is a request, one ``run`` and a result (docs/api.md)::

    import attnaudit as aa
    result = aa.run(aa.KappaRequest(dataset="digits", n=(256,)))
    result.verdicts, result.results, result.to_dict()      # sentences, numbers, the JSON report
    aa.run(aa.MalleabilityRequest(preset="quick"))           # the same protocol as the CLI's --preset quick

The building blocks stay public: plain functions over a :class:`Task` (any module with a
loss and an input layout) and tensors::

    task = aa.Task(my_vit, n_classes=10, loss="ce", inputs=aa.Inputs("images", (1, 28, 28)), params="head")
    infl = aa.compute_influence(task, X_train, y_train, X_test, y_test, aa.InfluenceConfig(estimator="cg"))
    K = aa.empirical_ntk(task, X_train[:64]).kernel

Names are imported on first use, so ``import attnaudit`` stays light.
"""

from __future__ import annotations

import importlib
import warnings as _warnings

__version__ = "0.2.0"

# torch's forward-mode AD (Hessian-vector products) loads a jit-scripted decomposition table
# on first use and warns about torch's own deprecated API; nothing a user of this tool can act on.
_warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated", category=FutureWarning)

_PUBLIC = {
    # what is audited, and the engine
    "Task": "core",
    "Inputs": "core",
    "Engine": "core",
    "MSELoss": "core",
    "CrossEntropyLoss": "core",
    "Loss": "core",
    "select_parameter_names": "core",
    # data
    "DataSpec": "data",
    "Dataset": "data",
    "load_dataset": "data",
    "holdout_split": "data",
    # reference models
    "ModelSpec": "models.builtin",
    "build_model": "models.builtin",
    "save_model": "models.builtin",
    "load_model": "models.builtin",
    "build_builtin": "models.builtin",
    "ViT": "models.vit",
    "ViTSpec": "models.vit",
    "Recipe": "core.fit",
    "fit": "core.fit",
    # trained models from files: attnaudit checkpoints, Hugging Face folders, user factories
    "LoadedModel": "models.loaded",
    "load_checkpoint": "models.checkpoints",
    "load_factory": "models.checkpoints",
    "fit_to_data": "models.checkpoints",
    # requests -> run -> result: one per command (docs/api.md)
    "run": "analyses.registry",
    "Result": "analyses.result",
    "FieldError": "errors",
    "KappaRequest": "analyses.kappa.run",
    "NtkDistanceRequest": "analyses.ntk_distance.run",
    "MalleabilityRequest": "analyses.malleability.run",
    "LandscapeRequest": "analyses.landscape.run",
    "AlignmentRequest": "analyses.alignment.run",
    "TrainRequest": "analyses.training.run",
    "ClaimsRequest": "claims.run",
    "AuditRequest": "audit.request",
    # analyses: the building blocks (config -> function -> result)
    "KappaConfig": "analyses.kappa.dataset",
    "analyse_kappa": "analyses.kappa.dataset",
    "LayerKappaConfig": "analyses.kappa.layers",
    "analyse_layers": "analyses.kappa.layers",
    "find_attention_layers": "analyses.kappa.discovery",
    "kernel_movement": "analyses.ntk_distance.movement",
    "centered_kernel_alignment": "core.linalg",
    "LinearizedModel": "analyses.ntk_distance.linearized",
    "linearized_prediction": "analyses.ntk_distance.linearized",
    "CheckpointKernelConfig": "analyses.ntk_distance.config",
    "analyse_checkpoint": "analyses.ntk_distance.checkpoint",
    "TransformerSweepConfig": "analyses.ntk_distance.config",
    "run_transformer_sweep": "analyses.ntk_distance.transformers",
    "NTKDistanceConfig": "analyses.ntk_distance.config",
    "run_ntk_distance": "analyses.ntk_distance.widths",
    "empirical_ntk": "core.ntk",
    "analytic_ntk": "core.ntk",
    "InfluenceConfig": "analyses.influence.influence",
    "compute_influence": "analyses.influence.influence",
    "influence_sweep": "analyses.influence.influence",
    "AttackConfig": "analyses.malleability.attack_config",
    "perturb": "analyses.malleability.attacks",
    "MalleabilityConfig": "analyses.malleability.config",
    "run_malleability": "analyses.malleability.malleability",
    "LandscapeConfig": "analyses.landscape",
    "analyse_landscape": "analyses.landscape",
    "run_landscape": "analyses.landscape",
    # CI audit files (attnaudit audit)
    "load_audit_file": "audit",
    "run_audit": "audit",
    "write_junit": "audit",
    # errors
    "AuditError": "errors",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'attnaudit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
