"""Progress bars on a terminal: a bar opened inside a run's bar (the gradient store's rows inside
malleability's trainings) joins it as a second line instead of failing (rich allows one live
display at a time), and a store build reports its new rows to the run's progress."""

from __future__ import annotations

import io

from rich.console import Console

from attnaudit.analyses.influence.store import build_progress, reporting
from attnaudit.cli.common import OutputOptions


def _terminal_options(monkeypatch) -> tuple[OutputOptions, io.StringIO]:
    monkeypatch.delenv("CI", raising=False)
    opts = OutputOptions()
    sink = io.StringIO()
    opts.console = Console(file=sink, force_terminal=True, width=120)
    return opts, sink


def test_a_bar_inside_a_bar_joins_it(monkeypatch):
    opts, sink = _terminal_options(monkeypatch)
    with opts.progress_bar("outer", 3, "cells") as outer:
        outer(1)
        with opts.progress_bar("inner", 5) as inner:
            inner(5)
        outer(2)
    with opts.progress_bar("after", 1) as again:  # the outer bar closed: a new one opens
        again(1)
    text = sink.getvalue()
    assert "outer" in text and "inner" in text and "after" in text


def test_a_store_build_reports_its_rows_to_the_runs_progress():
    calls: list = []

    class Recorder:
        def __init__(self, label, total, unit):
            calls.append(("open", label, total))

        def __enter__(self):
            return lambda k=1: calls.append(("advance", k))

        def __exit__(self, *exc):
            calls.append(("close",))

    with build_progress(10, 1 << 20) as silent:  # outside reporting(): nothing is told
        silent(10)
    assert calls == []
    with reporting(Recorder):
        with build_progress(2048, 3 << 20) as advance:
            advance(1024)
            advance(1024)
    assert (
        calls[0][0] == "open" and calls[0][2] == 2048 and "2,048 new rows" in calls[0][1] and "3.0 MiB" in calls[0][1]
    )
    assert calls[1:] == [("advance", 1024), ("advance", 1024), ("close",)]
