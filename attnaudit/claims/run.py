"""`claims` as a request and a run: the paper's claims scorecard (:mod:`attnaudit.claims.scorecard`).

The scorecard's runs are requests of the analyses, stated as the command lines that
reproduce them (every row shows its line), validated before anything trains and run by the
library through the executor (:func:`attnaudit.analyses.registry.run_cell`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from attnaudit.analyses.registry import check_argv, shell_line
from attnaudit.analyses.request import EXECUTION, PROTOCOL, FieldError, Request, field_check, option, unknown_preset
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields
from attnaudit.errors import AuditError, check_seed
from attnaudit.claims import plan, scorecard
from attnaudit.report.envelope import build_report
from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

PNG_NAME = "claims.png"
MODES = {"quick": "quick", "paper": "full"}


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
class ClaimsRequest(DataFields, Request):
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
    preset: str | None = option(
        None,
        "--preset",
        panel=PROTOCOL,
        help="quick (default): the commands' quick presets on digits; paper: their paper presets (MNIST-size), "
        "as in every other command.",
    )
    quick: bool | None = option(
        None,
        "--quick",
        panel=PROTOCOL,
        kind=bool,
        negative="--full",
        help="Older spelling of --preset quick / --preset paper (kept for one release).",
    )
    seed: int = option(0, "--seed", panel=PROTOCOL, help="Base random seed (recorded in the report).")
    device: str = option("auto", "--device", panel=EXECUTION, help="auto, cpu, cuda or cuda:<i>.")
    n_seeds: int = option(
        5,
        "--seeds",
        panel=PROTOCOL,
        help="Seeds of every stochastic run (seed, seed+1, ...); intervals are Student t / Fieller over them, and "
        "fewer than 3 never give supported or contradicted.",
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

    def validate(self) -> None:
        self.mode  # noqa: B018 - refuses a bad preset
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
            if self.quick is not None and self.quick != (key == "quick"):
                raise FieldError(
                    "preset",
                    "{name} " + key + " and --" + ("quick" if self.quick else "full") + " disagree; give {name} alone",
                )
            return MODES[key]
        return "quick" if self.quick is None or self.quick else "full"

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
        return args

    def check(self) -> None:
        """Every run's command line checked (options, model files, data) before anything trains."""

        runs, _ = plan.plan(self.mode, self.data_args(), self.seed, n_seeds=self.n_seeds, match_loss=self.match_loss)
        for r in runs:
            try:
                check_argv(r.command, list(r.args))
            except AuditError as exc:
                raise AuditError(f"{r.id} ({r.purpose}): {exc}") from None


def run(request: ClaimsRequest, *, progress: Progress | None = None, executor: Any = None) -> Result:
    """Run the scorecard; the report is the one ``attnaudit claims --json`` writes. Runs that
    fail are rows with their error (``failed_cells``), not an exception."""

    executor = executor or ExecutorConfig()
    executor.check_available()
    mode, seed, n_seeds = request.mode, request.seed, request.n_seeds
    data_args = request.data_args()
    runs, variants = plan.plan(mode, data_args, seed, n_seeds=n_seeds, match_loss=request.match_loss)
    commands = {r.id: shell_line(r.command, list(r.args)) for r in runs}
    request.check()
    t0 = time.perf_counter()
    tasks = [
        CellTask("attnaudit.analyses.registry:run_cell", {"analysis": r.command, "args": list(r.args)}, r.id)
        for r in runs
    ]
    with progress_or_silent(progress)("claims", len(tasks), "runs") as advance:
        outcomes = run_cells(tasks, executor, on_done=lambda o: advance(1))
    reports: dict[str, dict | None] = {}
    errors: dict[str, str] = {}
    run_info: list[dict[str, Any]] = []
    for r, o in zip(runs, outcomes):
        if o.ok and "report" in o.result:
            reports[r.id] = o.result["report"]
        else:
            errors[r.id] = o.error if o.error is not None else o.result.get("error")
            reports[r.id] = None
        run_info.append(
            {
                "id": r.id,
                "purpose": r.purpose,
                "command": commands[r.id],
                "seconds": o.seconds,
                "error": errors.get(r.id),
                "report": reports[r.id],
            }
        )
    match_loss_text = (
        None
        if request.match_loss is None
        else _show_match_loss(request.match_loss)
        if isinstance(request.match_loss, str)
        else f"{request.match_loss:g}"
    )
    result = scorecard.score(mode, reports, errors, commands, variants, slope_margin=request.slope_margin)
    result.runs = run_info
    result.protocol = {
        "n_seeds": n_seeds,
        "seeds": list(range(seed, seed + n_seeds)),
        "match_loss": match_loss_text,
        "slope_margin": request.slope_margin,
        "confidence": 0.95,
    }
    result.warnings = [f"{rid}: {err}" for rid, err in errors.items()]
    for rid, rep in reports.items():  # every sub-run's warnings reach the scorecard, named by run
        for w in (rep or {}).get("warnings") or []:
            result.warnings.append(f"{rid}: {w}")
    report = build_report(
        scorecard.SCHEMA,
        inputs={
            "mode": mode,
            "data": data_args,
            "seed": seed,
            "n_seeds": n_seeds,
            "match_loss": match_loss_text,
            "slope_margin": request.slope_margin,
            "execution": executor.to_dict(),
        },
        seeds={
            "base_seed": seed,
            "n_seeds": n_seeds,
            "runs": {r.id: list(range(seed, seed + n_seeds)) if "--seeds" in r.args else [seed] for r in runs},
        },
        device=None,
        dtype="as each run records",
        timings={"total": time.perf_counter() - t0, **{f"run:{x['id']}": x["seconds"] for x in run_info}},
        results=result.to_dict(),
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    failed = [{"cell": rid, "error": err} for rid, err in errors.items()]
    return Result(
        report,
        request,
        renderables=_tables(result),
        plot=lambda p: _plot(result, p),
        png_name=PNG_NAME,
        failed_cells=failed,
    )


def _tables(result) -> list:
    from rich.table import Table
    from rich.text import Text

    style = {"supported": "green", "contradicted": "bold red", "not resolved": "yellow", "not testable here": "dim"}
    claims = Table(title=f"The paper's claims, tested ({result.mode})", title_justify="left", show_lines=True)
    for col in ("claim", "H0 (null) / null value", "measured [95 % interval]", "seeds", "verdict", "why"):
        claims.add_column(col, overflow="fold")
    for c in result.claims:
        null = c.null + ("" if c.null_value is None else f" (boundary {c.null_value:g})")
        why = c.why + (f"\nwarnings: {len(c.warnings)} (see JSON)" if c.warnings else "")
        claims.add_row(
            c.claim,
            null,
            f"{c.measured}\n({c.interval_method})",
            str(c.n_seeds),
            Text(c.verdict, style=style[c.verdict]),
            why,
        )
    variants = Table(
        title="Malleability under protocol variants (attn / relu flip-rate ratio, Fieller interval)",
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
    ax.set_xlabel("flip-rate ratio attn / relu (95 % Fieller interval over seeds)")
    ax.set_title(f"Malleability ratio across protocol choices ({result.mode})", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
