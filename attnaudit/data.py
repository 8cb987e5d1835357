"""Data layer: every source becomes an (n, d) float64 matrix X plus int64 labels y.

Sources (``DataSpec.dataset`` or ``DataSpec.data``):

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, values 0..16 scaled to
  [0, 1]); needs no network. It has no official split, so a fixed permutation
  (``numpy.random.default_rng(0)``, independent of ``DataSpec.seed``) puts the first 80 %
  (1,437 images) in ``train`` and the other 360 in ``test``.
* ``mnist``, ``fashion-mnist``: torchvision's on-disk layout
  ``<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (and
  ``FashionMNIST/raw``), read with the IDX reader below, so one split loads when only its
  files exist. Pixels / 255, in [0, 1]; feature_shape (1, 28, 28).
* ``cifar10``: torchvision's ``<data_dir>/cifar-10-batches-py/{data_batch_1..5,test_batch}``
  pickles; pixels / 255; feature_shape (3, 32, 32) (channel-major, as stored). The pickles
  are read with a restricted unpickler that builds only what a genuine batch holds (dicts,
  lists, strings, ints and uint8 numpy arrays) and refuses any other object, so a crafted
  batch cannot run code.
* ``synthetic``: X = U diag(s) V^T with exact singular values s log-spaced from 1 down to
  1/kappa over rank r, so kappa(X) = kappa and kappa(X X^T) = kappa^2 at rank r.
* a user file or image folder (``DataSpec.data``): .npz, .npy, .safetensors, .pt/.pth,
  .csv, or a folder with one sub-folder of images per class. ``split`` does not apply
  (a file is one split; use :func:`holdout_split`).

Limits. Seeds are integers in 0..MAX_SEED (2**32 - 1; :func:`check_seed`); labels are class
indices 0..K-1 with K <= MAX_CLASSES (100,000).

Conventions. ``--classes`` keeps the original label values (no remapping) and
``n_classes`` stays the size of the full label space (10 for MNIST; max label + 1 over the
whole user file; 0 for unlabelled data), so a model head sized ``n_classes`` fits every
subset. Subsets are chosen after class filtering by a seeded permutation (or per class
when stratified) and kept in original row order; ``info`` records the seed and a checksum
of the chosen row indices (indices into the full split/file). Preprocessing statistics
(means, stds) are computed on the returned rows. ``--download`` is the only thing that
writes to disk (through torchvision); nothing else creates directories.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import numbers
import os
import pickle
import re
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import AuditError

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "synthetic")
PREPROCESS = ("raw", "center", "standardize", "unit-norm")
SPLITS = ("train", "test")

USER_SUFFIXES = (".npz", ".npy", ".safetensors", ".pt", ".pth", ".csv")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")
X_NAMES = ("X", "x", "data", "features", "images")
Y_NAMES = ("y", "Y", "labels", "label", "targets", "target")
CSV_LABEL_COLUMNS = ("label", "labels", "y", "target", "targets", "class")

SYNTHETIC_CLASSES = 4
MAX_SEED = 2**32 - 1  # numpy/torch seeds beyond this are refused rather than silently folded
MAX_CLASSES = 100_000  # labels are class indices 0..K-1 with K at most this
_DIGITS_TRAIN_FRACTION = 0.8
_DIGITS_SPLIT_SEED = 0

# torchvision folder names and the IDX file stems of each split.
_IDX_FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
_IDX_STEMS = {"train": "train", "test": "t10k"}
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_FILES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}

# IDX type codes -> big-endian numpy dtypes (http://yann.lecun.com/exdb/mnist/ format).
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# --------------------------------------------------------------------------- spec / result


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _clip(text: Any, limit: int = 80) -> str:
    """``str(text)`` cut to at most ``limit`` characters (an ellipsis marks the cut), for echoing user input."""
    try:
        text = str(text)
    except ValueError:  # an int of more than 4300 digits cannot be printed
        text = f"<{type(text).__name__} too large to print>"
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "\u2026"


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` clipped like :func:`_clip` (and safe for huge ints)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__} too large to print>"
    return _clip(text, limit)


def _short_list(values: Any, limit: int = 10, sep: str = ", ") -> str:
    """The first ``limit`` values joined by ``sep``, then ``… (N more)`` when there are more."""
    items = [_clip(v, 40) for v in values]
    if len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + f"{sep}\u2026 ({len(items) - limit} more)"


def check_seed(value: Any, option: str = "--seed", count: int = 1) -> None:
    """Refuse a seed unless ``value``, ``value + 1``, ..., ``value + count - 1`` all lie in 0..MAX_SEED.

    ``count`` is how many consecutive seeds will be used (e.g. ``--seeds``). Raises
    :class:`AuditError` naming ``option`` and the allowed range.
    """
    count = int(count) if _is_int(count) and count > 1 else 1
    top = MAX_SEED - count + 1
    if top < 0:
        raise AuditError(f"{count} consecutive seeds do not fit in 0..{MAX_SEED}; use fewer seeds")
    if not _is_int(value) or not 0 <= value <= top:
        raise AuditError(f"{option} must be an integer in 0..{top}, got {_clip(value)}")


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
            raise AuditError(
                f"unknown preprocessing {_show(self.preprocess)}; choose one of {', '.join(PREPROCESS)}"
            )
        object.__setattr__(self, "preprocess", preprocess)
        if self.n is not None and (not _is_int(self.n) or self.n < 1):
            raise AuditError(f"--n must be a positive integer, got {_show(self.n)}")
        check_seed(self.seed)
        if self.classes is not None:
            classes = tuple(self.classes)
            if not classes or not all(_is_int(c) and c >= 0 for c in classes):
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
            if not _is_int(value) or value < 1:
                raise AuditError(f"{name} must be a positive integer, got {_show(value)}")
        kappa = self.synthetic_kappa
        if not isinstance(kappa, numbers.Real) or not np.isfinite(kappa) or kappa < 1:
            raise AuditError(
                f"synthetic_kappa must be a finite number >= 1 (sigma_max / sigma_min), got {_show(kappa)}"
            )
        if self.synthetic_rank is not None:
            rows = self.n if self.n is not None else self.synthetic_n
            max_rank = min(rows, self.synthetic_d)
            if not _is_int(self.synthetic_rank) or not 1 <= self.synthetic_rank <= max_rank:
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


# --------------------------------------------------------------------------- small helpers


def default_data_dir() -> Path:
    """Root for torchvision-style data: ``$ATTNAUDIT_DATA_DIR``, else ``~/.cache/attnaudit/data``."""
    env = os.environ.get("ATTNAUDIT_DATA_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "attnaudit" / "data"


def data_fingerprint(X: torch.Tensor, y: torch.Tensor | None = None) -> str:
    """First 16 hex digits of sha256 over X (as float64) and y: identifies a training set exactly."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(X.detach().cpu().to(torch.float64).numpy()).tobytes())
    if y is not None:
        h.update(np.ascontiguousarray(y.detach().cpu().to(torch.int64).numpy()).tobytes())
    return h.hexdigest()[:16]


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


