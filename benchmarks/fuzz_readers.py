"""Property-based fuzzing of every attnaudit reader (issue 28, item 1).

Each reader has a hypothesis strategy that draws a *case*: the bytes of the files it reads
(written under a fresh folder) and, for a valid case, the content those files must load to
(arrays, labels, vocabularies, tensors, plan fields: what the generator put there, never the
reader's own formula). Hostile cases are valid files mutated (truncation at a point of every
region, flipped bytes, overwritten or inserted junk) or built to lie (headers that promise
1e12 elements or another dtype, NaN/Inf, labels out of range, empty and one-row sets, deep or
recursive YAML anchors, over-long lines, invalid UTF-8, absurd sizes).

The invariant, checked by :func:`run_case`: the files load to exactly the generated content
(hostile files that still load must give data that keeps the data contract: finite features,
labels in 0..n_classes-1), or the reader raises :class:`attnaudit.errors.AuditError` whose
message is one line naming the file (its path, which holds the case folder). Any other
exception, a hang over 10 s or more than 2 GiB of memory is a failure.

Deep run (this script)::

    python benchmarks/fuzz_readers.py --cases 5000 --keep fuzz-failures [--readers npy,csv] [--jobs 2]

prints ``FUZZ reader=<name> cases=<n> failures=<k>`` per reader and keeps the first failing
case of each reader under ``--keep DIR/<reader>/`` (its files plus ``case.txt``).

Isolation: cases are generated in this process (hypothesis, generate phase only, a fixed
seed per reader) and run in ``--jobs`` worker processes (spawned; each imports attnaudit
once). A worker gets a hard address-space limit (``RLIMIT_AS``) of its size after warm-up
plus 2 GiB, so an allocation a lying header provokes fails inside the case (a MemoryError,
recorded as a failure) instead of taking the machine down; the parent gives each case
10 s and kills and replaces a worker that overruns (a hang, recorded as a failure). A
subprocess per case would be exact but costs a torch import (~3 s) per case; a persistent
worker with these two limits keeps 5,000 cases per reader within minutes.

The fast profile of the same strategies runs in the default test suite
(``tests/data/test_fuzz_readers.py``).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import pickle
import struct
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

CASE_TIMEOUT_S = 10.0
MEMORY_LIMIT = 2 << 30


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    """Files to write (relative path -> bytes), what they must load to (None: hostile),
    symbolic links (relative path -> target, relative to the case folder or absolute)."""

    reader: str
    files: dict[str, bytes]
    expect: Any = None
    note: str = "valid"
    links: dict[str, str] = field(default_factory=dict)
    must_refuse: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    grow: dict[str, int] = field(default_factory=dict)  # relative path -> size: extended sparsely (zeros)

    def describe(self) -> str:
        sizes = ", ".join(f"{k} ({len(v)} bytes)" for k, v in self.files.items())
        links = ", ".join(f"{k} -> {v}" for k, v in self.links.items())
        return f"reader={self.reader} note={self.note} files: {sizes}" + (f" links: {links}" if links else "")


@dataclass
class Outcome:
    status: str  # loaded | refused | fail
    detail: str = ""


# --------------------------------------------------------------------------- generic mutations


@st.composite
def mutated(draw: Callable, data: bytes, regions: list[int] | None = None) -> tuple[bytes, str]:
    """A hostile variant of ``data``: truncated inside a region, a flipped byte, junk written
    over or into it, or emptied. ``regions`` are offsets where the format's regions start
    (header, dims, payload ...); truncation picks a region, then a point inside it."""
    n = len(data)
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "append", "empty"]))
    if kind == "empty" or n == 0:
        return b"", "empty file"
    if kind == "truncate":
        starts = sorted({0, *(r for r in (regions or []) if 0 <= r < n)})
        i = draw(st.integers(0, len(starts) - 1))
        lo, hi = starts[i], (starts[i + 1] if i + 1 < len(starts) else n)
        cut = draw(st.integers(lo, max(lo, hi - 1)))
        return data[:cut], f"truncated at byte {cut} of {n}"
    if kind == "flip":
        pos = draw(st.integers(0, n - 1))
        mask = draw(st.integers(1, 255))
        return data[:pos] + bytes([data[pos] ^ mask]) + data[pos + 1 :], f"byte {pos} xor {mask}"
    junk = draw(st.binary(min_size=1, max_size=16))
    pos = draw(st.integers(0, n - 1))
    if kind == "overwrite":
        return data[:pos] + junk + data[pos + len(junk) :], f"{len(junk)} junk bytes over byte {pos}"
    if kind == "insert":
        return data[:pos] + junk + data[pos:], f"{len(junk)} junk bytes inserted at byte {pos}"
    return data + junk, f"{len(junk)} junk bytes appended"


def _finite(dtype: Any) -> st.SearchStrategy:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return st.floats(allow_nan=False, allow_infinity=False, width=8 * dtype.itemsize)
    return hnp.from_dtype(dtype)


def _array(dtype: Any, shape: tuple[int, ...]) -> st.SearchStrategy:
    return hnp.arrays(np.dtype(dtype), shape, elements=_finite(dtype))


FEATURE_DTYPES = ["<f8", "<f4", ">f8", "<f2", "<i8", "<i4", ">i2", "|i1", "|u1", "<u2", "|b1"]


@st.composite
def features(draw: Callable, max_rows: int = 12) -> np.ndarray:
    n = draw(st.integers(1, max_rows))
    trailing = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    return draw(_array(draw(st.sampled_from(FEATURE_DTYPES)), (n, *trailing)))


@st.composite
def labels_for(draw: Callable, n: int) -> np.ndarray:
    k = draw(st.integers(1, 5))
    values = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    dtype = draw(st.sampled_from(["<i8", "<i4", "|u1", "<f8", "<i2"]))
    return np.asarray(values).astype(dtype)


def _expect_data(X: np.ndarray, y: np.ndarray | None, scale: float = 1.0, n_classes: int | None = None) -> dict:
    X64 = X.astype(np.float64).reshape(len(X), -1) / scale
    yy = None if y is None else np.asarray(y).astype(np.int64)
    if n_classes is None:
        n_classes = 0 if yy is None else int(yy.max()) + 1
    return {"X": X64, "y": yy, "n_classes": n_classes}


def _bad_value(draw: Callable, X: np.ndarray) -> tuple[np.ndarray, str]:
    X = X.astype(np.float64)
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    flat = X.reshape(-1)
    flat[draw(st.integers(0, flat.size - 1))] = value
    return X, f"non-finite feature {value}"


def _bad_labels(draw: Callable, n: int) -> tuple[np.ndarray, str]:
    kind = draw(st.sampled_from(["negative", "huge", "fraction", "nan", "short", "2d"]))
    y = np.zeros(n, dtype=np.float64)
    if kind == "negative":
        y[draw(st.integers(0, n - 1))] = -draw(st.integers(1, 2**40))
    elif kind == "huge":
        y[draw(st.integers(0, n - 1))] = draw(st.sampled_from([1e5, 1e12, 2.0**63, 1e300]))
    elif kind == "fraction":
        y[draw(st.integers(0, n - 1))] = 0.5
    elif kind == "nan":
        y[draw(st.integers(0, n - 1))] = np.nan
    elif kind == "short":
        y = y[: n - 1] if n > 1 else np.zeros(2)
    else:
        y = np.zeros((n, 2))
    return y, f"labels {kind}"


# --------------------------------------------------------------------------- .npy / .npz


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def npy_lying_header(descr: str, shape_text: str, payload: bytes, fortran: bool = False) -> bytes:
    """A .npy v1.0 file whose header states ``descr`` and ``shape_text`` over ``payload``."""
    header = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape_text}, }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin-1") + payload


LYING_SHAPES = [
    "(1000000000000, 4)",
    "(4, 1000000000000)",
    "(10**12,)",
    "(9223372036854775807, 2)",
    "(-1, 3)",
    "(3, -2)",
    "()",
    "(0, 5)",
    "(2, 3, 4, 5, 6, 7)",
    "(1.5, 2)",
    "'x'",
    "(2**64, 1)",
    "(100000, 100000)",
]
LYING_DESCRS = ["<f8", "<f4", "|O", "<U10", "|S3", "V8", "<c16", "<M8[s]", "[('a', '<f8')]", "<f16", "xyz", ">u8"]


@st.composite
def npy_cases(draw: Callable) -> Case:
    X = draw(features())
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "lie", "nonfinite", "1d"]))
    if kind == "valid":
        return Case("npy", {"data.npy": npy_bytes(X)}, _expect_data(X, None))
    if kind == "nonfinite":
        bad, note = _bad_value(draw, X)
        return Case("npy", {"data.npy": npy_bytes(bad)}, note=note, must_refuse=True)
    if kind == "1d":
        return Case("npy", {"data.npy": npy_bytes(X.reshape(-1))}, note="1-D array", must_refuse=True)
    raw = npy_bytes(X)
    if kind == "lie":
        shape = draw(st.sampled_from(LYING_SHAPES))
        descr = draw(st.sampled_from(LYING_DESCRS))
        data = npy_lying_header(descr, shape, X.tobytes(), draw(st.booleans()))
        return Case("npy", {"data.npy": data}, note=f"header lies: descr {descr} shape {shape}")
    header_end = 10 + struct.unpack("<H", raw[8:10])[0]
    data, note = draw(mutated(raw, [6, 8, 10, header_end]))
    return Case("npy", {"data.npy": data}, note=note)


def npz_bytes(arrays: dict[str, np.ndarray], compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def _zip_with(members: dict[str, bytes], declared: dict[str, int] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    raw = bytearray(buf.getvalue())
    for name, size in (declared or {}).items():  # lie about the uncompressed size in both headers
        key = name.encode()
        for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
            at = raw.find(sig)
            while at >= 0:
                name_at = at + (30 if sig == b"PK\x03\x04" else 46)
                if raw[name_at : name_at + len(key)] == key:
                    raw[at + off : at + off + 4] = struct.pack("<I", size & 0xFFFFFFFF)
                at = raw.find(sig, at + 1)
    return bytes(raw)


@st.composite
def npz_cases(draw: Callable) -> Case:
    X = draw(features())
    y = draw(labels_for(len(X))) if draw(st.booleans()) else None
    x_name = draw(st.sampled_from(["X", "x", "data", "features", "images"]))
    y_name = draw(st.sampled_from(["y", "labels", "target"]))
    arrays = {x_name: X} if y is None else {x_name: X, y_name: y}
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "lie", "zip-lie", "nonfinite", "labels"]))
    compressed = draw(st.booleans())
    if kind == "valid":
        return Case("npz", {"data.npz": npz_bytes(arrays, compressed)}, _expect_data(X, y))
    if kind == "nonfinite":
        arrays[x_name], note = _bad_value(draw, X)
        return Case("npz", {"data.npz": npz_bytes(arrays, compressed)}, note=note, must_refuse=True)
    if kind == "labels":
        arrays[y_name], note = _bad_labels(draw, len(X))
        return Case("npz", {"data.npz": npz_bytes(arrays, compressed)}, note=note, must_refuse=True)
    if kind == "lie":
        shape = draw(st.sampled_from(LYING_SHAPES))
        descr = draw(st.sampled_from(LYING_DESCRS))
        members = {f"{x_name}.npy": npy_lying_header(descr, shape, X.tobytes())}
        if y is not None:
            members[f"{y_name}.npy"] = npy_bytes(y)
        return Case("npz", {"data.npz": _zip_with(members)}, note=f"member header lies: {descr} {shape}")
    if kind == "zip-lie":
        members = {f"{x_name}.npy": npy_bytes(X)}
        size = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, len(members[f"{x_name}.npy"]) + 1]))
        return Case("npz", {"data.npz": _zip_with(members, {f"{x_name}.npy": size})}, note=f"zip says {size} bytes")
    raw = npz_bytes(arrays, compressed)
    data, note = draw(mutated(raw, [4, 30, len(raw) // 2, raw.rfind(b"PK\x01\x02"), raw.rfind(b"PK\x05\x06")]))
    return Case("npz", {"data.npz": data}, note=note)


# --------------------------------------------------------------------------- .csv


def _cell(v: float) -> str:
    return repr(float(v))


@st.composite
def csv_cases(draw: Callable) -> Case:
    n = draw(st.integers(1, 10))
    d = draw(st.integers(1, 4))
    X = draw(_array("<f8", (n, d)))
    label_name = draw(st.sampled_from([None, "label", "y", "target", "class", "Labels"]))
    y = draw(labels_for(n)).astype(np.int64) if label_name else None
    at = draw(st.integers(0, d)) if label_name else d
    header = [f"f{j}" for j in range(d)]
    rows = [[_cell(v) for v in row] for row in X]
    if label_name:
        header.insert(at, label_name)
        for r, row in enumerate(rows):
            row.insert(at, str(int(y[r])))  # type: ignore[index]
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "nonfinite", "ragged", "text", "long", "utf8", "empty"]))
    note = kind
    if kind == "nonfinite":
        rows[draw(st.integers(0, n - 1))][0 if at else -1] = draw(st.sampled_from(["nan", "inf", "-inf", "NaN"]))
    elif kind == "ragged":
        rows[draw(st.integers(0, n - 1))].append("1.0")
    elif kind == "text":
        rows[draw(st.integers(0, n - 1))][0] = draw(st.sampled_from(["abc", "", "1,2", '"', "0x10", "1e999999"]))
    elif kind == "long":
        rows[0][0] = "1" * draw(st.sampled_from([5000, 1 << 17, (1 << 20) + 5]))
    bom = "\ufeff" if draw(st.booleans()) else ""
    text = bom + "\n".join(",".join(r) for r in [header, *rows]) + ("\n" if draw(st.booleans()) else "")
    raw = text.encode("utf-8")
    if kind == "valid":
        return Case("csv", {"data.csv": raw}, _expect_data(X, y))
    if kind == "utf8":
        pos = draw(st.integers(0, len(raw)))
        raw = raw[:pos] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[pos:]
    elif kind == "empty":
        raw = draw(st.sampled_from([b"", b"\n", ("\n".join([",".join(header)]) + "\n").encode(), b"\xef\xbb\xbf"]))
    elif kind == "mutate":
        raw, note = draw(mutated(raw, [len(text.split("\n")[0]) + 1]))
    return Case("csv", {"data.csv": raw}, note=note, must_refuse=kind in ("nonfinite", "ragged", "empty"))


# --------------------------------------------------------------------------- .pt / .pth / .safetensors


def _torch():
    import torch

    return torch


TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "int8", "bool"]


@st.composite
def tensor_features(draw: Callable) -> Any:
    torch = _torch()
    n = draw(st.integers(1, 10))
    trailing = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    size = n * int(np.prod(trailing))
    if dtype in ("float32", "float64", "float16", "bfloat16"):
        values = draw(st.lists(st.floats(-1e4, 1e4, width=16), min_size=size, max_size=size))
    elif dtype == "bool":
        values = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    else:
        lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
        values = draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size))
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(n, *trailing)


def _expect_tensor(X: Any, y: Any) -> dict:
    torch = _torch()
    Xn = X.to(torch.float64).numpy()
    yn = None if y is None else y.to(torch.int64).numpy()
    return _expect_data(Xn, yn)


def pt_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    _torch().save(obj, buf)
    return buf.getvalue()


@st.composite
def pt_cases(draw: Callable) -> Case:
    torch = _torch()
    X = draw(tensor_features())
    y = torch.tensor(draw(labels_for(len(X))).astype(np.int64)) if draw(st.booleans()) else None
    layout = draw(st.sampled_from(["tensor", "tuple", "dict"])) if y is not None else "tensor"
    obj: Any = X if layout == "tensor" else (X, y) if layout == "tuple" else {"X": X, "y": y}
    name = draw(st.sampled_from(["data.pt", "data.pth"]))
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "nonfinite", "labels", "object"]))
    if kind == "valid":
        return Case("pt", {name: pt_bytes(obj)}, _expect_tensor(X, None if layout == "tensor" else y))
    if kind == "nonfinite":
        bad, note = _bad_value(draw, X.to(torch.float64).numpy())
        return Case("pt", {name: pt_bytes(torch.from_numpy(bad))}, note=note, must_refuse=True)
    if kind == "labels":
        bad_y, note = _bad_labels(draw, len(X))
        return Case("pt", {name: pt_bytes({"X": X, "y": torch.from_numpy(bad_y)})}, note=note, must_refuse=True)
    if kind == "object":
        obj = draw(st.sampled_from([[1, 2, 3], {"X": "text"}, "str", 3.5, {"a": X, "b": X}, (X,), None]))
        return Case("pt", {name: pt_bytes(obj)}, note="not tensors", must_refuse=True)
    raw = pt_bytes(obj)
    data, note = draw(mutated(raw, [30, len(raw) // 3, len(raw) // 2, raw.rfind(b"PK\x01\x02")]))
    return Case("pt", {name: data}, note=note)


def safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


def safetensors_lying(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


@st.composite
def safetensors_lie(draw: Callable, name: str, good: Any) -> tuple[bytes, str]:
    payload = good.contiguous().numpy().tobytes() if good is not None else b"\x00" * 16
    kind = draw(st.sampled_from(["shape", "dtype", "offsets", "header-size", "json", "deep"]))
    entry = {
        "dtype": "F64",
        "shape": list(good.shape) if good is not None else [2, 1],
        "data_offsets": [0, len(payload)],
    }
    if kind == "shape":
        entry["shape"] = draw(st.sampled_from([[10**12, 4], [2**62, 2**62], [-1, 2], [0, 3], [1, 1, 1, 1, 1, 1, 1, 1]]))
    elif kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(["F8", "X", "BOOL", "C64", "F8_E4M3", "U64", ""]))
    elif kind == "offsets":
        entry["data_offsets"] = draw(st.sampled_from([[0, 10**12], [5, 2], [-1, 8], [0, len(payload) + 8], [0]]))
    elif kind == "header-size":
        text = json.dumps({name: entry}).encode()
        size = draw(st.sampled_from([10**12, 2**64 - 1, len(text) + 100, 0, 7]))
        return struct.pack("<Q", size) + text + payload, f"header size says {size}"
    elif kind == "json":
        return struct.pack("<Q", 5) + b'{"a":' + payload, "broken header JSON"
    else:
        depth = draw(st.sampled_from([200, 5000]))
        text = ("[" * depth + "]" * depth).encode()
        return struct.pack("<Q", len(text)) + text + payload, f"header nested {depth} deep"
    return safetensors_lying({name: entry}, payload), f"header lies ({kind}): {entry}"


@st.composite
def safetensors_cases(draw: Callable) -> Case:
    torch = _torch()
    X = draw(tensor_features())
    y = torch.tensor(draw(labels_for(len(X))).astype(np.int64)) if draw(st.booleans()) else None
    tensors = {"X": X} if y is None else {"X": X, "y": y}
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "lie", "nonfinite", "labels"]))
    if kind == "valid":
        return Case("safetensors", {"data.safetensors": safetensors_bytes(tensors)}, _expect_tensor(X, y))
    if kind == "nonfinite":
        bad, note = _bad_value(draw, X.to(torch.float64).numpy())
        tensors["X"] = torch.from_numpy(bad)
        return Case("safetensors", {"data.safetensors": safetensors_bytes(tensors)}, note=note, must_refuse=True)
    if kind == "labels":
        bad_y, note = _bad_labels(draw, len(X))
        tensors["y"] = torch.from_numpy(bad_y)
        return Case("safetensors", {"data.safetensors": safetensors_bytes(tensors)}, note=note, must_refuse=True)
    if kind == "lie":
        data, note = draw(safetensors_lie("X", X.to(torch.float64)))
        return Case("safetensors", {"data.safetensors": data}, note=note)
    raw = safetensors_bytes(tensors)
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    data, note = draw(mutated(raw, [8, header_end]))
    return Case("safetensors", {"data.safetensors": data}, note=note)


# --------------------------------------------------------------------------- image folders


def image_bytes(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


@st.composite
def image_folder_cases(draw: Callable) -> Case:
    k = draw(st.integers(1, 3))
    names = sorted(
        draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True), min_size=k, max_size=k, unique=True))
    )
    w, h = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    rgb = draw(st.booleans())
    files: dict[str, bytes] = {}
    images: dict[str, tuple[np.ndarray, int]] = {}  # path -> (pixels, label)
    for label, cls in enumerate(names):
        for j in range(draw(st.integers(1, 3))):
            gray = not rgb or draw(st.booleans())
            shape = (h, w) if gray else (h, w, 3)
            arr = draw(hnp.arrays(np.uint8, shape))
            fmt, ext = draw(st.sampled_from([("PNG", "png"), ("BMP", "bmp"), ("PPM", "ppm")]))
            files[f"images/{cls}/img{j:02d}.{ext}"] = image_bytes(arr, fmt)
            images[f"images/{cls}/img{j:02d}.{ext}"] = (arr, label)

    def expected(images: dict[str, tuple[np.ndarray, int]]) -> dict:
        order = sorted(images, key=lambda p: (images[p][1], Path(p).name))
        pixels = [images[p][0] for p in order]
        channels = 3 if any(p.ndim == 3 for p in pixels) else 1
        X = np.stack([(np.repeat(p[..., None], 3, axis=2) if (channels == 3 and p.ndim == 2) else p) for p in pixels])
        if channels == 3:
            X = X.transpose(0, 3, 1, 2)
        return _expect_data(X, np.asarray([images[p][1] for p in order]), scale=255.0, n_classes=k)

    expect = expected(images)
    kind = draw(
        st.sampled_from(["valid", "valid", "mutate", "size", "junk", "link-out", "link-in", "empty-class", "lie"])
    )
    if kind == "valid":
        return Case("image-folder", files, expect)
    target = draw(st.sampled_from(sorted(files)))
    if kind == "mutate":
        files[target], note = draw(mutated(files[target], [8, 16, 33, len(files[target]) // 2]))
        return Case("image-folder", files, note=f"{target}: {note}")
    if kind == "lie":  # a PNG whose header (valid CRC) claims far more pixels than its data holds
        png = bytearray(image_bytes(np.zeros((h, w), np.uint8)))
        big_w, big_h = draw(st.sampled_from([(4096, 4096), (4097, 4096), (2**31 - 1, 1), (65535, 65535), (1, 2**24)]))
        png[16:24] = struct.pack(">II", big_w, big_h)
        png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
        copies = draw(st.integers(1, 40))
        for i in range(copies):
            files[f"images/{names[0]}/zz_lie{i:02d}.png"] = bytes(png)
        return Case("image-folder", files, note=f"{copies} PNGs claiming {big_w}x{big_h}", must_refuse=True)
    if kind == "size":
        files[f"images/{names[0]}/zz_big.png"] = image_bytes(np.zeros((h + 1, w), np.uint8))
        return Case("image-folder", files, note="one image of another size", must_refuse=True)
    if kind == "junk":
        files[f"images/{names[0]}/zz.png"] = draw(st.binary(max_size=64))
        return Case("image-folder", files, note="junk .png", must_refuse=True)
    if kind == "empty-class":
        return Case(
            "image-folder",
            {**files, "images/zzz_empty/readme.txt": b"x"},
            note="class folder without images",
            must_refuse=True,
        )
    if kind == "link-out":
        files["outside/secret.png"] = files[target]
        where = draw(st.sampled_from(["file", "dir"]))
        links = (
            {f"images/{names[0]}/zz_link.png": "../../outside/secret.png"}
            if where == "file"
            else {"images/zz_linked_class": "../outside"}
        )
        return Case("image-folder", files, note=f"symlink ({where}) out of the folder", links=links, must_refuse=True)
    # a link that stays inside the folder resolves like the file it names (same content, counted once more)
    cls_dir = target.split("/")[1]
    link = f"images/{cls_dir}/zz_link{Path(target).suffix}"
    return Case(
        "image-folder",
        files,
        expected({**images, link: images[target]}),
        note="symlink inside the folder",
        links={link: Path(target).name},
    )


# --------------------------------------------------------------------------- IDX (MNIST layout)


def idx_bytes(arr: np.ndarray, type_code: int = 0x08) -> bytes:
    return bytes([0, 0, type_code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


@st.composite
def idx_cases(draw: Callable) -> Case:
    n = draw(st.integers(1, 8))
    h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    images = draw(hnp.arrays(np.uint8, (n, h, w)))
    labels = draw(hnp.arrays(np.uint8, (n,), elements=st.integers(0, 9)))
    gz = draw(st.booleans())
    names = ("MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte")
    files = {names[0]: idx_bytes(images), names[1]: idx_bytes(labels)}
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "lie", "labels", "count"]))
    note = kind
    must = False
    if kind == "mutate":
        target = draw(st.sampled_from(names))
        files[target], note = draw(mutated(files[target], [2, 3, 4, 8, 4 + 4 * files[target][3]]))
        note = f"{target}: {note}"
    elif kind == "lie":
        target = draw(st.sampled_from(names))
        raw = files[target]
        ndim = raw[3]
        dims = [draw(st.sampled_from([0, 1, 10**6, 2**31 - 1, 2**32 - 1])) for _ in range(ndim)]
        code = draw(st.sampled_from([0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E]))
        files[target] = bytes([0, 0, code, ndim]) + struct.pack(f">{ndim}I", *dims) + raw[4 + 4 * ndim :]
        note, must = f"{target}: header says type {code:#x} dims {dims}", True
    elif kind == "labels":
        bad = labels.astype(np.int32)
        bad[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, -(2**31), 100000, 2**31 - 1]))
        files[names[1]] = idx_bytes(bad.astype(">i4"), 0x0C)
        note, must = "labels out of range", True
    elif kind == "count":
        files[names[1]] = idx_bytes(labels[: n - 1] if n > 1 else np.zeros(2, np.uint8))
        note, must = "label count differs", True
    if gz:
        files = {k + ".gz": gzip.compress(v, mtime=0) for k, v in files.items()}
        if kind == "mutate" and draw(st.booleans()):
            target = draw(st.sampled_from(sorted(files)))
            files[target], more = draw(mutated(files[target], [10, len(files[target]) - 8]))
            note += f"; gz {more}"
    expect = _expect_data(images, labels, scale=255.0, n_classes=10) if kind == "valid" else None
    return Case("idx", files, expect, note=note, must_refuse=must)


# --------------------------------------------------------------------------- CIFAR-10 python batches


@st.composite
def cifar_cases(draw: Callable) -> Case:
    n = draw(st.integers(1, 4))
    data = draw(hnp.arrays(np.uint8, (n, 3072), elements=st.integers(0, 255)))
    labels = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    batch: dict = {
        b"batch_label": b"testing batch 1 of 1",
        b"labels": labels,
        b"data": data,
        b"filenames": [b"x.png"] * n,
    }
    protocol = draw(st.sampled_from([2, 3, 4, 5]))
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "labels", "shape", "global", "bomb"]))
    note, must = kind, False
    if kind == "labels":
        batch[b"labels"] = list(labels)
        batch[b"labels"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, 10**6, 2**70, 1.5, "x"]))
        must = True
    elif kind == "shape":
        batch[b"data"] = draw(st.sampled_from([data.reshape(-1), data[:, :100], data.astype(np.int16), data[:-1]]))
        must = True
    raw = pickle.dumps(batch, protocol=protocol)
    if kind == "global":
        raw = draw(
            st.sampled_from(
                [
                    b"cos\nsystem\n(S'true'\ntR.",
                    b"cbuiltins\neval\n(S'1'\ntR.",
                    b"\x80\x02cnumpy\nload\nq\x00.",
                    b"\x80\x02cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\nK\x00\x85C\x01bcnumpy\ndtype\nS'O8'\nK\x00K\x01\x87RtR.",
                ]
            )
        )
        must = True
    elif kind == "bomb":
        # nested lists sharing one list: a small pickle that names a huge structure
        raw = b"\x80\x02]q\x00" + b"(h\x00h\x00h\x00h\x00h\x00h\x00h\x00h\x00h\x00h\x00e]q\x00" * 40 + b"."
        must = True
    elif kind == "mutate":
        raw, note = draw(mutated(raw, [2, len(raw) // 4, len(raw) // 2, len(raw) - 40]))
    expect = _expect_data(data, np.asarray(labels), scale=255.0, n_classes=10) if kind == "valid" else None
    return Case("cifar10", {"cifar-10-batches-py/test_batch": raw}, expect, note=note, must_refuse=must)


# --------------------------------------------------------------------------- YAML audit files


def _audit_text(name: str, seed: int, checks: list[tuple[str, float]]) -> str:
    lines = ["version: 1", f"name: {json.dumps(name)}", f"seed: {seed}", "data:", "  dataset: digits", "checks:"]
    for cname, limit in checks:
        lines.append(
            f"  - {{name: {json.dumps(cname)}, analysis: kappa, options: {{n: 200}}, "
            f"metric: log10_kappa_at_rank, max: {limit:.17e}}}"  # YAML 1.1 floats need a dot
        )
    return "\n".join(lines) + "\n"


def laughs(levels: int, fan: int, key: str = "name") -> str:
    """Billion laughs: ``fan ** levels`` nodes from a few hundred bytes of anchors and aliases."""
    parts = ["&l0 [lol, lol]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return f"version: 1\n{key}: [" + ", ".join(parts) + "]\nchecks: []\n"


@st.composite
def yaml_cases(draw: Callable) -> Case:
    # BMP only: json.dumps writes astral characters as surrogate pairs, which YAML reads as two code points
    name = draw(st.text(st.characters(max_codepoint=0xFFFD, exclude_categories=["Cs", "Cc"]), min_size=1, max_size=20))
    seed = draw(st.integers(0, 2**32 - 1))
    k = draw(st.integers(1, 3))
    checks = [(f"check-{i}", draw(st.floats(-1e6, 1e6, allow_nan=False))) for i in range(k)]
    text = _audit_text(name, seed, checks)
    expect = {"name": name, "seed": seed, "checks": [c for c, _ in checks], "max": [m for _, m in checks]}
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "mutate", "laughs", "merge", "deep", "recursive", "long", "utf8", "tag", "bigint"]
        )
    )
    note, must = kind, False
    if kind == "valid":
        return Case("audit-yaml", {"audit.yaml": text.encode()}, expect)
    if kind == "laughs":
        levels, fan = draw(st.sampled_from([(6, 9), (9, 9), (12, 9), (30, 2), (40, 3)]))
        text = laughs(levels, fan, draw(st.sampled_from(["name", "version", "seed", "data", "checks", "extra"])))
        note, must = f"billion laughs {fan}^{levels}", True
    elif kind == "merge":
        levels = draw(st.integers(10, 40))
        lines = ["version: 1", "a0: &a0 {k0: 1, k1: 2}"]
        lines += [f"a{i}: &a{i} {{<<: [*a{i - 1}], x{i}: [*a{i - 1}, *a{i - 1}]}}" for i in range(1, levels)]
        text = "\n".join(lines) + "\nchecks: []\n"
        note, must = f"merge-key laughs {levels}", True
    elif kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 20000]))
        style = draw(st.sampled_from(["flow", "flowmap", "block"]))
        if style == "flow":
            body = "[" * depth + "]" * depth
        elif style == "flowmap":
            body = "{a: " * depth + "1" + "}" * depth
        else:
            body = "\n" + "".join("  " * i + "- \n" for i in range(min(depth, 2000)))
        text = f"version: 1\nname: {body}\nchecks: []\n"
        note, must = f"nested {depth} deep ({style})", True
    elif kind == "recursive":
        text = draw(
            st.sampled_from(
                [
                    "version: 1\nname: &a [*a]\nchecks: []\n",
                    "version: 1\nversion2: &a {x: *a}\nchecks: []\n",
                    "version: &v [1, *v]\nchecks: []\n",
                    "version: 1\nchecks: &c [{name: x, analysis: kappa, metric: log10_kappa_at_rank, max: 1, options: *c}]\n",
                ]
            )
        )
        note, must = "recursive anchor", True
    elif kind == "long":
        text = text.replace(f"name: {json.dumps(name)}", "name: " + "x" * draw(st.sampled_from([10**4, 10**6 + 10])))
        note = "over-long line"
    elif kind == "utf8":
        raw = text.encode()
        pos = draw(st.integers(0, len(raw)))
        return Case(
            "audit-yaml", {"audit.yaml": raw[:pos] + b"\xff\xfe" + raw[pos:]}, note="invalid UTF-8", must_refuse=True
        )
    elif kind == "tag":
        text = text.replace(
            "seed:",
            draw(
                st.sampled_from(
                    [
                        "seed: !!python/object/apply:os.system ['true']\nx:",
                        "seed: !!binary aGk=\nx:",
                        "seed: !custom 1\nx:",
                    ]
                )
            ),
        )
        must = True
    elif kind == "bigint":
        text = text.replace(f"seed: {seed}", "seed: " + "9" * draw(st.sampled_from([50, 5000, 100000])))
        text = text if draw(st.booleans()) else text.replace("version: 1", "version: " + "1" * 5000)
        must = True
    else:
        raw, note = draw(mutated(text.encode(), [text.find("checks"), text.find("- {")]))
        return Case("audit-yaml", {"audit.yaml": raw}, note=note)
    return Case("audit-yaml", {"audit.yaml": text.encode()}, note=note, must_refuse=must)


# --------------------------------------------------------------------------- tokenizer.json and text data

TEXT_VOCAB = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(30)]


def tokenizer_json(vocab: dict[str, int], unk: str = "[UNK]", pad: str | None = "[PAD]") -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str().encode()


@st.composite
def tokenizer_cases(draw: Callable) -> Case:
    words = draw(st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True), min_size=1, max_size=20, unique=True))
    words = [w for w in words if w != "unk"] + ["[UNK]", "[PAD]"]
    ids = draw(st.permutations(range(len(words))))
    vocab = dict(zip(words, ids))
    raw = tokenizer_json(vocab)
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "huge", "deep", "utf8", "lie"]))
    note, must = kind, False
    if kind == "valid":
        return Case("tokenizer", {"tokenizer.json": raw}, {"vocab": vocab})
    if kind == "mutate":
        raw, note = draw(mutated(raw, [raw.find(b'"model"'), raw.find(b'"vocab"')]))
    elif kind == "huge":
        size = draw(st.sampled_from([(64 << 20) + 1, 1 << 40]))
        return Case(
            "tokenizer", {"tokenizer.json": raw}, note=f"{size} bytes", must_refuse=True, grow={"tokenizer.json": size}
        )
    elif kind == "deep":
        depth = draw(st.sampled_from([200, 100000]))
        raw = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
        note, must = f"JSON nested {depth} deep", True
    elif kind == "utf8":
        pos = raw.find(b'"vocab"')
        raw = raw[:pos] + b'"\xff\xfe": 1, ' + raw[pos:]
        must = True
    else:
        raw = raw.replace(b'"vocab":{', b'"vocab":{"big":99999999999999999999,', 1)
        note = "vocab id beyond u32"
    return Case("tokenizer", {"tokenizer.json": raw}, note=note, must_refuse=must)


def _words_strategy() -> st.SearchStrategy:
    return st.lists(st.sampled_from(TEXT_VOCAB[2:]), min_size=1, max_size=10).map(" ".join)


@st.composite
def text_cases(draw: Callable) -> Case:
    vocab = {w: i for i, w in enumerate(TEXT_VOCAB)}
    n = draw(st.integers(1, 6))
    texts = draw(st.lists(_words_strategy(), min_size=n, max_size=n))
    named = draw(st.booleans())
    if named:
        classes = sorted(
            draw(st.lists(st.from_regex(r"[a-z]{2,6}", fullmatch=True), min_size=1, max_size=3, unique=True))
        )
        labels: list = [draw(st.sampled_from(classes)) for _ in range(n)]
        order = sorted(set(labels))
        y = np.asarray([order.index(v) for v in labels])
    else:
        labels = [draw(st.integers(0, 4)) for _ in range(n)]
        y = np.asarray(labels)
    max_length = draw(st.integers(2, 12))
    ids = np.zeros((n, max_length), dtype=np.int64)
    for i, t in enumerate(texts):
        row = [vocab[w] for w in t.split()][:max_length]
        ids[i, : len(row)] = row
    fmt = draw(st.sampled_from(["jsonl", "csv"]))
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "labels", "long", "utf8", "empty", "fields"]))
    note, must = kind, False
    if kind == "labels":
        labels = list(labels)
        bad = draw(st.sampled_from([-1, 10**6, 10**30, True, 1.5, None, [1], "\u00b2", "-" + "9" * 5000, "9" * 30]))
        labels[draw(st.integers(0, n - 1))] = bad
        note = f"label {bad!r:.40}"
        if fmt == "jsonl":  # not a str/int: refused; an index beside indices: range-checked; beside names: a name
            must = bad is None or isinstance(bad, (bool, float, list)) or (not named and bad != "\u00b2")
        else:  # a CSV cell is text: an out-of-range index only among indices; anything else is a class name
            must = not named and bad in (-1, 10**6, 10**30, "-" + "9" * 5000, "9" * 30)
    elif kind == "fields":
        texts = list(texts)
        texts[draw(st.integers(0, n - 1))] = draw(st.sampled_from(["", "   ", 5, None, ["a"]]))  # type: ignore[call-overload]
        must = True
    if fmt == "jsonl":
        body = "".join(json.dumps({"text": t, "label": v}) + "\n" for t, v in zip(texts, labels))
    else:
        import csv

        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["text", "label"])
        for t, v in zip(texts, labels):
            w.writerow([t, v])
        body = out.getvalue()
        if kind == "fields":  # 5 or ['a'] are texts in a CSV cell; empty or blank ones are refused
            must = any(t is None or (isinstance(t, str) and not t.strip()) for t in texts)
    raw = body.encode()
    if kind == "long":
        raw = raw + (json.dumps({"text": "w1 " * ((1 << 19) + 10), "label": 0}) + "\n").encode()
        if fmt == "csv":
            raw = body.encode() + b'"' + b"w1 " * ((1 << 19) + 10) + b'",0\n'
        note, must = "a record over 1 MiB", True
    elif kind == "utf8":
        pos = draw(st.integers(0, len(raw)))
        raw = raw[:pos] + b"\xc3\x28" + raw[pos:]
        must = True
    elif kind == "empty":
        raw = draw(st.sampled_from([b"", b"\n\n", b"text,label\n" if fmt == "csv" else b"{}\n"]))
        must = True
    elif kind == "mutate":
        raw, note = draw(mutated(raw, [raw.find(b"\n") + 1]))
    files = {f"data.{fmt}": raw, "tok/tokenizer.json": tokenizer_json(vocab)}
    expect = (
        {"X": ids.astype(np.float64), "y": y.astype(np.int64), "n_classes": int(y.max()) + 1, "max_length": max_length}
        if kind == "valid"
        else {"max_length": max_length}
    )
    return Case(
        "text",
        files,
        expect if kind == "valid" else None,
        note=note,
        must_refuse=must,
        options={"max_length": max_length},
    )


# --------------------------------------------------------------------------- attnaudit checkpoints, weights


@st.composite
def checkpoint_cases(draw: Callable) -> Case:
    torch = _torch()
    arch = draw(st.sampled_from(["relu", "attn"]))
    d, m, c = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    shapes = {"W": (m, d), "a": (m, c)} | ({"context": (d, d)} if arch == "attn" else {})
    tensors = {
        k: torch.from_numpy(draw(_array("<f8", s).map(lambda a: np.clip(a, -1e30, 1e30)))).to(getattr(torch, dtype))
        for k, s in shapes.items()
    }
    side = {
        "schema": "attnaudit.model/2",
        "arch": arch,
        "spec": {"arch": arch, "d_in": d, "width": m, "n_out": c},
        "dtype": dtype,
        "input": {"kind": "flat", "shape": [d]},
        "metadata": {"note": "fuzz"},
    }
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "valid",
                "mutate-weights",
                "mutate-sidecar",
                "lie-sidecar",
                "lie-weights",
                "nonfinite",
                "huge-sidecar",
            ]
        )
    )
    note, must = kind, False
    if kind == "lie-sidecar":
        field_name = draw(st.sampled_from(["d_in", "width", "n_out"]))
        side["spec"][field_name] = draw(st.sampled_from([10**12, 2**63, -1, 0, 1.5, "3", None, 10**100]))
        note, must = f"side-car {field_name}={side['spec'][field_name]}", True
    elif kind == "nonfinite":
        tensors["W"].view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf")]))
        must = True
    weights = safetensors_bytes(tensors)
    sidecar = json.dumps(side).encode()
    if kind == "mutate-weights":
        weights, note = draw(mutated(weights, [8, 8 + struct.unpack("<Q", weights[:8])[0]]))
        note = "weights " + note
    elif kind == "mutate-sidecar":
        sidecar, note = draw(mutated(sidecar, [sidecar.find(b'"spec"'), sidecar.find(b'"metadata"')]))
        note = "side-car " + note
    elif kind == "lie-weights":
        weights, note = draw(safetensors_lie("W", tensors["W"].to(torch.float64)))
    elif kind == "huge-sidecar":
        must = True
    expect = {k: v.numpy() for k, v in tensors.items()} if kind == "valid" else None
    grow = {"model.safetensors.json": draw(st.sampled_from([1_000_001, 1 << 40]))} if kind == "huge-sidecar" else {}
    return Case(
        "checkpoint",
        {"model.safetensors": weights, "model.safetensors.json": sidecar},
        expect,
        note=note,
        must_refuse=must,
        grow=grow,
    )


@st.composite
def weights_cases(draw: Callable) -> Case:
    torch = _torch()
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.]{0,10}", fullmatch=True), min_size=1, max_size=4, unique=True))
    tensors = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        dtype = draw(st.sampled_from(["<f8", "<f4", "<i8", "|u1"]))
        tensors[name] = torch.from_numpy(draw(_array(dtype, shape)).copy())
    raw = safetensors_bytes(tensors)
    kind = draw(st.sampled_from(["valid", "valid", "mutate", "lie"]))
    if kind == "valid":
        return Case("weights", {"w.safetensors": raw}, {k: v.numpy() for k, v in tensors.items()})
    if kind == "lie":
        first = names[0]
        data, note = draw(safetensors_lie(first, tensors[first].to(torch.float64) if tensors[first].numel() else None))
        return Case("weights", {"w.safetensors": data}, note=note)
    data, note = draw(mutated(raw, [8, 8 + struct.unpack("<Q", raw[:8])[0]]))
    return Case("weights", {"w.safetensors": data}, note=note)


# --------------------------------------------------------------------------- Hugging Face folders

_HF_CACHE: dict[int, tuple[bytes, bytes, dict]] = {}


def hf_base(variant: int) -> tuple[bytes, bytes, dict]:
    """config.json and model.safetensors bytes of a tiny BERT classifier (built once per variant)."""
    if variant not in _HF_CACHE:
        import transformers
        from safetensors.torch import load

        torch = _torch()
        torch.manual_seed(variant)
        config = transformers.BertConfig(
            vocab_size=20 + variant,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            max_position_embeddings=12,
            num_labels=2 + variant % 2,
        )
        model = transformers.BertForSequenceClassification(config).eval()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            cfg = (Path(tmp) / "config.json").read_bytes()
            weights = (Path(tmp) / "model.safetensors").read_bytes()
        _HF_CACHE[variant] = (cfg, weights, {k: v.numpy() for k, v in load(weights).items()})
    return _HF_CACHE[variant]


@st.composite
def hf_cases(draw: Callable) -> Case:
    cfg_raw, weights, tensors = hf_base(draw(st.integers(0, 1)))
    config = json.loads(cfg_raw)
    # the weights are fixed (a model per case is slow to build); what varies in a valid case is
    # the config around them: class names, and fields transformers reads but shapes do not use
    k = len(config.get("id2label") or {}) or 2
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=k, max_size=k, unique=True))
    config["id2label"] = {str(i): name for i, name in enumerate(names)}
    config["label2id"] = {name: i for i, name in enumerate(names)}
    config["hidden_dropout_prob"] = draw(st.floats(0, 1))
    config["layer_norm_eps"] = draw(st.floats(1e-12, 1e-3))
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "mutate-config", "mutate-weights", "lie", "auto_map", "huge", "deep", "tokenizer"]
        )
    )
    note, must = kind, False
    files: dict[str, bytes] = {}
    if kind == "lie":
        key = draw(
            st.sampled_from(
                [
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "intermediate_size",
                    "max_position_embeddings",
                    "num_labels",
                ]
            )
        )
        config[key] = draw(st.sampled_from([10**12, 2**40, -1, 0, 3.5, "8", None]))
        note, must = f"config {key}={config[key]}", True
    elif kind == "auto_map":
        config["auto_map"] = {"AutoModelForSequenceClassification": "evil.EvilModel"}
        if draw(st.booleans()):
            config["architectures"] = ["EvilModel"]
        must = True
    cfg = json.dumps(config).encode()
    if kind == "mutate-config":
        cfg, note = draw(mutated(cfg, [cfg.find(b'"architectures"'), cfg.find(b'"hidden_size"')]))
    elif kind == "mutate-weights":
        weights, note = draw(mutated(weights, [8, 8 + struct.unpack("<Q", weights[:8])[0]]))
    elif kind == "huge":
        files["grow"] = b""  # marker: config.json grows past the limit below
        must = True
    elif kind == "deep":
        cfg = cfg[:-1] + b', "deep": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        must = True
    elif kind == "tokenizer":
        files["hf/tokenizer.json"] = draw(st.sampled_from([b"{", b"\xff", b"[" * 100000, b"{}"]))
        note = "broken tokenizer.json beside the model"
    grow = (
        {"hf/config.json": draw(st.sampled_from([(1 << 20) + 1, 1 << 40]))}
        if files.pop("grow", None) is not None
        else {}
    )
    files |= {"hf/config.json": cfg, "hf/model.safetensors": weights}
    return Case(
        "hf", files, tensors if kind in ("valid", "tokenizer") else None, note=note, must_refuse=must, grow=grow
    )


# --------------------------------------------------------------------------- readers: how each case is loaded


def _load_data(root: Path, name: str, **spec: Any) -> Any:
    from attnaudit.data import DataSpec, load_dataset

    return load_dataset(DataSpec(data=str(root / name), **spec))


def _load_builtin(root: Path, dataset: str, split: str) -> Any:
    from attnaudit.data import DataSpec, load_dataset

    return load_dataset(DataSpec(dataset=dataset, data_dir=str(root), split=split))


def _single(root: Path, case: Case) -> str:
    return next(iter(case.files))


LOADERS: dict[str, Callable[[Path, Case], Any]] = {
    "npy": lambda root, case: _load_data(root, _single(root, case)),
    "npz": lambda root, case: _load_data(root, _single(root, case)),
    "csv": lambda root, case: _load_data(root, _single(root, case)),
    "pt": lambda root, case: _load_data(root, _single(root, case)),
    "safetensors": lambda root, case: _load_data(root, _single(root, case)),
    "image-folder": lambda root, case: _load_data(root, "images"),
    "idx": lambda root, case: _load_builtin(root, "mnist", "train"),
    "cifar10": lambda root, case: _load_builtin(root, "cifar10", "test"),
    "text": lambda root, case: _load_data(
        root, _single(root, case), tokenizer=str(root / "tok"), max_length=case.options["max_length"]
    ),
}


def _load_yaml(root: Path, case: Case) -> Any:
    from attnaudit.audit.file import load_audit_file

    return load_audit_file(root / "audit.yaml")


def _load_tokenizer(root: Path, case: Case) -> Any:
    from attnaudit.data.text import load_tokenizer

    return load_tokenizer(root / "tokenizer.json")


def _load_checkpoint(root: Path, case: Case) -> Any:
    from attnaudit.models.checkpoints import load_checkpoint

    return load_checkpoint(root / "model.safetensors")


def _load_weights(root: Path, case: Case) -> Any:
    from attnaudit.models.weights import read_weights

    return read_weights(root / "w.safetensors")


def _load_hf(root: Path, case: Case) -> Any:
    from attnaudit.models.checkpoints import load_checkpoint

    return load_checkpoint(root / "hf")


LOADERS |= {
    "audit-yaml": _load_yaml,
    "tokenizer": _load_tokenizer,
    "checkpoint": _load_checkpoint,
    "weights": _load_weights,
    "hf": _load_hf,
}

STRATEGIES: dict[str, Callable[[], st.SearchStrategy]] = {
    "npy": npy_cases,
    "npz": npz_cases,
    "csv": csv_cases,
    "pt": pt_cases,
    "safetensors": safetensors_cases,
    "image-folder": image_folder_cases,
    "idx": idx_cases,
    "cifar10": cifar_cases,
    "audit-yaml": yaml_cases,
    "tokenizer": tokenizer_cases,
    "text": text_cases,
    "checkpoint": checkpoint_cases,
    "weights": weights_cases,
    "hf": hf_cases,
}
READERS = tuple(STRATEGIES)


# --------------------------------------------------------------------------- checking one case


def write_case(case: Case, root: Path) -> None:
    for rel, data in case.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for rel, size in case.grow.items():
        os.truncate(root / rel, size)  # a sparse tail: the size is real, the disk is not used
    for rel, target in case.links.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.kind == b.dtype.kind and bool(np.array_equal(a, b))


def _check_loaded(case: Case, root: Path, result: Any) -> str:
    """'' when ``result`` is exactly what the case holds (or, for hostile data that loaded,
    keeps the data contract); else what differs."""
    r = case.reader
    exp = case.expect
    if r in ("npy", "npz", "csv", "pt", "safetensors", "image-folder", "idx", "cifar10", "text"):
        X = result.X.numpy()
        y = None if result.y is None else result.y.numpy()
        if X.dtype != np.float64 or X.ndim != 2 or len(X) < 1 or not np.isfinite(X).all():
            return f"loaded X breaks the contract: {X.dtype} {X.shape}"
        if y is not None and (
            y.dtype != np.int64 or y.shape != (len(X),) or y.min() < 0 or y.max() >= result.n_classes
        ):
            return f"loaded y breaks the contract: {y.dtype} {y.shape} n_classes {result.n_classes}"
        if exp is None:
            return ""
        if X.shape != exp["X"].shape or not np.array_equal(X, exp["X"]):
            return f"X differs: loaded {X.shape}, generated {exp['X'].shape}"
        if (y is None) != (exp["y"] is None) or (y is not None and not np.array_equal(y, exp["y"])):
            return f"y differs: loaded {y}, generated {exp['y']}"
        if result.n_classes != exp["n_classes"]:
            return f"n_classes {result.n_classes}, generated {exp['n_classes']}"
        return ""
    if r == "audit-yaml":
        if exp is None:
            return ""
        got = {
            "name": result.name,
            "seed": result.seed,
            "checks": [c.name for c in result.checks],
            "max": [c.max for c in result.checks],
        }
        return "" if got == exp else f"plan differs: {got} vs {exp}"
    if r == "tokenizer":
        if exp is None:
            return ""
        vocab = result.get_vocab()
        return "" if vocab == exp["vocab"] else "vocabulary differs"
    if r in ("checkpoint", "hf"):
        state = {k: v.detach().cpu().numpy() for k, v in result.module.state_dict().items()}
        for k, v in state.items():
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                return f"loaded weight {k} is not finite"
        if exp is None:
            return ""
        for k, v in exp.items():
            match = [s for s in state if s == k or s.endswith("." + k)]
            if not match:
                return f"tensor {k} not in the loaded model"
            if not _equal(state[match[0]], v):
                return f"tensor {k} differs"
        return ""
    if r == "weights":
        if exp is None:
            return ""
        if sorted(result) != sorted(exp):
            return "tensor names differ"
        bad = [k for k in exp if not _equal(result[k].numpy(), exp[k])]
        return f"tensors differ: {bad}" if bad else ""
    raise ValueError(r)


def run_case(case: Case, root: Path) -> Outcome:
    """Write the case under ``root`` (an empty folder), load it, and judge the outcome."""
    from attnaudit.errors import AuditError

    write_case(case, root)
    try:
        result = LOADERS[case.reader](root, case)
    except AuditError as exc:
        msg = str(exc)
        if "\n" in msg or "\r" in msg:
            return Outcome("fail", f"AuditError of {msg.count(chr(10)) + 1} lines: {msg[:300]!r}")
        if str(root) not in msg:
            return Outcome("fail", f"AuditError does not name the file: {msg[:300]!r}")
        if len(msg) > 1000 + 4 * len(str(root)):
            return Outcome("fail", f"AuditError of {len(msg)} characters: {msg[:200]!r}")
        if "MemoryError" in msg or "Unable to allocate" in msg:
            return Outcome("fail", f"refused only after an allocation failed: {msg[:300]}")
        if case.expect is not None:
            return Outcome("fail", f"valid file refused: {msg[:300]}")
        return Outcome("refused", msg)
    except MemoryError:
        return Outcome("fail", "MemoryError (allocation past the 2 GiB budget)")
    except BaseException as exc:  # noqa: BLE001 - anything else is what the fuzzer looks for
        if isinstance(exc, KeyboardInterrupt):
            raise
        return Outcome("fail", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    if case.must_refuse:
        return Outcome("fail", "hostile file loaded but must be refused")
    problem = _check_loaded(case, root, result)
    return Outcome("fail", problem) if problem else Outcome("loaded")


# --------------------------------------------------------------------------- deep run: generation and workers


def generate(reader: str, n: int, seed: int) -> list[Case]:
    """``n`` cases of ``reader`` drawn by hypothesis (generate phase only, fixed seed)."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    cases: list[Case] = []

    @hseed(seed)
    @settings(
        max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(STRATEGIES[reader]())
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    return cases[:n]


def _worker(conn: Any, reader: str, n: int, seed: int, start: int, keep: str | None, save: int | None) -> None:
    """Generate the ``n`` cases of ``reader`` (deterministic for a seed) and run cases
    ``start``.. in fresh folders, reporting ("start", i) before and ("done", i, status,
    detail, peak RSS MiB) after each; keep the first failure (or case ``save``, a hang the
    previous worker died on) under ``keep``."""
    import resource
    import warnings

    warnings.simplefilter("ignore")
    torch = _torch()
    torch.set_num_threads(1)
    import attnaudit.audit.file  # noqa: F401
    import attnaudit.data  # noqa: F401
    import attnaudit.models.checkpoints  # noqa: F401
    import attnaudit.models.hf  # noqa: F401

    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    cases = generate(reader, n, seed)
    keep_dir = Path(keep) / reader if keep else None
    if save is not None and keep_dir is not None:
        keep_case(cases[save], f"hang: no answer within {CASE_TIMEOUT_S:.0f} s", keep_dir)
    kept = save is not None or (keep_dir is not None and keep_dir.exists())
    conn.send(("total", len(cases)))
    limited = False
    for i in range(start, len(cases)):
        conn.send(("start", i))
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            outcome = run_case(cases[i], Path(tmp))
        if outcome.status == "fail" and not kept and keep_dir is not None:
            keep_case(cases[i], outcome.detail, keep_dir)
            kept = True
        if not limited:  # after the first case (imports done): a hard cap of 2 GiB more address space
            with open("/proc/self/status") as fh:
                vm = int(fh.read().split("VmSize:")[1].split()[0]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_LIMIT, vm + MEMORY_LIMIT))
            limited = True
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        valid = cases[i].expect is not None
        conn.send(("done", i, outcome.status, f"{cases[i].note}: {outcome.detail}", rss, valid))
    conn.send(("end",))


