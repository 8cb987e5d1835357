"""Documents of a causal language model as rows and next-token targets.

Sources: a ``.jsonl`` file (one JSON object per line: a text field, or a prompt field and a
completion field), a ``.txt`` file (documents separated by one or more blank lines; a document's
lines are joined by newlines) or a folder of ``.txt`` files (each file one document, files
sorted by name; hidden files, other suffixes and subfolders are not read).

A document goes through the audited checkpoint's own tokenizer (``tokenizer.json``, read by the
``tokenizers`` library) whole, with the special tokens its post-processor adds (a BOS prefix,
say), is cut to ``max_length`` tokens, and gets the tokenizer's end-of-sequence token appended
when ``add_eos`` is set, the tokenizer has one, the document was not cut (a cut document does
not end) and there is room. Rows are padded on the right to the longest document, L tokens
(at most ``max_length``), as :mod:`attnaudit.core.lm_rows` fixes them:

* X (n, 2L) = [ids | attention], padding ids = the tokenizer's pad id, else its EOS id, else 0
  (the attention block, never the id, says what is padding);
* Y (n, 2L) = [next ids | weights], ``next[t] = ids[t + 1]`` and ``weight[t] = 1`` when token
  t + 1 is real and counted.

A document's loss is the mean next-token cross-entropy over its counted targets,
``l = sum_t w_t CE(logits_t, next_t) / max(1, sum_t w_t)``, in nats per counted token.

With ``prompt_field`` and ``completion_field`` (JSON lines only) a document is the text
``prompt + completion`` (joined as written: a separator belongs in one of them) and only
completion tokens count: the first token not added by the post-processor whose characters
reach into the completion, and every token after it (an appended EOS included). A cut keeps
the prompt and shortens the completion; a prompt that leaves no room for one completion token
is refused. Without them every real token counts.

``max_length`` unset (None) means the smaller of 512 and the model's position limit
(:func:`attnaudit.data.text.position_limit`); a value above that limit is refused. Every file
is hostile input (sizes, encodings, fields as in :mod:`attnaudit.data.text`); each failure is
one :class:`AuditError` naming the file, the line and the fix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnaudit.core.lm_rows import pack_rows, targets_for
from attnaudit.data.spec import Dataset
from attnaudit.data.text import (
    MAX_FILE_BYTES,
    MAX_LENGTH_LIMIT,
    beside_tokenizer,
    check_line_lengths,
    decode_utf8,
    load_tokenizer,
    pad_id_of,
    read_file_bytes,
    require_tokenizer,
    text_length,
    tokenizer_file,
)
from attnaudit.errors import AuditError, FieldError, clip_text, is_int, literal, one_line

DOCUMENT_SUFFIXES = (".jsonl", ".txt")
DEFAULT_MAX_LENGTH = 512  # tokens per document when max_length is unset and the model allows as many
LOSS = "next-token cross-entropy"
# end-of-sequence tokens by name, for a tokenizer whose checkpoint does not say which is its EOS
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]")


@dataclass(frozen=True)
class DocumentOptions:
    """How documents become token rows: fields, the tokenizer, the length cap and the EOS."""

    text_field: str = "text"
    prompt_field: str | None = None  # with completion_field: only completion tokens count
    completion_field: str | None = None
    tokenizer: str | None = None  # tokenizer.json, or a folder holding it (a Hugging Face checkpoint)
    max_length: int | None = None  # None: min(DEFAULT_MAX_LENGTH, the model's position limit)
    add_eos: bool = True  # append the tokenizer's EOS token when it has one and there is room

    def __post_init__(self) -> None:
        for name in ("text_field", "prompt_field", "completion_field"):
            value = getattr(self, name)
            if value is None and name != "text_field":
                continue
            if not isinstance(value, str) or not value.strip():
                raise FieldError(name, "{name} must name a field, got " + literal(clip_text(repr(value), 80)))
        if (self.prompt_field is None) != (self.completion_field is None):
            given, missing = (
                ("prompt_field", "completion_field")
                if self.prompt_field is not None
                else ("completion_field", "prompt_field")
            )
            raise FieldError(
                missing,
                f"{given} needs " + "{name} too: a document is prompt + completion and only the completion's "
                "tokens count; give both fields, or neither to score whole documents",
            )
        if self.prompt_field is not None and self.prompt_field == self.completion_field:
            raise FieldError(
                "completion_field",
                "{name} names the same field as prompt_field ("
                + literal(clip_text(repr(self.prompt_field), 80))
                + "); give two different fields",
            )
        if self.max_length is not None and (
            not is_int(self.max_length) or not (2 <= self.max_length <= MAX_LENGTH_LIMIT)
        ):
            raise FieldError(
                "max_length",
                "{name} must be an integer in 2.."
                + f"{MAX_LENGTH_LIMIT}, got "
                + literal(clip_text(repr(self.max_length), 80)),
            )
        if not isinstance(self.add_eos, bool):
            raise FieldError(
                "add_eos", "{name} must be true or false, got " + literal(clip_text(repr(self.add_eos), 80))
            )

    @property
    def split(self) -> bool:
        """Whether documents are prompt + completion (only completion tokens count)."""
        return self.prompt_field is not None


@dataclass(frozen=True)
class Document:
    """One document: its whole text, where its completion starts, and where it was read."""

    text: str
    prompt_chars: int | None  # the completion is text[prompt_chars:]; None: every token counts
    where: str  # "file: line N", for messages


# --------------------------------------------------------------------------- reading


def is_document_source(path: Path) -> bool:
    """A .jsonl or .txt file, or a folder (of .txt files)."""
    return path.is_dir() or path.suffix.lower() in DOCUMENT_SUFFIXES


def read_documents(path: str | Path, options: DocumentOptions) -> tuple[list[Document], str, int]:
    """(documents, sha256 of the source, number of files read) of a .jsonl or .txt file or a
    folder of .txt files. A folder's sha256 is that of its lines ``"<name> <sha256 of the file>\\n"``
    in reading order."""
    path = Path(path)
    if path.is_dir():
        _no_split(path, options)
        return _read_folder(path)
    suffix = path.suffix.lower()
    if not path.exists():
        raise FieldError("data", literal(path) + ": no such file or folder; check the {name} path")
    if suffix == ".jsonl":
        text, digest = _read_text(path)
        docs = _jsonl_documents(text, path, options)
    elif suffix == ".txt":
        _no_split(path, options)
        text, digest = _read_text(path)
        docs = [Document(body, None, f"{path}: line {line}") for line, body in _paragraphs(text)]
    else:
        raise AuditError(
            f"{path}: not a document source; give a .jsonl file (one JSON object per line), a .txt file "
            "(documents separated by blank lines) or a folder of .txt files (one document each)"
        )
    if not docs:
        raise AuditError(f"{path}: no documents; give at least one (a non-blank line or paragraph)")
    return docs, digest, 1


def _read_text(path: Path) -> tuple[str, str]:
    """(UTF-8 text with newlines as line breaks, sha256 of the bytes) of one file, size-checked."""
    raw = read_file_bytes(path)
    text = decode_utf8(raw, path).replace("\r\n", "\n").replace("\r", "\n")
    check_line_lengths(text, path)
    return text, hashlib.sha256(raw).hexdigest()


def _no_split(path: Path, options: DocumentOptions) -> None:
    if options.split:
        raise FieldError(
            "prompt_field",
            literal(path) + ": plain text has no fields; {name} and completion_field need a .jsonl file "
            "(one JSON object per line), or drop them to score whole documents",
        )


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each run of non-blank lines, the lines joined by newlines."""
    out: list[tuple[int, str]] = []
    lines: list[str] = []
    first = 0
    for i, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            if not lines:
                first = i
            lines.append(line)
        elif lines:
            out.append((first, "\n".join(lines)))
            lines = []
    if lines:
        out.append((first, "\n".join(lines)))
    return out


