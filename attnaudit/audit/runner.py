"""Running an audit: validate every check by a dry run, train the model once if asked, run each
distinct command line once, read each check's metric, judge thresholds and baselines.

Each check is a request run by the library (:func:`attnaudit.analyses.registry.run_argv`),
stated as the command line it prints as its reproduction, so a check's numbers are the
CLI's numbers for that line. Checks
whose command lines are identical share one run: its trained networks, influence scores
and every other intermediate (reported as ``run`` / ``shared_with``).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from attnaudit.errors import AuditError, FieldError, field_check, literal
from attnaudit.analyses.registry import run_argv as invoke, shell_line
from attnaudit.audit import metrics as M
from attnaudit.audit.commands import argv_of, option_params, to_args, to_values
from attnaudit.audit.file import AuditPlan, CheckSpec
from attnaudit.report.envelope import read_json_file
from attnaudit.analyses.registry import request_type
from attnaudit.analyses.registry import run as run_request
from attnaudit.runtime.sweep import ExecutorConfig
from attnaudit.report.envelope import check_target
from attnaudit.runtime.sweep import CellTask, run_cells
from attnaudit.runtime.atomic import StagedFiles

if TYPE_CHECKING:
    from attnaudit.runtime.sweep import ExecutorConfig

SCHEMA = "attnaudit.audit/1"
BASELINE_SCHEMA = "attnaudit.audit-baseline/1"
STATUSES = ("pass", "fail", "error", "skipped")


@dataclass
class CheckResult:
    """What one check measured and whether it held."""

    spec: CheckSpec
    command: str
    run: str
    status: str = "skipped"
    value: float | None = None
    values: list = field(default_factory=list)  # [{"labels": {...}, "value": v}]
    message: str = ""
    failure_type: str | None = None  # threshold | baseline
    error_kind: str | None = None  # input | internal
    baseline: dict | None = None
    shared_with: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def threshold_text(self) -> str:
        parts = []
        if self.spec.min is not None:
            parts.append(f">= {self.spec.min:g}")
        if self.spec.max is not None:
            parts.append(f"<= {self.spec.max:g}")
        return " and ".join(parts) or f"baseline only ({self.spec.better} is better)"

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "name": s.name,
            "analysis": s.analysis,
            "description": s.description,
            "metric": s.metric,
            "path": s.path,
            "report_schema": s.schema,
            "select": s.select,
            "stat": s.stat,
            "max": s.max,
            "min": s.min,
            "better": s.better,
            "tolerance": s.tolerance,
            "tolerance_rel": s.tolerance_rel,
            "value": _finite_or_none(self.value),
            "value_text": format_value(self.value),
            "values": [
                {"labels": v["labels"], "value": _finite_or_none(v["value"]), "value_text": format_value(v["value"])}
                for v in self.values
            ],
            "status": self.status,
            "message": self.message,
            "failure_type": self.failure_type,
            "error_kind": self.error_kind,
            "baseline": self.baseline,
            "command": self.command,
            "run": self.run,
            "shared_with": self.shared_with,
            "uses_model": s.use_model,
        }


@dataclass
class Run:
    """One command line, run once for every check that names it."""

    id: str
    analysis: str
    args: list[str]
    checks: list[str]
    report: dict | None = None
    error: str | None = None
    error_kind: str | None = None
    seconds: float = 0.0
    shown_args: list[str] | None = None  # args as a user reruns them (the saved model's path, not a temporary one)
    field_error: FieldError | None = None  # the error, when it was about one field (named per check)

    @property
    def command(self) -> str:
        return shell_line(self.analysis, self.shown_args if self.shown_args is not None else self.args)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "analysis": self.analysis,
            "command": self.command,
            "checks": self.checks,
            "seconds": self.seconds,
            "error": self.error,
            "report": self.report,
        }


@dataclass
class AuditResult:
    plan: AuditPlan
    checks: list[CheckResult]
    runs: list[Run]
    model: dict | None
    warnings: list[str]
    seconds: float

    @property
    def counts(self) -> dict[str, int]:
        return {status: sum(c.status == status for c in self.checks) for status in STATUSES}

    @property
    def exit_code(self) -> int:
        """3 an internal error, else 2 a check's input was refused, else 1 a check failed, else 0."""
        kinds = {c.error_kind for c in self.checks if c.status == "error"}
        if "internal" in kinds:
            return 3
        if kinds:
            return 2
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def verdicts(self) -> list[str]:
        n = self.counts
        line = (
            f"{self.plan.name}: {n['pass']} of {len(self.checks)} checks passed"
            + (f", {n['fail']} failed" if n["fail"] else "")
            + (f", {n['error']} errored" if n["error"] else "")
            + (f", {n['skipped']} skipped" if n["skipped"] else "")
            + f" (exit {self.exit_code})"
        )
        return [line] + [
            f"{c.name}: {c.status.upper()}: {c.message}" for c in self.checks if c.status in ("fail", "error")
        ]

    def to_dict(self) -> dict:
        shared = [r.id for r in self.runs if len(r.checks) > 1]
        return {
            "file": self.plan.file_info(),
            "model": self.model,
            "checks": [c.to_dict() for c in self.checks],
            "runs": [r.to_dict() for r in self.runs],
            "shared_runs": shared,
            "summary": {
                "checks": len(self.checks),
                "passed": self.counts["pass"],
                "failed": self.counts["fail"],
                "errors": self.counts["error"],
                "skipped": self.counts["skipped"],
                "exit_code": self.exit_code,
                "runs": len(self.runs),
                "seconds": self.seconds,
            },
        }


