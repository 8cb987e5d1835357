"""Self-contained HTML reports: one page per run (or per audit), readable by people who did not run it.

A page opens with the verdicts and warnings, then the tables the terminal showed, the
figures, the summary (every number of the JSON report's summary at full precision, folded in
a ``<details>`` element), the protocol (every recorded input, the seeds, the data fingerprint, the environment) and the
command that reproduces the run. Everything is inside the file: figures are PNGs embedded as
``data:`` URIs, the style sheet is inline, there are no scripts, fonts or links outside the
page. Every string that came from the user or the data (data-set names, paths, options) is
HTML-escaped, so a name like ``<script>`` shows as text.

The same renderer serves ``--html`` on every command (:func:`render_run`, called by
:func:`attnaudit.cli.common.emit`), the audit (:func:`render_audit`: one row per check with
pass / fail, value and threshold, each linking to its section) and ``attnaudit report``
(:func:`render_reports`: existing JSON reports, nothing recomputed).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from attnaudit.errors import AuditError

#: The report schemas a page can be rendered from (``attnaudit report`` refuses others).
KNOWN_SCHEMAS = (
    "attnaudit.kappa/1",
    "attnaudit.kappa-layers/1",
    "attnaudit.ntk-distance/1",
    "attnaudit.ntk-checkpoint/1",
    "attnaudit.ntk-transformers/1",
    "attnaudit.malleability/1",
    "attnaudit.landscape/1",
    "attnaudit.train/1",
    "attnaudit.audit/1",
    "attnaudit.claims/1",
    "attnaudit.claims/2",
    "attnaudit.claims/3",
    "attnaudit.alignment/1",
)

#: The fields of a claims row shown in the page's claims table, in order.
CLAIM_FIELDS = (
    "claim",
    "null",
    "alternative",
    "null_value",
    "measured",
    "interval",
    "interval_method",
    "confidence",
    "n_seeds",
    "per_seed",
    "p_value",
    "p_adjusted",
    "raw_verdict",
    "verdict",
    "seeds_needed",
    "why",
    "warnings",
    "command",
)

_STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:2em auto;max-width:78em;
padding:0 1em;color:#1d1d1f;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
h3{font-size:1.05em;margin-top:1.2em}.meta{color:#555;font-size:.92em}
ul.verdicts li{margin:.3em 0}ul.warnings li{margin:.3em 0;color:#8a4b00}
.none{color:#777;font-style:italic}
table.kv,table.checks{border-collapse:collapse;font-size:.9em;margin:.6em 0}
table.kv td,table.kv th,table.checks td,table.checks th{border:1px solid #ddd;padding:.25em .6em;text-align:left;
vertical-align:top}table.kv td.v{font-family:ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
th{background:#f4f4f6}.pass{color:#0a6b2d;font-weight:600}.fail{color:#b00020;font-weight:600}
.error{color:#b00020;font-weight:600}.skipped{color:#777;font-weight:600}
pre.rich{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.8em;line-height:1.25;overflow-x:auto;
background:#fafafa;border:1px solid #eee;padding:.6em}
pre.cmd{background:#f4f4f6;padding:.6em;overflow-x:auto}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}
nav a{margin-right:1em}
"""


@dataclass
class RunPage:
    """One run's page: its JSON report, the terminal's tables (rich renderables) and figures."""

    report: dict
    renderables: list = field(default_factory=list)
    figures: list[tuple[str, bytes]] = field(default_factory=list)  # (caption, PNG bytes)
    anchor: str = "run"
    title: str | None = None


def esc(value: Any) -> str:
    """HTML-escaped text of any value (quotes included)."""
    return html.escape(str(value), quote=True)


def _number(value: Any) -> str:
    """A JSON value as the JSON report writes it (full precision), escaped."""
    if isinstance(value, float) and not math.isfinite(value):
        return esc(value)
    return esc(json.dumps(value, ensure_ascii=False))


