"""Hostile and bad inputs through the CLI: one line, exit 2, nothing executed, nothing written.

A table-driven corpus. Every case fabricates its inputs under ``tmp_path`` and runs one
command (in-process with typer's ``CliRunner``, or as ``python -m attnaudit`` where
in-process would not be faithful). Each case asserts:

* the exit code (2 for bad input);
* standard error holds exactly one non-empty line, starting with ``error:``, that names
  the problem (a case-specific pattern, and for some cases a literal text or a length cap);
* no ``Traceback`` anywhere in the output;
* the marker file a malicious pickle would create does not exist;
* nothing under ``tmp_path`` (inputs, pre-existing outputs, output folders) was created,
  removed or changed, byte for byte;
* output-option mistakes fail fast (the check runs before any compute).

Plus one subprocess case for Ctrl-C (exit 130, "interrupted", no partial outputs).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

MARKER = "PWNED.marker"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TINY_NTK = ["--n-train", "40", "--n-test", "20", "--widths", "8", "--seeds", "1", "--steps", "5", "--models", "relu"]
TINY_LANDSCAPE = [
    "--n-train",
    "40",
    "--eigenvalues",
    "1",
    "--hutchinson-samples",
    "2",
    "--points",
    "0",
    "--grid",
    "0",
    "--basin-directions",
    "1",
]


# --------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def cli():
    """The Typer app and a runner; the analysis modules are imported once here so that
    per-case timings measure the command, not the first import of torch/sklearn."""
    from typer.testing import CliRunner

    from attnaudit.cli import app
    import attnaudit.data  # noqa: F401
    import attnaudit.analyses.kappa.dataset  # noqa: F401
    import attnaudit.analyses.landscape  # noqa: F401
    import attnaudit.analyses.malleability.malleability  # noqa: F401
    import attnaudit.analyses.ntk_distance.widths  # noqa: F401
    import sklearn.datasets

    sklearn.datasets.load_digits()
    return app, CliRunner()


class _OpenMarker:
    """Unpickling this calls open(marker, "w"): the marker file appears."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _ShellMarker:
    """Unpickling this runs ``touch marker`` through os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _evil_pickle(tmp: Path) -> bytes:
    return pickle.dumps({"X": _OpenMarker(tmp / MARKER), "y": [0, 1]}, protocol=2)


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def _npz(path: Path, X, y=None) -> Path:
    arrays = {"X": np.asarray(X)}
    if y is not None:
        arrays["y"] = np.asarray(y)
    np.savez(path, **arrays)
    return path


def _good_X(n: int = 20, d: int = 4) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, d))


def _good_y(n: int = 20) -> np.ndarray:
    return np.arange(n) % 2


def _truncated(path: Path) -> Path:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


def _png(path: Path, size: tuple[int, int]) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0]), 128, dtype=np.uint8), mode="L").save(path)
    return path


def _checkpoint(tmp: Path, name: str = "model.safetensors") -> Path:
    """A valid relu checkpoint for digits (d 64, 10 outputs, width 8) + its JSON side-car."""
    from attnaudit.models.builtin import ModelSpec, build_model, save_model

    net = build_model(ModelSpec("relu", d_in=64, width=8, n_out=10, seed=0))
    return save_model(net, tmp / name)


def _sidecar(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".json")


def _rewrite_tensors(path: Path, change: Callable[[dict], dict]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file(change(dict(tensors)), str(path))
    return path


def _tree(root: Path) -> dict[str, str]:
    """Every file (sha256 of its bytes) and folder under root, by relative path."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "<dir>"
        for f in filenames:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


# --------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path], list[str]]  # fabricates inputs under tmp, returns the argv
    match: tuple[str, ...]  # regexes (case-insensitive) that must all occur in the error line
    code: int = 2
    literal: str | None = None  # exact text that must appear in the error line
    max_stderr_chars: int | None = None
    max_seconds: float | None = None
    no_symbols: bool = False  # no character above U+2000 (emoji) except the ellipsis
    subprocess: bool = False


# ---- security: pickles must never run


def _cifar_pickle(tmp: Path) -> list[str]:
    payload = {b"data": _OpenMarker(tmp / MARKER), b"labels": [0], b"batch_label": b"x"}
    _write(tmp / "cifar" / "cifar-10-batches-py" / "test_batch", pickle.dumps(payload, protocol=2))
    return ["kappa", "--dataset", "cifar10", "--split", "test", "--data-dir", str(tmp / "cifar")]


