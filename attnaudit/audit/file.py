"""The audit file: YAML (safe loader, no tags), schema ``attnaudit.audit-file/1``, validated whole.

Every problem is one :class:`AuditError` line, ``<file>: <key path>: <what is wrong>; <what
is expected>``, with a 'did you mean' hint for near misses. The structure, the types, the
option names and the metric names are checked here; the option *values* are checked by
each command itself in a dry run (:mod:`attnaudit.audit.runner`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnaudit.errors import MAX_SEED, AuditError, clip_text, show_value
from attnaudit.audit import metrics as M
from attnaudit.audit.commands import (
    ANALYSES,
    DATA_OPTIONS,
    MODEL_OPTIONS,
    REFUSED,
    field_name,
    hint,
    normalise,
    option_params,
)

FILE_SCHEMA = "attnaudit.audit-file/1"
VERSION = 1
MAX_FILE_BYTES = 1 << 20
# Aliases share nodes, so a few hundred bytes of anchors can name a tree of 10**30 values
# (billion laughs). The file is refused once its tree, with every alias expanded, holds more
# than MAX_NODES nodes or nests deeper than MAX_DEPTH (a genuine audit file: a few hundred).
MAX_NODES = 100_000
MAX_DEPTH = 64
TOP_KEYS = ("version", "name", "seed", "data", "model", "checks")
CHECK_KEYS = (
    "name",
    "analysis",
    "description",
    "options",
    "use_model",
    "metric",
    "select",
    "stat",
    "max",
    "min",
    "better",
    "tolerance",
    "tolerance_rel",
)
MODEL_KEYS = (*MODEL_OPTIONS, "arch", "train", "save")
SUBSET_OPTIONS = ("n", "stratify")  # data options only some commands take (kappa)
BETTER = ("lower", "higher")


@dataclass
class ModelSection:
    """What the checks audit: checkpoint files, a factory, or a built-in architecture the audit trains once."""

    kind: str  # checkpoint | factory | trained
    options: dict[str, Any]  # checkpoint/factory options (python names) passed to every check that uses the model
    arch: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    save: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "options": self.options, "arch": self.arch, "train": self.train, "save": self.save}


@dataclass
class CheckSpec:
    """One check: which command runs with which options, which number it reads, what must hold."""

    index: int
    name: str
    analysis: str
    options: dict[str, Any]  # python names, data options merged in
    use_model: bool
    metric: str | None
    path: str | None
    schema: str
    select: dict[str, Any]
    stat: str
    max: float | None
    min: float | None
    better: str
    tolerance: float
    tolerance_rel: float | None
    description: str | None = None

    @property
    def where(self) -> str:
        return f"checks[{self.index}]"

    @property
    def metric_label(self) -> str:
        what = self.metric if self.metric else f"path {self.path}"
        sel = ", ".join(f"{k}={v}" for k, v in self.select.items())
        return what + (f" [{sel}]" if sel else "") + (f" ({self.stat})" if self.stat != "mean" else "")


@dataclass
class AuditPlan:
    path: str
    sha256: str
    name: str
    version: int
    seed: int
    data: dict[str, Any]
    model: ModelSection | None
    checks: list[CheckSpec]

    def file_info(self) -> dict:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "name": self.name,
            "version": self.version,
            "schema": FILE_SCHEMA,
        }


_STANDARD_TAGS = {
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq", "merge", "timestamp")
}


def _check_shape(text: str) -> None:
    """Refuse, from the event stream (pyyaml's parser is not recursive, its composer is), a
    document nested deeper than MAX_DEPTH, with a recursive alias, or whose tree holds more
    than MAX_NODES nodes once every alias is expanded (billion laughs, merge-key bombs)."""
    import yaml

    open_collections: list[list] = []  # [anchor, expanded size so far] per open collection
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    total = 0

    def add(count: int, line: int) -> None:
        nonlocal total
        total += count
        if open_collections:
            open_collections[-1][1] += count
        if total > MAX_NODES:
            raise AuditError(
                f"line {line}: the document holds more than {MAX_NODES:,} values once its aliases (*name) are "
                "expanded (a billion-laughs file?); an audit file needs a few hundred: write it out plainly"
            )

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(open_collections) >= MAX_DEPTH:
                raise AuditError(
                    f"line {line}: lists and mappings nested more than {MAX_DEPTH} levels deep; "
                    "an audit file needs a few levels: flatten it"
                )
            add(1, line)
            open_collections.append([event.anchor, 1])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, size = open_collections.pop()
            if open_collections:  # the parent counted this node (1) at its start; now its contents
                open_collections[-1][1] += size - 1
            if anchor is not None:
                sizes[anchor] = size
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            add(1, line)
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in open_collections):
                raise AuditError(
                    f"line {line}: the alias *{clip_text(event.anchor, 40)} refers to a node that contains it "
                    "(a recursive anchor); an audit file is a tree: write the value out"
                )
            add(sizes.get(event.anchor, 1), line)  # an undefined alias: the composer names it below


def _safe_load(text: str, where: str) -> Any:
    """YAML through pyyaml's safe loader; any tag beyond plain data (``!!python/...``, ``!custom``,
    ``!!set``...) is refused before anything is constructed, and so is a document that nests
    deeper than MAX_DEPTH or expands (through aliases) beyond MAX_NODES nodes."""
    import yaml

    try:
        _check_shape(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        seen: set[int] = set()
        stack = [root] if root is not None else []
        while stack:  # aliases share nodes: each is visited once
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.tag not in _STANDARD_TAGS:
                raise AuditError(
                    f"line {node.start_mark.line + 1}: the YAML tag {clip_text(node.tag, 60)} is not allowed (an "
                    "audit file is plain data: mappings, lists, strings, numbers, booleans); remove the tag"
                )
            if isinstance(node, yaml.SequenceNode):
                stack.extend(node.value)
            elif isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    stack.extend((key, value))
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise AuditError(f"{at}not valid YAML ({clip_text(problem, 120)}); fix the syntax") from None
    except ValueError as exc:  # int("9" * 5000) (Python reads at most 4300 digits), a date like 2024-13-45
        problem = "an integer has more than 4300 digits" if "digits" in str(exc) else clip_text(exc, 100)
        raise AuditError(f"a value cannot be read ({problem}); fix or shorten it") from None


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), type(value).__name__)


def _expect(value: Any, types: tuple, what: str, where: str) -> Any:
    if isinstance(value, bool) and bool not in types:
        raise AuditError(f"{where}: expected {what}, got {_kind(value)}")
    if not isinstance(value, types):
        raise AuditError(f"{where}: expected {what}, got {_kind(value)}")
    return value


def _number(value: Any, where: str) -> float:
    _expect(value, (int, float), "a number", where)
    if not math.isfinite(float(value)):
        raise AuditError(f"{where}: expected a finite number, got {value}")
    return float(value)


def _unknown_keys(mapping: dict, allowed: tuple, where: str) -> None:
    for key in mapping:
        if not isinstance(key, str):
            raise AuditError(f"{where}: keys must be strings, got {show_value(key)}")
        if key not in allowed:
            raise AuditError(
                f"{where + '.' if where else ''}{clip_text(key, 60)}: unknown key{hint(key, allowed)} "
                f"(allowed: {', '.join(allowed)})"
            )


def _options(raw: Any, command: str, where: str, refused: dict[str, str]) -> dict[str, Any]:
    """A mapping of CLI options (python names), names checked against the command's own options."""
    if raw is None:
        return {}
    _expect(raw, (dict,), "a mapping of option: value", where)
    params = option_params(command)
    usable = [n.replace("_", "-") for n in params if n not in refused]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = field_name(command, key) or normalise(key)
        if name in refused or normalise(key) in refused:
            name = name if name in refused else normalise(key)
            raise AuditError(f"{where}.{key}: --{name.replace('_', '-')} is not set in a check: {refused[name]}")
        if name not in params:
            raise AuditError(
                f"{where}.{key}: {command} has no option --{name.replace('_', '-')}"
                f"{hint(name.replace('_', '-'), usable)}"
            )
        if isinstance(value, dict):
            raise AuditError(f"{where}.{key}: expected a value or a list of values, got a mapping")
        out[name] = value
    return out


