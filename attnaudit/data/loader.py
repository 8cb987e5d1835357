"""The entry point: :func:`load_dataset` dispatches a :class:`~attnaudit.data.spec.DataSpec`
to a user file or a built-in source and assembles the :class:`~attnaudit.data.spec.Dataset`."""

from __future__ import annotations

from pathlib import Path

import dataclasses

import torch

from attnaudit.data.builtin import load_builtin
from attnaudit.data.documents import DocumentOptions, load_documents
from attnaudit.data.readers import load_user
from attnaudit.data.selection import assemble
from attnaudit.data.spec import Dataset, DataSpec
from attnaudit.data.text import TextOptions, is_text_file, read_text_source
from attnaudit.errors import FieldError


def load_dataset(spec: DataSpec) -> Dataset:
    """Load, filter (``classes``), subset (``n``), and preprocess the data ``spec`` names."""
    if spec.data is None:
        return load_builtin(spec)
    path = Path(spec.data).expanduser()
    if spec.documents:
        return _documents(path, spec)
    if path.is_file() and is_text_file(path, spec.text_field):
        if spec.preprocess != "raw":
            raise FieldError(
                "preprocess", "{name} " + f"{spec.preprocess} applies to numbers, not token ids; drop it for text data"
            )
        options = TextOptions(spec.text_field, spec.label_field, spec.tokenizer, spec.max_length)
        return assemble(read_text_source(path, options), spec, spec.n, spec.stratify)
    return assemble(load_user(spec.data), spec, spec.n, spec.stratify)


def _documents(path: Path, spec: DataSpec) -> Dataset:
    """A causal language model's documents (:func:`attnaudit.data.documents.load_documents`),
    ``spec.n`` of them drawn with ``spec.seed`` when asked (in file order)."""
    if spec.preprocess != "raw":
        raise FieldError(
            "preprocess", "{name} " + f"{spec.preprocess} applies to numbers, not token ids; drop it for documents"
        )
    if spec.classes is not None:
        raise FieldError("classes", "{name} applies to class labels; documents have none: drop it")
    options = DocumentOptions(
        text_field=spec.text_field,
        prompt_field=spec.prompt_field,
        completion_field=spec.completion_field,
        tokenizer=spec.tokenizer,
        max_length=spec.max_length,
    )
    ds = load_documents(path, options)
    n_available = ds.n
    rows = torch.arange(n_available)
    if spec.n is not None and spec.n < n_available:
        generator = torch.Generator().manual_seed(spec.seed)
        rows = torch.randperm(n_available, generator=generator)[: spec.n].sort().values
        assert ds.y is not None  # documents always have next-token targets
        ds = dataclasses.replace(ds, X=ds.X[rows], y=ds.y[rows], info=dict(ds.info))
    ds.info.update({"n_available": n_available, "n": ds.n, "seed": int(spec.seed), "split": None})
    return ds
