"""attnaudit: audit attention models through the neural tangent kernel (NTK) lens.

The public Python API mirrors the CLI: every command is a plain function that takes data,
a model or :class:`Task`, and a small config dataclass, and returns a result dataclass
with ``to_dict()``::

    import attnaudit as aa
    task = aa.Task(my_vit, n_classes=10, loss="ce", inputs=aa.Inputs("images", (1, 28, 28)), params="head")
    infl = aa.compute_influence(task, X_train, y_train, X_test, y_test, aa.InfluenceConfig(estimator="cg"))
    land = aa.analyze_landscape(task, X_train, y_train, aa.LandscapeConfig())
    K = aa.empirical_ntk(task, X_train[:64]).kernel

Names are imported on first use, so ``import attnaudit`` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

import importlib
import warnings as _warnings

__version__ = "0.1.0"

# torch's forward-mode AD (Hessian-vector products) loads a jit-scripted decomposition table
# on first use and warns about torch's own deprecated API; nothing a user of this tool can act on.
_warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated", category=FutureWarning)

_PUBLIC = {
    # what is audited, and the engine
    "Task": "core", "Inputs": "core", "Engine": "core", "MSELoss": "core", "CrossEntropyLoss": "core",
    "Loss": "core", "select_parameter_names": "core",
    # data
    "DataSpec": "data", "Dataset": "data", "load_dataset": "data", "holdout_split": "data",
    # reference models
    "ModelSpec": "models", "build_model": "models", "save_model": "models", "load_model": "models",
    "build_builtin": "models", "ViT": "vit", "ViTSpec": "vit", "Recipe": "fit", "fit": "fit",
    # trained models from files: attnaudit checkpoints, Hugging Face folders, user factories
    "LoadedModel": "loaded_model", "load_checkpoint": "checkpoints", "load_factory": "checkpoints",
    "fit_to_data": "checkpoints",
    # analyses: config -> run -> result
    "KappaConfig": "kappa", "analyse_kappa": "kappa",
    "LayerKappaConfig": "layer_kappa", "analyse_layers": "layer_kappa", "find_attention_layers": "layer_kappa",
    "kernel_movement": "kernel_regime", "centered_kernel_alignment": "kernel_regime",
    "LinearizedModel": "kernel_regime", "linearized_prediction": "kernel_regime",
    "CheckpointKernelConfig": "kernel_regime", "analyse_checkpoint": "kernel_regime",
    "TransformerSweepConfig": "kernel_regime", "run_transformer_sweep": "kernel_regime",
    "NTKDistanceConfig": "ntk_distance", "run_ntk_distance": "ntk_distance",
    "empirical_ntk": "ntk", "analytic_ntk": "ntk",
    "InfluenceConfig": "influence", "compute_influence": "influence", "influence_sweep": "influence",
    "AttackConfig": "attacks", "perturb": "attacks",
    "MalleabilityConfig": "malleability", "run_malleability": "malleability",
    "LandscapeConfig": "landscape", "analyze_landscape": "landscape", "run_landscape": "landscape",
    # CI audit files (attnaudit audit)
    "load_audit_file": "audit", "run_audit": "audit", "write_junit": "audit",
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
