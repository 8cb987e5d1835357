"""The entry point: :func:`load_dataset` dispatches a :class:`~attnaudit.data.spec.DataSpec`
to a user file or a built-in source and assembles the :class:`~attnaudit.data.spec.Dataset`."""

from __future__ import annotations

from pathlib import Path

from attnaudit.data.builtin import load_builtin
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
    if path.is_file() and is_text_file(path, spec.text_field):
        if spec.preprocess != "raw":
            raise FieldError(
                "preprocess", "{name} " + f"{spec.preprocess} applies to numbers, not token ids; drop it for text data"
            )
        options = TextOptions(spec.text_field, spec.label_field, spec.tokenizer, spec.max_length)
        return assemble(read_text_source(path, options), spec, spec.n, spec.stratify)
    return assemble(load_user(spec.data), spec, spec.n, spec.stratify)
