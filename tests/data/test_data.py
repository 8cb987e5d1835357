"""Tests for attnaudit.data against independently built ground truth.

Fabricated files are written byte by byte here (IDX headers, CIFAR pickles, PNGs), so the
reader is checked against the format definitions rather than against itself.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import subprocess
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from attnaudit.data import (
    DATASETS,
    MAX_CLASSES,
    MAX_SEED,
    PREPROCESS,
    DataSpec,
    Dataset,
    apply_preprocess,
    check_seed,
    default_data_dir,
    holdout_split,
    load_dataset,
    parse_classes,
)
from attnaudit.errors import clip_text, short_list
from attnaudit.errors import AuditError

REAL_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
REAL_MNIST = REAL_DATA / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz"


# --------------------------------------------------------------------------- helpers


def idx_bytes(arr: np.ndarray) -> bytes:
    """IDX encoding by the spec: two zero bytes, type code 0x08 (ubyte), ndim, big-endian uint32 dims, data."""
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_idx_split(
    root: Path, stem: str, images: np.ndarray, labels: np.ndarray, gz: bool, folder: str = "MNIST"
) -> None:
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
        path = raw / f"{stem}-{kind}-ubyte"
        data = idx_bytes(arr)
        if gz:
            with gzip.open(str(path) + ".gz", "wb") as fh:
                fh.write(data)
        else:
            path.write_bytes(data)


def with_row_ids(n: int, d: int = 3) -> np.ndarray:
    """Features whose column 0 is the row index, so selected rows can be identified."""
    X = np.random.default_rng(1).random((n, d))
    X[:, 0] = np.arange(n)
    return X


def npz_file(tmp_path: Path, X: np.ndarray, y: np.ndarray | None = None, name: str = "d.npz") -> str:
    path = tmp_path / name
    if y is None:
        np.savez(path, X=X)
    else:
        np.savez(path, X=X, y=y)
    return str(path)


def row_ids(ds: Dataset) -> np.ndarray:
    return ds.X[:, 0].numpy().astype(np.int64)


# --------------------------------------------------------------------------- user formats


def test_npz_round_trip_keeps_shape_and_values(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((6, 2, 3)).astype(np.float32)
    y = np.array([0, 2, 1, 2, 0, 1], dtype=np.int32)
    ds = load_dataset(DataSpec(data=npz_file(tmp_path, X, y)))
    assert ds.X.dtype == torch.float64 and ds.X.shape == (6, 6)
    np.testing.assert_array_equal(ds.X.numpy(), X.reshape(6, 6).astype(np.float64))
    assert ds.y.dtype == torch.int64 and ds.y.tolist() == y.tolist()
    assert ds.feature_shape == (2, 3)
    assert ds.n_classes == 3
    assert ds.value_range == (float(X.min()), float(X.max()))
    assert ds.info["format"] == "npz"


def test_npz_single_unnamed_array_and_alias_names(tmp_path):
    X = np.arange(12.0).reshape(4, 3)
    np.savez(tmp_path / "a.npz", whatever=X)
    ds = load_dataset(DataSpec(data=str(tmp_path / "a.npz")))
    np.testing.assert_array_equal(ds.X.numpy(), X)
    assert ds.y is None and ds.n_classes == 0
    np.savez(tmp_path / "b.npz", features=X, targets=np.array([1.0, 0.0, 1.0, 3.0]))
    ds = load_dataset(DataSpec(data=str(tmp_path / "b.npz")))
    assert ds.y.tolist() == [1, 0, 1, 3] and ds.n_classes == 4


def test_npy_features_only_and_object_rejected(tmp_path):
    X = np.random.default_rng(0).integers(0, 9, size=(5, 4)).astype(np.int16)
    np.save(tmp_path / "x.npy", X)
    ds = load_dataset(DataSpec(data=str(tmp_path / "x.npy")))
    np.testing.assert_array_equal(ds.X.numpy(), X.astype(np.float64))
    assert ds.y is None
    np.save(tmp_path / "obj.npy", np.array({"X": X}, dtype=object), allow_pickle=True)
    with pytest.raises(AuditError, match="Python object"):
        load_dataset(DataSpec(data=str(tmp_path / "obj.npy")))
    np.save(tmp_path / "flat.npy", np.arange(5.0))
    with pytest.raises(AuditError, match="at least 2-D"):
        load_dataset(DataSpec(data=str(tmp_path / "flat.npy")))


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import save_file

    X = torch.randn(5, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 0, 1, 1, 0])
    save_file({"images": X, "labels": y}, str(tmp_path / "d.safetensors"))
    ds = load_dataset(DataSpec(data=str(tmp_path / "d.safetensors")))
    torch.testing.assert_close(ds.X, X.reshape(5, 4).double(), rtol=0, atol=0)
    assert ds.y.tolist() == y.tolist() and ds.feature_shape == (1, 2, 2)


@pytest.mark.parametrize("layout", ["tensor", "tuple", "dict"])
def test_pt_round_trip(tmp_path, layout):
    X = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([3, 1, 0, 3])
    obj = {"tensor": X, "tuple": (X, y), "dict": {"x": X, "y": y}}[layout]
    torch.save(obj, tmp_path / "d.pt")
    ds = load_dataset(DataSpec(data=str(tmp_path / "d.pt")))
    torch.testing.assert_close(ds.X, X, rtol=0, atol=0)
    if layout == "tensor":
        assert ds.y is None
    else:
        assert ds.y.tolist() == [3, 1, 0, 3] and ds.n_classes == 4


def test_csv_with_label_column_in_the_middle(tmp_path):
    (tmp_path / "d.csv").write_text("f1,Label,f2\n0.5,1,2\n-1.25,0,3e2\n7,2,0\n")
    ds = load_dataset(DataSpec(data=str(tmp_path / "d.csv")))
    np.testing.assert_array_equal(ds.X.numpy(), [[0.5, 2.0], [-1.25, 300.0], [7.0, 0.0]])
    assert ds.y.tolist() == [1, 0, 2] and ds.feature_shape == (2,)


def test_csv_without_label_column_and_single_row(tmp_path):
    (tmp_path / "d.csv").write_text("a,b,c\n1,2,3\n")
    ds = load_dataset(DataSpec(data=str(tmp_path / "d.csv")))
    np.testing.assert_array_equal(ds.X.numpy(), [[1.0, 2.0, 3.0]])
    assert ds.y is None


def test_csv_non_numeric_cell_names_line_and_column(tmp_path):
    (tmp_path / "d.csv").write_text("a,b,label\n1,2,0\n3,oops,1\n")
    with pytest.raises(AuditError, match=r"'oops' at line 3, column 'b'"):
        load_dataset(DataSpec(data=str(tmp_path / "d.csv")))


def _png(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def test_image_folder_grayscale_two_classes(tmp_path):
    rng = np.random.default_rng(0)
    imgs = {name: rng.integers(0, 256, size=(3, 4), dtype=np.uint8) for name in ("c0", "c1", "d0")}
    # Folder names sort as cat < dog, so cat -> 0, dog -> 1.
    _png(tmp_path / "imgs" / "dog" / "d0.png", imgs["d0"])
    _png(tmp_path / "imgs" / "cat" / "c0.png", imgs["c0"])
    _png(tmp_path / "imgs" / "cat" / "c1.png", imgs["c1"])
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image")
    ds = load_dataset(DataSpec(data=str(tmp_path / "imgs")))
    assert ds.y.tolist() == [0, 0, 1]
    assert ds.feature_shape == (1, 3, 4) and ds.value_range == (0.0, 1.0)
    expected = np.stack([imgs["c0"], imgs["c1"], imgs["d0"]]).reshape(3, -1) / 255.0
    np.testing.assert_array_equal(ds.X.numpy(), expected)
    assert ds.info["class_names"] == ["cat", "dog"]


def test_image_folder_rgb_is_channel_major(tmp_path):
    rgb = np.random.default_rng(1).integers(0, 256, size=(2, 2, 3), dtype=np.uint8)
    _png(tmp_path / "f" / "a" / "x.png", rgb)
    _png(tmp_path / "f" / "b" / "y.png", np.zeros((2, 2), dtype=np.uint8))  # gray + rgb -> RGB
    ds = load_dataset(DataSpec(data=str(tmp_path / "f")))
    assert ds.feature_shape == (3, 2, 2)
    np.testing.assert_array_equal(ds.X[0].numpy(), rgb.transpose(2, 0, 1).reshape(-1) / 255.0)
    np.testing.assert_array_equal(ds.X[1].numpy(), np.zeros(12))


def test_image_folder_mixed_sizes_is_an_error(tmp_path):
    _png(tmp_path / "f" / "a" / "x.png", np.zeros((2, 2), dtype=np.uint8))
    _png(tmp_path / "f" / "b" / "y.png", np.zeros((3, 2), dtype=np.uint8))
    with pytest.raises(AuditError, match="same size"):
        load_dataset(DataSpec(data=str(tmp_path / "f")))


# --------------------------------------------------------------------------- torchvision layouts


@pytest.mark.parametrize("gz", [True, False])
def test_idx_test_split_loads_alone(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.uint8)
    write_idx_split(tmp_path, "t10k", images, labels, gz)
    ds = load_dataset(DataSpec("mnist", data_dir=str(tmp_path), split="test"))
    np.testing.assert_array_equal(ds.X.numpy(), images.reshape(7, -1) / 255.0)
    assert ds.y.tolist() == labels.tolist()
    assert ds.feature_shape == (1, 28, 28) and ds.n_classes == 10 and ds.value_range == (0.0, 1.0)
    with pytest.raises(AuditError) as err:
        load_dataset(DataSpec("mnist", data_dir=str(tmp_path), split="train"))
    msg = str(err.value)
    assert str(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte") in msg
    assert "--download" in msg and "--data-dir" in msg and "\n" not in msg


def test_fashion_mnist_uses_its_own_folder(tmp_path):
    images = np.full((2, 28, 28), 255, dtype=np.uint8)
    write_idx_split(tmp_path, "train", images, np.array([0, 9], dtype=np.uint8), gz=True, folder="FashionMNIST")
    ds = load_dataset(DataSpec("fashion_mnist", data_dir=str(tmp_path)))
    assert ds.name == "fashion-mnist" and ds.X.shape == (2, 784) and float(ds.X.min()) == 1.0


def test_idx_corrupt_magic_and_truncation(tmp_path):
    images = np.zeros((2, 28, 28), dtype=np.uint8)
    write_idx_split(tmp_path, "t10k", images, np.array([0, 1], dtype=np.uint8), gz=False)
    img_path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    good = img_path.read_bytes()
    img_path.write_bytes(b"\x12\x34" + good[2:])
    with pytest.raises(AuditError, match="not an IDX file"):
        load_dataset(DataSpec("mnist", data_dir=str(tmp_path), split="test"))
    img_path.write_bytes(good[:-5])
    with pytest.raises(AuditError, match="truncated"):
        load_dataset(DataSpec("mnist", data_dir=str(tmp_path), split="test"))


def test_idx_label_count_mismatch(tmp_path):
    write_idx_split(tmp_path, "t10k", np.zeros((3, 28, 28), np.uint8), np.array([0, 1], np.uint8), gz=True)
    with pytest.raises(AuditError, match="3 images but .* 2 labels"):
        load_dataset(DataSpec("mnist", data_dir=str(tmp_path), split="test"))


def test_cifar_test_batch_loads(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    data = np.random.default_rng(0).integers(0, 256, size=(4, 3072), dtype=np.uint8)
    with open(folder / "test_batch", "wb") as fh:
        pickle.dump({b"data": data, b"labels": [6, 9, 9, 4], b"batch_label": b"testing"}, fh)
    ds = load_dataset(DataSpec("cifar10", data_dir=str(tmp_path), split="test"))
    np.testing.assert_array_equal(ds.X.numpy(), data / 255.0)
    assert ds.y.tolist() == [6, 9, 9, 4] and ds.feature_shape == (3, 32, 32)
    with pytest.raises(AuditError, match="data_batch_1.*--download"):
        load_dataset(DataSpec("cifar10", data_dir=str(tmp_path), split="train"))
    (folder / "test_batch").write_bytes(b"garbage")
    with pytest.raises(AuditError, match="cannot read CIFAR batch"):
        load_dataset(DataSpec("cifar10", data_dir=str(tmp_path), split="test"))


def test_download_goes_through_torchvision_then_reads_files(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    calls = []

    class FakeMNIST:
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            write_idx_split(Path(root), "train", np.ones((1, 28, 28), np.uint8), np.array([5], np.uint8), gz=False)

    monkeypatch.setattr(tvd, "MNIST", FakeMNIST)
    ds = load_dataset(DataSpec("mnist", data_dir=str(tmp_path / "new"), download=True))
    assert calls == [(str(tmp_path / "new"), True, True)]
    assert ds.y.tolist() == [5]

    class Offline:
        def __init__(self, **kwargs):
            raise RuntimeError("no network\nat all")

    monkeypatch.setattr(tvd, "CIFAR10", Offline)
    with pytest.raises(AuditError, match="downloading cifar10 .* failed .*no network at all"):
        load_dataset(DataSpec("cifar10", data_dir=str(tmp_path / "c"), download=True))


def test_missing_files_create_no_directories(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(AuditError, match="--download"):
        load_dataset(DataSpec("mnist", data_dir=str(root)))
    assert not root.exists()


# --------------------------------------------------------------------------- errors


def test_unknown_dataset_lists_choices():
    with pytest.raises(AuditError) as err:
        DataSpec("imagenet")
    assert all(name in str(err.value) for name in DATASETS)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"split": "val"}, "split"),
        ({"preprocess": "whiten"}, "preprocess"),
        ({"n": 0}, "^n must"),
        ({"classes": (1, -2)}, "^classes must"),
        ({"dataset": "synthetic", "synthetic_kappa": 0.5}, "kappa"),
        ({"dataset": "synthetic", "synthetic_d": 4, "synthetic_rank": 5}, "synthetic_rank"),
    ],
)
def test_spec_validation(kwargs, text):
    with pytest.raises(AuditError, match=text):
        DataSpec(**kwargs)


def test_nan_message_counts_and_locates(tmp_path):
    X = np.zeros((8, 4))
    X[5, 2] = np.nan
    X[6, 0] = np.inf
    X[7, 3] = -np.inf
    with pytest.raises(AuditError, match=r"3 non-finite values \(first at row 5, column 2\)"):
        load_dataset(DataSpec(data=npz_file(tmp_path, X)))


def test_unsupported_extension_lists_supported(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"x")
    with pytest.raises(AuditError) as err:
        load_dataset(DataSpec(data=str(tmp_path / "d.parquet")))
    assert ".parquet" in str(err.value) and ".npz" in str(err.value) and ".csv" in str(err.value)


def test_missing_user_path(tmp_path):
    with pytest.raises(AuditError, match="does not exist"):
        load_dataset(DataSpec(data=str(tmp_path / "nope.npz")))


def test_corrupt_user_files(tmp_path):
    for name in ("bad.npz", "bad.npy", "bad.pt", "bad.safetensors"):
        (tmp_path / name).write_bytes(b"\x00 definitely not this format")
        with pytest.raises(AuditError, match="cannot read"):
            load_dataset(DataSpec(data=str(tmp_path / name)))


@pytest.mark.parametrize(
    "y, text",
    [
        (np.array([0, 1, 0]), "4 rows but y has 3 labels"),
        (np.array([0, 1, 0.5, 1]), "integer class labels"),
        (np.array([0, 1, -1, 1]), "non-negative"),
        (np.array(["a", "b", "a", "b"]), "integer class labels"),
    ],
)
def test_bad_labels(tmp_path, y, text):
    with pytest.raises(AuditError, match=text):
        load_dataset(DataSpec(data=npz_file(tmp_path, np.zeros((4, 2)), y)))


def test_empty_data(tmp_path):
    with pytest.raises(AuditError, match="empty"):
        load_dataset(DataSpec(data=npz_file(tmp_path, np.zeros((0, 3)))))
    (tmp_path / "e.csv").write_text("a,b\n")
    with pytest.raises(AuditError, match="empty"):
        load_dataset(DataSpec(data=str(tmp_path / "e.csv")))


def test_class_not_present_and_n_too_large(tmp_path):
    path = npz_file(tmp_path, with_row_ids(10), np.array([0, 0, 1, 1, 1, 3, 3, 3, 3, 3]))
    with pytest.raises(AuditError, match=r"label\(s\) 2 not present.*0, 1, 3"):
        load_dataset(DataSpec(data=path, classes=(1, 2)))
    with pytest.raises(AuditError, match="more than the 10 rows available"):
        load_dataset(DataSpec(data=path, n=11))
    with pytest.raises(AuditError, match="more than the 5 rows available .* classes 0,1"):
        load_dataset(DataSpec(data=path, n=6, classes=(0, 1)))


def test_classes_keep_original_labels_and_full_label_space(tmp_path):
    y = np.array([0, 0, 1, 1, 1, 3, 3, 3, 3, 3])
    ds = load_dataset(DataSpec(data=npz_file(tmp_path, with_row_ids(10), y), classes=(3, 1)))
    assert ds.y.tolist() == [1, 1, 1, 3, 3, 3, 3, 3]
    assert row_ids(ds).tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert ds.n_classes == 4


def test_parse_classes():
    assert parse_classes("0,1,7") == (0, 1, 7)
    assert parse_classes(" 7, 0,0-2 ") == (0, 1, 2, 7)
    assert parse_classes(None) is None and parse_classes("  ") is None
    for junk in ("a,b", "1,,2", "-1", "3-1", "1.5"):
        with pytest.raises(AuditError, match="^classes expects"):
            parse_classes(junk)


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNAUDIT_DATA_DIR", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d"
    monkeypatch.delenv("ATTNAUDIT_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / ".cache" / "attnaudit" / "data"


# --------------------------------------------------------------------------- subsets


def test_subset_is_seeded_and_sorted(tmp_path):
    path = npz_file(tmp_path, with_row_ids(200), np.arange(200) % 3)
    a = load_dataset(DataSpec(data=path, n=30, seed=4))
    b = load_dataset(DataSpec(data=path, n=30, seed=4))
    c = load_dataset(DataSpec(data=path, n=30, seed=5))
    ids = row_ids(a)
    assert len(set(ids)) == 30 and np.all(np.diff(ids) > 0)
    assert ids.tolist() == row_ids(b).tolist() and a.info["indices_sha256"] == b.info["indices_sha256"]
    assert ids.tolist() != row_ids(c).tolist() and a.info["indices_sha256"] != c.info["indices_sha256"]
    assert a.y.tolist() == (ids % 3).tolist()  # labels travel with their rows
    assert a.info["seed"] == 4 and a.info["n"] == 30 and a.info["n_available"] == 200


def test_stratified_subset_keeps_proportions(tmp_path):
    y = np.repeat([0, 1, 2], [60, 30, 10])
    path = npz_file(tmp_path, with_row_ids(100), y)
    ds = load_dataset(DataSpec(data=path, n=20, stratify=True, seed=3))
    assert np.bincount(ds.y.numpy()).tolist() == [12, 6, 2]
    assert np.array_equal(ds.y.numpy(), y[row_ids(ds)])
    # Tiny classes still get one row each when n allows it.
    y2 = np.repeat([0, 1, 2], [97, 2, 1])
    ds2 = load_dataset(DataSpec(data=npz_file(tmp_path, with_row_ids(100), y2, "b.npz"), n=5, stratify=True))
    assert np.bincount(ds2.y.numpy()).tolist() == [3, 1, 1]


def test_holdout_split_is_disjoint_and_stratified(tmp_path):
    y = np.repeat([0, 1], [75, 25])
    ds = load_dataset(DataSpec(data=npz_file(tmp_path, with_row_ids(100), y)))
    train, test = holdout_split(ds, 40, 20, seed=1)
    a, b = row_ids(train), row_ids(test)
    assert len(a) == 40 and len(b) == 20 and not set(a) & set(b)
    assert np.bincount(train.y.numpy()).tolist() == [30, 10]
    assert np.bincount(test.y.numpy()).tolist() == [15, 5]
    assert np.array_equal(train.y.numpy(), y[a]) and np.array_equal(test.y.numpy(), y[b])
    again, _ = holdout_split(ds, 40, 20, seed=1)
    assert np.array_equal(row_ids(again), a)
    with pytest.raises(AuditError, match="only 100"):
        holdout_split(ds, 90, 20, seed=1)


# --------------------------------------------------------------------------- preprocessing


def test_preprocess_against_numpy():
    rng = np.random.default_rng(0)
    Xn = rng.standard_normal((50, 6)) * [1, 10, 0.1, 3, 1, 1] + [5, -2, 0, 1, 0, 0]
    Xn[:, 4] = 0.3  # constant column: not exactly representable mean
    X = torch.from_numpy(Xn.copy())
    c = apply_preprocess(X, "center").numpy()
    np.testing.assert_allclose(c.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(c, Xn - Xn.mean(axis=0), atol=1e-12)
    s = apply_preprocess(X, "standardize").numpy()
    np.testing.assert_allclose(s.mean(axis=0), 0, atol=1e-12)
    keep = [0, 1, 2, 3, 5]
    np.testing.assert_allclose(s[:, keep].std(axis=0), 1, rtol=1e-12)
    assert np.all(s[:, 4] == 0)
    Xz = Xn.copy()
    Xz[7] = 0.0  # a zero row must stay zero
    u = apply_preprocess(torch.from_numpy(Xz), "unit-norm").numpy()
    norms = np.linalg.norm(u, axis=1)
    np.testing.assert_allclose(np.delete(norms, 7), 1, rtol=1e-12)
    assert np.all(u[7] == 0)
    np.testing.assert_array_equal(apply_preprocess(X, "raw").numpy(), Xn)
    np.testing.assert_array_equal(X.numpy(), Xn)  # input untouched
    with pytest.raises(AuditError, match="preprocess"):
        apply_preprocess(X, "bogus")
    assert set(PREPROCESS) == {"raw", "center", "standardize", "unit-norm", "ntk-scale"}  # ntk-scale: issue 14


def test_load_with_preprocess_drops_value_range(tmp_path):
    ds = load_dataset(DataSpec("digits", n=40, preprocess="unit-norm"))
    assert ds.value_range is None
    np.testing.assert_allclose(np.linalg.norm(ds.X.numpy(), axis=1), 1, rtol=1e-12)


# --------------------------------------------------------------------------- synthetic and digits


def test_synthetic_spectrum_is_exact():
    kappa = 1e3
    ds = load_dataset(DataSpec("synthetic", synthetic_n=80, synthetic_d=30, synthetic_kappa=kappa, seed=7))
    s = np.linalg.svd(ds.X.numpy(), compute_uv=False)
    expected = np.logspace(0, -3, 30)
    np.testing.assert_allclose(ds.singular_values, expected, rtol=1e-13)
    np.testing.assert_allclose(s, expected, rtol=1e-10)
    assert s[0] / s[-1] == pytest.approx(kappa, rel=1e-10)
    assert ds.X.shape == (80, 30) and ds.value_range is None and ds.n_classes == 4
    assert set(ds.y.tolist()) <= {0, 1, 2, 3} and len(set(ds.y.tolist())) > 1
    again = load_dataset(DataSpec("synthetic", synthetic_n=80, synthetic_d=30, synthetic_kappa=kappa, seed=7))
    assert torch.equal(ds.X, again.X)


def test_synthetic_rank_and_n_sets_rows():
    ds = load_dataset(DataSpec("synthetic", n=40, synthetic_d=25, synthetic_rank=7, synthetic_kappa=100.0))
    assert ds.X.shape == (40, 25)
    assert np.linalg.matrix_rank(ds.X.numpy()) == 7
    s = np.linalg.svd(ds.X.numpy(), compute_uv=False)
    np.testing.assert_allclose(s[:7], np.logspace(0, -2, 7), rtol=1e-10)
    test_spec = DataSpec("synthetic", n=40, synthetic_d=25, synthetic_rank=7, synthetic_kappa=100.0, split="test")
    test = load_dataset(test_spec)
    assert not torch.equal(ds.X, test.X)
    centered = load_dataset(DataSpec("synthetic", n=40, synthetic_d=25, preprocess="center"))
    assert centered.singular_values is None  # no longer the prescribed spectrum


def test_digits_splits_partition_the_bundled_set():
    from sklearn.datasets import load_digits

    train = load_dataset(DataSpec("digits", split="train"))
    test = load_dataset(DataSpec("digits", split="test"))
    assert train.X.shape[1] == 64 and train.n + test.n == 1797 and train.feature_shape == (8, 8)
    both = torch.cat([train.X, test.X]).numpy()
    assert both.min() == 0.0 and both.max() == 1.0
    # Same multiset of rows as sklearn's data / 16 (sort rows lexicographically to compare).
    ref = load_digits().data / 16.0
    np.testing.assert_array_equal(both[np.lexsort(both.T[::-1])], ref[np.lexsort(ref.T[::-1])])


def test_digits_read_from_the_bundled_file_are_what_load_digits_gives(monkeypatch):
    import importlib.util

    from sklearn.datasets import load_digits

    from attnaudit.data.builtin import digits_arrays

    reference = load_digits()
    images, labels = digits_arrays()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)
    assert labels.dtype == np.int64
    # without the file where it was, the same arrays through load_digits
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    again, again_labels = digits_arrays()
    np.testing.assert_array_equal(again, reference.images)
    np.testing.assert_array_equal(again_labels, reference.target)


# --------------------------------------------------------------------------- real MNIST


@pytest.mark.skipif(not REAL_MNIST.exists(), reason="real MNIST test split not present at ../shared/data")
def test_real_mnist_test_split():
    ds = load_dataset(DataSpec("mnist", data_dir=str(REAL_DATA), split="test"))
    assert ds.X.shape == (10000, 784) and ds.feature_shape == (1, 28, 28)
    assert ds.y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert np.bincount(ds.y.numpy()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert round(float(ds.X.mean()), 5) == 0.13251
    assert round(float(ds.X.std(correction=0)), 5) == 0.31048
    with pytest.raises(AuditError, match="train split not found.*pass --split test.*--download"):
        load_dataset(DataSpec("mnist", data_dir=str(REAL_DATA), split="train"))


# --------------------------------------------------------------------------- issue 8: hostile files, absurd values


def py2_string(raw: bytes) -> bytes:
    """A Python 2 ``str`` as pickle protocol 2 writes it: SHORT_BINSTRING or BINSTRING."""
    if len(raw) < 256:
        return b"U" + bytes([len(raw)]) + raw
    return b"T" + struct.pack("<i", len(raw)) + raw


def py2_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    return b"J" + struct.pack("<i", value)


def py2_cifar_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A CIFAR-10 batch laid out opcode by opcode as Python 2 + numpy pickled the official files.

    numpy's ndarray.__reduce__: _reconstruct(ndarray, (0,), 'b'), then BUILD with
    (1, shape, dtype('u1', 0, 1) + its BUILD state, is_fortran=False, raw bytes).
    """
    n, d = data.shape
    dtype = (
        b"cnumpy\ndtype\n"
        + py2_string(b"u1")
        + py2_int(0)
        + py2_int(1)
        + b"\x87R"
        + b"("
        + py2_int(3)
        + py2_string(b"|")
        + b"NNN"
        + b"J\xff\xff\xff\xff" * 2
        + py2_int(0)
        + b"tb"
    )
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\n"
        + b"cnumpy\nndarray\n"
        + py2_int(0)
        + b"\x85"
        + py2_string(b"b")
        + b"\x87R"
        + b"("
        + py2_int(1)
        + py2_int(n)
        + py2_int(d)
        + b"\x86"
        + dtype
        + b"\x89"
        + py2_string(data.tobytes())
        + b"tb"
    )
    label_list = b"](" + b"".join(py2_int(v) for v in labels) + b"e"
    return (
        b"\x80\x02}("
        + py2_string(b"batch_label")
        + py2_string(b"testing batch 1 of 1")
        + py2_string(b"labels")
        + label_list
        + py2_string(b"data")
        + array
        + py2_string(b"filenames")
        + b"]("
        + b"".join(py2_string(b"f%d.png" % i) for i in range(n))
        + b"e"
        + b"u."
    )


