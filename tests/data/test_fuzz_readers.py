"""Property-based fuzzing of every reader: the fast profile (issue 28, item 1), plus the
regression cases the fuzzer found and the remaining ways in (item 4).

The strategies live in ``benchmarks/fuzz_readers.py`` (the deep run: 5,000 cases per reader
in guarded worker processes); here each reader gets a few derandomized examples in-process.
Invariant (``run_case``): a valid file loads to exactly the generated content; anything else
loads to data that keeps the data contract or raises :class:`AuditError`, one line naming
the file. Every case also runs under tracemalloc (numpy's allocations are traced) and a
10 s alarm; a case the library refuses in-process must give exit 2 and one stderr line
through the CLI (checked for the first few refused cases of each reader).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import struct
import sys
import tempfile
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from attnaudit.errors import AuditError

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fuzz_readers", ROOT / "benchmarks" / "fuzz_readers.py")
assert _spec is not None and _spec.loader is not None
F = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_readers"] = F
_spec.loader.exec_module(F)

HANG_S = 10  # the hang guard: the only wall-clock limit in this file
TRACED_LIMIT = 256 << 20  # numpy allocations of one case; every generated file is a few kB
FAST = settings(
    max_examples=int(os.environ.get("ATTNAUDIT_FUZZ_EXAMPLES", "20")),
    deadline=HANG_S * 1000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
CLI_CASES_PER_READER = 3


class Hang(Exception):
    pass


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_S):
    def fire(signum, frame):
        raise Hang(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def captured_stderr():
    """Everything the command writes to standard error: sys.stderr (rich, warnings), file
    descriptor 2 (C libraries), and logging handlers that hold a stream of their own
    (transformers binds one at import)."""
    import io
    import logging

    buf = io.StringIO()
    handlers = [h for h in logging.root.handlers if isinstance(h, logging.StreamHandler)]
    for logger in list(logging.Logger.manager.loggerDict.values()):
        handlers += [h for h in getattr(logger, "handlers", []) if isinstance(h, logging.StreamHandler)]
    handlers = [h for h in handlers if not isinstance(h, logging.FileHandler)]
    streams = [h.setStream(buf) for h in handlers]
    sys.stderr.flush()
    saved = os.dup(2)
    out: dict[str, str] = {}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stderr(buf):
                yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            for h, stream in zip(handlers, streams):
                if stream is not None:
                    h.setStream(stream)
            tmp.seek(0)
            out["text"] = buf.getvalue() + tmp.read().decode("utf-8", "replace")


def cli_args(case, root: Path) -> list[str] | None:
    """The command line that reads this case's files, or None (no CLI path: --weights needs a factory)."""
    r = case.reader
    if r in ("npy", "npz", "csv", "pt", "safetensors"):
        return ["kappa", "--data", str(root / next(iter(case.files)))]
    if r == "image-folder":
        return ["kappa", "--data", str(root / "images")]
    if r == "idx":
        return ["kappa", "--dataset", "mnist", "--data-dir", str(root)]
    if r == "cifar10":
        return ["kappa", "--dataset", "cifar10", "--split", "test", "--data-dir", str(root)]
    if r == "text":
        name = next(k for k in case.files if k.startswith("data."))
        return [
            "kappa",
            "--data",
            str(root / name),
            "--tokenizer",
            str(root / "tok"),
            "--max-length",
            str(case.options["max_length"]),
        ]
    if r == "audit-yaml":
        return ["audit", str(root / "audit.yaml")]
    if r == "tokenizer":
        (root / "texts.jsonl").write_text('{"text": "a b", "label": 0}\n{"text": "b", "label": 1}\n')
        return ["kappa", "--data", str(root / "texts.jsonl"), "--tokenizer", str(root / "tokenizer.json")]
    if r == "checkpoint":
        return ["kappa", "--checkpoint", str(root / "model.safetensors")]
    if r == "hf":
        return ["kappa", "--checkpoint", str(root / "hf")]
    return None


def run_cli(args: list[str]) -> tuple[int, str]:
    from attnaudit.cli import main

    with captured_stderr() as err:
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err["text"]


def check_one_line(code: int, err: str, root: Path) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error:"), lines[0]
    assert str(root) in lines[0] or root.name in lines[0], lines[0]