def _read_folder(folder: Path) -> tuple[list[Document], str, int]:
    files = sorted(
        (f for f in folder.iterdir() if f.suffix.lower() == ".txt" and not f.name.startswith(".") and f.is_file()),
        key=lambda f: f.name,
    )
    if not files:
        raise AuditError(f"{folder}: no .txt files; give a folder of .txt files, one document each")
    total = sum(f.stat().st_size for f in files)
    if total > MAX_FILE_BYTES:
        raise AuditError(
            f"{folder}: {total / 2**30:.1f} GiB of .txt files is more text than an audit reads (limit 1 GiB); use a sample"
        )
    docs: list[Document] = []
    listing = hashlib.sha256()
    for f in files:
        text, digest = _read_text(f)
        listing.update(f"{f.name} {digest}\n".encode())
        lines = text.split("\n")
        blank = [not line.strip() for line in lines]
        if all(blank):
            raise AuditError(f"{f}: line 1: the document is empty; remove the file or give it a text")
        first = blank.index(False)
        last = len(lines) - blank[::-1].index(False)
        docs.append(Document("\n".join(lines[first:last]), None, f"{f}: line {first + 1}"))
    return docs, listing.hexdigest(), len(files)


def _jsonl_documents(text: str, path: Path, options: DocumentOptions) -> list[Document]:
    docs: list[Document] = []
    for i, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {i}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AuditError(f"{where} is not JSON ({exc.msg}); one JSON object per line") from None
        except (ValueError, RecursionError) as exc:  # a number of thousands of digits, deep nesting
            raise AuditError(
                f"{where} is not readable JSON ({clip_text(one_line(exc), 80)}); one flat JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise AuditError(f"{where} is a JSON {type(record).__name__}, not an object with the document's fields")
        if options.prompt_field is None or options.completion_field is None:
            body = _field(record, options.text_field, "text_field", where)
            if not body.strip():
                raise AuditError(
                    f"{where}: {options.text_field!r} is empty; remove the line or give it a document's text"
                )
            docs.append(Document(body, None, where))
        else:
            prompt = _field(record, options.prompt_field, "prompt_field", where)
            completion = _field(record, options.completion_field, "completion_field", where)
            if not completion.strip():
                raise AuditError(
                    f"{where}: {options.completion_field!r} is empty; every document needs a completion to "
                    "score (remove the line or give it one)"
                )
            docs.append(Document(prompt + completion, len(prompt), where))
    return docs


def _field(record: dict, name: str, option: str, where: str) -> str:
    value = record.get(name)
    if value is None:
        raise FieldError(
            option,
            literal(f"{where} has no {name!r} field") + "; every line needs one (or name the field with {name})",
        )
    if not isinstance(value, str):
        raise AuditError(f"{where}: {name!r} is a JSON {type(value).__name__}, not text; give the document as a string")
    return value


# --------------------------------------------------------------------------- tokens


def document_length(max_length: int | None, tokenizer_path: str) -> tuple[int, str]:
    """(tokens per document at most, where that comes from): :func:`attnaudit.data.text.text_length`
    with :data:`DEFAULT_MAX_LENGTH` (512) as the default instead of a classifier's 128."""
    return text_length(max_length, tokenizer_path, DEFAULT_MAX_LENGTH)


def eos_id_of(tokenizer: Any, tokenizer_path: str) -> int | None:
    """The tokenizer's end-of-sequence id: tokenizer_config.json's ``eos_token``, else config.json's
    ``eos_token_id`` (the first of a list), else a token named like an EOS (:data:`EOS_TOKENS`);
    None when it has none."""
    token = (beside_tokenizer(tokenizer_path, "tokenizer_config.json") or {}).get("eos_token")
    if isinstance(token, dict):  # transformers' AddedToken form
        token = token.get("content")
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
        return int(tokenizer.token_to_id(token))
    value: Any = (beside_tokenizer(tokenizer_path, "config.json") or {}).get("eos_token_id")
    if isinstance(value, list) and value:
        value = value[0]
    if is_int(value) and 0 <= value < tokenizer.get_vocab_size(with_added_tokens=True):
        return int(value)
    for name in EOS_TOKENS:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


def padding_id(tokenizer: Any, eos_id: int | None, where: str) -> int:
    """The id padding columns hold: the tokenizer's pad id, else its EOS id, else 0."""
    try:
        return pad_id_of(tokenizer, where)
    except AuditError:  # no pad token: a decoder model usually has none
        return eos_id if eos_id is not None else 0


def _completion_start(encoding: Any, prompt_chars: int) -> int | None:
    """Index of the first token not added by the post-processor whose characters reach into the
    completion (text[prompt_chars:]), or None when no such token is left."""
    for t, ((start, end), special) in enumerate(zip(encoding.offsets, encoding.special_tokens_mask)):
        if not special and (end > prompt_chars or start >= prompt_chars):
            return t
    return None


def encode_documents(
    tokenizer: Any, docs: Sequence[Document], max_length: int, eos_id: int | None, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids (n, L) long, attention (n, L) bool, counted (n, L) bool, documents cut) of ``docs``
    tokenized whole, cut to ``max_length``, with ``eos_id`` appended where there is room
    (None: nothing appended), padded on the right with ``pad_id`` to the longest, L tokens.
    ``tokenizer`` is configured here (no padding, truncation at ``max_length``): pass a fresh one."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    try:
        encodings = tokenizer.encode_batch([d.text for d in docs])
    except Exception as exc:  # noqa: BLE001 - the library's refusal (max_length below its special tokens), one line
        raise FieldError(
            "max_length",
            "the tokenizer cannot cut documents to {name} = "
            + f"{max_length} ("
            + literal(clip_text(one_line(exc), 120))
            + "); give a larger {name}",
        ) from None
    rows: list[list[int]] = []
    starts: list[int] = []
    cut_count = 0
    for doc, enc in zip(docs, encodings):
        ids = [int(i) for i in enc.ids]
        cut = bool(enc.overflowing)
        cut_count += cut
        if all(enc.special_tokens_mask):
            raise AuditError(
                f"{doc.where}: the document gives no tokens with this tokenizer; remove it or give it a text"
            )
        start = 0
        if doc.prompt_chars is not None:
            found = _completion_start(enc, doc.prompt_chars)
            if found is None and cut:
                tokenizer.no_truncation()
                n_prompt = len(tokenizer.encode(doc.text[: doc.prompt_chars]).ids)
                raise FieldError(
                    "max_length",
                    literal(f"{doc.where}: the prompt is {n_prompt} tokens")
                    + ", leaving no room for its completion within {name} = "
                    + f"{max_length}; give a larger "
                    + "{name} or a shorter prompt",
                )
            if found is None:
                raise AuditError(
                    f"{doc.where}: the completion gives no tokens with this tokenizer; give it a text the tokenizer reads"
                )
            start = found
        if eos_id is not None and not cut and len(ids) < max_length and ids[-1] != eos_id:
            ids.append(eos_id)
        rows.append(ids)
        starts.append(start)
    L = max(len(r) for r in rows)
    ids_t = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), L), dtype=torch.bool)
    counted = torch.zeros((len(rows), L), dtype=torch.bool)
    for i, (r, start) in enumerate(zip(rows, starts)):
        ids_t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, : len(r)] = True
        counted[i, start : len(r)] = True
    return ids_t, attention, counted, cut_count


