"""Text data: JSON-lines or CSV files of (text, label) records, tokenized offline with the
audited checkpoint's own tokenizer (``tokenizer.json``, read by the ``tokenizers`` library).

A record's text goes through the tokenizer as the checkpoint was trained with it (its
normaliser, pre-tokenizer, special tokens and post-processor), truncated to ``max_length``
tokens and padded to exactly ``max_length`` with the tokenizer's pad token, so every sample
is one row of ``max_length`` token ids. ``max_length`` unset (None) means the smaller of 128 and
the model's position limit (:func:`position_limit`: ``max_position_embeddings`` of the
``config.json`` beside the tokenizer, else the tokenizer's ``model_max_length``); a value above
that limit is refused. The report's data ``info`` records the length used and where it came from. The model wrapper masks the padding
(:class:`attnaudit.models.hf.HFSequenceClassifier`: attention mask ``input_ids != pad``), so
the pad id of the tokenizer must be the model's ``pad_token_id`` (checked where both are
known). Labels are integers 0..K-1, or strings mapped through the checkpoint's ``label2id``
(``config.json``) when it has one, else numbered in sorted order (the map is recorded).

Every file is checked as hostile input: sizes, encodings, fields and labels, and each failure is
one :class:`AuditError` naming the file, the line and the fix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnaudit.data.spec import MAX_CLASSES, Source
from attnaudit.errors import AuditError, FieldError, clip_text, literal

TEXT_SUFFIXES = (".jsonl", ".csv")
MAX_FILE_BYTES = 1 << 30  # 1 GiB of text is far more than an audit reads
MAX_LINE_BYTES = 1 << 20  # one record of more than 1 MiB is refused (a broken file, not a text)
MAX_LENGTH_LIMIT = 1 << 16
DEFAULT_MAX_LENGTH = 128  # tokens per sample when max_length is unset and the model allows as many
# tokenizer.json of the largest public vocabularies (250k tokens, merges included) is ~35 MB;
# a bigger file is refused from its size, before the tokenizers library parses any of it.
MAX_TOKENIZER_BYTES = 64 << 20
MAX_CONFIG_BYTES = 1 << 20  # config.json beside it, as attnaudit.models.hf reads it


@dataclass(frozen=True)
class TextOptions:
    """How records become token rows: field names, the tokenizer, and the row length."""

    text_field: str = "text"
    label_field: str = "label"
    tokenizer: str | None = None  # tokenizer.json, or a folder holding it (a Hugging Face checkpoint)
    max_length: int | None = None  # None: min(DEFAULT_MAX_LENGTH, the model's position limit)

    def __post_init__(self) -> None:
        for name in ("text_field", "label_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise FieldError(name, "{name} must name a field, got " + literal(clip_text(repr(value), 80)))
        if self.max_length is not None and (
            isinstance(self.max_length, bool)
            or not isinstance(self.max_length, int)
            or not (2 <= self.max_length <= MAX_LENGTH_LIMIT)
        ):
            raise FieldError(
                "max_length",
                "{name} must be an integer in 2.."
                + f"{MAX_LENGTH_LIMIT}, got "
                + literal(clip_text(repr(self.max_length), 80)),
            )


def is_text_file(path: Path, text_field: str = "text") -> bool:
    """A .jsonl file, or a .csv whose header names the text field."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return True
    if suffix != ".csv":
        return False
    try:
        with path.open("rb") as fh:
            head = fh.readline(MAX_LINE_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return False
    return text_field in next(csv.reader([head]), [])


# --------------------------------------------------------------------------- records


def read_file_bytes(path: Path) -> bytes:
    """The bytes of a user's file, refused when missing or over MAX_FILE_BYTES."""
    if not path.is_file():
        raise FieldError("data", literal(path) + ": no such file; check the {name} path")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise AuditError(f"{path}: {size / 2**30:.1f} GiB is more text than an audit reads (limit 1 GiB); use a sample")
    return path.read_bytes()


def decode_utf8(raw: bytes, path: Path) -> str:
    """``raw`` as UTF-8 text (a leading byte-order mark dropped); else one error naming the line."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise AuditError(f"{path}: line {line} is not valid UTF-8 (byte {exc.start}); save the file as UTF-8") from None


def check_line_lengths(text: str, path: Path) -> None:
    """Refuse a line over MAX_LINE_BYTES (a broken file, not a text)."""
    for i, line in enumerate(text.split("\n"), start=1):
        if len(line.encode("utf-8")) > MAX_LINE_BYTES:
            raise AuditError(f"{path}: line {i} is longer than 1 MiB; one record per line, texts under 1 MiB")


def read_records(path: str | Path, text_field: str = "text", label_field: str = "label") -> tuple[list[str], list[Any]]:
    """(texts, labels) of a .jsonl (one JSON object per line) or .csv (a header row) file."""
    path = Path(path)
    text = decode_utf8(read_file_bytes(path), path)
    check_line_lengths(text, path)
    texts: list[str] = []
    labels: list[Any] = []
    if path.suffix.lower() == ".jsonl":
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AuditError(f"{path}: line {i} is not JSON ({exc.msg}); one JSON object per line") from None
            if not isinstance(record, dict):
                raise AuditError(
                    f"{path}: line {i} is a JSON {type(record).__name__}, not an object with "
                    f"{text_field!r} and {label_field!r}"
                )
            texts.append(_field(record, text_field, path, i, "text"))
            labels.append(_field(record, label_field, path, i, "label"))
    else:
        reader = csv.DictReader(io.StringIO(text))
        header = reader.fieldnames or []
        for name, what in ((text_field, "text"), (label_field, "label")):
            if name not in header:
                raise FieldError(
                    f"{what}_field",
                    literal(f"{path}: no {name!r} column (columns: {clip_text(', '.join(header), 120)})")
                    + f"; name the {what} column with "
                    + "{name}",
                )
        for i, row in enumerate(reader, start=2):
            if None in row:  # more cells than the header names
                raise AuditError(
                    f"{path}: line {i} has more cells than the header's {len(header)}; quote texts that contain commas"
                )
            texts.append(_field(row, text_field, path, i, "text"))
            labels.append(_field(row, label_field, path, i, "label"))
    if not texts:
        raise AuditError(f"{path}: no records; give one {text_field!r} and {label_field!r} per line")
    return texts, labels


def _field(record: Mapping[str, Any], name: str, path: Path, line: int, what: str) -> Any:
    if name not in record or record[name] is None:
        raise FieldError(
            f"{what}_field",
            literal(f"{path}: line {line} has no {name!r} field")
            + f"; every record needs one (or name the {what} field with "
            + "{name})",
        )
    value = record[name]
    if what == "text":
        if not isinstance(value, str):
            raise AuditError(f"{path}: line {line}: {name!r} is a {type(value).__name__}, not text")
        if not value.strip():
            raise AuditError(f"{path}: line {line}: {name!r} is empty; remove the record or give it a text")
    return value


def label_ids(labels: Sequence[Any], label2id: Mapping[str, int] | None, where: str) -> tuple[np.ndarray, dict]:
    """Integer class ids (n,) and the map used: integers stay (0..K-1); strings go through the
    checkpoint's ``label2id``, else are numbered in sorted order."""

    def index_like(v: Any) -> bool:
        # ASCII digits only: "²".isdigit() is true but int("²") fails
        return (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v.strip()) is not None
        )

    if all(index_like(v) for v in labels):
        # checked as text and Python ints: int64 would overflow on 10**30, int() refuses 5,000 digits
        long_text = next((v for v in labels if isinstance(v, str) and len(v.strip().lstrip("-")) > 20), None)
        values = [int(v) for v in labels] if long_text is None else []
        out_of_range = (
            long_text if long_text is not None else next((v for v in values if not 0 <= v < MAX_CLASSES), None)
        )
        if out_of_range is not None:
            raise AuditError(
                f"{where}: label {clip_text(out_of_range, 40)} is outside 0..{MAX_CLASSES - 1}; labels are class indices"
            )
        return np.asarray(values, dtype=np.int64), {}
    if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in labels):
        bad = next(v for v in labels if not isinstance(v, (str, int)) or isinstance(v, bool))
        raise AuditError(f"{where}: label {clip_text(repr(bad), 80)} is neither a class index nor a class name")
    names = [str(v) for v in labels]
    if label2id:
        unknown = sorted(set(names) - set(label2id))
        if unknown:
            raise AuditError(
                f"{where}: unknown label {clip_text(repr(unknown[0]), 80)}; the checkpoint's classes are "
                f"{clip_text(', '.join(sorted(label2id)), 120)}"
            )
        mapping = {k: int(v) for k, v in label2id.items()}
        outside = sorted(k for k, v in mapping.items() if not 0 <= v < MAX_CLASSES)
        if outside:
            raise AuditError(
                f"{where}: the checkpoint's label2id maps {clip_text(repr(outside[0]), 80)} to {clip_text(mapping[outside[0]], 80)}, "
                f"outside 0..{MAX_CLASSES - 1}; fix label2id in config.json"
            )
    else:
        mapping = {name: i for i, name in enumerate(sorted(set(names)))}
    return np.asarray([mapping[n] for n in names], dtype=np.int64), mapping


