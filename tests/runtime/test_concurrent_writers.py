"""Two runs writing the same folder at once never leave a corrupt file or a mixed set
(issue 28 item 3): atomic renames, a lock on the folder while a set of files goes in, and
the no-overwrite promise kept under that lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnaudit.errors import AuditError
from attnaudit.runtime.atomic import StagedFiles, folder_lock


def test_a_set_of_files_waits_for_the_folder_lock(tmp_path):
    """While another holder has the folder's lock, a two-file commit does not rename anything."""
    done = threading.Event()

    def commit() -> None:
        with StagedFiles() as files:
            files.stage(tmp_path / "a.json", lambda p: Path(p).write_text("1"))
            files.stage(tmp_path / "b.json", lambda p: Path(p).write_text("1"))
            files.commit()
        done.set()

    with folder_lock(tmp_path):
        worker = threading.Thread(target=commit)
        worker.start()
        time.sleep(0.3)  # ample time for an unlocked commit to have renamed both
        assert not done.is_set() and not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()
    worker.join(timeout=30)
    assert done.is_set() and (tmp_path / "a.json").read_text() == "1" == (tmp_path / "b.json").read_text()


def test_a_file_that_appeared_meanwhile_is_not_replaced_without_overwrite(tmp_path):
    target = tmp_path / "report.json"
    with pytest.raises(AuditError, match="appeared while this run was writing"):
        with StagedFiles(overwrite=False) as files:
            files.stage(target, lambda p: Path(p).write_text("ours"))
            target.write_text("theirs")  # another process wrote it after our check
            files.commit()
    assert target.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file left


def _kappa(out_dir: Path, seed: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "attnaudit", "--threads", "1", "kappa", "--n", "80", "--seed", str(seed)]
    cmd += ["-q", "--out-dir", str(out_dir), "--overwrite"]
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def test_two_runs_writing_one_out_dir_leave_one_whole_set(tmp_path):
    out = tmp_path / "out"
    for _ in range(1):  # the lock itself is checked deterministically above
        procs = [_kappa(out, seed) for seed in (1, 2)]
        for proc in procs:
            assert proc.wait(timeout=300) == 0, proc.stderr.read() if proc.stderr else ""
        report = json.loads((out / "report.json").read_text())
        seed = report["seeds"]["base_seed"]
        html = (out / "report.html").read_text()
        assert f"--seed {seed}" in html and f"--seed {3 - seed}" not in html  # report and page from one run
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


# run in its own process (python worker.py CACHE OUT); its seeding stays inside main()
_CACHE_WORKER = """
import sys, torch
from torch import nn
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.data import DataSpec, load_dataset


def main():
    tr = load_dataset(DataSpec(dataset="digits", split="train", n=60))
    te = load_dataset(DataSpec(dataset="digits", split="test", n=8))
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    cfg = InfluenceConfig(estimator="ekfac", damping=0.05, per_test=True, cache_dir=sys.argv[1])
    res = compute_influence(model, tr.X.double(), tr.y, te.X.double(), te.y, cfg, loss="ce")
    torch.save(res.per_test, sys.argv[2])


main()
"""


def test_two_processes_sharing_a_factor_cache_leave_a_whole_entry(tmp_path):
    """Both fit the same factors and write the same entry at once: the entry left behind loads
    (its sha256 holds) and every process got the same scores."""
    import torch

    cache = tmp_path / "cache"
    script = tmp_path / "worker.py"
    script.write_text(_CACHE_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cache), str(tmp_path / f"s{i}.pt")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read() if proc.stderr else ""
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and not [p for p in cache.iterdir() if p.name.startswith(".")]
    third = subprocess.run(
        [sys.executable, str(script), str(cache), str(tmp_path / "s2.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert third.returncode == 0 and "warning" not in third.stderr  # loaded, not found damaged
    scores = [torch.load(tmp_path / f"s{i}.pt") for i in range(3)]
    for s in scores[1:]:
        torch.testing.assert_close(s, scores[0], rtol=0, atol=0)