def report_schema(analysis: str, options: dict[str, Any], with_model: bool) -> str:
    """The report schema (without version) the command produces with these options."""
    if analysis == "kappa":
        return M.KAPPA_LAYERS if with_model else M.KAPPA
    if analysis == "ntk-distance":
        if with_model:
            return M.NTK_CHECKPOINT
        return M.NTK_TRANSFORMERS if options.get("arch") else M.NTK
    return M.MALLEABILITY if analysis == "malleability" else M.LANDSCAPE


def _model(raw: Any, where: str = "model") -> ModelSection | None:
    if raw is None:
        return None
    _expect(raw, (dict,), "a mapping (checkpoint:, factory: + weights:, or arch: + train:)", where)
    _unknown_keys(raw, MODEL_KEYS, where)
    given = [k for k in ("checkpoint", "factory", "arch") if raw.get(k) is not None]
    if len(given) != 1:
        raise AuditError(
            f"{where}: give exactly one of checkpoint, factory or arch "
            f"({'none given' if not given else ', '.join(given) + ' given'})"
        )
    kind = {"checkpoint": "checkpoint", "factory": "factory", "arch": "trained"}[given[0]]
    for key in ("factory", "weights", "inputs", "arch", "save"):
        if raw.get(key) is not None:
            _expect(raw[key], (str,), "a string", f"{where}.{key}")
    if raw.get("trust_pickle") is not None:
        _expect(raw["trust_pickle"], (bool,), "true or false", f"{where}.trust_pickle")
    if kind == "trained":
        extra = [k for k in MODEL_OPTIONS if raw.get(k) is not None]
        if extra:
            raise AuditError(f"{where}.{extra[0]}: a model the audit trains (arch:) takes no {extra[0]}; drop it")
        train = _options(
            raw.get("train"),
            "train",
            f"{where}.train",
            {**REFUSED, "arch": "it is model.arch", "seed": "the audit's seed: trains it"},
        )
        return ModelSection(kind, {}, arch=raw["arch"], train=train, save=raw.get("save"))
    if raw.get("train") is not None or raw.get("save") is not None:
        raise AuditError(f"{where}: train: and save: belong to a model the audit trains (arch:); drop them")
    options: dict[str, Any] = {}
    if kind == "checkpoint":
        paths = raw["checkpoint"]
        paths = [paths] if isinstance(paths, str) else paths
        _expect(paths, (list,), "a path or a list of paths", f"{where}.checkpoint")
        for i, p in enumerate(paths):
            _expect(p, (str,), "a path", f"{where}.checkpoint[{i}]")
        if not paths:
            raise AuditError(f"{where}.checkpoint: give at least one path")
        options["checkpoint"] = list(paths)
        if raw.get("weights") is not None:
            raise AuditError(f"{where}.weights: weights: goes with factory:, not checkpoint:")
    else:
        options["factory"] = raw["factory"]
        if raw.get("weights") is not None:
            options["weights"] = raw["weights"]
    for key in ("trust_pickle", "inputs"):
        if raw.get(key) is not None:
            options[key] = raw[key]
    return ModelSection(kind, options)


