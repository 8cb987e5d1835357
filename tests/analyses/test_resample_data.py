"""--resample-data on ntk-distance and landscape, and the scorecard plan that uses it.

With the flag, model seed s trains and is measured on its own rows: the rows a run whose
base seed is s uses. The independent check is that run itself: seed s's cells of a
resampled run equal a separate one-seed run with ``--seed s``. Without the flag every seed
shares the base seed's split (the numbers are those of the code before the flag; here we
check the recorded protocol), and the flag is refused where no rows can be redrawn.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from attnaudit.analyses.registry import check_argv, run_argv
from attnaudit.analyses.request import FieldError, request_type
from attnaudit.claims import plan as P
from attnaudit.cli import app

runner = CliRunner()

NTK = ["--preset", "quick", "--widths", "8,32", "--n-train", "30", "--n-test", "20", "--steps", "20"]
LANDSCAPE = [
    "--n-train",
    "60",
    "--width",
    "16",
    "--steps",
    "30",
    "--match-loss",
    "none",  # a fixed budget: an auto target depends on every seed, so a one-seed run would stop elsewhere
    "--points",
    "3",
    "--grid",
    "0",
    "--eigenvalues",
    "2",
    "--hutchinson-samples",
    "4",
    "--basin-directions",
    "2",
]
NTK_ROWS = ("train_data_sha256", "test_data_sha256")


def _cells(report: dict, seed: int) -> list[dict]:
    """One seed's cells without their run time."""
    return [{k: v for k, v in c.items() if k != "seconds"} for c in report["results"]["cells"] if c["seed"] == seed]


@pytest.fixture(scope="module")
def ntk_resampled() -> dict:
    return run_argv("ntk-distance", [*NTK, "--seeds", "2", "--resample-data"])


@pytest.fixture(scope="module")
def landscape_resampled() -> dict:
    return run_argv("landscape", [*LANDSCAPE, "--seeds", "2", "--resample-data"])


# ----------------------------------------------------------------------------- ntk-distance
def test_ntk_resampled_seeds_train_on_their_own_rows(ntk_resampled):
    rep = ntk_resampled
    rows = rep["results"]["rows_by_seed"]
    assert [r["seed"] for r in rows] == [0, 1] and [r["split_seed"] for r in rows] == [0, 1]
    for key in (*NTK_ROWS, "train_indices_sha256"):
        assert rows[0][key] != rows[1][key], key
    assert rep["seeds"]["holdout_seed"] == "per model seed" and rep["seeds"]["holdout_seeds"] == [0, 1]
    assert rep["inputs"]["resample_data"] is True and rep["results"]["config"]["resample_data"] is True
    assert "--resample-data" in rep["command"]
    # each seed's own analytic kernel: its lr rule and diagnostics come from its rows
    per_seed = rep["results"]["models"]["relu"]["kernel_by_seed"]
    assert [k["seed"] for k in per_seed] == [0, 1]
    assert per_seed[0]["lr_by_width"] != per_seed[1]["lr_by_width"]
    for s in (0, 1):
        assert {c["lr"] for c in _cells(rep, s) if c["model"] == "relu"} == set(per_seed[s]["lr_by_width"].values())


def test_ntk_resampled_seed_equals_a_run_with_that_base_seed(ntk_resampled):
    alone = run_argv("ntk-distance", [*NTK, "--seeds", "1", "--seed", "1"])
    assert alone["seeds"]["holdout_seeds"] == [1]
    mine = _cells(ntk_resampled, 1)
    assert len(mine) == 4 and mine == _cells(alone, 1)  # every number, bit for bit
    assert ntk_resampled["results"]["rows_by_seed"][1] == alone["results"]["rows_by_seed"][0]
    first = ntk_resampled["results"]["models"]["relu"]["kernel_by_seed"][1]
    assert first["condition_number"] == alone["results"]["models"]["relu"]["condition_number"]


def test_ntk_without_the_flag_every_seed_shares_one_split():
    rep = run_argv("ntk-distance", [*NTK, "--seeds", "2", "--widths", "8", "--models", "relu"])
    rows = rep["results"]["rows_by_seed"]
    assert [r["split_seed"] for r in rows] == [0, 0]
    assert all(rows[1][k] == rows[0][k] for k in (*NTK_ROWS, "train_indices_sha256"))
    assert rep["seeds"]["holdout_seed"] == 0 and rep["seeds"]["holdout_seeds"] == [0, 0]
    assert rep["inputs"]["resample_data"] is False and rep["results"]["models"]["relu"]["kernel_by_seed"] == []