def _pt_raw_pickle(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(_write(tmp / "evil.pt", _evil_pickle(tmp)))]


def _pth_torch_save(tmp: Path) -> list[str]:
    import torch

    torch.save({"X": _ShellMarker(tmp / MARKER), "y": torch.zeros(2)}, tmp / "evil.pth")
    return ["kappa", "--data", str(tmp / "evil.pth")]


def _npy_pickle_bytes(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(_write(tmp / "evil.npy", _evil_pickle(tmp)))]


def _npy_object(tmp: Path) -> list[str]:
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = _OpenMarker(tmp / MARKER), 1
    np.save(tmp / "evil.npy", arr, allow_pickle=True)
    return ["kappa", "--data", str(tmp / "evil.npy")]


def _npz_object(tmp: Path) -> list[str]:
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = _OpenMarker(tmp / MARKER), 1
    np.savez(tmp / "evil.npz", X=arr, y=np.array([0, 1]))
    return ["kappa", "--data", str(tmp / "evil.npz")]


def _model_pickle(tmp: Path) -> list[str]:
    path = _checkpoint(tmp, "evil.safetensors")  # a valid side-car beside it
    path.write_bytes(_evil_pickle(tmp))
    return ["landscape", "--checkpoint", str(path), *TINY_LANDSCAPE]


# ---- files


