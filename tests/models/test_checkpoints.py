"""Loading users' models: --factory + --weights, pickle refusal, weight/key/shape checks,
data fit, and the audit of a user module end to end through the CLI."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from attnaudit.models.checkpoints import fit_to_data, load_checkpoint, load_factory
from attnaudit.data import DataSpec, load_dataset
from attnaudit.errors import AuditError
from attnaudit.models.weights import load_into, match_state_dict, read_weights

runner = CliRunner()

USER_MODULE = textwrap.dedent(
    '''
    import torch
    from torch import nn


    class Net(nn.Module):
        """A user's module: images (B, 1, 8, 8) in, a dict with logits out."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, stride=2, padding=1)
            self.classifier = nn.Linear(2 * 4 * 4, 10)

        def forward(self, images):
            return {"logits": self.classifier(torch.relu(self.conv(images)).flatten(1))}


    def build():
        torch.manual_seed(0)
        return Net()


    def not_a_module():
        return 42


    def broken():
        raise ValueError("boom")


    CONSTANT = 3
    '''
)


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A temporary package ``userpkg.models`` on sys.path, removed after the test."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def app():
    from attnaudit.cli import app as typer_app

    return typer_app


def _weights(tmp_path, **changes):
    """Weights of userpkg.models:build with a different init, optionally altered."""
    sys_path = list(sys.path)
    try:
        sys.path.insert(0, str(tmp_path))
        from userpkg.models import Net  # noqa: PLC0415 - the temporary package
    finally:
        sys.path[:] = sys_path
    torch.manual_seed(123)
    state = {k: v.clone() for k, v in Net().state_dict().items()}
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del state[key]
        else:
            state[key] = value
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    return path, state


def test_factory_loads_the_given_weights_exactly(user_package):
    path, state = _weights(user_package)
    loaded = load_factory("userpkg.models:build", path)
    for name, tensor in loaded.module.state_dict().items():
        assert torch.equal(tensor, state[name]), name  # the file's values, not the factory's init
    assert loaded.source["kind"] == "factory" and len(loaded.source["sha256"]) == 64
    assert not loaded.module.training
    ds = load_dataset(DataSpec(dataset="digits", n=20, seed=0))
    fitted = fit_to_data(loaded, ds)
    assert fitted.inputs.kind == "images" and fitted.inputs.shape == (1, 8, 8) and fitted.n_classes == 10
    # the logits the task computes are the module's own on images built from the rows
    images = ds.X[:5].to(torch.float32).reshape(5, 1, 8, 8)
    with torch.no_grad():
        expected = loaded.module(images)["logits"]
    torch.testing.assert_close(fitted.task("ce").logits(ds.X[:5].to(torch.float32)), expected)


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        ("userpkg.models", "package.module:function"),
        ("userpkg.nothere:build", "cannot import module 'userpkg.nothere'"),
        ("userpkg.models:missing", "has no attribute 'missing'"),
        ("userpkg.models:CONSTANT", "not a function"),
        ("userpkg.models:not_a_module", "returned a int, not a torch.nn.Module"),
        ("userpkg.models:broken", "calling it failed (ValueError: boom)"),
    ],
)
def test_factory_failures_name_the_problem(user_package, factory, needle):
    with pytest.raises(AuditError) as err:
        load_factory(factory)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_weights_that_do_not_fit_are_named(user_package):
    path, _ = _weights(user_package, conv__bias=None)
    with pytest.raises(AuditError, match=r"missing key\(s\) \(conv\.bias\)"):
        load_factory("userpkg.models:build", path)
    path, state = _weights(user_package, extra__weight=torch.zeros(2))
    with pytest.raises(AuditError, match=r"unexpected key\(s\) \(extra\.weight\)"):
        load_factory("userpkg.models:build", path)
    path, _ = _weights(user_package, classifier__weight=torch.zeros(3, 32))
    with pytest.raises(AuditError) as err:
        load_factory("userpkg.models:build", path)
    assert "classifier.weight" in str(err.value) and "(3, 32)" in str(err.value) and "(10, 32)" in str(err.value)
    path, _ = _weights(user_package, conv__weight=torch.full((2, 1, 3, 3), float("nan")))
    with pytest.raises(AuditError, match="non-finite"):
        load_factory("userpkg.models:build", path)


def test_truncated_safetensors_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.randn(50, 50)}, str(path))
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(AuditError, match="not a readable .safetensors file"):
        read_weights(path)


class _Marker:
    """Unpickling this would create a marker file (arbitrary code execution)."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_pickle_needs_trust_and_then_only_weights(tmp_path, suffix):
    marker = tmp_path / "pwned"
    evil = tmp_path / f"evil{suffix}"
    evil.write_bytes(pickle.dumps({"w": _Marker(str(marker))}))
    with pytest.raises(AuditError) as err:
        read_weights(evil)
    assert "can run arbitrary code" in str(err.value) and "--trust-pickle" in str(err.value)
    assert not marker.exists()
    with pytest.raises(AuditError, match=r"weights_only=True"):
        read_weights(evil, trust_pickle=True)
    assert not marker.exists()
    with pytest.raises(AuditError, match="arbitrary code"):
        load_checkpoint(evil)
    assert not marker.exists()


def test_trusted_pickle_state_dict_loads(user_package):
    path, state = _weights(user_package)
    pt = user_package / "w.pt"
    torch.save({"state_dict": state}, pt)
    with pytest.raises(AuditError, match="arbitrary code"):
        load_factory("userpkg.models:build", pt)
    loaded = load_factory("userpkg.models:build", pt, trust_pickle=True)
    assert torch.equal(loaded.module.classifier.weight, state["classifier.weight"])


def test_checkpoint_path_errors(tmp_path):
    bare = tmp_path / "bare.safetensors"
    save_file({"w": torch.zeros(2)}, str(bare))
    with pytest.raises(AuditError, match="no side-car"):
        load_checkpoint(bare)
    with pytest.raises(AuditError, match="without config.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(AuditError, match="not found"):
        load_checkpoint(tmp_path / "nothing.safetensors")
    (tmp_path / "model.onnx").write_bytes(b"x")
    with pytest.raises(AuditError, match="unknown checkpoint format"):
        load_checkpoint(tmp_path / "model.onnx")


def _net(seed: int) -> torch.nn.Module:
    """Parameters and buffers, float and integer (BatchNorm's num_batches_tracked is int64)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    net.train()(torch.randn(8, 3))  # moves the running statistics and the batch counter off their init
    return net.eval()


def _snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_match_state_dict_accepts_an_exact_fit_and_loads_nothing():
    """On a fit it returns None and changes neither the module nor the tensors; load_into,
    which checks with it, then leaves the module exactly as torch's own strict
    load_state_dict leaves a second copy."""
    import copy

    net, other = _net(0), _net(1)
    state = _snapshot(other)
    before, given = _snapshot(net), _snapshot(other)
    assert any(not torch.equal(before[k], state[k]) for k in state)  # the two nets really differ
    assert match_state_dict(net, state, where="w.safetensors") is None
    for name, tensor in net.state_dict().items():  # a check, not a load
        assert torch.equal(tensor, before[name]), name
    for name, tensor in state.items():
        assert torch.equal(tensor, given[name]), name
    # a floating tensor of another precision fits (torch casts it on load); so does the module's own state
    match_state_dict(net, {k: v.half() if v.is_floating_point() else v for k, v in state.items()}, where="w")
    match_state_dict(net, net.state_dict(), where="w")

    twin = copy.deepcopy(net)
    twin.load_state_dict(state, strict=True)
    assert load_into(net, state, where="w.safetensors") is net
    assert net.state_dict().keys() == twin.state_dict().keys() == state.keys()
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, twin.state_dict()[name]) and torch.equal(tensor, state[name]), name
        assert tensor.dtype == twin.state_dict()[name].dtype, name


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ("missing", ["1 missing key(s) (1.running_mean)"]),
        ("extra", ["1 unexpected key(s) (3.weight)"]),
        ("missing_and_extra", ["1 missing key(s) (2.bias)", "1 unexpected key(s) (2.bias_typo)"]),
        ("many_missing", ["7 missing key(s) (0.weight, 0.bias, 1.weight, 1.bias and 3 more)"]),
        ("shape", ["tensor 2.weight has shape (2, 5) in the file but the model expects (2, 4)"]),
        ("dtype", ["tensor 0.weight has dtype int64 but the model holds float32"]),
        ("int_as_float", ["tensor 1.num_batches_tracked has dtype float32 but the model holds int64"]),
        ("nan", ["tensor 1.running_var holds non-finite values"]),
        ("inf", ["tensor 0.bias holds non-finite values"]),
    ],
)
def test_match_state_dict_names_the_key_and_the_label_and_loads_nothing(change, needles):
    """Each misfit raises one AuditError line that starts with the ``where`` label and names the
    tensor; load_into then leaves the module untouched (torch's strict load would already have
    copied the tensors that did fit)."""
    net = _net(0)
    state = _snapshot(_net(1))
    if change == "missing":
        del state["1.running_mean"]
    elif change == "extra":
        state["3.weight"] = torch.zeros(2)
    elif change == "missing_and_extra":
        state["2.bias_typo"] = state.pop("2.bias")
    elif change == "many_missing":
        state = {k: v for k, v in state.items() if k.startswith("2.")}
    elif change == "shape":
        state["2.weight"] = torch.zeros(2, 5)
    elif change == "dtype":
        state["0.weight"] = torch.zeros(4, 3, dtype=torch.int64)
    elif change == "int_as_float":
        state["1.num_batches_tracked"] = state["1.num_batches_tracked"].float()
    elif change == "nan":
        state["1.running_var"][2] = float("nan")
    elif change == "inf":
        state["0.bias"][0] = -float("inf")
    before = _snapshot(net)
    fix = "re-export the weights from the same model class"
    with pytest.raises(AuditError) as err:
        match_state_dict(net, state, where="weights w.safetensors", fix=fix)
    message = str(err.value)
    assert message.startswith("weights w.safetensors: ") and "\n" not in message
    for needle in needles:
        assert needle in message, message
    if change not in ("nan", "inf"):  # a damaged file has no fix but re-saving it
        assert message.endswith("; " + fix), message
    with pytest.raises(AuditError) as again:
        load_into(net, state, where="weights w.safetensors", fix=fix)
    assert str(again.value) == message
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_data_that_does_not_fit_the_model(user_package):
    path, _ = _weights(user_package)
    loaded = load_factory("userpkg.models:build", path, inputs="flat")
    ds = load_dataset(DataSpec(dataset="digits", n=20, seed=0))
    with pytest.raises(AuditError) as err:
        fit_to_data(loaded, ds)
    assert "cannot take digits" in str(err.value) and "--inputs" in str(err.value)
    few = load_dataset(DataSpec(dataset="synthetic", n=20, seed=0))
    with pytest.raises(AuditError):
        fit_to_data(load_factory("userpkg.models:build", path), few)


def test_cli_ekfac_covers_a_user_modules_convolution(app, user_package, monkeypatch):
    """--estimator ekfac --params all on a user's conv net: the nn.Conv2d is factored too
    (nothing excluded, no warning), and the JSON records the estimator and its layers."""
    path, _ = _weights(user_package)
    monkeypatch.chdir(user_package)
    args = [
        "malleability",
        "--factory",
        "userpkg.models:build",
        "--weights",
        str(path),
        "--loss",
        "ce",
        "--attacks",
        "pgd",
        "--seeds",
        "2",
        "--n-train",
        "40",
        "--n-test",
        "20",
        "--top-k",
        "10",
        "--pgd-steps",
        "2",
        "--no-controls",
        "--estimator",
        "ekfac",
        "--params",
        "all",
        "--json",
        "-",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    diag = report["results"]["influence_diagnostics"][0]
    assert diag["layers"] == ["conv", "classifier"] and diag["excluded_parameters"] == []
    assert diag["n_params"] == 2 * 9 + 2 + 32 * 10 + 10
    assert all(row["estimator"] == "ekfac" for row in report["results"]["summary"])
    assert not any("left out" in w for w in report["warnings"])


def test_cli_audits_a_user_module(app, user_package, tmp_path, monkeypatch):
    path, _ = _weights(user_package)
    monkeypatch.chdir(user_package)
    args = [
        "malleability",
        "--factory",
        "userpkg.models:build",
        "--weights",
        str(path),
        "--loss",
        "ce",
        "--attacks",
        "pgd,random",
        "--seeds",
        "2",
        "--n-train",
        "40",
        "--n-test",
        "20",
        "--top-k",
        "10",
        "--pgd-steps",
        "2",
        "--json",
        "-",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["inputs"]["protocol"] == "static"
    assert report["results"]["checkpoints"]["models.build"]["kind"] == "factory"
    assert {r["model"] for r in report["results"]["summary"]} == {"models.build"}
    diag = report["results"]["influence_diagnostics"][0]
    assert diag["n_params"] == 2 * 16 * 10 + 10  # the head: classifier.weight and .bias
    for extra, needle in (
        (["--checkpoint", str(path)], "give one of them"),
        (["--weights", str(tmp_path / "none.safetensors")], "not found"),
    ):
        bad = runner.invoke(app, [a for a in args if a != "--json" and a != "-"] + extra)
        assert bad.exit_code == 2 and needle in bad.output, bad.output
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"w": _Marker(str(marker))}))
    for trust in ([], ["--trust-pickle"]):
        bad = runner.invoke(app, ["malleability", "--factory", "userpkg.models:build", "--weights", str(evil), *trust])
        assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1, bad.output
        assert not marker.exists()


# --------------------------------------------------------------------------- a trained built-in ViT, audited by path
@pytest.fixture(scope="module")
def vit_checkpoint(tmp_path_factory):
    """A tiny ViT trained briefly on digits (train split), saved with the side-car `train` writes:
    its recipe, its held-out split and the training-data fingerprint."""
    from attnaudit.data import data_fingerprint, holdout_split
    from attnaudit.core.fit import Recipe, fit
    from attnaudit.models.builtin import save_model
    from attnaudit.models.vit import ViT, ViTSpec

    ds = load_dataset(DataSpec(dataset="digits", split="train"))
    train_ds, test_ds = holdout_split(ds, 400, 100, seed=5, stratify=True)
    model = ViT(ViTSpec("vit", (1, 8, 8), 10, depth=1, dim=8, heads=2, patch=4, seed=1))
    recipe = Recipe(optimizer="adam", lr=3e-3, batch_size=64, steps=60, loss="ce", seed=1)
    fit(model, train_ds.X.float(), train_ds.y, recipe)
    path = tmp_path_factory.mktemp("ckpt") / "vit.safetensors"
    metadata = {
        "training_data": {
            "name": "digits",
            "split": "train",
            "n": 400,
            "fingerprint": data_fingerprint(train_ds.X, train_ds.y),
            "holdout": {"n_train": 400, "n_test": 100, "seed": 5, "stratify": True},
        },
        "recipe": recipe.to_dict(),
    }
    save_model(model, path, metadata=metadata)
    return path, train_ds


TINY_AUDIT = ["--n-train", "60", "--n-test", "30", "--top-k", "10", "--seeds", "2", "--pgd-steps", "2"]


def test_malleability_static_on_a_vit_checkpoint(app, vit_checkpoint):
    path, train_ds = vit_checkpoint
    before = path.read_bytes()
    res = runner.invoke(
        app, ["malleability", "--checkpoint", str(path), "--attacks", "pgd,random", *TINY_AUDIT, "--json", "-"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    results = report["results"]
    assert report["inputs"]["protocol"] == "static" and report["inputs"]["loss"] == "ce"  # the recorded loss
    assert results["checkpoints"]["vit"]["kind"] == "attnaudit" and results["checkpoints"]["vit"]["arch"] == "vit"
    assert results["audit_rows"]["rows"] == "checkpoint split"
    # the audited training rows are rows the model was trained on
    recorded = {tuple(r.tolist()) for r in train_ds.X}
    assert results["dataset"]["holdout"]["part"] == "subset" and results["n_train"] == 60
    diag = results["influence_diagnostics"][0]
    assert diag["n_params"] == 8 * 10 + 10 and diag["path"].startswith("fast: nn.Linear head")
    assert not any("other data" in w for w in report["warnings"])
    assert path.read_bytes() == before  # the checkpoint is untouched
    assert len(recorded) == 400


def test_malleability_finetune_protocol_with_zero_perturbation(app, vit_checkpoint):
    path, _ = vit_checkpoint
    res = runner.invoke(
        app,
        [
            "malleability",
            "--checkpoint",
            str(path),
            "--protocol",
            "finetune",
            "--finetune-steps",
            "4",
            "--attacks",
            "none,random",
            *TINY_AUDIT,
            "--json",
            "-",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    results = report["results"]
    by_attack = {row["attack"]: row for row in results["summary"]}
    # same data, same order: identical fine-tunes; a batch of 64 holds all 60 rows, so the seed's data
    # order changes nothing and seed 1 repeats seed 0 bit for bit: one replicate
    assert by_attack["none"]["flip_rate"]["values"] == [0.0]
    assert by_attack["none"]["same_inputs"] == [{"seed": 1, "as_seed": 0}]
    assert "reorder" in by_attack  # the control: clean fine-tuning in another data order
    # ... which with every row in one batch is the clean fine-tune itself: flagged, not a floor
    assert by_attack["reorder"]["degenerate"] is True
    assert by_attack["reorder"]["flip_rate"]["values"] == [0.0]
    assert any("reorder control reproduced the clean influence run" in w for w in report["warnings"])
    roles = {r["role"] for r in results["training"]}
    assert {"saved", "clean", "reorder"} <= roles
    assert all(r["steps_run"] == (0 if r["role"] == "saved" else 4) for r in results["training"])
    assert (
        results["config"]["finetune_optimizer"] == "adam" and results["config"]["finetune_lr"] == 3e-3
    )  # recorded recipe


def test_landscape_on_a_vit_checkpoint(app, vit_checkpoint):
    path, _ = vit_checkpoint
    res = runner.invoke(
        app,
        [
            "landscape",
            "--checkpoint",
            str(path),
            "--n-train",
            "50",
            "--grid",
            "0",
            "--points",
            "5",
            "--eigenvalues",
            "2",
            "--hutchinson-samples",
            "4",
            "--basin-directions",
            "2",
            "--json",
            "-",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    model = report["results"]["models"]["vit"]
    assert report["inputs"]["landscape"]["loss"] == "ce"
    assert len(model["hessian"]["top_eigenvalues"]) == 2 if "hessian" in model else True
    assert report["results"]["models"]["vit"]["training"]["checkpoint"]["arch"] == "vit"


def test_checkpoint_on_data_of_another_shape_exits_2(app, vit_checkpoint):
    path, _ = vit_checkpoint
    res = runner.invoke(app, ["malleability", "--checkpoint", str(path), "--dataset", "synthetic"])
    assert res.exit_code == 2 and "expects images of shape (1, 8, 8)" in res.output, res.output


# --------------------------------------------------------------------------- a Hugging Face folder, audited by path
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
    )
    model = transformers.ViTForImageClassification(config)
    folder = tmp_path_factory.mktemp("hf") / "tiny-vit"
    model.save_pretrained(folder)
    return folder, model


def test_malleability_and_landscape_on_a_hugging_face_folder(app, hf_folder):
    folder, model = hf_folder
    res = runner.invoke(
        app,
        [
            "malleability",
            "--checkpoint",
            str(folder),
            "--loss",
            "ce",
            "--attacks",
            "pgd,random",
            *TINY_AUDIT,
            "--json",
            "-",
        ],
    )
    assert res.exit_code == 0, res.output
    results = json.loads(res.stdout)["results"]
    source = results["checkpoints"]["tiny-vit"]
    assert source["kind"] == "huggingface" and source["architecture"] == "ViTForImageClassification"
    assert results["influence_diagnostics"][0]["n_params"] == 16 * 10 + 10  # the classifier head
    res = runner.invoke(
        app,
        [
            "landscape",
            "--checkpoint",
            str(folder),
            "--loss",
            "ce",
            "--n-train",
            "40",
            "--grid",
            "0",
            "--points",
            "5",
            "--eigenvalues",
            "2",
            "--hutchinson-samples",
            "4",
            "--basin-directions",
            "2",
            "--params",
            "model.classifier.*",
            "--json",
            "-",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "tiny-vit" in json.loads(res.stdout)["results"]["models"]


def test_hugging_face_folder_with_broken_weights_exits_2(app, hf_folder, tmp_path):
    import shutil

    folder, _ = hf_folder
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    res = runner.invoke(app, ["malleability", "--checkpoint", str(broken)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "safetensors" in res.output


def test_malleability_retrain_reruns_the_recorded_recipe(app, vit_checkpoint, tmp_path):
    path, _ = vit_checkpoint
    res = runner.invoke(
        app,
        [
            "malleability",
            "--checkpoint",
            str(path),
            "--protocol",
            "retrain",
            "--attacks",
            "none",
            *TINY_AUDIT,
            "--json",
            "-",
        ],
    )
    assert res.exit_code == 0, res.output
    results = json.loads(res.stdout)["results"]
    by_attack = {row["attack"]: row for row in results["summary"]}
    assert by_attack["none"]["flip_rate"]["values"] == [0.0, 0.0]  # same init, order and data: the same model
    assert "reinit" in by_attack
    rows = [r for r in results["training"] if r["role"] == "clean"]
    assert [r["init_seed"] for r in rows] == [1, 2] and all(
        r["steps_run"] == 60 for r in rows
    )  # recorded recipe: 60 steps
    assert all(r["source"] == "recorded recipe re-run" for r in results["training"])
    # the reported loss is the one the recipe trains (cross-entropy), also when the audit's --loss is mse
    mse = runner.invoke(
        app,
        [
            "malleability",
            "--checkpoint",
            str(path),
            "--protocol",
            "retrain",
            "--attacks",
            "none",
            *TINY_AUDIT,
            "--loss",
            "mse",
            "--no-controls",
            "--json",
            "-",
        ],
    )
    assert mse.exit_code == 0, mse.output
    rows_mse = [r for r in json.loads(mse.stdout)["results"]["training"] if r["role"] == "clean"]
    assert all(r["loss"] == "ce" for r in rows_mse)
    # same seeds and recipe: the same retrained models, so the same (cross-entropy) losses as the default run
    assert [r["final_loss"] for r in rows_mse] == pytest.approx([r["final_loss"] for r in rows], rel=1e-6)
    # a checkpoint without a recipe cannot be retrained
    from attnaudit.models.builtin import ModelSpec, build_model, save_model

    bare = tmp_path / "bare.safetensors"
    save_model(build_model(ModelSpec("relu", 64, 8, 10)), bare)
    res = runner.invoke(app, ["malleability", "--checkpoint", str(bare), "--protocol", "retrain"])
    assert res.exit_code == 2 and "records none" in res.output, res.output


def test_checkpoint_with_fewer_outputs_than_labels_exits_2(app, tmp_path):
    from attnaudit.models.builtin import ModelSpec, build_model, save_model

    path = tmp_path / "three.safetensors"
    save_model(build_model(ModelSpec("relu", 64, 8, 3)), path)
    res = runner.invoke(app, ["landscape", "--checkpoint", str(path)])
    assert res.exit_code == 2 and "3 outputs" in res.output and "labels go up to 9" in res.output, res.output
    ok = runner.invoke(
        app,
        [
            "landscape",
            "--checkpoint",
            str(path),
            "--classes",
            "0,1,2",
            "--n-train",
            "30",
            "--grid",
            "0",
            "--points",
            "5",
            "--eigenvalues",
            "1",
            "--hutchinson-samples",
            "2",
            "--basin-directions",
            "2",
            "-q",
        ],
    )
    assert ok.exit_code == 0, ok.output
