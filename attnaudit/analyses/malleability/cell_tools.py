"""What one cell's computations share: working copies of a saved model (float64, or float32
under a lower precision), the text model fed
embedding rows, the keys of an influence run's inputs (bitwise-equal inputs, equal results),
the diagnostics row of an influence result, a token attack's edits and the rows a cell used."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnaudit.analyses.influence.kfac import tensors_sha256
from attnaudit.analyses.malleability.attacks import ADVERSARIAL, RANDOM_CONTROLS, TOKEN_ATTACKS
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.core.task import Inputs, Task
from attnaudit.data import data_fingerprint
from attnaudit.errors import AuditError
from attnaudit.core.lm_rows import split_rows
from attnaudit.models.hf import HFEmbeddingShiftClassifier, HFSequenceClassifier, embedding_shift_rows
from attnaudit.models.hf_causal import HFCausalLM, HFCausalLMShift, causal_shift_rows

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe


#: rows per forward pass when a cell evaluates a model (accuracies, losses): bounds the
#: activations of a large text model (a 67 M-parameter one over 2,000 texts of 128 tokens in
#: one pass held ~10 GiB)
EVAL_ROWS = 128


def logits_of(model: nn.Module | Task, X: torch.Tensor) -> torch.Tensor:
    """Logits of flat rows X, without gradients, in chunks of :data:`EVAL_ROWS`: a Task maps rows
    to its module's input; a bare module takes rows. Floating rows are cast to the model's
    floating dtype (a float32 working copy evaluates float64 rows)."""
    module = model.module if isinstance(model, Task) else model
    dtype = next((t.dtype for t in module.parameters() if t.is_floating_point()), X.dtype)
    out = []
    with torch.no_grad():
        for a in range(0, X.shape[0], EVAL_ROWS):
            rows = X[a : a + EVAL_ROWS]
            rows = rows.to(dtype) if rows.is_floating_point() else rows
            out.append(model.logits(rows) if isinstance(model, Task) else model(rows))
    return torch.cat(out) if out else model.logits(X) if isinstance(model, Task) else model(X)


def working_copy(model: nn.Module | Task, device, dtype: torch.dtype, always: bool = False) -> nn.Module | Task:
    """``model`` in ``dtype`` on ``device``: a deep copy when it is not already (or ``always``), so a
    user's model is never changed."""
    module = model.module if isinstance(model, Task) else model
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    if always or any(t.dtype != dtype or t.device != device for t in floats):
        module = copy.deepcopy(module).to(device=device, dtype=dtype)
    return replace(model, module=module) if isinstance(model, Task) else module


def influence_key(
    model: nn.Module | Task,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    config: MalleabilityConfig,
    n_classes: int,
    arch: str,
) -> str:
    """sha256 over what one influence run depends on: the model (class, layer structure, every
    parameter and buffer, its input mapping), the training rows X with the cell's labels, the
    test rows, and the estimator's settings (the influence estimators draw no randomness from the
    cell's seed: their own seed is fixed in :class:`InfluenceConfig`). Equal keys give
    bitwise-equal results."""
    module = model.module if isinstance(model, Task) else model
    h = hashlib.sha256(f"{type(module).__qualname__}|{arch}|{config.loss}|{n_classes}|".encode())
    h.update(repr((config.influence, tuple(config.damping))).encode())
    if isinstance(model, Task):
        h.update(repr((model.inputs, getattr(model.loss, "name", model.loss), model.params)).encode())
    h.update(repr(module).encode())  # the layer structure (the state dict holds the numbers)
    tensors = {f"state.{name}": t for name, t in module.state_dict().items()}
    tensors.update(zip(("X", "y", "X_test", "y_test"), rows))
    h.update(tensors_sha256(tensors).encode())
    return h.hexdigest()


def attack_key(model: nn.Module | Task, X: torch.Tensor, y: torch.Tensor, config: Any) -> str:
    """sha256 over what a seedless attack depends on: the model (class, layer structure, every
    parameter and buffer, its input mapping and loss), the rows and labels, and the attack's
    settings but its seed. Equal keys give bitwise-equal perturbations."""
    module = model.module if isinstance(model, Task) else model
    h = hashlib.sha256(f"{type(module).__qualname__}|".encode())
    h.update(repr(replace(config, seed=0)).encode())
    if isinstance(model, Task):
        h.update(repr((model.inputs, getattr(model.loss, "name", model.loss), model.params)).encode())
    h.update(repr(module).encode())
    tensors = {f"state.{name}": t for name, t in module.state_dict().items()}
    tensors.update(X=X, y=y)
    h.update(tensors_sha256(tensors).encode())
    return h.hexdigest()


def pair_key(clean: str | None, perturbed: str | None) -> str | None:
    """The inputs of one clean-vs-perturbed comparison (None when either run has no key)."""
    if clean is None or perturbed is None:
        return None
    return hashlib.sha256(f"{clean}|{perturbed}".encode()).hexdigest()[:16]


