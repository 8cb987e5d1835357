"""The on-disk gradient store of ``--estimator projected`` (``InfluenceConfig.store``).

The reference is the in-memory path (no store), itself checked against dense autograd in
test_projected_logra.py: a store-backed run must give the same scores (F is then summed per
segment, so equal to round-off, not to the bit). Reuse, resumption and repair are checked on
what the store reports and on the folder's bytes against a build that ran straight through."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from attnaudit.analyses.influence import store as st
from attnaudit.analyses.influence.estimators import projected as pj
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError, FieldError
from attnaudit.models.vit import ViT, ViTSpec

F64 = torch.float64
SEGMENT = 16  # rows per segment here: 40 training rows make 3 segments (16, 16, 8)


def _setup(n=40, n_test=6, seed=0):
    """A tiny ViT (P = 811), CE, 3 classes; random images."""
    spec = ViTSpec("vit", (1, 8, 8), 3, depth=1, dim=8, heads=2, patch=4, mlp_ratio=2, seed=seed)
    task = Task(ViT(spec, dtype=F64).eval(), 3, "ce", Inputs(kind="images", shape=(1, 8, 8)))
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n + n_test, 64, generator=g, dtype=F64)
    y = torch.randint(0, 3, (n + n_test,), generator=g)
    return task, X[:n], y[:n], X[n:], y[n:]


@pytest.fixture(autouse=True)
def _small_segments(monkeypatch):
    monkeypatch.setattr(st, "SEGMENT_ROWS", SEGMENT)
    pj.clear_row_cache()
    yield
    pj.clear_row_cache()


def _run(task, X, y, Xt, yt, **kw):
    """Projected influence per test point in a fresh in-process state (no cached rows, no
    remembered checksums), as a later process would start."""
    pj.clear_row_cache()
    cfg = InfluenceConfig(estimator="projected", proj_dim=48, damping=0.01, per_test=True, params="all", **kw)
    return compute_influence(task, X, y, Xt, yt, cfg)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())


def _folder(root: Path) -> Path:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_store_backed_scores_equal_in_memory_projected_influence(tmp_path):
    task, X, y, Xt, yt = _setup()
    ref = _run(task, X, y, Xt, yt)
    got = _run(task, X, y, Xt, yt, store=str(tmp_path))
    assert _close(got.per_test, ref.per_test)
    d = got.diagnostics
    assert d["store_rows_computed"] == 40 and d["store_rows_reused"] == 0
    manifest = json.loads((_folder(tmp_path) / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["segments"]] == [16, 16, 8]
    assert manifest["key"]["dtype"] == "float64" and manifest["key"]["k"] == d["proj_dim_used"]
    # the size estimate made before the build: rows x (c' + 1) x k x 8, keys and float64 losses, per
    # segment k x k x 8 and the headers of its 5 files
    k = d["proj_dim_used"]
    assert d["store_bytes_estimate"] == 40 * 4 * k * 8 + 40 * (28 + 8) + 3 * (k * k * 8 + 5 * 128)
    on_disk = sum(p.stat().st_size for p in _folder(tmp_path).iterdir())
    assert d["store_bytes"] == on_disk
    assert abs(on_disk - d["store_bytes_estimate"]) < 0.05 * on_disk  # the manifest and header slack only


def test_a_second_run_reads_every_row_and_computes_none(tmp_path, monkeypatch):
    task, X, y, Xt, yt = _setup()
    ref = _run(task, X, y, Xt, yt)
    _run(task, X, y, Xt, yt, store=str(tmp_path))

    def refuse(*args, **kwargs):
        raise AssertionError("a stored row was computed again")

    monkeypatch.setattr(pj, "store_segment", refuse)
    again = _run(task, X, y, Xt[:3], yt[:3], store=str(tmp_path))  # another test set, same training set
    assert again.diagnostics["store_rows_computed"] == 0 and again.diagnostics["store_rows_reused"] == 40
    # each row's loss is read back with its gradients: the model's cross-entropy on it, by plain torch
    with torch.no_grad():
        truth = torch.nn.functional.cross_entropy(task.module(X.reshape(-1, 1, 8, 8)), y, reduction="none")
    assert again.train_losses is not None and _close(again.train_losses, truth)
    assert ref.train_losses is not None and _close(ref.train_losses, truth)
    ref3 = _run(task, X, y, Xt[:3], yt[:3])
    assert _close(again.per_test, ref3.per_test)
    assert ref.per_test.shape[1] == 6


def test_changed_rows_are_the_only_ones_computed_and_repeats_count_twice(tmp_path):
    task, X, y, Xt, yt = _setup()
    _run(task, X, y, Xt, yt, store=str(tmp_path))
    X2 = X.clone()
    X2[[3, 17, 30]] = torch.rand(3, 64, generator=torch.Generator().manual_seed(9), dtype=F64)
    X2[5] = X2[4]  # a repeated row (same target too) is stored once and counted twice in F
    y2 = y.clone()
    y2[5] = y2[4]
    changed = _run(task, X2, y2, Xt, yt, store=str(tmp_path))
    d = changed.diagnostics
    assert d["store_rows_computed"] == 3 and d["store_rows_reused"] == 37
    assert _close(changed.per_test, _run(task, X2, y2, Xt, yt).per_test)
    # a subset of the stored rows (no whole segment): F from the rows' psi, nothing computed
    sub = _run(task, X[5:25], y[5:25], Xt, yt, store=str(tmp_path))
    assert sub.diagnostics["store_rows_computed"] == 0
    assert _close(sub.per_test, _run(task, X[5:25], y[5:25], Xt, yt).per_test)


def test_a_corrupted_segment_is_detected_dropped_and_recomputed(tmp_path):
    task, X, y, Xt, yt = _setup()
    ref = _run(task, X, y, Xt, yt)
    _run(task, X, y, Xt, yt, store=str(tmp_path))
    folder = _folder(tmp_path)
    psi = folder / "seg-000001.psi.npy"
    data = bytearray(psi.read_bytes())
    data[-5] ^= 0x01  # one bit of one number
    psi.write_bytes(bytes(data))
    key = st.StoreKey(**json.loads((folder / "manifest.json").read_text())["key"])
    assert st.GradientStore(tmp_path, key).verify() == ["seg-000001"]
    with pytest.warns(UserWarning, match="seg-000001"):
        repaired = _run(task, X, y, Xt, yt, store=str(tmp_path))
    d = repaired.diagnostics
    assert d["store_segments_dropped"] == ["seg-000001"]
    assert d["store_rows_computed"] == 16 and d["store_rows_reused"] == 24
    assert _close(repaired.per_test, ref.per_test)
    names = [s["name"] for s in json.loads((folder / "manifest.json").read_text())["segments"]]
    assert names == ["seg-000000", "seg-000002", "seg-000003"] and not psi.exists()
    assert st.GradientStore(tmp_path, key).verify() == []


def test_an_interrupted_build_resumes_with_the_rest_and_ends_byte_identical(tmp_path, monkeypatch):
    task, X, y, Xt, yt = _setup()
    straight = tmp_path / "straight"
    _run(task, X, y, Xt, yt, store=str(straight))

    resumed = tmp_path / "resumed"
    real = pj.projected_rows
    calls = []

    def dies_on_the_second_segment(engine, proj, rows, targets, curvature):
        calls.append(rows.shape[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process killed while the second segment is computed
        return real(engine, proj, rows, targets, curvature)

    monkeypatch.setattr(pj, "projected_rows", dies_on_the_second_segment)
    with pytest.raises(KeyboardInterrupt):
        _run(task, X, y, Xt, yt, store=str(resumed))
    monkeypatch.setattr(pj, "projected_rows", real)
    folder = _folder(resumed)
    assert [s["rows"] for s in json.loads((folder / "manifest.json").read_text())["segments"]] == [16]
    (folder / ".seg-000001.psi.npy.x1y2.tmp.npy").write_bytes(b"half a file")  # what a kill mid-write leaves
    (folder / "seg-000001.r.npy").write_bytes(b"renamed, not yet in the manifest")

    done = _run(task, X, y, Xt, yt, store=str(resumed))
    assert done.diagnostics["store_rows_computed"] == 24 and done.diagnostics["store_rows_reused"] == 16
    assert _files(folder) == _files(_folder(straight))
    assert _folder(straight).name == folder.name


def test_precision_projection_and_seed_key_different_stores(tmp_path):
    task, X, y, Xt, yt = _setup()
    folders = set()
    for kw in ({}, {"dtype": "float32"}, {"proj_dim": 40}, {"seed": 1}, {"proj_split": "params"}):
        cfg = {"proj_dim": 48, **kw}
        pj.clear_row_cache()
        res = compute_influence(
            task,
            X,
            y,
            Xt,
            yt,
            InfluenceConfig(estimator="projected", damping=0.01, params="all", store=str(tmp_path), **cfg),
        )
        assert res.diagnostics["store_rows_computed"] == 40, kw  # nothing shared with another key
        folders.add(res.diagnostics["store"])
    assert len(folders) == 5 and len(list(tmp_path.iterdir())) == 5
    f32 = [f for f in tmp_path.iterdir() if json.loads((f / "manifest.json").read_text())["key"]["dtype"] == "float32"]
    assert len(f32) == 1


def test_store_settings_are_checked_before_any_compute(tmp_path, monkeypatch):
    with pytest.raises(FieldError, match="estimator projected"):
        InfluenceConfig(estimator="ekfac", store=str(tmp_path))
    with pytest.raises(FieldError, match="curvature"):
        InfluenceConfig(estimator="projected", curvature="galerkin", store=str(tmp_path))
    with pytest.raises(FieldError, match="give store"):
        InfluenceConfig(estimator="projected", store_executor="ray")
    with pytest.raises(FieldError, match="local or ray"):
        InfluenceConfig(estimator="projected", store=str(tmp_path), store_executor="dask")
    with pytest.raises(FieldError, match="store_executor ray"):
        InfluenceConfig(estimator="projected", store=str(tmp_path), ray_address="auto")
    with pytest.raises(FieldError, match="positive integer"):
        InfluenceConfig(estimator="projected", store=str(tmp_path), store_executor="ray", store_workers=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FieldError, match="is a file"):
        InfluenceConfig(estimator="projected", store=str(tmp_path / "file"))
    # Ray missing: the error names the extra to install
    monkeypatch.setitem(sys.modules, "ray", None)
    task, X, y, Xt, yt = _setup(n=8, n_test=2)
    with pytest.raises(FieldError, match=r"attnaudit\[ray\]"):
        _run(task, X, y, Xt, yt, store=str(tmp_path / "s"), store_executor="ray")


def test_a_store_of_another_key_in_the_same_folder_is_refused(tmp_path):
    task, X, y, Xt, yt = _setup(n=8, n_test=2)
    _run(task, X, y, Xt, yt, store=str(tmp_path))
    folder = _folder(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["key"]["k"] = 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AuditError, match="another model or projection"):
        _run(task, X, y, Xt, yt, store=str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_a_ray_build_on_two_workers_is_byte_identical_to_the_local_build(tmp_path):
    task, X, y, Xt, yt = _setup()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run at the driver's thread count: one each on 2 cores
    try:
        local = _run(task, X, y, Xt, yt, store=str(tmp_path / "local1"))
        ray_run = _run(task, X, y, Xt, yt, store=str(tmp_path / "ray"), store_executor="ray", store_workers=2)
    finally:
        torch.set_num_threads(threads)
    assert ray_run.diagnostics["store_executor"] == "ray" and ray_run.diagnostics["store_rows_computed"] == 40
    assert _files(_folder(tmp_path / "ray")) == _files(_folder(tmp_path / "local1"))
    assert torch.equal(ray_run.per_test, local.per_test)
