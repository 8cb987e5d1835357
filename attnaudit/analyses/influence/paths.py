"""How an influence run evaluates its task: the generic engine, or a declared fast path.

Every derivative comes from the functional :class:`~attnaudit.core.engine.Engine` built from
the task (:data:`PATH_GENERIC`). A fast path computes the part of the forward pass that does
not depend on the tracked parameters once per row and differentiates only the rest: the head
of a built-in 2-layer net (:func:`twolayer_head_fast_path`) or an ``nn.Linear`` head of any
model (:func:`linear_head_fast_path`); each gives the same numbers as the generic engine (tested).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, TypeVar

import torch
from torch import nn

from attnaudit.core.engine import Engine, math_attention, ranges
from attnaudit.core.task import Inputs, Task, eval_mode, to_logits
from attnaudit.errors import AuditError
from attnaudit.models.builtin import TwoLayerNet

PATH_GENERIC = "generic: engine"
PATH_FAST_TWOLAYER_HEAD = "fast: TwoLayerNet head, cached features"
PATH_FAST_LINEAR_HEAD = "fast: nn.Linear head, cached features"


class _CachedFeatureHead(nn.Module):
    """logits = u @ a on cached features u: the head of a TwoLayerNet, on its own."""

    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(a.detach().clone())

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u @ self.a


@dataclass(frozen=True)
class FastPath:
    """A cheaper evaluation of a task restricted to its tracked parameters.

    ``engine``: an engine over *prepared* rows whose tracked parameters are exactly the
    task's (same names, same order, same values); ``prepare(rows)``: the part of the
    forward pass that does not depend on them, run once without gradients.
    """

    description: str
    engine: Engine
    prepare: Callable[[torch.Tensor], torch.Tensor]


_M = TypeVar("_M", bound=nn.Module)


def _copy_with(module: _M, dtype: torch.dtype, state: dict[str, torch.Tensor] | None) -> _M:
    """A copy of ``module`` in ``dtype``, its parameters set from ``state`` where it has them
    (TracIn checkpoints); the module itself is never changed."""
    work = copy.deepcopy(module).to(dtype=dtype)
    if state is not None:
        with torch.no_grad():
            for name, p in work.named_parameters():
                if name in state:
                    p.copy_(state[name].to(p.device, p.dtype))
    return work


def twolayer_head_fast_path(
    task: Task,
    names: Sequence[str],
    *,
    dtype: torch.dtype = torch.float64,
    state: dict[str, torch.Tensor] | None = None,
    probe: torch.Tensor | None = None,
) -> FastPath | None:
    """The cached-feature head of a built-in 2-layer net, or None when it does not apply.

    Applies exactly when all of these hold:

    * ``task.module`` is a :class:`~attnaudit.models.builtin.TwoLayerNet` (that exact class: a
      subclass may change ``forward``);
    * the tracked parameters are its head alone: ``names == ["a"]``;
    * ``task.inputs`` is the default flat adapter (rows reach ``forward`` unchanged).

    Then the logits are f(x) = h(x) a with h(x) = relu(s_in W z) * s_out (z = x, or
    f_att(x) for MLP-Attn; s_in = 1/sqrt(d), s_out = 1/sqrt(m) under the NTK
    parametrization, 1 under the standard one) independent of ``a``: h is computed once per row (no gradients, eval mode, in ``dtype``), and the
    tracked model is the linear map u -> u a, for any loss. Same numbers as the generic
    engine path (tested). ``state``: parameter values to use instead of the module's
    (TracIn checkpoints); they are loaded into a copy, never into the module.
    """

    module = task.module
    if type(module) is not TwoLayerNet or list(names) != ["a"] or task.inputs != Inputs():
        return None
    work = module
    if state is not None or module.a.dtype != dtype:
        work = _copy_with(module, dtype, state)
    device = work.a.device
    _, s_out = work.preactivation_scale()

    def prepare(rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), eval_mode(work), math_attention():
            return work.hidden(rows.to(device=device, dtype=dtype)) * s_out

    head = Task(_CachedFeatureHead(work.a), task.n_classes, task.loss, name="TwoLayerNet head")
    return FastPath(PATH_FAST_TWOLAYER_HEAD, Engine(head, dtype=dtype, device=device, names=["a"]), prepare)


class _LinearOnFeatures(nn.Module):
    """A copy of a model's ``nn.Linear`` head at the same parameter path (``a.b.head``), applied to cached features."""

    def __init__(self, path: str, head: nn.Linear):
        super().__init__()
        parts = path.split(".")
        self._path = parts
        node: nn.Module = self
        for part in parts[:-1]:
            child = nn.Module()
            node.add_module(part, child)
            node = child
        node.add_module(parts[-1], head)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        node: nn.Module = self
        for part in self._path:
            node = getattr(node, part)
        return node(u)


def _single_use(module: nn.Module, head: nn.Module) -> bool:
    """Whether the head's parameters belong to no other module (no weight tying)."""
    own = {id(p) for p in head.parameters(recurse=False)}
    for sub in module.modules():
        if sub is not head and any(id(p) in own for p in sub.parameters(recurse=False)):
            return False
    return True