def keep_case(case: Case, detail: str, folder: Path) -> None:
    """The case's files under ``folder`` (a regression test can copy how they were made) and case.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    write_case(case, folder)
    (folder / "case.txt").write_text(f"{case.describe()}\nfailure: {detail}\n", encoding="utf-8")


class ReaderRun:
    """One reader's cases in a worker process, restarted after a case that hangs or kills it."""

    def __init__(self, reader: str, n: int, seed: int, keep: Path | None, verbose: bool) -> None:
        self.reader, self.n, self.seed, self.keep, self.verbose = reader, n, seed, keep, verbose
        self.stats: dict[str, Any] = {
            "cases": 0,
            "failures": 0,
            "valid": 0,
            "loaded": 0,
            "refused": 0,
            "peak_rss_mib": 0,
        }
        self.first: str | None = None
        self.t0 = time.monotonic()
        self.total: int | None = None
        self.done = False
        self._spawn(0, None)

    def _spawn(self, start: int, save: int | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=False)
        keep = str(self.keep) if self.keep is not None else None
        self.proc = ctx.Process(
            target=_worker, args=(child, self.reader, self.n, self.seed, start, keep, save), daemon=True
        )
        self.proc.start()
        child.close()
        self.current: int | None = None
        self.started = time.monotonic()

    def _fail(self, detail: str) -> None:
        self.stats["failures"] += 1
        if self.first is None:
            self.first = detail
        if self.verbose:
            print(f"  FAIL {self.reader}: {detail}", flush=True)

    def on_message(self) -> None:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode
            self.proc.join(5)
            if self.current is None:  # died outside a case (generation): report and stop
                self._fail(f"worker exited with {self.proc.exitcode if code is None else code} outside a case")
                self.done = True
                return
            i = self.current
            self.stats["cases"] += 1
            self._fail(f"case {i}: worker died (exit {self.proc.exitcode}; killed for memory?)")
            self._restart(i)
            return
        if msg[0] == "total":
            self.total = msg[1]
        elif msg[0] == "start":
            self.current, self.started = msg[1], time.monotonic()
        elif msg[0] == "done":
            _, i, status, detail, rss, valid = msg
            self.current = None
            self.stats["cases"] += 1
            self.stats["valid"] += int(valid)
            self.stats["peak_rss_mib"] = max(self.stats["peak_rss_mib"], rss)
            if status == "fail":
                self._fail(f"case {i}: {detail}")
            else:
                self.stats[status] += 1
        elif msg[0] == "end":
            self.proc.join(5)
            self.done = True

    def _restart(self, i: int) -> None:
        first_failure_here = self.stats["failures"] == 1
        self.proc.kill()
        self.proc.join(5)
        total = self.total if self.total is not None else self.n
        if i + 1 < total or (first_failure_here and self.keep is not None):
            self._spawn(i + 1, i if first_failure_here else None)
        else:
            self.done = True

    def check_hang(self) -> None:
        if self.current is not None and time.monotonic() - self.started > CASE_TIMEOUT_S:
            i = self.current
            self.stats["cases"] += 1
            self._fail(f"case {i}: hang, no answer within {CASE_TIMEOUT_S:.0f} s")
            self._restart(i)

    def report(self) -> dict:
        self.stats["seconds"] = round(time.monotonic() - self.t0, 1)
        s = self.stats
        print(
            f"FUZZ reader={self.reader} cases={s['cases']} failures={s['failures']} "
            f"(valid {s['valid']}; loaded {s['loaded']}, refused {s['refused']}; worker peak RSS "
            f"{s['peak_rss_mib']} MiB; {s['seconds']} s)",
            flush=True,
        )
        if self.first is not None:
            print(f"  first failure: {self.first}", flush=True)
        return dict(s, first_failure=self.first)


