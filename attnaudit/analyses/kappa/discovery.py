"""Which modules of a model are its attention layers (`attnaudit kappa --checkpoint`).

* :class:`attnaudit.models.vit.Attention` (built-in ``vit`` / ``vit-linear``);
* :class:`torch.nn.MultiheadAttention`;
* any other module whose class name ends in ``Attention`` (``SelfAttention`` included,
  ``CrossAttention`` excluded) and that owns query and key projections as direct children
  (``q``/``k``, ``q_proj``/``k_proj``, ``query``/``key``, ``q_lin``/``k_lin``, ``to_q``/
  ``to_k``, ``wq``/``wk``) or a fused one (``qkv``, ``in_proj``, ``c_attn``, ``Wqkv``,
  ``query_key_value``): Hugging Face's ``ViTAttention``, ``BertSelfAttention``, ...

A module nested inside another match is skipped (the outer one is the layer). Glob
patterns on module names (the request's ``layers``) override the detection.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError
from attnaudit.models.vit import Attention

_QK_PAIRS = (("q", "k"), ("q_proj", "k_proj"), ("query", "key"), ("q_lin", "k_lin"), ("to_q", "to_k"), ("wq", "wk"))
_FUSED = ("qkv", "in_proj", "c_attn", "Wqkv", "query_key_value", "qkv_proj")


@dataclass(frozen=True)
class AttentionLayer:
    """One layer to analyse: its module name, the module and how it was recognised.

    ``kind``: ``builtin`` (attnaudit.models.vit.Attention), ``multihead`` (torch.nn.MultiheadAttention),
    ``projections`` (a ``*Attention`` module owning query/key projections, e.g. Hugging Face)
    or ``selected`` (named by ``--layers`` but not a recognised attention module: token Grams only).
    """

    name: str
    module: nn.Module
    kind: str

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


def _owns_projections(module: nn.Module) -> bool:
    children = dict(module.named_children())
    if any(q in children and k in children for q, k in _QK_PAIRS):
        return True
    if any(f in children for f in _FUSED):
        return True
    params = dict(module.named_parameters(recurse=False))
    return "in_proj_weight" in params or "qkv_weight" in params


def attention_kind(module: nn.Module) -> str | None:
    """How ``module`` is recognised as an attention layer (see :class:`AttentionLayer`), else None."""

    if isinstance(module, Attention):
        return "builtin"
    if isinstance(module, nn.MultiheadAttention):
        return "multihead"
    name = type(module).__name__
    if name.lower().endswith("attention") and "crossattention" not in name.lower() and _owns_projections(module):
        return "projections"
    return None


def _candidates(module: nn.Module, limit: int = 12) -> str:
    names = [
        n for n, m in module.named_modules() if n and re.search(r"att|attn|attention", f"{n} {type(m).__name__}", re.I)
    ]
    if not names:
        names = [n for n, _ in module.named_modules() if n]
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return shown or "(the model has no submodules)"


def find_attention_layers(module: nn.Module, patterns: Sequence[str] | None = None) -> list[AttentionLayer]:
    """The attention layers of ``module``, in registration order (see the module docstring).

    ``patterns``: glob patterns (``fnmatch``, case-sensitive) on module names, e.g.
    ``blocks.*.attn`` or ``model.vit.layers.0.attention``; every pattern must match at
    least one module. Without patterns, attention layers are detected by type; a module
    nested inside another detected layer is skipped. Raises one :class:`AuditError` line
    listing candidate module names when nothing matches.
    """
    if not isinstance(module, nn.Module):
        raise AuditError(f"expected a torch.nn.Module, got {type(module).__name__}")
    named = [(n, m) for n, m in module.named_modules()]
    if patterns:
        chosen: dict[str, nn.Module] = {}
        for pat in patterns:
            hits = [(n, m) for n, m in named if n and fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise FieldError(
                    "layers",
                    "{name}: no module matches "
                    + literal(repr(pat))
                    + "; give module names or glob patterns; candidates: "
                    + literal(_candidates(module)),
                )
            chosen.update(hits)
        return [AttentionLayer(n, m, attention_kind(m) or "selected") for n, m in named if n in chosen]
    found: list[AttentionLayer] = []
    for n, m in named:
        kind = attention_kind(m)
        if kind is None:
            continue
        if any(n == f.name or (f.name == "" or n.startswith(f.name + ".")) for f in found):
            continue  # inside a layer already found
        found.append(AttentionLayer(n, m, kind))
    if not found:
        raise FieldError(
            "layers",
            f"no attention layer found in {type(module).__name__} (looked for attnaudit.models.vit.Attention, "
            "torch.nn.MultiheadAttention and modules named *Attention owning query/key projections); choose layers "
            "with {name}; candidates: " + literal(_candidates(module)),
        )
    return found
