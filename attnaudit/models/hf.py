"""Auditing a user's trained Hugging Face classifier from its model folder, offline.

:func:`load_hf_directory` turns a folder written by ``save_pretrained`` (``config.json``
plus ``model.safetensors``, optionally ``preprocessor_config.json``) into a
:class:`~attnaudit.models.checkpoints.LoadedModel` that every analysis can take (influence,
attacks, Hessians through ``torch.func``). Needs ``pip install "attnaudit[hf]"``
(transformers); attnaudit itself imports without it.

Every file in the folder is untrusted, and nothing is fetched or executed from it:

* no network: the config is parsed here and the model is built from it with the class's
  ``_from_config`` (the hub is never asked for anything, ``from_pretrained`` is not used);
  ``use_pretrained_backbone`` is switched off so no backbone weights are downloaded;
* no remote code: a config whose ``auto_map`` asks for custom modelling code is refused
  (``trust_remote_code`` is never set); the class must be one transformers ships;
* weights: read by :func:`attnaudit.models.weights.read_weights` (safetensors; ``pytorch_model.bin``
  only with ``trust_pickle``, and then with ``torch.load(weights_only=True)``), renamed from
  the saved layout to the model's own (transformers 5 keeps legacy names on disk, e.g.
  ``vit.encoder.layer.0.attention.attention.query.weight`` for the module's
  ``vit.layers.0.attention.q_proj.weight``), checked against the freshly built model
  (missing, unexpected, shapes) naming the keys as the file spells them, then loaded with
  :func:`attnaudit.models.weights.load_into` (dtypes, finite values, strict load). Tied weights that
  ``save_pretrained`` writes once are filled from their twin; non-persistent buffers are
  rebuilt by the model's constructor.

Every problem is one :class:`~attnaudit.errors.AuditError` line naming it and the fix,
raised before the model is run.

The module is wrapped so the toolkit can feed it the data layer's images or token ids:

* :class:`HFImageClassifier` (``...ForImageClassification``): ``forward(images)`` takes
  (B, C, H, W) floats in the data's range ([0, 1] for attnaudit's image data sets), maps
  channels (1 -> the model's count by repetition, 3 -> 1 by the mean), resizes with
  bilinear interpolation (``align_corners=False``, differentiable: attacks still work) to
  the model's ``image_size`` and normalises with ``preprocessor_config.json``'s
  ``image_mean``/``image_std`` when ``do_normalize``. ``do_rescale`` (x ``rescale_factor``,
  1/255) is skipped on purpose: it maps uint8 pixels to [0, 1], where the data already is.
  The resize is torch's bilinear without antialiasing, not PIL's; downsampling by large
  factors therefore differs slightly from the image processor.
* :class:`HFSequenceClassifier` (``...ForSequenceClassification``): ``forward(input_ids)``
  with an attention mask ``input_ids != pad_token_id`` when the config has a pad token.
  Verified on tiny BERT and DistilBERT models only.

Both return the model's ``.logits`` and run it under the math kernel of scaled dot-product
attention (second derivatives and forward-mode AD exist only there; see
``shared/notes/transformers-and-torch-func.md``). Parameter names, as ``--params`` takes
them, are the wrapper's: the transformer sits under ``model.``, so globs read like
``model.vit.layers.1.*`` or ``model.classifier.*`` (transformers 5 module names, not the
names in the file); ``head`` is ``model.classifier`` (or ``model.score``).

The data set's image shape is unknown while loading: the loaded model's ``inputs`` holds
the model's native shape (num_channels, image_size, image_size); :func:`adapt_to_data`
returns it set for a data set's ``feature_shape``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from attnaudit.models.loaded import LoadedModel
from attnaudit.core.engine import math_attention
from attnaudit.core.task import Inputs
from attnaudit.errors import AuditError, FieldError, clip_text as _clip, key_mismatch, literal, name_list as _names
from attnaudit.models.weights import load_into, read_weights

INSTALL_HINT = 'loading a Hugging Face checkpoint needs transformers: pip install "attnaudit[hf]"'
SUPPORTED_SUFFIXES = ("ForImageClassification", "ForSequenceClassification")
# causal language models: read by the same checks, loaded by attnaudit.models.hf_causal.load_hf_causal_lm
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
CONFIG_NAME = "config.json"
PREPROCESSOR_NAME = "preprocessor_config.json"
MAX_CONFIG_BYTES = 1 << 20
MAX_INDEX_BYTES = 16 << 20
# (file, sharded?) in order of preference: safetensors first, pickle only as a fallback.
WEIGHT_FILES = (
    ("model.safetensors", False),
    ("model.safetensors.index.json", True),
    ("pytorch_model.bin", False),
    ("pytorch_model.bin.index.json", True),
)
_OTHER_FRAMEWORKS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index")


# --------------------------------------------------------------------------- helpers


def read_json_object(path: Path, what: str, limit: int) -> dict[str, Any]:
    """A JSON object from a small file, or one AuditError line saying what is wrong with it."""
    size = path.stat().st_size
    if size > limit:
        raise AuditError(
            f"{what} {path} is {size:,} bytes, over the {limit:,}-byte limit for this file; it is not a genuine "
            "Hugging Face file — re-save the model with save_pretrained"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise AuditError(f"{what} {path} is not UTF-8 text; re-save the model with save_pretrained") from None
    except json.JSONDecodeError as exc:
        raise AuditError(
            f"{what} {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix or re-save it"
        ) from None
    except RecursionError:
        raise AuditError(
            f"{what} {path} nests JSON lists or objects too deeply to read; it is not a genuine Hugging Face file, "
            "re-save the model with save_pretrained"
        ) from None
    if not isinstance(data, dict):
        raise AuditError(
            f"{what} {path} holds a JSON {type(data).__name__}, not an object; re-save it with save_pretrained"
        )
    return data


def import_transformers():
    try:
        import transformers  # noqa: F401 - optional dependency, imported only here
    except ImportError:
        raise AuditError(INSTALL_HINT) from None
    return transformers


class _HeadNames:
    """A picklable ``head_parameter_names()`` for wrappers whose classifier was found."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)

    def __call__(self) -> list[str]:
        return list(self.names)


