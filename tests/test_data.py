"""Tests for attnaudit.data against independently built ground truth.

Fabricated files are written byte by byte here (IDX headers, CIFAR pickles, PNGs), so the
reader is checked against the format definitions rather than against itself.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from attnaudit.data import (
    DATASETS,
    PREPROCESS,
    DataSpec,
    Dataset,
    apply_preprocess,
    default_data_dir,
    holdout_split,
    load_dataset,
    parse_classes,
)
from attnaudit.errors import AuditError

REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
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
        ({"n": 0}, "--n"),
        ({"classes": (1, -2)}, "--classes"),
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
        with pytest.raises(AuditError, match="--classes"):
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
    assert set(PREPROCESS) == {"raw", "center", "standardize", "unit-norm"}


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
