"""`attnaudit claims`: thin CLI over :mod:`attnaudit.claims.scorecard` (the paper's claims scorecard)."""

from __future__ import annotations

import math
import time
from typing import Annotated, Optional

import typer

from attnaudit.errors import AuditError
from attnaudit.cli.common import DeviceOpt, SeedOpt, cli_errors, emit, progress
from attnaudit.cli.options import PROTOCOL, DataOptions, ExecutorOptions, ManualCommand, OutputBundle, bundled

PNG_NAME = "claims.png"
HELP = (
    "Test the paper's claims on one data set: runs kappa, ntk-distance, malleability and landscape with documented "
    "protocols (the commands' quick or paper presets) and prints one verdict per claim (supported / contradicted / "
    "not resolved / not testable here, with why), plus the malleability comparison under protocol variants. "
    "Every row states its null hypothesis, the interval it is read from (Student t or Fieller over --seeds seeds) and "
    "the warnings of its run. --preset quick: digits, a few minutes; --preset paper: MNIST-size presets (an hour or more "
    "on 2 cores with --jobs 2)."
)


def _data_args(source: DataOptions, mode: str) -> list[str]:
    """The data options every run gets: as given, else the mode's defaults (digits or mnist; the train split)."""
    args = ["--dataset", source.dataset or ("digits" if mode == "quick" else "mnist"), "--split", source.split or "train"]
    for flag, value in (("--data", source.data), ("--data-dir", source.data_dir), ("--classes", source.classes)):
        if value is not None:
            args += [flag, str(value)]
    if source.data is not None:
        args = args[2:]  # a user file replaces the built-in data set
    if source.preprocess and source.preprocess != "raw":
        args += ["--preprocess", source.preprocess]
    if source.download:
        args.append("--download")
    return args


def _mode(preset: str | None, quick: bool | None) -> str:
    """The scorecard mode from --preset (quick | paper) or the older --quick/--full."""
    if preset is not None:
        key = preset.strip().lower()
        if key not in ("quick", "paper"):
            raise AuditError(f"unknown --preset {preset!r}; use quick or paper")
        if quick is not None and quick != (key == "quick"):
            raise AuditError(f"--preset {key} and --{'quick' if quick else 'full'} disagree; give --preset alone")
        return "quick" if key == "quick" else "full"
    return "quick" if quick is None or quick else "full"


