"""Sweeps on executors (issue 13): same numbers under local, --jobs 2 and Ray; failed cells;
resume; the missing-extra message."""

from __future__ import annotations

import importlib.util
import json

import pytest

HAS_RAY = importlib.util.find_spec("ray") is not None


def _cli(args, capsys=None):
    from attnaudit.cli import main

    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code


def _without_timings(results: dict) -> dict:
    out = json.loads(json.dumps(results))
    out.pop("seconds", None)
    for cell in out.get("cells", []):
        cell.pop("seconds", None)
        if isinstance(cell.get("linearized"), dict):
            cell["linearized"].pop("seconds", None)
    for d in out.get("influence_diagnostics", []):
        d.pop("seconds", None)
    return out


def _tiny_ntk(tmp_path, name, *extra):
    path = tmp_path / f"{name}.json"
    code = _cli(
        [
            "--threads",
            "1",
            "ntk-distance",
            "--widths",
            "8,16",
            "--seeds",
            "2",
            "--n-train",
            "40",
            "--n-test",
            "20",
            "--steps",
            "20",
            "-q",
            "--json",
            str(path),
            *extra,
        ]
    )
    assert code == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def ntk_local(tmp_path_factory):
    return _tiny_ntk(tmp_path_factory.mktemp("local"), "local")


def test_jobs_give_the_same_numbers_as_local(tmp_path, ntk_local):
    jobs = _tiny_ntk(tmp_path, "jobs", "--jobs", "2")
    assert _without_timings(jobs["results"]) == _without_timings(ntk_local["results"])
    assert jobs["inputs"]["execution"]["jobs"] == 2
    assert ntk_local["inputs"]["execution"]["executor"] == "local"


@pytest.mark.skipif(not HAS_RAY, reason="ray not installed (pip install 'attnaudit[ray]')")
def test_ray_gives_the_same_numbers_as_local(tmp_path, ntk_local):
    ray_run = _tiny_ntk(tmp_path, "ray", "--executor", "ray", "--jobs", "2")
    assert _without_timings(ray_run["results"]) == _without_timings(ntk_local["results"])
    assert ray_run["inputs"]["execution"]["executor"] == "ray"


def test_the_cells_really_ran_in_other_processes():
    import os

    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    tasks = [CellTask("attnaudit.runtime.sweep:check_cell", {"i": i, "seed": i}, f"cell {i}") for i in range(4)]
    local = run_cells(tasks)
    jobs = run_cells(tasks, ExecutorConfig(jobs=2, threads=1))
    assert [o.result["value"] for o in local] == [o.result["value"] for o in jobs]
    assert {o.result["pid"] for o in local} == {os.getpid()}
    assert os.getpid() not in {o.result["pid"] for o in jobs}


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_cell_does_not_lose_the_others(jobs):
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    tasks = [
        CellTask("attnaudit.runtime.sweep:check_cell", {"i": i, "seed": i, "fail": i == 1}, f"cell {i}")
        for i in range(4)
    ]
    seen = []
    out = run_cells(tasks, ExecutorConfig(jobs=jobs, threads=1), on_done=lambda o: seen.append(o.task.label))
    assert [o.ok for o in out] == [True, False, True, True]
    assert "asked to fail" in out[1].error
    assert out[1].failure()["config"]["i"] == 1
    assert sorted(seen) == sorted(t.label for t in tasks)  # every outcome streamed back


def test_a_failed_ntk_cell_gives_partial_results_and_exit_1(tmp_path, monkeypatch, ntk_local):
    import attnaudit.analyses.ntk_distance.cells as nd

    real = nd.train_cell

    def flaky(arch, width, seed, *args):
        if arch == "attn" and width == 16 and seed == 1:
            raise RuntimeError("simulated out-of-memory in one cell")
        return real(arch, width, seed, *args)

    monkeypatch.setattr(nd, "train_cell", flaky)
    path = tmp_path / "partial.json"
    code = _cli(
        [
            "--threads",
            "1",
            "ntk-distance",
            "--widths",
            "8,16",
            "--seeds",
            "2",
            "--n-train",
            "40",
            "--n-test",
            "20",
            "--steps",
            "20",
            "-q",
            "--json",
            str(path),
        ]
    )
    assert code == 1
    results = json.loads(path.read_text())["results"]
    assert len(results["cells"]) == 7
    assert results["failed_cells"][0]["config"]["width"] == 16
    assert "simulated out-of-memory" in results["failed_cells"][0]["error"]
    # the finished cells are the same numbers as in the full run
    full = {(c["model"], c["width"], c["seed"]): c for c in _without_timings(ntk_local["results"])["cells"]}
    for cell in _without_timings(results)["cells"]:
        assert cell == full[(cell["model"], cell["width"], cell["seed"])]
    # relu is untouched; attn's slope uses the seed whose cells all finished
    assert results["models"]["relu"] == ntk_local["results"]["models"]["relu"]
    assert len(results["models"]["attn"]["slope_per_seed"]) == 1


def test_resume_skips_finished_cells_and_gives_the_same_report(tmp_path, monkeypatch, ntk_local):
    import attnaudit.analyses.ntk_distance.cells as nd

    folder = tmp_path / "cells"
    first = _tiny_ntk(tmp_path, "first", "--resume", str(folder))
    files = sorted(folder.glob("*.json"))
    assert len(files) == 8
    assert _without_timings(first["results"]) == _without_timings(ntk_local["results"])

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(nd, "train_cell", must_not_run)
    again = _tiny_ntk(tmp_path, "again", "--resume", str(folder))
    assert _without_timings(again["results"]) == _without_timings(ntk_local["results"])
    assert again["inputs"]["execution"]["resumed"] == 8


