"""What ``run(request)`` returns: the report, its tables and its figure, and progress reporting.

A :class:`Result` carries the JSON envelope every command writes (``to_dict()``; schema,
inputs, seeds, results, verdicts, timings), the request it answers, the rich tables of its
terminal output and the figure. ``Result.from_dict(report)`` restores a result from a saved
report: its numbers, verdicts and request come back; the tables and figure of a restored
result are a table of its verdicts (the rich tables are drawn from the analysis objects a
run holds), and its figure needs a re-run.

Progress: ``run`` takes ``progress(label, total, unit)``, a context manager that yields an
``advance(k)`` callable (the CLI passes a rich progress bar); None means silence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager
from attnaudit.errors import AuditError
from attnaudit.analyses.request import request_from_report

Progress = Callable[[str, int, str], ContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def silent(label: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
    """The progress of a run nobody watches."""

    def advance(k: int = 1) -> None:
        pass

    yield advance


def progress_or_silent(progress: Progress | None) -> Progress:
    return progress if progress is not None else silent


@dataclass
class Result:
    """The answer of one run: the report (JSON envelope), its request, tables and figure."""

    report: dict
    request: Any = None
    renderables: list | None = field(default=None, repr=False)
    plot: Callable[[Path], None] | None = field(default=None, repr=False)
    png_name: str = "figure.png"
    failed_cells: list = field(default_factory=list, repr=False)

    # ---- what a caller reads
    @property
    def schema(self) -> str:
        return str(self.report.get("schema", ""))

    @property
    def results(self) -> dict:
        """The analysis's numbers (the report's ``results``)."""
        return self.report.get("results") or {}

    @property
    def verdicts(self) -> list[str]:
        """The verdicts, one sentence each."""
        return list(self.report.get("verdicts") or [])

    @property
    def seeds(self) -> dict:
        return self.report.get("seeds") or {}

    def tables(self) -> list:
        """The rich tables of the terminal output."""
        if self.renderables is not None:
            return list(self.renderables)
        return [_verdict_table(self.report)]  # a restored result: its verdicts (the numbers are in results)

    def figure(self, path: str | Path) -> Path:
        """Write the figure (PNG) to ``path``; a restored result has none to draw."""
        if self.plot is None:
            raise AuditError(
                "this result has no figure (a result restored from a report keeps numbers, "
                "not the arrays a figure is drawn from); run the request again"
            )
        import matplotlib

        matplotlib.use("Agg")
        target = Path(path)
        self.plot(target)
        return target

    # ---- round trip
    def to_dict(self) -> dict:
        """The JSON envelope (what ``--json`` writes)."""
        return self.report

    @classmethod
    def from_dict(cls, report: dict) -> Result:
        """A result from a saved report (its request rebuilt when the report records one)."""

        return cls(report=dict(report), request=request_from_report(report))


def _verdict_table(report: dict) -> Any:
    from rich.table import Table

    table = Table(title=f"{report.get('schema', 'report')}: verdicts")
    table.add_column("verdict")
    for v in report.get("verdicts") or []:
        table.add_row(str(v))
    return table
