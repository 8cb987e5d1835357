"""An on-disk store of the ``projected`` estimator's training rows, reused across runs and processes.

For a training sample i the projected estimator needs psi_i (c' x k, with psi_i^T psi_i sample
i's term of the projected curvature), r_i = R^T grad l_i (k) and the loss l_i itself (from the
same forward pass: a later audit reads the training loss instead of a forward pass over the rows).
All depend on the model, the projection and the sample only, so a later audit of the same model
on the same data (another test set, attack or seed) can read them instead of recomputing them.

Key: one folder per model and projection, named by the sha256 of :class:`StoreKey` (the model's
fingerprint -- tracked values, frozen tensors, loss, dtype, curvature, projection seed --,
proj_dim, the projection's layout, the curvature, the dtype, k and c'). Inside it rows are
found by their content key (a hash of the row and its one-hot target).

Layout (``<root>/<key digest>/``)::

    manifest.json             format, the key's parts, segment_rows, next_segment, the committed segments
    seg-000000.keys.npy       (m, 28) uint8: the rows' content keys, in the order they were asked for
    seg-000000.psi.npy        (m, c', k) in the engine's dtype (bfloat16 stored as its int16 bits)
    seg-000000.r.npy          (m, k)
    seg-000000.curvature.npy  (k, k) float64: sum_i psi_i^T psi_i over the segment's rows
    seg-000000.loss.npy       (m,) float64: each row's loss at the model
    ...

Segments are append-only, at most ``segment_rows`` rows each; the rows one build adds are cut
into segments by their position among the missing rows, so the bytes of every file and of the
manifest depend on the rows, model, projection and precision only (no timestamps, no host
names, no completion order): a build in one process and one sharded on Ray give the same folder.

Integrity: the manifest records each file's size and sha256, and a segment counts only when its
files exist and match. Every file of a segment is hashed the first time a process reads the
segment (then remembered by file identity -- inode, size, mtime -- so the clean and perturbed
training sets of one run do not hash twice); a segment that fails is reported in one warning,
dropped from the manifest and its rows computed again. A wrong row would silently change
influence scores, so no audit reads unverified bytes; :meth:`GradientStore.verify` hashes every
segment again regardless of what the process remembers.

Resume: files are written under temporary names and renamed, the manifest (atomically) last,
so a killed build leaves complete committed segments, at most an orphaned temporary or a
renamed segment file the manifest does not list; the next open removes both and a rerun
computes only rows no committed segment holds. One build at a time per store: the folder is
locked (``flock``) while a run looks rows up and commits segments.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from attnaudit.core.precision import tensor_bits

from attnaudit.errors import AuditError, FieldError, literal
from attnaudit.runtime.atomic import folder_lock, temp_path_for, write_text_atomic
from attnaudit.runtime.sweep import RAY_INSTALL, ray_session

__all__ = [
    "FORMAT",
    "KEY_BYTES",
    "MAX_RETRIES",
    "SEGMENT_ROWS",
    "GradientStore",
    "SegmentArrays",
    "StoreKey",
    "forget_verified",
    "ray_map",
]

FORMAT = "attnaudit.gradient-store/2"  # 2: each row's loss stored beside its gradients
#: rows per segment (the last segment of a build may hold fewer)
SEGMENT_ROWS = 1024
#: bytes of one row's content key (sha1 of the row, 8 bytes of the sha1 of its target)
KEY_BYTES = 28
#: times Ray reruns a segment task whose worker died
MAX_RETRIES = 3
KINDS = ("keys", "psi", "r", "curvature", "loss")  # a segment's files, in the manifest's order
_MANIFEST = "manifest.json"
# files verified in this process: path -> (inode, size, mtime_ns, sha256)
_VERIFIED: dict[str, tuple[int, int, int, str]] = {}


def forget_verified() -> None:
    """Forget which segment files this process has hashed (the next read hashes them again)."""
    _VERIFIED.clear()


@dataclass(frozen=True)
class StoreKey:
    """What the stored rows depend on (besides each row's own content), readable in the manifest."""

    fingerprint: str  # factors_fingerprint of the engine: tracked values, frozen tensors, loss, dtype, curvature, seed
    proj_dim: int
    layout: dict  # the projection's layout (KroneckerProjection.describe())
    curvature: str  # ggn or empirical
    dtype: str  # the engine's dtype, e.g. float64
    k: int  # projected columns used
    columns: int  # c': rows of psi per sample (classes for ggn, 1 for empirical)

    def parts(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "proj_dim": int(self.proj_dim),
            "layout": self.layout,
            "curvature": self.curvature,
            "dtype": self.dtype,
            "k": int(self.k),
            "columns": int(self.columns),
        }

    @property
    def digest(self) -> str:
        """sha256 over the format and the key's parts (the folder's name is its first 24 hex digits)."""
        text = json.dumps({"format": FORMAT, **self.parts()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class SegmentArrays:
    """One segment's content: ``psi`` (m, c', k), ``r`` (m, k), ``curvature`` (k, k) float64 =
    sum_i psi_i^T psi_i, ``loss`` (m,) float64, as numpy arrays (what a local build or a Ray task returns)."""

    psi: np.ndarray
    r: np.ndarray
    curvature: np.ndarray
    loss: np.ndarray


def segment_arrays(psi: torch.Tensor, r: torch.Tensor, curvature: torch.Tensor, loss: torch.Tensor) -> SegmentArrays:
    return SegmentArrays(
        tensor_bits(psi), tensor_bits(r), tensor_bits(curvature.to(torch.float64)), tensor_bits(loss.to(torch.float64))
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Hashing:
    """A write-only file that hashes what goes through it (no second read of what was written)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)


def _save_npy(target: Path, array: np.ndarray) -> tuple[int, str]:
    """Write ``array`` as ``.npy`` under a temporary name and rename it to ``target``: (bytes, sha256).
    Not fsync'ed: a file a crash leaves short or empty fails its checksum and is recomputed."""
    tmp = temp_path_for(target)
    try:
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            np.save(out, np.ascontiguousarray(array), allow_pickle=False)
        os.chmod(tmp, 0o644)
        digest = out.sha.hexdigest()
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _VERIFIED[str(target)] = (*_identity(target), digest)
    return target.stat().st_size, digest


@dataclass
class Located:
    """Where rows are: (segment index, row) per content key found (a key absent is missing)."""

    where: dict[bytes, tuple[int, int]]
    dropped: list[str]  # segments whose files failed their checksums (dropped, their rows missing)


class GradientStore:
    """The rows of one :class:`StoreKey` under ``root`` (see the module docstring).

    Use :meth:`locked` around a lookup and a build so no other process commits in between."""

    def __init__(self, root: str | os.PathLike, key: StoreKey, segment_rows: int | None = None) -> None:
        self.root = Path(root)
        self.key = key
        self.folder = self.root / key.digest[:24]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FieldError("store", "{name} " + literal(self.root) + f" cannot be created: {exc.strerror}") from None
        self._segment_rows = int(segment_rows or SEGMENT_ROWS)
        self.manifest = self._read_manifest()

    # ------------------------------------------------------------------ manifest
    @property
    def segment_rows(self) -> int:
        return int(self.manifest["segment_rows"])

    @property
    def segments(self) -> list[dict]:
        return self.manifest["segments"]

    @property
    def rows(self) -> int:
        """Rows committed."""
        return sum(int(s["rows"]) for s in self.segments)

    @property
    def size_bytes(self) -> int:
        """Bytes of the committed segment files and the manifest."""
        files = sum(int(f["bytes"]) for s in self.segments for f in s["files"].values())
        path = self.folder / _MANIFEST
        return files + (path.stat().st_size if path.exists() else 0)

    def _read_manifest(self) -> dict:
        path = self.folder / _MANIFEST
        fresh = {
            "format": FORMAT,
            "key": self.key.parts(),
            "segment_rows": self._segment_rows,
            "next_segment": 0,
            "segments": [],
        }
        if not path.exists():
            return fresh
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AuditError(
                f"gradient store manifest {path} is unreadable ({exc.__class__.__name__}); delete the folder "
                f"{self.folder} to rebuild it"
            ) from None
        if manifest.get("format") != FORMAT:
            raise AuditError(
                f"gradient store {self.folder} has format {manifest.get('format')!r}, this attnaudit reads {FORMAT}; "
                "delete the folder to rebuild it"
            )
        if manifest.get("key") != json.loads(json.dumps(self.key.parts())):
            raise AuditError(
                f"gradient store {self.folder} belongs to another model or projection (its key differs from this "
                "run's, a hash collision or a hand-edited manifest); delete the folder to rebuild it"
            )
        return manifest

    def _write_manifest(self) -> None:
        write_text_atomic(self.folder / _MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def locked(self) -> Iterator[GradientStore]:
        """An exclusive lock on the store's folder for the block: re-reads the manifest and removes
        what a killed build left (temporaries, segment files the manifest does not list)."""
        with folder_lock(self.folder):
            self.manifest = self._read_manifest()
            self._remove_orphans()
            yield self

    def _remove_orphans(self) -> None:
        listed = {f["file"] for s in self.segments for f in s["files"].values()} | {_MANIFEST}
        for path in self.folder.iterdir():
            if path.name not in listed and (path.name.startswith(".") or path.name.startswith("seg-")):
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ integrity
    def _segment_ok(self, segment: dict, force: bool = False) -> bool:
        for entry in segment["files"].values():
            path = self.folder / entry["file"]
            try:
                ident = _identity(path)
            except OSError:
                return False
            if ident[1] != int(entry["bytes"]):
                return False
            seen = _VERIFIED.get(str(path))
            if not force and seen is not None and seen[:3] == ident and seen[3] == entry["sha256"]:
                continue
            digest = _sha256(path)
            if digest != entry["sha256"]:
                _VERIFIED.pop(str(path), None)
                return False
            _VERIFIED[str(path)] = (*ident, digest)
        return True

    def verify(self) -> list[str]:
        """Hash every committed file again (whatever this process remembers): the names of the
        segments that are missing a file or fail a checksum (nothing is changed)."""
        return [s["name"] for s in self.segments if not self._segment_ok(s, force=True)]

    def _drop(self, names: Sequence[str]) -> None:
        """Remove segments from the manifest (written first), then their files."""
        gone = [s for s in self.segments if s["name"] in set(names)]
        self.manifest["segments"] = [s for s in self.segments if s["name"] not in set(names)]
        self._write_manifest()
        for s in gone:
            for entry in s["files"].values():
                (self.folder / entry["file"]).unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading
    def _load(self, segment: dict, kind: str) -> np.ndarray:
        path = self.folder / segment["files"][kind]["file"]
        return np.load(path, mmap_mode="r", allow_pickle=False)

    def tensor(self, segment: int, kind: str, rows: np.ndarray | None = None) -> torch.Tensor:
        """Segment ``segment``'s ``kind`` array (memory-mapped), ``rows`` of it when given, as a tensor."""
        array = self._load(self.segments[segment], kind)
        part = np.array(array if rows is None else array[rows])  # a copy: the map stays read-only
        t = torch.from_numpy(part)
        if self.key.dtype == "bfloat16" and kind in ("psi", "r"):
            t = t.view(torch.bfloat16)
        return t

    def locate(self, keys: Iterable[bytes]) -> Located:
        """Where each of ``keys`` is stored, verifying every segment read (its files' sha256, once
        per process); segments that fail are dropped (one warning) and their rows reported missing."""
        wanted = set(keys)
        dropped: list[str] = []
        found: dict[bytes, tuple[str, int]] = {}
        for segment in self.segments:
            if not self._segment_ok(segment):
                dropped.append(segment["name"])
                continue
            blob = np.asarray(self._load(segment, "keys")).tobytes()
            for row in range(int(segment["rows"])):
                key = blob[row * KEY_BYTES : (row + 1) * KEY_BYTES]
                if key in wanted and key not in found:
                    found[key] = (segment["name"], row)
        if dropped:
            warnings.warn(
                f"gradient store {self.folder}: segment(s) {', '.join(dropped)} missing a file or failing their "
                "sha256; dropped, their rows are computed again",
                stacklevel=2,
            )
            self._drop(dropped)
        index = {s["name"]: j for j, s in enumerate(self.segments)}
        return Located({key: (index[name], row) for key, (name, row) in found.items()}, dropped)

    # ------------------------------------------------------------------ building
    def estimate_bytes(self, n_rows: int) -> int:
        """Bytes ``n_rows`` new rows add: rows x (c' + 1) x k x itemsize, their keys and float64 losses,
        one k x k float64 curvature sum per segment, and the npy headers (128 bytes a file)."""
        key = self.key
        itemsize = torch.empty(0, dtype=getattr(torch, key.dtype)).element_size()
        segments = -(-int(n_rows) // self.segment_rows)
        return (
            n_rows * (key.columns + 1) * key.k * itemsize
            + n_rows * (KEY_BYTES + 8)
            + segments * (key.k * key.k * 8 + len(KINDS) * 128)
        )

    def check_space(self, n_rows: int) -> int:
        """The size estimate for ``n_rows`` new rows; refuses (FieldError on ``store``) when the
        disk holding the store has less free space than that."""
        need = self.estimate_bytes(n_rows)
        free = shutil.disk_usage(self.folder).free
        if need > free:
            raise FieldError(
                "store",
                "{name} "
                + literal(self.root)
                + f" needs about {need / 2**20:,.0f} MiB for {n_rows:,} new projected rows but its disk has "
                f"{free / 2**20:,.0f} MiB free; free some space, lower proj_dim or choose another folder",
            )
        return need

    def plan(self, n_rows: int) -> list[tuple[int, int]]:
        """[start, stop) of each new segment over ``n_rows`` missing rows (by position, nothing else)."""
        size = self.segment_rows
        return [(a, min(n_rows, a + size)) for a in range(0, n_rows, size)]

    def commit(self, keys: Sequence[bytes], arrays: SegmentArrays) -> None:
        """Write one segment (its files under temporary names, renamed) and then the manifest."""
        m = len(keys)
        k, cols = self.key.k, self.key.columns
        shapes = (arrays.psi.shape, arrays.r.shape, arrays.curvature.shape, arrays.loss.shape)
        if shapes != ((m, cols, k), (m, k), (k, k), (m,)):
            raise AuditError(
                f"a gradient store segment has shapes psi {arrays.psi.shape}, r {arrays.r.shape}, curvature "
                f"{arrays.curvature.shape}, loss {arrays.loss.shape}; expected ({m}, {cols}, {k}), ({m}, {k}), "
                f"({k}, {k}), ({m},)"
            )
        name = f"seg-{int(self.manifest['next_segment']):06d}"
        blob = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(m, KEY_BYTES)
        files = {}
        parts: tuple[np.ndarray, ...] = (
            blob,
            arrays.psi,
            arrays.r,
            arrays.curvature.astype(np.float64),
            arrays.loss.astype(np.float64),
        )
        for kind, array in zip(KINDS, parts):
            file = f"{name}.{kind}.npy"
            size, digest = _save_npy(self.folder / file, array)
            files[kind] = {"file": file, "bytes": size, "sha256": digest}
        self.manifest["segments"].append({"name": name, "rows": m, "files": files})
        self.manifest["next_segment"] = int(self.manifest["next_segment"]) + 1
        self._write_manifest()  # last: the segment exists for readers only now

    def build(
        self,
        keys: Sequence[bytes],
        segments: Iterable[SegmentArrays],
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Commit ``segments`` (the arrays of :meth:`plan`'s segments over ``keys``, in that order)
        one by one; ``progress(rows)`` after each. Returns the rows committed."""
        done = 0
        spans = self.plan(len(keys))
        for (a, b), arrays in zip(spans, segments):
            self.commit(keys[a:b], arrays)
            done += b - a
            if progress is not None:
                progress(b - a)
        return done


# ---------------------------------------------------------------------------------------------- Ray
def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise FieldError(
            "store_executor", "{name} ray needs Ray, which is not installed; install it with " + literal(RAY_INSTALL)
        ) from None
    return ray


#: the run's progress (``progress(label, total, unit)``, :mod:`attnaudit.analyses.result`) a store
#: build reports to, set by :func:`reporting` around a run; none: silent
_REPORTER: ContextVar[Callable[..., Any] | None] = ContextVar("store_progress", default=None)


@contextlib.contextmanager
def reporting(progress: Callable[..., Any] | None) -> Iterator[None]:
    """Store builds inside this block show their rows on ``progress`` (the run's progress bar)."""
    token = _REPORTER.set(progress)
    try:
        yield
    finally:
        _REPORTER.reset(token)


def build_progress(rows: int, estimate_bytes: int) -> contextlib.AbstractContextManager[Callable[[int], None]]:
    """The progress of building ``rows`` new rows (about ``estimate_bytes`` on disk): a line of the
    run's progress bar under :func:`reporting`, else silent."""
    progress = _REPORTER.get()
    if progress is None:
        return contextlib.nullcontext(lambda k=1: None)
    return progress(f"gradient store: {rows:,} new rows, about {estimate_bytes / 2**20:,.1f} MiB", rows, "")


def ray_map(
    fn: Callable[..., Any],
    shared: Any,
    jobs: Iterable[tuple],
    *,
    threads: int,
    workers: int | None = None,
    address: str | None = None,
) -> Iterator[Any]:
    """``fn(shared, *job, threads)`` for each job on Ray tasks, yielded in the jobs' order.

    ``shared`` goes through the object store once. A local Ray is started for the call
    (``workers`` x ``threads`` CPUs, default all) and shut down after, unless ``address`` names a
    running cluster (``auto`` finds one) or Ray is already initialised. At most 2 x ``workers``
    tasks are in flight (their results wait in order); a task whose worker dies is run again up to
    :data:`MAX_RETRIES` times. ``fn`` must be importable by name in the workers."""
    _import_ray()  # a missing Ray: the one-line error naming the extra
    with ray_session(address, (workers or max(1, (os.cpu_count() or 1) // threads)) * threads) as ray:
        cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1.0)))
        slots = workers or max(1, int(cpus // threads))
        remote = ray.remote(fn).options(num_cpus=min(threads, cpus), max_retries=MAX_RETRIES, retry_exceptions=False)
        ref = ray.put(shared)
        todo = iter(jobs)
        pending: deque = deque()
        for job in todo:
            pending.append(remote.remote(ref, *job, threads))
            if len(pending) >= 2 * slots:
                break
        at = 0
        while pending:
            head = pending.popleft()
            try:
                result = ray.get(head)
            except Exception as exc:  # noqa: BLE001 - a task that failed (or whose worker died) past its retries
                raise AuditError(
                    f"a Ray task building gradient store segment {at} failed after {MAX_RETRIES} retries: "
                    f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(remote.remote(ref, *nxt, threads))
            at += 1
            yield result
