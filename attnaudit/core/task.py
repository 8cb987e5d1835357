"""What is audited: a module, how data becomes its input, how its output becomes logits,
a per-sample loss, and which parameters are tracked.

A :class:`Task` is the one adapter every analysis takes (after kronfluence's ``Task`` and
neural-tangents' "any apply function"): the built-in 2-layer nets, a hand-written
transformer and a Hugging Face model are all described the same way.

Data convention: the data layer hands every sample over as one flat float row (n, d);
:class:`Inputs` turns a batch of rows back into what the module expects — the rows
themselves, images (B, C, H, W) from the data set's ``feature_shape``, or integer token
ids (B, L) — optionally under a keyword (``pixel_values=`` for Hugging Face vision models).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from attnaudit.errors import AuditError
from attnaudit.core.attention import math_attention

# --------------------------------------------------------------------------- losses


class Loss:
    """A per-sample loss l(logits (..., c), one-hot targets (..., c)) -> (...); the training loss is its mean."""

    name: str = "loss"
    #: dimensions of a batch of the logits it takes: (batch, classes)
    logits_ndim: int = 2

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def targets(self, y: torch.Tensor, n_classes: int, dtype: torch.dtype) -> torch.Tensor:
        """The targets this loss compares the logits with, from a data set's labels ``y``: one-hot
        (n, c) of integer labels for the classification losses."""
        return torch.nn.functional.one_hot(y.long(), n_classes).to(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MSELoss(Loss):
    """0.5 ||f - y||^2 per sample (y one-hot)."""

    name = "mse"

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return 0.5 * (logits - targets).pow(2).sum(-1)


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy logsumexp(f) - <f, y> per sample (y one-hot)."""

    name = "ce"

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logits, -1) - (logits * targets).sum(-1)


class NextTokenLoss(Loss):
    """A causal language model's loss per document: the mean next-token cross-entropy over the
    document's counted target tokens, sum_t w_t CE(f_t, next_t) / max(1, sum_t w_t), for logits
    (..., L, V) and targets (..., 2L) = [next ids | weights] (:mod:`attnaudit.core.lm_rows`)."""

    name = "next-token"
    logits_ndim = 3  # (batch, positions, vocabulary)

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        L = logits.shape[-2]
        if targets.shape[-1] != 2 * L:
            raise AuditError(
                f"next-token targets must have 2L = {2 * L} columns for logits of {L} positions, got "
                f"{targets.shape[-1]}; build them with attnaudit.core.lm_rows.targets_for"
            )
        next_ids, weights = targets[..., :L].round().long(), targets[..., L:].to(logits.dtype)
        log_p = torch.log_softmax(logits, dim=-1)
        nll = -log_p.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
        return (weights * nll).sum(-1) / weights.sum(-1).clamp(min=1.0)

    def targets(self, y: torch.Tensor, n_classes: int, dtype: torch.dtype) -> torch.Tensor:
        """A document set's targets are given whole (n, 2L): only cast."""
        if y.ndim != 2 or y.shape[1] % 2:
            raise AuditError(
                f"a language model's targets are (n, 2L) = [next ids | weights], got shape {tuple(y.shape)}; "
                "build them with attnaudit.core.lm_rows.targets_for"
            )
        return y.to(dtype)


#: the classification losses a user names (a language model's loss comes with its checkpoint)
LOSSES: dict[str, type[Loss]] = {"mse": MSELoss, "ce": CrossEntropyLoss}


def as_loss(loss: str | Loss) -> Loss:
    """A :class:`Loss` from a name (``mse``, ``ce``) or a Loss object (returned as is)."""
    if isinstance(loss, Loss):
        return loss
    key = str(loss).strip().lower()
    if key not in LOSSES:
        raise AuditError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")
    return LOSSES[key]()


# --------------------------------------------------------------------------- inputs / outputs


@dataclass(frozen=True)
class Inputs:
    """How a batch of flat rows (B, d) becomes the module's input.

    ``kind``: ``flat`` (rows as they are), ``images`` (reshaped to (B, *shape)) or
    ``tokens`` (rows of integer token ids, cast to int64, reshaped to (B, *shape)).
    ``keyword``: pass the batch as ``module(**{keyword: batch})`` instead of positionally.
    """

    kind: str = "flat"
    shape: tuple[int, ...] | None = None
    keyword: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "images", "tokens"):
            raise AuditError(f"unknown input kind {self.kind!r}; use flat, images or tokens")
        if self.kind != "flat" and self.shape is None and self.kind == "images":
            raise AuditError("image inputs need their shape (C, H, W), e.g. the data set's feature_shape")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
            if any(s < 1 for s in self.shape):
                raise AuditError(f"input shape must be positive, got {self.shape}")

    @property
    def differentiable(self) -> bool:
        """Whether gradients with respect to the inputs exist (not for token ids)."""
        return self.kind != "tokens"

    def features(self) -> int | None:
        return math.prod(self.shape) if self.shape is not None else None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        batch = rows.shape[0]
        if self.kind == "tokens":
            out = rows.round().long()
            return out if self.shape is None else out.reshape(batch, *self.shape)
        if self.kind == "images":
            assert self.shape is not None  # __post_init__ rejects images without a shape
            if rows.shape[1:].numel() != math.prod(self.shape):
                raise AuditError(
                    f"rows of {rows.shape[1:].numel()} features cannot be images of shape {self.shape}; "
                    "check the data set or the model's input shape"
                )
            return rows.reshape(batch, *self.shape)
        return rows

    def call(self, module: nn.Module | Callable, batch: torch.Tensor) -> Any:
        return module(**{self.keyword: batch}) if self.keyword else module(batch)


