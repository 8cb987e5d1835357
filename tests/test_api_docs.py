"""docs/api.md runs as written: every ```python block, in order, in one namespace."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_page_has_an_example_for_every_command():
    text = DOC.read_text(encoding="utf-8")
    for request in (
        "KappaRequest",
        "NtkDistanceRequest",
        "MalleabilityRequest",
        "LandscapeRequest",
        "TrainRequest",
        "AuditRequest",
        "ClaimsRequest",
    ):
        assert request in text, request


def test_every_python_block_runs(monkeypatch, capsys):
    monkeypatch.chdir(DOC.parents[1])  # the page's relative paths (examples/...) are from the repository root
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    namespace: dict = {"__name__": "api_docs"}
    blocks = _blocks()
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/api.md block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as exc:  # noqa: BLE001 - name the block that broke
            pytest.fail(f"docs/api.md block {i + 1} raised {type(exc).__name__}: {exc}\n{block}")
    out = capsys.readouterr().out
    assert "seeds must be >= 1, got 0" in out
