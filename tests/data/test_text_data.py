"""Text data (.jsonl / .csv with a text column), tokenized with the checkpoint's own tokenizer.

Truths: the `tokenizers` library's own encoding (configured here, independently of the
reader), the records as written, and a Hugging Face model fed the same ids directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnaudit.data import DataSpec, load_dataset
from attnaudit.data.text import TextOptions, read_records, read_text_source
from attnaudit.errors import AuditError

tokenizers = pytest.importorskip("tokenizers")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "good", "bad", "movie", "film", "very", "not", "plot", "acting", "great"]
RECORDS = [
    ("Good movie", "positive"),
    ("very BAD film", "negative"),
    ("not good", "negative"),
    ("great acting, great plot", "positive"),
    ("bad bad bad plot and worse acting than any film", "negative"),
    ("very very good film", "positive"),
]


def _tokenizer(folder, pad="[PAD]"):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(VOCAB if pad == "[PAD]" else [v for v in VOCAB if v != "[PAD]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _jsonl(path, records=RECORDS, text="text", label="label"):
    path.write_text("".join(json.dumps({text: t, label: y}) + "\n" for t, y in records), encoding="utf-8")
    return path


def _csv(path, records=RECORDS):
    import csv

    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "text", "label"])
        for i, (t, y) in enumerate(records):
            w.writerow([i, t, y])
    return path


def test_rows_are_the_tokenizer_libraries_own_encoding(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    src = read_text_source(_jsonl(tmp_path / "d.jsonl"), TextOptions(tokenizer=str(folder), max_length=7))
    ref = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref.enable_truncation(max_length=7)
    ref.enable_padding(pad_id=0, pad_token="[PAD]", length=7)
    expected = np.array([e.ids for e in ref.encode_batch([t for t, _ in RECORDS])])
    assert np.array_equal(src.X, expected)
    # by hand for the first record: [CLS] good movie [SEP] and padding; the long one keeps its [SEP]
    assert src.X[0].tolist() == [2, 4, 6, 3, 0, 0, 0] and src.X[4, -1] == 3
    assert src.info["truncated"] == 1 and src.info["pad_id"] == 0 and src.info["modality"] == "text"
    # string labels numbered in sorted order (no label2id in the checkpoint), the map recorded
    assert src.info["label_map"] == {"negative": 0, "positive": 1}
    assert src.y.tolist() == [1, 0, 0, 1, 0, 1]


def test_jsonl_and_csv_give_the_same_rows_and_selection_works(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    a = load_dataset(DataSpec(data=str(_jsonl(tmp_path / "d.jsonl")), tokenizer=str(folder), max_length=8))
    b = load_dataset(DataSpec(data=str(_csv(tmp_path / "d.csv")), tokenizer=str(folder), max_length=8))
    assert torch.equal(a.X, b.X) and torch.equal(a.y, b.y) and a.feature_shape == (8,)
    sub = load_dataset(DataSpec(data=str(tmp_path / "d.jsonl"), tokenizer=str(folder), max_length=8, classes=(1,)))
    assert sub.n == 3 and set(sub.y.tolist()) == {1}
    some = load_dataset(DataSpec(data=str(tmp_path / "d.jsonl"), tokenizer=str(folder), max_length=8, n=4, seed=3))
    assert some.n == 4 and all(any(torch.equal(r, x) for x in a.X) for r in some.X)


def test_the_checkpoints_label2id_names_the_classes(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    (folder / "config.json").write_text(json.dumps({"label2id": {"negative": 1, "positive": 0}}))
    src = read_text_source(_jsonl(tmp_path / "d.jsonl"), TextOptions(tokenizer=str(folder)))
    assert src.y.tolist() == [0, 1, 1, 0, 1, 0]  # the checkpoint's own numbering, not sorted order
    with pytest.raises(AuditError, match=r"unknown label 'neutral'; the checkpoint's classes are negative, positive"):
        read_text_source(_jsonl(tmp_path / "e.jsonl", [("good", "neutral")]), TextOptions(tokenizer=str(folder)))


def test_custom_field_names(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    path = _jsonl(tmp_path / "d.jsonl", text="sentence", label="y")
    texts, labels = read_records(path, "sentence", "y")
    assert texts == [t for t, _ in RECORDS] and labels == [y for _, y in RECORDS]
    with pytest.raises(AuditError, match="line 1 has no 'text' field"):
        read_text_source(path, TextOptions(tokenizer=str(folder)))
    src = read_text_source(path, TextOptions(text_field="sentence", label_field="y", tokenizer=str(folder)))
    assert src.X.shape == (6, 128)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty.jsonl", b"", "no records"),
        ("blank.jsonl", b"\n\n", "no records"),
        ("nofield.jsonl", b'{"text": "good"}\n', "line 1 has no 'label' field"),
        ("notjson.jsonl", b'{"text": "good", "label": 1}\n{oops\n', "line 2 is not JSON"),
        ("array.jsonl", b"[1, 2]\n", "line 1 is a JSON list"),
        ("utf8.jsonl", b'{"text": "good", "label": 1}\n{"text": "caf\xe9", "label": 0}\n', "line 2 is not valid UTF-8"),
        ("long.jsonl", b'{"text": "' + b"a" * (1 << 20) + b'", "label": 1}\n', "line 1 is longer than 1 MiB"),
        ("emptytext.jsonl", b'{"text": "  ", "label": 1}\n', "line 1: 'text' is empty"),
        ("numbertext.jsonl", b'{"text": 3, "label": 1}\n', "'text' is a int, not text"),
        ("badlabel.jsonl", b'{"text": "good", "label": [1]}\n', "neither a class index nor a class name"),
        ("nocolumn.csv", b"id,text\n1,good\n", "no 'label' column"),
        ("extra.csv", b"text,label\ngood,1,2\n", "line 2 has more cells than the header"),
    ],
)
def test_bad_text_files_get_one_clear_line(tmp_path, name, content, message):
    folder = _tokenizer(tmp_path / "ckpt")
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(AuditError, match=message) as exc:
        read_text_source(path, TextOptions(tokenizer=str(folder)))
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_a_checkpoint_without_a_tokenizer_says_so(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(AuditError, match="no tokenizer.json; text data is tokenized with the checkpoint's own"):
        read_text_source(path, TextOptions(tokenizer=str(tmp_path / "ckpt")))
    with pytest.raises(AuditError, match="text data needs a tokenizer"):
        read_text_source(path, TextOptions())
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(AuditError, match="not a tokenizers tokenizer.json"):
        read_text_source(path, TextOptions(tokenizer=str(tmp_path / "bad.json")))
    nopad = _tokenizer(tmp_path / "nopad", pad=None)
    with pytest.raises(AuditError, match="no pad token"):
        read_text_source(path, TextOptions(tokenizer=str(nopad)))


def test_options_are_checked(tmp_path):
    with pytest.raises(AuditError, match="^max_length must be an integer in 2"):
        TextOptions(max_length=1)
    with pytest.raises(AuditError, match="^text_field must name a field"):
        TextOptions(text_field=" ")
    folder = _tokenizer(tmp_path / "ckpt")
    with pytest.raises(AuditError, match="^preprocess center applies to numbers, not token ids"):
        load_dataset(DataSpec(data=str(_jsonl(tmp_path / "d.jsonl")), tokenizer=str(folder), preprocess="center"))


def test_a_hugging_face_classifier_reads_the_rows_as_its_own_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    from attnaudit.models.hf import adapt_to_data, load_hf_directory

    folder = tmp_path / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        pad_token_id=0,
    )
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    _tokenizer(folder)
    ds = load_dataset(DataSpec(data=str(_jsonl(tmp_path / "d.jsonl")), tokenizer=str(folder), max_length=8))
    loaded = adapt_to_data(load_hf_directory(folder), ds.feature_shape)
    ids = ds.X.long()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        assert torch.allclose(loaded.task().logits(ds.X), ref, atol=1e-5)


def _bert_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        pad_token_id=0,
        label2id={"negative": 0, "positive": 1},
        id2label={0: "negative", 1: "positive"},
    )
    transformers.BertForSequenceClassification(config).eval().save_pretrained(folder)
    return _tokenizer(folder)


def test_the_command_line_audits_a_text_checkpoint_with_its_own_tokenizer(tmp_path, capsys):
    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", RECORDS * 5)
    out = tmp_path / "k.json"
    with pytest.raises(SystemExit) as code:
        main(
            [
                "kappa",
                "--checkpoint",
                str(folder),
                "--data",
                str(data),
                "--max-length",
                "8",
                "--n",
                "20",
                "-q",
                "--json",
                str(out),
            ]
        )
    assert code.value.code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    info = report["results"]["dataset"]
    assert info["modality"] == "text" and info["tokenizer"] == str(folder / "tokenizer.json")
    assert info["label_map"] == {"negative": 0, "positive": 1} and info["max_length"] == 8
    assert "attention.self" in json.dumps(report["results"]["models"]["bert"])  # the encoder's attention layers
    assert "--max-length 8" in report["command"]


def test_without_max_length_texts_fit_the_models_position_limit(tmp_path, capsys):
    """A BERT of 64 positions and texts of up to 100 tokens: unset, max_length is min(128, 64) = 64
    (recorded with where it came from); --max-length 100 is refused naming the flag."""
    pytest.importorskip("transformers")
    from hf_models import tiny_bert

    from attnaudit.cli import main

    folder = tmp_path / "bert64"
    tiny_bert(len(VOCAB), max_positions=64, num_labels=2).save_pretrained(folder)
    _tokenizer(folder)
    long = [(" ".join(["very"] * (20 * i) + ["good"]), "positive") for i in range(1, 6)]
    data = _jsonl(tmp_path / "long.jsonl", (RECORDS + long) * 2)
    out = tmp_path / "k.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["kappa", "--checkpoint", str(folder), "--data", str(data), "-q", "--json", str(out)])
    assert code.value.code == 0, capsys.readouterr().err
    info = json.loads(out.read_text())["results"]["dataset"]
    assert info["max_length"] == 64 and info["truncated"] > 0
    assert "max_position_embeddings" in info["max_length_from"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["kappa", "--checkpoint", str(folder), "--data", str(data), "--max-length", "100", "-q"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "--max-length 100 is more than the model takes" in err, err
    # from Python the error names the field
    with pytest.raises(AuditError, match="^max_length 100 is more than the model takes"):
        load_dataset(DataSpec(data=str(data), tokenizer=str(folder), max_length=100))
    # without a model's limit the default stays 128
    plain = _tokenizer(tmp_path / "plain")
    assert load_dataset(DataSpec(data=str(data), tokenizer=str(plain))).info["max_length_from"] == "default"


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "no records"),
        (b'{"text": "good"}\n', "line 1 has no 'label' field"),
        (b'{"text": "good", "label": "neutral"}\n', "unknown label 'neutral'"),
        (b'{"text": "caf\xe9", "label": 0}\n', "line 1 is not valid UTF-8"),
    ],
)
def test_bad_text_files_exit_2_with_one_line_on_the_command_line(tmp_path, capsys, content, message):
    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    capsys.readouterr()  # transformers' own progress output while saving the fixture
    data = tmp_path / "bad.jsonl"
    data.write_bytes(content)
    with pytest.raises(SystemExit) as code:
        main(["kappa", "--checkpoint", str(folder), "--data", str(data), "-q"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_text_audit_example_runs(tmp_path):
    """examples/text/make_text_checkpoint.py: model, tokenizer, reviews.jsonl, and the YAML audit, end to end."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[2] / "examples" / "text" / "make_text_checkpoint.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ex")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "text-checkpoint-gate: 4 of 4 checks passed (exit 0)" in out.stdout
    assert (tmp_path / "ex" / "text-model" / "tokenizer.json").is_file()


