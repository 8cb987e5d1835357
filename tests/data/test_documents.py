"""Documents of a causal language model (.jsonl, blank-line separated .txt, a folder of .txt files)
as rows [ids | attention] and next-token targets [next ids | weights].

Truths: token ids and targets written out by hand from a word-level vocabulary whose ids are
the list positions below, the `tokenizers` library's own encoding, the documents as written,
and hashlib over the file bytes."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from attnaudit.data.documents import DocumentOptions, load_documents, read_documents
from attnaudit.errors import AuditError, FieldError

tokenizers = pytest.importorskip("tokenizers")

VOCAB = ["[PAD]", "[UNK]", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "q", ":", "yes", "no"]
ID = {t: i for i, t in enumerate(VOCAB)}
TEXTS = ["the cat sat", "a dog ran\non the mat", "the dog"]


def _tokenizer(folder, vocab=VOCAB, bos=None):
    """tokenizer.json of a WordLevel model over ``vocab`` (ids = positions), whitespace
    pre-tokenizer, and a post-processor that adds nothing (or ``bos`` in front)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos is None:
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, ids[bos])]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _load(tmp_path, path, **options):
    options.setdefault("tokenizer", _tokenizer(tmp_path / "ckpt"))
    return load_documents(path, DocumentOptions(**options))


def _rows(ds):
    """(ids, attention, next ids, weights) as lists of lists, split at L = half the columns."""
    L = ds.X.shape[1] // 2
    return (
        ds.X[:, :L].long().tolist(),
        ds.X[:, L:].tolist(),
        ds.y[:, :L].long().tolist(),
        ds.y[:, L:].tolist(),
    )


def _one_line(exc_info, *parts):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# --------------------------------------------------------------------------- ids and targets


