"""NtkDistanceRequest from Python: errors name the field, presets and mode defaults (explicit beats
preset), the argv round trip, and a run on in-memory data."""

from __future__ import annotations

import pytest

from attnaudit.analyses.ntk_distance.run import (
    CHECKPOINT_DEFAULTS,
    PRESETS,
    TRANSFORMER_DEFAULTS,
    NtkDistanceRequest,
    run,
)
from attnaudit.analyses.request import FieldError, fields_named
from attnaudit.errors import AuditError

R = NtkDistanceRequest


def _error(**fields) -> FieldError:
    with pytest.raises(FieldError) as info:
        R(**fields)
    return info.value


def test_errors_name_the_field_in_python_and_the_flag_on_the_command_line():
    err = _error(seeds=0)
    assert err.field == "seeds" and str(err) == "seeds must be >= 1, got 0"
    assert str(fields_named(err, R)) == "--seeds must be >= 1, got 0"
    err = _error(steps=0)  # checked by the sweep's config, named by the request
    assert err.field == "steps" and str(err) == "steps must be >= 1, got 0"
    assert str(fields_named(err, R)) == "--steps must be >= 1, got 0"
    err = _error(n_train=1, n_test=5)
    assert err.field == "n_train" and str(err).startswith("n_train must be >= 2")
    assert _error(preset="huge").field == "preset"
    assert _error(models=("relu", "gelu")).field == "models"
    assert _error(widths=(9,)).field == "widths"
    assert _error(lr_fraction=1.5).field == "lr_fraction"
    assert _error(seed=-1).field == "seed"
    err = _error(arch=("vit",), optimizer="sgd")
    assert err.field == "lr" and "sgd needs lr:" in str(err)
    assert "needs --lr:" in str(fields_named(err, R))
    assert _error(arch=("mlp",)).field == "arch"
    assert _error(arch=("vit",), widths=(6,)).field == "widths"


def test_a_refusal_names_every_field_that_does_not_apply():
    err = _error(checkpoint=("m.safetensors",), widths=(8,), seeds=2)
    assert err.field == "widths"
    assert str(err).startswith("widths, seeds set how the sweeps train new networks") and str(err).endswith("drop them")
    assert str(fields_named(err, R)).startswith("--widths, --seeds set how")
    assert str(err.named("checks[0].options.widths")).startswith("checks[0].options.widths, checks[0].options.seeds")
    assert _error(arch=("vit",), models=("relu",)).field == "models"
    assert str(_error(linearized="train")).startswith("linearized apply to --checkpoint or --arch")
    assert _error(reference_checkpoint="x.safetensors").field == "reference_checkpoint"
    assert _error(checkpoint=("m.safetensors",), arch=("vit",)).field == "arch"


def test_presets_and_mode_defaults_explicit_beats_preset():
    quick = R().resolved()
    assert quick.preset == "quick" and quick.widths == PRESETS["quick"]["widths"] and quick.seeds == 3
    assert quick.models == ("relu", "attn") and quick.loss == "mse" and quick.dtype is None
    paper = R(preset="Paper", widths=(16, 64), n_test=50).resolved()
    assert paper.preset == "paper" and paper.widths == (16, 64) and paper.n_test == 50
    assert paper.n_train == PRESETS["paper"]["n_train"]
    assert R(preset="paper").resolve().analysis.float32_from_width == 1024
    assert R(preset="paper", dtype="float64").resolve().analysis.float32_from_width is None
    vit = R(arch=("ViT",)).resolved()
    assert vit.arch == ("vit",) and vit.widths == TRANSFORMER_DEFAULTS["widths"] and vit.optimizer == "adam"
    assert vit.lr == 1e-3 and vit.epochs == 5 and vit.batch_size == 64 and vit.preset is None
    gd = R(arch=("vit",), optimizer="gd", lr=0.1, steps=3).resolved()
    assert gd.batch_size is None and gd.epochs is None and gd.resolve().analysis.recipe.steps == 3
    ckpt = R(checkpoint=("m.safetensors",)).resolved()
    assert (ckpt.kernel_points, ckpt.n_test, ckpt.linearized) == tuple(CHECKPOINT_DEFAULTS.values())
    assert R().to_argv() == []  # the defaults stay None: nothing given, nothing to reproduce


def test_presets_are_the_documented_sizes():
    assert PRESETS["quick"]["widths"] == (16, 64, 256, 1024) and PRESETS["paper"]["widths"][-1] == 4096
    assert (PRESETS["paper"]["n_train"], PRESETS["paper"]["seeds"], PRESETS["paper"]["float32_from_width"]) == (
        500,
        3,
        1024,
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [
            "--preset",
            "paper",
            "--models",
            "relu",
            "--widths",
            "16,64",
            "--lr",
            "0.25",
            "--train-dtype",
            "float32",
            "--seed",
            "3",
        ],
        [
            "--checkpoint",
            "a.safetensors",
            "--checkpoint",
            "b.safetensors",
            "--n-test",
            "30",
            "--kernel-points",
            "16",
            "--reference-checkpoint",
            "init.safetensors",
        ],
        [
            "--arch",
            "vit,vit-linear",
            "--widths",
            "16,32",
            "--seeds",
            "3",
            "--steps",
            "4",
            "--lr",
            "0.1",
            "--linearized",
            "off",
            "--optimizer",
            "sgd",
            "--batch-size",
            "8",
        ],
        ["--n-train", "40", "--n-test", "20", "--save-models", "models", "--device", "cpu"],
    ],
)
def test_argv_round_trip(argv):
    request = R.from_argv(argv)
    assert sorted(request.to_argv()) == sorted(argv)
    assert R.from_argv(request.to_argv()) == request
    assert R.from_dict(request.to_dict()) == request


def test_a_sweep_on_in_memory_data_runs_locally():
    from attnaudit.data import DataSpec, load_dataset

    ds = load_dataset(DataSpec(dataset="digits", n=120, seed=0))
    request = R(loaded_data=ds, models=("relu",), widths=(8,), seeds=1, n_train=30, n_test=20, steps=3, device="cpu")
    result = run(request)
    assert result.to_dict()["command"] is None and result.failed_cells == []
    assert {(c["model"], c["width"]) for c in result.results["cells"]} == {("relu", 8)}
    assert result.to_dict()["inputs"]["n_train"] == 30
    with pytest.raises(AuditError, match="in-memory loaded_data"):
        request.command_line()
