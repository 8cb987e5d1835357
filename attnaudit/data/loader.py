"""The entry point: :func:`load_dataset` dispatches a :class:`~attnaudit.data.spec.DataSpec`
to a user file or a built-in source and assembles the :class:`~attnaudit.data.spec.Dataset`."""

from __future__ import annotations

from pathlib import Path

from attnaudit.data.builtin import (
    _IDX_FOLDERS,
    _load_cifar10,
    _load_digits,
    _load_idx_dataset,
    _load_synthetic,
    default_data_dir,
)
from attnaudit.data.readers import _load_user
from attnaudit.data.selection import _finish
from attnaudit.data.spec import Dataset, DataSpec
from attnaudit.data.text import TextOptions, is_text_file, read_text_source
from attnaudit.errors import AuditError


def load_dataset(spec: DataSpec) -> Dataset:
    """Load, filter (--classes), subset (--n), and preprocess the data ``spec`` names."""
    return _load(spec)


def _load(spec: DataSpec) -> Dataset:
    if spec.data is not None:
        path = Path(spec.data).expanduser()
        if path.is_file() and is_text_file(path, spec.text_field):
            if spec.preprocess != "raw":
                raise AuditError(
                    f"--preprocess {spec.preprocess} applies to numbers, not token ids; drop it for text data"
                )
            options = TextOptions(spec.text_field, spec.label_field, spec.tokenizer, spec.max_length)
            return _finish(read_text_source(path, options), spec, spec.n, spec.stratify)
        return _finish(_load_user(spec.data), spec, spec.n, spec.stratify)
    root = Path(spec.data_dir).expanduser() if spec.data_dir is not None else default_data_dir()
    if spec.dataset == "digits":
        src = _load_digits(spec.split)
    elif spec.dataset in _IDX_FOLDERS:
        src = _load_idx_dataset(spec.dataset, root, spec.split, spec.download)
    elif spec.dataset == "cifar10":
        src = _load_cifar10(root, spec.split, spec.download)
    else:
        return _load_synthetic(spec)
    ds = _finish(src, spec, spec.n, spec.stratify)
    ds.info["data_dir"] = str(root) if spec.dataset != "digits" else None
    return ds
