"""`attnaudit report RUN.json [...] --html out.html`: render existing JSON reports into one
self-contained HTML page, without recomputing anything (see :mod:`attnaudit.report.html`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnaudit.cli.common import Debug, cli_errors, path_option, switch
from attnaudit.cli.options import ManualCommand
from attnaudit.errors import AuditError
from attnaudit.report.html import check_schema
from attnaudit.report.envelope import read_json_file
from attnaudit.runtime.atomic import write_text_atomic
from attnaudit.report.html import render_reports
from attnaudit.report.envelope import check_target

HELP = (
    "Render one or several JSON reports written by --json (a sweep's runs, two checkpoints, an audit) into one "
    "self-contained HTML page: verdicts first, then the summaries, the protocol and the command of each run. "
    "Nothing is recomputed, so figures (not stored in JSON) are absent; --html on the command itself embeds them. "
    "A report of an unknown schema is refused (exit 2)."
)

EPILOG = "Example: attnaudit kappa --json k.json && attnaudit report k.json --html k.html"

MAX_REPORT_BYTES = 512 * 2**20  # a JSON report is a few MB at most; refuse absurd inputs before reading them


def load_reports(paths: list[str]) -> list[tuple[str, dict]]:
    """(file name, report) for every path, each a JSON report of a known schema."""

    out = []
    for raw in paths:
        report = read_json_file(raw, raw, "give JSON reports written by --json", MAX_REPORT_BYTES)
        out.append((Path(raw).name, check_schema(report, raw)))
    return out


def register(app: typer.Typer) -> None:
    @app.command("report", help=HELP, epilog=EPILOG, cls=ManualCommand)
    def report_command(
        reports: Annotated[
            list[str],
            typer.Argument(
                help="JSON reports written by --json (one or more).", show_default=False, metavar="RUN.json"
            ),
        ],
        html: Annotated[str, path_option("--html", "Write the HTML page here.")],
        overwrite: Annotated[bool, switch("--overwrite", "Allow replacing an existing file.")] = False,
        quiet: Annotated[bool, switch("--quiet", "Print nothing on success.", short="-q")] = False,
        debug: Debug = False,
    ) -> None:

        with cli_errors(debug):
            if not html.lower().endswith((".html", ".htm")):
                raise AuditError(f"--html {html}: the report is an HTML page; give a path ending in .html")
            check_target(html, overwrite)
            loaded = load_reports(reports)
            write_text_atomic(html, render_reports(loaded))
            if not quiet:
                typer.echo(f"HTML report of {len(loaded)} run(s) written to {html}")
