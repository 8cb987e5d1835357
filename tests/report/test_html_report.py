"""Self-contained HTML reports (--html on every command and the audit; `attnaudit report`).

Every page is parsed with the standard library's html.parser: it must hold every verdict
and every number of its JSON report's summary (compared with the JSON written by the same
run), embed its figure, and reference nothing outside the file. User strings are escaped.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import run_cli
import yaml

from attnaudit.report.html import flatten, summary_of

TINY = {
    "kappa": ["--n", "200"],
    "ntk-distance": [
        "--n-train",
        "40",
        "--n-test",
        "20",
        "--widths",
        "8,16",
        "--seeds",
        "1",
        "--steps",
        "5",
        "--models",
        "relu",
    ],
    "malleability": [
        "--models",
        "relu",
        "--attacks",
        "pgd",
        "--eps",
        "0.1",
        "--n-train",
        "40",
        "--n-test",
        "20",
        "--width",
        "8",
        "--steps",
        "10",
        "--top-k",
        "10",
        "--pgd-steps",
        "2",
        "--seeds",
        "2",
        "--no-controls",
    ],
    "landscape": [
        "--n-train",
        "40",
        "--eigenvalues",
        "1",
        "--hutchinson-samples",
        "2",
        "--points",
        "0",
        "--grid",
        "0",
        "--basin-directions",
        "1",
    ],
}


cli = run_cli


class Page(HTMLParser):
    """Text, image sources and every URL-bearing attribute of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.images: list[str] = []
        self.urls: list[tuple[str, str, str]] = []
        self.tags: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id":
                self.ids.add(value or "")
            if name in ("src", "href", "action", "data", "poster", "srcset") and value is not None:
                self.urls.append((tag, name, value))
                if tag == "img" and name == "src":
                    self.images.append(value)

    def handle_data(self, data):
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def assert_self_contained(page: Page) -> None:
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    for tag, attr, url in page.urls:
        assert url.startswith("#") or url.startswith("data:image/png;base64,"), (tag, attr, url[:60])


def assert_png(src: str) -> None:
    data = base64.b64decode(src.split(",", 1)[1])
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def assert_holds_report(page: Page, report: dict) -> None:
    text = page.all_text
    assert report["verdicts"] or report["warnings"] or True
    for line in report["verdicts"] + report["warnings"]:
        assert line in text, line[:80]
    leaves = flatten(summary_of(report))
    assert leaves
    for path, value in leaves:
        assert path in text, path
        assert json.dumps(value, ensure_ascii=False) in text, (path, value)


@pytest.mark.parametrize("command", list(TINY))
def test_every_command_writes_a_self_contained_page_holding_its_report(tmp_path, command):
    html, js = tmp_path / "r.html", tmp_path / "r.json"
    assert cli("--threads", "1", command, *TINY[command], "-q", "--json", js, "--html", html) == 0
    report = json.loads(js.read_text())
    page = parse(html)
    assert_self_contained(page)
    assert_holds_report(page, report)
    assert len(page.images) == 1
    assert_png(page.images[0])
    text = page.all_text
    # verdicts come first: the Verdicts heading precedes the tables, figures, numbers and protocol
    order = [text.index(h) for h in ("Verdicts", "Warnings", "Tables", "Figures", "Summary", "Protocol", "Reproduce")]
    assert order == sorted(order)
    assert f"attnaudit {command}" in text  # the command that reproduces the run (derived from its request)
    assert report["command"].startswith(f"attnaudit {command}") and report["environment"]["torch_threads"] == 1
    fingerprints = [v for k, v in flatten(report["results"]["dataset"]) if k.endswith("indices_sha256")]
    assert fingerprints and all(f in text for f in fingerprints)  # data fingerprint


def test_out_dir_holds_report_html_and_existing_pages_are_not_overwritten(tmp_path):
    out = tmp_path / "run"
    assert cli("--threads", "1", "kappa", *TINY["kappa"], "-q", "--out-dir", out) == 0
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.html", "kappa.png"}
    before = (out / "report.html").read_bytes()
    assert cli("--threads", "1", "kappa", *TINY["kappa"], "-q", "--out-dir", out) == 2
    assert (out / "report.html").read_bytes() == before
    assert cli("--threads", "1", "kappa", *TINY["kappa"], "-q", "--html", tmp_path / "page.txt") == 2