def _metric(raw: Any, schema: str, analysis: str, where: str) -> tuple[str | None, str | None]:
    if raw is None:
        raise AuditError(f"{where}: missing 'metric' (a named metric of {analysis}, or {{path: results.field}})")
    available = M.METRICS.get(schema, {})
    if isinstance(raw, dict):
        _unknown_keys(raw, ("path",), f"{where}.metric")
        path: str = _expect(
            raw.get("path"),
            (str,),
            "a dotted path into the report's results, e.g. models.*.loss",
            f"{where}.metric.path",
        )
        return None, path.removeprefix("results.")
    _expect(raw, (str,), "a metric name or {path: ...}", f"{where}.metric")
    if raw not in available:
        others = sorted({n for table in M.METRICS.values() for n in table} - set(available))
        elsewhere = f" ({raw} belongs to another analysis or mode)" if raw in others else ""
        raise AuditError(
            f"{where}.metric: unknown metric {show_value(raw)} for {analysis} (report {schema}){elsewhere}"
            f"{hint(raw, available)}; available: {', '.join(available)}"
        )
    return raw, None


def _check(raw: Any, index: int, plan_data: dict, model: ModelSection | None, names: set) -> CheckSpec:
    where = f"checks[{index}]"
    _expect(raw, (dict,), "a mapping with name, analysis, metric and a threshold", where)
    _unknown_keys(raw, CHECK_KEYS, where)
    for key in ("name", "analysis"):
        if raw.get(key) is None:
            raise AuditError(f"{where}: missing '{key}'")
    name = _expect(raw["name"], (str,), "a string", f"{where}.name").strip()
    if not name:
        raise AuditError(f"{where}.name: give a non-empty name")
    if name in names:
        raise AuditError(f"{where}.name: {show_value(name)} names two checks; give each check its own name")
    names.add(name)
    analysis = _expect(raw["analysis"], (str,), "a string", f"{where}.analysis").strip().lower()
    if analysis not in ANALYSES:
        raise AuditError(
            f"{where}.analysis: unknown analysis {raw['analysis']!r}{hint(analysis, ANALYSES)}; "
            f"use one of {', '.join(ANALYSES)}"
        )
    own = _options(raw.get("options"), analysis, f"{where}.options", REFUSED)
    params = option_params(analysis)
    for key in plan_data:
        if key in SUBSET_OPTIONS and key not in params and key not in own:
            raise AuditError(
                f"data.{key}: {analysis} (checks[{index}]) has no --{key} option; move {key} into the "
                "options of the checks that take it"
            )
    options = {**plan_data, **own}
    use_model = raw.get("use_model", True)
    _expect(use_model, (bool,), "true or false", f"{where}.use_model")
    with_model = bool(use_model and model is not None)
    if with_model and analysis == "ntk-distance" and options.get("arch"):
        raise AuditError(
            f"{where}.options.arch: the ntk-distance transformer sweep trains new models; set "
            "use_model: false for this check"
        )
    schema = report_schema(analysis, options, with_model)
    metric, path = _metric(raw.get("metric"), schema, analysis, where)
    spec = M.METRICS[schema][metric] if metric else None
    stats = spec.stats if spec else ("mean",)
    stat = raw.get("stat", stats[0])
    _expect(stat, (str,), "a string", f"{where}.stat")
    if stat not in stats:
        raise AuditError(
            f"{where}.stat: {metric or 'a path metric'} has no statistic {show_value(stat)}{hint(stat, stats)}; "
            f"use one of {', '.join(stats)}"
        )
    select = raw.get("select") or {}
    _expect(select, (dict,), "a mapping of label: value", f"{where}.select")
    for key, value in select.items():
        if spec is not None and key not in spec.labels:
            raise AuditError(
                f"{where}.select.{key}: {metric} rows have no label {show_value(key)}{hint(key, spec.labels)}"
                f"{'; labels: ' + ', '.join(spec.labels) if spec.labels else '; it has a single row'}"
            )
        if isinstance(value, (dict, list)):
            raise AuditError(f"{where}.select.{key}: expected a single value, got {_kind(value)}")
    lo = None if raw.get("min") is None else _number(raw["min"], f"{where}.min")
    hi = None if raw.get("max") is None else _number(raw["max"], f"{where}.max")
    if lo is not None and hi is not None and lo > hi:
        raise AuditError(f"{where}: min {lo:g} is above max {hi:g}; no value can pass")
    better = raw.get("better")
    if better is None:
        if hi is None and lo is None:
            raise AuditError(
                f"{where}: give a threshold (max: or min:), or better: lower|higher for a baseline-only check"
            )
        better = "lower" if hi is not None else "higher"
    _expect(better, (str,), "lower or higher", f"{where}.better")
    if better not in BETTER:
        raise AuditError(f"{where}.better: expected lower or higher, got {show_value(better)}{hint(better, BETTER)}")
    tol = 0.0 if raw.get("tolerance") is None else _number(raw["tolerance"], f"{where}.tolerance")
    tol_rel = None if raw.get("tolerance_rel") is None else _number(raw["tolerance_rel"], f"{where}.tolerance_rel")
    if tol < 0 or (tol_rel is not None and tol_rel < 0):
        raise AuditError(f"{where}: tolerances must be >= 0")
    description = raw.get("description")
    if description is not None:
        _expect(description, (str,), "a string", f"{where}.description")
    return CheckSpec(
        index,
        name,
        analysis,
        options,
        with_model,
        metric,
        path,
        schema,
        dict(select),
        stat,
        hi,
        lo,
        better,
        tol,
        tol_rel,
        description,
    )


