"""MalleabilityRequest from Python: presets (explicit beats preset), field-named errors, argv round trips."""

from __future__ import annotations

import pytest

from attnaudit.analyses.malleability.run import MalleabilityRequest as R
from attnaudit.analyses.request import FieldError


def test_presets_resolve_and_explicit_values_win():
    # the protocol as docs/malleability.md states it (an independent statement of the numbers)
    stated = {
        "quick": dict(
            dataset="digits", n_train=300, n_test=100, width=64, steps=300, seeds=3, top_k=(30,), match_loss="auto"
        ),
        "paper": dict(
            dataset="mnist", n_train=2000, n_test=500, width=64, steps=400, seeds=5, top_k=(200,), match_loss="none"
        ),
    }
    for name, expected in stated.items():
        v = R(preset=name).resolve_preset()
        assert {k: v[k] for k in expected} == expected, name
        assert v["eps"] == (0.3,) and v["damping"] == (1e-3,) and v["pgd_steps"] == 10 and v["lr"] == 4.0
    v = R(preset="paper", n_train=100, eps=0.1, match_loss="none", dataset="digits").resolve_preset()
    assert (v["n_train"], v["eps"], v["match_loss"], v["dataset"], v["n_test"]) == (100, (0.1,), "none", "digits", 500)
    assert R(match_loss="none").resolve_preset()["match_loss"] == "none"  # an explicit none beats quick's auto
    assert R(optimizer="adam").resolve_preset()["lr"] == pytest.approx(1e-3)
    assert R(data="x.npz").resolve_preset()["dataset"] is None  # user data: the preset's data set does not apply
    assert (
        R(checkpoint=("m.safetensors",)).resolve_preset()["match_loss"] is None
    )  # a saved model is not trained to a loss


@pytest.mark.parametrize(
    "kwargs,field,text",
    [
        (dict(seeds=0), "seeds", "seeds must be >= 1, got 0"),
        (dict(preset="huge"), "preset", "unknown preset 'huge'"),
        (dict(eps=(0.3, -1.0)), "eps", "eps values must be positive numbers"),
        (dict(models="relu,bert"), "models", "unknown model(s) bert in models"),
        (dict(damping="-1"), "damping", "damping values must be numbers >= 0"),
        (dict(top_k=(10, 10)), "top_k", "top_k lists a value twice"),
        (dict(n_test=0), "n_test", "n_test must be a positive integer"),
        (dict(lr="relu=1,bert=2"), "lr", "lr names model(s) bert"),
        (dict(protocol="finetune"), "protocol", "protocol finetune fine-tunes a saved model"),
        (dict(checkpoint=("m.safetensors",), steps=3), "steps", "steps set how new models are trained"),
        (
            dict(checkpoint=("m.safetensors",), models=("relu",)),
            "models",
            "a checkpoint is audited as saved and models trains new ones",
        ),
    ],
)
def test_errors_name_the_field(kwargs, field, text):
    with pytest.raises(FieldError) as err:
        R(**kwargs)
    assert err.value.field == field and text in str(err.value), str(err.value)
    assert R.flag_of(field) in str(err.value.named(R.flag_of(field)))  # the command line names the flag


def test_python_values_take_the_command_line_form():
    r = R(eps=0.3, top_k=30, lr=4, damping="1e-3x", attacks="pgd,random", match_loss="AUTO")
    assert (r.eps, r.top_k, r.lr, r.damping, r.attacks, r.match_loss) == (
        (0.3,),
        (30,),
        4.0,
        ("0.001x",),
        ("pgd", "random"),
        "auto",
    )
    assert R(lr={"relu": 10, "attn": 8}).lr == {"relu": 10.0, "attn": 8.0}


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [
            "--preset",
            "paper",
            "--lr",
            "relu=10,attn=8",
            "--match-loss",
            "none",
            "--damping",
            "1e-3,1e-2x",
            "--eps",
            "0.1,0.3",
            "--top-k",
            "10,30",
            "--no-controls",
            "--resample-data",
        ],
        [
            "--checkpoint",
            "a.safetensors",
            "--checkpoint",
            "b.safetensors",
            "--protocol",
            "finetune",
            "--finetune-lr",
            "0.01",
            "--controls",
        ],
        [
            "--dataset",
            "mnist",
            "--split",
            "test",
            "--optimizer",
            "adam",
            "--batch-size",
            "8",
            "--match-loss",
            "relu=0.1,attn=0.2",
        ],
    ],
)
def test_argv_round_trip(argv):
    r = R.from_argv(argv)
    assert R.from_argv(r.to_argv()) == r and R.from_dict(r.to_dict()) == r
    assert R.from_argv(r.to_argv()).to_argv() == r.to_argv()