# --------------------------------------------------------------------------- tokenizer


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a path names: the file itself, or the one inside a checkpoint folder."""
    p = Path(path).expanduser()
    candidate = p / "tokenizer.json" if p.is_dir() else p
    if not candidate.is_file():
        raise FieldError(
            "tokenizer",
            literal(p) + ": no tokenizer.json; text data is tokenized with the checkpoint's own tokenizer: save it "
            "beside the model (tokenizer.save_pretrained) or name it with {name}",
        )
    return candidate


def require_tokenizer(path: Path, tokenizer: str | None, what: str) -> str:
    """``tokenizer``; a FieldError on it when none is given for ``what`` (e.g. "documents need")
    read from ``path``."""
    if tokenizer is None:
        raise FieldError(
            "tokenizer",
            literal(path) + f": {what} a tokenizer: give " + "{name} (a tokenizer.json), or a Hugging Face "
            "checkpoint folder that holds its tokenizer.json",
        )
    return tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from tokenizer.json (offline; the [hf] extra brings the library)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # optional dependency: the [hf] extra
        raise AuditError("text data needs the tokenizers library: pip install 'attnaudit[hf]'") from None
    file = tokenizer_file(path)
    size = file.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise AuditError(
            f"{file}: {size:,} bytes is larger than any genuine tokenizer.json (limit {MAX_TOKENIZER_BYTES:,} bytes); "
            "save the checkpoint's own tokenizer with tokenizer.save_pretrained"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library's own parse errors, one line
        raise AuditError(f"{file}: not a tokenizers tokenizer.json ({clip_text(str(exc), 120)})") from None


def pad_id_of(tokenizer: Any, where: str) -> int:
    """The id the tokenizer pads with: its padding configuration's, else a [PAD]/<pad> token."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    for token in ("[PAD]", "<pad>", "<|pad|>"):
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return int(tid)
    raise AuditError(f"{where}: the tokenizer has no pad token; rows of equal length need one ([PAD] or <pad>)")


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int, where: str = "tokenizer") -> tuple[np.ndarray, int]:
    """Token ids (n, max_length) int64, truncated and padded; and how many texts were truncated."""
    pad = pad_id_of(tokenizer, where)
    pad_token = tokenizer.id_to_token(pad)
    tok = _copy(tokenizer)
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=pad, pad_token=pad_token, length=max_length)
    encodings = tok.encode_batch(list(texts))  # one pass: a truncated text keeps its overflow
    ids = np.asarray([e.ids for e in encodings], dtype=np.int64)
    return ids, sum(bool(e.overflowing) for e in encodings)


