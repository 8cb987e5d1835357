"""`attnaudit claims`: thin CLI over :mod:`attnaudit.claims` (the paper's claims scorecard)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from ..cli_common import DeviceOpt, SeedOpt, cli_errors, emit, progress
from ..cli_options import PROTOCOL, DataOptions, ExecutorOptions, ManualCommand, OutputBundle, bundled

PNG_NAME = "claims.png"
HELP = (
    "Test the paper's claims on one data set: runs kappa, ntk-distance, malleability and landscape with documented "
    "protocols (the commands' quick or paper presets) and prints one verdict per claim (supported / contradicted / "
    "not resolved / not testable here, with why), plus the malleability comparison under protocol variants. "
    "--quick: digits, a few minutes; --full: MNIST-size presets (under an hour on 2 cores with --jobs 2)."
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


def register(app: typer.Typer) -> None:
    @app.command("claims", help=HELP, cls=ManualCommand, epilog="Example: attnaudit claims --quick --json claims.json")
    @bundled(source=DataOptions.defaults(dataset=None, split=None), out=OutputBundle, execution=ExecutorOptions)
    def claims_command(
        source: DataOptions,
        out: OutputBundle,
        execution: ExecutorOptions,
        quick: Annotated[bool, typer.Option("--quick/--full", help="--quick (default): the commands' quick presets on digits; --full: their paper presets (MNIST-size).", rich_help_panel=PROTOCOL)] = True,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        from ..audit.commands import shell_line
        from ..claims import SCHEMA, plan, score
        from ..data import check_seed
        from ..report import build_report
        from ..sweep import CellTask, run_cells

        with cli_errors(out.debug):
            mode = "quick" if quick else "full"
            opts = out.options()
            check_seed(seed, "--seed")
            executor = execution.config()
            executor.check_available()
            opts.check_writable((PNG_NAME,))
            data_args = _data_args(source, mode)
            if device != "auto":
                data_args += ["--device", device]
            runs, variants = plan(mode, data_args, seed)
            commands = {r.id: shell_line(r.command, list(r.args)) for r in runs}
            if not opts.quiet:
                opts.console.print(f"claims ({mode}): {len(runs)} runs on {' '.join(data_args)}, executor "
                                   f"{executor.name}", highlight=False)
            from ..audit.runner import _dry

            for r in runs:  # every command line checked (options and data) before anything trains
                _dry(r.command, list(r.args), f"{r.id} ({r.purpose})")
            t0 = time.perf_counter()
            tasks = [CellTask("attnaudit.audit.commands:run_cell", {"analysis": r.command, "args": list(r.args)}, r.id)
                     for r in runs]
            with progress(opts, "claims", len(tasks)) as advance:
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
            result = score(mode, reports, errors, commands, variants)
            result.runs = run_info
            result.warnings = [f"{rid}: {err}" for rid, err in errors.items()]
            report = build_report(
                SCHEMA,
                inputs={"mode": mode, "data": data_args, "seed": seed, "execution": executor.to_dict()},
                seeds={"base_seed": seed, "runs": {r.id: seed for r in runs}},
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
    for col in ("claim", "paper", "measured", "verdict", "why"):
        claims.add_column(col, overflow="fold")
    for c in result.claims:
        claims.add_row(c.claim, c.paper, c.measured, Text(c.verdict, style=style[c.verdict]), c.why)
    variants = Table(title="Malleability under protocol variants (attn / relu flip-rate ratio)", title_justify="left")
    for col in ("variant", "flip relu", "flip attn", "ratio [interval]", "beats noise (relu / attn)", "reading"):
        variants.add_column(col)

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f} %"

    for v in result.variants:
        if v.error:
            variants.add_row(v.variant, "", "", "", "", Text(f"failed: {v.error}", style="red"))
            continue
        iv = v.interval or [None, None]
        ratio = "n/a" if v.ratio is None else f"{v.ratio:.2f} [{'n/a' if iv[0] is None else f'{iv[0]:.2f}'}, " \
                                              f"{'n/a' if iv[1] is None else f'{iv[1]:.2f}'}]"
        beats = " / ".join({True: "yes", False: "no", None: "-"}[v.above_floor.get(m)] for m in ("relu", "attn"))
        variants.add_row(v.variant, pct(v.flip_relu), pct(v.flip_attn), ratio, beats, v.reading)
    lines = [claims, variants]
    lines += [Text(line) for line in result.verdicts()[:1]]
    lines += [Text("commands that reproduce each row:")] + [Text(f"  {r['id']}: {r['command']}") for r in result.runs]
    return lines


def _plot(result, path) -> None:
    import matplotlib.pyplot as plt

    rows = [v for v in result.variants if v.ratio is not None and v.interval and None not in v.interval]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.5 * max(1, len(rows))))
    for i, v in enumerate(rows):
        ax.errorbar([v.ratio], [i], xerr=[[v.ratio - v.interval[0]], [v.interval[1] - v.ratio]], fmt="o", capsize=4,
                    color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvspan(2, 9, color="tab:red", alpha=0.1, label="paper: 2-9x")
    ax.set_yticks(range(len(rows)), [v.variant for v in rows])
    ax.set_xlabel("flip-rate ratio attn / relu (bootstrap interval)")
    ax.set_title(f"Malleability ratio across protocol choices ({result.mode})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