def parse_audit(data: Any, path: str, sha256: str = "") -> AuditPlan:
    """Validate a parsed audit file (see module docstring); ``path`` prefixes every error."""
    try:
        return _parse(data, path, sha256)
    except AuditError as exc:
        raise AuditError(f"{path}: {exc}") from None


def _parse(data: Any, path: str, sha256: str) -> AuditPlan:
    if data is None:
        raise AuditError("the file is empty; see docs/audit.md for the keys (version, checks, ...)")
    _expect(data, (dict,), "a mapping at the top level (version:, checks:, ...)", "top level")
    _unknown_keys(data, TOP_KEYS, "")
    if "version" not in data:
        raise AuditError(f"version: missing; add 'version: {VERSION}' (the file schema {FILE_SCHEMA})")
    version = data["version"]
    if isinstance(version, bool) or version != VERSION:
        raise AuditError(
            f"version: {show_value(version)} is not a version this attnaudit reads; use version: {VERSION}"
        )
    name = data.get("name", Path(path).stem)
    _expect(name, (str,), "a string", "name")
    seed = data.get("seed", 0)
    _expect(seed, (int,), "an integer", "seed")
    if not 0 <= seed <= MAX_SEED:
        raise AuditError(f"seed: must be an integer in 0..{MAX_SEED}, got {clip_text(seed, 40)}")
    raw_data = data.get("data") or {}
    _expect(raw_data, (dict,), "a mapping of data options (dataset, split, data_dir, ...)", "data")
    plan_data: dict[str, Any] = {}
    for key, value in raw_data.items():
        key_name = normalise(key)
        allowed = (*DATA_OPTIONS, *SUBSET_OPTIONS)
        if key_name not in allowed:
            raise AuditError(
                f"data.{clip_text(key, 60)}: unknown data option{hint(key_name, allowed)} (allowed: "
                f"{', '.join(allowed)}; other options go into each check's options)"
            )
        plan_data[key_name] = value
    model = _model(data.get("model"))
    checks = data.get("checks")
    if checks is None:
        raise AuditError("checks: missing; list at least one check")
    _expect(checks, (list,), "a list of checks", "checks")
    if not checks:
        raise AuditError("checks: empty; list at least one check")
    names: set = set()
    specs = [_check(raw, i, plan_data, model, names) for i, raw in enumerate(checks)]
    return AuditPlan(path, sha256, name, VERSION, seed, plan_data, model, specs)


def load_audit_file(path: str | Path) -> AuditPlan:
    """Read and validate an audit file (keys, types, option and metric names); runs nothing."""
    p = Path(path)
    where = str(path)
    if not p.is_file():
        raise AuditError(f"{where}: no such file; give the path of an audit YAML file")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise AuditError(f"{where}: {p.stat().st_size} bytes is too large for an audit file (limit {MAX_FILE_BYTES})")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AuditError(f"{where}: not UTF-8 text; save the audit file as UTF-8") from None
    try:
        data = _safe_load(text, where)
    except AuditError as exc:
        raise AuditError(f"{where}: {exc}") from None
    return parse_audit(data, where, hashlib.sha256(raw).hexdigest())
