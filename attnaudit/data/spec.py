"""What to load and what comes back: :class:`DataSpec`, :class:`Dataset`, the limits
(MAX_SEED, MAX_CLASSES), :func:`check_seed`, :func:`parse_classes`, and :class:`Source`, a
source before row selection."""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

from attnaudit.errors import MAX_SEED as MAX_SEED, AuditError, FieldError, check_seed as check_seed, clip_text, is_int
from attnaudit.errors import literal, show_value

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "synthetic")
PREPROCESS = ("raw", "center", "standardize", "unit-norm", "ntk-scale")
SPLITS = ("train", "test")
MAX_CLASSES = 100_000  # labels are class indices 0..K-1 with K at most this


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
            raise FieldError(
                "classes",
                "{name} expects comma-separated non-negative integer labels like 0,1,7 or 0-4; "
                + literal(f"could not read {show_value(item, 40)} in {show_value(str(text), 80)}"),
            ) from None
        if hi - lo + 1 > MAX_CLASSES:
            raise FieldError(
                "classes",
                "{name} range "
                + literal(f"{clip_text(item, 40)} spans {clip_text(hi - lo + 1, 40)} labels")
                + f", more than the {MAX_CLASSES} classes supported; list the labels you want "
                f"(labels are 0..K-1 with K <= {MAX_CLASSES})",
            )
        if hi >= MAX_CLASSES:
            raise _label_too_big(hi)
        labels.update(range(lo, hi + 1))
    return tuple(sorted(labels))


def _label_too_big(label: object) -> FieldError:
    return FieldError(
        "classes",
        "{name} names label "
        + literal(clip_text(label, 40))
        + f", but labels are class indices 0..K-1 with K <= {MAX_CLASSES}; pick labels below {MAX_CLASSES}",
    )


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
    max_length: int | None = None  # None: min(128, the model's position limit) (attnaudit.data.text)
    # documents of a causal language model (attnaudit.data.documents): rows [ids | attention],
    # next-token targets; max_length None then means min(512, the model's position limit)
    documents: bool = False
    prompt_field: str | None = None  # with completion_field: only completion tokens count
    completion_field: str | None = None

    def __post_init__(self) -> None:
        # Normalise spelling variants ("Fashion_MNIST") so the CLI can pass text through.
        dataset = str(self.dataset).strip().lower().replace("_", "-")
        object.__setattr__(self, "dataset", dataset)
        if self.data is None and dataset not in DATASETS:
            raise FieldError(
                "dataset",
                "unknown {name} " + literal(show_value(self.dataset, 80)) + f"; choose one of {', '.join(DATASETS)}, "
                "or give your own data (a .npz/.npy/.safetensors/.pt/.csv file or an image folder)",
            )
        if self.data is not None:
            object.__setattr__(self, "data", str(self.data))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", str(self.data_dir))
        split = str(self.split).strip().lower()
        if split not in SPLITS:
            raise FieldError("split", "unknown {name} " + literal(show_value(self.split, 80)) + "; use train or test")
        object.__setattr__(self, "split", split)
        preprocess = str(self.preprocess).strip().lower()
        if preprocess not in PREPROCESS:
            raise FieldError(
                "preprocess",
                "unknown {name} "
                + literal(show_value(self.preprocess, 80))
                + f"; choose one of {', '.join(PREPROCESS)}",
            )
        object.__setattr__(self, "preprocess", preprocess)
        if self.n is not None and (not is_int(self.n) or self.n < 1):
            raise FieldError("n", "{name} must be a positive integer, got " + literal(show_value(self.n, 80)))
        check_seed(self.seed)
        if self.classes is not None:
            classes = tuple(self.classes)
            if not classes or not all(is_int(c) and c >= 0 for c in classes):
                raise FieldError(
                    "classes",
                    "{name} must list non-negative integer labels like 0,1,7; got "
                    + literal(show_value(self.classes, 80)),
                )
            too_big = [c for c in classes if c >= MAX_CLASSES]
            if too_big:
                raise _label_too_big(too_big[0])
            object.__setattr__(self, "classes", tuple(sorted({int(c) for c in classes})))
        for name in ("synthetic_d", "synthetic_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise AuditError(f"{name} must be a positive integer, got {show_value(value, 80)}")
        kappa = self.synthetic_kappa
        if not isinstance(kappa, numbers.Real) or not np.isfinite(kappa) or kappa < 1:
            raise AuditError(
                f"synthetic_kappa must be a finite number >= 1 (sigma_max / sigma_min), got {show_value(kappa, 80)}"
            )
        if self.synthetic_rank is not None:
            rows = self.n if self.n is not None else self.synthetic_n
            max_rank = min(rows, self.synthetic_d)
            if not is_int(self.synthetic_rank) or not 1 <= self.synthetic_rank <= max_rank:
                raise AuditError(
                    f"synthetic_rank must be an integer in 1..min(n, d) = 1..{max_rank}, "
                    f"got {show_value(self.synthetic_rank, 80)}"
                )


@dataclass
class Dataset:
    """Loaded data: X (n, d) float64 rows = flattened samples; y (n,) int64 class ids, or a causal
    language model's (n, 2L) float64 next-token targets (attnaudit.core.lm_rows), or None."""

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
class Source:
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
