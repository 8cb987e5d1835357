"""Built-in sources: scikit-learn digits, MNIST / Fashion-MNIST (IDX files) and CIFAR-10
(python batches) in torchvision's layout, located under the data directory or downloaded
on request, and the synthetic matrix of prescribed spectrum."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from attnaudit.data.readers import check_labels, read_cifar_batch, read_idx
from attnaudit.data.selection import assemble
from attnaudit.data.spec import SPLITS, Dataset, DataSpec, Source
from attnaudit.errors import AuditError, one_line

SYNTHETIC_CLASSES = 4
_DIGITS_TRAIN_FRACTION = 0.8
_DIGITS_SPLIT_SEED = 0

# torchvision folder names and the IDX file stems of each split.
_IDX_FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
_IDX_STEMS = {"train": "train", "test": "t10k"}
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_FILES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}


# --------------------------------------------------------------------------- the built-in data sets


def load_builtin(spec: DataSpec) -> Dataset:
    """The built-in data set ``spec.dataset`` names, its ``spec.split``, with ``spec``'s class
    filter, subset and preprocessing (``info['data_dir']``: the folder read, None for digits)."""
    root = Path(spec.data_dir).expanduser() if spec.data_dir is not None else default_data_dir()
    if spec.dataset == "digits":
        src = _load_digits(spec.split)
    elif spec.dataset in _IDX_FOLDERS:
        src = _load_idx_dataset(spec.dataset, root, spec.split, spec.download)
    elif spec.dataset == "cifar10":
        src = _load_cifar10(root, spec.split, spec.download)
    else:
        return _load_synthetic(spec)
    ds = assemble(src, spec, spec.n, spec.stratify)
    ds.info["data_dir"] = str(root) if spec.dataset != "digits" else None
    return ds


# --------------------------------------------------------------------------- locating and downloading


def default_data_dir() -> Path:
    """Root for torchvision-style data: ``$ATTNAUDIT_DATA_DIR``, else ``~/.cache/attnaudit/data``."""
    env = os.environ.get("ATTNAUDIT_DATA_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "attnaudit" / "data"


def _find_file(folder: Path, stem: str, suffixes: tuple[str, ...]) -> Path | None:
    for suffix in suffixes:
        candidate = folder / (stem + suffix)
        if candidate.is_file():
            return candidate
    return None


def _missing(
    name: str, split: str, root: Path, searched: list[str], layout: str, other_present: bool = False
) -> AuditError:
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
            f"downloading {name} into {root} failed ({one_line(exc)}); check the network, "
            "or copy the files there by hand and pass --data-dir"
        ) from None


# --------------------------------------------------------------------------- digits


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: images (1797, 8, 8) with values 0..16 and labels (1797,).

    Read from the CSV file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, what its
    ``load_digits`` parses) without importing scikit-learn, whose import takes about 1.2 s
    against 0.02 s for the file; through ``load_digits`` when that file is not where it was.
    """
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            if data.shape == (1797, 65):
                return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def _load_digits(split: str) -> Source:
    images_all, labels = digits_arrays()
    total = len(labels)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(total)
    n_train = int(total * _DIGITS_TRAIN_FRACTION)
    rows = np.sort(order[:n_train] if split == "train" else order[n_train:])
    images = images_all[rows]  # (n, 8, 8), values 0..16
    return Source(
        X=images,
        y=labels[rows],
        name="digits",
        n_classes=10,
        scale=16.0,
        value_range=(0.0, 1.0),
        info={"source": "sklearn.datasets.load_digits", "split_rule": "default_rng(0) permutation, first 80% train"},
    )


# --------------------------------------------------------------------------- MNIST / Fashion-MNIST


def _locate_idx(name: str, root: Path, split: str) -> tuple[Path | None, Path | None, list[str]]:
    folder = root / _IDX_FOLDERS[name] / "raw"
    stem = _IDX_STEMS[split]
    images = _find_file(folder, f"{stem}-images-idx3-ubyte", ("", ".gz"))
    labels = _find_file(folder, f"{stem}-labels-idx1-ubyte", ("", ".gz"))
    searched = [str(folder / f"{stem}-images-idx3-ubyte[.gz]"), str(folder / f"{stem}-labels-idx1-ubyte[.gz]")]
    return images, labels, searched


def _load_idx_dataset(name: str, root: Path, split: str, download: bool) -> Source:
    images, labels, searched = _locate_idx(name, root, split)
    if (images is None or labels is None) and download:
        _download(name, root, split)
        images, labels, searched = _locate_idx(name, root, split)
    if images is None or labels is None:
        folder = _IDX_FOLDERS[name]
        other_images, other_labels, _ = _locate_idx(name, root, "test" if split == "train" else "train")
        raise _missing(
            name,
            split,
            root,
            searched,
            f"{folder}/raw/{_IDX_STEMS[split]}-*-ubyte[.gz]",
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
    return Source(
        X=X[:, None, :, :],  # (N, 1, H, W): channel axis as torchvision tensors have
        y=y.astype(np.int64),
        name=name,
        n_classes=10,
        scale=255.0,
        value_range=(0.0, 1.0),
        info={"source": name, "paths": [str(images), str(labels)]},
    )


# --------------------------------------------------------------------------- CIFAR-10


def _load_cifar10(root: Path, split: str, download: bool) -> Source:
    folder = root / _CIFAR_FOLDER
    files = [folder / f for f in _CIFAR_FILES[split]]
    if not all(f.is_file() for f in files) and download:
        _download("cifar10", root, split)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        other = _CIFAR_FILES["test" if split == "train" else "train"]
        raise _missing(
            "cifar10",
            split,
            root,
            missing,
            f"{_CIFAR_FOLDER}/{{data_batch_1..5,test_batch}}",
            other_present=all((folder / f).is_file() for f in other),
        )
    parts = [read_cifar_batch(f) for f in files]
    X = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    y = check_labels(np.concatenate([p[1] for p in parts]), len(X), str(folder))
    if y.max() >= 10:
        raise AuditError(f"{folder}: label {int(y.max())} outside 0..9; the files are corrupt, fetch them again")
    return Source(
        X=X.reshape(-1, 3, 32, 32),
        y=y,
        name="cifar10",
        n_classes=10,
        scale=255.0,
        value_range=(0.0, 1.0),
        info={"source": "cifar10", "paths": [str(f) for f in files]},
    )


# --------------------------------------------------------------------------- synthetic


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


def _load_synthetic(spec: DataSpec) -> Dataset:
    rows = spec.n if spec.n is not None else spec.synthetic_n
    X, y, s = synthetic_matrix(rows, spec.synthetic_d, spec.synthetic_kappa, spec.synthetic_rank, spec.seed, spec.split)
    src = Source(
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
    ds = assemble(src, spec, None, False)
    ds.value_range = None
    if spec.classes is None and spec.preprocess == "raw":
        # Only exact while X is untouched: filtering or preprocessing changes the spectrum.
        ds.singular_values = s.copy()
    return ds
