"""Compatibility module: the landscape's presentation now lives in :mod:`attnaudit.landscape.report`
(table, figure) and :mod:`attnaudit.landscape.compare` (verdicts and warnings)."""

from attnaudit.landscape.compare import EOS_SHARE, LOSS_MISMATCH_RATIO, compare_landscapes, loss_mismatch_warning
from attnaudit.landscape.report import PNG_NAME, SCHEMA, build_tables, plot_landscape

__all__ = [
    "EOS_SHARE", "LOSS_MISMATCH_RATIO", "PNG_NAME", "SCHEMA", "build_tables", "compare_landscapes",
    "loss_mismatch_warning", "plot_landscape",
]
