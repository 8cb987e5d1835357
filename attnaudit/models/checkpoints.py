"""Loading the model a user wants audited, from any of the supported sources.

Sources (one :class:`LoadedModel` each):

* an attnaudit checkpoint, ``model.safetensors`` with its JSON side-car
  ``model.safetensors.json`` (:func:`attnaudit.models.builtin.load_model`);
* a Hugging Face model folder holding ``config.json`` and ``model.safetensors``
  (:mod:`attnaudit.models.hf`, needs ``pip install "attnaudit[hf]"``);
* a user's own ``torch.nn.Module`` built by ``--factory package.module:function`` with
  weights from ``--weights file.safetensors``.

Only safetensors is read by default; pickle-based files are refused unless
``trust_pickle`` (:mod:`attnaudit.models.weights`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnaudit.core.task import Inputs
from attnaudit.errors import AuditError, FieldError, clip_text, field_check, literal
from attnaudit.models.loaded import LoadedModel
from attnaudit.models.weights import PICKLE_SUFFIXES, pickle_refusal
from attnaudit.models.builtin import load_model
from attnaudit.models.hf import is_causal_lm_folder, load_hf_directory
from attnaudit.models.hf_causal import load_hf_causal_lm
from attnaudit.models.weights import load_into, read_weights
from attnaudit.core.task import eval_mode, probe_rows, to_logits
from attnaudit.data import image_shape
from attnaudit.models.hf import adapt_to_data
from attnaudit.data import data_fingerprint, holdout_split
from attnaudit.data import subset
from attnaudit.core.fit import Recipe
from attnaudit.models.builtin import ModelSpec
from attnaudit.models.vit import ViTSpec
from attnaudit.models.builtin import build_model
from attnaudit.models.vit import ViT


# --------------------------------------------------------------------------- sources

INPUT_KINDS = ("auto", "flat", "images", "tokens")


def _sha256(path: Path, limit: int = 1 << 34) -> str | None:
    """sha256 of a file (None for folders): identifies exactly which weights were audited."""
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(path: str | Path, *, trust_pickle: bool = False, field: str = "checkpoint") -> LoadedModel:
    """A model from a checkpoint path: an attnaudit checkpoint or a Hugging Face folder. A path
    that is none is refused with a :class:`FieldError` on ``field`` (the request field that named it).

    * a folder with ``config.json``: a Hugging Face classifier (:func:`attnaudit.models.hf.load_hf_directory`)
      or causal language model (:func:`attnaudit.models.hf_causal.load_hf_causal_lm`);
    * ``.safetensors`` with its side-car ``PATH.json``: a model written by attnaudit;
    * a pickle-based file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): refused unless
      ``trust_pickle``; a bare state_dict says nothing of the architecture, so it is
      loaded through ``--factory`` (see :func:`load_factory`).
    """

    path = Path(path)
    named = "{name} " + literal(path)
    if not path.exists():
        raise FieldError(field, named + " not found; check the path")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FieldError(
                field,
                named + " is a folder without config.json: a Hugging Face model folder holds config.json and "
                "model.safetensors (save_pretrained writes both); for an attnaudit checkpoint give the .safetensors file",
            )

        if is_causal_lm_folder(path):
            return load_hf_causal_lm(path, trust_pickle=trust_pickle)
        return load_hf_directory(path, trust_pickle=trust_pickle)
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        if not trust_pickle:
            raise pickle_refusal(path, field=field)
        raise FieldError(
            field,
            named + " is a bare weights file that does not say which architecture it belongs to; load it with a "
            "factory (package.module:function) and these weights, trusting pickle",
        )
    if suffix != ".safetensors":
        raise FieldError(
            field,
            named + literal(f": unknown checkpoint format {suffix or '(no suffix)'}") + "; give an attnaudit "
            ".safetensors file (with its .json side-car) or a Hugging Face model folder",
        )
    sidecar = path.with_suffix(path.suffix + ".json")
    if not sidecar.exists():
        raise FieldError(
            field,
            named + literal(f" has no side-car {sidecar.name}") + ", so it was not written by attnaudit and its "
            "architecture is unknown; for your own model give a factory (package.module:function) and its weights; "
            "for a Hugging Face model give its folder",
        )

    module = load_model(path)
    module.eval()
    spec = module.spec
    metadata = dict(getattr(module, "metadata", None) or {})
    recipe = metadata.get("recipe")
    if not isinstance(recipe, dict):
        recipe = {}
    loss = recipe.get("loss") if recipe.get("loss") in ("mse", "ce") else None
    inputs = module.audit_inputs() if hasattr(module, "audit_inputs") else Inputs()
    n_features = int(math.prod(inputs.shape)) if inputs.shape is not None else getattr(spec, "d_in", None)
    arch = getattr(spec, "arch", type(module).__name__)
    return LoadedModel(
        module=module,
        inputs=inputs,
        n_classes=int(spec.n_out),
        n_features=n_features,
        label=path.name.removesuffix(".safetensors") or arch,
        source={
            "kind": "attnaudit",
            "path": str(path),
            "sha256": _sha256(path),
            "arch": arch,
            "spec": dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else None,
            "parameters": int(sum(p.numel() for p in module.parameters())),
        },
        metadata=metadata,
        loss=loss,
    )


def _import_factory(factory: str):
    text = str(factory).strip()
    module_name, sep, attr = text.partition(":")
    named = "{name} " + literal(text)
    if not sep or not module_name or not attr:
        raise FieldError(
            "factory",
            "{name} " + literal(repr(text)) + " must look like package.module:function (a module path, a colon, "
            "a callable)",
        )
    # Like `python -m`, look in the working directory first: users keep their model code there.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise FieldError(
            "factory",
            named + literal(f": cannot import module {module_name!r} ({clip_text(exc)})") + "; run from the folder "
            "that holds it or install it",
        ) from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise FieldError(
            "factory",
            named + literal(f": importing {module_name!r} failed ({type(exc).__name__}: {clip_text(exc)})"),
        ) from None
    target = mod
    for part in attr.split("."):
        if not hasattr(target, part):
            raise FieldError("factory", named + literal(f": module {module_name!r} has no attribute {attr!r}"))
        target = getattr(target, part)
    if not callable(target):
        raise FieldError(
            "factory",
            named + literal(f": {attr!r} is a {type(target).__name__}") + ", not a function that builds the model",
        )
    return target


def load_factory(
    factory: str,
    weights: str | Path | None = None,
    *,
    trust_pickle: bool = False,
    inputs: str = "auto",
) -> LoadedModel:
    """A user's own ``torch.nn.Module`` from ``factory`` (``package.module:function``, called
    without arguments), with the ``weights`` (safetensors; pickle only with ``trust_pickle``)
    checked against it key by key and shape by shape. A refusal is a :class:`FieldError` on the
    field at fault (``factory``, ``weights`` or ``inputs``).

    ``inputs``: how data rows reach the module -- ``flat`` rows, ``images`` in the data
    set's (C, H, W), ``tokens``, or ``auto`` (the module's own ``audit_inputs()`` when it
    defines one, else images for image data and flat rows otherwise; settled by
    :func:`fit_to_data`).
    """

    if inputs not in INPUT_KINDS:
        raise FieldError("inputs", "unknown {name} " + literal(repr(inputs)) + f"; use one of {', '.join(INPUT_KINDS)}")
    builder = _import_factory(factory)
    tensors = None
    if weights is not None:
        tensors = field_check("weights", lambda name: read_weights(weights, trust_pickle=trust_pickle, what=name))
    try:
        module = builder()
    except Exception as exc:  # noqa: BLE001 - the user's code failed
        raise FieldError(
            "factory",
            "{name} " + literal(f"{factory}: calling it failed ({type(exc).__name__}: {clip_text(exc)})"),
        ) from None
    if not isinstance(module, nn.Module):
        raise FieldError(
            "factory",
            "{name} " + literal(f"{factory} returned a {type(module).__name__}") + ", not a torch.nn.Module; return "
            "the model itself",
        )
    if tensors is not None:
        field_check(
            "weights",
            lambda name: load_into(
                module,
                tensors,
                where=f"{name} {weights}",
                fix="check that the factory builds the model these weights belong to",
            ),
        )
    module.eval()
    declare = getattr(module, "audit_inputs", None) if inputs == "auto" else None  # a model's optional declaration
    declared = declare() if declare is not None else None
    module_name, _, attr = str(factory).partition(":")
    label = f"{module_name.rpartition('.')[2]}.{attr}"
    return LoadedModel(
        module=module,
        inputs=declared if declared is not None else Inputs(kind="flat" if inputs == "auto" else inputs),
        n_classes=0,  # read off the logits by fit_to_data
        n_features=None,
        label=label,
        source={
            "kind": "factory",
            "factory": str(factory),
            "weights": None if weights is None else str(weights),
            "sha256": None if weights is None else _sha256(Path(weights)),
            "inputs": "declared" if declared is not None else inputs,
            "parameters": int(sum(p.numel() for p in module.parameters())),
        },
    )


def fit_to_data(loaded: LoadedModel, dataset) -> LoadedModel:
    """``loaded`` ready for ``dataset`` (an :class:`attnaudit.data.Dataset`), or one
    :class:`AuditError` line saying what the model expects.

    Settles the input layout (Hugging Face image models adapt to the data's channels and
    size; ``auto`` factory inputs become images for image data), then runs one row through
    the model (no gradients, eval mode, nothing changed) to check that it accepts the data
    and that its logits cover every label.
    """

    if loaded.source.get("task") == "causal-lm" or dataset.info.get("task") == "next-token":
        return _fit_language_model(loaded, dataset)
    shape = tuple(int(s) for s in dataset.feature_shape)
    images = image_shape(shape)
    d = int(dataset.X.shape[1])
    if loaded.source.get("kind") == "huggingface" and loaded.inputs.kind == "tokens":
        loaded = adapt_to_data(loaded, shape)  # a sequence classifier: rows of token ids (text data)
    elif loaded.source.get("kind") == "huggingface":
        if images is None:
            raise AuditError(
                f"model {loaded.label} is an image model but {dataset.name} has flat rows of {d} features; give image data"
            )
        loaded = adapt_to_data(loaded, images)
    elif loaded.source.get("kind") == "factory" and loaded.source.get("inputs") in ("auto", "images"):
        if images is not None:
            loaded = dataclasses.replace(loaded, inputs=Inputs(kind="images", shape=images))
        elif loaded.source.get("inputs") == "images":
            raise FieldError(
                "inputs",
                "{name} images needs image data (C, H, W), but "
                + literal(f"{dataset.name} has flat rows of {d} features"),
            )
    if loaded.inputs.kind == "tokens" and loaded.inputs.shape is None:
        loaded = dataclasses.replace(loaded, inputs=Inputs(kind="tokens", shape=None, keyword=loaded.inputs.keyword))
    if loaded.inputs.kind == "images" and images != loaded.inputs.shape:  # Inputs keeps its shape as a tuple
        have = f"images of shape {images}" if images is not None else f"flat rows of {d} features"
        raise AuditError(
            f"model {loaded.label} expects images of shape {loaded.inputs.shape} but {dataset.name} has {have}; "
            "audit it on data of the shape it was trained on"
        )
    expected = loaded.inputs.features()
    if expected is None and loaded.inputs.kind == "flat" and loaded.n_features is not None:
        expected = loaded.n_features
    if expected is not None and expected != d:
        what = f"images of shape {loaded.inputs.shape}" if loaded.inputs.kind == "images" else f"{expected} features"
        raise AuditError(
            f"model {loaded.label} expects {what} ({expected} values per sample), but {dataset.name} has {d} per sample "
            f"(shape {shape}); audit it on data of the shape it was trained on"
        )
    module = loaded.module
    try:
        with torch.no_grad(), eval_mode(module):
            rows = probe_rows(module, dataset.X[:2])
            logits = to_logits(loaded.inputs.call(module, loaded.inputs(rows)))
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model rejected the data
        raise AuditError(
            f"model {loaded.label} cannot take {dataset.name}'s samples as {loaded.inputs.kind} of shape "
            f"{loaded.inputs.shape or (d,)} ({type(exc).__name__}: {clip_text(exc)}); give data of the shape it expects"
            + (" or set --inputs" if loaded.source.get("kind") == "factory" else "")
        ) from None
    width = int(logits.shape[1])
    if loaded.n_classes and width != loaded.n_classes:
        raise AuditError(f"model {loaded.label} declares {loaded.n_classes} classes but returns {width} logits")
    if dataset.y is not None and dataset.y.numel():
        top = int(dataset.y.max())
        if top >= width:
            raise FieldError(
                "classes",
                literal(
                    f"model {loaded.label} has {width} outputs (classes 0..{width - 1}) but {dataset.name}'s labels "
                )
                + f"go up to {top}; select matching classes ({{name}}) or audit it on the data it was trained on",
            )
    return dataclasses.replace(loaded, n_classes=width, n_features=d)


def _fit_language_model(loaded: LoadedModel, dataset) -> LoadedModel:
    """A causal language model and documents (rows [ids | attention], attnaudit.core.lm_rows):
    both must be one, the documents' ids inside the model's vocabulary, and one forward must
    give logits (rows, positions, vocabulary)."""
    if loaded.source.get("task") != "causal-lm":
        raise AuditError(
            f"{dataset.name} holds documents for a causal language model, but model {loaded.label} is not one; "
            "audit a ...ForCausalLM / ...LMHeadModel checkpoint on documents, or give labelled data"
        )
    if dataset.info.get("task") != "next-token":
        raise AuditError(
            f"model {loaded.label} is a causal language model, but {dataset.name} is not a set of documents; give "
            "documents (.jsonl with a text field, .txt, or a folder of .txt files) tokenized by its tokenizer"
        )
    L = int(dataset.X.shape[1]) // 2
    top = int(dataset.X[:, :L].max()) if dataset.n else 0
    if top >= loaded.n_classes:
        raise AuditError(
            f"{dataset.name}'s token ids go up to {top} but model {loaded.label} has a vocabulary of {loaded.n_classes}; "
            "tokenize the documents with the model's own tokenizer"
        )
    with torch.no_grad(), eval_mode(loaded.module):
        logits = loaded.module(dataset.X[:2].to(torch.float32))
    if logits.ndim != 3 or int(logits.shape[-1]) != loaded.n_classes:
        raise AuditError(
            f"model {loaded.label} returned logits of shape {tuple(logits.shape)}; a causal language model returns "
            f"(documents, positions, {loaded.n_classes})"
        )
    return dataclasses.replace(loaded, n_features=int(dataset.X.shape[1]))


def load_model_source(
    checkpoint: str | Path | None = None,
    *,
    factory: str | None = None,
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str = "auto",
    field: str = "checkpoint",
) -> LoadedModel:
    """One model from a request's model fields: ``checkpoint`` (named ``field`` in the request) or
    ``factory`` (+ ``weights``)."""
    if checkpoint is not None and factory is not None:
        raise FieldError(field, "{name} and factory both name a model; give one of them")
    if weights is not None and factory is None:
        raise FieldError(
            "weights",
            "{name} go with a factory (the function that builds the model); for an attnaudit or Hugging Face "
            "checkpoint give the checkpoint alone",
        )
    if factory is not None:
        return load_factory(factory, weights, trust_pickle=trust_pickle, inputs=inputs)
    if checkpoint is None:
        raise AuditError("no model given; give a checkpoint (a path) or a factory (package.module:function)")
    if inputs != "auto":
        raise FieldError("inputs", "{name} applies to factory models; a checkpoint records its own input layout")
    return load_checkpoint(checkpoint, trust_pickle=trust_pickle, field=field)


def unique_labels(labels: list[str]) -> list[str]:
    """Labels made unique in order (``vit``, ``vit#2``, ...)."""
    out: list[str] = []
    for stem in labels:
        label, i = stem, 2
        while label in out:
            label, i = f"{stem}#{i}", i + 1
        out.append(label)
    return out


def recorded_split(dataset, models: dict[str, LoadedModel]):
    """(training rows, held-out rows, recorded split) of the models' own training split, or None.

    Applies when every model's side-car records the same split (``metadata.training_data``:
    ``holdout`` sizes and seed, and the training-data ``fingerprint``) and rebuilding it from
    ``dataset`` reproduces that fingerprint exactly -- the proof that these are the rows the
    model was trained on.
    """

    keys = set()
    for loaded in models.values():
        data = loaded.metadata.get("training_data") if isinstance(loaded.metadata, dict) else None
        if not isinstance(data, dict):
            return None
        hold = data.get("holdout")
        if not isinstance(hold, dict):
            return None
        try:
            keys.add(
                (
                    int(hold["n_train"]),
                    int(hold["n_test"]),
                    int(hold["seed"]),
                    bool(hold.get("stratify", True)),
                    str(data.get("fingerprint")),
                )
            )
        except (KeyError, TypeError, ValueError):
            return None
    if len(keys) != 1:
        return None
    n_train, n_test, seed, stratify, fingerprint = keys.pop()
    if n_train < 1 or n_test < 1 or n_train + n_test > dataset.n or dataset.y is None:
        return None
    train_all, held_all = holdout_split(dataset, n_train, n_test, seed=seed, stratify=stratify)
    if data_fingerprint(train_all.X, train_all.y) != fingerprint:
        return None
    return train_all, held_all, {"n_train": n_train, "n_test": n_test, "seed": seed, "fingerprint": fingerprint}


def audit_split(dataset, models: dict[str, LoadedModel], n_train: int, n_test: int, seed: int):
    """The audit's training and held-out rows, and a note saying where they came from.

    When the models' own training split can be rebuilt (:func:`recorded_split`), the audit
    draws ``n_train`` of its rows from the checkpoint's training rows and ``n_test`` from
    its held-out rows (seeded by ``seed``): influence is measured on data the model was
    trained on and evaluated on data it never saw. Otherwise a fresh seeded holdout split of
    ``dataset`` (as for built-in models); the caller warns if the recorded fingerprint differs.
    """

    rebuilt = recorded_split(dataset, models)
    if rebuilt is not None:
        train_all, held_all, rec = rebuilt
        if n_test > held_all.n:
            raise FieldError(
                "n_test", "{name} " + f"{n_test} exceeds the checkpoint's {held_all.n} held-out rows; lower {{name}}"
            )
        train = subset(train_all, min(n_train, train_all.n), seed)
        test = subset(held_all, n_test, seed)
        return (
            train,
            test,
            {
                "rows": "checkpoint split",
                "detail": f"{train.n} of the checkpoint's {train_all.n} training rows and {test.n} of its {held_all.n} "
                f"held-out rows (its split rebuilt; training-data fingerprint {rec['fingerprint']} matched)",
                "recorded_split": rec,
            },
        )
    train, test = holdout_split(dataset, n_train, n_test, seed=seed, stratify=True)
    return train, test, {"rows": "fresh split", "detail": f"a seeded holdout split of the data (seed {seed})"}


@dataclass(frozen=True)
class Rebuild:
    """How to re-run a checkpoint's recorded training from scratch (``--protocol retrain``).

    ``spec``: the architecture and sizes (a built-in's ``ModelSpec``/``ViTSpec``);
    ``recipe``: the recorded :class:`attnaudit.core.fit.Recipe`; ``init_seed``: the recorded
    initialisation seed.
    """

    spec: Any
    recipe: Any
    init_seed: int

    def build(self, seed: int, X_context: torch.Tensor) -> nn.Module:
        """A fresh float64 model of this architecture initialised from ``seed`` (MLP-Attn's
        context from ``X_context``)."""

        if isinstance(self.spec, ModelSpec):
            return build_model(
                dataclasses.replace(self.spec, seed=seed), X_context, dtype=torch.float64, device=X_context.device
            )
        if isinstance(self.spec, ViTSpec):
            return ViT(dataclasses.replace(self.spec, seed=seed), dtype=torch.float64, device=X_context.device)
        raise AuditError(f"cannot rebuild a {type(self.spec).__name__}")  # pragma: no cover - guarded by rebuild_of


def rebuild_of(loaded: LoadedModel) -> Rebuild | None:
    """The :class:`Rebuild` of an attnaudit checkpoint whose side-car records its recipe, else None."""

    spec = (loaded.source or {}).get("spec")
    module_spec = getattr(loaded.module, "spec", None)
    if loaded.source.get("kind") != "attnaudit" or spec is None or not isinstance(module_spec, (ModelSpec, ViTSpec)):
        return None
    recorded = loaded.recipe
    if recorded is None:
        return None
    recipe = Recipe.from_dict(recorded)
    init_seed = loaded.metadata.get("init_seed", module_spec.seed)
    if not isinstance(init_seed, int) or isinstance(init_seed, bool):
        raise AuditError(f"checkpoint {loaded.label}: side-car init_seed must be an integer, got {init_seed!r}")
    return Rebuild(spec=module_spec, recipe=recipe, init_seed=init_seed)