def _copy(tokenizer: Any) -> Any:
    """An independent copy (truncation and padding are set on it, never on the caller's)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer.to_str())


# --------------------------------------------------------------------------- source


def read_text_source(path: str | Path, options: TextOptions) -> Source:
    """The records of ``path`` as token rows (n, max_length) with class ids, for the data layer."""
    path = Path(path)
    tokenizer_path = require_tokenizer(path, options.tokenizer, "text data needs")
    texts, labels = read_records(path, options.text_field, options.label_field)
    tokenizer = load_tokenizer(tokenizer_path)
    label2id = _label2id(tokenizer_path)
    y, mapping = label_ids(labels, label2id, str(path))
    max_length, length_from = text_length(options.max_length, tokenizer_path)
    ids, truncated = tokenize(tokenizer, texts, max_length, str(path))
    file = tokenizer_file(tokenizer_path)
    return Source(
        X=ids,
        y=y,
        name=path.name,
        n_classes=int(y.max()) + 1 if label2id is None else max(int(y.max()) + 1, len(label2id)),
        scale=None,
        value_range=None,
        info={
            "source": str(path),
            "format": path.suffix.lstrip(".").lower() + "-text",
            "modality": "text",
            "text_field": options.text_field,
            "label_field": options.label_field,
            "max_length": max_length,
            "max_length_from": length_from,
            "tokenizer": str(file),
            "tokenizer_sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "pad_id": pad_id_of(tokenizer, str(path)),
            "truncated": int(truncated),
            "label_map": mapping or None,
        },
    )


def beside_tokenizer(tokenizer_path: str, name: str) -> dict | None:
    """The JSON object ``name`` (config.json, tokenizer_config.json) in the tokenizer's folder, or None.

    A broken config.json is the model loader's to refuse (attnaudit.models.hf); here it only
    means nothing is known. It is not read past MAX_CONFIG_BYTES, nor parsed past Python's depth."""
    p = Path(tokenizer_path).expanduser()
    file = (p if p.is_dir() else p.parent) / name
    if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def position_limit(tokenizer_path: str) -> tuple[int, str] | None:
    """(tokens per sample the model takes at most, where that comes from), or None when unknown:
    ``max_position_embeddings`` of the checkpoint's config.json beside the tokenizer, else the
    tokenizer's own ``model_max_length`` (tokenizer_config.json; its "no limit" placeholder, a huge
    number, is ignored)."""
    for file, key, what in (
        ("config.json", "max_position_embeddings", "the model's max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length", "the tokenizer's model_max_length"),
    ):
        value = (beside_tokenizer(tokenizer_path, file) or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 2 <= value <= MAX_LENGTH_LIMIT:
            return value, what
    return None


def text_length(max_length: int | None, tokenizer_path: str, default: int = DEFAULT_MAX_LENGTH) -> tuple[int, str]:
    """(tokens per sample, where that comes from): ``max_length`` as given (a :class:`FieldError` on
    ``max_length`` when it is more than the model's :func:`position_limit`), else the smaller of
    ``default`` (:data:`DEFAULT_MAX_LENGTH` unless given) and that limit."""
    limit = position_limit(tokenizer_path)
    if max_length is not None:
        if limit is not None and max_length > limit[0]:
            raise FieldError(
                "max_length",
                "{name} " + f"{max_length} is more than the model takes: {limit[1]} is {limit[0]}; give at most "
                f"{limit[0]}, or leave it unset to use min({default}, {limit[0]})",
            )
        return max_length, "given"
    if limit is not None and limit[0] < default:
        return limit[0], f"{limit[1]} ({limit[0]}, below the default {default})"
    return default, "default"


def _label2id(tokenizer_path: str) -> dict[str, int] | None:
    """The checkpoint's label2id (config.json beside the tokenizer), when it names real classes."""
    data = beside_tokenizer(tokenizer_path, "config.json")
    mapping = data.get("label2id") if data is not None else None
    if not isinstance(mapping, dict) or not mapping:
        return None
    if all(str(k).upper().startswith("LABEL_") for k in mapping):  # transformers' placeholder names
        return None
    return {str(k): int(v) for k, v in mapping.items() if isinstance(v, int)}