def _classifier_head(model: nn.Module, prefix: str = "model.") -> list[str] | None:
    """Parameter names (with ``prefix``) of the layer producing the logits: the ``classifier``
    or ``score`` attribute, or its last parameter-holding leaf (RoBERTa's ``out_proj``)."""
    for attr in ("classifier", "score"):
        head = getattr(model, attr, None)
        if not isinstance(head, nn.Module):
            continue
        leaves = [
            (name, sub)
            for name, sub in head.named_modules()
            if any(p.requires_grad for p in sub.parameters(recurse=False))
        ]
        if not leaves:
            continue
        name, sub = leaves[-1]
        base = f"{prefix}{attr}." + (f"{name}." if name else "")
        names = [base + n for n, p in sub.named_parameters(recurse=False) if p.requires_grad]
        if names:
            return names
    return None


# --------------------------------------------------------------------------- wrappers


class HFImageClassifier(nn.Module):
    """A Hugging Face image classifier fed the data set's images.

    ``forward(images)``: (B, C, H, W) floats in the data's range, C in {1, 3} or the
    model's channel count, any H, W -> channel mapping, bilinear resize to ``image_size``,
    ``(x - image_mean) / image_std`` when normalising -> ``model(pixel_values=...).logits``.
    ``image_mean``/``image_std`` are non-persistent buffers (None without normalisation).
    """

    image_mean: torch.Tensor | None  # registered buffers (declared for the type checker)
    image_std: torch.Tensor | None

    def __init__(
        self,
        model: nn.Module,
        *,
        num_channels: int,
        image_size: tuple[int, int] | None,
        image_mean: Sequence[float] | None = None,
        image_std: Sequence[float] | None = None,
    ):
        super().__init__()
        self.model = model
        self.num_channels = int(num_channels)
        self.image_size = tuple(int(s) for s in image_size) if image_size is not None else None
        if (image_mean is None) != (image_std is None):
            raise AuditError("image normalisation needs both image_mean and image_std")
        if image_mean is not None and image_std is not None:  # both or neither, checked above
            mean = torch.tensor(list(image_mean), dtype=torch.float32).reshape(1, -1, 1, 1)
            std = torch.tensor(list(image_std), dtype=torch.float32).reshape(1, -1, 1, 1)
            self.register_buffer("image_mean", mean, persistent=False)
            self.register_buffer("image_std", std, persistent=False)
        else:
            self.register_buffer("image_mean", None, persistent=False)
            self.register_buffer("image_std", None, persistent=False)
        head = _classifier_head(model)
        if head is not None:  # else attnaudit finds the head from a probe pass
            self.head_parameter_names = _HeadNames(head)

    def channel_mapping(self, channels: int) -> str:
        """How images with ``channels`` channels reach the model (AuditError when they cannot)."""
        if channels == self.num_channels:
            return "as is"
        if channels == 1:
            return f"1 -> {self.num_channels} by repetition"
        if channels == 3 and self.num_channels == 1:
            return "3 -> 1 by the mean"
        raise AuditError(
            f"the model takes images of {self.num_channels} channel(s); images of {channels} channels cannot be "
            f"mapped to it (supported: 1 or 3 channels, or {self.num_channels}); use a data set with 1 or 3 channels"
        )

    def pixel_values(self, images: torch.Tensor) -> torch.Tensor:
        """The model's ``pixel_values`` for a batch of data images (differentiable)."""
        if images.ndim != 4:
            raise AuditError(
                f"the model takes images (batch, channels, height, width); got a tensor of shape {tuple(images.shape)}"
            )
        channels = int(images.shape[1])
        self.channel_mapping(channels)
        if channels != self.num_channels:
            if channels == 1:
                images = images.expand(-1, self.num_channels, -1, -1)
            else:
                images = images.mean(dim=1, keepdim=True)
        if self.image_size is not None and tuple(images.shape[-2:]) != self.image_size:
            images = nn.functional.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
        if self.image_mean is not None and self.image_std is not None:  # both or neither
            images = (images - self.image_mean) / self.image_std
        return images

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with math_attention():
            return self.model(pixel_values=self.pixel_values(images)).logits