def test_malleability_swaps_tokens_of_a_text_checkpoint(tmp_path, capsys):
    """--attacks hotflip,swap: at most eps tokens per text, hotflip raises the model's loss, swap is its control."""
    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", RECORDS * 5)
    out = tmp_path / "m.json"
    argv = [
        "malleability",
        "--checkpoint",
        str(folder),
        "--data",
        str(data),
        "--max-length",
        "8",
        "--protocol",
        "static",
        "--n-train",
        "16",
        "--n-test",
        "8",
        "--seeds",
        "2",
        "--top-k",
        "4",
        "-q",
    ]
    with pytest.raises(SystemExit) as code:
        main([*argv, "--attacks", "hotflip,swap", "--eps", "2", "--json", str(out)])
    assert code.value.code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    rows = report["results"]["attacks"]
    assert {r["method"] for r in rows} == {"hotflip", "swap"}
    for r in rows:
        assert r["perturbation_norm_max"] <= 2  # tokens swapped per text
        if r["method"] == "hotflip":
            assert r["model_loss_after"] >= r["model_loss_before"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main([*argv, "--attacks", "hotflip", "--eps", "0.5"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "--eps is the number of tokens swapped per text" in err
    hot = next(r for r in report["results"]["summary"] if r["attack"] == "hotflip")
    assert "random" in hot["floors"]  # swap, the same token budget at random, is hotflip's floor
    assert hot["floors"]["random"]["mean"] == next(
        r["flip_rate"]["mean"] for r in report["results"]["summary"] if r["attack"] == "swap"
    )


def test_save_perturbed_writes_the_edited_training_texts(tmp_path, capsys):
    """--save-perturbed: one JSON line per edited text; its swaps are exactly the tokenizer's
    tokens before and after, and re-encoding the texts gives the ids the attack produced."""
    from tokenizers import Tokenizer

    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", RECORDS * 5)
    out = tmp_path / "edits.jsonl"
    argv = ["malleability", "--checkpoint", str(folder), "--data", str(data), "--max-length", "8"]
    argv += ["--protocol", "static", "--n-train", "16", "--n-test", "8", "--seeds", "2", "--top-k", "4", "-q"]
    argv += ["--attacks", "hotflip,swap", "--eps", "2"]
    with pytest.raises(SystemExit) as code:
        main([*argv, "--save-perturbed", str(out), "--json", str(tmp_path / "m.json")])
    assert code.value.code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["results"]["perturbed_texts"]["rows"] == len(rows) > 0
    assert {r["attack"] for r in rows} == {"hotflip", "swap"} and {r["seed"] for r in rows} == {0, 1}
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for r in rows:
        assert 1 <= len(r["swaps"]) <= 2 and r["text"] != r["perturbed"]
        words = tok.encode(r["perturbed"]).tokens
        for s in r["swaps"]:
            assert s["from"] == tok.id_to_token(s["from_id"]) and s["to"] == tok.id_to_token(s["to_id"])
            assert s["from"] != s["to"] and s["to"] in words
            assert s["to"] not in ("[PAD]", "[CLS]", "[SEP]")
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:  # an existing file is kept
        main([*argv, "--save-perturbed", str(out)])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "already exists" in err
    with pytest.raises(SystemExit) as code:
        main([*argv[:-4], "--attacks", "pgd", "--eps", "0.1", "--save-perturbed", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "--save-perturbed writes the texts hotflip/swap edited" in err


def test_malleability_attacks_the_embeddings_of_a_text_checkpoint(tmp_path, capsys):
    """--attacks pgd,sign on a text model: each token's embedding moves by at most eps of its norm."""
    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", RECORDS * 5)
    out = tmp_path / "m.json"
    argv = ["malleability", "--checkpoint", str(folder), "--data", str(data), "--max-length", "8"]
    argv += ["--protocol", "static", "--n-train", "16", "--n-test", "8", "--seeds", "2", "--top-k", "4", "-q"]
    with pytest.raises(SystemExit) as code:
        main([*argv, "--attacks", "pgd,sign", "--eps", "0.25", "--norm", "l2", "--json", str(out)])
    assert code.value.code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["results"]["value_range"] is None
    rows = report["results"]["attacks"]
    assert {r["method"] for r in rows} == {"pgd", "sign"}
    for r in rows:
        assert 0 < r["perturbation_norm_max"] <= 0.25 * (1 + 1e-9)  # relative to the embedding norms
        assert r["perturbation_l2_max"] > 0
    pgd = next(r for r in rows if r["method"] == "pgd")
    assert pgd["model_loss_after"] > pgd["model_loss_before"]
    assert "random" in next(r for r in report["results"]["summary"] if r["attack"] == "pgd")["floors"]


def test_kernel_movement_between_two_text_checkpoints_and_ekfac_influence(tmp_path, capsys):
    """ntk-distance --checkpoint/--reference-checkpoint and malleability --estimator ekfac on text:
    a model against itself moved exactly 0; against another initialisation it moved."""
    import shutil

    from attnaudit.cli import main

    folder = _bert_folder(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    config = transformers.BertConfig.from_pretrained(folder)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(other)
    capsys.readouterr()
    data = _jsonl(tmp_path / "d.jsonl", RECORDS * 4)
    moved = {}
    for name, ref in (("self", folder), ("other", other)):
        out = tmp_path / f"nd_{name}.json"
        with pytest.raises(SystemExit) as code:
            main(
                [
                    "ntk-distance",
                    "--checkpoint",
                    str(folder),
                    "--reference-checkpoint",
                    str(ref),
                    "--data",
                    str(data),
                    "--max-length",
                    "8",
                    "--n-test",
                    "8",
                    "--kernel-points",
                    "8",
                    "-q",
                    "--json",
                    str(out),
                ]
            )
        assert code.value.code == 0, capsys.readouterr().err
        moved[name] = json.loads(out.read_text())["results"]["models"]["bert"]["movement"]["movement"]
    assert moved["self"] == 0.0 and moved["other"] > 0.0
    out = tmp_path / "ek.json"
    with pytest.raises(SystemExit) as code:
        main(
            [
                "malleability",
                "--checkpoint",
                str(folder),
                "--data",
                str(data),
                "--max-length",
                "8",
                "--protocol",
                "static",
                "--attacks",
                "hotflip,swap",
                "--eps",
                "1",
                "--estimator",
                "ekfac",
                "--n-train",
                "12",
                "--n-test",
                "6",
                "--seeds",
                "2",
                "--top-k",
                "3",
                "-q",
                "--json",
                str(out),
            ]
        )
    assert code.value.code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["results"]["summary"]
    assert {r["estimator"] for r in rows} == {"ekfac"} and {r["attack"] for r in rows} == {"hotflip", "swap"}


def test_per_layer_kappa_of_a_text_model_leaves_padding_out(tmp_path):
    """Each sequence's token Gram and attention maps are over its real tokens: the truth is the
    same model run on that sequence alone, unpadded (so nothing is masked), its hidden states
    and attention maps read from transformers' own outputs and decomposed by numpy."""
    transformers = pytest.importorskip("transformers")
    from attnaudit.analyses.kappa.layers import LayerKappaConfig, analyse_layers
    from attnaudit.models.hf import adapt_to_data, load_hf_directory

    folder = _bert_folder(tmp_path)
    ds = load_dataset(DataSpec(data=str(_jsonl(tmp_path / "d.jsonl")), tokenizer=str(folder), max_length=15))
    ids = ds.X.long()
    lengths = (ids != 0).sum(1)
    assert lengths.min() < lengths.max() < 15  # sequences of several lengths, all padded
    loaded = adapt_to_data(load_hf_directory(folder), ds.feature_shape)
    result = analyse_layers(loaded, ds.X, LayerKappaConfig(n=len(RECORDS)))
    layer = result.layers[0]
    assert layer.name.endswith("layer.0.attention.self")
    assert "padding excluded" in layer.attention_note
    assert layer.input.rows_per_sample.tolist() == lengths.tolist()

    model = transformers.BertForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    model = model.double().eval()
    for b in range(len(RECORDS)):
        real = ids[b, : lengths[b]].unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=real, output_hidden_states=True, output_attentions=True)
        X = out.hidden_states[0][0].numpy()  # the attention layer's input: the embeddings of the real tokens
        lam = np.linalg.eigvalsh(X @ X.T)[::-1][: min(X.shape)]
        assert layer.input.kappa_full[b] == pytest.approx(lam[0] / lam[-1], rel=1e-6)
        for h, head in enumerate(layer.heads):
            s = np.linalg.svd(out.attentions[0][0, h].numpy(), compute_uv=False)
            assert head.kappa_full[b] == pytest.approx(s[0] / s[-1], rel=1e-6)