def linear_head_fast_path(
    task: Task,
    names: Sequence[str],
    *,
    dtype: torch.dtype = torch.float64,
    state: dict[str, torch.Tensor] | None = None,
    probe: torch.Tensor | None = None,
    chunk: int = 512,
) -> FastPath | None:
    """Cached features for an ``nn.Linear`` head of any model, or None when it does not apply.

    Applies exactly when all of these hold:

    * the tracked parameters are all the trainable parameters of one ``nn.Linear`` module
      (that exact class) -- its weight and bias, if any -- and no other module holds them
      (no weight tying, so the features cannot depend on them);
    * on probe rows, the linear module runs exactly once per forward pass, on (B, in)
      inputs, and its output *is* the model's logits bit for bit (nothing follows it).
      The same is checked again on every chunk of rows the path prepares; a violation
      raises rather than return wrong numbers.

    Then logits = phi(x) W^T + b with features phi(x) that do not depend on the tracked
    parameters: phi is computed once per row (no gradients, eval mode, math attention
    kernel, in ``dtype``, on a copy of the module) and the tracked model is that linear map
    on the features, for any loss. Same numbers as the generic engine path (tested).
    ``state``: parameter values to use instead of the module's (TracIn checkpoints),
    loaded into the copy.
    """
    module = task.module
    names = list(names)
    path = names[0].rpartition(".")[0] if names else ""
    head = dict(module.named_modules()).get(path) if path else None
    if probe is None or type(head) is not nn.Linear:
        return None
    own = [f"{path}.{n}" for n, p in head.named_parameters(recurse=False) if p.requires_grad]
    if names != own or not _single_use(module, head):
        return None
    ref = next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    work = _copy_with(module, dtype, state)
    work_head = dict(work.named_modules())[path]
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(head inputs, whether the assumptions held) for a batch of rows."""
        captured.clear()
        hook = work_head.register_forward_hook(lambda m, args, out: captured.append((args[0], out)))
        try:
            with torch.no_grad(), eval_mode(work), math_attention():
                rows = rows.to(device=device, dtype=dtype) if rows.is_floating_point() else rows.to(device)
                logits = to_logits(task.inputs.call(work, task.inputs(rows)))
        finally:
            hook.remove()
        ok = (
            len(captured) == 1
            and captured[0][0].ndim == 2
            and captured[0][1].shape == logits.shape
            and torch.equal(captured[0][1], logits)
        )
        return (captured[0][0] if captured else logits), ok

    try:
        _, ok = run(probe[:2])
    except Exception:  # noqa: BLE001 - the generic path will report what is wrong with the model
        return None
    if not ok:
        return None

    def prepare(rows: torch.Tensor) -> torch.Tensor:
        parts = []
        for a, b in ranges(rows.shape[0], chunk):
            feats, ok = run(rows[a:b])
            if not ok:
                raise AuditError(
                    f"the head {path} stopped producing the logits directly on some rows (data-dependent forward pass); "
                    "the cached-feature fast path does not apply: rerun with the fast path off"
                )
            parts.append(feats)
        return torch.cat(parts) if parts else rows.new_zeros((0, work_head.in_features), dtype=dtype)

    head_copy = copy.deepcopy(work_head)
    reduced = Task(_LinearOnFeatures(path, head_copy), task.n_classes, task.loss, name=f"{task.name} head")
    return FastPath(PATH_FAST_LINEAR_HEAD, Engine(reduced, dtype=dtype, device=device, names=names), prepare)


FAST_PATHS: tuple[Callable[..., FastPath | None], ...] = (twolayer_head_fast_path, linear_head_fast_path)


class EngineView(NamedTuple):
    """The engine an influence run differentiates, ``prepare`` (rows -> what it takes) and which path it is."""

    engine: Engine
    prepare: Callable[[torch.Tensor], torch.Tensor]
    path: str


def _load_state(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    """Point ``engine`` at the parameter values in ``state`` (names it lacks keep their values)."""
    current = engine.unflatten(engine.theta)
    engine.theta = torch.cat(
        [
            (state[n] if n in state else current[n]).detach().to(engine.device, engine.dtype).reshape(-1)
            for n in engine.names
        ]
    ).clone()
    for name in list(engine.frozen):
        if name in state:
            t = state[name].detach()
            engine.frozen[name] = t.to(engine.device, engine.dtype if t.is_floating_point() else t.dtype)


def engine_view(
    task: Task,
    names: list[str],
    dtype: torch.dtype,
    fast_path: bool = True,
    state: dict[str, torch.Tensor] | None = None,
    probe: torch.Tensor | None = None,
) -> EngineView:
    """The first fast path that applies (when ``fast_path``; ``probe``: rows to check it on), else
    the generic engine, in ``dtype``, at the parameter values ``state`` (None: the module's)."""
    if fast_path:
        for fast in FAST_PATHS:
            found = fast(task, names, dtype=dtype, state=state, probe=probe)
            if found is not None:
                return EngineView(found.engine, found.prepare, found.description)
    engine = Engine(task, dtype=dtype, names=names)
    if state is not None:
        _load_state(engine, state)
    return EngineView(engine, engine.rows, PATH_GENERIC)