def test_a_known_sentence_gives_its_vocabulary_ids_and_the_eos(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    ds = _load(tmp_path, _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat on the mat"}]), tokenizer=folder)
    ids, attention, _, _ = _rows(ds)
    # by hand: the=3 cat=4 sat=5 on=6 the=3 mat=7, then </s>=2 appended
    assert ids == [[3, 4, 5, 6, 3, 7, 2]] and attention == [[1.0] * 7]
    # the library's own encoding of the sentence, without the appended </s>
    ref = tokenizers.Tokenizer.from_file(folder + "/tokenizer.json")
    assert ref.encode("the cat sat on the mat").ids == ids[0][:-1]
    assert ds.X.dtype == torch.float64 and ds.y.dtype == torch.float64
    assert ds.X.shape == ds.y.shape == (1, 14) and ds.feature_shape == (14,)
    assert ds.n_classes == len(VOCAB)


def test_targets_are_the_next_ids_weighted_by_real_tokens(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran on the mat"}, {"text": "the dog"}]
    )
    ds = _load(tmp_path, path)
    ids, attention, nxt, w = _rows(ds)
    # L = 7, the longest document (6 words + </s>); padding [PAD] = 0 on the right
    assert ids == [[3, 4, 5, 2, 0, 0, 0], [8, 9, 10, 6, 3, 7, 2], [3, 9, 2, 0, 0, 0, 0]]
    assert attention == [[1, 1, 1, 1, 0, 0, 0], [1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert nxt == [[4, 5, 2, 0, 0, 0, 0], [9, 10, 6, 3, 7, 2, 0], [9, 2, 0, 0, 0, 0, 0]]
    assert w == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]]
    info = ds.info
    assert (info["documents"], info["tokens"], info["target_tokens"]) == (3, 4 + 7 + 3, 3 + 6 + 2)
    assert (info["length"], info["max_length"], info["max_length_from"]) == (7, 512, "default")
    assert (info["truncated"], info["pad_id"], info["eos_id"]) == (0, 0, 2)
    assert info["loss"] == "next-token cross-entropy" and info["files"] == 1
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    bare = _load(tmp_path, path, add_eos=False)
    ids, _, nxt, w = _rows(bare)
    assert ids == [[3, 4, 5, 0, 0, 0], [8, 9, 10, 6, 3, 7], [3, 9, 0, 0, 0, 0]]
    assert nxt == [[4, 5, 0, 0, 0, 0], [9, 10, 6, 3, 7, 0], [9, 0, 0, 0, 0, 0]]
    assert w == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]


def test_prompt_and_completion_count_only_completion_tokens(tmp_path):
    records = [
        {"prompt": "q: the cat sat", "completion": " yes"},
        {"prompt": "q:", "completion": " no"},
        {"prompt": "q: the", "completion": "cat"},  # "thecat" straddles the split: one [UNK], a completion token
    ]
    ds = _load(tmp_path, _jsonl(tmp_path / "pc.jsonl", records), prompt_field="prompt", completion_field="completion")
    ids, attention, nxt, w = _rows(ds)
    assert ids == [[11, 12, 3, 4, 5, 13, 2], [11, 12, 14, 2, 0, 0, 0], [11, 12, 1, 2, 0, 0, 0]]
    assert nxt == [[12, 3, 4, 5, 13, 2, 0], [12, 14, 2, 0, 0, 0, 0], [12, 1, 2, 0, 0, 0, 0]]
    # only the predictions of "yes"/"no"/[UNK] and of the </s> after them count
    assert w == [[0, 0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert ds.info["target_tokens"] == 6 and ds.info["tokens"] == 7 + 4 + 4
    assert ds.info["prompt_field"] == "prompt" and ds.info["text_field"] is None


def test_documents_are_cut_at_max_length_and_cut_ones_get_no_eos(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"text": "the cat sat on the mat"}, {"text": "the dog"}, {"text": "a dog ran on"}]
    )
    ds = _load(tmp_path, path, max_length=4)
    ids, attention, nxt, w = _rows(ds)
    # cut to 4 (no room, and no end, for </s>); "the dog" gets its </s>; "a dog ran on" fills 4 exactly
    assert ids == [[3, 4, 5, 6], [3, 9, 2, 0], [8, 9, 10, 6]]
    assert attention == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert nxt == [[4, 5, 6, 0], [9, 2, 0, 0], [9, 10, 6, 0]]
    assert w == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert ds.info["truncated"] == 1 and ds.info["max_length_from"] == "given"

    # a prompt/completion document keeps its prompt and shortens the completion
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "q: the cat sat", "completion": " yes no yes"}])
    ds = _load(tmp_path, pc, max_length=6, prompt_field="prompt", completion_field="completion")
    ids, _, nxt, w = _rows(ds)
    assert ids == [[11, 12, 3, 4, 5, 13]] and nxt == [[12, 3, 4, 5, 13, 0]] and w == [[0, 0, 0, 0, 1, 0]]
    assert ds.info["truncated"] == 1


def test_special_tokens_of_the_post_processor_are_kept(tmp_path):
    folder = _tokenizer(tmp_path / "bos", vocab=[*VOCAB, "<s>"], bos="<s>")  # <s> = 15
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat on"}, {"text": "dog"}])
    ids, _, nxt, w = _rows(_load(tmp_path, path, tokenizer=folder, max_length=4))
    assert ids == [[15, 3, 4, 5], [15, 9, 2, 0]]
    assert nxt == [[3, 4, 5, 0], [9, 2, 0, 0]] and w == [[1, 1, 1, 0], [1, 1, 0, 0]]
    # the <s> before a prompt belongs to the prompt
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "", "completion": "yes"}, {"prompt": "q:", "completion": " no"}])
    _, _, _, w = _rows(_load(tmp_path, pc, tokenizer=folder, prompt_field="prompt", completion_field="completion"))
    assert w == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0]]


