"""``malleability --store``: the projected estimator's gradient store through the request, reused by a
second run of the same protocol (every training row read, none computed) and refused for an
estimator that has no projected rows."""

from __future__ import annotations

import json

import pytest

from attnaudit.analyses.malleability.run import MalleabilityRequest
from attnaudit.analyses.registry import run
from attnaudit.errors import FieldError

TINY = dict(
    models=("relu",),
    n_train=40,
    n_test=10,
    seeds=1,
    steps=10,
    width=8,
    attacks=("pgd",),
    top_k=(5,),
    pgd_steps=2,
    controls=False,
    match_loss="none",
    estimator="projected",
    proj_dim=32,
)


def _diagnostics(results: dict) -> dict:
    return {row["role"]: row for row in results["influence_diagnostics"]}


def test_a_second_run_reads_every_training_row_from_the_store(tmp_path):
    store = tmp_path / "store"
    first = _diagnostics(run(MalleabilityRequest(**TINY, store=str(store))).results)
    second = _diagnostics(run(MalleabilityRequest(**TINY, store=str(store))).results)
    plain = _diagnostics(run(MalleabilityRequest(**TINY)).results)
    for role in ("clean", "pgd@0.3"):
        assert first[role]["store_rows_computed"] == 40 and first[role]["store_rows_reused"] == 0
        assert second[role]["store_rows_computed"] == 0 and second[role]["store_rows_reused"] == 40
        assert "store" not in plain[role]
    assert any(store.rglob("manifest.json"))


def test_the_store_is_for_the_projected_estimator(tmp_path):
    with pytest.raises(FieldError) as err:
        MalleabilityRequest(**{**TINY, "estimator": "exact"}, store=str(tmp_path / "s"))
    assert err.value.field == "store"


def test_a_bfloat16_store_is_reused_and_kept_apart_from_float32(tmp_path):
    """bfloat16 rows (which numpy lacks: stored as their int16 bits) are found again by a second
    run; a float32 run of the same protocol gets a store of its own."""
    store = tmp_path / "store"
    for _ in range(2):
        last = _diagnostics(run(MalleabilityRequest(**TINY, store=str(store), precision="bfloat16")).results)
    assert last["clean"]["store_rows_reused"] == 40 and last["clean"]["store_rows_computed"] == 0
    f32 = _diagnostics(run(MalleabilityRequest(**TINY, store=str(store), precision="float32")).results)
    assert f32["clean"]["store_rows_computed"] == 40
    # the clean model and the model retrained on the PGD rows, at each precision: four stores
    dtypes = sorted(json.loads(m.read_text())["key"]["dtype"] for m in store.glob("*/manifest.json"))
    assert dtypes == ["bfloat16", "bfloat16", "float32", "float32"]
