"""How far training moved a network from the kernel regime: the empirical NTK of a trained
model against the one at its initialization, per parameter group.

Everything runs through the functional engine (:class:`attnaudit.core.engine.Engine`) on
float64 copies in eval mode, so it applies to any module (built-in ViTs and 2-layer nets,
Hugging Face models, a user's ``--factory`` module) and never touches the caller's module.
The closed forms of :mod:`attnaudit.core.ntk` stay the fast path of the 2-layer width sweep.

Kernels
-------
Rows X = ``kernel_points`` training rows; J_g(x) the per-sample Jacobian (c, P_g) of the c
logits with respect to the parameters of group g; the eNTK of group g is

    Theta_g[i, j, a, b] = J_g,a(x_i) . J_g,b(x_j),     Theta = sum_g Theta_g.

* ``movement`` = ||Theta(T) - Theta(0)||_F / ||Theta(0)||_F on the **full (n c) x (n c)
  kernel**, the definition of ``ntk-distance``'s 2-layer sweep (``kernel_movement``);
  ``movement_trace`` the same on the output-averaged (n x n) kernel (1/c) sum_a Theta[:, :, a, a]
  (the sweep's ``kernel_movement_trace``). ``form="trace"`` computes only the latter (c
  times fewer operations).
* ``norm_ratio`` = ||Theta(T)||_F / ||Theta(0)||_F and ``kernel_distance`` = 1 - <Theta(0),
  Theta(T)>_F / (||Theta(0)||_F ||Theta(T)||_F) (Fort et al. 2020), which split the movement into
  a change of size and a change of shape: a kernel that only grew has kernel distance 0 however
  large its movement (the built-in ViTs start from weights of std 0.02, so training mostly
  scales their kernel up, and the movement alone would overstate how its shape changed).
* per group, the same quantities for Theta_g, and ``trace_share`` = tr(Theta_g) / tr(Theta):
  the group's share of the kernel (groups add up to 1, since Theta = sum_g Theta_g).
* ``cka`` = centred kernel alignment of the output-averaged kernel K with the labels,
  <H K H, H L H>_F / (||H K H||_F ||H L H||_F), L = Y Y^T (Y one-hot), H = I - 11^T/n
  (Cortes et al. 2012; scale-free, so output-averaged or summed gives the same value), before
  (Theta(0)) and after (Theta(T)) training, overall and per group.

Grouping rule (:func:`group_of`): a parameter belongs to the prefix of its name up to and
including the first integer component (``blocks.1.attn.q.weight`` -> ``blocks.1``;
``vit.encoder.layer.0.output.dense.bias`` -> ``vit.encoder.layer.0``); a name without one
to its first two module components (``vit.embeddings.cls_token`` -> ``vit.embeddings``),
one for a direct child (``embed.weight`` -> ``embed``, ``head.bias`` -> ``head``), and a
parameter of the root module to itself (``pos_embed``; the 2-layer nets' ``W`` and ``a``).

Memory plan: per-sample Jacobians of both models (2 c P float64 numbers per row) are held
for all rows when they fit ``memory_bytes``, else in panels such that two panels fit, the
column panels recomputed (``jacobian_passes`` says how often each row's Jacobians were
computed). Only the upper block triangle of the symmetric kernels is formed, one matrix
product per group and block; the per-group Frobenius sums are accumulated and only the
n x n output-averaged kernels are kept. When even two rows' Jacobians over all parameters do
not fit, the kernels are summed layer by layer (:mod:`.layerwise`).

The linearized model is :mod:`.linearized`; one checkpoint's audit :mod:`.checkpoint`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from attnaudit.analyses.ntk_distance.aggregate import strict_json
from attnaudit.analyses.ntk_distance.config import DEFAULT_MEMORY_BYTES, KERNEL_FORMS
from attnaudit.analyses.ntk_distance.layerwise import layer_kernels
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.contraction import contract
from attnaudit.core.engine import JACOBIAN_ROWS, JACOBIAN_TRANSIENT, Engine, ranges
from attnaudit.core.linalg import centered_kernel_alignment as centered_kernel_alignment
from attnaudit.core.precision import PrecisionCheck, compare
from attnaudit.core.task import Task, as_task
from attnaudit.errors import AuditError

F64 = torch.float64
# rows of the strips of the symmetric kernels (one matrix product per group and strip)
STRIP_ROWS = 32

MOVEMENT_DEFINITION = (
    "||Theta(T) - Theta(0)||_F / ||Theta(0)||_F of the empirical NTK on the kernel rows; movement: the full "
    "(n c) x (n c) kernel (as the 2-layer sweep's kernel_movement), movement_trace: the output-averaged n x n kernel; "
    "norm_ratio: ||Theta(T)||_F / ||Theta(0)||_F; kernel_distance: 1 - <Theta(0), Theta(T)>_F / "
    "(||Theta(0)||_F ||Theta(T)||_F) (Fort et al. 2020), of the full kernel (output-averaged with form=trace)"
)
CKA_DEFINITION = (
    "centred kernel alignment <HKH, HLH>_F / (||HKH||_F ||HLH||_F) of the output-averaged eNTK K with L = Y Y^T "
    "(one-hot labels), H = I - 11^T/n"
)


def _check_form(form: str) -> None:
    """Refuse a kernel form other than full or trace."""
    if form not in KERNEL_FORMS:
        raise FieldError("form", "unknown kernel {name} " + literal(repr(form)) + "; use full or trace")


# --------------------------------------------------------------------------- parameter groups


def group_of(name: str) -> str:
    """The parameter group of a parameter name (see the module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    if len(parts) == 1:
        return name
    return ".".join(parts[: min(2, len(parts) - 1)])


def parameter_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Parameter names grouped by :func:`group_of`, groups in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(group_of(name), []).append(name)
    return groups


def _check_groups(groups: dict[str, Sequence[str]], names: Sequence[str]) -> dict[str, list[str]]:
    known = set(names)
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for g, members in groups.items():
        members = list(members)
        if not members:
            raise AuditError(f"parameter group {g!r} is empty")
        bad = [m for m in members if m not in known]
        if bad:
            raise AuditError(f"parameter group {g!r} names parameters not in the model: {', '.join(bad[:5])}")
        twice = [m for m in members if m in seen]
        if twice:
            raise AuditError(f"parameter(s) {', '.join(twice[:5])} are in more than one group")
        seen.update(members)
        out[str(g)] = members
    return out


def _engines(
    tasks: Sequence[Task],
    X: torch.Tensor,
    groups: dict[str, Sequence[str]] | None,
    device=None,
    dtype: torch.dtype = F64,
) -> tuple[list[Engine], dict[str, list[str]], dict[str, tuple[int, int]]]:
    """Engines in ``dtype`` (the Jacobians' precision; the kernel sums stay float64) over the same
    parameters, ordered group by group, and each group's slice of theta."""
    probe = X[:1]
    first = tasks[0]
    names = first.parameter_names(probe)
    if not names:
        raise AuditError("the model has no trainable parameters to take an NTK over")
    shapes = dict(first.module.named_parameters())
    for other in tasks[1:]:
        other_names = other.parameter_names(probe)
        mine = {n: tuple(shapes[n].shape) for n in names}
        theirs = {n: tuple(p.shape) for n, p in other.module.named_parameters() if n in set(other_names)}
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise AuditError(
                "the two models do not have the same parameters (names and shapes), so their kernels cannot be "
                f"compared (first differences: {', '.join(f'{n} {s}' for n, s in diff)}); give the same architecture"
            )
        if other.n_classes != first.n_classes:
            raise AuditError(
                f"the two models have {first.n_classes} and {other.n_classes} outputs; give the same architecture"
            )
    grouped = _check_groups(groups, names) if groups is not None else parameter_groups(names)
    ordered = [n for members in grouped.values() for n in members]
    engines = [Engine(t, dtype=dtype, device=device, names=ordered) for t in tasks]
    slices: dict[str, tuple[int, int]] = {}
    start = 0
    numel = dict(zip(engines[0].names, engines[0].numels))
    for g, members in grouped.items():
        size = sum(numel[m] for m in members)
        slices[g] = (start, start + size)
        start += size
    return engines, grouped, slices


def _upper_blocks(
    engines: Sequence[Engine], X: torch.Tensor, memory_bytes: int, c: int, counter: dict
) -> Iterator[tuple[int, int, list[torch.Tensor], list[torch.Tensor], int]]:
    """The upper block triangle of the symmetric kernels on rows X.

    Yields (row start, column start, row Jacobians, column Jacobians, k): one (rows, c, P)
    tensor per engine for each; the first k columns of a diagonal strip are the square on the
    diagonal (counted once in Frobenius sums), the rest lie above it (counted twice).
    """

    n = X.shape[0]
    P = engines[0].n_params
    per_sample = len(engines) * c * P * 8
    # the transient memory of computing one sub-batch of one model's Jacobians is budgeted too
    transient = JACOBIAN_TRANSIENT * min(JACOBIAN_ROWS, n) * c * P * 8
    avail = int(memory_bytes) - transient
    if 2 * per_sample > avail:
        raise AuditError(
            f"one row's Jacobians ({len(engines)} model(s) x {c} outputs x {P:,} parameters, float64) take "
            f"{per_sample / 2**20:.3g} MiB; two rows plus the {transient / 2**20:.3g} MiB of computing them must fit "
            f"the {memory_bytes / 2**20:.3g} MiB budget; raise the memory budget or use a smaller model"
        )

    def jac(a: int, b: int) -> list[torch.Tensor]:
        counter["rows"] = counter.get("rows", 0) + (b - a)
        return [e.jacobian(X[a:b]) for e in engines]

    panels = [(0, n)] if n * per_sample <= avail else list(ranges(n, max(1, avail // (2 * per_sample))))
    for i, (p1, q1) in enumerate(panels):
        J1 = None  # release the previous row panel before computing the next
        J1 = jac(p1, q1)
        for a, b in ranges(q1 - p1, STRIP_ROWS):
            yield p1 + a, p1 + a, [J[a:b] for J in J1], [J[a:] for J in J1], b - a
        for p2, q2 in panels[i + 1 :]:
            yield p1, p2, J1, jac(p2, q2), 0


def _product(R: torch.Tensor, C: torch.Tensor, s: int, e: int, form: str, c: int) -> torch.Tensor:
    """Group block of the kernel: (r c, m c) flat full form (row i*c + a), or (r, m) output-averaged;
    float64, summed in float64 whatever the Jacobians' precision (:func:`~attnaudit.core.contraction.contract`)."""
    r, m = R.shape[0], C.shape[0]
    if form == "trace":
        return contract(R[..., s:e].reshape(r, -1), C[..., s:e].reshape(m, -1)) / c
    return contract(R[..., s:e].reshape(r * c, e - s), C[..., s:e].reshape(m * c, e - s))


def _trace_of(block: torch.Tensor, form: str, r: int, m: int, c: int) -> torch.Tensor:
    if form == "trace":
        return block
    return block.view(r, c, m, c).diagonal(dim1=1, dim2=3).sum(-1) / c


def _weighted_sq(block: torch.Tensor, k_cols: int) -> float:
    """Sum of squares with the first k_cols (flat) columns counted once and the rest twice."""
    return float(block[:, :k_cols].pow(2).sum()) + 2.0 * float(block[:, k_cols:].pow(2).sum())


def _fill(K: torch.Tensor, a1: int, a2: int, block: torch.Tensor) -> None:
    r, m = block.shape
    K[a1 : a1 + r, a2 : a2 + m] = block
    K[a2 : a2 + m, a1 : a1 + r] = block.T


def _jacobian_plan_fits(engines: Sequence[Engine], n: int, c: int, memory_bytes: int) -> bool:
    """Whether :func:`_upper_blocks` can run: two rows' Jacobians over all parameters (of every
    model) and the transient memory of computing them fit ``memory_bytes``. When they do not
    (transformers of millions of parameters at the 2 GiB default), the kernels are summed layer by
    layer (:func:`layer_kernels`)."""
    P = engines[0].n_params
    per_sample = len(engines) * c * P * 8
    transient = JACOBIAN_TRANSIENT * min(JACOBIAN_ROWS, n) * c * P * 8
    return 2 * per_sample <= int(memory_bytes) - transient


# --------------------------------------------------------------------------- kernel movement


@dataclass
class GroupMovement:
    """One parameter group's kernel before and after training (see the module docstring)."""

    group: str
    n_params: int
    n_tensors: int
    movement: float | None
    movement_trace: float
    norm_ratio: float
    kernel_distance: float
    trace_share_init: float
    trace_share_trained: float
    cka_init: float | None
    cka_trained: float | None

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


@dataclass
class KernelMovement:
    """The eNTK at initialization vs after training on ``n_points`` rows (module docstring).

    ``kernel_init``/``kernel_trained``: the output-averaged (n, n) kernels (not in
    ``to_dict``). ``jacobian_passes``: Jacobians computed per row (1 when all fitted the
    memory budget at once).
    """

    form: str
    n_points: int
    n_classes: int
    n_params: int
    movement: float | None
    movement_trace: float
    norm_init: float
    norm_trained: float
    norm_ratio: float
    kernel_distance: float
    kernel_distance_trace: float
    cka_init: float | None
    cka_trained: float | None
    groups: list[GroupMovement]
    memory_bytes: int
    jacobian_passes: float
    seconds: float
    kernel_init: torch.Tensor | None = field(default=None, repr=False)
    kernel_trained: torch.Tensor | None = field(default=None, repr=False)

    @property
    def headline(self) -> float:
        """The full-kernel movement, or the output-averaged one when only that was computed."""
        return self.movement if self.movement is not None else self.movement_trace

    def group(self, name: str) -> GroupMovement:
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("kernel_init", "kernel_trained", "groups")}
        out["groups"] = [g.to_dict() for g in self.groups]
        out["definition"] = MOVEMENT_DEFINITION
        out["cka_definition"] = CKA_DEFINITION
        return strict_json(out)


def task_of(model: Task | nn.Module, X: torch.Tensor) -> Task:
    """``model`` as a :class:`~attnaudit.core.task.Task` (a module with its ``audit_inputs()``, probed on rows X)."""

    if isinstance(model, Task):
        return model
    declared = getattr(model, "audit_inputs", None)  # the built-in models declare their inputs
    return as_task(model, inputs=declared() if callable(declared) else None, probe=X)


class _KernelSums:
    """What the movement is read from, for each group and the whole kernel (key None): the
    Frobenius sums ||K0||^2, ||KT||^2, ||KT - K0||^2 of the full kernels (form full) and the
    output-averaged (n, n) kernels at initialization and after training."""

    def __init__(self, keys: Sequence[str | None], n: int, form: str, c: int, device) -> None:
        self.form, self.c = form, c
        self.trace0 = {g: torch.zeros(n, n, dtype=F64, device=device) for g in keys}
        self.traceT = {g: torch.zeros(n, n, dtype=F64, device=device) for g in keys}
        self.acc = {g: {"t0": 0.0, "tT": 0.0, "move": 0.0} for g in keys}

    def add_squares(self, g: str | None, B0: torch.Tensor, BT: torch.Tensor, kc: int) -> None:
        """Adds a block's Frobenius sums (its first ``kc`` columns counted once, the rest twice)."""
        if self.form == "full":
            self.acc[g]["t0"] += _weighted_sq(B0, kc)
            self.acc[g]["tT"] += _weighted_sq(BT, kc)
            self.acc[g]["move"] += _weighted_sq(BT - B0, kc)

    def add_block(
        self, g: str | None, B0: torch.Tensor, BT: torch.Tensor, kc: int, at: tuple[int, int, int, int]
    ) -> None:
        """Adds one block (rows a1.., columns a2.., r x m rows) of group g's kernels at init and trained."""
        a1, a2, r, m = at
        self.add_squares(g, B0, BT, kc)
        _fill(self.trace0[g], a1, a2, _trace_of(B0, self.form, r, m, self.c))
        _fill(self.traceT[g], a1, a2, _trace_of(BT, self.form, r, m, self.c))

    def sums(self, g: str | None) -> tuple[float, float, float]:
        """(||KT - K0||^2, ||K0||^2, ||KT||^2) of the full kernel, or of the output-averaged one for form=trace."""
        if self.form == "full":
            return self.acc[g]["move"], self.acc[g]["t0"], self.acc[g]["tT"]
        return self.trace_sums(g)

    def trace_sums(self, g: str | None) -> tuple[float, float, float]:
        """(||KT - K0||^2, ||K0||^2, ||KT||^2) of the output-averaged kernel."""
        return (
            float((self.traceT[g] - self.trace0[g]).pow(2).sum()),
            float(self.trace0[g].pow(2).sum()),
            float(self.traceT[g].pow(2).sum()),
        )

    def trace_movement(self, g: str | None) -> float:
        """||KT - K0||_F / ||K0||_F of the output-averaged kernels of group g (None: the whole kernel)."""
        base = self.trace0[g].norm()
        return float((self.traceT[g] - self.trace0[g]).norm() / base) if float(base) > 0 else float("nan")


def _ratio(a: float, b: float) -> float:
    return math.sqrt(a / b) if b > 0 else float("nan")


def _cos_distance(move: float, t0: float, tT: float) -> float:
    """1 - <K0, KT>_F / (||K0|| ||KT||) from the three Frobenius sums, as
    (||KT - K0||^2 - (||KT|| - ||K0||)^2) / (2 ||K0|| ||KT||) (no cancellation of two cosines)."""
    n0, nT = math.sqrt(t0), math.sqrt(tT)
    return max(0.0, (move - (nT - n0) ** 2) / (2 * n0 * nT)) if n0 > 0 and nT > 0 else float("nan")


def _sum_blocks(
    engines: Sequence[Engine],
    rows: torch.Tensor,
    slices: dict[str, tuple[int, int]],
    sums: _KernelSums,
    memory_bytes: int,
    c: int,
) -> int:
    """Accumulates both models' kernels block by block from the rows' Jacobians (:func:`_upper_blocks`);
    returns how many rows' Jacobians were computed."""
    form = sums.form
    counter: dict = {}
    for a1, a2, R, C, k in _upper_blocks(engines, rows, memory_bytes, c, counter):
        at = (a1, a2, R[0].shape[0], C[0].shape[0])
        kc = k * (c if form == "full" else 1)
        S0 = ST = None
        for g, (s, e) in slices.items():
            B0 = _product(R[0], C[0], s, e, form, c)
            BT = _product(R[1], C[1], s, e, form, c)
            sums.add_block(g, B0, BT, kc, at)
            S0 = B0 if S0 is None else S0 + B0
            ST = BT if ST is None else ST + BT
        assert S0 is not None and ST is not None  # a model has at least one parameter group
        sums.add_block(None, S0, ST, kc, at)
        del R, C, S0, ST, B0, BT  # the column panel is freed before the generator computes the next one
    return counter.get("rows", 0)


def _sum_layers(
    engines: Sequence[Engine],
    rows: torch.Tensor,
    slices: dict[str, tuple[int, int]],
    sums: _KernelSums,
    memory_bytes: int,
    c: int,
) -> None:
    """Both models' group kernels summed layer by layer (:func:`~.layerwise.layer_kernels`), one model
    after the other: two models' kernels are held, never a row's Jacobian over all parameters."""
    form, n = sums.form, rows.shape[0]
    kc = n * (c if form == "full" else 1)
    # the second model's pass also holds the first one's kernels
    held = len(slices) * kc**2 * 8
    kernels = [layer_kernels(e, rows, slices, c, form, int(memory_bytes) - i * held) for i, e in enumerate(engines)]
    for g in [*slices, None]:
        if g is None:
            B0 = torch.stack(list(kernels[0].values())).sum(0)
            BT = torch.stack(list(kernels[1].values())).sum(0)
        else:
            B0, BT = kernels[0][g], kernels[1][g]
        sums.add_squares(g, B0, BT, kc)
        sums.trace0[g] = _trace_of(B0, form, n, n, c).clone()
        sums.traceT[g] = _trace_of(BT, form, n, n, c).clone()


def kernel_movement(
    task_init: Task | nn.Module,
    task_trained: Task | nn.Module,
    X: torch.Tensor,
    y: torch.Tensor | None = None,
    groups: dict[str, Sequence[str]] | None = None,
    *,
    form: str = "full",
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
    dtype: torch.dtype = F64,
) -> KernelMovement:
    """Relative movement of the empirical NTK between two models of one architecture on rows X.

    ``task_init``/``task_trained``: Tasks (or modules, wrapped with their ``audit_inputs()``)
    over the same parameter names and shapes. ``y``: labels for the centred kernel alignment
    (None: no CKA). ``groups``: name -> parameter names (default: :func:`parameter_groups`).
    ``form``: ``full`` (the (n c)^2 kernel, and the output-averaged one) or ``trace`` (only the
    output-averaged one). Jacobians in ``dtype`` (the precision policy, float64 by default),
    kernel sums and metrics in float64 (module docstring).
    """
    _check_form(form)
    if X.ndim != 2 or X.shape[0] < 2:
        raise AuditError(f"kernel movement needs at least 2 rows (n, d), got shape {tuple(X.shape)}")
    t0 = time.perf_counter()
    engines, grouped, slices = _engines([task_of(task_init, X), task_of(task_trained, X)], X, groups, device, dtype)
    rows = engines[0].rows(X)
    n = rows.shape[0]
    c = int(engines[0].logits(rows[:1]).shape[1])
    sums = _KernelSums([*grouped, None], n, form, c, engines[0].device)
    if _jacobian_plan_fits(engines, n, c, memory_bytes):
        rows_computed = _sum_blocks(engines, rows, slices, sums, memory_bytes, c)
    else:
        _sum_layers(engines, rows, slices, sums, memory_bytes, c)
        rows_computed = n
    Y = None
    if y is not None:
        y = y.reshape(-1).long()
        if y.shape[0] != n:
            raise AuditError(f"{y.shape[0]} labels for {n} kernel rows")
        Y = torch.nn.functional.one_hot(y.to(engines[0].device), max(c, int(y.max()) + 1)).to(F64)
    numel = dict(zip(engines[0].names, engines[0].numels))
    return _movement_of(
        sums,
        grouped,
        numel,
        Y,
        n=n,
        c=c,
        n_params=engines[0].n_params,
        memory_bytes=memory_bytes,
        passes=rows_computed / n,
        t0=t0,
    )


def _movement_of(
    sums: _KernelSums,
    grouped: dict[str, list[str]],
    numel: dict[str, int],
    Y: torch.Tensor | None,
    *,
    n: int,
    c: int,
    n_params: int,
    memory_bytes: int,
    passes: float,
    t0: float,
) -> KernelMovement:
    """The :class:`KernelMovement` read from the accumulated sums and kernels (``Y``: one-hot labels for the CKA)."""
    full = sums.form == "full"
    acc, trace0, traceT = sums.acc, sums.trace0, sums.traceT

    def cka(K: torch.Tensor) -> float | None:
        return None if Y is None else centered_kernel_alignment(K, Y)

    tr_all0, tr_allT = float(trace0[None].trace()), float(traceT[None].trace())
    out_groups = [
        GroupMovement(
            group=g,
            n_params=int(sum(numel[m] for m in members)),
            n_tensors=len(members),
            movement=_ratio(acc[g]["move"], acc[g]["t0"]) if full else None,
            movement_trace=sums.trace_movement(g),
            norm_ratio=_ratio(sums.sums(g)[2], sums.sums(g)[1]),
            kernel_distance=_cos_distance(*sums.sums(g)),
            trace_share_init=float(trace0[g].trace()) / tr_all0 if tr_all0 > 0 else float("nan"),
            trace_share_trained=float(traceT[g].trace()) / tr_allT if tr_allT > 0 else float("nan"),
            cka_init=cka(trace0[g]),
            cka_trained=cka(traceT[g]),
        )
        for g, members in grouped.items()
    ]
    return KernelMovement(
        form=sums.form,
        n_points=n,
        n_classes=c,
        n_params=n_params,
        movement=_ratio(acc[None]["move"], acc[None]["t0"]) if full else None,
        movement_trace=sums.trace_movement(None),
        norm_init=math.sqrt(acc[None]["t0"]) if full else float(trace0[None].norm()),
        norm_trained=math.sqrt(acc[None]["tT"]) if full else float(traceT[None].norm()),
        norm_ratio=_ratio(sums.sums(None)[2], sums.sums(None)[1]),
        kernel_distance=_cos_distance(*sums.sums(None)),
        kernel_distance_trace=_cos_distance(*sums.trace_sums(None)),
        cka_init=cka(trace0[None]),
        cka_trained=cka(traceT[None]),
        groups=out_groups,
        memory_bytes=int(memory_bytes),
        jacobian_passes=passes,
        seconds=time.perf_counter() - t0,
        kernel_init=trace0[None].cpu(),
        kernel_trained=traceT[None].cpu(),
    )


def entk_by_group(
    model: "Task | nn.Module",
    X: torch.Tensor,
    groups: dict[str, Sequence[str]] | None = None,
    *,
    form: str = "full",
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
) -> dict[str, torch.Tensor]:
    """The eNTK of each parameter group on rows X, {group: (n, n, c, c) or (n, n)}, from one
    pass of Jacobians (the machinery of :func:`kernel_movement`); the groups sum to the full
    eNTK (:meth:`Engine.entk <attnaudit.core.engine.Engine.entk>`)."""
    _check_form(form)
    engines, grouped, slices = _engines([task_of(model, X)], X, groups, device)
    rows = engines[0].rows(X)
    n = rows.shape[0]
    c = int(engines[0].logits(rows[:1]).shape[1])
    shape = (n, n) if form == "trace" else (n * c, n * c)
    out = {g: torch.zeros(shape, dtype=F64, device=engines[0].device) for g in grouped}
    for a1, a2, R, C, _ in _upper_blocks(engines, rows, memory_bytes, c, {}):
        for g, (s, e) in slices.items():
            B = _product(R[0], C[0], s, e, form, c)
            k = c if form == "full" else 1
            _fill(out[g], a1 * k, a2 * k, B)
        del R, C, B
    if form == "full":
        return {g: K.view(n, c, n, c).permute(0, 2, 1, 3).contiguous() for g, K in out.items()}
    return out


#: rows of the kernel block the float64 spot check recomputes (its Jacobians cost 2 x rows x outputs
#: backward passes, one side in float64: 89 s of a 751 s DeiT-tiny audit at 16 rows on 2 cores)
KERNEL_CHECK_ROWS = 8


def kernel_precision_check(task: Task | nn.Module, X: torch.Tensor, dtype: torch.dtype, device=None) -> PrecisionCheck:
    """A block of the model's empirical NTK -- the first :data:`KERNEL_CHECK_ROWS` rows, every
    output pair -- by Jacobian contraction in ``dtype`` against float64."""
    t0 = time.perf_counter()
    task = task_of(task, X)
    rows = X[:KERNEL_CHECK_ROWS]
    blocks = []
    for d in (dtype, F64):
        K = Engine(task, dtype=d, device=device).entk(rows)  # (m, m, c, c)
        m, c = K.shape[0], K.shape[2]
        blocks.append(K.permute(0, 2, 1, 3).reshape(m * c, m * c).to(F64))
    return compare(
        blocks[0],
        blocks[1],
        quantity="empirical NTK block (trained model)",
        precision=str(dtype).replace("torch.", ""),
        subsample={"rows": int(rows.shape[0]), "outputs": int(blocks[0].shape[0] // max(1, rows.shape[0]))},
        seconds=time.perf_counter() - t0,
    )
