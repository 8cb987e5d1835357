"""The GPU check: each analysis on the device and on the CPU, timed, and the numbers compared.

Run by benchmarks/gpu/check.sh (see there). For every analysis (kappa, ntk-distance,
malleability, landscape) the same request runs with ``device=cpu`` and with ``device=DEVICE``;
the report's headline numbers are compared within stated tolerances and everything is
written to ``OUT/gpu-check.json``:

    {"device": ..., "reference": "cpu", "size": ..., "torch": ..., "cuda": ..., "device_name": ...,
     "stages": [{"command", "request", "seconds": {"cpu", "device"}, "speedup",
                 "agreement": [{"metric", "cpu", "device", "diff", "tolerance", "ok"}]}],
     "ok": true|false}

Tolerances: the analyses compute in float64 on both sides, but reductions run in another
order on a GPU, and training steps compound the round-off. kappa's numerical rank must
match exactly and its log10 condition number to 1e-6 relative; trained quantities (NTK
distances, Hessian eigenvalues) to 1e-3 relative; flip rates, which count rank changes among
near-tied influence scores, to 0.1 absolute (one or two of the top-k flipping).

Exit code: 0 when every comparison holds, 1 otherwise (the JSON says which).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

# sizes: tiny (the test suite, < 1 min on 2 CPU cores), small (DEVICE=cpu SMALL=1, a few
# minutes), full (one H200, under 8 minutes with the CPU reference runs included)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "kappa": dict(n=(64,)),
        "ntk-distance": dict(widths=(8, 16), seeds=1, n_train=30, n_test=20, steps=10, models=("relu",)),
        "malleability": dict(
            models=("relu",),
            n_train=30,
            n_test=10,
            seeds=1,
            steps=10,
            width=8,
            attacks=("pgd",),
            top_k=(5,),
            pgd_steps=2,
            controls=False,
        ),
        "landscape": dict(
            models=("relu",),
            n_train=40,
            width=8,
            steps=10,
            seeds=1,
            points=0,
            grid=0,
            eigenvalues=1,
            hutchinson_samples=2,
            basin_directions=1,
            match_loss="none",
        ),
    },
    "small": {
        "kappa": dict(n=(1024,)),
        "ntk-distance": dict(preset="quick", seeds=2),
        "malleability": dict(preset="quick", seeds=2),
        "landscape": dict(preset="quick", seeds=2),
    },
    "full": {
        "kappa": dict(n=(1024,), seeds=3),
        "ntk-distance": dict(preset="quick", seeds=3),
        "malleability": dict(preset="quick", seeds=3),
        "landscape": dict(preset="quick", seeds=3),
    },
}

# the analyses whose built-in runs compute at --precision (kappa of the data and the 2-layer
# ntk-distance sweep are closed forms in float64 at every precision)
PRECISION_COMMANDS = ("malleability", "landscape")
KAPPA_REL = 1e-6
TRAINED_REL = 1e-3
FLIP_ABS = 0.1


def _metrics(command: str, report: dict) -> list[tuple[str, float | None, str, float]]:
    """(metric, value, kind, tolerance) of a report: kind 'exact', 'rel' or 'abs'."""
    r = report["results"]
    out: list[tuple[str, float | None, str, float]] = []
    if command == "kappa":
        g = r["gram"]
        out.append(("gram.numerical_rank", g["numerical_rank"], "exact", 0.0))
        out.append(("gram.log10_kappa_at_numerical_rank", g["log10_kappa_at_numerical_rank"], "rel", KAPPA_REL))
    elif command == "ntk-distance":
        for row in r["summary"]:
            out.append(
                (f"distance_rms[{row['model']}, m={row['width']}]", row["distance_rms"]["mean"], "rel", TRAINED_REL)
            )
    elif command == "malleability":
        for row in r["summary"]:
            out.append(
                (
                    f"flip_rate[{row['model']}, {row['attack']}, eps={row['eps']}]",
                    row["flip_rate"]["mean"],
                    "abs",
                    FLIP_ABS,
                )
            )
    elif command == "landscape":
        for label, m in r["models"].items():
            top = m["top_eigenvalues"]["eigenvalues"][0] if m["top_eigenvalues"]["eigenvalues"] else None
            out.append((f"lambda_max[{label}]", top, "rel", TRAINED_REL))
            out.append((f"loss[{label}]", m["loss"], "rel", TRAINED_REL))
    return out


def _agree(a: float | None, b: float | None, kind: str, tol: float) -> tuple[float | None, bool]:
    if a is None or b is None:
        return None, a is None and b is None
    if kind == "exact":
        return abs(a - b), a == b
    diff = abs(a - b) if kind == "abs" else abs(a - b) / max(abs(a), abs(b), 1e-300)
    return diff, bool(math.isfinite(diff) and diff <= tol)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_check(
    device: str,
    size: str,
    out_dir: Path,
    deadline: float | None = None,
    precisions: tuple[str, ...] = ("float32", "bfloat16"),
) -> dict:
    """Every analysis on the CPU and on ``device``, then the scale benchmark; with ``deadline``
    (seconds for the whole check) a stage that would start after it is skipped and the scale
    benchmark gets the time left. The JSON is rewritten after every stage, so a check stopped
    from outside still leaves what it measured."""
    import torch

    import attnaudit as aa
    from attnaudit.analyses.registry import request_type

    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "schema": "attnaudit.gpu-check/1",
        "device": device,
        "reference": "cpu",
        "size": size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "device_name": torch.cuda.get_device_name(0) if cuda and device.startswith("cuda") else platform.processor(),
        "threads": torch.get_num_threads(),
        "stages": [],
        "skipped": [],
        "scale": None,
        "ok": False,
    }

    def save() -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    # one untimed run on each side first: imports, data caches and the CUDA context are set up
    # there, not charged to whichever side happens to run first
    warm = request_type("kappa")(**SIZES["tiny"]["kappa"], device="cpu")
    aa.run(warm)
    aa.run(warm.replace(device=device))

    stages = result["stages"]
    for command, fields in SIZES[size].items():
        if deadline is not None and time.perf_counter() - start > deadline:
            result["skipped"].append(command)
            print(f"{command:13s} skipped: past the deadline of {deadline:.0f} s", flush=True)
            continue
        cls = request_type(command)
        cpu_request = cls(**fields, device="cpu")
        cpu, cpu_s = _timed(lambda r=cpu_request: aa.run(r))
        # on the CPU the "device" run is a second, independent run: the comparison then checks
        # that a run is reproducible, through the same code as the GPU comparison
        dev_request = cpu_request.replace(device=device)
        dev, dev_s = _timed(lambda r=dev_request: aa.run(r))
        agreement = []
        reference = dict((m, (v, k, t)) for m, v, k, t in _metrics(command, cpu.to_dict()))
        for metric, value, kind, tol in _metrics(command, dev.to_dict()):
            ref = reference.get(metric, (None, kind, tol))[0]
            diff, ok = _agree(ref, value, kind, tol)
            agreement.append(
                {
                    "metric": metric,
                    "cpu": ref,
                    "device": value,
                    "diff": diff,
                    "tolerance": f"{kind} {tol:g}" if kind != "exact" else "exact",
                    "ok": ok,
                }
            )
        stages.append(
            {
                "command": command,
                "request": cpu_request.command_line() + f"  (and --device {device})",
                "seconds": {"cpu": cpu_s, "device": dev_s},
                "speedup": cpu_s / dev_s if dev_s > 0 else None,
                "agreement": agreement,
                "ok": all(a["ok"] for a in agreement) and bool(agreement),
                "precisions": _lower_precisions(command, dev_request, reference, precisions),
            }
        )
        print(
            f"{command:13s} cpu {cpu_s:7.2f} s  {device} {dev_s:7.2f} s  "
            f"{'agree' if stages[-1]['ok'] else 'DISAGREE'} ({len(agreement)} numbers)",
            flush=True,
        )
        result["ok"] = all(s["ok"] for s in stages) and not result["skipped"]
        save()
    left = None if deadline is None else max(0.0, deadline - (time.perf_counter() - start))
    result["scale"] = _scale_benchmark(device, size, out_dir, left, precisions[0] if precisions else None)
    result["ok"] = bool(stages) and all(s["ok"] for s in stages) and not result["skipped"]
    save()
    total_cpu = sum(s["seconds"]["cpu"] for s in stages)
    total_dev = sum(s["seconds"]["device"] for s in stages)
    print(f"RATIO gpu_check_speedup={total_cpu / total_dev if total_dev else float('nan'):.2f}")
    return result


def _lower_precisions(command: str, request: Any, reference: dict, precisions: tuple[str, ...]) -> list[dict]:
    """``request`` (on the device) again at each lower precision: its time, its headline numbers
    against the CPU float64 run's (informational: a lower precision is not expected to meet the
    float64 tolerances) and the float64 spot check its report records."""
    import attnaudit as aa

    if command not in PRECISION_COMMANDS:
        return []
    rows = []
    for precision in precisions:
        try:
            res, seconds = _timed(lambda p=precision: aa.run(request.replace(precision=p)))
        except Exception as exc:  # noqa: BLE001 - a precision the device lacks is a result, not a crash
            rows.append({"precision": precision, "error": str(exc).splitlines()[0]})
            print(f"{command:13s} {precision}: failed ({str(exc).splitlines()[0]})", flush=True)
            continue
        report = res.to_dict()
        numbers = []
        for metric, value, kind, tol in _metrics(command, report):
            ref = reference.get(metric, (None, kind, tol))[0]
            diff, ok = _agree(ref, value, kind, tol)
            numbers.append({"metric": metric, "cpu_float64": ref, "device": value, "diff": diff, "within": ok})
        rows.append(
            {
                "precision": precision,
                "seconds": seconds,
                "numbers": numbers,
                "precision_check": report["results"].get("precision_check"),
            }
        )
        print(f"{command:13s} {precision}: {seconds:7.2f} s", flush=True)
    return rows


def _scale_benchmark(
    device: str, size: str, out_dir: Path, deadline: float | None = None, precision: str | None = None
) -> dict | None:
    """benchmarks/bench_scale.py on ``device`` (``--small`` for the small check, full size for the
    full one, skipped in the tiny form) within ``deadline`` seconds: its SCALE and RATIO lines,
    its per-stage lines, and its exit status."""
    import subprocess

    if size == "tiny":
        return None
    script = Path(__file__).resolve().parents[1] / "bench_scale.py"
    cmd = [sys.executable, str(script), "--device", device, "--out", str(out_dir / "scale")]
    if size == "small":
        cmd.append("--small")
    if deadline is not None:
        cmd += ["--deadline", f"{deadline:.0f}"]
    if precision is not None:
        cmd += ["--precision", precision]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        print(line, flush=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("SCALE ", "RATIO "))]
    stage_lines = [
        line for line in out.stdout.splitlines() if line.strip() and not line.startswith(("SCALE ", "RATIO "))
    ]
    models = [
        dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
        for line in lines
        if line.startswith("SCALE ")
    ]
    return {
        "command": " ".join(cmd[1:]),
        "exit": out.returncode,
        "models": models,
        "lines": lines,
        "stages": stage_lines,
        "error": out.stderr.strip().splitlines()[-1] if out.returncode and out.stderr.strip() else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", default=".")
    parser.add_argument(
        "--deadline", type=float, default=None, help="seconds for the whole check (stages past it are skipped)"
    )
    parser.add_argument(
        "--precisions",
        default="float32,bfloat16",
        help="lower precisions each of malleability and landscape also runs at on the device (empty: none); the "
        "first is the scale benchmark's",
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device here; run with DEVICE=cpu for the CPU path", file=sys.stderr)
            return 2
    precisions = tuple(p for p in args.precisions.split(",") if p)
    result = run_check(args.device, args.size, Path(args.out), args.deadline, precisions)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