def test_txt_file_and_folder_give_the_same_rows_as_jsonl(tmp_path):
    folder = _tokenizer(tmp_path / "ckpt")
    reference = _load(tmp_path, _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS]), tokenizer=folder)
    txt = tmp_path / "d.txt"
    txt.write_text("\n" + "the cat sat\n\n\n  \t\na dog ran\r\non the mat\n\nthe dog\n\n", encoding="utf-8")
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in reversed(
        [("01.txt", "the cat sat\n"), ("02.txt", "\na dog ran\non the mat\n\n"), ("03.txt", "the dog")]
    ):
        (docs / name).write_text(text, encoding="utf-8")
    (docs / "notes.md").write_text("not a document", encoding="utf-8")
    (docs / ".hidden.txt").write_bytes(b"\xff\xfe")
    for source in (txt, docs):
        assert [d.text for d in read_documents(source, DocumentOptions())[0]] == TEXTS
        ds = _load(tmp_path, source, tokenizer=folder)
        assert torch.equal(ds.X, reference.X) and torch.equal(ds.y, reference.y)
        assert ds.info["documents"] == 3
    folder_info = _load(tmp_path, docs, tokenizer=folder).info
    listing = "".join(
        f"{n} {hashlib.sha256((docs / n).read_bytes()).hexdigest()}\n" for n in ("01.txt", "02.txt", "03.txt")
    )
    assert folder_info["files"] == 3 and folder_info["sha256"] == hashlib.sha256(listing.encode()).hexdigest()


# --------------------------------------------------------------------------- padding and lengths


def test_without_a_pad_token_padding_holds_the_eos_and_attention_says_what_is_padding(tmp_path):
    no_pad = _tokenizer(tmp_path / "nopad", vocab=[v for v in VOCAB if v != "[PAD]"])  # [UNK]=0 </s>=1 the=2 ...
    ids, attention, nxt, w = _rows(
        _load(tmp_path, _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "dog"}]), tokenizer=no_pad)
    )
    assert ids == [[2, 3, 4, 1], [8, 1, 1, 1]] and attention == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert nxt == [[3, 4, 1, 0], [1, 1, 1, 0]] and w == [[1, 1, 1, 0], [1, 0, 0, 0]]
    # no pad and no EOS: padding is 0, and nothing is appended
    bare = _tokenizer(tmp_path / "bare", vocab=[v for v in VOCAB if v not in ("[PAD]", "</s>")])  # the=1 cat=2 ...
    ds = _load(tmp_path, _jsonl(tmp_path / "e.jsonl", [{"text": "the cat sat"}, {"text": "the"}]), tokenizer=bare)
    assert _rows(ds)[0] == [[1, 2, 3], [1, 0, 0]] and ds.info["eos_id"] is None and ds.info["pad_id"] == 0


def test_the_checkpoints_eos_and_position_limit_are_used(tmp_path):
    folder = tmp_path / "ckpt"
    _tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "mat"}}), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 3}), encoding="utf-8")
    ds = _load(
        tmp_path, _jsonl(tmp_path / "d.jsonl", [{"text": "the"}, {"text": "the cat sat on"}]), tokenizer=str(folder)
    )
    assert _rows(ds)[0] == [[3, 7, 0], [3, 4, 5]]  # "mat" (7) is this checkpoint's EOS; cut at 3 positions
    assert ds.info["max_length"] == 3 and "max_position_embeddings" in ds.info["max_length_from"]
    with pytest.raises(FieldError) as exc:
        _load(tmp_path, tmp_path / "d.jsonl", tokenizer=str(folder), max_length=4)
    assert exc.value.field == "max_length"
    _one_line(exc, "max_length 4 is more than the model takes", "give at most 3")


# --------------------------------------------------------------------------- refusals


def test_a_missing_field_names_the_line_and_the_option(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}, {"body": "the dog"}])
    with pytest.raises(FieldError) as exc:
        _load(tmp_path, path)
    assert exc.value.field == "text_field"
    _one_line(exc, "line 2", "no 'text' field", "name the field with text_field")
    # a prompt/completion record without its completion
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "q:", "answer": " yes"}])
    with pytest.raises(FieldError) as exc:
        _load(tmp_path, pc, prompt_field="prompt", completion_field="completion")
    assert exc.value.field == "completion_field"
    _one_line(exc, "line 1", "no 'completion' field")


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_bytes(b"the cat\n\n\xff dog\n")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, txt)
    _one_line(exc, str(txt), "line 3", "not valid UTF-8", "save the file as UTF-8")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_bytes(b"the cat \xc3\x28")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, docs)
    _one_line(exc, "a.txt", "line 1", "UTF-8")