def flatten(value: Any, prefix: str = "", limit: int = 4000) -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a JSON value: ``a.b[2].c`` style paths, leaves in order."""
    out: list[tuple[str, Any]] = []

    def walk(v: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(v, dict):
            if not v:
                out.append((path, {}))
            for k, item in v.items():
                walk(item, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list):
            if not v:
                out.append((path, []))
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
        else:
            out.append((path, v))

    walk(value, prefix)
    return out


def _kv_table(pairs: Iterable[tuple[str, Any]], caption: str | None = None) -> str:
    rows = "".join(f'<tr><th>{esc(k)}</th><td class="v">{_number(v)}</td></tr>' for k, v in pairs)
    if not rows:
        return '<p class="none">(none recorded)</p>'
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return f'<table class="kv">{cap}{rows}</table>'


def rich_to_html(renderables: Sequence) -> str:
    """The tables a command printed, as escaped, inline-styled ``<pre>`` blocks (rich's export)."""
    if not renderables:
        return ""
    from rich.console import Console

    console = Console(
        record=True,
        width=160,
        file=io.StringIO(),
        highlight=False,
        markup=False,
        emoji=False,
        color_system="truecolor",
        force_terminal=True,
    )
    for item in renderables:
        console.print(item)
    return console.export_html(inline_styles=True, code_format='<pre class="rich">{code}</pre>')


def png_bytes(plot, name: str = "figure.png") -> bytes:
    """Run a command's plot callback (which writes a PNG to a path) and return the bytes."""
    import tempfile
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    with tempfile.TemporaryDirectory(prefix="attnaudit-html-") as tmp:
        path = Path(tmp) / name
        plot(path)
        return path.read_bytes()


def _figure(caption: str, data: bytes) -> str:
    src = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return f'<figure><img alt="{esc(caption)}" src="{src}"><figcaption>{esc(caption)}</figcaption></figure>'


def _list(items: Sequence[str], cls: str, empty: str) -> str:
    if not items:
        return f'<p class="none">{esc(empty)}</p>'
    return f'<ul class="{cls}">' + "".join(f"<li>{esc(v)}</li>" for v in items) + "</ul>"


def summary_of(report: dict) -> Any:
    """What a page shows as the summary: ``results.summary`` when the report has one, else the
    results without their long arrays (spectra, per-sample values: in the JSON)."""
    results = report.get("results", {})
    if isinstance(results, dict) and "summary" in results:
        return results["summary"]

    def trim(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: trim(x) for k, x in v.items()}
        if isinstance(v, list) and len(v) > 20 and all(not isinstance(x, (dict, list)) for x in v):
            return f"[{len(v)} values; see the JSON report]"
        if isinstance(v, list):
            return [trim(x) for x in v]
        return v

    return trim(results)


def command_of(report: dict) -> str | None:
    """The recorded command line that reproduces the run, if any."""
    env = report.get("environment") or {}
    return report.get("command") or env.get("command")


def _fingerprint(report: dict) -> list[tuple[str, Any]]:
    results = report.get("results", {})
    ds = results.get("dataset") if isinstance(results, dict) else None
    return flatten(ds) if isinstance(ds, dict) else []


def _run_sections(page: RunPage, level: int = 2) -> str:
    r = page.report
    h = f"h{level}"
    a = page.anchor
    parts = [
        f'<section id="{esc(a)}-verdicts"><{h}>Verdicts</{h}>',
        _list(r.get("verdicts", []), "verdicts", "No verdict recorded for this run."),
        f"<{h}>Warnings</{h}>",
        _list(r.get("warnings", []), "warnings", "No warnings."),
        "</section>",
    ]
    claim_rows = (
        (r.get("results") or {}).get("claims") if str(r.get("schema", "")).startswith("attnaudit.claims") else None
    )
    if claim_rows:
        parts += [
            f'<section id="{esc(a)}-claims"><{h}>Claims: null, interval, verdict</{h}>',
            _claims_table(claim_rows),
            "</section>",
        ]
    tables = rich_to_html(page.renderables)
    if tables:
        parts += [f'<section id="{esc(a)}-tables"><{h}>Tables</{h}>', tables, "</section>"]
    if page.figures:
        parts += [f'<section id="{esc(a)}-figures"><{h}>Figures</{h}>']
        parts += [_figure(c, d) for c, d in page.figures]
        parts += ["</section>"]
    parts += [
        f'<section id="{esc(a)}-summary"><{h}>Summary</{h}>',
        # folded when tables and figures already show the run; open on pages rendered from JSON alone
        f"<details{'' if (tables or page.figures) else ' open'}><summary>Every number of the report's summary, "
        "under its JSON path, as the JSON holds it</summary>",
        _kv_table(flatten(summary_of(r))),
        "</details></section>",
    ]
    parts += [
        f'<section id="{esc(a)}-protocol"><{h}>Protocol</{h}>',
        _kv_table(flatten(r.get("inputs", {})), "inputs (every recorded option)"),
        _kv_table(flatten(r.get("seeds", {})), "seeds"),
        _kv_table(_fingerprint(r), "data (fingerprint: indices_sha256)"),
        _kv_table(flatten(r.get("environment", {})), "environment"),
        _kv_table(flatten(r.get("timings_s", {})), "timings (s)"),
        "</section>",
        f'<section id="{esc(a)}-reproduce"><{h}>Reproduce</{h}>',
    ]
    cmd = command_of(r)
    parts.append(
        f'<pre class="cmd">{esc(cmd)}</pre>' if cmd else '<p class="none">The command line was not recorded.</p>'
    )
    parts.append("</section>")
    return "\n".join(parts)


def _claim_cell(key: str, value: Any) -> str:
    if key == "interval" and isinstance(value, list) and len(value) == 2:
        lo, hi = value
        return esc(f"[{'-inf' if lo is None else format(lo, '.4g')}, {'+inf' if hi is None else format(hi, '.4g')}]")
    if key == "per_seed" and isinstance(value, list):
        return _number(value)
    if key == "warnings" and isinstance(value, list):
        return "<br>".join(esc(w) for w in value) if value else '<span class="none">none</span>'
    if key in ("p_value", "p_adjusted") and isinstance(value, float):
        return esc(format(value, ".3g"))
    if key == "verdict":
        cls = {"supported": "pass", "contradicted": "fail"}.get(str(value), "skipped")
        return f'<span class="{cls}">{esc(value)}</span>'
    return esc("" if value is None else value)


def _claims_table(rows: Sequence[dict]) -> str:
    """Every claim row with its null, interval (null ends shown as unbounded), method, seeds and warnings."""
    head = "".join(f"<th>{esc(k)}</th>" for k in CLAIM_FIELDS)
    body = "".join(
        "<tr>" + "".join(f"<td>{_claim_cell(k, row.get(k))}</td>" for k in CLAIM_FIELDS) + "</tr>" for row in rows
    )
    return f'<table class="checks"><tr>{head}</tr>{body}</table>'


def _document(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
        f"<style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def _header(report: dict, title: str) -> str:
    meta = (
        f"schema {report.get('schema', '?')} · attnaudit {report.get('attnaudit_version', '?')} · "
        f"created {report.get('created', '?')}"
    )
    return f'<header><h1>{esc(title)}</h1><p class="meta">{esc(meta)}</p></header>'


def _title(report: dict) -> str:
    schema = str(report.get("schema", "attnaudit report"))
    name = schema.split(".", 1)[-1].split("/", 1)[0]
    return f"attnaudit {name} report"


def render_run(page: RunPage) -> str:
    """One run's page (``--html`` on a command); an audit report is rendered as an audit."""
    if page.report.get("schema") == "attnaudit.audit/1":
        return render_audit(page.report, page.renderables)
    title = page.title or _title(page.report)
    return _document(title, _header(page.report, title) + "\n" + _run_sections(page))


def _status_cell(status: str) -> str:
    cls = status if status in ("pass", "fail", "error", "skipped") else ""
    return f'<td class="{cls}">{esc(status.upper())}</td>'


def render_audit(report: dict, renderables: Sequence = ()) -> str:
    """An audit's page: verdicts, one row per check (status, value, threshold, link to its
    section), then each check's section with the run that served it."""
    results = report.get("results", {})
    checks = results.get("checks", [])
    runs = {str(run.get("id")): run for run in results.get("runs", [])}
    name = (results.get("file") or {}).get("name") or ""
    title = f"attnaudit audit report: {name}" if name else "attnaudit audit report"
    rows = []
    for i, c in enumerate(checks):
        threshold = ", ".join(f"{k} {c[k]}" for k in ("max", "min") if c.get(k) is not None) or "-"
        rows.append(
            f'<tr><td><a href="#check-{i}">{esc(c.get("name", f"check {i}"))}</a></td>{_status_cell(str(c.get("status", "?")))}'
            f"<td>{esc(c.get('analysis', ''))}</td><td>{esc(c.get('metric', ''))}</td>"
            f'<td class="v">{_number(c.get("value"))}</td><td>{esc(threshold)}</td><td>{esc(c.get("message", ""))}</td></tr>'
        )
    table = (
        (
            '<table class="checks"><tr><th>check</th><th>status</th><th>analysis</th><th>metric</th><th>value</th>'
            "<th>threshold</th><th>message</th></tr>" + "".join(rows) + "</table>"
        )
        if rows
        else '<p class="none">No checks.</p>'
    )
    body = [
        _header(report, title),
        '<section id="verdicts"><h2>Verdicts</h2>',
        _list(report.get("verdicts", []), "verdicts", "No verdict recorded."),
        "<h2>Warnings</h2>",
        _list(report.get("warnings", []), "warnings", "No warnings."),
        "</section>",
        f'<section id="checks"><h2>Checks</h2>{table}</section>',
    ]
    for i, c in enumerate(checks):
        body.append(f'<section id="check-{i}"><h2>Check: {esc(c.get("name", i))}</h2>')
        body.append(_kv_table([(k, v) for k, v in c.items() if not isinstance(v, (dict, list))]))
        run = runs.get(str(c.get("run")))
        if run is not None and isinstance(run.get("report"), dict):
            body.append(f"<h3>Run {esc(run.get('id'))}: {esc(run.get('command', ''))}</h3>")
            body.append(_run_sections(RunPage(run["report"], anchor=f"check-{i}-run"), level=3))
        body.append("</section>")
    tables = rich_to_html(renderables)
    if tables:
        body.append(f'<section id="tables"><h2>Tables</h2>{tables}</section>')
    body.append(
        f'<section id="protocol"><h2>Protocol</h2>{_kv_table(flatten(report.get("inputs", {})), "inputs")}'
        f"{_kv_table(flatten(report.get('environment', {})), 'environment')}</section>"
    )
    cmd = command_of(report)
    body.append(
        '<section id="reproduce"><h2>Reproduce</h2>'
        + (f'<pre class="cmd">{esc(cmd)}</pre>' if cmd else '<p class="none">The command line was not recorded.</p>')
        + "</section>"
    )
    return _document(title, "\n".join(body))


def check_schema(report: Any, source: str) -> dict:
    """The report, if it is a JSON object of a known schema; an :class:`AuditError` otherwise."""
    if not isinstance(report, dict) or "schema" not in report:
        raise AuditError(f"{source} is not an attnaudit JSON report (no 'schema' field); give a file written by --json")
    schema = report["schema"]
    if schema not in KNOWN_SCHEMAS:
        known = ", ".join(KNOWN_SCHEMAS)
        raise AuditError(f"{source} has schema {schema!r}, which this attnaudit cannot render; known: {known}")
    return report


def render_reports(reports: Sequence[tuple[str, dict]]) -> str:
    """One page for several existing reports (``attnaudit report``): a table of contents, then
    each run's sections; nothing is recomputed (figures are not stored in JSON)."""
    if len(reports) == 1 and reports[0][1].get("schema") == "attnaudit.audit/1":
        return render_audit(reports[0][1])
    title = "attnaudit report" + (f": {len(reports)} runs" if len(reports) > 1 else "")
    nav = "".join(f'<a href="#run-{i}">{esc(name)}</a>' for i, (name, _) in enumerate(reports))
    body = [
        f"<header><h1>{esc(title)}</h1><nav>{nav}</nav>"
        '<p class="meta">Rendered from the JSON reports named below; nothing was recomputed, so the '
        "figures (not stored in JSON) are absent: rerun a command with --html to embed them.</p></header>"
    ]
    for i, (name, report) in enumerate(reports):
        body.append(f'<section id="run-{i}"><h2>{esc(name)} — {esc(_title(report))}</h2>')
        body.append(f'<p class="meta">{esc(report.get("schema"))} · created {esc(report.get("created", "?"))}</p>')
        if report.get("schema") == "attnaudit.audit/1":
            res = report.get("results", {})
            body.append(
                _kv_table(
                    [
                        (c.get("name"), f"{str(c.get('status', '?')).upper()}: {c.get('value')}")
                        for c in res.get("checks", [])
                    ],
                    "checks",
                )
            )
        body.append(_run_sections(RunPage(report, anchor=f"run-{i}"), level=3))
        body.append("</section>")
    return _document(title, "\n".join(body))
