"""Crash consistency of long runs: kill a multi-cell sweep at random moments, resume it, compare.

    python benchmarks/soak_resume.py [--interrupts 20] [--seed 0] [--workloads ntk,audit] [--keep DIR]

Two workloads, each a sweep of several cells run with ``--jobs 2 --resume DIR``:

* ``ntk``: ``ntk-distance`` over 3 widths x 3 seeds (+ the figure);
* ``audit``: an audit file with four checks (kappa, ntk-distance, malleability, landscape).

For each, an uninterrupted run gives the reference report. Then campaigns: a fresh resume
folder, the same command started again and again, each start killed after a random delay
(uniform between 0.2 s and 0.8 x the reference's wall time, the upper end growing by 25%
with each kill of a campaign so that every campaign ends) with SIGKILL or SIGINT (a coin
flip) sent to its whole process group (the workers too, as an OOM killer or a lost node
would), until a start finishes on its own; its report must equal the reference's (timings,
environment and execution counts aside). Campaigns repeat until ``--interrupts`` kills have
landed. A watcher thread reads every output file (reports, figures, resume entries) every
few milliseconds while the runs go on and counts any that is ever partial or unparsable
under its final name (temporary files, dot-named, are not outputs).

Prints one line per workload and the summary line
``SOAK interrupts=<n> identical=<true|false> partial_outputs=<k>``; exits 1 when a report
differed or an output was ever seen partial. ``--threads 1`` per run, so numbers are
bit-identical however the cells are split.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VOLATILE = {
    "timings",
    "timings_s",
    "seconds",
    "environment",
    "created",
    "created_utc",
    "execution",
    "resumed",
    "wall_s",
}

AUDIT_YAML = """\
version: 1
name: soak
seed: 0
data:
  dataset: digits
checks:
  - name: kappa
    analysis: kappa
    options: {n: 120}
    metric: log10_kappa_attention
    max: 100
  - name: ntk
    analysis: ntk-distance
    options: {widths: "8,16", seeds: 2, n-train: 40, n-test: 20, steps: 30}
    metric: distance_slope
    select: {model: relu}
    max: 100
  - name: malleability
    analysis: malleability
    options: {n-train: 40, n-test: 20, seeds: 2, steps: 30, attacks: "pgd,sign", eps: 0.1, top-k: 5}
    metric: flip_rate
    select: {model: relu, attack: pgd}
    max: 1
  - name: landscape
    analysis: landscape
    options: {n-train: 60, steps: 30, eigenvalues: 1, points: 0, grid: 0, basin-directions: 1}
    metric: lambda_max
    max: 1.0e+9