#: the diagnostics of an influence result a row of ``influence_diagnostics`` keeps (when present)
DIAGNOSTIC_KEYS = (
    "min_eigenvalue",
    "max_eigenvalue",
    "damped_min_eigenvalue",
    "positive_definite",
    "n_negative_eigenvalues",
    "damped_condition_number",
    "iterations",
    "relative_residual_max",
    "converged",
    "negative_curvature",
    "checkpoints_used",
    "lambda_max",
    "lambda_max_method",
    "lambda_max_residual",
    "lambda_max_converged",
    "damping_relative",
    "damping_abs",
    "solver",
    "curvature",
    "curvature_seed",
    "layers",
    "excluded_parameters",
    "damping_per_layer",
    "factor_bytes",
    "proj_dim",
    "proj_dim_used",
    "store",
    "store_rows_reused",
    "store_rows_computed",
    "store_bytes",
    "store_build_seconds",
    "store_executor",
    "store_segments_dropped",
    "projection_layout",
    "projected_rows_computed",
    "projected_rows_reused",
    "hessian_vector_products",
    "projected_min_eigenvalue",
)


def diagnostics_row(seed: int, arch: str, role: str, res) -> dict:
    """The report's row of one influence result: who (seed, model, role), how (estimator, path,
    damping as given and absolute) and :data:`DIAGNOSTIC_KEYS` of its diagnostics."""
    d = res.diagnostics
    row = {
        "seed": seed,
        "model": arch,
        "role": role,
        "estimator": res.estimator,
        "damping": res.damping,
        "path": res.path,
        "n_params": res.n_params,
        "memory_estimate_bytes": d.get("memory_estimate_bytes", {}).get("total"),
        "seconds": d.get("seconds"),
    }
    row.update({k: d[k] for k in DIAGNOSTIC_KEYS if k in d})
    if "damping_given" in d:
        row["damping"] = d["damping_given"]  # as given (a number, or "1e-3x"); damping_abs is what was used
    else:
        row["damping_abs"] = res.damping
    return row


def embedding_attacked(model, config: MalleabilityConfig) -> bool:
    """Whether ``model`` is a text classifier fed token ids and ``config`` attacks its embeddings
    (fgsm, pgd, mim or a noise control): its rows then become embedding-shift rows."""
    module = model.module if isinstance(model, Task) else model
    continuous = [a for a in config.attacks if a in ADVERSARIAL + RANDOM_CONTROLS and a not in TOKEN_ATTACKS]
    plain_text = isinstance(module, HFSequenceClassifier) and not isinstance(module, HFEmbeddingShiftClassifier)
    plain_lm = isinstance(module, HFCausalLM) and not isinstance(module, HFCausalLMShift)
    return bool(continuous) and (plain_text or plain_lm)


def as_embedding_rows(model: Task, *rows: torch.Tensor) -> tuple[Task, list[torch.Tensor]]:
    """The text ``model`` fed embedding-shift rows, and ``rows`` (token ids) as such rows (zero shift):
    same numbers, parameter gradients included (:class:`~attnaudit.models.hf.HFEmbeddingShiftClassifier`, or
    for a language model's documents :class:`~attnaudit.models.hf_causal.HFCausalLMShift`)."""
    if isinstance(model.module, HFCausalLM):
        lm = HFCausalLMShift(model.module)
        return replace(model, module=lm, inputs=Inputs()), [
            causal_shift_rows(*split_rows(r), lm.hidden).to(r.device) for r in rows
        ]
    assert isinstance(model.module, HFSequenceClassifier)
    shift = HFEmbeddingShiftClassifier(model.module)
    return replace(model, module=shift, inputs=Inputs()), [
        embedding_shift_rows(r, shift.hidden).to(r.device) for r in rows
    ]


def token_edits(model, X: torch.Tensor, X_adv: torch.Tensor) -> list[dict]:
    """Each changed text of a token attack: its training-row index, its ids before and the swaps [position, old id, new id]."""
    module = model.module if isinstance(model, Task) else model
    if isinstance(module, HFEmbeddingShiftClassifier):
        before, after = module.split_rows(X)[0], module.split_rows(X_adv)[0]
    elif isinstance(module, HFCausalLMShift):
        before, after = module.split_shift(X)[0], module.split_shift(X_adv)[0]
    elif isinstance(module, HFCausalLM):
        before, after = split_rows(X)[0], split_rows(X_adv)[0]
    else:
        before, after = X.round().long(), X_adv.round().long()
    out = []
    for i in torch.nonzero((before != after).any(1)).flatten().tolist():
        positions = torch.nonzero(before[i] != after[i]).flatten().tolist()
        swaps = [[p, int(before[i, p]), int(after[i, p])] for p in positions]
        out.append({"index": i, "ids": before[i].tolist(), "swaps": swaps})
    return out


def split_info(X_train: torch.Tensor, y_train: torch.Tensor, data: "HoldoutRecipe | None") -> dict:
    """Which rows a cell trained and was measured on: the split seed and index checksums (from
    the recipe) and a checksum of the training rows' contents."""

    info: dict = {
        "split_seed": None if data is None else int(data.seed),
        "train_indices_sha256": None,
        "test_indices_sha256": None,
        "train_data_sha256": data_fingerprint(X_train, y_train),
    }
    if data is not None:
        try:
            tr, te = data.load()
            info["train_indices_sha256"] = (tr.info.get("holdout") or {}).get("indices_sha256")
            info["test_indices_sha256"] = (te.info.get("holdout") or {}).get("indices_sha256")
        except AuditError:
            pass
    return info
