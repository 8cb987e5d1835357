"""Auditing a Hugging Face causal language model (GPT-2, Llama, ...) from its model folder, offline.

:func:`load_hf_causal_lm` turns a ``save_pretrained`` folder whose ``architectures[0]`` ends in
``ForCausalLM`` or ``LMHeadModel`` into a :class:`~attnaudit.models.loaded.LoadedModel` with the
same safety as the classifier loader (:mod:`attnaudit.models.hf`, whose checks it reuses):
config.json is read as untrusted (sizes bounded), custom code (``auto_map``) is refused and
never imported, the class must be one transformers ships, quantized checkpoints are refused,
weights come from safetensors (``pytorch_model.bin`` only with ``trust_pickle``), and the model
is built from the config alone (no download), in float32, in eval mode.

The model is wrapped in :class:`HFCausalLM`, which takes the document rows of
:mod:`attnaudit.core.lm_rows` -- X (n, 2L) = [ids | attention], right-padded -- and returns
logits (n, L, V); position t's logits predict token t + 1. Its loss is
:class:`~attnaudit.core.task.NextTokenLoss`, the mean next-token cross-entropy per document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnaudit.core.attention import math_attention
from attnaudit.core.lm_rows import pack_rows, split_rows
from attnaudit.core.task import Inputs, NextTokenLoss
from attnaudit.errors import AuditError
from attnaudit.models.hf import (
    CAUSAL_SUFFIXES,
    build_fields,
    build_with_weights,
    check_config,
    import_transformers,
    kept_columns,
    open_model_folder,
    read_folder_weights,
)
from attnaudit.models.loaded import LoadedModel

__all__ = ["CAUSAL_SUFFIXES", "HFCausalLM", "HFCausalLMShift", "causal_shift_rows", "load_hf_causal_lm"]


class HFCausalLM(nn.Module):
    """A Hugging Face causal language model fed document rows.

    ``forward(rows)``: rows (n, 2L) = [ids | attention] (:mod:`attnaudit.core.lm_rows`; a single
    row (2L,) is a batch of one) -> logits (n, L, V). Columns that are padding in every row
    (trailing padding) are dropped before the model runs -- with a causal mask no real token
    reads a later position, so this changes no real position's logits -- and the logits are
    padded back to L columns with zeros (those positions carry loss weight 0). The model gets
    the 0/1 attention mask and explicit positions ``cumsum(attention) - 1`` (clamped at 0), so
    a document's positions count its real tokens only. Runs under the math kernel of scaled
    dot-product attention (differentiable twice).

    ``pad_token_id``: the config's pad id, else its end-of-sequence id (None without either);
    ``vocab_size``: V, the width of the logits; ``max_length``: the model's position limit
    (None when the config names none).
    """

    def __init__(self, model: nn.Module, *, pad_token_id: int | None, vocab_size: int, max_length: int | None):
        super().__init__()
        self.model = model
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        self.vocab_size = int(vocab_size)
        self.max_length = None if max_length is None else int(max_length)

    def audit_inputs(self) -> Inputs:
        """Plain rows: the wrapper splits ids and attention itself."""
        return Inputs()

    # Dropping trailing all-padding columns per batch saves their compute; per-layer captures that
    # stack batches at the data's full length switch it off (the token mask excludes padding then).
    trim_padding = True

    def token_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, L) bool: the real (non-padding) tokens of rows (n, 2L)."""
        return split_rows(rows if rows.ndim == 2 else rows.unsqueeze(0))[1] > 0.5

    def kept_length(self, attention: torch.Tensor) -> int | None:
        """Leading columns of a batch's attention (n, L) through its last real token; None to keep
        all of them (trimming off, no trailing padding, or rows batched by ``vmap``, whose length
        must not depend on their values)."""
        return kept_columns(attention.long(), 0) if self.trim_padding else None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.ndim == 1:
            rows = rows.unsqueeze(0)
        ids, attention = split_rows(rows)
        return self.run(ids, attention)

    def run(self, ids: torch.Tensor, attention: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (n, L, V) of documents ``ids`` (n, L) with ``attention`` (n, L), each token's input
        embedding moved by ``shift`` (n, L, h) when given: the model reads ``E[ids] + shift``."""
        L = ids.shape[-1]
        kept = self.kept_length(attention)
        if kept is not None:
            ids, attention = ids[:, :kept], attention[:, :kept]
            shift = None if shift is None else shift[:, :kept]
        if self.max_length is not None and ids.shape[-1] > self.max_length:
            raise AuditError(
                f"documents of {ids.shape[-1]} tokens are longer than the model's {self.max_length} positions; "
                f"cut them to at most {self.max_length} tokens"
            )
        mask = attention.long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with math_attention():
            try:
                kwargs: dict[str, torch.Tensor] = {"input_ids": ids}
                if shift is not None:
                    # the lookup inside the graph: parameter gradients reach the embedding table
                    embeds = self.model.get_input_embeddings()(ids)  # type: ignore[operator]  # transformers' method
                    kwargs = {"inputs_embeds": embeds + shift.to(embeds.dtype)}
                out = self.model(**kwargs, attention_mask=mask, position_ids=positions, use_cache=False)
            except IndexError as exc:  # an embedding lookup out of range: the user's token ids
                raise AuditError(
                    f"the model cannot read these rows ({exc}); token ids must be integers in "
                    f"0..{self.vocab_size - 1} (this model's vocabulary)"
                ) from None
        logits = out.logits
        if logits.shape[-2] < L:
            logits = nn.functional.pad(logits, (0, 0, 0, L - logits.shape[-2]))
        return logits

    def special_ids(self) -> tuple[int, ...]:
        """The ids no attack changes or inserts: the config's BOS, EOS and pad ids (inside the
        vocabulary) and the pad id padding holds."""
        config = getattr(self.model, "config", None)
        found = {self.pad_token_id} if self.pad_token_id is not None else set()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, key, None)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < self.vocab_size:
                    found.add(v)
        return tuple(sorted(found))


class HFCausalLMShift(HFCausalLM):
    """A causal language model fed document rows plus a shift of each token's input embedding.

    A row is (n, L (2 + h)) numbers, flat: [ids | attention | delta], the document rows of
    :mod:`attnaudit.core.lm_rows` followed by ``delta`` (L, h) row-major, so the model reads
    ``inputs_embeds = E[ids] + delta`` with the same attention mask and positions as
    :class:`HFCausalLM`. With ``delta = 0`` it computes exactly what :class:`HFCausalLM` computes
    on [ids | attention], parameter gradients included (the lookup stays in the graph): the
    embedding attacks on documents perturb ``delta``. Shares (never copies) the wrapped
    model; parameter names are the same (``model.*``).
    """

    def __init__(self, base: HFCausalLM):
        super().__init__(
            base.model, pad_token_id=base.pad_token_id, vocab_size=base.vocab_size, max_length=base.max_length
        )
        self.trim_padding = base.trim_padding
        embeddings = base.model.get_input_embeddings()  # type: ignore[operator]  # a transformers model's method
        self.hidden = int(embeddings.weight.shape[1])

    def split_shift(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (n, L) int64, attention (n, L) bool, delta (n, L, h)) of rows (n, L (2 + h))."""
        if rows.ndim == 1:
            rows = rows.unsqueeze(0)
        width = self.hidden + 2
        if rows.ndim != 2 or rows.shape[-1] % width:
            raise AuditError(
                f"rows of shape {tuple(rows.shape)} are not [ids | attention | delta] rows of L (2 + {self.hidden}) "
                "numbers; build them with attnaudit.models.hf_causal.causal_shift_rows"
            )
        L = rows.shape[-1] // width
        ids, attention = split_rows(rows[:, : 2 * L])
        return ids, attention, rows[:, 2 * L :].reshape(rows.shape[0], L, self.hidden)

    def token_mask(self, rows: torch.Tensor) -> torch.Tensor:
        return self.split_shift(rows)[1]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        ids, attention, delta = self.split_shift(rows)
        return self.run(ids, attention, delta)


