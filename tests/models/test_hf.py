"""Hugging Face model folders (attnaudit.models.hf): loading offline, checks, preprocessing, the engine."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from attnaudit.core.engine import Engine  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf import HFImageClassifier, adapt_to_data, load_hf_directory  # noqa: E402

MEAN = [0.4, 0.5, 0.6]
STD = [0.2, 0.25, 0.3]


def _vit(channels: int, size: int, seed: int):
    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        image_size=size,
        patch_size=4,
        num_channels=channels,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
    )
    return transformers.ViTForImageClassification(config).eval()


@pytest.fixture(scope="module")
def vit1(tmp_path_factory):
    """A 1-channel 8x8 ViT saved with save_pretrained (no preprocessor config)."""
    folder = tmp_path_factory.mktemp("hf") / "vit1"
    model = _vit(1, 8, 0)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def vit3(tmp_path_factory):
    """A 3-channel 16x16 ViT with a preprocessor_config.json holding mean/std."""
    folder = tmp_path_factory.mktemp("hf") / "vit3"
    model = _vit(3, 16, 1)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_normalize": True,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_resize": True,
                "image_mean": MEAN,
                "image_std": STD,
                "size": {"height": 16, "width": 16},
                "image_processor_type": "ViTImageProcessor",
            }
        )
    )
    return folder, model


def _copy(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def _edit_weights(folder, fn):
    path = folder / "model.safetensors"
    tensors = fn(dict(load_file(str(path))))
    save_file(tensors, str(path))


def _edit_config(folder, fn):
    path = folder / "config.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """1-D linear interpolation with half-pixel centres (align_corners=False), edges clamped."""
    A = np.zeros((n_out, n_in))
    for o in range(n_out):
        src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(np.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        w = src - i0
        A[o, i0] += 1 - w
        A[o, i1] += w
    return A


# --------------------------------------------------------------------------- loading and logits


def test_vit_loads_and_matches_the_model(vit1):
    folder, model = vit1
    loaded = load_hf_directory(folder)
    assert loaded.n_classes == 10 and loaded.label == "vit1" and loaded.loss is None
    assert loaded.inputs.kind == "images" and loaded.inputs.shape == (1, 8, 8) and loaded.n_features == 64
    src = loaded.source
    assert src["kind"] == "huggingface" and src["architecture"] == "ViTForImageClassification"
    assert src["model_type"] == "vit" and src["image_size"] == [8, 8] and src["num_channels"] == 1
    assert src["parameters"] == sum(p.numel() for p in model.parameters())
    assert src["preprocessing"]["normalize"] is None and src["renamed_keys"] > 0
    json.dumps(src)  # recordable in reports
    module = loaded.module
    assert not module.training and all(p.dtype == torch.float32 for p in module.parameters())
    loaded_state = module.model.state_dict()
    assert set(loaded_state) == set(model.state_dict())
    assert all(torch.equal(loaded_state[k], v) for k, v in model.state_dict().items())
    assert module.head_parameter_names() == ["model.classifier.weight", "model.classifier.bias"]
    task = loaded.task(loss="ce", params="head")
    assert task.parameter_names() == ["model.classifier.weight", "model.classifier.bias"]
    assert loaded.task(params="model.vit.layers.0.attention.*").parameter_names()

    X = torch.rand(5, 64)
    with torch.no_grad():
        ref = model(pixel_values=X.reshape(5, 1, 8, 8)).logits
        assert torch.allclose(loaded.task().logits(X), ref, atol=1e-6)
        # 3-channel data into the 1-channel model: the mean of the channels
        X3 = torch.rand(2, 3, 8, 8)
        assert torch.allclose(module(X3), model(pixel_values=X3.mean(1, keepdim=True)).logits, atol=1e-6)


def test_vit_channels_resize_and_normalisation(vit3):
    folder, model = vit3
    loaded = adapt_to_data(load_hf_directory(folder), (1, 8, 8))
    assert loaded.inputs.shape == (1, 8, 8) and loaded.n_features == 64
    pre = loaded.source["preprocessing"]
    assert pre["normalize"] == {"mean": MEAN, "std": STD} and "skipped" in pre["rescale"]
    assert loaded.source["data_shape"] == [1, 8, 8] and "repetition" in loaded.source["data_channels"]

    X = torch.rand(3, 64, dtype=torch.float64).float()
    images = X.numpy().astype(np.float64).reshape(3, 1, 8, 8)
    rgb = np.repeat(images, 3, axis=1)  # 1 -> 3 channels by repetition
    A = _bilinear_matrix(8, 16)
    big = np.einsum("oh,bchw,pw->bcop", A, rgb, A)  # bilinear 8x8 -> 16x16
    pixels = (big - np.array(MEAN)[None, :, None, None]) / np.array(STD)[None, :, None, None]
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(pixels).float()).logits
        got = loaded.task().logits(X)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_adapt_to_data_refuses_what_cannot_fit(vit1, vit3):
    loaded = load_hf_directory(vit3[0])
    with pytest.raises(AuditError, match="flat rows"):
        adapt_to_data(loaded, (64,))
    with pytest.raises(AuditError, match="2 channels"):
        adapt_to_data(loaded, (2, 8, 8))
    assert adapt_to_data(loaded, (3, 32, 32)).inputs.shape == (3, 32, 32)


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {**c, "model_type": "no-such-model"}, "unknown model_type 'no-such-model'"),
        (
            lambda c: {**c, "architectures": ["ViTForMaskedImageModeling"]},
            "ForImageClassification or ForSequenceClassification",
        ),
        (
            lambda c: {**c, "architectures": ["NoSuchForImageClassification"]},
            "no model class NoSuchForImageClassification",
        ),
        (lambda c: {k: v for k, v in c.items() if k != "architectures"}, "no architectures"),
        (lambda c: {**c, "auto_map": {"AutoModel": "evil.Model"}}, "custom modelling code"),
        (lambda c: {**c, "architectures": ["BertForSequenceClassification"]}, "does not take model_type 'vit'"),
    ],
)
def test_bad_configs(vit1, tmp_path, edit, message):
    folder = _copy(vit1[0], tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(AuditError, match=message):
        load_hf_directory(folder)


def test_missing_folder_config_and_broken_json(vit1, tmp_path):
    with pytest.raises(AuditError, match="not found"):
        load_hf_directory(tmp_path / "nowhere")
    folder = _copy(vit1[0], tmp_path)
    (folder / "config.json").write_text('{"model_type": "vit",')
    with pytest.raises(AuditError, match="not valid JSON"):
        load_hf_directory(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(AuditError, match="not an object"):
        load_hf_directory(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "vit", "pad": "x" * (1 << 20)}))
    with pytest.raises(AuditError, match="over the 1,048,576-byte limit"):
        load_hf_directory(folder)
    (folder / "config.json").unlink()
    with pytest.raises(AuditError, match="has no config.json"):
        load_hf_directory(folder)


def test_weights_that_do_not_fit(vit1, tmp_path):
    folder = _copy(vit1[0], tmp_path)
    (folder / "model.safetensors").rename(tmp_path / "saved.safetensors")
    with pytest.raises(AuditError, match="no weights file"):
        load_hf_directory(folder)

    def renamed(t):
        t["classifier.kernel"] = t.pop("classifier.weight")
        return t

    shutil.copy(tmp_path / "saved.safetensors", folder / "model.safetensors")
    _edit_weights(folder, renamed)
    with pytest.raises(
        AuditError, match=r"missing key\(s\) \(classifier\.weight\).*unexpected key\(s\) \(classifier\.kernel\)"
    ):
        load_hf_directory(folder)

    def renamed_layer(t):
        t["vit.encoder.layer.0.attention.attention.query.w"] = t.pop(
            "vit.encoder.layer.0.attention.attention.query.weight"
        )
        return t

    shutil.copy(tmp_path / "saved.safetensors", folder / "model.safetensors")
    _edit_weights(folder, renamed_layer)
    with pytest.raises(AuditError, match=r"vit\.encoder\.layer\.0\.attention\.attention\.query\.weight\).*query\.w\)"):
        load_hf_directory(folder)

    def reshaped(t):
        t["vit.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(31, 16)
        return t

    shutil.copy(tmp_path / "saved.safetensors", folder / "model.safetensors")
    _edit_weights(folder, reshaped)
    with pytest.raises(
        AuditError,
        match=r"tensor vit\.encoder\.layer\.0\.intermediate\.dense\.weight .*shape \(31, 16\) in the file but the model expects \(32, 16\)",
    ):
        load_hf_directory(folder)

    def poisoned(t):
        t["classifier.bias"] = t["classifier.bias"].clone()
        t["classifier.bias"][3] = float("nan")
        return t

    shutil.copy(tmp_path / "saved.safetensors", folder / "model.safetensors")
    _edit_weights(folder, poisoned)
    with pytest.raises(AuditError, match="classifier.bias holds non-finite"):
        load_hf_directory(folder)

    data = (tmp_path / "saved.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AuditError, match="truncated or corrupted"):
        load_hf_directory(folder)


def test_pickle_weights_need_trust(vit1, tmp_path):
    folder, model = vit1
    folder = _copy(folder, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(AuditError, match="pickle-based file.*--trust-pickle"):
        load_hf_directory(folder)
    loaded = load_hf_directory(folder, trust_pickle=True)
    assert loaded.source["weights_format"] == "pickle"
    X = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(loaded.module(X), model(pixel_values=X).logits, atol=1e-6)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling would create the marker file
        return (open, (self.marker, "w"))


def test_malicious_pickle_never_runs(vit1, tmp_path):
    folder = _copy(vit1[0], tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"classifier.weight": _Payload(str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(AuditError, match="pickle-based"):
        load_hf_directory(folder)
    assert not marker.exists()
    with pytest.raises(AuditError, match="weights_only=True"):
        load_hf_directory(folder, trust_pickle=True)
    assert not marker.exists()


def test_sharded_safetensors(vit1, tmp_path):
    folder, model = vit1
    folder = _copy(folder, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(folder / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_directory(folder)
    assert loaded.source["weights"] == sorted(halves)
    X = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(loaded.module(X), model(pixel_values=X).logits, atol=1e-6)
    index["weight_map"][keys[0]] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(AuditError, match="not a plain file name"):
        load_hf_directory(folder)


def test_transformers_missing_gives_the_install_line(vit1, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(AuditError, match=r'needs transformers: pip install "attnaudit\[hf\]"'):
        load_hf_directory(vit1[0])


# --------------------------------------------------------------------------- the engine


def test_engine_per_sample_grads_and_hvp(vit3):
    """Channels + resize + normalisation + ViT under vmap(grad), a plain loop, and an HVP."""
    folder, _ = vit3
    loaded = adapt_to_data(load_hf_directory(folder), (1, 8, 8))
    module = loaded.module
    assert isinstance(module, HFImageClassifier)
    torch.manual_seed(0)
    X, y = torch.rand(4, 64), torch.tensor([0, 3, 7, 9])
    engine = Engine(loaded.task(loss="ce", params="all"))
    G = engine.per_sample_grads(X, engine.targets(y))
    params = [p for _, p in module.named_parameters()]
    assert engine.names == [n for n, _ in module.named_parameters()]
    loop = []
    for i in range(4):
        logits = module(X[i].reshape(1, 1, 8, 8))
        loss = torch.nn.functional.cross_entropy(logits, y[i : i + 1])
        loop.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    loop = torch.stack(loop)
    assert G.shape == (4, sum(p.numel() for p in params))
    assert torch.allclose(G, loop, atol=1e-5, rtol=1e-4), (G - loop).abs().max()

    # HVP of the mean loss vs double backward on the wrapper (which forces the math kernel itself)
    hvp = engine.hvp_operator(X, engine.targets(y))
    v = torch.randn(engine.n_params)
    Hv = hvp(v)
    loss = torch.nn.functional.cross_entropy(module(X.reshape(4, 1, 8, 8)), y)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params, create_graph=True)])
    ref = torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ v, params)])
    assert hvp.mode == "reverse-over-reverse"
    assert torch.allclose(Hv, ref, atol=1e-4, rtol=1e-3), (Hv - ref).abs().max()

    # input gradients exist through the resize (attacks)
    assert engine.input_grads(X, engine.targets(y)).abs().sum() > 0


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_sequence_classifier(tmp_path, name):
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=40,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=3,
        )
        model = transformers.BertForSequenceClassification(config).eval()
    else:
        config = transformers.DistilBertConfig(
            vocab_size=40,
            dim=16,
            n_layers=1,
            n_heads=2,
            hidden_dim=32,
            max_position_embeddings=16,
            num_labels=3,
        )
        model = transformers.DistilBertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / name)
    loaded = load_hf_directory(tmp_path / name)
    assert loaded.inputs.kind == "tokens" and loaded.inputs.keyword == "input_ids" and loaded.n_classes == 3
    assert "4-D" in loaded.source["attention_mask"]
    assert loaded.module.head_parameter_names() == ["model.classifier.weight", "model.classifier.bias"]
    loaded = adapt_to_data(loaded, (6,))
    assert loaded.n_features == 6
    with pytest.raises(AuditError, match="at most 16 tokens"):
        adapt_to_data(loaded, (17,))

    ids = torch.randint(1, 40, (3, 6))
    ids[0, 4:] = 0  # padding (pad_token_id 0)
    X, y = ids.float(), torch.tensor([0, 2, 1])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        assert torch.allclose(loaded.task().logits(X), ref, atol=1e-5)
    engine = Engine(loaded.task(loss="ce"))
    G = engine.per_sample_grads(X, engine.targets(y))
    params = [p for _, p in loaded.module.named_parameters()]
    for i in range(3):
        loss = torch.nn.functional.cross_entropy(loaded.module(ids[i : i + 1]), y[i : i + 1])
        g = torch.cat(
            [t.reshape(-1) for t in torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)]
        )
        assert torch.allclose(G[i], g, atol=1e-5, rtol=1e-4)


def test_tied_weights_written_once_are_filled(tmp_path):
    """save_pretrained writes one tensor per tied group; the check fills the twin, refuses disagreeing twins."""
    from attnaudit.models.hf import _match_weights

    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = transformers.BertForMaskedLM(config).eval()
    model.save_pretrained(tmp_path / "mlm")
    tensors = load_file(str(tmp_path / "mlm" / "model.safetensors"))
    assert "cls.predictions.decoder.weight" not in tensors
    with torch.device("meta"):
        skeleton = transformers.BertForMaskedLM(config)
    native, info = _match_weights(skeleton, tensors, "mlm")
    assert "cls.predictions.decoder.weight" in info["tied_keys_filled"]
    assert native["cls.predictions.decoder.weight"] is tensors["bert.embeddings.word_embeddings.weight"]
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"] + 1
    with pytest.raises(AuditError, match="tied in this model but differ"):
        _match_weights(skeleton, tensors, "mlm")


def test_base_model_without_head_is_refused(tmp_path):
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
    transformers.ViTModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "base")
    _edit_config(tmp_path / "base", lambda c: {**c, "architectures": ["ViTForImageClassification"]})
    with pytest.raises(AuditError, match=r"no classification head \(classifier\.weight, classifier\.bias missing\)"):
        load_hf_directory(tmp_path / "base")


def test_weights_are_checked_on_a_meta_skeleton_before_the_model_is_built(vit1, tmp_path, monkeypatch):
    """A config inflated far beyond its weights fails on the meta device: the real model is never allocated."""
    import attnaudit.models.hf as hf

    folder = _copy(vit1[0], tmp_path)
    _edit_config(folder, lambda c: {**c, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 48})
    calls = []
    real_build = hf._build
    monkeypatch.setattr(
        hf,
        "_build",
        lambda cls, config, *, meta, where=None: calls.append(meta) or real_build(cls, config, meta=meta, where=where),
    )
    with pytest.raises(AuditError, match="missing key"):
        load_hf_directory(folder)
    assert calls == [True]
