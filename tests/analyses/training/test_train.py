"""Mini-batch training (attnaudit.core.fit) and the `attnaudit train` command."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from attnaudit.errors import AuditError
from attnaudit.core.fit import FitResult, Recipe, evaluate, fit
from attnaudit.models.builtin import ModelSpec, build_model, load_model
from attnaudit.core.training import TrainConfig, train
from attnaudit.models.vit import ViT, ViTSpec

MNIST_DIR = Path(__file__).resolve().parents[4] / "shared" / "data"


def data(n=40, d=12, c=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g, dtype=dtype), torch.randint(0, c, (n,), generator=g)


def one_line(fn, *match):
    with pytest.raises(AuditError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    for m in match:
        assert m in message, message
    return message


# --------------------------------------------------------------------------- Recipe


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(optimizer="lbfgs", lr=0.1, steps=1), "unknown optimizer"),
        (dict(optimizer="adam", lr=0.0, steps=1), "lr must be a positive number"),
        (dict(optimizer="adam", lr=float("nan"), steps=1), "lr must be"),
        (dict(optimizer="adam", lr="0.1", steps=1), "lr must be"),
        (dict(optimizer="adam", lr=True, steps=1), "lr must be"),
        (dict(optimizer="adam", lr=0.1), "give epochs or steps"),
        (dict(optimizer="adam", lr=0.1, epochs=1, steps=1), "epochs and steps both say how long to train"),
        (dict(optimizer="adam", lr=0.1, epochs=-1), "epochs must be an integer"),
        (dict(optimizer="adam", lr=0.1, steps=2.5), "steps must be an integer"),
        (dict(optimizer="gd", lr=0.1, steps=1, batch_size=8), "batch_size does not apply to the gd optimizer"),
        (dict(optimizer="sgd", lr=0.1, steps=1, batch_size=0), "batch_size must be a positive integer"),
        (dict(optimizer="adam", lr=0.1, steps=1, loss="hinge"), "unknown loss"),
        (dict(optimizer="adam", lr=0.1, steps=1, seed=-1), "seed must be an integer"),
        (dict(optimizer="adam", lr=0.1, steps=1, momentum=0.9), "momentum applies to the sgd optimizer"),
        (dict(optimizer="sgd", lr=0.1, steps=1, momentum=1.0), "momentum must be below 1"),
        (dict(optimizer="sgd", lr=0.1, steps=1, weight_decay=-1e-4), "weight_decay must be a number >= 0"),
    ],
)
def test_recipe_validation_names_the_field(kwargs, expected):
    one_line(lambda: Recipe(**kwargs), expected)


def test_recipe_dict_round_trip_and_untrusted_dicts():
    import numpy as np

    recipe = Recipe(
        "sgd", np.float32(0.5), batch_size=np.int64(16), epochs=np.int64(2), loss="ce", seed=3, momentum=0.9
    )
    assert type(recipe.batch_size) is int and type(recipe.lr) is float
    d = json.loads(json.dumps(recipe.to_dict()))
    assert Recipe.from_dict(d) == recipe
    one_line(lambda: Recipe.from_dict([1]), "must be an object")
    one_line(lambda: Recipe.from_dict({**d, "scheduler": "cosine"}), "unknown field(s) scheduler")
    one_line(lambda: Recipe.from_dict({"lr": 0.1, "steps": 3}), "lacks field(s) optimizer")
    one_line(lambda: Recipe.from_dict({**d, "lr": "fast"}), "recipe is invalid", "lr must be")
    assert Recipe("gd", 1.0, steps=10).total_steps(100) == 10
    assert Recipe("adam", 1.0, batch_size=32, epochs=3).total_steps(100) == 12  # 4 batches (32, 32, 32, 4) x 3
    assert Recipe("adam", 1.0, batch_size=500, epochs=2).total_steps(100) == 2


# --------------------------------------------------------------------------- fit


@pytest.mark.parametrize("arch", ["relu", "attn"])
@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_gd_fit_equals_the_reference_gd_trainer(arch, loss):
    X, y = data()
    base = build_model(ModelSpec(arch, 12, 16, 3, seed=4), X)
    ref, fast, generic = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    train(ref, X, y, TrainConfig(loss=loss, lr=1.5, steps=30))
    result = fit(fast, X, y, Recipe("gd", 1.5, steps=30, loss=loss))
    fit(generic, X, y, Recipe("gd", 1.5, steps=30, loss=loss), fast_path=False)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(fast.named_parameters())[name], p, rtol=0, atol=1e-13)
        torch.testing.assert_close(dict(generic.named_parameters())[name], p, rtol=0, atol=1e-13)
    assert not torch.equal(ref.W, base.W)
    assert result.steps_run == 30 and result.epochs_run == 30 and len(result.loss_curve) == 30
    assert result.path.startswith("fast") == (arch == "attn")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.0, 1e-2), (0.9, 0.0), (0.9, 1e-3)])
def test_gradient_descent_makes_torch_sgds_updates_bit_for_bit(dtype, momentum, weight_decay):
    """GradientDescent against torch.optim.SGD on the same gradients, 6 steps, a parameter that
    gets no gradient at one step among them: equal to the last bit."""
    from attnaudit.core.fit import GradientDescent

    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(5, 4, generator=gen, dtype=dtype), torch.randn(4, generator=gen, dtype=dtype)]
    ours = [nn.Parameter(t.clone()) for t in start]
    theirs = [nn.Parameter(t.clone()) for t in start]
    mine = GradientDescent(ours, lr=0.3, momentum=momentum, weight_decay=weight_decay)
    reference = torch.optim.SGD(theirs, lr=0.3, momentum=momentum, weight_decay=weight_decay)
    for step in range(6):
        grads = [torch.randn(t.shape, generator=gen, dtype=dtype) for t in start]
        for params in (ours, theirs):
            for i, p in enumerate(params):
                p.grad = None if (step == 2 and i == 1) else grads[i].clone()
        mine.step()
        reference.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q), (step, momentum, weight_decay)
    mine.zero_grad()
    assert all(p.grad is None for p in ours)


def test_adam_fit_equals_a_plain_torch_loop():
    """The promised semantics, written out: per epoch a fresh torch.randperm from a generator
    seeded with recipe.seed, consecutive batches (the last partial one kept), mean loss, Adam."""
    X, y = data(n=50, d=16, c=3)
    # vit-linear: in softmax attention the key bias has an exactly zero gradient (softmax ignores a shift
    # shared by all keys), and Adam would turn its round-off into arbitrary steps on both sides
    spec = ViTSpec("vit-linear", (1, 4, 4), 3, depth=1, dim=8, heads=2, patch=2, seed=1)
    model, plain = ViT(spec), ViT(spec)
    recipe = Recipe("adam", 3e-3, batch_size=16, epochs=3, loss="ce", seed=7, weight_decay=1e-3)
    result = fit(model, X, y, recipe)
    opt = torch.optim.Adam(plain.parameters(), lr=3e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(7)
    Xf, losses = X.float(), []
    for _ in range(3):
        perm = torch.randperm(50, generator=gen)
        for a in range(0, 50, 16):
            idx = perm[a : a + 16]
            loss = nn.functional.cross_entropy(plain(Xf[idx].reshape(-1, 1, 4, 4)), y[idx])
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert result.steps_run == 12 and result.steps_per_epoch == 4 and result.epochs_run == 3
    torch.testing.assert_close(torch.tensor(result.loss_curve), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


class Recorder(nn.Module):
    """A linear model that records the rows it is called with and whether it ran in training mode."""

    def __init__(self, d=3, c=2):
        super().__init__()
        self.lin = nn.Linear(d, c, dtype=torch.float64)
        self.drop = nn.Dropout(0.5)
        self.seen: list[torch.Tensor] = []
        self.modes: list[bool] = []

    def forward(self, x):
        self.seen.append(x[:, 0].detach().clone())
        self.modes.append(self.training or self.drop.training)
        return self.lin(self.drop(x))


def test_mini_batches_cover_each_epoch_once_and_steps_cross_epochs():
    n = 10
    X = torch.zeros(n, 3, dtype=torch.float64)
    X[:, 0] = torch.arange(n, dtype=torch.float64)  # row ids
    y = torch.arange(n) % 2
    model = Recorder()
    model.train()
    calls = []
    result = fit(model, X, y, Recipe("sgd", 0.1, batch_size=4, epochs=2, seed=5), progress=lambda k: calls.append(k))
    batches = model.seen[1:7]  # after the one-row probe of the logits width: 6 steps
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(torch.cat(epoch).long().tolist()) == list(range(n))
    assert torch.cat(batches[:3]).tolist() != list(range(n))  # shuffled
    assert torch.cat(batches[:3]).tolist() != torch.cat(batches[3:]).tolist()  # a fresh order per epoch
    assert not any(model.modes) and model.training and model.drop.training  # eval flags inside, restored after
    assert calls == [1] * 6 and result.steps_run == 6 and result.epochs_run == 2.0

    model = Recorder()
    result = fit(model, X, y, Recipe("sgd", 0.1, batch_size=4, steps=5, seed=5))
    assert [len(b) for b in model.seen[1:6]] == [4, 4, 2, 4, 4]
    assert result.steps_run == 5 and result.epochs_run == pytest.approx(5 / 3)
    # full batch: every row, in the data's own order, at every step
    model = Recorder()
    fit(model, X, y, Recipe("gd", 0.1, steps=2))
    assert all(b.tolist() == list(range(n)) for b in model.seen[1:3])


def test_fit_is_deterministic_and_seeded():
    X, y = data(n=60, d=16, c=3, dtype=torch.float32)
    spec = ViTSpec("vit-linear", (1, 4, 4), 3, depth=1, dim=8, heads=2, patch=2, seed=0)
    runs = []
    for seed in (1, 1, 2):
        model = ViT(spec)
        r = fit(model, X, y, Recipe("adam", 1e-2, batch_size=8, epochs=2, loss="ce", seed=seed))
        runs.append((r.loss_curve, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[0][0] != runs[2][0]


def test_divergence_stops_and_is_reported():
    X, y = data()
    model = nn.Linear(12, 3, dtype=torch.float64)
    result = fit(model, X, y, Recipe("gd", 1e3, steps=200))
    assert result.diverged and result.steps_run < 200
    assert not math.isfinite(result.loss_curve[-1]) and all(math.isfinite(v) for v in result.loss_curve[:-1])
    assert len(result.loss_curve) == result.steps_run + 1 and "lower --lr" in result.notes[0]


def test_final_metrics_and_validation_are_measured_independently():
    X, y = data(n=40)
    Xv, yv = data(n=15, seed=1)
    model = build_model(ModelSpec("relu", 12, 16, 3, seed=1))
    result = fit(model, X, y, Recipe("gd", 2.0, steps=20, loss="ce"), X_val=Xv, y_val=yv)
    with torch.no_grad():
        out, outv = model(X), model(Xv)
    assert result.train_accuracy == pytest.approx((out.argmax(1) == y).double().mean().item())
    assert result.val_accuracy == pytest.approx((outv.argmax(1) == yv).double().mean().item())
    assert result.final_train_loss == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-12)
    assert result.val_loss == pytest.approx(nn.functional.cross_entropy(outv, yv).item(), rel=1e-12)
    assert evaluate(model, Xv, yv, "mse")[0] == pytest.approx(
        0.5 * ((outv - nn.functional.one_hot(yv, 3)) ** 2).sum(1).mean().item()
    )
    plain = fit(model, X, y, Recipe("gd", 2.0, steps=1))
    assert plain.val_loss is None and plain.val_accuracy is None
    d = plain.to_dict()
    assert set(d) >= {
        "steps_run",
        "epochs_run",
        "loss_curve",
        "final_train_loss",
        "train_accuracy",
        "val_loss",
        "val_accuracy",
        "diverged",
        "seconds",
    } and isinstance(plain, FitResult)


def test_fit_refuses_bad_data():
    X, y = data()
    model = build_model(ModelSpec("relu", 12, 4, 3))
    one_line(lambda: fit(model, X, y.double(), Recipe("gd", 1.0, steps=1)), "integer class indices")
    one_line(lambda: fit(model, X, y[:-1], Recipe("gd", 1.0, steps=1)), "one label per row")
    one_line(lambda: fit(model, X, y + 3, Recipe("gd", 1.0, steps=1)), "3 outputs", "labels go up to 5")
    one_line(lambda: fit(model, X, y, Recipe("gd", 1.0, steps=1), X_val=X), "both X_val and y_val")


# --------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def cli():
    from typer.testing import CliRunner

    from attnaudit.cli import app

    return app, CliRunner()


def run(cli, *args):
    app, runner = cli
    result = runner.invoke(app, ["--threads", "1", "train", *map(str, args)], env={"FORCE_COLOR": None})
    return result.exit_code, result.stdout, result.stderr


TINY_VIT = [
    "--dataset",
    "digits",
    "--patch",
    "4",
    "--dim",
    "16",
    "--heads",
    "2",
    "--depth",
    "1",
    "--n-train",
    "200",
    "--n-test",
    "100",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--quiet",
]


def test_train_vit_writes_an_auditable_checkpoint(cli, tmp_path):
    from attnaudit.models.checkpoints import audit_split, load_checkpoint
    from attnaudit.data import DataSpec, data_fingerprint, holdout_split, load_dataset

    out = tmp_path / "vit.safetensors"
    code, stdout, stderr = run(
        cli, *TINY_VIT, "--seed", 3, "--out", out, "--json", tmp_path / "r.json", "--png", tmp_path / "loss.png"
    )
    assert code == 0, stderr
    side = json.loads(out.with_suffix(".safetensors.json").read_text())
    meta = side["metadata"]
    assert side["arch"] == "vit" and side["spec"]["patch"] == 4 and side["spec"]["seed"] == 3
    assert side["input"] == {"kind": "images", "shape": [1, 8, 8]} and side["dtype"] == "float32"
    assert meta["recipe"] == {
        "optimizer": "adam",
        "lr": 1e-3,
        "batch_size": 32,
        "epochs": 2,
        "steps": None,
        "loss": "ce",
        "seed": 3,
        "momentum": 0.0,
        "weight_decay": 0.0,
    }
    assert meta["init_seed"] == 3 and "loss_curve" not in meta["metrics"] and meta["metrics"]["steps_run"] == 14
    data = meta["training_data"]
    assert data["holdout"] == {"n_train": 200, "n_test": 100, "seed": 3, "stratify": True}
    assert data["dataset"] == "digits" and data["split"] == "train" and data["n"] == 200 and data["n_classes"] == 10
    # the split can be rebuilt from the record alone, and its fingerprint matches
    ds = load_dataset(DataSpec(data["dataset"], split=data["split"], preprocess=data["preprocess"]))
    train_rows, _ = holdout_split(ds, 200, 100, seed=3, stratify=True)
    assert data_fingerprint(train_rows.X, train_rows.y) == data["fingerprint"]
    loaded = load_checkpoint(out)
    assert loaded.loss == "ce" and loaded.recipe["optimizer"] == "adam"
    _, _, note = audit_split(ds, {"vit": loaded}, 50, 20, seed=0)
    assert note["rows"] == "checkpoint split"
    # held-out accuracy in the report is the accuracy of the saved model on the held-out rows
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["schema"] == "attnaudit.train/1" and report["seeds"]["seed"] == 3
    _, held = holdout_split(ds, 200, 100, seed=3, stratify=True)
    model = load_model(out)
    with torch.no_grad():
        acc = (model(held.X.float().reshape(-1, 1, 8, 8)).argmax(1) == held.y).double().mean().item()
    assert report["results"]["fit"]["val_accuracy"] == pytest.approx(acc)
    assert len(report["results"]["fit"]["loss_curve"]) == 14
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_weights_and_no_silent_overwrite(cli, tmp_path):
    from safetensors.torch import load_file

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for path in (a, b):
        code, _, stderr = run(cli, *TINY_VIT, "--epochs", 1, "--out", path)
        assert code == 0, stderr
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    before = a.read_bytes(), a.with_suffix(".safetensors.json").read_bytes()
    code, stdout, stderr = run(cli, *TINY_VIT, "--epochs", 1, "--out", a)
    assert code == 2 and stderr.count("\n") == 1 and "already exists; pass --overwrite" in stderr
    assert (a.read_bytes(), a.with_suffix(".safetensors.json").read_bytes()) == before
    # the side-car alone is the user's file too
    c = tmp_path / "c.safetensors"
    c.with_suffix(".safetensors.json").write_text("{}")
    code, _, stderr = run(cli, *TINY_VIT, "--out", c)
    assert code == 2 and "c.safetensors.json already exists" in stderr and not c.exists()
    code, _, stderr = run(cli, *TINY_VIT, "--epochs", 1, "--seed", 1, "--out", a, "--overwrite")
    assert code == 0, stderr
    assert not torch.equal(load_file(str(a))["head.weight"], ta["head.weight"])


def test_train_two_layer_nets(cli, tmp_path):
    for arch in ("relu", "attn"):
        out = tmp_path / f"{arch}.safetensors"
        code, stdout, stderr = run(
            cli,
            "--arch",
            arch,
            "--dataset",
            "digits",
            "--n-train",
            100,
            "--n-test",
            50,
            "--steps",
            20,
            "--width",
            8,
            "--out",
            out,
        )
        assert code == 0, stderr
        assert "attnaudit train" in stdout and arch in stdout
        model = load_model(out)
        assert model.spec.arch == arch and model.W.dtype == torch.float64 and model.spec.width == 8
        recipe = model.metadata["recipe"]
        assert (recipe["optimizer"], recipe["lr"], recipe["steps"], recipe["loss"]) == ("gd", 4.0, 20, "mse")


BAD = [
    (["--arch", "relu", "--depth", "2"], "--depth"),
    (["--arch", "attn", "--patch", "4", "--dim", "8"], "--dim sets the size of the transformers"),
    (["--arch", "vit", "--width", "8"], "--width"),
    (["--arch", "lstm"], "unknown --arch"),
    (["--arch", "relu", "--batch-size", "8"], "--batch-size does not apply to the gd optimizer"),
    (["--optimizer", "sgd"], "optimizer sgd needs --lr"),
    (["--arch", "relu", "--optimizer", "adam"], "optimizer adam needs --lr"),
    (["--epochs", "1", "--steps", "2"], "--epochs and steps both say how long to train"),
    (["--lr", "-1"], "--lr"),
    (["--momentum", "0.9"], "--momentum applies to the sgd optimizer"),
    (["--dtype", "float16"], "--dtype"),
    (["--loss", "hinge"], "--loss"),
    (["--seed", "-3"], "--seed"),
    (["--n-test", "0"], "--n-test"),
    (["--patch", "3"], "patch size 3 does not divide the image size 8x8"),
    (["--dataset", "synthetic"], "needs image data"),
    (["--n-train", "1400", "--n-test", "100"], "holdout split asks for 1400 train + 100 test"),
]


@pytest.mark.parametrize("args, expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_exit_2_with_one_line(cli, tmp_path, args, expected):
    out = tmp_path / "m.safetensors"
    code, stdout, stderr = run(cli, *args, "--out", out)
    assert code == 2, (stdout, stderr)
    assert stderr.startswith("error:") and stderr.count("\n") == 1 and expected in stderr, stderr
    assert not list(tmp_path.iterdir())


def test_bad_output_paths_fail_before_training(cli, tmp_path):
    code, _, stderr = run(cli, "--out", tmp_path / "missing" / "m.safetensors")
    assert code == 2 and "does not exist" in stderr and stderr.count("\n") == 1
    code, _, stderr = run(cli, "--out", tmp_path / "m.pt")
    assert code == 2 and "ending in .safetensors" in stderr
    code, _, stderr = run(cli, "--out", tmp_path / "m.safetensors", "--json", tmp_path / "m.safetensors")
    assert code == 2 and "name the same file" in stderr
    assert not list(tmp_path.iterdir())


def test_main_without_out_is_one_usage_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "attnaudit", "train", "--dataset", "digits"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "--out" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["vit", "vit-linear"])
def test_mnist_default_recipe_learns(cli, tmp_path, arch):
    if not (MNIST_DIR / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip("real MNIST test split not present in ../shared/data")
    out = tmp_path / "m.safetensors"
    code, _, stderr = run(
        cli,
        "--arch",
        arch,
        "--dataset",
        "mnist",
        "--split",
        "test",
        "--data-dir",
        MNIST_DIR,
        "--out",
        out,
        "--json",
        tmp_path / "r.json",
        "--quiet",
    )
    assert code == 0, stderr
    fit_result = json.loads((tmp_path / "r.json").read_text())["results"]["fit"]
    assert fit_result["steps_run"] == 705 and fit_result["val_accuracy"] > 0.85
