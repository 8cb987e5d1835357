"""LandscapeRequest and AlignmentRequest from Python: field-named errors, presets, argv round trip."""

from __future__ import annotations

import pytest

from attnaudit.analyses.alignment.run import AlignmentRequest
from attnaudit.analyses.landscape.run import PRESETS, LandscapeRequest
from attnaudit.analyses.request import FieldError, fields_named


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"directions": "sideways"}, "directions", ["directions", "sideways"]),
        ({"points": 2}, "points", ["points must be 0 (skip) or >= 3"]),
        ({"preset": "huge"}, "preset", ["preset", "huge", "quick or paper"]),
        ({"models": ("relu", "gpt")}, "models", ["models", "gpt"]),
        ({"models": ("relu", "relu")}, "models", ["twice"]),
        ({"match_loss": "soon"}, "match_loss", ["auto or none"]),
        ({"match_loss": -1.0}, "match_loss", ["positive training loss"]),
        ({"optimizer": "sgd", "match_loss": 0.2}, "match_loss", ["full-batch GD"]),
        ({"batch_size": 8}, "batch_size", ["applies to --optimizer sgd or adam"]),
        ({"n_train": 1}, "n_train", ["n_train must be >= 2"]),
        ({"seeds": 0}, "seeds", ["seeds must be a positive integer"]),
        ({"seed": -1}, "seed", ["seed must be an integer"]),
        ({"loss": "hinge"}, "loss", ["hinge"]),
        ({"checkpoint": ("m.safetensors",), "models": ("relu",)}, "models", ["give one of them"]),
        ({"checkpoint": ("m.safetensors",), "width": 8, "steps": 3}, "width", ["width, --steps", "do not apply"]),
        ({"checkpoint": ("m.safetensors",), "seeds": 2}, "seeds", ["a saved model is one model"]),
        ({"memory_budget": 0.0}, "memory_budget", ["positive number of MiB"]),
        ({"lanczos_steps": 0}, "lanczos_steps", ["lanczos_steps must be >= 1"]),
        ({"lanczos_tol": 1.5}, "lanczos_tol", ["lanczos_tol must be in (0, 1)"]),
    ],
)
def test_landscape_errors_name_the_field(kwargs, field, words):
    with pytest.raises(FieldError) as info:
        LandscapeRequest(**kwargs)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)
    assert LandscapeRequest.flag_of(field) in str(fields_named(info.value, LandscapeRequest))


def test_landscape_explicit_beats_preset():
    quick = LandscapeRequest().resolved()
    assert (quick.dataset, quick.split, quick.n_train, quick.width, quick.steps, quick.lr, quick.seeds) == (
        "digits",
        "train",
        500,
        256,
        1000,
        4.0,
        3,
    )
    assert quick.match_loss == "auto" and quick.match_target == "auto"
    paper = LandscapeRequest(preset="paper", dataset="digits", n_train=100, seeds=2).resolved()
    assert (paper.dataset, paper.n_train, paper.seeds, paper.width) == ("digits", 100, 2, PRESETS["paper"]["width"])
    assert paper.match_loss == "none" and paper.match_target is None
    # an explicit "none" beats the quick preset's "auto"; sgd/adam train for fixed steps
    assert LandscapeRequest(match_loss="none").resolved().match_target is None
    assert LandscapeRequest(optimizer="sgd").resolved().match_target is None
    from attnaudit.core.fit import DEFAULT_ADAM_LR

    assert LandscapeRequest(optimizer="adam").resolved().lr == DEFAULT_ADAM_LR
    # a saved model is one seed and trains nothing
    saved = LandscapeRequest(checkpoint=("m.safetensors",)).resolved()
    assert saved.seeds == 1 and saved.width is None and saved.match_loss is None and saved.arch_list == ()
    # the data set follows the preset only when no data are given
    assert LandscapeRequest(preset="paper", data="x.npz").resolved().dataset is None
    assert LandscapeRequest(preset="paper").data_spec(0).dataset == "mnist"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--preset", "paper", "--split", "test", "--models", "relu", "--n-train", "40", "--match-loss", "none"],
        ["--match-loss", "0.25", "--seeds", "2", "--params", "W,a", "--keep-1d-params", "--precision", "float32"],
        ["--optimizer", "sgd", "--batch-size", "16", "--lr", "0.5", "--steps", "7", "--directions", "hessian"],
        ["--checkpoint", "a.safetensors", "--checkpoint", "b.safetensors", "--loss", "ce", "--grid", "0"],
        ["--memory-budget", "64.0", "--lanczos-steps", "40", "--lanczos-tol", "1e-06"],
    ],
)
def test_landscape_argv_round_trip(argv):
    req = LandscapeRequest.from_argv(argv)
    assert LandscapeRequest.from_argv(req.to_argv()) == req
    assert sorted(req.to_argv()) == sorted(argv)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"k": 0}, "k"),
        ({"ridge": -1.0}, "ridge"),
        ({"targets": ("principal", "nope")}, "targets"),
        ({"preset": "huge"}, "preset"),
        ({"match_loss": 1.5}, "match_loss"),
        ({"lr_fraction": 1.0}, "lr_fraction"),
        ({"n_test": 0}, "n_test"),
        ({"attn_scaling": "huge"}, "attn_scaling"),
        ({"lr": 0.0}, "lr"),
        ({"seeds": 0}, "seeds"),
        ({"rank_tol": 2.0}, "rank_tol"),
    ],
)
def test_alignment_errors_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as info:
        AlignmentRequest(**kwargs)
    assert info.value.field == field and str(info.value).startswith(("unknown " + field, field))
    assert AlignmentRequest.flag_of(field) in str(fields_named(info.value, AlignmentRequest))


