"""File readers: IDX, CIFAR-10 python batches (restricted unpickler), and user files
(.npz, .npy, .safetensors, .pt/.pth, .csv, image folders), with the checks every array
read from disk goes through."""

from __future__ import annotations

import csv
import gzip
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnaudit.data.spec import MAX_CLASSES, Source
from attnaudit.errors import AuditError, FieldError, clip_text, is_int, literal, one_line, short_list, show_value

USER_SUFFIXES = (".npz", ".npy", ".safetensors", ".pt", ".pth", ".csv")
MAX_IMAGE_PIXELS = 1 << 24  # per image (4096 x 4096): audits flatten images into rows of features
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")
X_NAMES = ("X", "x", "data", "features", "images")
Y_NAMES = ("y", "Y", "labels", "label", "targets", "target")
CSV_LABEL_COLUMNS = ("label", "labels", "y", "target", "targets", "class")

# IDX type codes -> big-endian numpy dtypes (http://yann.lecun.com/exdb/mnist/ format).
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# --------------------------------------------------------------------------- validation


def check_labels(y: Any, n_rows: int, where: str) -> np.ndarray:
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
                f"{where}: labels y must be integer class labels; found {show_value(y[first].item(), 80)} at row "
                f"{first}; convert labels to 0..K-1 integers"
            )
    elif not np.issubdtype(y.dtype, np.integer):
        raise AuditError(
            f"{where}: labels y must be integer class labels, got dtype {clip_text(str(y.dtype), 80)}; convert them to 0..K-1"
        )
    # Range checks on the original dtype: casting 1e30 or a uint64 above 2**63 to int64 would wrap.
    if len(y) and y.min() < 0:
        first = int(np.flatnonzero(y < 0)[0])
        raise AuditError(
            f"{where}: labels must be non-negative class indices 0..K-1; found {clip_text(int(y[first]), 80)} at row {first}"
        )
    if len(y) and y.max() >= MAX_CLASSES:
        first = int(np.flatnonzero(y >= MAX_CLASSES)[0])
        raise AuditError(
            f"{where}: labels must be class indices 0..K-1 with K <= {MAX_CLASSES}; found label "
            f"{clip_text(int(y[first]), 80)} at row {first}; remap labels to 0..K-1"
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


# --------------------------------------------------------------------------- IDX


def _open_maybe_gzip(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise AuditError(
            f"cannot read {path} ({one_line(exc)}); the file is corrupt or truncated, delete it and fetch it again"
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


# --------------------------------------------------------------------------- CIFAR-10 python batches


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
            f"refused: the CIFAR batch {self._path} asks to load {clip_text(what, 80)}, which a genuine CIFAR-10 batch "
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
            raise self._refuse(f"numpy.dtype({show_value(text, 40)})")
        return text

    def _dtype(self, spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
        # A fresh dtype object (copy=True), so the BUILD that follows cannot touch numpy's singletons.
        return np.dtype(self._checked_dtype(spec), False, True)

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if subtype is not _NdarrayToken:
            raise self._refuse(f"numpy _reconstruct of {show_value(subtype, 40)}")
        dims = shape if isinstance(shape, tuple) else (shape,)
        if not all(is_int(k) and k >= 0 for k in dims) or int(np.prod(dims, dtype=object)) > _MAX_PLACEHOLDER:
            raise self._refuse(f"numpy _reconstruct of shape {show_value(shape, 40)}")
        return _numpy_function("multiarray", "_reconstruct")(np.ndarray, dims, self._checked_dtype(dtype))

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
        if not isinstance(buf, (bytes, bytearray, pickle.PickleBuffer)):
            raise self._refuse(f"numpy _frombuffer of {type(buf).__name__}")
        dtype = np.dtype(self._checked_dtype(dtype))
        return _numpy_function("numeric", "_frombuffer")(buf, dtype, shape, order)

    def _latin1_encode(self, text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise self._refuse(f"_codecs.encode with {show_value(encoding, 30)}")
        return text.encode("latin-1")


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images (k, 3072) uint8, labels (k,) int64) of one CIFAR-10 python batch, read with the
    restricted unpickler (a batch that asks for anything else is refused)."""
    try:
        with open(path, "rb") as fh:
            batch = _RestrictedUnpickler(fh, path, encoding="bytes").load()
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - unpickling can fail in many ways
        raise AuditError(
            f"cannot read CIFAR batch {path} ({clip_text(one_line(exc), 200)}); the file is corrupt, "
            "delete it and fetch it again"
        ) from None
    if isinstance(batch, dict):
        # Genuine batches (pickled by Python 2) have bytes keys; accept str keys as well.
        batch = {k.encode("latin-1") if isinstance(k, str) else k: v for k, v in batch.items()}
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = short_list(sorted(map(repr, batch))) if isinstance(batch, dict) else type(batch).__name__
        raise AuditError(
            f"{path} is not a CIFAR-10 batch (expected keys b'data' and b'labels', found {clip_text(keys, 200)}); "
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
        is_int(v) for v in (labels.tolist() if isinstance(labels, np.ndarray) else labels)
    ):
        raise AuditError(
            f"{path}: b'labels' must be a list of integer labels, got {clip_text(type(labels).__name__, 80)}; "
            "the file is corrupt, delete it and fetch it again"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise AuditError(
            f"{path}: b'labels' holds a label outside int64; the file is corrupt, fetch it again"
        ) from None
    if (
        type(data) is not np.ndarray
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
        or len(labels) != len(data)
    ):
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise AuditError(
            f"{path}: expected uint8 data of shape (k, 3072) and k labels, got data {clip_text(what, 80)} "
            f"and {len(labels)} labels; the file is corrupt, fetch it again"
        )
    return data, labels


# --------------------------------------------------------------------------- user files


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
        raise AuditError(f"{where}: cannot turn {type(value).__name__} into an array ({one_line(exc)})") from None


# deflate cannot shrink data more than 1032:1, so a zip member that claims to unpack to more
# than this many times its compressed size lies about it.
_MAX_DEFLATE_RATIO = 1100


def _npy_header(fh: Any, where: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and payload bytes a .npy header states (read from ``fh``, left after it)."""
    from numpy.lib import format as npformat

    try:
        version = npformat.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = npformat.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = npformat.read_array_header_2_0(fh)
        else:  # 3.0 (utf-8 field names) has no public reader
            shape, _, dtype = npformat._read_array_header(fh, version)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - ValueError, EOFError, SyntaxError ...
        raise AuditError(
            f"cannot read {where} as .npy ({clip_text(one_line(exc), 200)}); save it with numpy.save"
        ) from None
    count = int(np.prod(shape, dtype=object)) if shape else 1
    return tuple(shape), dtype, count * dtype.itemsize


def _check_npy_size(shape: tuple, dtype: np.dtype, declared: int, available: int, where: str) -> None:
    """Refuse, before numpy allocates from it, a header that promises more data than the file holds."""
    if dtype.hasobject:
        return  # a pickle: np.load(allow_pickle=False) refuses it without allocating
    if declared != available:
        raise AuditError(
            f"{where}: the .npy header promises shape {clip_text(shape, 60)} of {dtype} ({clip_text(declared, 40)} bytes) but "
            f"the file holds {available} bytes of data; the file is truncated or corrupt, save it again with numpy.save"
        )


def _check_npz_members(path: Path) -> None:
    """Every member's .npy header against the member's size, and each member's size against
    its compressed size, before numpy allocates anything from either."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                where = f"{path} (member {clip_text(info.filename, 60)})"
                limit = (
                    info.compress_size
                    if info.compress_type == zipfile.ZIP_STORED
                    else (info.compress_size * _MAX_DEFLATE_RATIO + 1024)
                )
                if info.file_size > limit:
                    raise AuditError(
                        f"{where}: the zip directory says it unpacks to {info.file_size} bytes from "
                        f"{info.compress_size}, more than compression allows; the file is corrupt, save it again"
                    )
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as fh:
                    shape, dtype, declared = _npy_header(fh, where)
                    header_bytes = fh.tell()
                _check_npy_size(shape, dtype, declared, info.file_size - header_bytes, where)
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile raises BadZipFile, OSError, ValueError, EOFError ...
        raise AuditError(
            f"cannot read {path} as .npz ({clip_text(one_line(exc), 200)}); save it with numpy.savez(X=..., y=...)"
        ) from None


def _read_npz(path: Path) -> tuple[Any, Any]:
    _check_npz_members(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except Exception as exc:  # noqa: BLE001 - zip/format/pickle errors
        raise AuditError(
            f"cannot read {path} as .npz ({one_line(exc)}); save it with numpy.savez(X=..., y=...)"
        ) from None
    return _pick(arrays, str(path))


def _read_npy(path: Path) -> tuple[Any, Any]:
    # np.load treats a file without the .npy magic as a pickle; check first so garbage
    # is reported as garbage rather than as "holds a Python object".
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
            if magic == b"\x93NUMPY":
                fh.seek(0)
                shape, dtype, declared = _npy_header(fh, str(path))
                available = os.fstat(fh.fileno()).st_size - fh.tell()
    except OSError as exc:
        raise AuditError(f"cannot read {path} ({one_line(exc)})") from None
    if magic != b"\x93NUMPY":
        raise AuditError(f"cannot read {path} as .npy (no .npy header); save it with numpy.save")
    _check_npy_size(shape, dtype, declared, available, str(path))
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise AuditError(
                f"{path} holds a Python object (e.g. a dict), not a numeric array; save a plain array, "
                "or use .npz with arrays X and y"
            ) from None
        raise AuditError(f"cannot read {path} as .npy ({one_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read {path} as .npy ({one_line(exc)})") from None
    return arr, None


def _read_safetensors(path: Path) -> tuple[Any, Any]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read {path} as .safetensors ({one_line(exc)})") from None
    return _pick(tensors, str(path))


# torch's weights-only refusal wraps the one useful line in advice to retry with
# unrestricted loading (which would run the file's code); keep only the useful line.
_TORCH_BOILERPLATE = ("weights only load failed", "please file an issue", "check the documentation")


def _torch_load_reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.lower().startswith(_TORCH_BOILERPLATE)]
    if kept and kept[0].startswith("WeightsUnpickler error:"):
        kept[0] = kept[0][len("WeightsUnpickler error:") :].strip()
    text = " ".join(line for line in kept if line)
    return clip_text(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, 200)


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
    raise AuditError(f"{path} holds a {type(obj).__name__}; expected a tensor, an (X, y) tuple, or a dict with X and y")


def _read_csv(path: Path) -> tuple[Any, Any]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            header = next(csv.reader(fh), None)
    except UnicodeDecodeError:
        raise AuditError(f"{path}: {_bad_utf8_line(path)} is not valid UTF-8 text; save the file as UTF-8") from None
    except OSError as exc:
        raise AuditError(f"cannot read {path} as .csv ({one_line(exc)})") from None
    if not header:
        raise AuditError(f"{path}: the CSV file is empty; it needs a header row and one row per sample")
    names = [h.strip() for h in header]
    label_cols = [i for i, h in enumerate(names) if h.lower() in CSV_LABEL_COLUMNS]
    if len(label_cols) > 1:
        raise AuditError(f"{path}: several label columns ({', '.join(names[i] for i in label_cols)}); keep one of them")
    try:
        # numpy's C parser is fast on large files; the slow loop below only runs to find the bad cell.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "no data": reported below as an AuditError
            table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2, encoding="utf-8-sig")
    except ValueError:
        try:
            table = _csv_slow(path, names)
        except UnicodeDecodeError:
            raise AuditError(
                f"{path}: {_bad_utf8_line(path)} is not valid UTF-8 text; save the file as UTF-8"
            ) from None
    if table.size == 0:
        raise AuditError(f"{path}: the data is empty (0 samples below the header)")
    if table.shape[1] != len(names):
        raise AuditError(f"{path}: the header has {len(names)} columns but the rows have {table.shape[1]}")
    if label_cols:
        j = label_cols[0]
        return np.delete(table, j, axis=1), table[:, j]
    return table, None


NEWLINE = b"\n"


def _bad_utf8_line(path: Path) -> str:
    """'line N' of the first byte that is not UTF-8 (for the message)."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return f"line {raw.count(NEWLINE, 0, exc.start) + 1}"
    return "a line"


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


def _inside(entry: Path, root: Path) -> Path:
    """``entry`` itself, or, for a symbolic link, refused unless it resolves to an existing
    file or folder inside ``root`` (the image folder, resolved): a link never leads out."""
    if not entry.is_symlink():
        return entry
    try:
        target = entry.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling link, or a loop of links
        raise AuditError(
            f"{entry}: symbolic link to {clip_text(os.readlink(entry) if entry.is_symlink() else '?', 120)}, which does "
            "not exist; remove the link or copy the image in"
        ) from None
    if not target.is_relative_to(root):
        raise AuditError(
            f"{entry}: symbolic link to {clip_text(target, 120)}, outside the image folder {root}; links are followed "
            "only within the folder: copy the file in or remove the link"
        )
    return entry


def _read_image_folder(path: Path) -> Source:
    from PIL import Image

    root = path.resolve()
    entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    class_dirs = [p for p in entries if _inside(p, root).is_dir()]
    if not class_dirs:
        raise AuditError(
            f"{path}: image folder has no class sub-folders; put each class's images in its own sub-folder"
        )
    files: list[tuple[Path, int]] = []
    for label, folder in enumerate(class_dirs):
        images = sorted(
            f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and _inside(f, root).is_file()
        )
        if not images:
            raise AuditError(
                f"{folder}: class folder holds no images ({', '.join(IMAGE_SUFFIXES)}); add images or remove the folder"
            )
        files.extend((f, label) for f in images)

    gray_modes = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
    size = None
    all_gray = True
    # First pass reads headers only (PIL opens lazily) to fix the mode and size. A header may
    # lie about the size; nothing is allocated from it: each image is decoded on its own in
    # the second pass (a lying one fails there), and X is assembled from decoded images only.
    for f, _ in files:
        try:
            with Image.open(f) as img:
                mode, this_size = img.mode, img.size
        except Exception as exc:  # noqa: BLE001 - PIL's decoders raise OSError, ValueError, SyntaxError ...
            raise AuditError(f"cannot read image {f} ({clip_text(one_line(exc), 200)}); remove or replace it") from None
        if this_size[0] * this_size[1] > MAX_IMAGE_PIXELS:
            raise AuditError(
                f"image {f} is {this_size[0]}x{this_size[1]} pixels, more than the {MAX_IMAGE_PIXELS:,} an image "
                "may hold (its header may lie); resize it"
            )
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
    decoded = []
    for f, _ in files:
        try:
            with Image.open(f) as img:
                pixels = np.asarray(img.convert(mode))
        except Exception as exc:  # noqa: BLE001 - as above
            raise AuditError(f"cannot read image {f} ({clip_text(one_line(exc), 200)}); remove or replace it") from None
        if pixels.shape[:2] != (height, width):  # the file changed between the passes
            raise AuditError(f"image {f} changed while it was read; read the folder again")
        decoded.append(pixels[None] if channels == 1 else pixels.transpose(2, 0, 1))
    X = np.stack(decoded)
    del decoded
    return Source(
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


def load_user(path_text: str) -> Source:
    """A user's file (.npz, .npy, .safetensors, .pt/.pth, .csv) or image folder (field ``data``)
    as a :class:`Source`, every array checked."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise FieldError("data", "{name} " + literal(path) + " does not exist; check the path")
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
    y = check_labels(_to_numpy(y_raw, where), len(X), where) if y_raw is not None else None
    return Source(
        X=X,
        y=y,
        name=path.name,
        n_classes=int(y.max()) + 1 if y is not None else 0,
        scale=None,
        value_range=None,
        info={"source": str(path), "format": suffix.lstrip(".")},
    )