def _checksum(indices: np.ndarray) -> str:
    """First 12 hex digits of sha256 over the indices as little-endian int64."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()[:12]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- preprocessing


def _preprocess_inplace(X: torch.Tensor, how: str) -> torch.Tensor:
    """Apply ``how`` to a float64 tensor in place (callers own X); returns X."""
    if how == "raw":
        return X
    if how in ("center", "standardize"):
        # Constant columns (e.g. MNIST's always-zero border) are set to exactly 0: the
        # mean of a constant column is not always the constant in floating point, and
        # dividing that residue by its tiny std would blow round-off up to +-1.
        constant = X.amax(dim=0) == X.amin(dim=0)
        X.sub_(X.mean(dim=0, keepdim=True))
        if how == "standardize":
            std = X.std(dim=0, correction=0, keepdim=True)
            std[:, constant] = 1.0
            X.div_(std)
        X[:, constant] = 0.0
        return X
    if how == "unit-norm":
        norms = torch.linalg.vector_norm(X, dim=1, keepdim=True)
        norms[norms == 0] = 1.0  # zero rows stay zero
        X.div_(norms)
        return X
    raise AuditError(f"unknown preprocessing {how!r}; choose one of {', '.join(PREPROCESS)}")


def apply_preprocess(X: torch.Tensor, how: str) -> torch.Tensor:
    """Return a float64 copy of X (n, d) preprocessed; X itself is not modified.

    raw: unchanged. center: subtract column means. standardize: center, then divide by
    the population column std (ddof 0), constant columns left at 0. unit-norm: each row
    divided by its L2 norm, zero rows left at 0.
    """
    if how not in PREPROCESS:
        raise AuditError(f"unknown preprocessing {how!r}; choose one of {', '.join(PREPROCESS)}")
    if X.ndim != 2:
        raise AuditError(f"preprocessing needs a 2-D (samples x features) matrix, got shape {tuple(X.shape)}")
    return _preprocess_inplace(X.to(torch.float64, copy=True), how)


# --------------------------------------------------------------------------- subsets


def _stratified_counts(counts: np.ndarray, n: int) -> np.ndarray:
    """Split n over classes proportionally to counts (largest remainder), >= 1 each if n >= K."""
    counts = np.asarray(counts, dtype=np.int64)
    k = len(counts)
    quota = n * counts / counts.sum()
    alloc = np.floor(quota).astype(np.int64)
    floor_min = 1 if n >= k else 0
    alloc = np.minimum(np.maximum(alloc, floor_min), counts)
    while alloc.sum() < n:
        room = alloc < counts
        gap = np.where(room, quota - alloc, -np.inf)
        alloc[int(np.argmax(gap))] += 1
    while alloc.sum() > n:
        can_drop = alloc > floor_min
        excess = np.where(can_drop, alloc - quota, -np.inf)
        alloc[int(np.argmax(excess))] -= 1
    return alloc


def _choose(
    pool: np.ndarray, labels: np.ndarray | None, n: int, rng: np.random.Generator, stratify: bool
) -> np.ndarray:
    """Pick n entries of ``pool`` (sorted result); per class if stratify, else uniformly."""
    if n >= len(pool):
        return np.sort(pool)
    if not stratify:
        return np.sort(rng.permutation(pool)[:n])
    assert labels is not None
    values, counts = np.unique(labels, return_counts=True)
    alloc = _stratified_counts(counts, n)
    chosen = [rng.permutation(pool[labels == v])[:a] for v, a in zip(values, alloc)]
    return np.sort(np.concatenate(chosen))


def holdout_split(
    ds: Dataset, n_train: int, n_test: int, seed: int, stratify: bool = True
) -> tuple[Dataset, Dataset]:
    """Two disjoint row subsets of ``ds`` of sizes n_train and n_test (each in original order).

    Stratified by label when ``stratify`` and ``ds`` is labelled (unlabelled data falls back
    to a uniform draw). The test rows are drawn from the rows left after the train draw.
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if not _is_int(value) or value < 1:
            raise AuditError(f"{name} must be a positive integer, got {_show(value)}")
    check_seed(seed)
    if n_train + n_test > ds.n:
        raise AuditError(
            f"holdout split asks for {n_train} train + {n_test} test rows but {ds.name} has only {ds.n}; "
            "lower --n-train/--n-test or load more rows"
        )
    rng = np.random.default_rng(seed)
    labels = ds.y.cpu().numpy() if ds.y is not None else None
    use_strata = stratify and labels is not None
    pool = np.arange(ds.n)
    train_idx = _choose(pool, labels, n_train, rng, use_strata)
    rest = np.setdiff1d(pool, train_idx, assume_unique=True)
    test_idx = _choose(rest, labels[rest] if labels is not None else None, n_test, rng, use_strata)

    def part(idx: np.ndarray, which: str) -> Dataset:
        t = torch.from_numpy(idx).to(ds.X.device)
        info = dict(ds.info)
        info["holdout"] = {
            "part": which,
            "n": int(len(idx)),
            "seed": int(seed),
            "stratify": bool(use_strata),
            "indices_sha256": _checksum(idx),
        }
        return Dataset(
            X=ds.X.index_select(0, t),
            y=ds.y.index_select(0, t.to(ds.y.device)) if ds.y is not None else None,
            name=ds.name,
            n_classes=ds.n_classes,
            value_range=ds.value_range,
            feature_shape=ds.feature_shape,
            info=info,
            singular_values=None,  # a row subset has a different spectrum
        )

    return part(train_idx, "train"), part(test_idx, "test")