def test_alignment_presets_and_argv_round_trip():
    r = AlignmentRequest().resolved()
    assert (r.dataset, r.split, r.n_train, r.n_test, r.width, r.steps, r.match_loss, r.preprocess) == (
        "digits",
        "train",
        500,
        300,
        256,
        2000,
        0.1,
        "center",
    )
    p = AlignmentRequest(preset="paper", n_test=50, match_loss=0.2).resolved()
    assert (p.dataset, p.n_train, p.n_test, p.match_loss) == ("mnist", 1000, 50, 0.2)
    cfg = AlignmentRequest(targets=("random", "principal"), seeds=2, seed=4).resolve()
    assert cfg.targets == ("principal", "random") and cfg.seeds == (4, 5)
    for argv in (
        [],
        ["--preset", "paper", "--no-nets", "--targets", "principal,random", "--ridge", "0.01"],
        ["--preprocess", "raw", "--seeds", "2", "--lr", "3.0", "--rank-tol", "1e-06"],
    ):
        req = AlignmentRequest.from_argv(argv)
        assert AlignmentRequest.from_argv(req.to_argv()) == req and sorted(req.to_argv()) == sorted(argv)


def test_runs_from_python_on_loaded_data():
    """A request holding an in-memory data set runs without any file or command line."""
    from attnaudit.analyses.alignment.run import run as run_alignment
    from attnaudit.analyses.landscape.run import run as run_landscape
    from attnaudit.data import DataSpec, load_dataset

    ds = load_dataset(DataSpec(dataset="digits", n=150, seed=0, stratify=True))
    res = run_alignment(AlignmentRequest(loaded_data=ds, n_train=60, n_test=30, seeds=2, nets=False, k=3, device="cpu"))
    assert res.schema == "attnaudit.alignment/1" and res.report["command"] is None
    assert res.report["inputs"]["n_train"] == 60 and res.report["seeds"]["seeds"] == [0, 1]
    res = run_landscape(
        LandscapeRequest(
            loaded_data=ds,
            models=("relu",),
            n_train=50,
            width=8,
            steps=5,
            seeds=1,
            points=0,
            grid=0,
            eigenvalues=1,
            hutchinson_samples=2,
            basin_directions=1,
            device="cpu",
        )
    )
    assert list(res.results["models"]) == ["relu"] and res.results["models"]["relu"]["n_samples"] == 50
    assert res.results["dataset"]["holdout"]["n"] == 50
    assert res.report["inputs"]["match_loss"] == "auto"
    with pytest.raises(FieldError) as info:
        run_landscape(
            LandscapeRequest(loaded_data=ds, models=("relu",), n_train=500, width=8, steps=5, seeds=1, device="cpu")
        )
    assert info.value.field == "n_train"