def fuzz_one(case, cli_budget: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        root = Path(tmp)
        tracemalloc.start()
        try:
            with hang_guard():
                outcome = F.run_case(case, root)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert outcome.status != "fail", f"{case.describe()}\n{outcome.detail}"
        assert peak < TRACED_LIMIT, f"{case.describe()}: {peak / 2**20:.0f} MiB allocated"
        if outcome.status == "refused" and cli_budget.get(case.reader, 0) < CLI_CASES_PER_READER:
            args = cli_args(case, root)
            if args is not None:
                cli_budget[case.reader] = cli_budget.get(case.reader, 0) + 1
                with hang_guard():
                    code, err = run_cli(args)
                check_one_line(code, err, root)


_CLI_BUDGET: dict[str, int] = {}
_RAN: set[str] = set()


def _make_test(reader: str):
    @FAST
    @given(case=F.STRATEGIES[reader]())
    def test(case) -> None:
        _RAN.add(reader)
        fuzz_one(case, _CLI_BUDGET)

    test.__name__ = f"test_fuzz_{reader.replace('-', '_')}"
    return test


for _reader in F.READERS:
    globals()[f"test_fuzz_{_reader.replace('-', '_')}"] = _make_test(_reader)


def test_every_reader_has_a_strategy_and_a_loader():
    assert set(F.STRATEGIES) == set(F.LOADERS)
    assert {
        "npy",
        "npz",
        "csv",
        "pt",
        "safetensors",
        "image-folder",
        "idx",
        "cifar10",
        "audit-yaml",
        "tokenizer",
        "text",
        "checkpoint",
        "weights",
        "hf",
    } <= set(F.READERS)


def test_zz_cli_was_exercised():
    """After the per-reader tests (file order): refused cases went through the CLI for every
    reader that has a command line (--weights needs a factory, so 'weights' has none)."""
    if _RAN != set(F.READERS):
        pytest.skip("only when every reader's fuzz test ran in this session")
    assert set(_CLI_BUDGET) == set(F.READERS) - {"weights"}, _CLI_BUDGET


def test_the_checker_can_fail(tmp_path):
    """run_case compares with the generated content: a valid case whose expectation is off fails."""
    X = np.arange(6, dtype=np.float64).reshape(3, 2)
    case = F.Case("npy", {"data.npy": F.npy_bytes(X)}, F._expect_data(X + 1, None))
    outcome = F.run_case(case, tmp_path)
    assert outcome.status == "fail" and "X differs" in outcome.detail


# --------------------------------------------------------------------------- regressions: what the fuzzer found


def _load_yaml(path: Path):
    from attnaudit.audit.file import load_audit_file

    with hang_guard():
        return load_audit_file(path)


def _refused(call, *names: str) -> str:
    with hang_guard(), pytest.raises(AuditError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 1000, msg
    for name in names:
        assert name in msg, msg
    return msg


@pytest.mark.parametrize("body", ["[" * 2000 + "]" * 2000, "{a: " * 2000 + "1" + "}" * 2000])
def test_yaml_nested_too_deep_is_refused(tmp_path, body):
    """Found by the fuzzer: nesting beyond Python's recursion limit escaped as RecursionError."""
    path = tmp_path / "audit.yaml"
    path.write_text(f"version: 1\nname: {body}\nchecks: []\n")
    msg = _refused(lambda: _load_yaml(path), str(path), "nested more than")
    assert "64" in msg


@pytest.mark.parametrize("key", ["version", "name", "checks", "extra"])
def test_yaml_billion_laughs_is_refused(tmp_path, key):
    """Found by the fuzzer: 'version: *laughs' echoed the expanded tree (9.7 MB message at 9^7,
    exponential time beyond); now refused once the expanded tree passes MAX_NODES."""
    from attnaudit.audit.file import MAX_NODES

    path = tmp_path / "audit.yaml"
    path.write_text(F.laughs(12, 9, key))  # 9**11 lists
    assert path.stat().st_size < 2000
    msg = _refused(lambda: _load_yaml(path), str(path), f"{MAX_NODES:,}")
    assert "aliases" in msg


def test_yaml_node_limit_counts_aliases_exactly(tmp_path):
    """Just under the limit loads; one alias more is refused (the count is of expanded nodes)."""
    from attnaudit.audit.file import MAX_NODES

    base = "version: 1\nname: x\nchecks: [{name: k, analysis: kappa, options: {n: 200}, metric: log10_kappa_at_rank, max: 1}]\n"
    path = tmp_path / "audit.yaml"
    path.write_text(base)
    plan = _load_yaml(path)  # 1 mapping + 3 pairs + checks list + check (1 + 5 pairs + options 1 + 1 pair)
    assert plan.name == "x"
    # an anchor of 1000 nodes (a list of 999 scalars), then k aliases of it under an unknown key
    anchor = "[" + ", ".join(["0"] * 999) + "]"
    for k, ok in (((MAX_NODES - 3000) // 1000, True), (MAX_NODES // 1000 + 1, False)):
        path.write_text(base + f"z: [&a {anchor}" + ", *a" * k + "]\n")
        msg = _refused(lambda: _load_yaml(path), "z: unknown key" if ok else f"{MAX_NODES:,}")
        assert str(path) in msg


@pytest.mark.parametrize(
    "text",
    ["version: 1\nname: &a [*a]\nchecks: []\n", "version: &v [1, *v]\nchecks: []\n", "version: 1\nx: &m {a: *m}\n"],
)
def test_yaml_recursive_anchor_is_refused(tmp_path, text):
    path = tmp_path / "audit.yaml"
    path.write_text(text)
    _refused(lambda: _load_yaml(path), str(path), "recursive anchor")


def test_yaml_merge_key_expansion_counts(tmp_path):
    """'<<: *a' copies the anchored mapping: counted like an alias, so merge chains are bounded too."""
    lines = ["version: 1", "a0: &a0 {k0: 1, k1: 2}"]
    lines += [f"a{i}: &a{i} {{<<: [*a{i - 1}], x{i}: [*a{i - 1}, *a{i - 1}]}}" for i in range(1, 30)]
    path = tmp_path / "audit.yaml"
    path.write_text("\n".join(lines) + "\nchecks: []\n")
    _refused(lambda: _load_yaml(path), str(path), "aliases")


@pytest.mark.parametrize("line", ["seed: " + "9" * 5000, "version: " + "1" * 5000])
def test_yaml_integer_beyond_python_digit_limit(tmp_path, line):
    """Found by the fuzzer: an integer of more than 4,300 digits escaped as ValueError."""
    path = tmp_path / "audit.yaml"
    path.write_text(f"version: 1\n{line}\nchecks: []\n" if line.startswith("seed") else f"{line}\nchecks: []\n")
    _refused(lambda: _load_yaml(path), str(path), "more than 4300 digits")


def test_yaml_seed_out_of_range_refused_at_load(tmp_path):
    """Found by the fuzzer: 'seed: 99999999999999999999' passed the file check (refused only by the run)."""
    path = tmp_path / "audit.yaml"
    path.write_text(
        "version: 1\nseed: 99999999999999999999\nchecks: [{name: k, analysis: kappa, metric: log10_kappa_at_rank, max: 1}]\n"
    )
    _refused(lambda: _load_yaml(path), str(path), "seed", "4294967295")


def test_yaml_long_values_are_clipped_in_messages(tmp_path):
    path = tmp_path / "audit.yaml"
    path.write_text("version: 1\nchecks: [{name: k, analysis: kappa, metric: " + "m" * 100_000 + ", max: 1}]\n")
    msg = _refused(lambda: _load_yaml(path), str(path), "unknown metric")
    assert len(msg) < 600


def test_hf_config_nested_too_deep_is_refused(tmp_path):
    """Found by the fuzzer: a config.json nested 100,000 deep escaped as RecursionError."""
    from attnaudit.models.checkpoints import load_checkpoint

    cfg, weights, _ = F.hf_base(0)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(cfg.rstrip()[:-1] + b', "deep": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    (folder / "model.safetensors").write_bytes(weights)
    _refused(lambda: load_checkpoint(folder), str(folder / "config.json"), "too deeply")


def _hf_folder_with(tmp_path, key, value):
    """A valid fuzzer Hugging Face folder whose config.json says ``key: value``."""
    cfg, weights, _ = F.hf_base(0)
    config = json.loads(cfg)
    config[key] = value
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.mark.parametrize("key, value", [("vocab_size", 0), ("vocab_size", -1), ("hidden_size", -1)])
def test_hf_lying_config_is_one_line_on_the_cli(tmp_path, key, value):
    """Found by the fuzzer's CLI check: transformers logged its own warning ('pad_token_id must
    be ... within the vocabulary') before the refusal, so stderr held two lines."""
    folder = _hf_folder_with(tmp_path, key, value)
    code, err = run_cli(["kappa", "--checkpoint", str(folder)])
    check_one_line(code, err, tmp_path)


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("num_labels", 10**12, "num_labels must be an integer in 1..100000"),
        ("num_labels", 2**40, "num_labels must be an integer in 1..100000"),
        ("num_attention_heads", -1, "num_attention_heads must be an integer in 1..2147483647"),
        ("hidden_size", "8", "hidden_size must be an integer in 1..2147483647"),
        ("num_hidden_layers", 10**12, "num_hidden_layers must be an integer in 1..1024"),
        ("num_labels", 0, "num_labels must be an integer in 1..100000"),
    ],
)
def test_hf_config_sizes_checked_before_transformers_builds(tmp_path, key, value, problem):
    """Found by the deep run: num_labels=10**12 made transformers build a dict of 10**12 labels
    (MemoryError under the 2 GiB cap), num_hidden_layers=10**12 built layers on the meta device
    past the 10 s limit, and num_attention_heads=-1 loaded a model whose forward pass cannot run
    (head size -8)."""
    from attnaudit.models.checkpoints import load_checkpoint

    folder = _hf_folder_with(tmp_path, key, value)
    tracemalloc.start()
    try:
        _refused(lambda: load_checkpoint(folder), str(folder / "config.json"), problem)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, peak


@pytest.mark.parametrize("header", [b"P5\n2\xa3 2\n255\n", b"P6\n2 2\n25\x0e\n", b"P5\n^Rc 2\n255\n"])
def test_image_with_garbled_ppm_header_is_refused(tmp_path, header):
    """Found by the fuzzer: PIL's PPM reader raised ValueError (not OSError) on a garbled header."""
    from attnaudit.data import DataSpec, load_dataset

    (tmp_path / "images" / "a").mkdir(parents=True)
    (tmp_path / "images" / "a" / "x.ppm").write_bytes(F.image_bytes(np.zeros((2, 2), np.uint8), "PPM"))
    (tmp_path / "images" / "a" / "y.ppm").write_bytes(header + b"\x00" * 12)
    _refused(lambda: load_dataset(DataSpec(data=str(tmp_path / "images"))), "y.ppm", "cannot read image")


def _lying_png(width: int, height: int) -> bytes:
    png = bytearray(F.image_bytes(np.zeros((2, 2), np.uint8)))
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


@pytest.mark.parametrize("size", [(4096, 4096), (65535, 65535), (2**31 - 1, 1)])
def test_png_headers_lying_about_size_allocate_nothing(tmp_path, size):
    """40 PNGs of 70 bytes whose headers claim 4096x4096 (670 MB of pixels) or more: refused
    (decoding fails, or over MAX_IMAGE_PIXELS) before any array of that size exists."""
    from attnaudit.data import DataSpec, load_dataset

    folder = tmp_path / "images" / "a"
    folder.mkdir(parents=True)
    for i in range(40):
        (folder / f"x{i:02d}.png").write_bytes(_lying_png(*size))
    tracemalloc.start()
    try:
        msg = _refused(lambda: load_dataset(DataSpec(data=str(tmp_path / "images"))), "x00.png")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert "cannot read image" in msg or "pixels" in msg


@pytest.mark.parametrize("tail", [b"\xe8\x80", b"\xff", b"3.0,\xc3(\n"])
def test_csv_invalid_utf8_below_the_header_is_refused(tmp_path, tail):
    """Found by the fuzzer: invalid UTF-8 after the header escaped as UnicodeDecodeError."""
    from attnaudit.data import DataSpec, load_dataset

    path = tmp_path / "data.csv"
    path.write_bytes(b"f0,label\n1.0,0\n2.0,1\n" + tail)
    _refused(lambda: load_dataset(DataSpec(data=str(path))), str(path), "line 4 is not valid UTF-8")


def test_npy_header_promising_1e12_elements_allocates_nothing(tmp_path):
    from attnaudit.data import DataSpec, load_dataset

    path = tmp_path / "data.npy"
    path.write_bytes(F.npy_lying_header("<f8", "(1000000000000, 4)", b"\x00" * 64))
    tracemalloc.start()
    try:
        _refused(lambda: load_dataset(DataSpec(data=str(path))), str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_npz_member_header_promising_1e12_elements_allocates_nothing(tmp_path):
    """Found by the fuzzer: numpy allocated the 32 TB an .npz member's header promised (the
    deep run's memory cap turned it into a MemoryError) before finding 64 bytes of data."""
    from attnaudit.data import DataSpec, load_dataset

    path = tmp_path / "data.npz"
    member = F.npy_lying_header("<f8", "(1000000000000, 4)", b"\x00" * 64)
    path.write_bytes(F._zip_with({"X.npy": member, "y.npy": F.npy_bytes(np.zeros(2, np.int64))}))
    tracemalloc.start()
    try:
        msg = _refused(lambda: load_dataset(DataSpec(data=str(path))), str(path), "X.npy", "promises")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert "64 bytes" in msg


@pytest.mark.parametrize("size", [2**31, 2**32 - 1])
def test_npz_zip_directory_lying_about_member_size(tmp_path, size):
    from attnaudit.data import DataSpec, load_dataset

    path = tmp_path / "data.npz"
    path.write_bytes(F._zip_with({"X.npy": F.npy_bytes(np.ones((3, 2)))}, {"X.npy": size}))
    _refused(lambda: load_dataset(DataSpec(data=str(path))), str(path), f"{size} bytes")


def test_npy_with_junk_after_the_data_is_refused(tmp_path):
    """The payload must be exactly what the header states (numpy would ignore a tail)."""
    from attnaudit.data import DataSpec, load_dataset

    path = tmp_path / "data.npy"
    path.write_bytes(F.npy_bytes(np.ones((3, 2))) + b"junk")
    _refused(lambda: load_dataset(DataSpec(data=str(path))), str(path), "48 bytes", "52 bytes")


@pytest.mark.parametrize("label", [10**30, "9" * 30, "-" + "9" * 5000, "\u00b2"])
def test_text_label_beyond_int64_or_not_a_digit(tmp_path, label):
    """Found by the fuzzer: label 10**30 escaped as OverflowError (int64); '\u00b2'.isdigit() is
    true but int() refuses it; 5,000 digits pass Python's int() limit."""
    from attnaudit.data import DataSpec, load_dataset

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(F.tokenizer_json({w: i for i, w in enumerate(F.TEXT_VOCAB)}))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "w1", "label": label}) + "\n" + json.dumps({"text": "w2", "label": 0}) + "\n")
    spec = DataSpec(data=str(data), tokenizer=str(tok))
    if label == "\u00b2":  # a class name, not an index: numbered in sorted order ("0" < "\u00b2")
        from attnaudit.data import load_dataset as load

        assert load(spec).y.tolist() == [1, 0]
    else:
        _refused(lambda: load_dataset(spec), str(data), "outside 0..99999")


def test_text_label2id_out_of_range_is_refused(tmp_path):
    """label2id in config.json beside the tokenizer maps names to -1: refused, not a negative label."""
    from attnaudit.data import DataSpec, load_dataset

    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {w: i for i, w in enumerate(F.TEXT_VOCAB)}
    (tok / "tokenizer.json").write_bytes(F.tokenizer_json(vocab))
    (tok / "config.json").write_text(json.dumps({"label2id": {"good": 0, "bad": -1}}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "w1 w2", "label": "good"}\n{"text": "w3", "label": "bad"}\n')
    _refused(lambda: load_dataset(DataSpec(data=str(data), tokenizer=str(tok))), str(data), "label2id")


# --------------------------------------------------------------------------- item 4: the remaining ways in


def test_tokenizer_json_of_absurd_size_refused_from_its_size(tmp_path):
    """A tokenizer.json over MAX_TOKENIZER_BYTES (64 MiB) is refused from its size: the file
    here is sparse (1 TiB of zeros after a valid start), so parsing it would take hours."""
    from attnaudit.data.text import MAX_TOKENIZER_BYTES, load_tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_bytes(F.tokenizer_json({"[UNK]": 0, "[PAD]": 1, "a": 2}))
    os.truncate(path, 1 << 40)
    msg = _refused(lambda: load_tokenizer(path), str(path), f"{MAX_TOKENIZER_BYTES:,}")
    assert "1,099,511,627,776 bytes" in msg
    os.truncate(path, MAX_TOKENIZER_BYTES + 1)
    _refused(lambda: load_tokenizer(path), str(path), "limit")


@pytest.mark.parametrize("name", ["config.json"])
def test_hf_config_of_absurd_size_refused_from_its_size(tmp_path, name):
    from attnaudit.models.checkpoints import load_checkpoint
    from attnaudit.models.hf import MAX_CONFIG_BYTES

    cfg, weights, _ = F.hf_base(0)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(cfg)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / name).write_bytes(b'{"a": 1}')
    os.truncate(folder / name, 1 << 40)
    _refused(lambda: load_checkpoint(folder), str(folder / name), f"{MAX_CONFIG_BYTES:,}-byte limit")


@pytest.mark.parametrize("architectures", [None, ["EvilModel"]])
def test_hf_remote_code_stays_refused(tmp_path, architectures):
    """auto_map asks transformers to import code shipped in the folder: refused, library and CLI,
    and the folder's .py file never runs."""
    from attnaudit.models.checkpoints import load_checkpoint

    cfg, weights, _ = F.hf_base(0)
    config = json.loads(cfg)
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForSequenceClassification": "evil.EvilModel"}
    if architectures:
        config["architectures"] = architectures
    folder = tmp_path / "hf"
    folder.mkdir()
    marker = tmp_path / "PWNED.marker"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights)
    _refused(lambda: load_checkpoint(folder), str(folder), "custom modelling code")
    code, err = run_cli(["kappa", "--checkpoint", str(folder)])
    check_one_line(code, err, tmp_path)
    assert not marker.exists()