def _empty(suffix: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["kappa", "--data", str(_write(tmp / f"empty{suffix}", b""))]

    return make


def _truncated_npz(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(_truncated(_npz(tmp / "cut.npz", _good_X(200, 16), _good_y(200))))]


def _truncated_npy(tmp: Path) -> list[str]:
    np.save(tmp / "cut.npy", _good_X(200, 16))
    return ["kappa", "--data", str(_truncated(tmp / "cut.npy"))]


def _truncated_safetensors(tmp: Path) -> list[str]:
    import torch
    from safetensors.torch import save_file

    save_file(
        {"X": torch.randn(200, 16, dtype=torch.float64), "y": torch.arange(200) % 2}, str(tmp / "cut.safetensors")
    )
    return ["kappa", "--data", str(_truncated(tmp / "cut.safetensors"))]


def _random_bytes(suffix: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        noise = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        return ["kappa", "--data", str(_write(tmp / f"noise{suffix}", noise))]

    return make


def _nonfinite(value: float) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        X = _good_X()
        X[3, 2] = value
        return ["kappa", "--data", str(_npz(tmp / "bad.npz", X, _good_y()))]

    return make


def _one_d(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(_npz(tmp / "flat.npz", np.arange(20.0), _good_y()))]


def _csv(text: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["kappa", "--data", str(_write(tmp / "data.csv", text))]

    return make


def _mixed_images(tmp: Path) -> list[str]:
    for i in range(3):
        _png(tmp / "imgs" / "a" / f"{i}.png", (8, 8))
        _png(tmp / "imgs" / "b" / f"{i}.png", (8, 8))
    _png(tmp / "imgs" / "b" / "odd.png", (9, 7))
    return ["kappa", "--data", str(tmp / "imgs")]


def _flat_images(tmp: Path) -> list[str]:
    for i in range(4):
        _png(tmp / "flat" / f"{i}.png", (8, 8))
    return ["kappa", "--data", str(tmp / "flat")]


def _txt(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(_write(tmp / "data.txt", "1,2,3\n4,5,6\n"))]


def _missing_path(tmp: Path) -> list[str]:
    return ["kappa", "--data", str(tmp / "nowhere" / "data.npz")]


def _labels(y) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        return ["kappa", "--data", str(_npz(tmp / "labels.npz", _good_X(), y))]

    return make


_y_negative = _good_y().copy()
_y_negative[5] = -1
_y_huge = _good_y().astype(np.float64)
_y_huge[7] = 1e12

# ---- values


def _kappa(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["kappa", *args]


def _widths_huge(tmp: Path) -> list[str]:
    args = ["ntk-distance", *TINY_NTK, "--device", "cpu"]
    args[args.index("--widths") + 1] = "1000000000"
    return args


def _single_class(tmp: Path) -> list[str]:
    return ["ntk-distance", "--classes", "3", *TINY_NTK, "--device", "cpu"]


def _zero_data(tmp: Path) -> list[str]:
    path = _npz(tmp / "zeros.npz", np.zeros((60, 8)), np.array([0, 1] * 30))
    return [
        "landscape",
        "--data",
        str(path),
        "--models",
        "relu",
        "--width",
        "8",
        "--steps",
        "5",
        *TINY_LANDSCAPE,
        "--device",
        "cpu",
    ]


# ---- checkpoints (landscape --model)


def _ckpt(corrupt: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = _checkpoint(tmp)
        corrupt(path)
        return ["landscape", "--checkpoint", str(path), *TINY_LANDSCAPE, "--device", "cpu"]

    return make


def _sidecar_width(path: Path) -> None:
    side = json.loads(_sidecar(path).read_text())
    side["spec"]["width"] = 16  # the tensors have width 8
    _sidecar(path).write_text(json.dumps(side))


def _drop_W(path: Path) -> None:
    _rewrite_tensors(path, lambda t: {k: v for k, v in t.items() if k != "W"})


def _int64(path: Path) -> None:
    import torch

    _rewrite_tensors(path, lambda t: {k: (v * 100).to(torch.int64) for k, v in t.items()})


def _nan_weight(path: Path) -> None:
    def change(t: dict) -> dict:
        W = t["W"].clone()
        W[0, 0] = float("nan")
        return {**t, "W": W}

    _rewrite_tensors(path, change)


def _no_sidecar(path: Path) -> None:
    _sidecar(path).unlink()


def _sidecar_garbage(path: Path) -> None:
    _sidecar(path).write_text("this is {not json")


# ---- outputs (checked before compute)


def _json_readonly_dir(tmp: Path) -> list[str]:
    ro = tmp / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):
        ro.chmod(0o700)
        pytest.skip("running as root: a 0o500 folder is still writable (the file-as-folder case covers this)")
    return ["kappa", "--n", "50", "--json", str(ro / "report.json")]


def _json_under_file(tmp: Path) -> list[str]:
    _write(tmp / "file", b"I am a regular file\n")
    return ["kappa", "--n", "50", "--json", str(tmp / "file" / "x.json")]


def _json_clash(tmp: Path) -> list[str]:
    od = tmp / "od"
    _write(od / "keep.txt", b"unrelated user file\n")
    return ["kappa", "--n", "50", "--json", str(od / "report.json"), "--out-dir", str(od)]


def _json_exists(tmp: Path) -> list[str]:
    _write(tmp / "out" / "report.json", b'{"mine": "do not touch"}\n')
    return ["malleability", "--json", str(tmp / "out" / "report.json")]


def _png_txt(tmp: Path) -> list[str]:
    (tmp / "out").mkdir()
    return ["landscape", "--png", str(tmp / "out" / "figure.txt")]


def _out_dir_file(tmp: Path) -> list[str]:
    _write(tmp / "od", b"a file where a folder should be\n")
    return ["ntk-distance", "--out-dir", str(tmp / "od")]  # default preset: a late check would take minutes


def _restore_perms(tmp: Path) -> None:
    ro = tmp / "ro"
    if ro.exists():
        ro.chmod(0o700)


FAST = 5.0

CASES = [
    # security
    Case("pickle-cifar10-test_batch", _cifar_pickle, (r"pickl|refus|unsafe|forbidden|not allowed",)),
    Case("pickle-raw-bytes-as-pt", _pt_raw_pickle, (r"pickl|refus|weights.only|unsafe|forbidden",)),
    Case("pickle-torch-save-as-pth", _pth_torch_save, (r"pickl|refus|weights.only|unsafe|forbidden",)),
    Case("pickle-raw-bytes-as-npy", _npy_pickle_bytes, (r"header|pickl|refus",)),
    Case("pickle-npy-object-dtype", _npy_object, (r"pickl|python object|object|refus",)),
    Case("pickle-npz-object-array", _npz_object, (r"pickl|object|refus",)),
    Case("pickle-as-model-safetensors", _model_pickle, (r"cannot (read|load)|not a readable|pickl|refus",)),
    # files
    Case("empty-npz", _empty(".npz"), (r"empty|no data|cannot read",)),
    Case("empty-npy", _empty(".npy"), (r"empty|no data|no \.npy header|cannot read",)),
    Case("empty-safetensors", _empty(".safetensors"), (r"empty|no data|cannot read",)),
    Case("empty-pt", _empty(".pt"), (r"empty|no data|cannot read",)),
    Case("empty-csv", _empty(".csv"), (r"empty",)),
    Case("truncated-npz", _truncated_npz, (r"truncat|corrupt|cannot read",)),
    Case("truncated-npy", _truncated_npy, (r"truncat|corrupt|cannot read",)),
    Case("truncated-safetensors", _truncated_safetensors, (r"truncat|corrupt|cannot read",)),
    Case("random-bytes-npz", _random_bytes(".npz"), (r"cannot read|corrupt|not a",)),
    Case("random-bytes-pt", _random_bytes(".pt"), (r"cannot read|corrupt|not a",)),
    Case("nan-in-X", _nonfinite(float("nan")), (r"non-finite",)),
    Case("inf-in-X", _nonfinite(float("inf")), (r"non-finite",)),
    Case("X-is-1-D", _one_d, (r"2-D",)),
    Case("csv-ragged", _csv("a,b,label\n1,2,0\n3,1\n5,6,1\n"), (r"line 3", r"cells|columns")),
    Case("csv-non-numeric-cell", _csv("a,b,label\n1,2,0\n3,abc,1\n"), (r"non-numeric", r"abc")),
    Case("csv-header-only", _csv("a,b,label\n"), (r"empty|0 samples",)),
    Case("images-mixed-sizes", _mixed_images, (r"same size",)),
    Case("images-no-class-folders", _flat_images, (r"sub-?folder",)),
    Case("unsupported-extension-txt", _txt, (r"unsupported", r"\.txt")),
    Case("path-does-not-exist", _missing_path, (r"does not exist|not found",)),
    Case("labels-negative", _labels(_y_negative), (r"non-negative", r"-1")),
    Case("label-1e12", _labels(_y_huge), (r"label", r"1000000000000|1e\+?12")),
    Case("labels-length-mismatch", _labels(_good_y(19)), (r"20 rows", r"19 labels")),
    # values
    Case("seed-negative", _kappa("--n", "50", "--seed", "-1"), (r"--seed",)),
    Case("seed-2**70", _kappa("--n", "50", "--seed", "1180591620717411303424"), (r"--seed",)),
    Case("n-zero", _kappa("--n", "0"), (r"--n(?![\w-])",)),
    Case("n-duplicate-64,64", _kappa("--n", "64,64"), (r"--n(?![\w-])",)),
    Case("classes-0-1000000", _kappa("--n", "50", "--classes", "0-1000000"), (r"--classes",), max_stderr_chars=500),
    Case("classes-absent-99", _kappa("--n", "50", "--classes", "99"), (r"--classes", r"99")),
    Case("dataset-rich-markup", _kappa("--dataset", "[/x]"), (r"dataset",), literal="[/x]"),
    Case("data-rich-markup", _kappa("--data", "[bold]x.npz"), (r"does not exist|not found",), literal="[bold]x.npz"),
    Case("device-cuda-x", _kappa("--n", "50", "--device", "cuda:x"), (r"--device",), literal="cuda:x", no_symbols=True),
    Case("split-validation", _kappa("--n", "50", "--split", "validation"), (r"split", r"validation")),
    Case("preprocess-foo", _kappa("--n", "50", "--preprocess", "foo"), (r"preprocess", r"foo")),
    Case("ntk-widths-1e9", _widths_huge, (r"--widths", r"memory"), max_seconds=20.0, subprocess=True),
    Case("ntk-single-class", _single_class, (r"--classes|single class|one class|only class",)),
    Case("landscape-all-zero-data", _zero_data, (r"zero|constant",)),
    Case("threads-negative", lambda tmp: ["--threads", "-1", "kappa"], (r"--threads",)),
    # checkpoints
    Case("ckpt-sidecar-width-differs", _ckpt(_sidecar_width), (r"width|shape",)),
    Case("ckpt-without-W", _ckpt(_drop_W), (r"\bW\b|missing",)),
    Case("ckpt-int64-weights", _ckpt(_int64), (r"int64|dtype|float",)),
    Case("ckpt-nan-weight", _ckpt(_nan_weight), (r"non-finite|nan",)),
    Case("ckpt-sidecar-missing", _ckpt(_no_sidecar), (r"side-?car",)),
    Case("ckpt-sidecar-not-json", _ckpt(_sidecar_garbage), (r"json|side-?car",)),
    # outputs, refused before compute
    Case("json-into-readonly-dir", _json_readonly_dir, (r"writ|permission|read-only",), max_seconds=FAST),
    Case("json-under-a-regular-file", _json_under_file, (r"not a (folder|directory)|is a file",), max_seconds=FAST),
    Case("json-and-out-dir-same-path", _json_clash, (r"same|twice|clash|both|collid",), max_seconds=FAST),
    Case("json-exists-no-overwrite", _json_exists, (r"already exists", r"--overwrite"), max_seconds=FAST),
    Case("png-not-png", _png_txt, (r"--png",), max_seconds=FAST),
    Case("out-dir-is-a-file", _out_dir_file, (r"--out-dir",), max_seconds=FAST),
]


def _run_subprocess(args: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str, str]:
    def limit_memory() -> None:  # a product that tries to allocate must fail, not take the machine down
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (32 * 2**30, 32 * 2**30))

    env = {k: v for k, v in os.environ.items() if k != "FORCE_COLOR"}
    proc = subprocess.run(
        [sys.executable, "-m", "attnaudit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=limit_memory,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, runner = cli
    marker = tmp_path / MARKER
    monkeypatch.chdir(tmp_path)  # relative paths and any stray output land in tmp_path
    try:
        args = case.make(tmp_path)
        before = _tree(tmp_path)
        t0 = time.perf_counter()
        if case.subprocess:
            code, stdout, stderr = _run_subprocess(args, tmp_path)
        else:
            result = runner.invoke(app, args, env={"FORCE_COLOR": None})
            code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        elapsed = time.perf_counter() - t0
        after = _tree(tmp_path)
    finally:
        _restore_perms(tmp_path)

    shown = f"args: {args}\nexit {code} after {elapsed:.1f} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert "Traceback" not in stdout + stderr, shown
    assert not marker.exists(), f"the pickle ran: {marker} was created\n{shown}"
    assert code == case.code, shown
    lines = [ln for ln in ANSI.sub("", stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one non-empty stderr line, got {len(lines)}\n{shown}"
    line = lines[0]
    assert line.startswith("error:"), shown
    # tmp_path is named after the test id (which holds words like "pickle"): match without it
    line = line.replace(str(tmp_path), "<tmp>")
    for pattern in case.match:
        assert re.search(pattern, line, re.IGNORECASE), f"error line does not match {pattern!r}\n{shown}"
    if case.literal is not None:
        assert case.literal in line, f"literal {case.literal!r} missing (rich markup?)\n{shown}"
    if case.max_stderr_chars is not None:
        assert len(stderr) < case.max_stderr_chars, f"stderr is {len(stderr)} characters\n{shown}"
    if case.no_symbols:
        odd = [ch for ch in stderr if ord(ch) > 0x2000 and ch != "\u2026"]
        assert not odd, f"unexpected symbols/emoji {odd!r}\n{shown}"
    if case.max_seconds is not None:
        assert elapsed < case.max_seconds, f"took {elapsed:.1f} s: the check does not run before compute\n{shown}"
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    assert not (added or removed or changed), (
        f"files touched: added {added}, removed {removed}, changed {changed}\n{shown}"
    )


def test_case_count():
    assert len(CASES) >= 45
    assert len({c.id for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_exits_130_without_partial_outputs(tmp_path: Path) -> None:
    od = tmp_path / "od"
    env = {k: v for k, v in os.environ.items() if k != "FORCE_COLOR"}
    # The child prints "ready" once the package is imported, right before the CLI runs, so the
    # signal lands inside the command (an interrupt during interpreter start-up is Python's).
    # SIGINT is reset to Python's handler: a suite started as a background job (nohup ... &) hands
    # its children an ignored SIGINT, which a user's terminal does not.
    launcher = (
        "import signal, sys, attnaudit.cli; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "print('ready', flush=True); "
        "attnaudit.cli.main(['ntk-distance', '--out-dir', sys.argv[1]])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, str(od)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # data loading and training are under way (the run takes 10 s or more)
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.skip(f"ntk-distance finished (exit {proc.returncode}) before the signal could be sent")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    shown = f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert "Traceback" not in out + err, shown
    assert proc.returncode == 130, shown
    lines = [ln for ln in ANSI.sub("", err).splitlines() if ln.strip()]
    assert lines and "interrupted" in lines[-1].lower(), shown
    leftovers = sorted(str(p.relative_to(tmp_path)) for p in od.rglob("*")) if od.exists() else []
    assert not leftovers, f"partial outputs left behind: {leftovers}\n{shown}"
    stray = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p != od and od not in p.parents)
    assert not stray, f"files written outside --out-dir: {stray}\n{shown}"
