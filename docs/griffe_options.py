"""Griffe extension for the API reference: a request field's documentation is its option.

A request field is declared as ``name: type = option(default, "--flag", help="...", ...)``
(attnaudit.analyses.request). Read statically, the attribute has no docstring and its value
is the whole ``option(...)`` call. This extension makes the field's docstring its flags and
help text, and its value the default, so the reference lists every field the way ``--help``
does. ``redefault(Owner, "name", default, help=...)`` is shown the same way.
"""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


def _literal(node: ast.expr | None) -> str | None:
    """The text of a string literal (adjacent literals are one constant already)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if left is not None and right is not None:
            return left + right
    return None


class RequestOptions(Extension):
    """Document ``option(...)`` and ``redefault(...)`` fields from their arguments."""

    def on_attribute_instance(self, *, node: ast.AST | Any, attr: Attribute, **kwargs: Any) -> None:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.value, ast.Call):
            return
        call = node.value
        name = call.func.id if isinstance(call.func, ast.Name) else None
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        help_text = _literal(keywords.get("help"))
        if name == "option" and call.args:
            flags = [f"`{_literal(a)}`" for a in call.args[1:] if _literal(a)]
            default = call.args[0]
            text = (", ".join(flags) + ": " if flags else "") + (help_text or "")
        elif name == "redefault" and len(call.args) >= 2:
            owner = ast.unparse(call.args[0])
            default = call.args[2] if len(call.args) > 2 else None
            text = help_text or f"The option of `{owner}`, with this request's default."
        else:
            return
        attr.docstring = Docstring(text, parent=attr)
        attr.value = ast.unparse(default) if default is not None else None  # None: the owner's default