# ----------------------------------------------------------------------------- landscape
def test_landscape_resampled_seeds_train_on_their_own_rows(landscape_resampled):
    rep = landscape_resampled
    rows = rep["results"]["rows_by_seed"]
    assert [r["seed"] for r in rows] == [0, 1] and [r["subset_seed"] for r in rows] == [0, 1]
    assert rows[0]["train_data_sha256"] != rows[1]["train_data_sha256"]
    assert rows[0]["indices_sha256"] != rows[1]["indices_sha256"]
    assert rep["seeds"]["subset_seed"] == "per model seed" and rep["seeds"]["subset_seeds"] == [0, 1]
    assert rep["inputs"]["resample_data"] is True and "--resample-data" in rep["command"]


def test_landscape_resampled_seed_equals_a_run_with_that_base_seed(landscape_resampled):
    alone = run_argv("landscape", [*LANDSCAPE, "--seeds", "1", "--seed", "1"])
    assert landscape_resampled["results"]["rows_by_seed"][1] == alone["results"]["rows_by_seed"][0]
    for model in ("relu", "attn"):
        mine = landscape_resampled["results"]["models"][model]["seeds"]
        theirs = alone["results"]["models"][model]
        assert mine["values"][1] == theirs["seeds"]["values"][0], model  # every number, bit for bit
        assert mine["training"][1] == theirs["training"], model


def test_landscape_without_the_flag_every_seed_shares_one_subset():
    rep = run_argv("landscape", [*LANDSCAPE, "--seeds", "2", "--models", "relu", "--points", "0"])
    rows = rep["results"]["rows_by_seed"]
    assert [r["subset_seed"] for r in rows] == [0, 0] and rows[0] == {**rows[1], "seed": 0}
    assert rep["seeds"]["subset_seed"] == 0 and rep["seeds"]["subset_seeds"] == [0, 0]
    assert rep["inputs"]["resample_data"] is False


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    from attnaudit.data import DataSpec, load_dataset
    from attnaudit.models.builtin import ModelSpec, build_model, save_model

    ds = load_dataset(DataSpec(dataset="digits", n=60, seed=0, stratify=True))
    net = build_model(ModelSpec("relu", ds.d, 8, ds.n_classes, seed=0), ds.X)
    return str(save_model(net, tmp_path_factory.mktemp("saved") / "relu.safetensors"))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ntk-distance", "--checkpoint", "{model}"], "a saved model was not trained on"),
        (["ntk-distance", "--arch", "vit"], "transformer sweep"),
        (["landscape", "--checkpoint", "{model}"], "a saved model was not trained on"),
    ],
)
def test_the_flag_is_refused_without_rows_to_redraw(saved_model, args, needle):
    argv = [a.replace("{model}", saved_model) for a in args]
    res = runner.invoke(app, [*argv, "--resample-data", "--quiet"])
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "--resample-data" in text and needle in text and "drop it" in text, text


@pytest.mark.parametrize("command", ["ntk-distance", "landscape"])
def test_the_flag_is_refused_with_loaded_data(digits, command):
    """Rows handed in as a Dataset have no recipe to redraw them from."""
    from attnaudit.data import Dataset

    X, y, _, _ = digits
    data = Dataset(X=X, y=y, name="mine", n_classes=10, value_range=(0.0, 1.0), feature_shape=(64,), info={})
    kind = request_type(command)
    kind(loaded_data=data, n_train=20)  # the same request without the flag is fine
    with pytest.raises(FieldError, match="loaded data") as info:
        kind(loaded_data=data, n_train=20, resample_data=True)
    assert info.value.field == "resample_data"


# ----------------------------------------------------------------------------- the plan
RESAMPLED = ("ntk-distance", "malleability", "landscape")


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_plan_resamples_every_run_that_can(mode):
    data = ["--dataset", "digits", "--split", "train"]
    for resample in (True, False):
        runs, variants = P.plan(mode, data, 0, n_seeds=3, resample=resample)
        for r in runs:
            check_argv(r.command, list(r.args))  # every command line parses and validates
        flagged = {r.id for r in runs if "--resample-data" in r.args}
        name, rid = variants[-1]
        # the variant rows keep their order and ids, this one appended last
        assert [v for _, v in variants] == ["malleability", *(f"malleability-v{i}" for i in range(1, len(variants)))]
        if resample:
            assert {"ntk", "malleability", "landscape"} <= flagged
            assert flagged == {r.id for r in runs if r.command in RESAMPLED} - {rid}
            assert name == "fixed data split (seeds replicate the initialisation only)"
        else:
            assert flagged == {rid} and name == "data split resampled per seed"
    assert P.plan(mode, data, 0, n_seeds=3) == P.plan(mode, data, 0, n_seeds=3, resample=True)  # the default


def test_plan_resample_variant_keeps_the_matched_loss():
    runs, variants = P.plan("quick", [], 0, n_seeds=3, match_loss=0.05)
    rid = variants[-1][1]
    args = next(r.args for r in runs if r.id == rid)
    assert ("--match-loss", "0.05") in list(zip(args, args[1:]))