def test_an_interrupted_sweep_leaves_the_folder_consistent_and_resumes(tmp_path):
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    folder = tmp_path / "cells"
    tasks = [CellTask("attnaudit.runtime.sweep:check_cell", {"i": i, "seed": i}, f"cell {i}") for i in range(5)]
    done = []

    def interrupt_after_two(outcome):
        done.append(outcome)
        if len(done) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_cells(tasks, ExecutorConfig(resume_dir=str(folder)), on_done=interrupt_after_two)
    stored = sorted(folder.iterdir())
    assert len(stored) == 2 and all(json.loads(json.loads(p.read_text())["result_json"])["value"] for p in stored)
    resumed = run_cells(tasks, ExecutorConfig(resume_dir=str(folder)))
    assert [o.resumed for o in resumed] == [True, True, False, False, False]
    assert [o.result["value"] for o in resumed] == [o.result["value"] for o in run_cells(tasks)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "edit-result", "garbage"])
def test_a_damaged_resume_entry_is_reported_and_recomputed_never_trusted(tmp_path, damage):
    """Every resume entry carries the sha256 of its result: a flipped byte, a truncated or empty
    file, a result edited to another valid JSON value, or a foreign file is one warning line and
    a recomputation, and the outcome equals a fresh run's."""
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    folder = tmp_path / "cells"
    tasks = [CellTask("attnaudit.runtime.sweep:check_cell", {"i": i, "seed": i}, f"cell {i}") for i in range(3)]
    fresh = run_cells(tasks, ExecutorConfig(resume_dir=str(folder)))
    target = sorted(folder.iterdir())[1]
    raw = target.read_bytes()
    if damage == "flip":
        i = raw.index(b"value") + 12  # inside the stored result's text
        raw = raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1 :]
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "empty":
        raw = b""
    elif damage == "edit-result":  # still valid JSON, still the right key: only the checksum tells
        outer = json.loads(raw)
        inner = json.loads(outer["result_json"])
        inner["value"] = inner["value"] + 1.0
        outer["result_json"] = json.dumps(inner)
        raw = json.dumps(outer).encode()
    else:
        raw = b"\x00\xff not json at all"
    target.write_bytes(raw)
    lines: list[str] = []
    again = run_cells(tasks, ExecutorConfig(resume_dir=str(folder)), warn=lines.append)
    assert len(lines) == 1 and target.name in lines[0] and "recomputing" in lines[0] and "\n" not in lines[0]
    assert sum(not o.resumed for o in again) == 1
    assert [o.result["value"] for o in again] == [o.result["value"] for o in fresh]
    lines.clear()
    third = run_cells(tasks, ExecutorConfig(resume_dir=str(folder)), warn=lines.append)  # rewritten whole
    assert lines == [] and all(o.resumed for o in third)


def test_a_resume_entry_from_an_older_schema_is_recomputed_quietly(tmp_path):
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    folder = tmp_path / "cells"
    task = CellTask("attnaudit.runtime.sweep:check_cell", {"i": 0, "seed": 0}, "a")
    run_cells([task], ExecutorConfig(resume_dir=str(folder)))
    (entry,) = folder.iterdir()
    outer = json.loads(entry.read_text())
    old = {k: v for k, v in outer.items() if k not in ("result_json", "sha256")}
    old |= {"schema": "attnaudit.cell/1", "result": json.loads(outer["result_json"])}
    entry.write_text(json.dumps(old))
    lines: list[str] = []
    out = run_cells([task], ExecutorConfig(resume_dir=str(folder)), warn=lines.append)
    assert lines == [] and not out[0].resumed


def test_a_changed_configuration_is_not_resumed(tmp_path):
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    folder = tmp_path / "cells"
    run_cells(
        [CellTask("attnaudit.runtime.sweep:check_cell", {"i": 0, "seed": 0}, "a")],
        ExecutorConfig(resume_dir=str(folder)),
    )
    out = run_cells(
        [CellTask("attnaudit.runtime.sweep:check_cell", {"i": 0, "seed": 1}, "a")],
        ExecutorConfig(resume_dir=str(folder)),
    )
    assert not out[0].resumed


def test_malleability_jobs_match_local(tmp_path):
    args = [
        "--threads",
        "1",
        "malleability",
        "--seeds",
        "2",
        "--n-train",
        "60",
        "--n-test",
        "20",
        "--attacks",
        "pgd,random",
        "--steps",
        "50",
        "-q",
    ]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert _cli([*args, "--json", str(a)]) == 0
    assert _cli([*args, "--json", str(b), "--jobs", "2"]) == 0
    ra, rb = (_without_timings(json.loads(p.read_text())["results"]) for p in (a, b))
    assert ra == rb
    assert ra["summary"] and ra["failed_cells"] == []


def test_missing_ray_is_one_line_with_the_install_command(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    code = _cli(["ntk-distance", "--widths", "8", "--seeds", "1", "--executor", "ray", "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert 'pip install "attnaudit[ray]"' in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--executor", "dask"], "unknown --executor"),
        (["--jobs", "0"], "--jobs must be a positive integer"),
        (["--gpus-per-cell", "1"], "--gpus-per-cell asks Ray for accelerators; use it with the ray executor"),
        (["--ray-address", "auto"], "--ray-address joins a Ray cluster; use it with the ray executor"),
    ],
)
def test_bad_executor_options_exit_2(args, message, capsys):
    code = _cli(["ntk-distance", "--widths", "8", "--seeds", "1", "-q", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_save_models_needs_the_local_executor(tmp_path, capsys):
    code = _cli(
        ["ntk-distance", "--widths", "8", "--seeds", "1", "-q", "--jobs", "2", "--save-models", str(tmp_path / "m")]
    )
    assert code == 2
    assert "--save-models" in capsys.readouterr().err
