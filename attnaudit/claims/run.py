"""`claims` as a request and a run: the paper's claims scorecard (:mod:`attnaudit.claims.scorecard`).

The scorecard's runs are requests of the analyses, stated as the command lines that
reproduce them (every row shows its line), validated before anything trains and run by the
library through the executor (:func:`attnaudit.analyses.registry.run_cell`).
"""

from __future__ import annotations

from attnaudit.errors import is_int

import dataclasses
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from attnaudit.analyses.registry import check_argv, shell_line
from attnaudit.analyses.request import (
    DeviceField,
    PrecisionField,
    PresetField,
    SeedField,
    OUTPUT,
    PROTOCOL,
    FieldError,
    Request,
    field_check,
    internal,
    literal,
    option,
    redefault,
    unknown_preset,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields
from attnaudit.errors import AuditError, check_seed
from attnaudit.claims import plan, scorecard
from attnaudit.report.envelope import build_report, dumps, folder_problem, read_json_file
from attnaudit.runtime.atomic import StagedFiles
from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

PNG_NAME = "claims.png"
MODES = {"quick": "quick", "paper": "full"}
#: What --keep-reports writes beside the reports: the command lines, the errors and the protocol of the runs.
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "attnaudit.claims-reports/1"
#: The file each main run's report is kept in; a protocol variant's is its run id + .json (malleability-v1.json).
REPORT_FILES = {
    "kappa": "kappa.json",
    "ntk": "ntk-distance.json",
    "malleability": "malleability.json",
    "landscape": "landscape.json",
    "alignment": "alignment.json",
}
MAX_REPORT_BYTES = 2**30
MAX_MANIFEST_BYTES = 2**24
_RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def _match_loss(value: Any, name: str) -> float | str | None:
    """``--match-loss`` as given: a number, or the words auto / none."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return str(value)


def _show_match_loss(value: float | str) -> str:
    return f"{value!r}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class ClaimsRequest(DataFields, SeedField, DeviceField, PrecisionField, PresetField, Request):
    """What ``attnaudit claims`` runs: the mode's presets on one data set, over ``seeds`` seeds."""

    COMMAND = "claims"

    dataset: str | None = option(
        None,
        "--dataset",
        panel="Data",
        help="Built-in data set: digits (embedded, offline), mnist, fashion-mnist, cifar10, synthetic. "
        "Default: digits (quick) or mnist (paper).",
    )
    split: str | None = option(None, "--split", panel="Data", help="train or test (default train).")
    preset: str | None = redefault(
        PresetField,
        "preset",
        None,
        help="quick (default): the commands' quick presets on digits; paper: their paper presets (MNIST-size), "
        "as in every other command.",
    )
    n_seeds: int = option(
        10,
        "--seeds",
        panel=PROTOCOL,
        help="Seeds of every stochastic run (seed, seed+1, ...). Verdicts use tests valid for any seed distribution "
        "(betting tests for flip rates, the sign test of the median seed for slopes and log ratios) with Holm across "
        "the rows: with fewer than about 9 seeds whose signs agree no seed-based row resolves, and each unresolved "
        "row says how many seeds it would need.",
    )
    match_loss: float | str | None = option(
        None,
        "--match-loss",
        panel=PROTOCOL,
        parse=_match_loss,
        show=_show_match_loss,
        help="Train malleability's and landscape's models to this common training loss (full-batch GD stops there); "
        "auto: to the largest loss any model reaches in the step budget; none: fixed steps. Default: the "
        "presets' own choice (quick: auto; paper: fixed steps, the paper's protocol). The protocol-variant "
        "table also shows the other choice.",
    )
    slope_margin: float = option(
        0.1,
        "--slope-margin",
        panel=PROTOCOL,
        help="Log-log slopes above -margin count as 'no fall with width' in the MLP-Attn claim (tested against "
        "the margin, never against 0).",
    )
    fixed_split: bool = option(
        False,
        "--fixed-split",
        panel=PROTOCOL,
        help="Keep one data split for every seed (seeds then replicate the initialisation only); default: each seed "
        "draws its own split, so verdicts cover the data set, not one sample of it.",
    )
    keep_reports: str | None = option(
        None,
        "--keep-reports",
        panel=OUTPUT,
        metavar="PATH",
        help="Also write every run's JSON report into this folder (kappa.json, ntk-distance.json, malleability.json, "
        "landscape.json, alignment.json, malleability-v1.json, ...) with a manifest.json of their command lines and "
        "protocol, so --reports can score them again without running anything. Existing files are kept unless "
        "--overwrite.",
    )
    reports_dir: str | None = option(
        None,
        "--reports",
        panel=OUTPUT,
        metavar="PATH",
        help="Run nothing: score the reports in this folder (written by --keep-reports). Its manifest.json gives the "
        "command lines and the protocol (without one, this command's options do); a missing report makes its rows "
        "'not testable here'. --slope-margin applies when given; --preset, --seed, --seeds, --match-loss and "
        "--fixed-split must agree with the manifest; the other options are not used.",
    )
    overwrite: bool = internal(False)  # --keep-reports may replace files already there (the CLI's --overwrite)

    def validate(self) -> None:
        self.mode  # noqa: B018 - refuses a bad preset
        self.check_precision_field()
        if self.reports_dir is not None and self.keep_reports is not None:
            raise FieldError(
                "keep_reports",
                "{name} keeps the reports of the runs, and --reports runs none; give one of them "
                "(the folder --reports reads already holds its reports)",
            )
        for name in ("reports_dir", "keep_reports"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise FieldError(name, "{name} is empty; give a folder")
        field_check("seed", check_seed, self.seed)
        if self.n_seeds < 1:
            raise FieldError("n_seeds", "{name} must be >= 1, got " + str(self.n_seeds))
        if not (math.isfinite(self.slope_margin) and self.slope_margin >= 0):
            raise FieldError("slope_margin", "{name} must be a non-negative number, got " + str(self.slope_margin))
        ml = self.match_loss
        if isinstance(ml, str) and ml.strip().lower() not in ("auto", "none"):
            raise FieldError(
                "match_loss", "{name}: " + repr(ml) + " is not a training loss; give a number, auto or none"
            )
        if isinstance(ml, float) and not (math.isfinite(ml) and ml > 0):
            raise FieldError("match_loss", "{name} must be a positive training loss, got " + str(ml))

    @property
    def mode(self) -> str:
        """The scorecard mode: quick, or full (the paper presets)."""
        if self.preset is not None:
            key = self.preset.strip().lower()
            if key not in MODES:
                raise unknown_preset(self.preset, MODES)
            return MODES[key]
        return "quick"

    def data_args(self) -> list[str]:
        """The data options every run gets: as given, else the mode's defaults (digits or mnist; the train split)."""
        args = [
            "--dataset",
            self.dataset or ("digits" if self.mode == "quick" else "mnist"),
            "--split",
            self.split or "train",
        ]
        for flag, value in (("--data", self.data), ("--data-dir", self.data_dir), ("--classes", self.classes)):
            if value is not None:
                args += [flag, str(value)]
        if self.data is not None:
            args = args[2:]  # a user file replaces the built-in data set
        if self.preprocess and self.preprocess != "raw":
            args += ["--preprocess", self.preprocess]
        if self.download:
            args.append("--download")
        if self.device != "auto":
            args += ["--device", self.device]
        if self.precision != "auto":  # every analysis takes it; auto is each one's default
            args += ["--precision", self.precision]
        return args

    def planned(self) -> tuple[list[plan.RunSpec], list[tuple[str, str]]]:
        """The scorecard's runs and its protocol variants (name, run id) for these options."""
        return plan.plan(
            self.mode,
            self.data_args(),
            self.seed,
            n_seeds=self.n_seeds,
            match_loss=self.match_loss,
            resample=not self.fixed_split,
        )

    def check(self) -> None:
        """Every run's command line checked (options, model files, data) and the --keep-reports folder before
        anything trains; with --reports, only that the folder is there (nothing runs)."""

        if self.reports_dir is not None:
            reports_folder(self.reports_dir)
            return
        runs, _ = self.planned()
        if self.keep_reports is not None:
            check_keep(self, [r.id for r in runs])
        for r in runs:
            try:
                check_argv(r.command, list(r.args))
            except AuditError as exc:
                raise AuditError(f"{r.id} ({r.purpose}): {exc}") from None

    def to_argv(self) -> list[str]:
        # ``overwrite`` is an output permission (the CLI's --overwrite), not part of the protocol
        if self.overwrite:
            return dataclasses.replace(self, overwrite=False).to_argv()
        return super().to_argv()


@dataclass(frozen=True)
class RunsProtocol:
    """What the runs of a scorecard were: the request's options, or those a kept manifest records."""

    mode: str
    seed: int
    n_seeds: int
    match_loss: float | str | None
    slope_margin: float
    resample_data: bool
    data_args: tuple[str, ...]
    execution: dict | None = None

    @classmethod
    def of(cls, request: ClaimsRequest, execution: dict | None) -> RunsProtocol:
        return cls(
            request.mode,
            request.seed,
            request.n_seeds,
            request.match_loss.strip().lower() if isinstance(request.match_loss, str) else request.match_loss,
            request.slope_margin,
            not request.fixed_split,
            tuple(request.data_args()),
            execution,
        )

    @property
    def match_loss_text(self) -> str | None:
        """``--match-loss`` as the report shows it (None: the presets' own choice)."""
        ml = self.match_loss
        return None if ml is None else _show_match_loss(ml) if isinstance(ml, str) else f"{ml:g}"


def _run_seeds(spec: plan.RunSpec, seed: int, n_seeds: int) -> list[int]:
    return list(range(seed, seed + n_seeds)) if "--seeds" in spec.args else [seed]


def run(request: ClaimsRequest, *, progress: Progress | None = None, executor: Any = None) -> Result:
    """Run the scorecard; the report is the one ``attnaudit claims --json`` writes. Runs that
    fail are rows with their error (``failed_cells``), not an exception. With ``reports_dir``
    nothing runs: the kept reports there are scored (:func:`rescore`)."""

    if request.reports_dir is not None:
        return rescore(request)
    executor = executor or ExecutorConfig()
    executor.check_available()
    seed, n_seeds = request.seed, request.n_seeds
    runs, variants = request.planned()
    commands = {r.id: shell_line(r.command, list(r.args)) for r in runs}
    request.check()
    t0 = time.perf_counter()
    tasks = [
        CellTask("attnaudit.analyses.registry:run_cell", {"analysis": r.command, "args": list(r.args)}, r.id)
        for r in runs
    ]
    with progress_or_silent(progress)("claims", len(tasks), "runs") as advance:
        outcomes = run_cells(tasks, executor, on_done=lambda o: advance(1))
    records: list[dict[str, Any]] = []
    for r, o in zip(runs, outcomes):
        ok = o.ok and "report" in o.result
        records.append(
            {
                "id": r.id,
                "analysis": r.command,
                "purpose": r.purpose,
                "command": commands[r.id],
                "seconds": o.seconds,
                "error": None if ok else o.error if o.error is not None else o.result.get("error"),
                "report": o.result["report"] if ok else None,
                "seeds": _run_seeds(r, seed, n_seeds),
            }
        )
    protocol = RunsProtocol.of(request, executor.to_dict())
    problems: list[tuple[str, str]] = []
    if request.keep_reports is not None:
        try:
            keep(request.keep_reports, protocol, records, variants, overwrite=request.overwrite)
        except (AuditError, OSError) as exc:  # the scorecard is still scored and written; the run says so
            problems.append(("keep-reports", f"the reports were not kept in {request.keep_reports}: {exc}"))
    return score_runs(request, protocol, records, variants, t0=t0, problems=problems)


def score_runs(
    request: ClaimsRequest,
    protocol: RunsProtocol,
    records: list[dict[str, Any]],
    variants: list[tuple[str, str]],
    *,
    t0: float,
    rescored_from: str | None = None,
    problems: list[tuple[str, str]] | None = None,
) -> Result:
    """The scorecard of the runs' reports: a run just finished, or reports read back by :func:`rescore`.

    ``records``: per run, its id, purpose, command line, seconds, seeds, error and report (None when it
    failed); ``problems``: (what, error) beside the runs (listed as failed, and as warnings)."""

    reports: dict[str, dict | None] = {r["id"]: r["report"] for r in records}
    errors: dict[str, str] = {r["id"]: r["error"] for r in records if r["report"] is None}
    commands = {r["id"]: r["command"] for r in records}
    run_info = [
        {k: r[k] for k in ("id", "purpose", "command", "seconds")}
        | {"error": errors.get(r["id"]), "report": r["report"]}
        for r in records
    ]
    mode, seed, n_seeds = protocol.mode, protocol.seed, protocol.n_seeds
    result = scorecard.score(mode, reports, errors, commands, variants, slope_margin=protocol.slope_margin)
    result.runs = run_info
    result.protocol = {
        "n_seeds": n_seeds,
        "seeds": list(range(seed, seed + n_seeds)),
        "resample_data": protocol.resample_data,
        "match_loss": protocol.match_loss_text,
        "slope_margin": protocol.slope_margin,
        "confidence": 0.95,
    }
    result.warnings = [f"{rid}: {err}" for rid, err in errors.items()]
    for rid, rep in reports.items():  # every sub-run's warnings reach the scorecard, named by run
        for w in (rep or {}).get("warnings") or []:
            result.warnings.append(f"{rid}: {w}")
    result.warnings += [f"{what}: {err}" for what, err in problems or ()]
    seconds = {f"run:{x['id']}": x["seconds"] for x in run_info if isinstance(x["seconds"], (int, float))}
    report = build_report(
        scorecard.SCHEMA,
        inputs={
            "mode": mode,
            "data": list(protocol.data_args),
            "seed": seed,
            "n_seeds": n_seeds,
            "match_loss": protocol.match_loss_text,
            "slope_margin": protocol.slope_margin,
            "execution": protocol.execution,
            "rescored_from": rescored_from,
        },
        seeds={"base_seed": seed, "n_seeds": n_seeds, "runs": {r["id"]: r["seeds"] for r in records}},
        device=None,
        dtype="as each run records",
        timings={"total": time.perf_counter() - t0, **seconds},
        results=result.to_dict(),
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    failed = [{"cell": rid, "error": err} for rid, err in errors.items()]
    failed += [{"cell": what, "error": err} for what, err in problems or ()]
    return Result(
        report,
        request,
        renderables=_tables(result),
        plot=lambda p: _plot(result, p),
        png_name=PNG_NAME,
        failed_cells=failed,
    )


# ----------------------------------------------------------------------------- kept reports
def report_file(run_id: str) -> str:
    """The file a run's report is kept in (:data:`REPORT_FILES`; a variant's: ``<run id>.json``)."""
    return REPORT_FILES.get(run_id, f"{run_id}.json")


def check_keep(request: ClaimsRequest, run_ids: list[str]) -> None:
    """Refuse a ``keep_reports`` folder that cannot be made or written, or whose report files (or manifest)
    exist already unless ``overwrite``: before anything runs."""
    assert request.keep_reports is not None
    folder = Path(request.keep_reports)
    if folder.exists() and not folder.is_dir():
        raise FieldError("keep_reports", "{name} " + literal(folder) + " is a file; give a folder")
    if folder.is_dir():
        problem = folder_problem(folder)
        if problem:
            raise FieldError("keep_reports", "{name}: " + literal(problem))
        for name in [*map(report_file, run_ids), MANIFEST]:
            if (folder / name).exists() and not request.overwrite:
                raise FieldError(
                    "overwrite",
                    literal(folder / name) + " already exists; pass {name} or choose another --keep-reports folder",
                )
        return
    ancestor = folder.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    problem = (
        f"{ancestor} is a file, so the folder cannot be created; choose another folder"
        if not ancestor.is_dir()
        else folder_problem(ancestor)
    )
    if problem:
        raise FieldError("keep_reports", "{name} " + literal(folder) + ": " + literal(problem))


def keep(
    folder: str,
    protocol: RunsProtocol,
    records: list[dict[str, Any]],
    variants: list[tuple[str, str]],
    *,
    overwrite: bool = False,
) -> None:
    """Write every run's report to ``folder`` (:func:`report_file`) and :data:`MANIFEST`, all renamed into
    place together (a failed run has no report; with ``overwrite`` an older file of its name is removed)."""
    from attnaudit import __version__

    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "attnaudit_version": __version__,
        "mode": protocol.mode,
        "seed": protocol.seed,
        "n_seeds": protocol.n_seeds,
        "match_loss": protocol.match_loss,
        "slope_margin": protocol.slope_margin,
        "resample_data": protocol.resample_data,
        "data": list(protocol.data_args),
        "execution": protocol.execution,
        "variants": [{"name": name, "run": rid} for name, rid in variants],
        "runs": [
            {"file": report_file(r["id"])}
            | {k: r[k] for k in ("id", "analysis", "purpose", "command", "seconds", "seeds", "error")}
            for r in records
        ],
    }
    with StagedFiles(overwrite=overwrite) as files:
        for r in records:
            if r["report"] is not None:
                files.stage(target / report_file(r["id"]), _json_writer(r["report"]))
        files.stage(target / MANIFEST, _json_writer(manifest))
        files.commit()
    for r in records:
        stale = target / report_file(r["id"])
        if r["report"] is None and overwrite and stale.is_file():
            stale.unlink()  # an earlier run's report must not be scored as this run's


def _json_writer(payload: dict) -> Callable[[Path], object]:
    text = dumps(payload) + "\n"
    return lambda p: Path(p).write_text(text, encoding="utf-8")


def reports_folder(path: str) -> Path:
    """``reports_dir`` as a folder that is there."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise FieldError(
            "reports_dir", "{name} " + literal(folder) + f" {what}; give the folder --keep-reports wrote the reports to"
        )
    return folder


def rescore(request: ClaimsRequest) -> Result:
    """Score the reports kept in ``request.reports_dir`` without running anything, through the same
    :func:`score_runs` as a run. The folder's manifest gives the command lines, variants and protocol
    (without one, the request's own options rebuild the plan); a missing report is a failed run."""
    assert request.reports_dir is not None
    t0 = time.perf_counter()
    folder = reports_folder(request.reports_dir)
    if (folder / MANIFEST).exists():
        protocol, records, variants = read_manifest(folder / MANIFEST, request)
    else:
        protocol = RunsProtocol.of(request, None)
        runs, variants = request.planned()
        records = [
            {
                "id": r.id,
                "analysis": r.command,
                "purpose": r.purpose,
                "command": shell_line(r.command, list(r.args)),
                "seconds": None,
                "seeds": _run_seeds(r, request.seed, request.n_seeds),
                "error": None,
            }
            for r in runs
        ]
    for r in records:
        name = report_file(r["id"])
        path = folder / name
        if path.exists():
            r["report"], r["error"] = read_report(path, r.get("analysis")), None
        else:  # a run that failed keeps its error; any other missing report is named
            r["report"] = None
            r["error"] = r["error"] or f"no report ({name} not in {request.reports_dir})"
    return score_runs(request, protocol, records, variants, t0=t0, rescored_from=request.reports_dir)


_REPORT_FIX = "write the folder again with --keep-reports, or remove the file to score that run as not testable"


def read_report(path: Path, analysis: str | None) -> dict:
    """A kept report (untrusted: JSON only): an object with a ``results`` mapping, of ``analysis``'s schema
    when it names one; else an :class:`AuditError` naming the file and what is wrong."""
    if not path.is_file():
        raise AuditError(f"{path} is not a file; {_REPORT_FIX}")
    data = read_json_file(path, str(path), _REPORT_FIX, MAX_REPORT_BYTES)
    if not isinstance(data, dict):
        raise AuditError(f"{path}: not a report (JSON {type(data).__name__}, not an object); {_REPORT_FIX}")
    if not isinstance(data.get("results"), dict):
        raise AuditError(f"{path}: not a report (no 'results' mapping); {_REPORT_FIX}")
    schema = data.get("schema")
    if analysis and isinstance(schema, str) and not schema.startswith(f"attnaudit.{analysis}/"):
        raise AuditError(
            f"{path}: a report of schema {literal(schema)[:80]!r} where the {analysis} run's belongs; {_REPORT_FIX}"
        )
    return data


def _manifest_error(path: Path, what: str) -> AuditError:
    return AuditError(
        f"{path}: {what}; write the folder again with --keep-reports, or remove {MANIFEST} to score the reports "
        "under this command's options"
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_manifest(
    path: Path, request: ClaimsRequest
) -> tuple[RunsProtocol, list[dict[str, Any]], list[tuple[str, str]]]:
    """The protocol, run records (without reports) and variants a kept manifest records (untrusted: every
    entry checked). ``request``'s slope margin applies when given; its other protocol options must agree."""
    data = read_json_file(path, str(path), "write the folder again with --keep-reports", MAX_MANIFEST_BYTES)
    if not isinstance(data, dict):
        raise _manifest_error(path, "not a manifest (a JSON object belongs here)")

    def need(key: str, ok: Any, what: str) -> Any:
        if key not in data or not ok(data[key]):
            raise _manifest_error(path, f"'{key}' must be {what}")
        return data[key]

    mode = need("mode", lambda v: v in plan.MODES, "quick or full")
    seed = need("seed", lambda v: is_int(v) and v >= 0, "a seed (an integer >= 0)")
    n_seeds = need("n_seeds", lambda v: is_int(v) and v >= 1, "an integer >= 1")
    margin = need("slope_margin", lambda v: _is_number(v) and v >= 0, "a non-negative number")
    match_loss = need(
        "match_loss",
        lambda v: v is None or (_is_number(v) and v > 0) or v in ("auto", "none"),
        "a number, auto or none",
    )
    resample = need("resample_data", lambda v: isinstance(v, bool), "true or false")
    data_args = need("data", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings")
    execution = data.get("execution") if isinstance(data.get("execution"), dict) else None
    runs = need("runs", lambda v: isinstance(v, list) and v and all(isinstance(r, dict) for r in v), "a list of runs")
    records: list[dict[str, Any]] = []
    for i, r in enumerate(runs):
        rid = r.get("id")
        if not (isinstance(rid, str) and _RUN_ID.fullmatch(rid)) or rid in {x["id"] for x in records}:
            raise _manifest_error(path, f"runs[{i}].id must be a run id of its own, such as malleability-v1")
        checks = {
            "command": lambda v: isinstance(v, str),
            "analysis": lambda v: v is None or (isinstance(v, str) and _RUN_ID.fullmatch(v) is not None),
            "purpose": lambda v: v is None or isinstance(v, str),
            "error": lambda v: v is None or isinstance(v, str),
            "seconds": lambda v: v is None or _is_number(v),
            "seeds": lambda v: v is None or (isinstance(v, list) and all(is_int(s) for s in v)),
        }
        for key, ok in checks.items():
            if not ok(r.get(key)):
                raise _manifest_error(path, f"runs[{i}].{key} ({rid}) is not what --keep-reports writes")
        records.append(
            {
                "id": rid,
                "analysis": r.get("analysis"),
                "purpose": r.get("purpose") or "",
                "command": r["command"],
                "seconds": r.get("seconds"),
                "seeds": r.get("seeds") if r.get("seeds") is not None else [seed],
                "error": r.get("error"),
            }
        )
    ids = {x["id"] for x in records}
    listed = need(
        "variants",
        lambda v: (
            isinstance(v, list)
            and all(isinstance(x, dict) and isinstance(x.get("name"), str) and x.get("run") in ids for x in v)
        ),
        "a list of {name, run} naming runs of 'runs'",
    )
    variants = [(x["name"], x["run"]) for x in listed]
    given_margin = request.slope_margin != scorecard.SLOPE_MARGIN
    protocol = RunsProtocol(
        mode,
        seed,
        n_seeds,
        float(match_loss) if _is_number(match_loss) else match_loss,
        request.slope_margin if given_margin else float(margin),
        resample,
        tuple(data_args),
        execution,
    )
    _agree(request, protocol, path)
    return protocol, records, variants


def _agree(request: ClaimsRequest, kept: RunsProtocol, path: Path) -> None:
    """Refuse a protocol option given with ``reports_dir`` that the kept runs did not run under."""
    fix = "; drop {name} to score them as they ran, or run the scorecard again"
    preset = {mode: name for name, mode in MODES.items()}
    if request.preset is not None and request.mode != kept.mode:
        where = literal(path)
        raise FieldError(
            "preset",
            f"{{name}} asks for the {preset[request.mode]} scorecard, and {where} records {preset[kept.mode]} runs"
            + fix,
        )
    defaults = {f.name: f.default for f in dataclasses.fields(request)}
    asked = RunsProtocol.of(request, None)
    splits = {True: "one fixed split", False: "a split per seed"}
    pairs: dict[str, tuple[Any, Any, str]] = {
        "seed": (asked.seed, kept.seed, str(kept.seed)),
        "n_seeds": (asked.n_seeds, kept.n_seeds, str(kept.n_seeds)),
        "match_loss": (asked.match_loss_text, kept.match_loss_text, kept.match_loss_text or "the presets' own choice"),
        "fixed_split": (not asked.resample_data, not kept.resample_data, splits[not kept.resample_data]),
    }
    for name, (mine, theirs, recorded) in pairs.items():
        if getattr(request, name) != defaults[name] and mine != theirs:
            shown = "" if isinstance(mine, bool) else f" {literal(mine)}"
            where = literal(path.parent)
            raise FieldError(
                name,
                f"{{name}}{shown} disagrees with the runs in {where} ({MANIFEST} records {literal(recorded)})" + fix,
            )


def _tables(result) -> list:
    from rich.table import Table
    from rich.text import Text

    style = {"supported": "green", "contradicted": "bold red", "not resolved": "yellow", "not testable here": "dim"}
    claims = Table(title=f"The paper's claims, tested ({result.mode})", title_justify="left", show_lines=True)
    for col in (
        "claim",
        "H0 (null) / minimum effect",
        "measured [95 % interval]",
        "seeds",
        "p raw / Holm",
        "verdict",
        "why",
    ):
        claims.add_column(col, overflow="fold")
    for c in result.claims:
        null = c.null + ("" if c.null_value is None else f" (boundary {c.null_value:g})")
        why = c.why + (f"\nwarnings: {len(c.warnings)} (see JSON)" if c.warnings else "")
        p = (
            "-"
            if c.p_value is None
            else f"{c.p_value:.3g} / " + ("-" if c.p_adjusted is None else f"{c.p_adjusted:.3g}")
        )
        verdict = Text(c.verdict, style=style[c.verdict])
        if c.raw_verdict and c.raw_verdict != c.verdict:
            verdict.append(f"\n(unadjusted: {c.raw_verdict})", style="dim")
        if c.seeds_needed is not None:
            verdict.append(f"\nneeds ~{c.seeds_needed} seeds", style="dim")
        claims.add_row(
            c.claim + (" [sensitivity]" if c.role == "sensitivity" and "sensitivity" not in c.claim else ""),
            null,
            f"{c.measured}\n({c.interval_method})",
            str(c.n_seeds),
            p,
            verdict,
            why,
        )
    variants = Table(
        title="Malleability under protocol variants (attn / relu flip-rate ratio, betting interval; unadjusted)",
        title_justify="left",
    )
    for col in (
        "variant",
        "flip relu",
        "flip attn",
        "ratio [interval]",
        "beats noise (relu / attn)",
        "losses comparable",
        "reading",
    ):
        variants.add_column(col)

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f} %"

    def end(x, unbounded):
        return unbounded if x is None else f"{x:.2f}"

    for v in result.variants:
        if v.error:
            variants.add_row(v.variant, "", "", "", "", "", Text(f"failed: {v.error}", style="red"))
            continue
        iv = v.interval or [None, None]
        ratio = ("undefined" if v.ratio is None else f"{v.ratio:.2f}") + f" [{end(iv[0], '-')}, {end(iv[1], '+inf')}]"
        beats = " / ".join({True: "yes", False: "no", None: "-"}[v.above_floor.get(m)] for m in ("relu", "attn"))
        variants.add_row(
            v.variant,
            pct(v.flip_relu),
            pct(v.flip_attn),
            ratio,
            beats,
            {True: "yes", False: "no", None: "-"}[v.losses_comparable],
            v.reading,
        )
    lines: list[Table | Text] = [claims, variants]
    lines += [Text(line) for line in result.verdicts()[:1]]
    lines += [Text("commands that reproduce each row:")] + [Text(f"  {r['id']}: {r['command']}") for r in result.runs]
    return lines


def _plot(result, path) -> None:
    import matplotlib.pyplot as plt

    rows = [v for v in result.variants if v.ratio is not None and v.interval and v.interval[0] is not None]
    import textwrap

    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.55 * max(1, len(rows))))
    finite_highs = [v.interval[1] for v in rows if v.interval[1] is not None]
    right = max([2 * max(finite_highs, default=1.0), 10.0] + [2 * v.ratio for v in rows])
    for i, v in enumerate(rows):
        hi = v.interval[1] if v.interval[1] is not None else right
        ax.plot([v.interval[0], hi], [i, i], color="tab:blue", linewidth=2)
        ax.plot([v.ratio], [i], "o", color="tab:blue")
        if v.interval[1] is None:
            ax.annotate("unbounded", (right, i), xytext=(-4, 4), textcoords="offset points", ha="right", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvspan(2, 9, color="tab:red", alpha=0.1, label="paper: 2-9x")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(0, right)
    ax.set_yticks(range(len(rows)), [textwrap.fill(v.variant, 30) for v in rows], fontsize=8)
    ax.set_xlabel("flip-rate ratio attn / relu (95 % betting interval over seeds)")
    ax.set_title(f"Malleability ratio across protocol choices ({result.mode})", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
