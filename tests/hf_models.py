"""Tiny Hugging Face BERT classifiers built offline from a config, for the text tests."""

from __future__ import annotations

import torch


def tiny_bert(
    vocab_size: int,
    *,
    layers: int = 1,
    max_positions: int = 16,
    num_labels: int = 3,
    pad_token_id: int | None = 0,
    seed: int = 0,
    **config,
):
    """A ``BertForSequenceClassification`` of width 16 (2 heads, FFN 32), initialised from
    ``seed``, in eval mode and float32 (``.double()`` it for float64 truths)."""
    import transformers

    torch.manual_seed(seed)
    bert_config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=max_positions,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
        **config,
    )
    return transformers.BertForSequenceClassification(bert_config).eval()