"""


def _command(workload: str, work: Path, resume: Path, out: Path, tiny: bool = False) -> list[str]:
    base = [sys.executable, "-m", "attnaudit", "--threads", "1"]
    if workload == "ntk":
        return base + [
            "ntk-distance",
            "--widths",
            "8,16" if tiny else "8,16,32",
            "--seeds",
            "2" if tiny else "3",
            "--n-train",
            "30" if tiny else "60",
            "--n-test",
            "15" if tiny else "30",
            "--steps",
            "10" if tiny else "40",
            "-q",
            "--jobs",
            "2",
            "--resume",
            str(resume),
            "--json",
            str(out),
            "--png",
            str(out.with_suffix(".png")),
            "--overwrite",  # a start killed after writing its report is started again
        ]
    yaml_path = work / "soak.yaml"
    if not yaml_path.exists():
        yaml_path.write_text(AUDIT_YAML)
    return (
        base
        + ["audit", str(yaml_path), "-q", "--jobs", "2", "--resume", str(resume), "--json", str(out)]
        + [
            "--overwrite"  # a start killed after writing its report is started again
        ]
    )


def _stable(obj):
    """The report without what legitimately differs between runs (timings, environment, counts of resumed cells)."""
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


class Watcher(threading.Thread):
    """Reads every output file under ``folders`` every few ms; records those ever partial or unparsable."""

    def __init__(self, folders: list[Path]):
        super().__init__(daemon=True)
        self.folders = folders
        self.bad: set[str] = set()
        self.reads = 0
        self.stop = threading.Event()

    @staticmethod
    def _complete(path: Path) -> bool:
        data = path.read_bytes()
        if path.suffix == ".json":
            json.loads(data.decode("utf-8"))
            return True
        if path.suffix == ".png":
            return data.startswith(b"\x89PNG\r\n\x1a\n") and data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
        return True

    def run(self) -> None:
        while not self.stop.is_set():
            for folder in self.folders:
                for path in folder.rglob("*") if folder.exists() else ():
                    if path.name.startswith(".") or not path.is_file():
                        continue  # temporary files of atomic writes are not outputs
                    try:
                        ok = self._complete(path)
                    except FileNotFoundError:
                        continue  # replaced between the listing and the read
                    except (OSError, UnicodeDecodeError, ValueError):
                        ok = False
                    self.reads += 1
                    if not ok:
                        self.bad.add(str(path))
            time.sleep(0.003)


def _run(cmd: list[str], timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"the run failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return proc.returncode, time.perf_counter() - t0


def soak(
    workload: str, work: Path, interrupts: int, rng: random.Random, verbose: bool = False, tiny: bool = False
) -> dict:
    ref_dir = work / f"{workload}-reference"
    ref_dir.mkdir(parents=True)
    ref_out = ref_dir / "report.json"
    _, duration = _run(_command(workload, work, ref_dir / "cells", ref_out, tiny), timeout=1800)
    reference = _stable(json.loads(ref_out.read_text()))
    landed = campaigns = identical = 0
    differences: list[str] = []
    watcher = Watcher([work / f"{workload}-campaign"])
    watcher.start()
    try:
        while landed < interrupts:
            campaigns += 1
            camp = work / f"{workload}-campaign" / str(campaigns)
            camp.mkdir(parents=True)
            out = camp / "report.json"
            cmd = _command(workload, work, camp / "cells", out, tiny)
            kills_here = 0
            while True:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
                )
                # the window widens with each kill of this campaign, so a campaign always ends (on a
                # loaded machine a start may need longer than the reference did to finish a cell)
                delay = rng.uniform(0.2, max(0.4, 0.8 * duration * 1.25**kills_here))
                kills_here += 1
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    sig = rng.choice([signal.SIGKILL, signal.SIGINT])
                    os.killpg(proc.pid, sig)
                    t_sig = time.perf_counter()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    if verbose:
                        print(
                            f"  {workload} campaign {campaigns}: {signal.Signals(sig).name} after {delay:.1f} s, "
                            f"exit {proc.returncode} {time.perf_counter() - t_sig:.1f} s later",
                            flush=True,
                        )
                    if sig == signal.SIGINT:  # let the worker processes finish dying before the next start
                        time.sleep(0.2)
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
                    except ProcessLookupError:
                        pass
                    landed += 1
                    continue
                if proc.returncode not in (0, 1):
                    raise SystemExit(f"{workload}: a resumed run failed with exit {proc.returncode}")
                break
            got = _stable(json.loads(out.read_text()))
            if got == reference:
                identical += 1
            else:
                differences.append(str(out))
    finally:
        watcher.stop.set()
        watcher.join()
    line = (
        f"SOAK_WORKLOAD name={workload} interrupts={landed} campaigns={campaigns} identical={identical}/{campaigns} "
        f"partial_outputs={len(watcher.bad)} reads={watcher.reads} reference_s={duration:.1f}"
    )
    print(line, flush=True)
    return {
        "interrupts": landed,
        "identical": identical == campaigns,
        "partial": sorted(watcher.bad),
        "differences": differences,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interrupts", type=int, default=20, help="kills per workload (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments and signals")
    ap.add_argument("--workloads", default="ntk,audit", help="ntk, audit or both (default)")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("--verbose", action="store_true", help="one line per interrupt")
    ap.add_argument(
        "--tiny", action="store_true", help="the smallest ntk sweep (the test suite's check of this script)"
    )
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="attnaudit-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = [
            soak(w.strip(), work, args.interrupts, rng, args.verbose, args.tiny)
            for w in args.workloads.split(",")
            if w.strip()
        ]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = sum(r["interrupts"] for r in results)
    same = all(r["identical"] for r in results)
    partial = sum(len(r["partial"]) for r in results)
    for r in results:
        for path in r["partial"]:
            print(f"partial output seen: {path}")
        for path in r["differences"]:
            print(f"report differs from the uninterrupted run: {path}")
    print(f"SOAK interrupts={total} identical={str(same).lower()} partial_outputs={partial}")
    return 0 if same and partial == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