def to_logits(output: Any, ndim: int = 2) -> torch.Tensor:
    """The logits in a module's output: a tensor, the first item of a tuple/list, ``["logits"]``
    of a dict, or ``.logits`` of an output object (Hugging Face); (B,) becomes (B, 1). ``ndim``:
    2 for a classifier's (batch, classes), 3 for a language model's (batch, positions, vocabulary)."""
    if isinstance(output, torch.Tensor):
        logits = output
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        logits = output.logits
    elif isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        logits = output["logits"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    else:
        raise AuditError(
            f"cannot find logits in the model's output of type {type(output).__name__}; return a tensor, a tuple "
            "whose first item is the logits, a dict with 'logits', or an object with .logits"
        )
    if logits.ndim == 1:
        logits = logits.unsqueeze(-1)
    if ndim == 3 and logits.ndim == 3:
        return logits
    if logits.ndim != 2:
        raise AuditError(
            f"the model's logits have shape {tuple(logits.shape)}; a classifier audit needs (batch, classes) — "
            "pool sequence outputs inside the model"
        )
    return logits


# --------------------------------------------------------------------------- parameter selection


def probe_rows(module: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """The first row of X on the module's device, floating rows in its floating dtype (for structural probes)."""
    ref = next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
    rows = X[:1]
    if ref is not None:
        rows = rows.to(device=ref.device, dtype=ref.dtype if rows.is_floating_point() else rows.dtype)
    return rows


def _math_attention():
    return math_attention()


PARAM_KEYWORDS = ("all", "head")


def _trainable(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters() if p.requires_grad]


def head_parameter_names(
    module: nn.Module, probe: torch.Tensor | None = None, inputs: Inputs | None = None
) -> list[str]:
    """Weight and bias of the layer that produces the logits, found from the module's structure.

    A module may declare them (``head_parameter_names()`` method, as the built-in nets do).
    Otherwise the leaf module holding parameters that runs *last* in a probe forward pass is
    the head; without a probe batch, the last leaf module with parameters in the module tree
    (definition order) is used. Never the last registered *parameter* (on
    ``Sequential(Linear, Tanh, Linear)`` that would be the bias alone).
    """
    declared = getattr(module, "head_parameter_names", None)
    if callable(declared):
        return list(declared())
    holders = [
        (name, sub)
        for name, sub in module.named_modules()
        if any(p.requires_grad for p in sub.parameters(recurse=False))
    ]
    if not holders:
        raise AuditError("the model has no trainable parameters; nothing to audit")
    # A container that also holds parameters of its own (a ViT's position embedding or class
    # token on the root) finishes its forward after its children, so it is never the head
    # while a parameter-holding descendant exists.
    leaves = [
        (name, sub)
        for name, sub in holders
        if not any(other != name and (name == "" or other.startswith(name + ".")) for other, _ in holders)
    ] or holders
    chosen = leaves[-1]
    if probe is not None:
        adapter = inputs or Inputs()
        rows = probe_rows(module, probe)
        order: list[str] = []
        hooks = [sub.register_forward_hook(lambda m, a, o, name=name: order.append(name)) for name, sub in leaves]
        try:
            with torch.no_grad(), eval_mode(module), _math_attention():
                adapter.call(module, adapter(rows))
        finally:
            for h in hooks:
                h.remove()
        if order:
            chosen = next((name, sub) for name, sub in leaves if name == order[-1])
    prefix = f"{chosen[0]}." if chosen[0] else ""
    # a head tied to another module's weight (GPT-2's to its token embedding) is listed by
    # named_parameters under the name it was first registered with: that name is the one tracked
    canonical = {id(p): name for name, p in module.named_parameters()}
    return [canonical.get(id(p), prefix + n) for n, p in chosen[1].named_parameters(recurse=False) if p.requires_grad]


def select_parameter_names(
    module: nn.Module,
    selector: str | Sequence[str] = "all",
    probe: torch.Tensor | None = None,
    inputs: Inputs | None = None,
) -> list[str]:
    """Resolve a parameter selector to names, in registration order.

    ``all``: every trainable parameter; ``head``: the logits layer's weight and bias
    (:func:`head_parameter_names`); a module name (``layers.1``): its parameters; or glob
    patterns on parameter names (``blocks.*.attn.*``), several joined by commas or given as
    a list.
    """
    trainable = _trainable(module)
    if not trainable:
        raise AuditError("the model has no trainable parameters; nothing to audit")
    if isinstance(selector, str):
        items = [s.strip() for s in selector.split(",") if s.strip()]
    else:
        items = [str(s).strip() for s in selector]
    if not items:
        raise AuditError("the parameter selector is empty; use all, head, a module name or glob patterns")
    chosen: set[str] = set()
    modules = dict(module.named_modules())
    for item in items:
        if item == "all":
            chosen.update(trainable)
        elif item == "head":
            chosen.update(head_parameter_names(module, probe, inputs))
        elif item in modules and item:
            prefix = item + "."
            chosen.update(n for n in trainable if n.startswith(prefix))
        else:
            matched = [n for n in trainable if fnmatch.fnmatchcase(n, item)]
            if not matched:
                shown = ", ".join(trainable[:12]) + (f", … ({len(trainable) - 12} more)" if len(trainable) > 12 else "")
                raise AuditError(
                    f"no trainable parameter matches {item!r}; use all, head, a module name or a glob; the model has: {shown}"
                )
            chosen.update(matched)
    return [n for n in trainable if n in chosen]


# --------------------------------------------------------------------------- eval mode


class eval_mode:
    """Context: the module and its children in eval mode, their previous flags restored after.

    Analyses never run a model in training mode (dropout, batch statistics), and never
    leave a user's module changed.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> nn.Module:
        self.flags = [(m, m.training) for m in self.module.modules()]
        for m, _ in self.flags:
            m.training = False
        return self.module

    def __exit__(self, *exc) -> None:
        for m, flag in self.flags:
            m.training = flag


# --------------------------------------------------------------------------- the task


@dataclass
class Task:
    """A module plus everything needed to audit it (see the module docstring).

    ``params``: the parameter selector (``all``, ``head``, a module name, globs or a list
    of names). ``n_classes``: width of the one-hot targets (the logits' last dimension).
    """

    module: nn.Module
    n_classes: int
    loss: Loss | str = "mse"
    inputs: Inputs = field(default_factory=Inputs)
    params: str | Sequence[str] = "all"
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise AuditError(f"a task needs a torch.nn.Module, got {type(self.module).__name__}")
        self.loss = as_loss(self.loss)
        if not isinstance(self.n_classes, int) or isinstance(self.n_classes, bool) or self.n_classes < 1:
            raise AuditError(f"n_classes must be a positive integer, got {self.n_classes!r}")
        if not self.name:
            self.name = type(self.module).__name__

    def parameter_names(self, probe: torch.Tensor | None = None) -> list[str]:
        return select_parameter_names(self.module, self.params, probe, self.inputs)

    def targets(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The loss's targets for labels y: one-hot (n, c) of integer labels for a classifier."""
        return as_loss(self.loss).targets(y, self.n_classes, dtype)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The module's logits for flat rows, in eval mode, with the module's own parameters."""
        with eval_mode(self.module):
            return to_logits(self.inputs.call(self.module, self.inputs(rows)), as_loss(self.loss).logits_ndim)


def as_task(
    model: "Task | nn.Module",
    *,
    loss: Loss | str = "mse",
    n_classes: int | None = None,
    inputs: Inputs | None = None,
    params: str | Sequence[str] = "all",
    probe: torch.Tensor | None = None,
) -> Task:
    """A :class:`Task` as given, or a bare module wrapped in one.

    For a module, ``n_classes`` defaults to the width of its logits on ``probe`` rows (one
    forward pass without gradients, in eval mode, with the rows cast to the module's
    floating dtype and device; the module is left as it was). ``loss``, ``inputs`` and
    ``params`` apply to a wrapped module only: a Task keeps its own.
    """
    if isinstance(model, Task):
        return model
    if not isinstance(model, nn.Module):
        raise AuditError(f"expected a Task or a torch.nn.Module, got {type(model).__name__}")
    inputs = inputs if inputs is not None else Inputs()
    if n_classes is None:
        if probe is None or probe.shape[0] == 0:
            raise AuditError("cannot tell the number of classes: give n_classes or at least one row of data")
        rows = probe_rows(model, probe)
        with torch.no_grad(), eval_mode(model):
            n_classes = int(to_logits(inputs.call(model, inputs(rows))).shape[1])
    return Task(model, n_classes, loss, inputs, params)


def closed_form_blocker(module: nn.Module, inputs: Inputs) -> str | None:
    """Why a built-in closed form cannot stand in for ``module`` (None when it can).

    A model with a structured fast path declares it by a ``closed_form_blocker(inputs)``
    method (:class:`attnaudit.models.builtin.TwoLayerNet`); any other module takes the
    generic path.
    """
    declare = getattr(type(module), "closed_form_blocker", None)
    if declare is None:
        return f"the model is a {type(module).__name__}, not a TwoLayerNet"
    return declare(module, inputs)