def test_a_hostile_data_set_name_and_path_are_escaped(tmp_path):
    import numpy as np

    folder = tmp_path / "<script>alert(1)"  # no '/': a path separator
    folder.mkdir()
    rng = np.random.default_rng(0)
    data = folder / "<img src=x onerror=alert(2)>.npz"
    np.savez(data, X=rng.uniform(size=(60, 6)), y=rng.integers(0, 3, size=60))
    html = tmp_path / "r.html"
    assert cli("--threads", "1", "kappa", "--data", data, "-q", "--html", html) == 0
    raw = html.read_text(encoding="utf-8")
    assert "<script>" not in raw and "<img src=x" not in raw
    page = parse(html)
    assert "script" not in page.tags
    assert sum(t == "img" for t in page.tags) == 1  # only the embedded figure
    assert "<script>alert(1)" in page.all_text and "<img src=x onerror=alert(2)>" in page.all_text  # shown as text
    assert_self_contained(page)


def test_report_command_renders_two_runs_without_recomputing_and_refuses_unknown_schemas(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert cli("--threads", "1", "kappa", *TINY["kappa"], "-q", "--json", a) == 0
    assert cli("--threads", "1", "kappa", "--n", "150", "-q", "--json", b) == 0
    out = tmp_path / "both.html"
    assert cli("report", a, b, "--html", out, "-q") == 0
    page = parse(out)
    assert_self_contained(page)
    for path in (a, b):
        assert_holds_report(page, json.loads(path.read_text()))
    assert {"run-0", "run-1"} <= page.ids
    assert "a.json" in page.all_text and "b.json" in page.all_text
    bad = tmp_path / "future.json"
    bad.write_text(json.dumps({"schema": "attnaudit.kappa/99", "results": {}}))
    assert cli("report", bad, "--html", tmp_path / "x.html") == 2
    assert not (tmp_path / "x.html").exists()
    (tmp_path / "junk.json").write_text("{not json")
    assert cli("report", tmp_path / "junk.json", "--html", tmp_path / "y.html") == 2
    assert cli("report", a, "--html", out) == 2  # exists: not overwritten without --overwrite


def test_audit_page_has_one_row_per_check_linking_to_its_section(tmp_path):
    doc = {
        "version": 1,
        "name": "html <audit>",
        "seed": 0,
        "data": {"dataset": "digits"},
        "checks": [
            {
                "name": "kappa finite",
                "analysis": "kappa",
                "options": {"n": 200},
                "metric": "log10_kappa_at_rank",
                "max": 100,
            },
            {
                "name": "kappa too strict",
                "analysis": "kappa",
                "options": {"n": 200},
                "metric": "log10_kappa_at_rank",
                "max": 0.5,
            },
        ],
    }
    path = tmp_path / "audit.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    html, js = tmp_path / "a.html", tmp_path / "a.json"
    code = cli("--threads", "1", "audit", path, "-q", "--html", html, "--json", js)
    report = json.loads(js.read_text())
    assert code == 1  # one check fails
    page = parse(html)
    assert_self_contained(page)
    text = page.all_text
    for line in report["verdicts"]:
        assert line in text
    hrefs = [url for tag, attr, url in page.urls if tag == "a"]
    for i, check in enumerate(report["results"]["checks"]):
        assert f"#check-{i}" in hrefs and f"check-{i}" in page.ids
        assert check["status"].upper() in text and json.dumps(check["value"]) in text
    assert "html <audit>" in text and "<audit>" not in html.read_text().replace("&lt;audit&gt;", "")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


# In CI (.ci/run installs Chromium) a missing browser is a failure, never a silent skip.
@pytest.mark.skipif(
    _chromium() is None and not os.environ.get("CI"),
    reason="no headless Chromium on this machine (apt-get install chromium)",
)
@pytest.mark.parametrize("command", list(TINY))
def test_a_real_browser_renders_each_page(tmp_path, command):
    """Headless Chromium draws the page: a screenshot that is not blank, and no console errors."""
    assert _chromium() is not None, "CI runs the browser test: .ci/run should have installed chromium"
    html = tmp_path / "r.html"
    assert cli("--threads", "1", command, *TINY[command], "-q", "--html", html) == 0
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={shot}",
            "--window-size=1280,2000",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Chromium logs every console message as "...:INFO:CONSOLE:<line>] ..." (an uncaught error included)
    assert re.search(r"CONSOLE[:(]|Uncaught", proc.stderr) is None, proc.stderr[-2000:]
    from PIL import Image  # matplotlib depends on pillow

    img = Image.open(shot).convert("L")
    lo, hi = img.getextrema()
    assert hi - lo > 100  # not a blank page