# --------------------------------------------------------------------------- data set


def load_documents(path: str | Path, options: DocumentOptions) -> Dataset:
    """The documents of ``path`` as a :class:`Dataset`: X (n, 2L) float64 rows [ids | attention],
    y (n, 2L) float64 targets [next ids | weights] (:mod:`attnaudit.core.lm_rows`), n_classes the
    tokenizer's vocabulary size (added tokens included)."""
    path = Path(path)
    tokenizer_path = require_tokenizer(path, options.tokenizer, "documents need")
    docs, digest, n_files = read_documents(path, options)
    tokenizer = load_tokenizer(tokenizer_path)  # a fresh instance: encode_documents configures it
    max_length, length_from = document_length(options.max_length, tokenizer_path)
    eos = eos_id_of(tokenizer, tokenizer_path)
    pad = padding_id(tokenizer, eos, str(path))
    ids, attention, counted, cut = encode_documents(tokenizer, docs, max_length, eos if options.add_eos else None, pad)
    X = pack_rows(ids, attention)
    Y = targets_for(ids, attention, counted)
    L = int(ids.shape[1])
    n_targets = int(Y[:, L:].sum())
    if n_targets == 0:
        raise AuditError(
            f"{path}: no document has a counted token after its first, so none has a target to predict; give "
            "documents (or completions) of two tokens or more"
        )
    file = tokenizer_file(tokenizer_path)
    return Dataset(
        X=X,
        y=Y,
        name=path.name,
        n_classes=int(tokenizer.get_vocab_size(with_added_tokens=True)),
        value_range=None,
        feature_shape=(2 * L,),
        info={
            "source": str(path),
            "format": "txt-folder-documents" if path.is_dir() else path.suffix.lstrip(".").lower() + "-documents",
            "modality": "text",
            "task": "next-token",
            "loss": LOSS,
            "documents": len(docs),
            "files": n_files,
            "sha256": digest,
            "text_field": None if options.split else options.text_field,
            "prompt_field": options.prompt_field,
            "completion_field": options.completion_field,
            "tokens": int(attention.sum()),
            "target_tokens": n_targets,
            "length": L,
            "max_length": max_length,
            "max_length_from": length_from,
            "truncated": int(cut),
            "pad_id": int(pad),
            "eos_id": eos,
            "add_eos": bool(options.add_eos),
            "tokenizer": str(file),
            "tokenizer_sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
        },
    )