def write_cifar_test_batch(root: Path, raw: bytes) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(exist_ok=True)
    (folder / "test_batch").write_bytes(raw)


def load_cifar_test(root: Path) -> Dataset:
    return load_dataset(DataSpec("cifar10", data_dir=str(root), split="test"))


class _Payload:
    """Unpickling this calls ``func(*args)``: what a crafted pickle does."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _hostile_payloads(marker: Path) -> dict[str, object]:
    return {
        "os.system": _Payload(os.system, (f"touch {marker}",)),
        "open": _Payload(open, (str(marker), "w")),
        "subprocess": _Payload(subprocess.call, (["touch", str(marker)],)),
        "eval": _Payload(eval, (f"open({str(marker)!r}, 'w')",)),
        "getattr": _Payload(getattr, ("text", "upper")),
        "numpy.load": _Payload(np.load, (str(marker),)),
    }


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("kind", ["os.system", "open", "subprocess", "eval", "getattr", "numpy.load"])
def test_hostile_cifar_batch_is_refused_without_running_code(tmp_path, protocol, kind):
    marker = tmp_path / "marker"
    payload = _hostile_payloads(marker)[kind]
    data = np.zeros((1, 3072), np.uint8)
    write_cifar_test_batch(tmp_path, pickle.dumps({b"data": data, b"labels": [1], b"x": payload}, protocol=protocol))
    with pytest.raises(AuditError) as err:
        load_cifar_test(tmp_path)
    message = str(err.value)
    assert message.startswith("refused: the CIFAR batch") and "asks to load" in message
    assert "fetch the data again" in message and "\n" not in message
    assert not marker.exists()


def test_hostile_cifar_batch_names_the_global_it_asked_for(tmp_path):
    marker = tmp_path / "marker"
    write_cifar_test_batch(tmp_path, pickle.dumps(_Payload(os.system, (f"touch {marker}",)), protocol=2))
    with pytest.raises(AuditError, match=r"asks to load (posix|nt|os)\.system, which a genuine CIFAR-10 batch"):
        load_cifar_test(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 3, 4, 5])
def test_genuine_format_cifar_batch_still_loads(tmp_path, protocol):
    data = np.random.default_rng(3).integers(0, 256, size=(3, 3072), dtype=np.uint8)
    batch = {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": [0, 9, 4],
        b"data": data,
        b"filenames": [b"a.png", b"b.png", b"c.png"],
    }
    write_cifar_test_batch(tmp_path, pickle.dumps(batch, protocol=protocol))
    ds = load_cifar_test(tmp_path)
    np.testing.assert_array_equal(ds.X.numpy(), data.astype(np.float64) / 255.0)
    assert ds.y.tolist() == [0, 9, 4]


def test_python2_cifar_batch_loads(tmp_path):
    data = np.random.default_rng(4).integers(0, 256, size=(2, 3072), dtype=np.uint8)
    write_cifar_test_batch(tmp_path, py2_cifar_batch(data, [3, 8]))
    ds = load_cifar_test(tmp_path)
    np.testing.assert_array_equal(ds.X.numpy(), data.astype(np.float64) / 255.0)
    assert ds.y.tolist() == [3, 8] and ds.feature_shape == (3, 32, 32)
    # pixel 0 of image 1 is byte 3072 of the data: channel-major layout kept
    assert ds.X[1, 0].item() == data[1, 0] / 255.0


@pytest.mark.parametrize("protocol", [2, 4])
def test_object_and_structured_arrays_in_a_cifar_batch_are_refused(tmp_path, protocol):
    data = np.zeros((1, 3072), np.uint8)
    for extra in (np.array([1, "two", None], dtype=object), np.zeros(2, dtype=[("f", "O")])):
        write_cifar_test_batch(tmp_path, pickle.dumps({b"data": data, b"labels": [1], b"x": extra}, protocol=protocol))
        with pytest.raises(AuditError, match="refused: the CIFAR batch .*dtype"):
            load_cifar_test(tmp_path)
    objects = np.empty((1, 3072), dtype=object)
    objects[:] = 0
    write_cifar_test_batch(tmp_path, pickle.dumps({b"data": objects, b"labels": [1]}, protocol=protocol))
    with pytest.raises(AuditError, match="refused"):
        load_cifar_test(tmp_path)


def test_non_uint8_cifar_data_is_refused(tmp_path):
    for data in (np.zeros((1, 3072), np.float64), np.zeros((1, 3072), np.int64), np.zeros((1, 100), np.uint8)):
        write_cifar_test_batch(tmp_path, pickle.dumps({b"data": data, b"labels": [1]}, protocol=2))
        with pytest.raises(AuditError, match=r"expected uint8 data of shape \(k, 3072\)"):
            load_cifar_test(tmp_path)
    write_cifar_test_batch(tmp_path, pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10**30]}))
    with pytest.raises(AuditError, match="labels"):
        load_cifar_test(tmp_path)
    write_cifar_test_batch(tmp_path, pickle.dumps([1, 2, 3]))
    with pytest.raises(AuditError, match="not a CIFAR-10 batch"):
        load_cifar_test(tmp_path)


def test_data_module_never_calls_plain_unpickling():
    import attnaudit.data as data_module

    files = sorted(Path(data_module.__file__).parent.glob("*.py"))  # the attnaudit.data package
    assert len(files) > 1
    for path in files:
        source = path.read_text()
        assert "pickle.load(" not in source and "pickle.loads(" not in source, path
        assert "trusted" not in source, path


def _evil_pth_files(tmp_path: Path, marker: Path) -> dict[str, Path]:
    files = {}
    legacy = tmp_path / "legacy.pth"
    legacy.write_bytes(pickle.dumps(_Payload(os.system, (f"touch {marker}",)), protocol=4))
    files["legacy pickle"] = legacy
    noise = tmp_path / "noise.pth"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes())
    files["random bytes"] = noise
    good = tmp_path / "good.pth"
    torch.save({"X": torch.zeros(3, 2)}, good)
    evil_zip = tmp_path / "evilzip.pth"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(evil_zip, "w") as dst:
        for name in src.namelist():
            body = src.read(name)
            if name.endswith("data.pkl"):
                body = pickle.dumps(_Payload(os.system, (f"touch {marker}",)), protocol=2)
            dst.writestr(name, body)
    files["zip with hostile data.pkl"] = evil_zip
    return files


def test_hostile_pth_files_give_one_quiet_line(tmp_path):
    marker = tmp_path / "marker"
    for what, path in _evil_pth_files(tmp_path, marker).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(AuditError) as err:
                load_dataset(DataSpec(data=str(path)))
        message = str(err.value)
        assert caught == [], (what, [str(w.message) for w in caught])
        assert "\n" not in message and len(message) < 400, (what, message)
        assert message.startswith(f"cannot read {path}") and "weights_only=True" in message
        # torch's advice to retry with weights_only=False would run the file's code
        assert "set to `False`" not in message and "will likely succeed" not in message
    assert not marker.exists()


def test_seed_range():
    assert MAX_SEED == 4294967295
    for bad in (-1, 2**70, MAX_SEED + 1, 1.5, "3", True):
        with pytest.raises(AuditError, match=r"--seed must be an integer in 0\.\.4294967295, got"):
            DataSpec(seed=bad)
    assert DataSpec(seed=0).seed == 0 and DataSpec(seed=MAX_SEED).seed == 4294967295
    check_seed(4294967293, count=3)
    with pytest.raises(AuditError, match=r"^--seeds-first must be an integer in 0\.\.4294967292, got 4294967293$"):
        check_seed(4294967293, option="--seeds-first", count=4)
    with pytest.raises(AuditError, match="-1"):
        check_seed(-1)
    # ints beyond 4300 digits cannot even be printed by Python: still one short AuditError
    for bad in (10**5000, -(10**5000)):
        with pytest.raises(AuditError, match="--seed must be an integer") as err:
            check_seed(bad)
        assert len(str(err.value)) < 120
    with pytest.raises(AuditError, match="^classes names label"):
        DataSpec(classes=(10**5000,))


def test_extreme_seeds_load_and_split(tmp_path):
    path = npz_file(tmp_path, with_row_ids(30), np.arange(30) % 3)
    ds = load_dataset(DataSpec(data=path, n=10, seed=MAX_SEED))
    assert ds.n == 10 and ds.info["seed"] == 4294967295
    train, test = holdout_split(ds, 4, 3, seed=MAX_SEED)
    assert train.n == 4 and test.n == 3
    for bad in (-1, 2**70):
        with pytest.raises(AuditError, match="seed"):
            holdout_split(ds, 4, 3, seed=bad)


@pytest.mark.parametrize(
    "y, shown",
    [
        (np.array([0, 1, 1e12, 1]), "1000000000000"),
        (np.array([0, 1, 10**12, 1], dtype=np.int64), "1000000000000"),
        (np.array([0, 1, 2**63 + 5, 1], dtype=np.uint64), "9223372036854775813"),
        (np.array([0, 1, 1e30, 1]), "1000000000000000019884624838656"),
        (np.array([0, 1, 100000, 1]), "100000"),
    ],
)
def test_absurd_labels_refused(tmp_path, y, shown):
    with pytest.raises(AuditError) as err:
        load_dataset(DataSpec(data=npz_file(tmp_path, np.zeros((4, 2)), y)))
    message = str(err.value)
    assert "K <= 100000" in message and f"found label {shown} at row 2" in message and "remap" in message


def test_largest_allowed_label_and_csv_label_cap(tmp_path):
    ds = load_dataset(DataSpec(data=npz_file(tmp_path, np.zeros((3, 2)), np.array([0, 99999, 5]))))
    assert ds.n_classes == 100000 and MAX_CLASSES == 100000
    (tmp_path / "big.csv").write_text("a,label\n0.5,0\n0.25,1000000000000\n")
    with pytest.raises(AuditError, match="found label 1000000000000 at row 1"):
        load_dataset(DataSpec(data=str(tmp_path / "big.csv")))


def test_huge_class_ranges_and_long_text_give_short_messages():
    for text in ("0-1000000", "5-99999999999999999999", "0-100000", "100000", "0," * 5000 + "x", "9" * 6000):
        with pytest.raises(AuditError, match="^classes ") as err:
            parse_classes(text)
        assert len(str(err.value)) < 300, (text[:20], len(str(err.value)))
    assert parse_classes("0-99999") == tuple(range(100000))
    with pytest.raises(AuditError, match="^classes names label"):
        DataSpec(classes=(1, 10**30))


def test_label_lists_in_messages_are_capped(tmp_path):
    y = np.arange(50)
    path = npz_file(tmp_path, np.zeros((50, 2)), y)
    with pytest.raises(AuditError) as err:
        load_dataset(DataSpec(data=path, classes=tuple(range(60, 90))))
    message = str(err.value)
    assert "label(s) 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, \u2026 (20 more) not present" in message
    assert "labels present: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, \u2026 (40 more)" in message
    assert len(message) < 300


def test_short_list_and_clip():
    assert short_list([1, 2, 3]) == "1, 2, 3"
    assert short_list(range(10)) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9"
    assert short_list(range(12)) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, \u2026 (2 more)"
    assert short_list(range(4), limit=2, sep=",") == "0,1,\u2026 (2 more)"
    assert clip_text("abc", 80) == "abc" and clip_text("x" * 80, 80) == "x" * 80
    assert clip_text("x" * 81, 80) == "x" * 79 + "\u2026" and len(clip_text("y" * 10**6, 80)) == 80


def test_long_user_text_is_clipped_in_spec_errors():
    for kwargs in ({"dataset": "z" * 10**5}, {"split": "z" * 10**5}, {"preprocess": "z" * 10**5}):
        with pytest.raises(AuditError) as err:
            DataSpec(**kwargs)
        assert len(str(err.value)) < 300


def test_ntk_scale_preprocess_against_numpy():
    """ntk-scale: one global scalar s = sqrt(d / mean ||x||^2); mean ||x||^2 becomes d, directions unchanged."""
    rng = np.random.default_rng(3)
    Xn = rng.uniform(0, 1, size=(50, 12))
    out = apply_preprocess(torch.from_numpy(Xn), "ntk-scale").numpy()
    s = np.sqrt(12 / np.mean(np.sum(Xn**2, axis=1)))
    np.testing.assert_allclose(out, s * Xn, rtol=1e-14)
    assert np.mean(np.sum(out**2, axis=1)) == pytest.approx(12, rel=1e-13)
    zeros = apply_preprocess(torch.zeros(3, 4, dtype=torch.float64), "ntk-scale")
    assert torch.equal(zeros, torch.zeros(3, 4, dtype=torch.float64))  # all-zero data stay zero (no 0/0)