def _finite_or_none(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def format_value(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}" if isinstance(value, (int, float)) else str(value)


# ----------------------------------------------------------------------------- baselines
def read_baseline(path: str | Path) -> dict[str, dict]:
    """check name -> {value, metric, stat, better} from a --save-baseline file."""

    data = field_check(
        "baseline", lambda name: read_json_file(path, f"{name} {path}", "write a baseline with --save-baseline first")
    )
    named = "{name} " + literal(path)
    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA or not isinstance(data.get("checks"), dict):
        raise FieldError(
            "baseline",
            named + f": not an attnaudit baseline (schema {BASELINE_SCHEMA}); write one with --save-baseline",
        )
    out = {}
    for name, entry in data["checks"].items():
        value = entry.get("value") if isinstance(entry, dict) else None
        if isinstance(value, str) and value in ("inf", "-inf"):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError("baseline", named + literal(f": checks.{name}.value must be a number"))
        out[name] = {**entry, "value": float(value)}
    return out


def baseline_payload(result: AuditResult) -> dict:
    """The --save-baseline file: every check that produced a value."""
    checks = {}
    for c in result.checks:
        if c.value is None:
            continue
        value = c.value if math.isfinite(c.value) else format_value(c.value)
        checks[c.name] = {
            "value": value,
            "metric": c.spec.metric or f"path {c.spec.path}",
            "select": c.spec.select,
            "stat": c.spec.stat,
            "better": c.spec.better,
        }
    return {"schema": BASELINE_SCHEMA, "file": result.plan.file_info(), "seed": result.plan.seed, "checks": checks}


# ----------------------------------------------------------------------------- judging one check
def observe(spec: CheckSpec, report: dict) -> list[dict]:
    """The check's metric in a run's report: [{labels, value}] after select (AuditError when nothing fits)."""
    schema = str(report.get("schema", "")).split("/")[0]
    if schema != spec.schema:
        raise AuditError(
            f"{spec.where}: the run produced a {schema} report, not the {spec.schema} report its metric "
            "reads; check the options"
        )
    results = report.get("results") or {}
    if spec.path is not None:
        obs = M.path_observations(results, spec.path)
        if not obs:
            raise AuditError(f"{spec.where}.metric.path: {spec.path} matches nothing in the {schema} report's results")
    else:
        assert spec.metric is not None  # a check reads a named metric or a path
        obs = M.observations(M.METRICS[spec.schema][spec.metric], results, spec.stat)
        if not obs:
            raise AuditError(f"{spec.where}.metric: the {schema} report has no {spec.metric} rows")
    kept = [(labels, value) for labels, value in obs if M.matches(labels, spec.select)]
    if not kept:
        available: dict[str, list] = {}
        for labels, _ in obs:
            for key, value in labels.items():
                available.setdefault(key, [])
                if value not in available[key]:
                    available[key].append(value)
        offer = "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in available.items())
        raise AuditError(
            f"{spec.where}.select: no {spec.metric or 'path'} row matches "
            f"{', '.join(f'{k}={v}' for k, v in spec.select.items())} (available {offer})"
        )
    out: list[dict] = []
    missing = [labels for labels, value in kept if value is None]
    if len(missing) == len(kept):
        where = "; ".join(", ".join(f"{k}={v}" for k, v in labels.items()) or "the report" for labels in missing[:4])
        raise AuditError(
            f"{spec.where}: {spec.metric or spec.path} was not measured (null in the report) for {where}; "
            "select rows where it is defined"
        )
    for labels, value in kept:
        where = ", ".join(f"{k}={v}" for k, v in labels.items()) or "the report"
        if value is None:  # undefined for this row (e.g. a 0/0 ratio): listed, not judged
            out.append({"labels": labels, "value": None})
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AuditError(
                f"{spec.where}: {spec.metric or spec.path} for {where} is {type(value).__name__}, not a number"
            )
        if math.isnan(value):
            raise AuditError(f"{spec.where}: {spec.metric or spec.path} for {where} is NaN")
        out.append({"labels": labels, "value": float(value)})
    return out


def judge(check: CheckResult, values: list[dict], baseline: dict | None) -> None:
    """Thresholds on every value, then the baseline on the worst one; sets status and message."""
    spec = check.spec
    check.values = values
    undefined = [v for v in values if v["value"] is None]
    values = [v for v in values if v["value"] is not None]
    nums = [v["value"] for v in values]
    check.value = max(nums) if spec.better == "lower" else min(nums)
    what = spec.metric_label
    problems = []
    if spec.max is not None and max(nums) > spec.max:
        bad = [v for v in values if v["value"] > spec.max]
        problems.append(f"{what} = {format_value(max(nums))} > max {spec.max:g}" + _rows(bad, values))
        check.value = max(nums)
    if spec.min is not None and min(nums) < spec.min:
        bad = [v for v in values if v["value"] < spec.min]
        problems.append(f"{what} = {format_value(min(nums))} < min {spec.min:g}" + _rows(bad, values))
        if spec.max is None or max(nums) <= spec.max:
            check.value = min(nums)
    if problems:
        check.failure_type = "threshold"
    if baseline is not None:
        base = baseline["value"]
        worse = (check.value - base) if spec.better == "lower" else (base - check.value)
        if math.isnan(worse):
            worse = 0.0  # inf against inf: unchanged
        allowed = spec.tolerance if spec.tolerance_rel is None else spec.tolerance_rel * abs(base)
        passed = worse <= allowed
        check.baseline = {
            "value": _finite_or_none(base),
            "value_text": format_value(base),
            "worse_by": _finite_or_none(worse),
            "allowed": _finite_or_none(allowed),
            "passed": passed,
        }
        if not passed:
            problems.append(
                f"{what} = {format_value(check.value)} is worse than the baseline {format_value(base)} by "
                f"{format_value(worse)} (tolerance {format_value(allowed)}; {spec.better} is better)"
            )
            check.failure_type = check.failure_type or "baseline"
    check.status = "fail" if problems else "pass"
    if problems:
        check.message = "; ".join(problems) + f"; reproduce: {check.command}"
    else:
        check.message = f"{what} = {format_value(check.value)} ({check.threshold_text})"
    if undefined:
        rows = "; ".join(", ".join(f"{k}={x}" for k, x in v["labels"].items()) for v in undefined[:4])
        check.message += f" [not defined, so not judged, at {rows}]"


def _rows(bad: list[dict], values: list[dict]) -> str:
    if len(values) == 1:
        return ""
    rows = "; ".join(", ".join(f"{k}={x}" for k, x in v["labels"].items()) for v in bad[:4])
    return f" at {rows}" + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")


# ----------------------------------------------------------------------------- the plan of runs
def _model_values(plan: AuditPlan, analysis: str, model_path: str | None) -> dict[str, Any]:
    if plan.model is None:
        return {}
    if plan.model.kind == "trained":
        return to_values(analysis, {"checkpoint": [str(model_path)]}, "model")
    return to_values(analysis, plan.model.options, "model")


def _train_args(plan: AuditPlan, out: str, stand_in: bool) -> list[str]:
    model = plan.model
    assert model is not None and model.arch is not None  # only a model the audit trains (arch:) gets here
    options = {**plan.data, **model.train}
    if stand_in:  # one step: a model of the right architecture to validate the checks against
        options = {k: v for k, v in options.items() if k not in ("steps", "epochs")}
        options["steps"] = 1
    return [
        "--arch",
        model.arch,
        *to_args("train", options, "model.train"),
        "--seed",
        str(plan.seed),
        "--out",
        out,
    ]


def _train_request(args: list[str]):
    """The train request of the audit's model (it replaces its own temporary file)."""

    return request_type("train").from_argv(args, overwrite=True)


def _train(args: list[str]) -> dict:

    return run_request(_train_request(args)).to_dict()


def _check_values(plan: AuditPlan, spec: CheckSpec, model_path: str | None) -> dict[str, Any]:
    """The check's request as command-line values (:func:`attnaudit.audit.commands.to_values`):
    its options, the audit's seed, and the model when the check uses it."""
    options = dict(spec.options)
    if "seed" in option_params(spec.analysis) and options.get("seed") is None:
        options["seed"] = plan.seed
    # a canonical order, so the same options written in another order share one run
    values = to_values(spec.analysis, dict(sorted(options.items())), f"{spec.where}.options")
    return {**values, **(_model_values(plan, spec.analysis, model_path) if spec.use_model else {})}


def _dry(analysis: str, values: dict[str, Any]) -> None:
    """The request validates its options and reads its model files and data; nothing computes.
    (``from_options`` of the command-line values: the request ``from_argv`` builds, its errors
    still naming fields.)"""
    request_type(analysis).from_options(values).check()


def option_key(error: FieldError, plan: AuditPlan, spec: CheckSpec) -> str:
    """The key path in the audit file of the option that set the field ``error`` names:
    ``checks[i].options.<key>``, ``data.<key>``, ``model.<key>`` or ``seed`` (a field the file
    does not set: the check option that would set it)."""
    key = error.field.replace("_", "-")
    if error.field in plan.data and spec.options.get(error.field) == plan.data[error.field]:
        return f"data.{key}"
    if error.field == "seed" and "seed" not in spec.options:
        return "seed"
    if plan.model is not None and spec.use_model and error.field in ("checkpoint", *plan.model.options):
        return "model" if plan.model.kind == "trained" else f"model.{key}"
    return f"{spec.where}.options.{key}"


def field_message(error: FieldError, plan: AuditPlan, spec: CheckSpec) -> str:
    """``<key path>: <the error, naming the option by its key>`` for an audit file's user."""
    where = option_key(error, plan, spec)
    return f"{where}: {error.named(where.rpartition('.')[2])}"


def run_audit(
    plan: AuditPlan,
    *,
    baseline: str | Path | dict | None = None,
    fail_fast: bool = False,
    overwrite: bool = False,
    progress: Callable[[CheckResult], None] | None = None,
    executor: "ExecutorConfig | None" = None,
) -> AuditResult:
    """Validate every check (dry runs), then run them; see the module docstring.

    Raises :class:`AuditError` for a bad file, baseline or option value (nothing has run
    then); a check that fails at run time is recorded in the result (status error).
    ``executor`` (:mod:`attnaudit.runtime.sweep`): each distinct run is one cell; with worker
    processes or Ray the runs go in parallel (``fail_fast`` needs the sequential local one).
    """

    ex = executor or ExecutorConfig()
    parallel = ex.kind != "local" or ex.jobs > 1 or ex.resume_dir is not None
    if fail_fast and parallel:
        raise FieldError(
            "fail_fast",
            "{name} stops a sequential audit at its first failure; drop it, or run without the ray executor, "
            "worker processes (jobs) or resume",
        )
    ex.check_available()
    t0 = time.perf_counter()
    base = read_baseline(baseline) if isinstance(baseline, (str, Path)) else (baseline or {})
    warnings: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="attnaudit-audit-"))
    try:
        model_path: str | None = None
        shown_model = ""  # model_path as the reports show it (set with model_path)
        model_info = None
        if plan.model is not None and plan.model.kind == "trained":
            if plan.model.save:
                try:
                    check_target(plan.model.save, overwrite)
                except AuditError as exc:
                    raise AuditError(f"{plan.path}: model.save: {exc}") from None
            model_path = str(workdir / "model.safetensors")
            shown_model = plan.model.save or "MODEL.safetensors"
            try:
                _train_request(_train_args(plan, model_path, stand_in=False)).check()
            except AuditError as exc:
                raise AuditError(f"{plan.path}: model.train: {exc}") from None
            try:  # a one-step stand-in, so the checks can be validated against the architecture
                _train(_train_args(plan, model_path, stand_in=True))
            except AuditError as exc:
                raise AuditError(f"{plan.path}: model: {exc}") from None
        elif plan.model is not None:
            model_info = {"kind": plan.model.kind, **plan.model.options}

        runs: dict[tuple, Run] = {}
        checks: list[CheckResult] = []
        for spec in plan.checks:
            try:
                values = _check_values(plan, spec, model_path)
            except AuditError as exc:
                raise AuditError(f"{plan.path}: {exc}") from None
            args = argv_of(spec.analysis, values)
            key = (spec.analysis, tuple(args))
            if key not in runs:
                shown = [shown_model if a == model_path else a for a in args] if model_path else None
                runs[key] = Run(f"run{len(runs) + 1}", spec.analysis, args, [], shown_args=shown)
                try:
                    _dry(spec.analysis, values)
                except FieldError as exc:
                    raise AuditError(f"{plan.path}: {field_message(exc, plan, spec)} (check {spec.name!r})") from None
                except AuditError as exc:
                    raise AuditError(f"{plan.path}: {spec.where}: {exc} (check {spec.name!r})") from None
            run = runs[key]
            run.checks.append(spec.name)
            checks.append(CheckResult(spec, run.command, run.id))
        for c in checks:
            run = next(r for r in runs.values() if r.id == c.run)
            c.shared_with = [n for n in run.checks if n != c.name]
        for name in base:
            if name not in {c.name for c in checks}:
                warnings.append(f"the baseline has a check {name!r} that this file does not define")
        for c in checks:
            if base and c.name not in base:
                warnings.append(f"{c.name}: not in the baseline; judged by its thresholds only")

        if plan.model is not None and plan.model.kind == "trained":
            assert model_path is not None
            tt = time.perf_counter()
            train_report = _train(_train_args(plan, model_path, stand_in=False))
            if plan.model.save:
                _keep_model(model_path, plan.model.save)
            model_info = {
                "kind": "trained",
                "arch": plan.model.arch,
                "saved_to": plan.model.save,
                "command": shell_line("train", _train_args(plan, shown_model, stand_in=False)),
                "seconds": time.perf_counter() - tt,
                "train_report": train_report,
            }

        if parallel:
            _run_parallel(list(runs.values()), ex)
        stop = False
        for c in checks:
            if stop:
                c.message = "skipped: --fail-fast stopped the audit at an earlier failure"
                if progress:
                    progress(c)
                continue
            run = next(r for r in runs.values() if r.id == c.run)
            if run.report is None and run.error is None:
                tr = time.perf_counter()
                try:
                    run.report = invoke(run.analysis, run.args)
                except FieldError as exc:  # named for each check below, by the key that check wrote
                    run.error, run.error_kind, run.field_error = str(exc), "input", exc
                except AuditError as exc:
                    run.error, run.error_kind = str(exc), "input"
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded against the check, reported with exit 3
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    run.error, run.error_kind = f"{exc.__class__.__name__}: {first}", "internal"
                run.seconds = time.perf_counter() - tr
            if run.error is not None:
                c.status, c.error_kind = "error", run.error_kind
                error = field_message(run.field_error, plan, c.spec) if run.field_error else run.error
                c.message = f"{error}; reproduce: {c.command}"
            else:
                assert run.report is not None  # a run without an error has its report
                try:
                    judge(c, observe(c.spec, run.report), base.get(c.name))
                except AuditError as exc:
                    c.status, c.error_kind, c.message = "error", "input", f"{exc}; reproduce: {c.command}"
            if progress:
                progress(c)
            if fail_fast and c.status in ("fail", "error"):
                stop = True
        return AuditResult(plan, checks, list(runs.values()), model_info, warnings, time.perf_counter() - t0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_parallel(runs: list[Run], ex: "ExecutorConfig") -> None:
    """Every run as one cell on the executor; reports (or errors) stored on the runs."""

    tasks = [
        CellTask("attnaudit.analyses.registry:run_cell", {"analysis": r.analysis, "args": r.args}, r.id) for r in runs
    ]
    for run, outcome in zip(runs, run_cells(tasks, ex)):
        run.seconds = outcome.seconds
        if not outcome.ok:
            run.error, run.error_kind = outcome.error, "internal"
        elif "error" in outcome.result:
            run.error, run.error_kind = outcome.result["error"], outcome.result.get("kind", "input")
        else:
            run.report = outcome.result["report"]


def _keep_model(src: str, target: str) -> None:
    """Copy the trained model and its side-car to model.save, atomically together."""

    def copy_of(s: Path) -> Callable[[Path], object]:
        return lambda path: shutil.copyfile(s, path)

    pairs = [(Path(src), Path(target)), (Path(src + ".json"), Path(target + ".json"))]
    with StagedFiles() as files:
        for s, t in pairs:
            if s.exists():
                files.stage(t, copy_of(s))
        files.commit()