def causal_shift_rows(
    ids: torch.Tensor, attention: torch.Tensor, hidden: int, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """Flat rows (n, L (2 + hidden)) in float64 = [ids | attention | delta] for documents ``ids``
    (n, L) with ``attention`` (n, L) and embedding shifts ``delta`` (n, L, hidden; default 0)."""
    n, L = ids.shape
    rows = torch.zeros(n, L * (2 + hidden), dtype=torch.float64, device=ids.device)
    rows[:, : 2 * L] = pack_rows(ids.round() if ids.is_floating_point() else ids, attention)
    if delta is not None:
        rows[:, 2 * L :] = delta.to(device=ids.device, dtype=torch.float64).reshape(n, L * hidden)
    return rows


def _token_id(value: Any, vocab: int) -> int | None:
    """The first id in ``value`` (an int or a list of them, as configs write eos ids) inside the
    vocabulary, else None: an id past the embedding table could not be fed to the model."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab:
            return v
    return None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_hf_causal_lm(folder: str | Path, *, trust_pickle: bool = False) -> LoadedModel:
    """A Hugging Face causal language model folder (``save_pretrained`` output) as a :class:`LoadedModel`.

    ``module``: :class:`HFCausalLM` (float32, CPU, eval mode); ``inputs``: plain rows;
    ``n_classes``: the vocabulary size V; ``loss``: :class:`~attnaudit.core.task.NextTokenLoss`.
    Offline, no remote code, safetensors unless ``trust_pickle``; every problem is one
    :class:`AuditError` line, raised before the model runs.
    """
    path, config_path, raw = open_model_folder(folder)
    transformers = import_transformers()
    config, cls, kind = check_config(raw, config_path, transformers)
    if kind != "causal-lm":
        raise AuditError(
            f"{path} holds {cls.__name__}, not a causal language model (classes ending in "
            f"{' or '.join(CAUSAL_SUFFIXES)}); load it with attnaudit.models.hf.load_hf_directory"
        )
    tensors, files, fmt = read_folder_weights(path, trust_pickle)
    model, info = build_with_weights(
        cls, config, tensors, config_path=config_path, where=f"Hugging Face checkpoint {path}"
    )

    # The logits' width is the output embedding's row count (the config's vocab_size may be
    # nested or rounded differently in some families).
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    weight = getattr(head, "weight", None)
    vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else _positive(getattr(config, "vocab_size", None))
    if vocab is None:
        raise AuditError(f"config {config_path}: vocab_size must be a positive integer; fix the config")
    max_length = _positive(getattr(config, "max_position_embeddings", None))
    pad = _token_id(getattr(config, "pad_token_id", None), vocab)
    eos = _token_id(getattr(config, "eos_token_id", None), vocab)
    pad_from = "config pad_token_id" if pad is not None else "config eos_token_id" if eos is not None else None
    module = HFCausalLM(model, pad_token_id=pad if pad is not None else eos, vocab_size=vocab, max_length=max_length)
    module.eval()
    source = {
        "kind": "huggingface",
        "task": "causal-lm",
        "loss": "next-token cross-entropy",
        "path": str(path),
        "architecture": cls.__name__,
        "model_type": config.model_type,
        "n_classes": vocab,
        "vocab_size": vocab,
        "max_length": max_length,
        "pad_token_id": module.pad_token_id,
        "pad_token_from": pad_from or "none (no pad or eos id in the config inside the vocabulary)",
        "eos_token_id": eos,
        "positions": "cumsum(attention) - 1, clamped at 0; trailing all-padding columns dropped per batch",
        "tokenizer_json": (path / "tokenizer.json").is_file(),
        **build_fields(model, config, files, fmt, tensors, raw, transformers),
        **info,
    }
    return LoadedModel(
        module=module,
        inputs=module.audit_inputs(),
        n_classes=vocab,
        n_features=None,
        label=path.name,
        source=source,
        metadata={},
        # LoadedModel.loss is typed ``str | None`` (the name of a classification loss); a Task
        # takes a Loss object as it is (as_loss), and a language model's loss is not one a user names.
        loss=NextTokenLoss(),  # type: ignore[arg-type]
    )
