"""User-facing errors.

``AuditError`` is the one exception type the CLI turns into a one-line message and exit
code 2 (no traceback unless ``--debug``). Raise it for anything the user can fix: a bad
option, a missing file, unusable data. The message should name the problem and the fix.
"""

from __future__ import annotations


class AuditError(Exception):
    """A problem with the user's input; the message names the problem and the fix."""

    exit_code = 2
