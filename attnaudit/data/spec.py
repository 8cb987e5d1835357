"""What to load and what comes back: :class:`DataSpec`, :class:`Dataset`, the limits
(MAX_SEED, MAX_CLASSES), :func:`check_seed`, :func:`parse_classes`, and the helpers that
echo user input in one-line messages."""

from __future__ import annotations

from attnaudit.errors import is_int

import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnaudit.errors import MAX_SEED as MAX_SEED, AuditError, check_seed as check_seed, clip_text, show_value

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "synthetic")
PREPROCESS = ("raw", "center", "standardize", "unit-norm", "ntk-scale")
SPLITS = ("train", "test")
MAX_CLASSES = 100_000  # labels are class indices 0..K-1 with K at most this


# --------------------------------------------------------------------------- message helpers


def _clip(text: object, limit: int = 80) -> str:
    return clip_text(text, limit)


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` clipped like :func:`_clip` (and safe for huge ints)."""
    return show_value(value, limit)


def _short_list(values: Any, limit: int = 10, sep: str = ", ") -> str:
    """The first ``limit`` values joined by ``sep``, then ``… (N more)`` when there are more."""
    items = [_clip(v, 40) for v in values]
    if len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + f"{sep}\u2026 ({len(items) - limit} more)"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- limits and options


def parse_classes(text: str | None) -> tuple[int, ...] | None:
    """Parse ``"0,1,7"`` (ranges like ``"0-3"`` allowed) into sorted unique labels; None/"" -> None."""
    if text is None or not str(text).strip():
        return None
    labels: set[int] = set()
    for item in str(text).split(","):
        item = item.strip()
        try:
            if "-" in item:
                lo_text, hi_text = item.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
                if lo < 0 or hi < lo:
                    raise ValueError
            else:
                lo = hi = int(item)
                if lo < 0:
                    raise ValueError
        except ValueError:  # also int() of a number with thousands of digits
            raise AuditError(
                f"--classes expects comma-separated non-negative integer labels like 0,1,7 or 0-4; "
                f"could not read {_show(item, 40)} in {_show(str(text))}"
            ) from None
        if hi - lo + 1 > MAX_CLASSES:
            raise AuditError(
                f"--classes range {_clip(item, 40)} spans {_clip(hi - lo + 1, 40)} labels, more than the {MAX_CLASSES} "
                f"classes supported; list the labels you want (labels are 0..K-1 with K <= {MAX_CLASSES})"
            )
        if hi >= MAX_CLASSES:
            raise AuditError(
                f"--classes names label {_clip(hi, 40)}, but labels are class indices 0..K-1 with "
                f"K <= {MAX_CLASSES}; pick labels below {MAX_CLASSES}"
            )
        labels.update(range(lo, hi + 1))
    return tuple(sorted(labels))


# --------------------------------------------------------------------------- spec / result


@dataclass(frozen=True)
class DataSpec:
    """What to load; validated on construction so a bad option fails before any work.

    For ``synthetic``, ``n`` is the number of rows generated (``synthetic_n`` when ``n`` is
    None) rather than a subset, because subsetting rows would change the prescribed
    spectrum; ``stratify`` does not apply to it.
    """

    dataset: str = "digits"
    data: str | None = None
    data_dir: str | None = None
    split: str = "train"
    n: int | None = None
    classes: tuple[int, ...] | None = None
    preprocess: str = "raw"
    seed: int = 0
    stratify: bool = False
    download: bool = False
    synthetic_d: int = 64
    synthetic_n: int = 512
    synthetic_kappa: float = 1e3
    synthetic_rank: int | None = None
    # text files (.jsonl, or .csv with a text column): see attnaudit.data.text
    text_field: str = "text"
    label_field: str = "label"
    tokenizer: str | None = None
    max_length: int = 128

    def __post_init__(self) -> None:
        # Normalise spelling variants ("Fashion_MNIST") so the CLI can pass text through.
        dataset = str(self.dataset).strip().lower().replace("_", "-")
        object.__setattr__(self, "dataset", dataset)
        if self.data is None and dataset not in DATASETS:
            raise AuditError(
                f"unknown --dataset {_show(self.dataset)}; choose one of {', '.join(DATASETS)}, "
                "or pass --data with a .npz/.npy/.safetensors/.pt/.csv file or an image folder"
            )
        if self.data is not None:
            object.__setattr__(self, "data", str(self.data))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        split = str(self.split).strip().lower()
        if split not in SPLITS:
            raise AuditError(f"unknown split {_show(self.split)}; use --split train or --split test")
        object.__setattr__(self, "split", split)
        preprocess = str(self.preprocess).strip().lower()
        if preprocess not in PREPROCESS:
            raise AuditError(f"unknown preprocessing {_show(self.preprocess)}; choose one of {', '.join(PREPROCESS)}")
        object.__setattr__(self, "preprocess", preprocess)
        if self.n is not None and (not is_int(self.n) or self.n < 1):
            raise AuditError(f"--n must be a positive integer, got {_show(self.n)}")
        check_seed(self.seed)
        if self.classes is not None:
            classes = tuple(self.classes)
            if not classes or not all(is_int(c) and c >= 0 for c in classes):
                raise AuditError(
                    f"--classes must list non-negative integer labels like 0,1,7; got {_show(self.classes)}"
                )
            too_big = [c for c in classes if c >= MAX_CLASSES]
            if too_big:
                raise AuditError(
                    f"--classes names label {_clip(too_big[0])}, but labels are class indices 0..K-1 with "
                    f"K <= {MAX_CLASSES}; pick labels below {MAX_CLASSES}"
                )
            object.__setattr__(self, "classes", tuple(sorted({int(c) for c in classes})))
        for name in ("synthetic_d", "synthetic_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise AuditError(f"{name} must be a positive integer, got {_show(value)}")
        kappa = self.synthetic_kappa
        if not isinstance(kappa, numbers.Real) or not np.isfinite(kappa) or kappa < 1:
            raise AuditError(
                f"synthetic_kappa must be a finite number >= 1 (sigma_max / sigma_min), got {_show(kappa)}"
            )
        if self.synthetic_rank is not None:
            rows = self.n if self.n is not None else self.synthetic_n
            max_rank = min(rows, self.synthetic_d)
            if not is_int(self.synthetic_rank) or not 1 <= self.synthetic_rank <= max_rank:
                raise AuditError(
                    f"synthetic_rank must be an integer in 1..min(n, d) = 1..{max_rank}, "
                    f"got {_show(self.synthetic_rank)}"
                )


@dataclass
class Dataset:
    """Loaded data: X (n, d) float64 rows = flattened samples, y (n,) int64 or None."""

    X: torch.Tensor
    y: torch.Tensor | None
    name: str
    n_classes: int
    value_range: tuple[float, float] | None
    feature_shape: tuple[int, ...]
    info: dict
    singular_values: np.ndarray | None = None

    @property
    def n(self) -> int:
        """Number of rows (samples)."""
        return int(self.X.shape[0])

    @property
    def d(self) -> int:
        """Number of features per row."""
        return int(self.X.shape[1])


@dataclass
class _Source:
    """A source before row selection: X keeps its on-disk dtype (uint8 images stay small)."""

    X: np.ndarray  # (N, ...) real dtype
    y: np.ndarray | None  # (N,) int64
    name: str
    n_classes: int
    scale: float | None  # X / scale gives the values; None = use as is
    value_range: tuple[float, float] | None  # known range of raw values; None = observe
    info: dict = field(default_factory=dict)


def image_shape(feature_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(C, H, W) of image samples from a data set's ``feature_shape``, or None for flat rows.

    Every image source stores samples channel-first: grey images are (H, W) (MNIST, digits)
    and become (1, H, W); colour images are already (C, H, W) (CIFAR-10, image folders).
    A user array of (N, H, W, C) must be transposed to channel-first before loading.
    """
    shape = tuple(int(s) for s in feature_shape)
    if len(shape) == 2:
        return (1, *shape)
    if len(shape) == 3:
        return shape  # type: ignore[return-value]
    return None


def data_fingerprint(X: torch.Tensor, y: torch.Tensor | None = None) -> str:
    """First 16 hex digits of sha256 over X (as float64) and y: identifies a training set exactly."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(X.detach().cpu().to(torch.float64).numpy()).tobytes())
    if y is not None:
        h.update(np.ascontiguousarray(y.detach().cpu().to(torch.int64).numpy()).tobytes())
    return h.hexdigest()[:16]