def _image_folder(tmp_path: Path) -> tuple[Path, np.ndarray]:
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    pixels = np.arange(4, dtype=np.uint8).reshape(2, 2) * 60
    (root / "a" / "x.png").write_bytes(F.image_bytes(pixels))
    return root, pixels


@pytest.mark.parametrize("kind", ["file", "class-folder", "root-entry"])
def test_symlink_out_of_image_folder_is_refused(tmp_path, kind):
    """A link that resolves outside the image folder is refused, naming the link and its target."""
    from attnaudit.data import DataSpec, load_dataset

    root, pixels = _image_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(F.image_bytes(pixels))
    link = {"file": root / "a" / "y.png", "class-folder": root / "b", "root-entry": root / "c"}[kind]
    link.symlink_to(outside / "secret.png" if kind == "file" else outside)
    msg = _refused(lambda: load_dataset(DataSpec(data=str(root))), str(link), "outside the image folder")
    assert "secret" in msg or str(outside) in msg


def test_dangling_symlink_in_image_folder_is_refused(tmp_path):
    from attnaudit.data import DataSpec, load_dataset

    root, _ = _image_folder(tmp_path)
    (root / "a" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    _refused(lambda: load_dataset(DataSpec(data=str(root))), "gone.png", "does not exist")


def test_symlink_inside_image_folder_is_followed(tmp_path):
    """Links that stay inside the folder resolve like the files they name (a class folder
    linked to another one loads its images again, under its own label)."""
    from attnaudit.data import DataSpec, load_dataset

    root, pixels = _image_folder(tmp_path)
    (root / "a" / "y.png").symlink_to("x.png")
    (root / "b").symlink_to("a")
    ds = load_dataset(DataSpec(data=str(root)))
    assert ds.info["class_names"] == ["a", "b"]
    assert ds.y.tolist() == [0, 0, 1, 1]
    expected = np.tile(pixels.reshape(1, -1) / 255.0, (4, 1))
    np.testing.assert_array_equal(ds.X.numpy(), expected)


def test_symlinked_image_folder_root_is_allowed(tmp_path):
    """The folder named by --data may itself be a link: 'inside' means inside its target."""
    from attnaudit.data import DataSpec, load_dataset

    root, _ = _image_folder(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    (root / "a" / "y.png").symlink_to("x.png")
    assert load_dataset(DataSpec(data=str(alias))).n == 2