def test_an_empty_document_is_refused_with_its_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}, {"text": "  \n "}])
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, path)
    _one_line(exc, "line 2", "'text' is empty", "remove the line")
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "q:", "completion": " "}])
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, pc, prompt_field="prompt", completion_field="completion")
    _one_line(exc, "line 1", "'completion' is empty")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the cat", encoding="utf-8")
    (docs / "b.txt").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, docs)
    _one_line(exc, "b.txt: line 1", "the document is empty")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n\n", encoding="utf-8")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, blank)
    _one_line(exc, "no documents")


def test_a_prompt_longer_than_max_length_is_refused_naming_max_length(tmp_path):
    path = _jsonl(
        tmp_path / "pc.jsonl",
        [{"prompt": "q:", "completion": " yes"}, {"prompt": "q: the cat sat on", "completion": " no"}],
    )
    with pytest.raises(FieldError) as exc:
        _load(tmp_path, path, max_length=4, prompt_field="prompt", completion_field="completion")
    assert exc.value.field == "max_length"
    _one_line(exc, "line 2", "the prompt is 6 tokens", "no room for its completion", "give a larger max_length")
    assert "give a larger --max-length" in str(exc.value.named("--max-length"))


def test_only_one_of_prompt_and_completion_fields_is_refused(tmp_path):
    with pytest.raises(FieldError) as exc:
        DocumentOptions(prompt_field="prompt")
    assert exc.value.field == "completion_field"
    _one_line(exc, "prompt_field needs completion_field too", "give both fields, or neither")
    with pytest.raises(FieldError) as exc:
        DocumentOptions(completion_field="completion")
    assert exc.value.field == "prompt_field"
    with pytest.raises(FieldError) as exc:
        DocumentOptions(prompt_field="x", completion_field="x")
    assert exc.value.field == "completion_field"
    # plain text has no fields to split
    txt = tmp_path / "d.txt"
    txt.write_text("the cat\n", encoding="utf-8")
    with pytest.raises(FieldError) as exc:
        _load(tmp_path, txt, prompt_field="prompt", completion_field="completion")
    assert exc.value.field == "prompt_field"
    _one_line(exc, "prompt_field and completion_field need a .jsonl file")


def test_other_bad_inputs_are_one_line_refusals(tmp_path):
    bad_json = tmp_path / "d.jsonl"
    bad_json.write_text('{"text": "the cat"}\n\n{"text": "the dog"\n', encoding="utf-8")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, bad_json)
    _one_line(exc, "line 3 is not JSON", "one JSON object per line")
    not_object = _jsonl(tmp_path / "e.jsonl", [["the cat"]])
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, not_object)
    _one_line(exc, "line 1 is a JSON list")
    not_text = _jsonl(tmp_path / "f.jsonl", [{"text": 3}])
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, not_text)
    _one_line(exc, "line 1", "not text")
    with pytest.raises(FieldError) as exc:
        load_documents(_jsonl(tmp_path / "g.jsonl", [{"text": "the"}]), DocumentOptions())
    assert exc.value.field == "tokenizer"
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, tmp_path / "missing.jsonl")
    _one_line(exc, "no such file")
    other = tmp_path / "d.csv"
    other.write_text("text\nthe cat\n", encoding="utf-8")
    with pytest.raises(AuditError) as exc:
        _load(tmp_path, other)
    _one_line(exc, "not a document source", ".jsonl", ".txt")
    for bad in (0, 1, True, 2.5, "8"):
        with pytest.raises(FieldError) as exc:
            DocumentOptions(max_length=bad)
        assert exc.value.field == "max_length"
