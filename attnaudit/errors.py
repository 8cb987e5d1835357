"""User-facing errors.

``AuditError`` is the one exception type the CLI turns into a one-line message and exit
code 2 (no traceback unless ``--debug``). Raise it for anything the user can fix: a bad
option, a missing file, unusable data. The message should name the problem and the fix.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

MAX_SEED = 2**32 - 1  # numpy/torch seeds beyond this are refused rather than silently folded


class AuditError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""

    exit_code = 2


class FieldError(AuditError):
    """A value of one named field (a request field, an option) that the library refuses.

    ``template`` names the field as ``{name}``; :meth:`named` renders it for the spelling
    the caller used (the field name from Python, the flag on the command line, the option
    key in an audit file). Raised by any layer: the CLI and the audit runner rename it.
    """

    def __init__(self, field_name: str, template: str) -> None:
        self.field = field_name
        self.template = template
        super().__init__(template.format(name=field_name))

    def named(self, name: str) -> AuditError:
        """The same error, naming the field as ``name`` (e.g. ``--seeds``)."""
        return AuditError(self.template.format(name=name))


def literal(text: Any) -> str:
    """``text`` inside a :class:`FieldError` template (its braces kept literally)."""
    return str(text).replace("{", "{{").replace("}", "}}")


_MARK = "\x00name\x00"


def field_check(field_name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a check that names its option in the message (``check(..., option)``: the option's
    spelling as its last positional argument) and turn its :class:`AuditError` into a
    :class:`FieldError` on ``field_name``."""
    try:
        return check(*args, _MARK, **kwargs)
    except FieldError:
        raise
    except AuditError as exc:
        raise FieldError(field_name, literal(exc).replace(_MARK, "{name}")) from None


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


def short_list(values: Any, limit: int = 10, sep: str = ", ") -> str:
    """The first ``limit`` values (each clipped to 40 characters) joined by ``sep``, then
    ``\u2026 (N more)`` when there are more: for listing user values in a one-line message."""
    items = [clip_text(v, 40) for v in values]
    if len(items) <= limit:
        return sep.join(items)
    return sep.join(items[:limit]) + f"{sep}\u2026 ({len(items) - limit} more)"


def one_line(exc: BaseException) -> str:
    """``"TypeName: message"`` of an exception on one line (just the type name when it has no message)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
