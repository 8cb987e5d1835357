"""User-facing errors.

``AuditError`` is the one exception type the CLI turns into a one-line message and exit
code 2 (no traceback unless ``--debug``). Raise it for anything the user can fix: a bad
option, a missing file, unusable data. The message should name the problem and the fix.
"""

from __future__ import annotations

import numbers
from typing import Any

MAX_SEED = 2**32 - 1  # numpy/torch seeds beyond this are refused rather than silently folded


class AuditError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""

    exit_code = 2


def clip_text(text: object, limit: int = 160) -> str:
    """``str(text)`` on one line (runs of white space become one space), cut to at most
    ``limit`` characters with an ellipsis marking the cut: for echoing user input in a
    one-line error message. Never raises (an int too large to print becomes a placeholder)."""
    try:
        text = str(text)
    except ValueError:  # an int of more than 4300 digits cannot be printed
        text = f"<{type(text).__name__} too large to print>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "\u2026"


def name_list(items, limit: int = 4) -> str:
    """The first ``limit`` names joined by commas, then "and N more"."""
    items = [str(x) for x in items]
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def show_value(value: object, limit: int = 60) -> str:
    """``repr(value)`` clipped like :func:`clip_text` (and safe for ints too large to print)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__} too large to print>"
    return clip_text(text, limit)


def key_mismatch(missing: list, unexpected: list) -> str:
    """ "N missing key(s) (a, b ...); M unexpected key(s) (...)" for a state dict that does not fit."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) ({name_list(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({name_list(unexpected)})")
    return "; ".join(parts)


def is_int(value: Any) -> bool:
    """An integer (numpy integers included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (ints and numpy floats included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_seed(value: Any, option: str = "--seed", count: int = 1) -> None:
    """Refuse a seed unless ``value``, ``value + 1``, ..., ``value + count - 1`` all lie in 0..MAX_SEED.

    ``count`` is how many consecutive seeds will be used (e.g. ``--seeds``). Raises
    :class:`AuditError` naming ``option`` and the allowed range.
    """
    count = int(count) if is_int(count) and count > 1 else 1
    top = MAX_SEED - count + 1
    if top < 0:
        raise AuditError(f"{count} consecutive seeds do not fit in 0..{MAX_SEED}; use fewer seeds")
    if not is_int(value) or not 0 <= value <= top:
        raise AuditError(f"{option} must be an integer in 0..{top}, got {clip_text(value, 80)}")
