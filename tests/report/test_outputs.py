"""Output safety: atomic writes, pre-compute target checks, one-line errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from attnaudit.runtime.atomic import StagedFiles, write_text_atomic
from attnaudit.cli.common import OutputOptions, emit
from attnaudit.errors import AuditError


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_staged_files_are_all_or_nothing(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.png"
    with pytest.raises(RuntimeError):
        with StagedFiles() as files:
            files.stage(a, lambda p: Path(p).write_text("one"))
            files.stage(b, lambda p: (_ for _ in ()).throw(RuntimeError("plot failed")))
            files.commit()
    assert _listing(tmp_path) == []  # neither target nor any temporary file
    with StagedFiles() as files:
        files.stage(a, lambda p: Path(p).write_text("one"))
        files.stage(b, lambda p: Path(p).write_bytes(b"two"))
        assert not a.exists() and not b.exists()  # nothing visible before commit
        files.commit()
    assert a.read_text() == "one" and b.read_bytes() == b"two"
    assert _listing(tmp_path) == ["a.json", "b.png"]


def test_atomic_write_gets_the_usual_file_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644  # not mkstemp's private 0600


def test_atomic_write_replaces_in_place_and_devices_are_written_directly(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    write_text_atomic(target, "new")
    assert target.read_text() == "new" and _listing(tmp_path) == ["r.json"]
    write_text_atomic("/dev/null", "ignored")  # cannot be renamed over; must not raise


def test_emit_writes_nothing_when_the_figure_fails(tmp_path):
    opts = OutputOptions(out_dir=str(tmp_path / "od"), quiet=True)
    opts.check_writable(("fig.png",))

    def broken_plot(path):
        raise ValueError("matplotlib exploded")

    with pytest.raises(ValueError):
        emit(opts, {"results": {}}, [], plot=broken_plot, png_name="fig.png")
    assert _listing(tmp_path / "od") == []  # no report.json without its figure, no temporaries


def test_emit_writes_report_and_figure(tmp_path):
    opts = OutputOptions(out_dir=str(tmp_path / "od"), quiet=True)
    emit(opts, {"results": {"x": 1.5}}, [], plot=lambda p: Path(p).write_bytes(b"\x89PNG"), png_name="fig.png")
    assert json.loads((tmp_path / "od" / "report.json").read_text()) == {"results": {"x": 1.5}}
    assert (tmp_path / "od" / "fig.png").read_bytes() == b"\x89PNG"
    assert _listing(tmp_path / "od") == ["fig.png", "report.html", "report.json"]
    page = (tmp_path / "od" / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page  # the figure, embedded


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (lambda t: {"json": str(t / "od" / "report.json"), "out_dir": str(t / "od")}, "same file"),
        (lambda t: {"json": str(t / "x.png"), "png": str(t / "x.png")}, "same file"),
        (lambda t: {"json": str(t / "afile" / "x.json")}, "is a file"),
        (lambda t: {"out_dir": str(t / "afile")}, "is a file"),
        (lambda t: {"out_dir": str(t / "afile" / "sub")}, "is a file"),
        (lambda t: {"json": str(t / "missing" / "x.json")}, "does not exist"),
        (lambda t: {"json": str(t / "existing.json")}, "--overwrite"),
        (lambda t: {"png": str(t / "fig.jpg")}, "ending in .png"),
    ],
    ids=[
        "json-in-out-dir",
        "json-equals-png",
        "parent-is-file",
        "out-dir-is-file",
        "out-dir-under-file",
        "missing-folder",
        "existing-without-overwrite",
        "png-suffix",
    ],
)
def test_check_writable_refuses_before_compute(tmp_path, kwargs, expected):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "existing.json").write_text("mine")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(AuditError, match=expected):
        OutputOptions(**kwargs(tmp_path)).check_writable(("fig.png",))
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before
    assert not (tmp_path / "od").exists()  # nothing created by a check


def test_check_writable_refuses_an_unwritable_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write into a read-only folder (root)")
        with pytest.raises(AuditError, match="cannot write into folder"):
            OutputOptions(json=str(ro / "x.json")).check_writable()
    finally:
        ro.chmod(0o700)


def test_a_folder_that_refuses_files_is_reported_even_as_root(tmp_path, monkeypatch):
    # Root ignores permission bits, so the probe (not os.access) must decide; simulate the refusal.
    import attnaudit.report.envelope as report

    def refuse(target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report, "temp_path_for", refuse)
    with pytest.raises(AuditError, match=r"cannot write into folder .* \(Permission denied\)"):
        OutputOptions(json=str(tmp_path / "x.json")).check_writable()