# --------------------------------------------------------------------------- validation


def _check_labels(y: Any, n_rows: int, where: str) -> np.ndarray:
    """Return y as (n,) int64, or raise AuditError saying what is wrong with it."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise AuditError(f"{where}: labels y must be 1-D (one integer per sample), got shape {y.shape}")
    if len(y) != n_rows:
        raise AuditError(
            f"{where}: X has {n_rows} rows but y has {len(y)} labels; they must match one label per sample"
        )
    if y.dtype == np.bool_:
        y = y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        bad = ~np.isfinite(y) | (y != np.round(y))
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise AuditError(
                f"{where}: labels y must be integer class labels; found {_show(y[first].item())} at row "
                f"{first}; convert labels to 0..K-1 integers"
            )
    elif not np.issubdtype(y.dtype, np.integer):
        raise AuditError(
            f"{where}: labels y must be integer class labels, got dtype {_clip(str(y.dtype))}; convert them to 0..K-1"
        )
    # Range checks on the original dtype: casting 1e30 or a uint64 above 2**63 to int64 would wrap.
    if len(y) and y.min() < 0:
        first = int(np.flatnonzero(y < 0)[0])
        raise AuditError(
            f"{where}: labels must be non-negative class indices 0..K-1; found {_clip(int(y[first]))} at row "
            f"{first}"
        )
    if len(y) and y.max() >= MAX_CLASSES:
        first = int(np.flatnonzero(y >= MAX_CLASSES)[0])
        raise AuditError(
            f"{where}: labels must be class indices 0..K-1 with K <= {MAX_CLASSES}; found label "
            f"{_clip(int(y[first]))} at row {first}; remap labels to 0..K-1"
        )
    return y.astype(np.int64, copy=False)


def _check_features(X: Any, where: str) -> np.ndarray:
    """Return X as a real numeric array of >= 2 dims with no NaN/inf, or raise AuditError."""
    X = np.asarray(X)
    if X.dtype == object or not (np.issubdtype(X.dtype, np.number) or X.dtype == np.bool_):
        raise AuditError(f"{where}: X must be a numeric array, got dtype {X.dtype}")
    if np.issubdtype(X.dtype, np.complexfloating):
        raise AuditError(f"{where}: X is complex; only real-valued features are supported")
    if X.ndim < 2:
        raise AuditError(
            f"{where}: X must be at least 2-D (samples x features...), got shape {X.shape}; "
            "reshape a single feature to (n, 1)"
        )
    if X.shape[0] == 0:
        raise AuditError(f"{where}: the data is empty (0 samples)")
    if int(np.prod(X.shape[1:])) == 0:
        raise AuditError(f"{where}: samples have no features (shape {X.shape})")
    if np.issubdtype(X.dtype, np.floating):
        flat = X.reshape(X.shape[0], -1)
        bad = ~np.isfinite(flat)
        count = int(bad.sum())
        if count:
            row, col = np.argwhere(bad)[0]
            raise AuditError(
                f"{where}: X has {count} non-finite values (first at row {row}, column {col}); "
                "clean the data or drop those rows"
            )
    return X


# --------------------------------------------------------------------------- built-in sources


def _load_digits(split: str) -> _Source:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    total = len(bunch.target)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(total)
    n_train = int(total * _DIGITS_TRAIN_FRACTION)
    rows = np.sort(order[:n_train] if split == "train" else order[n_train:])
    images = bunch.images[rows]  # (n, 8, 8), values 0..16
    return _Source(
        X=images,
        y=bunch.target[rows].astype(np.int64),
        name="digits",
        n_classes=10,
        scale=16.0,
        value_range=(0.0, 1.0),
        info={"source": "sklearn.datasets.load_digits", "split_rule": "default_rng(0) permutation, first 80% train"},
    )


def _open_maybe_gzip(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise AuditError(
            f"cannot read {path} ({_one_line(exc)}); the file is corrupt or truncated, delete it and fetch it again"
        ) from None


def read_idx(path: Path, expect_ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (plain or .gz): magic 0x00 0x00 <type> <ndim>, big-endian int32 dims, data."""
    path = Path(path)
    raw = _open_maybe_gzip(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        magic = raw[:4].hex() if raw else "(empty file)"
        raise AuditError(
            f"{path} is not an IDX file (magic bytes {magic}); the file is corrupt, delete it and fetch it again"
        )
    ndim = raw[3]
    if expect_ndim is not None and ndim != expect_ndim:
        raise AuditError(
            f"{path}: IDX header says {ndim} dimensions but {expect_ndim} were expected (wrong file?); "
            "check the file names or fetch the data again"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise AuditError(f"{path}: IDX header is truncated; delete the file and fetch it again")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise AuditError(
            f"{path}: IDX header promises {dims} ({expected} bytes of data) but the file holds "
            f"{len(raw) - header}; the file is truncated or corrupt, delete it and fetch it again"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr if dtype.isnative or dtype.itemsize == 1 else arr.astype(dtype.newbyteorder("="))


def _find_file(folder: Path, stem: str, suffixes: tuple[str, ...]) -> Path | None:
    for suffix in suffixes:
        candidate = folder / (stem + suffix)
        if candidate.is_file():
            return candidate
    return None


def _missing(name: str, split: str, root: Path, searched: list[str], layout: str, other_present: bool = False) -> AuditError:
    other = "test" if split == "train" else "train"
    hint = f" (the {other} split is there: pass --split {other} to use it)" if other_present else ""
    return AuditError(
        f"{name} {split} split not found under {root}: looked for {', '.join(searched)}{hint}; "
        f"pass --download to fetch it, or --data-dir pointing at a folder holding {layout}"
    )


def _download(name: str, root: Path, split: str) -> None:
    """Fetch with torchvision (the only place that writes to disk)."""
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[name]
    try:
        cls(root=str(root), train=(split == "train"), download=True)
    except Exception as exc:  # noqa: BLE001 - network/IO errors of many kinds
        raise AuditError(
            f"downloading {name} into {root} failed ({_one_line(exc)}); check the network, "
            "or copy the files there by hand and pass --data-dir"
        ) from None


def _locate_idx(name: str, root: Path, split: str) -> tuple[Path | None, Path | None, list[str]]:
    folder = root / _IDX_FOLDERS[name] / "raw"
    stem = _IDX_STEMS[split]
    images = _find_file(folder, f"{stem}-images-idx3-ubyte", ("", ".gz"))
    labels = _find_file(folder, f"{stem}-labels-idx1-ubyte", ("", ".gz"))
    searched = [str(folder / f"{stem}-images-idx3-ubyte[.gz]"), str(folder / f"{stem}-labels-idx1-ubyte[.gz]")]
    return images, labels, searched


def _load_idx_dataset(name: str, root: Path, split: str, download: bool) -> _Source:
    images, labels, searched = _locate_idx(name, root, split)
    if (images is None or labels is None) and download:
        _download(name, root, split)
        images, labels, searched = _locate_idx(name, root, split)
    if images is None or labels is None:
        folder = _IDX_FOLDERS[name]
        other_images, other_labels, _ = _locate_idx(name, root, "test" if split == "train" else "train")
        raise _missing(
            name, split, root, searched, f"{folder}/raw/{_IDX_STEMS[split]}-*-ubyte[.gz]",
            other_present=other_images is not None and other_labels is not None,
        )
    X = read_idx(images, expect_ndim=3)
    y = read_idx(labels, expect_ndim=1)
    if X.dtype != np.uint8 or y.dtype != np.uint8:
        raise AuditError(f"{images} / {labels}: expected unsigned-byte IDX files, got {X.dtype} / {y.dtype}")
    if len(X) != len(y):
        raise AuditError(f"{images} holds {len(X)} images but {labels} holds {len(y)} labels; fetch the data again")
    if len(X) == 0:
        raise AuditError(f"{images} holds no images; fetch the data again")
    if y.max() >= 10:
        raise AuditError(f"{labels} holds label {int(y.max())} outside 0..9; the file is corrupt, fetch it again")
    return _Source(
        X=X[:, None, :, :],  # (N, 1, H, W): channel axis as torchvision tensors have
        y=y.astype(np.int64),
        name=name,
        n_classes=10,
        scale=255.0,
        value_range=(0.0, 1.0),
        info={"source": name, "paths": [str(images), str(labels)]},
    )


# A genuine CIFAR-10 python batch is a dict of bytes keys holding a uint8 numpy array,
# lists of ints / bytes and bytes. Pickles run whatever callables they name, so the batch
# is read by an unpickler that resolves only the few globals such a batch names, each
# replaced by a checking wrapper; everything else is refused before it can run.
_SIMPLE_DTYPE = re.compile(r"[<>|=]?(?:[bB?]|b1|[iu][1248]|f[248])")
_MAX_PLACEHOLDER = 1 << 20  # _reconstruct only makes an empty placeholder that BUILD fills


def _numpy_function(module: str, name: str) -> Any:
    """numpy's private pickle helper ``module.name`` (numpy 2 ``_core``, numpy 1 ``core``)."""
    import importlib

    for prefix in ("numpy._core", "numpy.core"):
        try:
            return getattr(importlib.import_module(f"{prefix}.{module}"), name)
        except (ImportError, AttributeError):
            continue
    raise AuditError(f"this numpy has no {module}.{name}; cannot read CIFAR batches with numpy {np.__version__}")


class _NdarrayToken:
    """Stands in for ``numpy.ndarray`` in a CIFAR pickle: only ``_reconstruct`` may use it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError("numpy.ndarray called directly")


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR-10 python batches: no global outside a small allow-list resolves."""

    def __init__(self, fh: Any, path: Path, **kwargs: Any) -> None:
        super().__init__(fh, **kwargs)
        self._path = path
        self._globals = {
            ("numpy.core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): self._reconstruct,
            ("numpy.core.numeric", "_frombuffer"): self._frombuffer,
            ("numpy._core.numeric", "_frombuffer"): self._frombuffer,
            ("numpy", "ndarray"): _NdarrayToken,
            ("numpy", "dtype"): self._dtype,
            ("_codecs", "encode"): self._latin1_encode,  # how Python 3 pickles bytes at protocol < 3
        }

    def _refuse(self, what: str) -> AuditError:
        return AuditError(
            f"refused: the CIFAR batch {self._path} asks to load {_clip(what)}, which a genuine CIFAR-10 batch "
            "never holds; delete it and fetch the data again"
        )

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is None:
            raise self._refuse(f"{module}.{name}")
        return found

    def _checked_dtype(self, spec: Any) -> Any:
        text = spec.decode("latin-1") if isinstance(spec, bytes) else spec
        if isinstance(text, np.dtype):
            text = text.str
        if not isinstance(text, str) or not _SIMPLE_DTYPE.fullmatch(text):
            raise self._refuse(f"numpy.dtype({_show(text, 40)})")
        return text

    def _dtype(self, spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
        # A fresh dtype object (copy=True), so the BUILD that follows cannot touch numpy's singletons.
        return np.dtype(self._checked_dtype(spec), False, True)

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if subtype is not _NdarrayToken:
            raise self._refuse(f"numpy _reconstruct of {_show(subtype, 40)}")
        dims = shape if isinstance(shape, tuple) else (shape,)
        if not all(_is_int(k) and k >= 0 for k in dims) or int(np.prod(dims, dtype=object)) > _MAX_PLACEHOLDER:
            raise self._refuse(f"numpy _reconstruct of shape {_show(shape, 40)}")
        return _numpy_function("multiarray", "_reconstruct")(np.ndarray, dims, self._checked_dtype(dtype))

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
        if not isinstance(buf, (bytes, bytearray, pickle.PickleBuffer)):
            raise self._refuse(f"numpy _frombuffer of {type(buf).__name__}")
        dtype = np.dtype(self._checked_dtype(dtype))
        return _numpy_function("numeric", "_frombuffer")(buf, dtype, shape, order)

    def _latin1_encode(self, text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise self._refuse(f"_codecs.encode with {_show(encoding, 30)}")
        return text.encode("latin-1")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as fh:
            batch = _RestrictedUnpickler(fh, path, encoding="bytes").load()
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - unpickling can fail in many ways
        raise AuditError(
            f"cannot read CIFAR batch {path} ({_clip(_one_line(exc), 200)}); the file is corrupt, "
            "delete it and fetch it again"
        ) from None
    if isinstance(batch, dict):
        # Genuine batches (pickled by Python 2) have bytes keys; accept str keys as well.
        batch = {k.encode("latin-1") if isinstance(k, str) else k: v for k, v in batch.items()}
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = _short_list(sorted(map(repr, batch))) if isinstance(batch, dict) else type(batch).__name__
        raise AuditError(
            f"{path} is not a CIFAR-10 batch (expected keys b'data' and b'labels', found {_clip(keys, 200)}); "
            "delete it and fetch the data again"
        )
    data, labels = batch[b"data"], batch[b"labels"]
    for value in batch.values():
        if isinstance(value, np.ndarray) and value.dtype.hasobject:
            raise AuditError(
                f"refused: the CIFAR batch {path} holds an array of Python objects, which a genuine CIFAR-10 "
                "batch never holds; delete it and fetch the data again"
            )
    if not isinstance(labels, (list, tuple, np.ndarray)) or not all(
        _is_int(v) for v in (labels.tolist() if isinstance(labels, np.ndarray) else labels)
    ):
        raise AuditError(
            f"{path}: b'labels' must be a list of integer labels, got {_clip(type(labels).__name__)}; "
            "the file is corrupt, delete it and fetch it again"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise AuditError(f"{path}: b'labels' holds a label outside int64; the file is corrupt, fetch it again") from None
    if type(data) is not np.ndarray or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 \
            or len(labels) != len(data):
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise AuditError(
            f"{path}: expected uint8 data of shape (k, 3072) and k labels, got data {_clip(what)} "
            f"and {len(labels)} labels; the file is corrupt, fetch it again"
        )
    return data, labels


def _load_cifar10(root: Path, split: str, download: bool) -> _Source:
    folder = root / _CIFAR_FOLDER
    files = [folder / f for f in _CIFAR_FILES[split]]
    if not all(f.is_file() for f in files) and download:
        _download("cifar10", root, split)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        other = _CIFAR_FILES["test" if split == "train" else "train"]
        raise _missing(
            "cifar10", split, root, missing, f"{_CIFAR_FOLDER}/{{data_batch_1..5,test_batch}}",
            other_present=all((folder / f).is_file() for f in other),
        )
    parts = [_read_cifar_batch(f) for f in files]
    X = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    y = _check_labels(np.concatenate([p[1] for p in parts]), len(X), str(folder))
    if y.max() >= 10:
        raise AuditError(f"{folder}: label {int(y.max())} outside 0..9; the files are corrupt, fetch them again")
    return _Source(
        X=X.reshape(-1, 3, 32, 32),
        y=y,
        name="cifar10",
        n_classes=10,
        scale=255.0,
        value_range=(0.0, 1.0),
        info={"source": "cifar10", "paths": [str(f) for f in files]},
    )


def _orthonormal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """rows x cols matrix with orthonormal columns (QR of a Gaussian, signs fixed by R's diagonal)."""
    q, r = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q * np.sign(np.where(np.diag(r) == 0, 1.0, np.diag(r)))


def synthetic_matrix(
    n: int, d: int, kappa: float, rank: int | None, seed: int, split: str = "train"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X = U diag(s) V^T (n x d) with s log-spaced from 1 to 1/kappa over rank r; returns (X, y, s).

    r = min(n, d) when ``rank`` is None. s is exact by construction; the SVD of the float64
    X reproduces it to about 1e-16 absolute, so relative agreement degrades once
    1/kappa approaches round-off (kappa beyond ~1e12).

    V and the labelling map W (d x 4, y = argmax X W) depend on ``seed`` only, U on
    (seed, split), so both splits share one row space and one labelling rule.
    """
    r = min(n, d) if rank is None else rank
    shared = np.random.default_rng([seed, 0])
    V = _orthonormal(shared, d, r)
    W = shared.standard_normal((d, SYNTHETIC_CLASSES))
    U = _orthonormal(np.random.default_rng([seed, 1 + SPLITS.index(split)]), n, r)
    s = np.logspace(0.0, -np.log10(kappa), r) if r > 1 else np.ones(1)
    X = (U * s) @ V.T
    y = np.argmax(X @ W, axis=1).astype(np.int64)
    return X, y, s


# --------------------------------------------------------------------------- user sources


def _pick(arrays: dict[str, Any], where: str) -> tuple[Any, Any]:
    """Choose X and y from named arrays: X_NAMES / Y_NAMES, or a single unnamed array as X."""
    x_key = next((k for k in X_NAMES if k in arrays), None)
    y_key = next((k for k in Y_NAMES if k in arrays), None)
    if x_key is None:
        others = [k for k in arrays if k != y_key]
        if len(others) == 1:
            x_key = others[0]
        else:
            raise AuditError(
                f"{where}: cannot tell which array holds the features (found {sorted(arrays) or 'nothing'}); "
                f"name it one of {', '.join(X_NAMES)} and the labels one of {', '.join(Y_NAMES)}"
            )
    return arrays[x_key], (arrays[y_key] if y_key is not None else None)


def _to_numpy(value: Any, where: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.to(torch.float64)  # bfloat16/float16 have no numpy equivalent path
        return value.numpy()
    try:
        return np.asarray(value)
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"{where}: cannot turn {type(value).__name__} into an array ({_one_line(exc)})") from None


def _read_npz(path: Path) -> tuple[Any, Any]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except Exception as exc:  # noqa: BLE001 - zip/format/pickle errors
        raise AuditError(
            f"cannot read {path} as .npz ({_one_line(exc)}); save it with numpy.savez(X=..., y=...)"
        ) from None
    return _pick(arrays, str(path))


def _read_npy(path: Path) -> tuple[Any, Any]:
    # np.load treats a file without the .npy magic as a pickle; check first so garbage
    # is reported as garbage rather than as "holds a Python object".
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except OSError as exc:
        raise AuditError(f"cannot read {path} ({_one_line(exc)})") from None
    if magic != b"\x93NUMPY":
        raise AuditError(f"cannot read {path} as .npy (no .npy header); save it with numpy.save")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise AuditError(
                f"{path} holds a Python object (e.g. a dict), not a numeric array; save a plain array, "
                "or use .npz with arrays X and y"
            ) from None
        raise AuditError(f"cannot read {path} as .npy ({_one_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read {path} as .npy ({_one_line(exc)})") from None
    return arr, None


def _read_safetensors(path: Path) -> tuple[Any, Any]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read {path} as .safetensors ({_one_line(exc)})") from None
    return _pick(tensors, str(path))


# torch's weights-only refusal wraps the one useful line in advice to retry with
# weights_only=False (which would run the file's code); keep only the useful line.
_TORCH_BOILERPLATE = ("weights only load failed", "please file an issue", "check the documentation")


def _torch_load_reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.lower().startswith(_TORCH_BOILERPLATE)]
    if kept and kept[0].startswith("WeightsUnpickler error:"):
        kept[0] = kept[0][len("WeightsUnpickler error:"):].strip()
    text = " ".join(line for line in kept if line)
    return _clip(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, 200)


def _read_pt(path: Path) -> tuple[Any, Any]:
    try:
        # torch warns (e.g. about the pickle protocol of a legacy or crafted file) before it
        # refuses; the refusal below is the one line the user needs.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors of many kinds
        raise AuditError(
            f"cannot read {path} with torch.load(weights_only=True) ({_torch_load_reason(exc)}); it must hold "
            "only tensors: save a tensor, an (X, y) tuple of tensors, or a dict {'X': ..., 'y': ...} with torch.save"
        ) from None
    if isinstance(obj, torch.Tensor):
        return obj, None
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return obj[0], obj[1]
    if isinstance(obj, dict):
        return _pick({str(k): v for k, v in obj.items()}, str(path))
    raise AuditError(
        f"{path} holds a {type(obj).__name__}; expected a tensor, an (X, y) tuple, or a dict with X and y"
    )


def _read_csv(path: Path) -> tuple[Any, Any]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            header = next(csv.reader(fh), None)
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"cannot read {path} as .csv ({_one_line(exc)})") from None
    if not header:
        raise AuditError(f"{path}: the CSV file is empty; it needs a header row and one row per sample")
    names = [h.strip() for h in header]
    label_cols = [i for i, h in enumerate(names) if h.lower() in CSV_LABEL_COLUMNS]
    if len(label_cols) > 1:
        raise AuditError(
            f"{path}: several label columns ({', '.join(names[i] for i in label_cols)}); keep one of them"
        )
    try:
        # numpy's C parser is fast on large files; the slow loop below only runs to find the bad cell.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no data": reported below as an AuditError
            table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2, encoding="utf-8-sig")
    except ValueError:
        table = _csv_slow(path, names)
    if table.size == 0:
        raise AuditError(f"{path}: the data is empty (0 samples below the header)")
    if table.shape[1] != len(names):
        raise AuditError(f"{path}: the header has {len(names)} columns but the rows have {table.shape[1]}")
    if label_cols:
        j = label_cols[0]
        return np.delete(table, j, axis=1), table[:, j]
    return table, None


def _csv_slow(path: Path, names: list[str]) -> np.ndarray:
    """Parse cell by cell to report the first bad cell (line and column) in the error."""
    rows: list[list[float]] = []
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        next(reader)
        for line, cells in enumerate(reader, start=2):
            if not cells or all(not c.strip() for c in cells):
                continue
            if len(cells) != len(names):
                raise AuditError(f"{path}: line {line} has {len(cells)} cells but the header has {len(names)} columns")
            try:
                rows.append([float(c) for c in cells])
            except ValueError:
                col = next(i for i, c in enumerate(cells) if not _is_float(c))
                raise AuditError(
                    f"{path}: non-numeric cell {cells[col]!r} at line {line}, column {names[col]!r}; "
                    "all feature and label cells must be numbers"
                ) from None
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(names))


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _read_image_folder(path: Path) -> _Source:
    from PIL import Image, UnidentifiedImageError

    class_dirs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise AuditError(
            f"{path}: image folder has no class sub-folders; put each class's images in its own sub-folder"
        )
    files: list[tuple[Path, int]] = []
    for label, folder in enumerate(class_dirs):
        images = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise AuditError(
                f"{folder}: class folder holds no images ({', '.join(IMAGE_SUFFIXES)}); add images or remove the folder"
            )
        files.extend((f, label) for f in images)

    gray_modes = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
    size = None
    all_gray = True
    # First pass reads headers only (PIL opens lazily) to fix the mode and size.
    for f, _ in files:
        try:
            with Image.open(f) as img:
                mode, this_size = img.mode, img.size
        except (OSError, UnidentifiedImageError) as exc:
            raise AuditError(f"cannot read image {f} ({_one_line(exc)}); remove or replace it") from None
        if size is None:
            size, first = this_size, f
        elif this_size != size:
            raise AuditError(
                f"images must all have the same size: {first} is {size[0]}x{size[1]} but {f} is "
                f"{this_size[0]}x{this_size[1]}; resize them first"
            )
        all_gray &= mode in gray_modes
    assert size is not None
    width, height = size
    mode = "L" if all_gray else "RGB"
    channels = 1 if all_gray else 3
    X = np.empty((len(files), channels, height, width), dtype=np.uint8)
    for i, (f, _) in enumerate(files):
        try:
            with Image.open(f) as img:
                pixels = np.asarray(img.convert(mode))
        except (OSError, UnidentifiedImageError) as exc:
            raise AuditError(f"cannot read image {f} ({_one_line(exc)}); remove or replace it") from None
        X[i] = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
    return _Source(
        X=X,
        y=np.array([label for _, label in files], dtype=np.int64),
        name=path.name,
        n_classes=len(class_dirs),
        scale=255.0,
        value_range=(0.0, 1.0),
        info={
            "source": str(path),
            "format": "image-folder",
            "class_names": [p.name for p in class_dirs],
            "mode": mode,
        },
    )


_READERS = {
    ".npz": _read_npz,
    ".npy": _read_npy,
    ".safetensors": _read_safetensors,
    ".pt": _read_pt,
    ".pth": _read_pt,
    ".csv": _read_csv,
}


def _load_user(path_text: str) -> _Source:
    path = Path(path_text).expanduser()
    if not path.exists():
        raise AuditError(f"data path {path} does not exist; check the --data path")
    if path.is_dir():
        return _read_image_folder(path)
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise AuditError(
            f"{path}: unsupported file type {suffix or '(no extension)'!r}; use one of "
            f"{', '.join(USER_SUFFIXES)}, or a folder of images with one sub-folder per class"
        )
    X_raw, y_raw = reader(path)
    where = str(path)
    X = _check_features(_to_numpy(X_raw, where), where)
    y = _check_labels(_to_numpy(y_raw, where), len(X), where) if y_raw is not None else None
    return _Source(
        X=X,
        y=y,
        name=path.name,
        n_classes=int(y.max()) + 1 if y is not None else 0,
        scale=None,
        value_range=None,
        info={"source": str(path), "format": suffix.lstrip(".")},
    )


# --------------------------------------------------------------------------- assembly


def _select_rows(src: _Source, spec: DataSpec, n: int | None, stratify: bool) -> np.ndarray:
    """Row indices into src after the class filter and subset (sorted)."""
    total = len(src.X)
    pool = np.arange(total)
    what = f"{src.name} ({spec.split})" if spec.data is None else src.name
    if spec.classes is not None:
        if src.y is None:
            raise AuditError(f"{what} has no labels, so --classes cannot be applied; drop --classes or add labels")
        present = np.unique(src.y)
        absent = [c for c in spec.classes if c not in set(present.tolist())]
        if absent:
            raise AuditError(
                f"--classes names label(s) {_short_list(absent)} not present in {what}; "
                f"labels present: {_short_list(present.tolist())}"
            )
        pool = pool[np.isin(src.y, np.asarray(spec.classes))]
    if n is None:
        return pool
    if n > len(pool):
        scope = f" with classes {_short_list(spec.classes, sep=',')}" if spec.classes is not None else ""
        raise AuditError(f"--n {n} is more than the {len(pool)} rows available in {what}{scope}; lower --n")
    if stratify and src.y is None:
        raise AuditError(f"{what} has no labels, so --stratify cannot be applied; drop --stratify")
    rng = np.random.default_rng(spec.seed)
    return _choose(pool, src.y[pool] if src.y is not None else None, n, rng, stratify)


def _finish(src: _Source, spec: DataSpec, n: int | None, stratify: bool) -> Dataset:
    idx = _select_rows(src, spec, n, stratify)
    everything = len(idx) == len(src.X)
    rows = src.X if everything else src.X[idx]
    flat = rows.reshape(len(rows), -1)
    if src.scale is not None:
        # Divide straight into the float64 result: no float64 temporary of the uint8 data.
        out = np.empty(flat.shape, dtype=np.float64)
        np.divide(flat, src.scale, out=out)
    else:
        # May share memory with src.X: fine, the source is private to this call and
        # preprocessing then works in place without a second copy.
        out = np.ascontiguousarray(flat, dtype=np.float64)
        if not out.flags.writeable:
            out = out.copy()
    X = torch.from_numpy(out)
    if src.value_range is not None:
        value_range: tuple[float, float] | None = src.value_range
    else:
        value_range = (float(X.min()), float(X.max()))
    _preprocess_inplace(X, spec.preprocess)
    y = torch.from_numpy(np.ascontiguousarray(src.y[idx])) if src.y is not None else None
    info = dict(src.info)
    info.update(
        {
            "name": src.name,
            "split": spec.split if spec.data is None else None,
            "n_available": int(len(src.X)),
            "n": int(len(idx)),
            "seed": int(spec.seed),
            "classes": list(spec.classes) if spec.classes is not None else None,
            "stratify": bool(stratify and n is not None),
            "preprocess": spec.preprocess,
            "indices_sha256": _checksum(idx),
        }
    )
    if y is not None:
        labels, counts = np.unique(src.y[idx], return_counts=True)
        info["class_counts"] = {str(int(k)): int(c) for k, c in zip(labels, counts)}
    return Dataset(
        X=X,
        y=y,
        name=src.name,
        n_classes=src.n_classes,
        value_range=value_range if spec.preprocess == "raw" else None,
        feature_shape=tuple(int(s) for s in src.X.shape[1:]),
        info=info,
    )


def load_dataset(spec: DataSpec) -> Dataset:
    """Load, filter (--classes), subset (--n), and preprocess the data ``spec`` names."""
    if spec.data is not None:
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


def _load_synthetic(spec: DataSpec) -> Dataset:
    rows = spec.n if spec.n is not None else spec.synthetic_n
    X, y, s = synthetic_matrix(rows, spec.synthetic_d, spec.synthetic_kappa, spec.synthetic_rank, spec.seed, spec.split)
    src = _Source(
        X=X,
        y=y,
        name="synthetic",
        n_classes=SYNTHETIC_CLASSES,
        scale=None,
        value_range=None,
        info={
            "source": "synthetic",
            "synthetic": {
                "n": rows,
                "d": spec.synthetic_d,
                "kappa": float(spec.synthetic_kappa),
                "rank": int(len(s)),
            },
        },
    )
    # n already set the number of rows generated; subsetting would break the spectrum.
    ds = _finish(src, spec, None, False)
    ds.value_range = None
    if spec.classes is None and spec.preprocess == "raw":
        # Only exact while X is untouched: filtering or preprocessing changes the spectrum.
        ds.singular_values = s.copy()
    return ds