def _match_loss_value(text: str | None) -> float | str | None:
    """--match-loss as given: a number, or the words auto / none (checked by the plan)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def register(app: typer.Typer) -> None:
    @app.command("claims", help=HELP, cls=ManualCommand, epilog="Example: attnaudit claims --preset quick --json claims.json")
    @bundled(source=DataOptions.defaults(dataset=None, split=None), out=OutputBundle, execution=ExecutorOptions)
    def claims_command(
        source: DataOptions,
        out: OutputBundle,
        execution: ExecutorOptions,
        preset: Annotated[Optional[str], typer.Option("--preset", help="quick (default): the commands' quick presets on digits; paper: their paper presets (MNIST-size), as in every other command.", rich_help_panel=PROTOCOL)] = None,
        quick: Annotated[Optional[bool], typer.Option("--quick/--full", help="Older spelling of --preset quick / --preset paper (kept for one release).", rich_help_panel=PROTOCOL)] = None,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
        n_seeds: Annotated[int, typer.Option("--seeds", help="Seeds of every stochastic run (seed, seed+1, ...); intervals are Student t / Fieller over them, and fewer than 3 never give supported or contradicted.", rich_help_panel=PROTOCOL)] = 5,
        match_loss: Annotated[Optional[str], typer.Option("--match-loss", help="Train malleability's and landscape's models to this common training loss (full-batch GD stops there); auto: to the largest loss any model reaches in the step budget; none: fixed steps. Default: the presets' own choice (quick: auto; paper: fixed steps, the paper's protocol). The protocol-variant table also shows the other choice.", rich_help_panel=PROTOCOL)] = None,
        slope_margin: Annotated[float, typer.Option("--slope-margin", help="Log-log slopes above -margin count as 'no fall with width' in the MLP-Attn claim (tested against the margin, never against 0).", rich_help_panel=PROTOCOL)] = 0.1,
    ) -> None:
        from attnaudit.audit.commands import shell_line
        from attnaudit.claims.scorecard import SCHEMA, plan, score
        from attnaudit.data import check_seed
        from attnaudit.report.envelope import build_report
        from attnaudit.runtime.sweep import CellTask, run_cells

        with cli_errors(out.debug):
            mode = _mode(preset, quick)
            opts = out.options()
            check_seed(seed, "--seed")
            executor = execution.config()
            executor.check_available()
            opts.check_writable((PNG_NAME,))
            data_args = _data_args(source, mode)
            if device != "auto":
                data_args += ["--device", device]
            if not (math.isfinite(slope_margin) and slope_margin >= 0):
                raise AuditError(f"--slope-margin must be a non-negative number, got {slope_margin}")
            runs, variants = plan(mode, data_args, seed, n_seeds=n_seeds, match_loss=_match_loss_value(match_loss))
            commands = {r.id: shell_line(r.command, list(r.args)) for r in runs}
            if not opts.quiet:
                opts.console.print(f"claims ({mode}): {len(runs)} runs on {' '.join(data_args)}, executor "
                                   f"{executor.name}", highlight=False)
            from attnaudit.audit.runner import _dry

            for r in runs:  # every command line checked (options and data) before anything trains
                _dry(r.command, list(r.args), f"{r.id} ({r.purpose})")
            t0 = time.perf_counter()
            tasks = [CellTask("attnaudit.audit.commands:run_cell", {"analysis": r.command, "args": list(r.args)}, r.id)
                     for r in runs]
            with progress(opts, "claims", len(tasks), "runs") as advance:
                outcomes = run_cells(tasks, executor, on_done=lambda o: advance(1))
            reports, errors, run_info = {}, {}, []
            for r, o in zip(runs, outcomes):
                if o.ok and "report" in o.result:
                    reports[r.id] = o.result["report"]
                else:
                    errors[r.id] = o.error if not o.ok else o.result.get("error")
                    reports[r.id] = None
                run_info.append({"id": r.id, "purpose": r.purpose, "command": commands[r.id], "seconds": o.seconds,
                                 "error": errors.get(r.id), "report": reports[r.id]})
            result = score(mode, reports, errors, commands, variants, slope_margin=slope_margin)
            result.runs = run_info
            result.protocol = {"n_seeds": n_seeds, "seeds": list(range(seed, seed + n_seeds)), "match_loss": match_loss,
                               "slope_margin": slope_margin, "confidence": 0.95}
            result.warnings = [f"{rid}: {err}" for rid, err in errors.items()]
            for rid, rep in reports.items():  # every sub-run's warnings reach the scorecard, named by run
                for w in (rep or {}).get("warnings") or []:
                    result.warnings.append(f"{rid}: {w}")
            report = build_report(
                SCHEMA,
                inputs={"mode": mode, "data": data_args, "seed": seed, "n_seeds": n_seeds, "match_loss": match_loss,
                        "slope_margin": slope_margin, "execution": executor.to_dict()},
                seeds={"base_seed": seed, "n_seeds": n_seeds, "runs": {r.id: list(range(seed, seed + n_seeds))
                                                                       if "--seeds" in r.args else [seed] for r in runs}},
                device=None,
                dtype="as each run records",
                timings={"total": time.perf_counter() - t0, **{f"run:{x['id']}": x["seconds"] for x in run_info}},
                results=result.to_dict(),
                warnings=result.warnings,
                verdicts=result.verdicts(),
            )
            emit(opts, report, _tables(result), plot=lambda p: _plot(result, p), png_name=PNG_NAME)
        if errors:
            raise typer.Exit(1)


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
        claims.add_row(c.claim, null, f"{c.measured}\n({c.interval_method})", str(c.n_seeds),
                       Text(c.verdict, style=style[c.verdict]), why)
    variants = Table(title="Malleability under protocol variants (attn / relu flip-rate ratio, Fieller interval)",
                     title_justify="left")
    for col in ("variant", "flip relu", "flip attn", "ratio [interval]", "beats noise (relu / attn)", "losses comparable",
                "reading"):
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
        variants.add_row(v.variant, pct(v.flip_relu), pct(v.flip_attn), ratio, beats,
                         {True: "yes", False: "no", None: "-"}[v.losses_comparable], v.reading)
    lines = [claims, variants]
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
