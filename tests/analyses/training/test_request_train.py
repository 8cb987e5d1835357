"""TrainRequest from Python: field-named errors, presets per family, argv round trip, no silent overwrite."""

from __future__ import annotations

import pytest

from attnaudit.analyses.registry import request_type
from attnaudit.analyses.request import FieldError
from attnaudit.analyses.training.run import TrainRequest, run


def test_registry_and_default_request():
    assert request_type("train") is TrainRequest
    r = TrainRequest()
    assert (r.dataset, r.split, r.arch, r.out_path) == ("digits", "train", "vit", None)
    assert r.to_argv() == [] and TrainRequest.from_argv([]) == r


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        (dict(arch="lstm"), "arch", "unknown arch 'lstm'"),
        (
            dict(arch="relu", dim=8, patch=4),
            "dim",
            "dim sets the size of the transformers (vit, vit-linear), not of arch relu; drop it (so do patch)",
        ),
        (dict(arch="vit", width=8), "width", "width sets the size of the 2-layer nets"),
        (dict(optimizer="sgd"), "lr", "optimizer sgd needs lr"),
        (dict(lr=-1.0), "lr", "lr must be a positive number"),
        (dict(epochs=1, steps=2), "epochs", "epochs and steps both say how long to train"),
        (dict(arch="relu", batch_size=8), "batch_size", "batch_size does not apply to the gd optimizer"),
        (dict(momentum=0.9), "momentum", "momentum applies to the sgd optimizer"),
        (dict(dtype="float16"), "dtype", "unknown dtype 'float16'"),
        (dict(seed=-3), "seed", "seed must be an integer"),
        (dict(n_test=0), "n_test", "n_test must be a positive integer"),
        (dict(out_path="m.pt"), "out_path", "out_path m.pt: checkpoints are safetensors files"),
    ],
)
def test_errors_name_the_field(kwargs, field, text):
    with pytest.raises(FieldError) as err:
        TrainRequest(**kwargs)
    assert err.value.field == field and text in str(err.value), str(err.value)
    flag = TrainRequest.flag_of(field)
    assert flag in str(err.value.named(flag))


def test_family_presets_explicit_beats_preset():
    vit = TrainRequest().resolved()
    assert (vit.optimizer, vit.lr, vit.batch_size, vit.epochs, vit.steps, vit.loss, vit.dtype) == (
        "adam",
        1e-3,
        64,
        5,
        None,
        "ce",
        "float32",
    )
    assert (vit.depth, vit.dim, vit.heads, vit.mlp_ratio, vit.patch, vit.width) == (2, 64, 4, 2, None, None)
    relu = TrainRequest(arch="RELU", steps=20, width=8).resolved()
    assert (relu.arch, relu.optimizer, relu.lr, relu.batch_size, relu.steps, relu.epochs, relu.loss, relu.width) == (
        "relu",
        "gd",
        4.0,
        None,
        20,
        None,
        "mse",
        8,
    )
    sgd = TrainRequest(arch="attn", optimizer="sgd", lr=0.1)
    assert sgd.recipe().batch_size == 64 and sgd.recipe().steps == 300


@pytest.mark.parametrize(
    "argv",
    [
        ["--lr", "0.5", "--out", "m.safetensors", "--arch", "relu", "--width", "8", "--steps", "20"],
        [
            "--lr",
            "0.01",
            "--batch-size",
            "32",
            "--epochs",
            "2",
            "--n-test",
            "100",
            "--dtype",
            "float64",
            "--device",
            "cpu",
            "--seed",
            "3",
            "--dataset",
            "mnist",
            "--split",
            "test",
            "--classes",
            "0,1",
            "--out",
            "v.safetensors",
            "--arch",
            "vit-linear",
            "--patch",
            "4",
            "--optimizer",
            "sgd",
            "--momentum",
            "0.9",
        ],
    ],
)
def test_argv_round_trip(argv):
    r = TrainRequest.from_argv(argv)
    assert r.to_argv() == argv and TrainRequest.from_argv(r.to_argv()) == r
    assert TrainRequest.from_dict(r.to_dict()) == r


def test_overwrite_is_internal_and_required_to_replace(tmp_path):
    assert "overwrite" not in TrainRequest.options()
    target = tmp_path / "m.safetensors"
    r = TrainRequest(out_path=str(target), overwrite=True)
    assert r.to_argv() == ["--out", str(target)]  # an output permission, not part of what is trained
    with pytest.raises(FieldError) as err:
        TrainRequest().checkpoint_paths()
    assert err.value.field == "out_path"
    (tmp_path / "m.safetensors.json").write_text("{}")
    with pytest.raises(FieldError) as err:
        run(TrainRequest(out_path=str(target), arch="relu", steps=1, width=4, n_train=20, n_test=10))
    assert err.value.field == "overwrite" and "already exists" in str(err.value) and not target.exists()
    result = run(
        TrainRequest(out_path=str(target), arch="relu", steps=1, width=4, n_train=20, n_test=10, overwrite=True)
    )
    assert target.exists() and result.report["request"]["options"]["out_path"] == str(target)
    assert result.results["fit"]["steps_run"] == 1
