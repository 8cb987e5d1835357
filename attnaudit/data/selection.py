"""Which rows: class filter, seeded (optionally stratified) subsets, the holdout split,
and the assembly of a :class:`~attnaudit.data.spec.Dataset` from a source."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from attnaudit.data.preprocess import ntk_scale_factor, preprocess_inplace
from attnaudit.data.spec import Dataset, DataSpec, Source, check_seed
from attnaudit.errors import AuditError, FieldError, is_int, literal, short_list, show_value


def _checksum(indices: np.ndarray) -> str:
    """First 12 hex digits of sha256 over the indices as little-endian int64."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()[:12]


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


def holdout_split(ds: Dataset, n_train: int, n_test: int, seed: int, stratify: bool = True) -> tuple[Dataset, Dataset]:
    """Two disjoint row subsets of ``ds`` of sizes n_train and n_test (each in original order).

    Stratified by label when ``stratify`` and ``ds`` is labelled (unlabelled data falls back
    to a uniform draw). The test rows are drawn from the rows left after the train draw.
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if not is_int(value) or value < 1:
            raise AuditError(f"{name} must be a positive integer, got {show_value(value, 80)}")
    check_seed(seed)
    if n_train + n_test > ds.n:
        raise AuditError(
            f"holdout split asks for {n_train} train + {n_test} test rows but {ds.name} has only {ds.n}; "
            "lower --n-train/--n-test or load more rows"
        )
    rng = np.random.default_rng(seed)
    # class labels only: a language model's next-token targets (n, 2L) have no strata
    labels = ds.y.cpu().numpy() if ds.y is not None and ds.y.ndim == 1 else None
    use_strata = stratify and labels is not None
    pool = np.arange(ds.n)
    train_idx = _choose(pool, labels, n_train, rng, use_strata)
    rest = np.setdiff1d(pool, train_idx, assume_unique=True)
    test_idx = _choose(rest, labels[rest] if labels is not None else None, n_test, rng, use_strata)
    return _rows(ds, train_idx, "train", seed, use_strata), _rows(ds, test_idx, "test", seed, use_strata)


def _rows(ds: Dataset, idx: np.ndarray, which: str, seed: int, use_strata: bool) -> Dataset:
    """The rows ``idx`` of ``ds`` as a Dataset whose info records how they were drawn."""
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


def subset(ds: Dataset, n: int, seed: int, stratify: bool = True) -> Dataset:
    """A seeded subset of n rows of ``ds`` (in original order; all rows when n >= ds.n),
    stratified by label when ``stratify`` and labelled. ``info['holdout']`` records the draw
    (``part``: ``subset``)."""
    if not is_int(n) or n < 1:
        raise AuditError(f"subset size must be a positive integer, got {show_value(n, 80)}")
    check_seed(seed)
    # class labels only: a language model's next-token targets (n, 2L) have no strata
    labels = ds.y.cpu().numpy() if ds.y is not None and ds.y.ndim == 1 else None
    use_strata = stratify and labels is not None
    idx = _choose(np.arange(ds.n), labels, n, np.random.default_rng(seed), use_strata)
    return _rows(ds, idx, "subset", seed, use_strata)


# --------------------------------------------------------------------------- assembly


def _select_rows(src: Source, spec: DataSpec, n: int | None, stratify: bool) -> np.ndarray:
    """Row indices into src after the class filter and subset (sorted)."""
    total = len(src.X)
    pool = np.arange(total)
    what = f"{src.name} ({spec.split})" if spec.data is None else src.name
    if spec.classes is not None:
        if src.y is None:
            raise FieldError(
                "classes", literal(what) + " has no labels, so {name} cannot be applied; drop {name} or add labels"
            )
        present = np.unique(src.y)
        absent = [c for c in spec.classes if c not in set(present.tolist())]
        if absent:
            raise FieldError(
                "classes",
                "{name} names label(s) "
                + literal(
                    f"{short_list(absent)} not present in {what}; labels present: {short_list(present.tolist())}"
                ),
            )
        pool = pool[np.isin(src.y, np.asarray(spec.classes))]
    if n is None:
        return pool
    if n > len(pool):
        scope = f" with classes {short_list(spec.classes, sep=',')}" if spec.classes is not None else ""
        raise FieldError(
            "n",
            "{name} " + literal(f"{n} is more than the {len(pool)} rows available in {what}{scope}") + "; lower {name}",
        )
    if stratify and src.y is None:
        raise FieldError("stratify", literal(what) + " has no labels, so {name} cannot be applied; drop {name}")
    rng = np.random.default_rng(spec.seed)
    return _choose(pool, src.y[pool] if src.y is not None else None, n, rng, stratify)


def assemble(src: Source, spec: DataSpec, n: int | None, stratify: bool) -> Dataset:
    """The :class:`Dataset` of ``src``'s rows that ``spec`` keeps (class filter, then ``n`` rows
    drawn with ``spec.seed``, per class when ``stratify``): float64 values (raw / scale), then
    preprocessed; ``info`` records the draw and the preprocessing."""
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
        value_range: tuple[float, float] = src.value_range
    else:
        value_range = (float(X.min()), float(X.max()))
    scale = ntk_scale_factor(X) if spec.preprocess == "ntk-scale" else None
    preprocess_inplace(X, spec.preprocess)
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
    if scale is not None:
        # one global scalar: the valid range (attack clipping) scales with the data
        info["preprocess_scale"] = scale
        info["preprocess_scale_rule"] = "x -> s x with s = sqrt(d / mean_i ||x_i||^2) over the loaded rows"
        info["mean_sq_norm_after"] = float(X.pow(2).sum()) / max(X.shape[0], 1)
        value_range = (value_range[0] * scale, value_range[1] * scale)
    if src.y is not None:
        labels, counts = np.unique(src.y[idx], return_counts=True)
        info["class_counts"] = {str(int(k)): int(c) for k, c in zip(labels, counts)}
    return Dataset(
        X=X,
        y=y,
        name=src.name,
        n_classes=src.n_classes,
        value_range=value_range if spec.preprocess in ("raw", "ntk-scale") else None,
        feature_shape=tuple(int(s) for s in src.X.shape[1:]),
        info=info,
    )