def fuzz(readers: list[str], n: int, keep: Path | None, jobs: int, seed: int, verbose: bool) -> dict[str, dict]:
    """Run ``n`` cases of each reader, ``jobs`` readers at a time; one FUZZ line per reader."""
    from multiprocessing.connection import wait

    pending = list(readers)
    running: list[ReaderRun] = []
    results: dict[str, dict] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(ReaderRun(pending.pop(0), n, seed, keep, verbose))
            for conn in wait([r.conn for r in running], timeout=0.5):
                next(r for r in running if r.conn is conn).on_message()
            for r in list(running):
                if not r.done:
                    r.check_hang()
                if r.done:
                    running.remove(r)
                    results[r.reader] = r.report()
    finally:
        for r in running:
            r.proc.kill()
    return {k: results[k] for k in readers if k in results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000, help="cases per reader (default 5000)")
    parser.add_argument("--readers", default=",".join(READERS), help=f"comma-separated subset of {', '.join(READERS)}")
    parser.add_argument("--keep", type=Path, default=None, help="folder for the first failing case of each reader")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="worker processes")
    parser.add_argument("--seed", type=int, default=28, help="hypothesis seed (the same seed draws the same cases)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    args = parser.parse_args(argv)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    unknown = [r for r in readers if r not in STRATEGIES]
    if unknown:
        parser.error(f"unknown reader(s) {', '.join(unknown)}; choose from {', '.join(READERS)}")
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the workers
    results = fuzz(readers, args.cases, args.keep, args.jobs, args.seed, args.verbose)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r["failures"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