class HFSequenceClassifier(nn.Module):
    """A Hugging Face sequence classifier fed rows of token ids.

    ``forward(input_ids)``: (B, L) integer ids -> ``model(input_ids, attention_mask).logits``.
    With a ``pad_token_id``, padding is masked out; ``trim_padding``: columns that are padding
    in every row of a batch (trailing padding) are dropped before the model runs, which
    changes nothing for a model whose real tokens never read padding (masked positions get
    an exactly zero attention weight; the positions of the kept tokens are unchanged) and
    saves their compute: the loader turns it on only after checking that on the model
    (:func:`_padding_trim_exact`). Not while the ids are batched by ``vmap``, whose per-sample
    rows cannot be cut to a data-dependent length. ``mask="4d"`` (the default) passes an
    additive (B, 1, 1, L) mask (0 to attend, the dtype's minimum for padding), which
    transformers 5 hands to the attention unchanged: it has no data-dependent branch, so
    ``vmap`` (per-sample gradients) works — the 2-D mask makes transformers test
    ``mask.all()``, which ``vmap`` refuses. ``mask="2d"``: the plain 0/1 mask (for models
    that do not take 4-D masks; per-sample gradients may then fail). ``mask="none"``: every
    position is attended.
    """

    def __init__(self, model: nn.Module, *, pad_token_id: int | None, mask: str = "4d", trim_padding: bool = False):
        super().__init__()
        if mask not in ("4d", "2d", "none"):
            raise AuditError(f"unknown attention-mask mode {mask!r}; use 4d, 2d or none")
        self.model = model
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self.mask = mask if self.pad_token_id is not None else "none"
        self.trim_padding = bool(trim_padding) and self.mask != "none"
        head = _classifier_head(model)
        if head is not None:
            self.head_parameter_names = _HeadNames(head)

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if self.mask == "none":
            return None
        pad = self.pad_token_id
        assert pad is not None  # __init__ sets mask "none" without a pad token
        keep = input_ids != pad
        if self.mask == "2d":
            return keep.long()
        embeddings = self.model.get_input_embeddings()  # type: ignore[operator]  # a transformers model's method
        dtype = embeddings.weight.dtype if embeddings is not None else torch.float32
        zero = torch.zeros((), dtype=dtype, device=input_ids.device)
        low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        return torch.where(keep, zero, low)[:, None, None, :]

    def token_mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """(B, L) bool over the positions the model runs (trailing padding dropped when
        ``trim_padding``), True at real tokens, or None without a padding mask: what per-token
        analyses (per-layer kappa, K-FAC's input factors) restrict each sequence to."""
        if self.mask == "none":
            return None
        if input_ids.ndim == 1:
            input_ids = input_ids.unsqueeze(0)
        ids = input_ids.round().long() if input_ids.is_floating_point() else input_ids.long()
        kept = self.kept_length(ids)
        return torch.ne(ids if kept is None else ids[:, :kept], int(self.pad_token_id or 0))

    def kept_length(self, input_ids: torch.Tensor) -> int | None:
        """How many leading columns of a batch of ids (B, L) the model needs: through the last
        column holding a real token in some row; None to keep all of them (trimming off, ids
        batched by ``vmap``, or no trailing padding)."""
        return kept_columns(input_ids, self.pad_token_id) if self.trim_padding else None

    def cut_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of ids (B, L) without their trailing all-padding columns (``trim_padding``;
        else as given): what a vmapped per-sample computation, which cannot cut inside, is fed."""
        ids = rows.round().long() if rows.is_floating_point() else rows.long()
        kept = self.kept_length(ids) if rows.ndim == 2 else None
        return rows if kept is None else rows[:, :kept]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.long()
        if input_ids.ndim == 1:
            input_ids = input_ids.unsqueeze(0)
        kept = self.kept_length(input_ids)
        if kept is not None:
            input_ids = input_ids[:, :kept]
        kwargs: dict[str, torch.Tensor] = {"input_ids": input_ids}
        mask = self.attention_mask(input_ids)
        if mask is not None:
            kwargs["attention_mask"] = mask
        with math_attention():
            return self.model(**kwargs).logits


class HFEmbeddingShiftClassifier(HFSequenceClassifier):
    """A Hugging Face sequence classifier fed token ids plus a shift of their input embeddings.

    A row is (L, 1 + h) numbers, flat: channel 0 the token ids (exact integers in a float
    tensor), channels 1..h a shift ``delta`` added to each token's input embedding, so the
    model sees ``inputs_embeds = E[ids] + delta`` with the padding mask of ``ids``. With
    ``delta = 0`` it computes exactly what :class:`HFSequenceClassifier` computes on ``ids``,
    parameter gradients included (the embedding lookup stays inside the model's graph): the
    continuous attacks on text perturb ``delta`` and every analysis reads the rows as flat
    floats. Shares (never copies) the wrapped classifier's transformer; parameter names are
    the same (``model.*``).
    """

    def __init__(self, base: HFSequenceClassifier):
        super().__init__(base.model, pad_token_id=base.pad_token_id, mask=base.mask, trim_padding=base.trim_padding)
        embeddings = base.model.get_input_embeddings()  # type: ignore[operator]  # a transformers model's method
        self.hidden = int(embeddings.weight.shape[1])

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, L) int64, delta (B, L, h)) of rows (B, L * (1 + h)) or (B, L, 1 + h)."""
        if rows.ndim == 1:
            rows = rows.unsqueeze(0)
        width = self.hidden + 1
        if rows.ndim == 2:
            if rows.shape[1] % width:
                raise AuditError(
                    f"rows of {rows.shape[1]} numbers are not (tokens, 1 + {self.hidden}) embedding-shift rows"
                )
            rows = rows.reshape(rows.shape[0], -1, width)
        return rows[..., 0].round().long(), rows[..., 1:]

    def token_mask(self, rows: torch.Tensor) -> torch.Tensor | None:
        return super().token_mask(self.split_rows(rows)[0])

    def cut_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Flat rows (B, L (1 + h)) without the tokens of their trailing all-padding columns."""
        if rows.ndim != 2:
            return rows
        kept = self.kept_length(self.split_rows(rows)[0])
        return rows if kept is None else rows[:, : kept * (self.hidden + 1)]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # rows, not input_ids
        ids, delta = self.split_rows(rows)
        kept = None if _batched(rows) else self.kept_length(ids)
        if kept is not None:
            ids, delta = ids[:, :kept], delta[:, :kept]
        embeds = self.model.get_input_embeddings()(ids)  # type: ignore[operator]  # a transformers model's method
        kwargs: dict[str, torch.Tensor] = {"inputs_embeds": embeds + delta.to(embeds.dtype)}
        mask = self.attention_mask(ids)
        if mask is not None:
            kwargs["attention_mask"] = mask
        with math_attention():
            return self.model(**kwargs).logits


def kept_columns(ids: torch.Tensor, pad: int | None) -> int | None:
    """Leading columns of a batch of ids (B, L) that hold every real token: through the last
    column that is not ``pad`` in some row. None to keep all of them: no pad token, no
    trailing padding, or ids batched by ``vmap`` (their length must not depend on their
    values)."""
    if pad is None or ids.ndim != 2 or _batched(ids):
        return None
    where = torch.ne(ids, int(pad)).any(0).nonzero()
    kept = int(where.max()) + 1 if where.numel() else 1
    return kept if kept < ids.shape[1] else None


def _batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is (or wraps) a ``vmap`` batch: its per-sample views must not be cut to a
    data-dependent length. Tensors wrapped by ``grad``, ``vjp`` or ``jvp`` alone can be."""
    functorch = torch._C._functorch
    wrapped = getattr(functorch, "is_functorch_wrapped_tensor", None)
    is_batch = getattr(functorch, "is_batchedtensor", None)
    unwrap = getattr(functorch, "get_unwrapped", None)
    if wrapped is None or is_batch is None or unwrap is None:
        return True  # unknown torch internals: never cut
    while wrapped(t):
        if is_batch(t):
            return True
        t = unwrap(t)
    return False


def _padding_trim_exact(model: nn.Module, pad: int, mask: str, vocab: int | None, length: int | None) -> bool:
    """Whether dropping trailing padding leaves this model's logits unchanged, on a probe: two
    sequences of real tokens padded to ``length`` (at most 16) against the same sequences cut
    after their longest; a model whose head or pooling reads padded positions fails it."""
    if mask == "none" or not isinstance(vocab, int) or not 0 <= pad < vocab or vocab < 3:
        return False
    size = max(4, min(16, length if isinstance(length, int) and length > 0 else 16))
    tokens = [c for c in range(min(vocab, size + 1)) if c != pad]
    ids = torch.tensor([[tokens[(i + r) % len(tokens)] for i in range(size)] for r in range(2)])
    ids[0, size // 2 :] = pad
    ids[1, size // 2 + 1 :] = pad
    try:
        with torch.no_grad():
            wrapped = HFSequenceClassifier(model, pad_token_id=pad, mask=mask)
            full = wrapped(ids)
            cut = wrapped(ids[:, : size // 2 + 1])
    except Exception:  # noqa: BLE001 - the model cannot run on the shorter batch: keep the padding
        return False
    return bool(torch.allclose(full, cut, rtol=1e-5, atol=1e-6))


def embedding_shift_rows(ids: torch.Tensor, hidden: int, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Flat rows (n, L * (1 + hidden)) in float64 holding ``ids`` (n, L) and ``delta`` (n, L, hidden; default 0)."""
    ids = ids.round().long() if ids.is_floating_point() else ids.long()
    n, L = ids.shape
    rows = torch.zeros(n, L, hidden + 1, dtype=torch.float64, device=ids.device)
    rows[..., 0] = ids.to(torch.float64)
    if delta is not None:
        rows[..., 1:] = delta.to(torch.float64)
    return rows.reshape(n, -1)


def _choose_mask(model: nn.Module, pad: int | None, vocab: int | None, length: int | None) -> str:
    """``4d`` when the additive 4-D mask reproduces the model's own 2-D padding mask on a probe, else ``2d``."""
    if pad is None:
        return "none"
    if not isinstance(vocab, int) or not 0 <= pad < vocab or vocab < 3:
        return "2d"
    size = max(2, min(8, length if isinstance(length, int) and length > 0 else 8))
    tokens = [c for c in range(min(vocab, size + 1)) if c != pad]
    ids = torch.tensor([[tokens[i % len(tokens)] for i in range(size)]] * 2)
    ids[0, size // 2 :] = pad
    try:
        with torch.no_grad():
            ref = HFSequenceClassifier(model, pad_token_id=pad, mask="2d")(ids)
            got = HFSequenceClassifier(model, pad_token_id=pad, mask="4d")(ids)
    except Exception:  # noqa: BLE001 - the model does not take 4-D masks
        return "2d"
    return "4d" if torch.allclose(ref, got, rtol=1e-4, atol=1e-5) else "2d"


# --------------------------------------------------------------------------- config


# Sizes every supported architecture reads from config.json. Shapes are checked against the
# weights on the meta device (nothing allocated), but transformers builds some objects from
# them right away: num_labels=10**12 makes a dict of 10**12 labels, num_hidden_layers=10**12
# builds layers forever (even on the meta device), and a negative head count builds a model
# whose forward pass cannot run. So each must be a positive integer (layers at most MAX_LAYERS).
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "dim",
    "num_hidden_layers",
    "n_layers",
    "num_attention_heads",
    "n_heads",
    "intermediate_size",
    "hidden_dim",
    "max_position_embeddings",
    "type_vocab_size",
    "image_size",
    "patch_size",
    "num_channels",
    # causal language models (GPT-2's names; Llama's grouped-query key/value heads and head size)
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
    "num_key_value_heads",
    "head_dim",
)
# null in a saved config means "derived from the other sizes" (GPT-2's n_inner = 4 n_embd)
_NULLABLE_SIZES = ("n_inner", "num_key_value_heads", "head_dim")


MAX_LAYERS = 1024  # transformers builds layers one by one, even on the meta device: 10**12 would never end


def _check_sizes(raw: dict[str, Any], where: str) -> None:
    from attnaudit.data.spec import MAX_CLASSES

    for key in _SIZE_FIELDS:
        if key not in raw or (raw[key] is None and key in _NULLABLE_SIZES):
            continue
        values = raw[key] if isinstance(raw[key], list) and key in ("image_size", "patch_size") else [raw[key]]
        low = 0 if key == "type_vocab_size" else 1  # a BERT-like model may have no token types
        high = MAX_LAYERS if key in ("num_hidden_layers", "n_layers", "n_layer") else 2**31 - 1
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high for v in values):
            raise AuditError(
                f"{where}: {key} must be an integer in {low}..{high}, got {_clip(json.dumps(raw[key]), 40)}; fix it"
            )
    labels = raw.get("num_labels")
    for key in ("id2label", "label2id"):
        if isinstance(raw.get(key), dict) and labels is None:
            labels = len(raw[key])
    if labels is not None and (
        isinstance(labels, bool) or not isinstance(labels, int) or not 1 <= labels <= MAX_CLASSES
    ):
        raise AuditError(
            f"{where}: num_labels must be an integer in 1..{MAX_CLASSES}, got {_clip(json.dumps(labels), 40)}; fix it"
        )
    for key in ("id2label", "label2id"):
        if isinstance(raw.get(key), dict) and len(raw[key]) > MAX_CLASSES:
            raise AuditError(f"{where}: {key} names {len(raw[key])} classes, more than {MAX_CLASSES}; fix it")


def check_config(raw: dict[str, Any], path: Path, transformers) -> tuple[Any, type, str]:
    """The transformers config object, the model class and its kind (``images``, ``tokens`` or
    ``causal-lm``) from config.json, refusing custom code, unknown classes and quantized models."""
    where = f"config {path}"
    if raw.get("auto_map"):
        raise AuditError(
            f"{where} asks for custom modelling code (auto_map: {_clip(json.dumps(raw['auto_map']), 80)}); attnaudit "
            "does not run code from a checkpoint — use a model class that transformers ships"
        )
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise AuditError(f"{where} has no model_type; re-save the model with save_pretrained")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise AuditError(
            f"{where}: unknown model_type {model_type!r} for transformers {transformers.__version__}; upgrade "
            "transformers, or check the config (custom model types are not run)"
        )
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise AuditError(
            f'{where} has no architectures list naming the model class (e.g. ["ViTForImageClassification"]); '
            "re-save the model with save_pretrained"
        )
    arch = archs[0]
    if not arch.endswith(SUPPORTED_SUFFIXES + CAUSAL_SUFFIXES):
        raise AuditError(
            f"{where}: architecture {arch} is not supported; attnaudit audits classifiers: classes ending in "
            f"{' or '.join(SUPPORTED_SUFFIXES)} (e.g. ViTForImageClassification, BertForSequenceClassification), "
            f"and causal language models: classes ending in {' or '.join(CAUSAL_SUFFIXES)} (e.g. LlamaForCausalLM)"
        )
    if raw.get("quantization_config"):
        raise AuditError(f"{where}: quantized checkpoints are not supported; audit the float model")
    cls = getattr(transformers, arch, None) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", arch) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise AuditError(
            f"{where}: transformers {transformers.__version__} has no model class {arch}; upgrade transformers or "
            "check the architectures entry"
        )
    config_class = CONFIG_MAPPING[model_type]
    expected = getattr(cls, "config_class", None)
    if expected is not None and not issubclass(config_class, expected):
        raise AuditError(
            f"{where}: architecture {arch} does not take model_type {model_type!r} "
            f"(it expects {getattr(expected, 'model_type', '?')!r}); fix the config"
        )
    _check_sizes(raw, where)
    clean = {k: v for k, v in raw.items() if k != "auto_map"}
    try:
        config = config_class.from_dict(clean)
    except Exception as exc:  # noqa: BLE001 - the user's config
        raise AuditError(
            f"{where} is not a valid {model_type} config ({type(exc).__name__}: {_clip(exc)}); fix it"
        ) from None
    if getattr(config, "use_pretrained_backbone", False):
        config.use_pretrained_backbone = False  # never download a backbone: the folder's weights are loaded
    if arch.endswith(CAUSAL_SUFFIXES):
        return config, cls, "causal-lm"
    return config, cls, "images" if arch.endswith("ForImageClassification") else "tokens"


# --------------------------------------------------------------------------- weights


def _safe_member(folder: Path, name: object, index: Path) -> Path:
    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
        raise AuditError(
            f"index {index} names shard {name!r}, which is not a plain file name in the folder; fix the index"
        )
    path = folder / name
    if not path.is_file():
        raise AuditError(
            f"index {index} names shard {name}, which is not in {folder}; copy every shard into the folder"
        )
    return path


def read_folder_weights(folder: Path, trust_pickle: bool) -> tuple[dict[str, torch.Tensor], list[str], str]:
    """The folder's tensors (file names as keys), the files read and their format."""
    for name, sharded in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        fmt = "safetensors" if "safetensors" in name else "pickle"
        if not sharded:
            return read_weights(path, trust_pickle=trust_pickle, what="weights"), [name], fmt
        index = read_json_object(path, "index", MAX_INDEX_BYTES)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise AuditError(f"index {path} has no weight_map of tensor names to shard files; re-save the model")
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            _safe_member(folder, shard, path)
            shards.setdefault(shard, []).append(key)
        tensors: dict[str, torch.Tensor] = {}
        for shard, keys in shards.items():
            shard_path = folder / shard
            part = read_weights(shard_path, trust_pickle=trust_pickle, what="weights shard")
            absent = [k for k in keys if k not in part]
            extra = [k for k in part if weight_map.get(k) != shard]
            if absent or extra:
                what = f"lacks {_names(absent)}" if absent else f"holds {_names(extra)}, which the index puts elsewhere"
                raise AuditError(
                    f"weights shard {shard_path} {what}; the index and the shards disagree: re-save the model"
                )
            tensors.update(part)
        return tensors, sorted(shards), fmt
    others = [n for n in _OTHER_FRAMEWORKS if (folder / n).exists()]
    if others:
        raise AuditError(
            f"{folder} holds {', '.join(others)}: only PyTorch weights are read; save the model with PyTorch "
            "(save_pretrained writes model.safetensors)"
        )
    raise AuditError(
        f"{folder} has no weights file (model.safetensors, model.safetensors.index.json or pytorch_model.bin); "
        "save the trained model with save_pretrained"
    )


def _renamer(model: nn.Module):
    """file key -> model key, following transformers' own checkpoint conversions (renames only).

    Returns a function giving (model key, whether a tensor conversion other than renaming
    would be needed)."""
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # older transformers: the module's names are the file's (up to the base-model prefix)

        def plain(key: str) -> tuple[str, bool]:
            if key in state:
                return key, False
            if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1 :] in state:
                return key[len(prefix) + 1 :], False
            if prefix and f"{prefix}.{key}" in state:
                return f"{prefix}.{key}", False
            return key, False

        return plain
    mapping = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a PreTrainedModel (see _build)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    def rename(key: str) -> tuple[str, bool]:
        new, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if new not in state and key in state:  # as transformers does: keep names that already fit
            new, pattern = rename_source_key(key, [], [], prefix, state)
        return new, pattern is not None

    return rename


def _file_names(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """model key -> the name save_pretrained gives it in a file (for messages)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(state))  # type: ignore[arg-type]  # a PreTrainedModel
    except Exception:  # noqa: BLE001 - only for nicer messages
        return {}
    by_id = {id(t): k for k, t in state.items()}
    return {by_id[id(t)]: name for name, t in reverted.items() if id(t) in by_id}


def _tie_groups(model: nn.Module, keys: Sequence[str]) -> list[list[str]]:
    """State-dict keys grouped by the tensor object they name (tied weights share one; works on meta models)."""
    owner: dict[str, int] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        owner[name] = id(t)
    groups: dict[object, list[str]] = {}
    for key in keys:
        groups.setdefault(owner.get(key, key), []).append(key)
    return list(groups.values())


def _match_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The file's tensors keyed by the model's names, checked: unexpected, missing (tied
    twins are filled, ignorable keys dropped), shapes — every message naming file keys."""
    fix = "check that the weights belong to this config (re-save the folder with save_pretrained)"
    state = model.state_dict()
    rename = _renamer(model)
    saved_as = _file_names(model, state)
    ignore_unexpected = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignore_missing = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]

    native: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    unexpected, ignored, converted = [], [], []
    for key, tensor in tensors.items():
        new, needs_conversion = rename(key)
        if new not in state:
            if any(p.search(key) for p in ignore_unexpected):
                ignored.append(key)
            else:
                unexpected.append(key)
            continue
        if needs_conversion:
            converted.append(key)
            continue
        if new in native:
            raise AuditError(f"{where}: tensors {origin[new]} and {key} both load into {new}; remove one of them")
        native[new], origin[new] = tensor, key
    if converted:
        raise AuditError(
            f"{where}: tensors {_names(converted)} need transformers' tensor conversions (fused or split weights), "
            "which attnaudit does not perform; re-save the model with this transformers version's save_pretrained"
        )

    # Tied weights (save_pretrained writes one of each group) and ignorable missing buffers.
    buffers = {k for k, _ in model.named_buffers()}
    tied_filled: list[str] = []
    for keys in _tie_groups(model, list(state)):
        present = [k for k in keys if k in native]
        if len(keys) < 2 or not present:
            continue
        first = native[present[0]]
        for other in present[1:]:
            same = native[other].shape == first.shape and torch.equal(native[other].to(first.dtype), first)
            if not same:
                raise AuditError(
                    f"{where}: {origin[present[0]]} and {origin[other]} are tied in this model but differ in the file; "
                    "set tie_word_embeddings=false in config.json if the model was trained untied"
                )
        for key in keys:
            if key not in native:
                native[key] = first
                tied_filled.append(key)
    missing = [k for k in state if k not in native]
    skipped = [k for k in missing if k in buffers and any(p.search(k) for p in ignore_missing)]
    missing = [k for k in missing if k not in skipped]
    head = _classifier_head(model, prefix="") or []
    if missing and not unexpected and set(missing) <= set(head):
        raise AuditError(
            f"{where} holds no classification head ({_names(missing)} missing): it is a base model, not a trained "
            "classifier; fine-tune it and save the classifier with save_pretrained"
        )
    if missing or unexpected:
        raise AuditError(
            f"{where}: the weights do not fit the model: "
            f"{key_mismatch([saved_as.get(k, k) for k in missing], unexpected)}; {fix}"
        )
    for key, ref in state.items():
        got = native.get(key)
        if got is not None and tuple(got.shape) != tuple(ref.shape):
            name = origin.get(key, key)
            also = f" (the model's {key})" if name != key else ""
            raise AuditError(
                f"{where}: tensor {name}{also} has shape {tuple(got.shape)} in the file but the model expects "
                f"{tuple(ref.shape)}; {fix}"
            )
    info = {
        "renamed_keys": sum(1 for k, v in origin.items() if k != v),
        "tied_keys_filled": tied_filled,
        "ignored_keys": ignored,
        "skipped_buffers": skipped,
    }
    return native, info


# --------------------------------------------------------------------------- preprocessing


def _image_size(config, processor: dict[str, Any] | None) -> tuple[tuple[int, int] | None, str]:
    def pair(value) -> tuple[int, int] | None:
        if isinstance(value, bool):
            return None
        if isinstance(value, int) and value > 0:
            return (value, value)
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
            return (int(value[0]), int(value[1]))
        if isinstance(value, dict):
            if isinstance(value.get("height"), int) and isinstance(value.get("width"), int):
                return pair([value["height"], value["width"]])
        return None

    size = pair(getattr(config, "image_size", None))
    if size is not None:
        return size, "config.json image_size"
    for key in ("crop_size", "size"):
        size = pair((processor or {}).get(key))
        if size is not None:
            return size, f"{PREPROCESSOR_NAME} {key}"
    return None, "none (the model takes any size; images are not resized)"


def _normalisation(processor: dict[str, Any] | None, channels: int, path: Path) -> dict[str, Any]:
    """The normalisation recorded in preprocessor_config.json (mean/std per channel) or None."""
    where = f"{PREPROCESSOR_NAME} in {path}"
    if processor is None:
        return {"normalize": None, "note": f"no {PREPROCESSOR_NAME}: images reach the model unnormalised"}
    out: dict[str, Any] = {
        "rescale": "skipped: the data's images are already in [0, 1] (do_rescale maps uint8 pixels there)",
        "processor_rescale_factor": processor.get("rescale_factor"),
    }
    if not processor.get("do_normalize", True) or ("image_mean" not in processor and "image_std" not in processor):
        out["normalize"] = None
        return out

    def values(name: str) -> list[float]:
        value = processor.get(name)
        value = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        if (
            not isinstance(value, list)
            or len(value) not in (1, channels)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        ):
            raise AuditError(
                f"{where}: {name} must be 1 or {channels} finite numbers (one per channel), got {_clip(value, 60)}; fix the file"
            )
        return [float(v) for v in value] * (channels if len(value) == 1 else 1)

    mean, std = values("image_mean"), values("image_std")
    if any(s <= 0 for s in std):
        raise AuditError(f"{where}: image_std must be positive, got {std}; fix the file")
    out["normalize"] = {"mean": mean, "std": std}
    return out


# --------------------------------------------------------------------------- loading


def _build(cls: type, config, *, meta: bool, where: Path | None = None) -> nn.Module:
    """``cls`` built from ``config`` in float32 (on the meta device: a shape-only skeleton)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta") if meta else contextlib.nullcontext():
            try:
                # cls is a transformers PreTrainedModel subclass (checked by the caller)
                model = cls._from_config(copy.deepcopy(config), dtype=torch.float32)  # type: ignore[attr-defined]
            except TypeError:
                model = cls(copy.deepcopy(config))
        return model.to(dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a config the class cannot build
        if meta:
            raise
        raise AuditError(
            f"config {where} cannot build {cls.__name__} ({type(exc).__name__}: {_clip(exc)}); fix the config"
        ) from None


def _quiet_transformers(func):
    """Run ``func`` with transformers' own warnings muted: a hostile config makes it log
    ("pad_token_id must be ... within the vocabulary") before attnaudit refuses it, and the
    refusal must stay the one line on stderr."""

    @functools.wraps(func)
    def quiet(*args, **kwargs):
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            return func(*args, **kwargs)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return func(*args, **kwargs)
        finally:
            hf_logging.set_verbosity(level)

    return quiet


@_quiet_transformers
def _image_wrapper(
    model: nn.Module,
    num_channels: int,
    image_size: tuple[int, int] | None,
    size_from: str,
    preprocessing: dict,
    processor: dict | None,
) -> tuple[nn.Module, Inputs, dict]:
    """(the :class:`HFImageClassifier` around ``model``, its native :class:`Inputs`, the report's
    image fields: size, channels, and the preprocessing the wrapper applies)."""
    norm = preprocessing.get("normalize")
    module: nn.Module = HFImageClassifier(
        model,
        num_channels=num_channels,
        image_size=image_size,
        image_mean=norm["mean"] if norm else None,
        image_std=norm["std"] if norm else None,
    )
    native_hw = image_size or (224, 224)
    inputs = Inputs(kind="images", shape=(num_channels, *native_hw))
    preprocessing = {
        "channels": (
            f"{num_channels} as is; "
            + ("3 -> 1 by the mean" if num_channels == 1 else f"1 -> {num_channels} by repetition")
        ),
        "resize": (
            f"bilinear (align_corners=False, no antialias) to {image_size[0]}x{image_size[1]} when the data differs"
            if image_size
            else "none"
        ),
        "image_size_from": size_from,
        **preprocessing,
    }
    extra = {
        "image_size": list(image_size) if image_size else None,
        "num_channels": num_channels,
        "preprocessing": preprocessing,
        "preprocessor_config": processor is not None,
    }
    return module, inputs, extra


def _text_wrapper(model: nn.Module, config: Any) -> tuple[nn.Module, Inputs, dict]:
    """(the :class:`HFSequenceClassifier` around ``model``, token :class:`Inputs`, the report's
    text fields: vocabulary, position limit, pad id and how padding is masked and trimmed)."""
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
    mask = _choose_mask(
        model, pad, getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
    )
    max_length = getattr(config, "max_position_embeddings", None)
    trim = pad is not None and _padding_trim_exact(model, pad, mask, getattr(config, "vocab_size", None), max_length)
    module = HFSequenceClassifier(model, pad_token_id=pad, mask=mask, trim_padding=trim)
    inputs = Inputs(kind="tokens", shape=None, keyword="input_ids")
    extra = {
        "vocab_size": getattr(config, "vocab_size", None),
        "max_length": getattr(config, "max_position_embeddings", None),
        "pad_token_id": pad,
        "attention_mask": {
            "4d": f"input_ids != {pad}, as an additive 4-D mask (checked against the model's own masking)",
            "2d": f"input_ids != {pad}, as a 2-D mask (this model did not take a 4-D one: per-sample gradients may fail)",
            "none": "none (no pad_token_id in the config)",
        }[mask],
        "trailing_padding": (
            "dropped per batch (checked: this model's logits do not depend on trailing padding)"
            if trim
            else "kept (no padding mask, or the model's logits depend on padded positions)"
        ),
    }
    return module, inputs, extra


def open_model_folder(path: str | Path) -> tuple[Path, Path, dict[str, Any]]:
    """(the resolved folder, its config.json, the config read as untrusted JSON) of a
    ``save_pretrained`` folder; AuditError when the folder or its config is missing or broken."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise AuditError(f"Hugging Face model folder {folder} not found; check the path")
    if not folder.is_dir():
        raise AuditError(
            f"{folder} is a file; give the Hugging Face model folder holding config.json and model.safetensors"
        )
    folder = folder.resolve()
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise AuditError(
            f"{folder} has no {CONFIG_NAME}; give a folder written by save_pretrained (config.json and model.safetensors)"
        )
    return folder, config_path, read_json_object(config_path, "config", MAX_CONFIG_BYTES)


def is_causal_lm_folder(path: str | Path) -> bool:
    """Whether ``path`` is a model folder whose config.json names a causal language model
    (``architectures[0]`` ending in one of :data:`CAUSAL_SUFFIXES`). Reads the config only (no
    transformers import); a folder that is not a readable model folder is not one."""
    try:
        _, _, raw = open_model_folder(path)
    except AuditError:
        return False
    archs = raw.get("architectures")
    return isinstance(archs, list) and bool(archs) and isinstance(archs[0], str) and archs[0].endswith(CAUSAL_SUFFIXES)


def build_with_weights(
    cls: type, config: Any, tensors: dict[str, torch.Tensor], *, config_path: Path, where: str
) -> tuple[nn.Module, dict[str, Any]]:
    """``cls`` built from ``config`` (float32, eval mode) holding the file's ``tensors``, and the
    report's weight fields (renamed keys, tied twins filled, ignored keys, skipped buffers).

    The weights are checked against a skeleton on the meta device first (no memory, no compute:
    a config asking for a huge model fails here, on the file's tensors); then the model is built
    for real from the config alone (random init, the caller's RNG left untouched) and loaded."""
    try:
        skeleton = _build(cls, config, meta=True)
    except Exception:  # noqa: BLE001 - some models cannot be built on the meta device
        skeleton = None
    if skeleton is not None:
        native, info = _match_weights(skeleton, tensors, where)
    model = _build(cls, config, meta=False, where=config_path)
    if skeleton is None:
        native, info = _match_weights(model, tensors, where)
    # buffers the file may omit (info["skipped_buffers"]) keep the value the model was built with
    state = model.state_dict()
    native.update({k: state[k] for k in info["skipped_buffers"]})
    load_into(model, native, where=where, fix="check that the weights belong to this config")
    return model.eval(), info


def build_fields(
    model: nn.Module,
    config: Any,
    files: list[str],
    fmt: str,
    tensors: dict[str, torch.Tensor],
    raw: dict[str, Any],
    transformers: Any,
) -> dict[str, Any]:
    """The report's fields on how a Hugging Face model was built: its weight files and their
    format and dtypes, the working dtype, the attention kernel, the parameter count and the
    transformers versions (now and at save time)."""
    return {
        "weights": files,
        "weights_format": fmt,
        "saved_dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors.values() if t.is_floating_point()}),
        "dtype": "float32",
        "attention": f"{getattr(config, '_attn_implementation', None) or 'default'} (math kernel forced under attnaudit)",
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "transformers_version": transformers.__version__,
        "saved_with_transformers": raw.get("transformers_version"),
        "parameter_prefix": "model.",
    }


def load_hf_directory(path: str | Path, *, trust_pickle: bool = False) -> LoadedModel:
    """A Hugging Face classifier folder (``save_pretrained`` output) as a :class:`LoadedModel`.

    The model is built from ``config.json`` (class ``architectures[0]``, which must end in
    ``ForImageClassification`` or ``ForSequenceClassification``), its weights checked and
    loaded from ``model.safetensors`` (or its shards; ``pytorch_model.bin`` only with
    ``trust_pickle``), kept in float32 on the CPU in eval mode, and wrapped in
    :class:`HFImageClassifier` or :class:`HFSequenceClassifier`. Offline, no remote code;
    every problem is an :class:`AuditError`. Image models get ``inputs`` of their native
    shape: call :func:`adapt_to_data` with the data set's ``feature_shape``. A causal language
    model (``...ForCausalLM``, ``...LMHeadModel``) is refused with a pointer to
    :func:`attnaudit.models.hf_causal.load_hf_causal_lm` (which imports this module, so this
    one cannot call it without an import cycle).
    """
    folder, config_path, raw = open_model_folder(path)
    transformers = import_transformers()
    config, cls, kind = check_config(raw, config_path, transformers)
    if kind == "causal-lm":
        raise AuditError(
            f"{folder} holds a causal language model ({cls.__name__}), not a classifier; load it with "
            "attnaudit.models.hf_causal.load_hf_causal_lm"
        )

    processor = None
    processor_path = folder / PREPROCESSOR_NAME
    if kind == "images" and processor_path.is_file():
        processor = read_json_object(processor_path, "image processor config", MAX_CONFIG_BYTES)

    tensors, files, fmt = read_folder_weights(folder, trust_pickle)
    where = f"Hugging Face checkpoint {folder}"

    if kind == "images":
        num_channels = getattr(config, "num_channels", 3)
        if not isinstance(num_channels, int) or isinstance(num_channels, bool) or num_channels < 1:
            raise AuditError(f"config {config_path}: num_channels must be a positive integer, got {num_channels!r}")
        image_size, size_from = _image_size(config, processor)
        preprocessing = _normalisation(processor, num_channels, folder)
    num_labels = getattr(config, "num_labels", None)
    if not isinstance(num_labels, int) or num_labels < 1:
        raise AuditError(f"config {config_path}: num_labels must be a positive integer, got {num_labels!r}")

    model, info = build_with_weights(cls, config, tensors, config_path=config_path, where=where)

    if kind == "images":
        module, inputs, extra = _image_wrapper(model, num_channels, image_size, size_from, preprocessing, processor)
    else:
        module, inputs, extra = _text_wrapper(model, config)
    module.eval()
    id2label = getattr(config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(num_labels)]
    source = {
        "kind": "huggingface",
        "path": str(folder),
        "architecture": cls.__name__,
        "model_type": config.model_type,
        "n_classes": num_labels,
        "labels": labels,
        **extra,
        **build_fields(model, config, files, fmt, tensors, raw, transformers),
        **info,
    }
    return LoadedModel(
        module=module,
        inputs=inputs,
        n_classes=num_labels,
        n_features=inputs.features(),
        label=folder.name,
        source=source,
        metadata={},
        loss=None,
    )


def adapt_to_data(loaded: LoadedModel, feature_shape: Sequence[int] | None) -> LoadedModel:
    """``loaded`` with ``inputs``/``n_features`` set for a data set whose samples have ``feature_shape``.

    Image models take (C, H, W) with C in {1, 3} (or the model's own channel count) and
    any H, W (resized to the model's image size); token models take rows of L ids, L at
    most the model's ``max_position_embeddings``. Models from other sources are returned
    unchanged. AuditError, saying what the model expects, when the data cannot fit.
    """
    if loaded.source.get("kind") != "huggingface":
        return loaded
    label = loaded.label
    shape = tuple(int(s) for s in feature_shape) if feature_shape is not None else None
    source = dict(loaded.source)
    if loaded.inputs.kind == "images":
        size = source.get("image_size")
        native = (
            f"{source.get('num_channels')}x{size[0]}x{size[1]}"
            if size
            else f"{source.get('num_channels')} channels, any size"
        )
        wants = f"images (C, H, W) with C = 1 or 3 (natively {native}, resized when different)"
        if shape is None or len(shape) != 3 or any(s < 1 for s in shape):
            raise AuditError(
                f"model {label} takes {wants}; the data set's samples have shape {shape if shape else 'unknown'} "
                "(flat rows): use an image data set"
            )
        module = loaded.module
        try:
            mapping = module.channel_mapping(shape[0]) if isinstance(module, HFImageClassifier) else "as is"
        except AuditError:
            raise AuditError(
                f"model {label} takes {wants}; the data set's images have {shape[0]} channels: use 1- or 3-channel images"
            ) from None
        source["data_shape"] = list(shape)
        source["data_channels"] = mapping
        return dataclasses.replace(
            loaded,
            inputs=Inputs(kind="images", shape=shape, keyword=loaded.inputs.keyword),
            n_features=math.prod(shape),
            source=source,
        )
    if loaded.inputs.kind == "tokens":
        if shape is None or len(shape) != 1 or shape[0] < 1:
            raise AuditError(
                f"model {label} takes rows of token ids (one sequence per sample); the data set's samples have "
                f"shape {shape}: use a token data set"
            )
        limit = source.get("max_length")
        if isinstance(limit, int) and shape[0] > limit:
            raise FieldError(
                "max_length",
                literal(f"model {label} takes at most {limit} tokens per sample; the data set has {shape[0]}")
                + f": set {{name}} {limit} or lower (unset, it is the smaller of 128 and the model's limit)",
            )
        source["data_shape"] = list(shape)
        return dataclasses.replace(loaded, n_features=shape[0], source=source)
    return loaded
