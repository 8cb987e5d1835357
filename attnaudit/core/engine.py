"""The functional engine built from a :class:`~attnaudit.core.task.Task`.

Everything an analysis needs from a model, for any ``torch.nn.Module``:

* ``apply(theta, rows)`` -> logits, with the tracked parameters as one flat vector theta
  (P,) and everything else (other parameters, buffers) held fixed;
* per-sample gradients of the loss (``vmap(grad)``), the gradient of the summed loss;
* Hessian-vector products of the mean training loss (reverse-over-reverse, with a
  forward-over-reverse fallback for modules without double-backward support);
* per-sample Jacobians of the logits and the empirical NTK by Jacobian contraction;
* gradients with respect to the inputs (attacks);
* a memory planner sized from a measured probe pass.

Guarantees. The user's module is never modified: parameters and buffers are detached
copies in the engine's dtype (float64 by default for analyses that need it; the caller
chooses), passed through ``torch.func.functional_call``. Every call runs the module in
eval mode (flags restored afterwards) and inside ``sdpa_kernel(SDPBackend.MATH)``, because
the fused scaled-dot-product-attention kernels have no forward-mode derivative and no
double backward (measured: ../shared/notes/transformers-and-torch-func.md), so second
derivatives work for every attention layer.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

from attnaudit.errors import AuditError
from attnaudit.core.attention import math_attention
from attnaudit.core.contraction import contract
from attnaudit.core.task import Task, as_loss, eval_mode, to_logits

KERNEL_FORMS = ("full", "trace")
_DEFAULT_MEMORY_BYTES = 1 << 30
# vmap(jacrev) sub-batch: larger vmapped batches were slower on CPU (see Engine.jacobian)
JACOBIAN_ROWS = 16
# bytes vmap(jacrev) holds transiently per sub-batch row, in units of one row's Jacobian (measured: about 3)
JACOBIAN_TRANSIENT = 3
# strip height of the symmetric eNTK's upper triangle (Engine.entk; 4x for the trace form)
ENTK_STRIP_ROWS = 16


#: text sorted by length (a model that drops trailing padding) runs in chunks of neighbours,
#: each at its own longest sequence: a chunk closes when its padding would pass this share of
#: its tokens, or its tokens (rows x longest) those of the planned chunk of longest rows
#: (BERT-mini, reviews of 5 to 128 tokens, 2 threads: a Hessian-vector product 53.2 s padded
#: in chunks of 64, 22.5 s sorted and cut)
TEXT_PADDING_SHARE = 0.25
#: fewer rows are taken as they come
TEXT_SORT_MIN_ROWS = 16


def length_spans(lengths: Sequence[int], chunk: int, max_rows: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) spans over rows sorted by ascending real ``lengths``: a span runs at its
    last (longest) row's length and holds at most the tokens of ``chunk`` rows of the longest
    length overall (so memory stays within what ``chunk`` full rows were planned for), at most
    ``max_rows`` rows (for memory that does not shrink with length: per-sample gradients), and
    closes before its padding passes :data:`TEXT_PADDING_SHARE` of its tokens."""
    n = len(lengths)
    if n == 0:
        return []
    budget = max(1, int(chunk)) * max(1, int(lengths[-1]))
    spans, start, real = [], 0, 0
    for i, length in enumerate(lengths):
        length = max(1, int(length))
        rows = i - start + 1
        padded = rows * length
        too_many = max_rows is not None and rows > max_rows
        if rows > 1 and (too_many or padded > budget or padded - (real + length) > TEXT_PADDING_SHARE * padded):
            spans.append((start, i))
            start, real = i, 0
        real += length
    spans.append((start, n))
    return spans


def ranges(n: int, size: int) -> Iterable[tuple[int, int]]:
    """Consecutive [start, stop) chunks of ``range(n)`` of at most ``size``."""
    size = max(1, int(size))
    for start in range(0, n, size):
        yield start, min(n, start + size)


class Engine:
    """Functional view of ``task`` at the module's current parameter values.

    ``dtype``: floating dtype of every parameter copy and computation (default: the
    tracked parameters' own dtype). ``names``: the tracked parameters (default: the
    task's selector, resolved with ``probe`` rows when given).
    """

    def __init__(
        self,
        task: Task,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        names: Sequence[str] | None = None,
        probe: torch.Tensor | None = None,
    ):
        self.task = task
        self.module = task.module
        self.loss = as_loss(task.loss)  # a Loss since Task.__post_init__ (returned as is); narrows Loss | str
        self.inputs = task.inputs
        self.n_classes = task.n_classes
        named = dict(self.module.named_parameters())
        self.names = list(names) if names is not None else task.parameter_names(probe)
        missing = [n for n in self.names if n not in named]
        if missing:
            raise AuditError(f"parameter(s) {', '.join(missing)} not in the model")
        if not self.names:
            raise AuditError("no parameters selected; nothing to audit")
        first = named[self.names[0]]
        self.dtype = dtype or (first.dtype if first.is_floating_point() else torch.float64)
        self.device = torch.device(device) if device is not None else first.device

        def copy(t: torch.Tensor) -> torch.Tensor:
            target = self.dtype if t.is_floating_point() else t.dtype
            return t.detach().to(device=self.device, dtype=target)

        self.shapes = [tuple(named[n].shape) for n in self.names]
        self.numels = [named[n].numel() for n in self.names]
        self.theta = torch.cat([copy(named[n]).reshape(-1) for n in self.names]).clone()
        chosen = set(self.names)
        self.frozen = {k: copy(v) for k, v in named.items() if k not in chosen}
        self.frozen.update({k: copy(v) for k, v in self.module.named_buffers()})
        originals = {**named, **dict(self.module.named_buffers())}
        # False once vmap over rows failed on this module's forward (data-dependent control flow,
        # such as transformers' attention-mask helpers): per-row work then loops (see map_rows)
        self.vmap_rows: bool = True
        # True when no frozen tensor had to be converted (then each is the module's own storage)
        self._frozen_shared = all(
            v.data_ptr() == originals[k].data_ptr() and v.dtype == originals[k].dtype for k, v in self.frozen.items()
        )

    # ----------------------------------------------------------------- basics
    @property
    def n_params(self) -> int:
        return int(self.theta.numel())

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(theta, self.numels)
        return {k: p.view(s) for k, p, s in zip(self.names, parts, self.shapes)}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[k].reshape(-1) for k in self.names])

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        """The loss's targets for labels y (one-hot (n, c) for a classifier) in the engine's dtype
        and device."""
        return self.loss.targets(y.to(self.device), self.n_classes, self.dtype)

    def rows(self, X: torch.Tensor) -> torch.Tensor:
        """Flat rows on the engine's device, in its dtype (token ids are small integers: exact)."""
        return X.to(device=self.device, dtype=self.dtype)

    def real_lengths(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Per row, the position after its last real token, for a model that drops trailing
        padding per batch (``trim_padding``, text models); None otherwise."""
        module = self.module
        mask_of = getattr(module, "token_mask", None)
        if not getattr(module, "trim_padding", False) or not callable(mask_of):
            return None
        keep = mask_of(self.inputs(rows))
        if keep is None:
            return None
        positions = torch.arange(1, keep.shape[1] + 1, device=keep.device)
        return (keep.long() * positions).amax(1).to(rows.device)

    def length_order(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The stable permutation that orders ``rows`` by :meth:`real_lengths`, so chunks of
        neighbours run at their own longest sequence; None for other models and for fewer
        than :data:`TEXT_SORT_MIN_ROWS` rows."""
        if rows.shape[0] < TEXT_SORT_MIN_ROWS:
            return None
        lengths = self.real_lengths(rows)
        return None if lengths is None else torch.argsort(lengths, stable=True)

    def longest_first(self, rows: torch.Tensor) -> torch.Tensor:
        """Indices of ``rows``, the longest real length first for text that drops trailing
        padding (any number of rows), else as they come: where a memory probe measures the
        worst chunk."""
        lengths = self.real_lengths(rows)
        if lengths is None:
            return torch.arange(rows.shape[0], device=rows.device)
        return torch.argsort(lengths, descending=True, stable=True)

    def sorted_spans(
        self, rows: torch.Tensor, chunk: int, max_rows: int | None = None
    ) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
        """(order, spans): :meth:`length_order` and :func:`length_spans` over the rows in that
        order for text; (None, consecutive chunks of ``chunk`` rows) otherwise."""
        order = self.length_order(rows)
        if order is None:
            return None, list(ranges(int(rows.shape[0]), chunk))
        lengths = self.real_lengths(rows[order])
        assert lengths is not None  # an order was found
        return order, length_spans(lengths.tolist(), chunk, max_rows)

    def cut_padding(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` without the trailing columns that are padding in all of them, for a model
        that drops them itself (``trim_padding``; the same numbers): ``vmap`` cannot cut inside
        the model, so per-sample computations are fed cut rows. Other models: as given."""
        cut = getattr(self.module, "cut_rows", None)
        return cut(rows) if getattr(self.module, "trim_padding", False) and callable(cut) else rows

    def row_chunks(
        self, rows: torch.Tensor, chunk: int, max_rows: int | None = None
    ) -> list[slice] | list[torch.Tensor]:
        """Chunks of at most ``chunk`` rows' worth covering ``rows`` once: consecutive slices,
        or for text that drops trailing padding, index tensors of neighbours in length
        (:meth:`sorted_spans`; ``max_rows`` caps their rows). Sums over chunks are the same
        either way (up to round-off); per-row results go back to ``out[index]``."""
        order, spans = self.sorted_spans(rows, chunk, max_rows)
        if order is None:
            return [slice(a, b) for a, b in spans]
        return [order[a:b] for a, b in spans]

    def _as_targets(self, T: torch.Tensor) -> torch.Tensor:
        return T.to(device=self.device, dtype=self.dtype)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Eval mode and the math attention kernel around every model call."""
        with eval_mode(self.module), math_attention():
            yield

    def apply(
        self, theta: torch.Tensor, rows: torch.Tensor, overrides: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Logits (B, c) of flat rows (B, d) with tracked parameters ``theta`` (call inside :meth:`context`);
        ``overrides`` replace named tensors of that state (per-sample copies of a parameter)."""
        state = {**self.frozen, **self.unflatten(theta), **(overrides or {})}
        batch = self.inputs(rows)
        if self.inputs.keyword:
            out = functional_call(self.module, state, (), {self.inputs.keyword: batch})
        else:
            out = functional_call(self.module, state, (batch,))
        return to_logits(out, self.loss.logits_ndim)

    def _module_is_theta(self) -> bool:
        """Whether calling the module itself computes apply(self.theta, .): every frozen
        tensor is the module's own (same dtype and device, so no copy was made) and the
        tracked parameters still hold theta's values. Checked per call, O(tracked size)."""
        if not self._frozen_shared:
            return False
        named = dict(self.module.named_parameters())
        current = [named[k] for k in self.names]
        if any(p.dtype != self.dtype or p.device != self.device for p in current):
            return False
        return torch.equal(torch.cat([p.detach().reshape(-1) for p in current]), self.theta)

    def _call_module(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits of the module called as it is (no functional call; see :meth:`_module_is_theta`)."""
        batch = self.inputs(rows)
        out = self.module(**{self.inputs.keyword: batch}) if self.inputs.keyword else self.module(batch)
        return to_logits(out, self.loss.logits_ndim)

    def logits(self, rows: torch.Tensor, theta: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
        """Logits of many rows, without gradients."""
        th = self.theta if theta is None else theta
        rows = self.rows(rows)
        with torch.no_grad(), self.context():
            parts = self.row_chunks(rows, chunk)
            if isinstance(parts[0], slice):
                return torch.cat([self.apply(th, rows[part]) for part in parts])
            out = [(part, self.apply(th, rows[part])) for part in parts]
            logits = torch.empty(rows.shape[0], *out[0][1].shape[1:], dtype=out[0][1].dtype, device=out[0][1].device)
            for part, value in out:
                logits[part] = value
            return logits

    def map_rows(self, fn: Callable, in_dims: tuple) -> Callable:
        """``vmap(fn, in_dims)`` over rows; for a module whose forward branches on its inputs'
        values (transformers' causal-mask helpers call ``.item()`` on the attention mask, which
        vmap refuses) a loop that calls ``fn`` row by row and stacks the results (tuples item by
        item): the same numbers, one forward per row. The switch is remembered per engine."""
        batched = vmap(fn, in_dims=in_dims)

        def looped(*args):
            n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
            outs = [fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(n)]
            if isinstance(outs[0], tuple):
                return tuple(torch.stack(parts) for parts in zip(*outs))
            return torch.stack(outs)

        def call(*args):
            if self.vmap_rows:
                try:
                    return batched(*args)
                except RuntimeError as exc:
                    if "vmap" not in str(exc):
                        raise
                    self.vmap_rows = False
            return looped(*args)

        return call

    # ----------------------------------------------------------------- losses and gradients
    def sample_loss(self, theta: torch.Tensor, row: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Loss of one row (d,) with one-hot target (c,): a scalar."""
        return self.loss.per_sample(self.apply(theta, row.unsqueeze(0)), target.unsqueeze(0)).squeeze(0)

    def sum_loss(self, theta: torch.Tensor, rows: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        return self.loss.per_sample(self.apply(theta, rows), T).sum()

    def per_sample_grads(
        self, rows: torch.Tensor, T: torch.Tensor, theta: torch.Tensor | None = None, chunk: int | None = None
    ) -> torch.Tensor:
        """Per-sample loss gradients (n, P) (``vmap(grad)``, in chunks of ``chunk`` rows; a loop
        over rows for a module vmap cannot batch, :meth:`map_rows`)."""
        th = self.theta if theta is None else theta
        rows, T = self.rows(rows), self._as_targets(T)
        fn = self.map_rows(grad(self.sample_loss), (None, 0, 0))
        size = rows.shape[0] if chunk is None else chunk
        with self.context():
            parts = self.row_chunks(rows, size, max_rows=size)  # a P-wide gradient per row, whatever its length
            if isinstance(parts[0], slice):
                return torch.cat([fn(th, self.cut_padding(rows[part]), T[part]) for part in parts])
            out = torch.empty(rows.shape[0], th.numel(), dtype=th.dtype, device=th.device)
            for part in parts:  # text: neighbours in length, each chunk cut to its longest before vmap
                out[part] = fn(th, self.cut_padding(rows[part]), T[part])
            return out

    def summed_grad(
        self, rows: torch.Tensor, T: torch.Tensor, chunk: int = 512, theta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gradient (P,) of sum_i l(z_i), accumulated in chunks."""
        th = self.theta if theta is None else theta
        rows, T = self.rows(rows), self._as_targets(T)
        g = torch.zeros_like(th)
        with self.context():
            for part in self.row_chunks(rows, chunk):
                g += grad(self.sum_loss)(th, rows[part], T[part])
        return g

    def input_grads(self, rows: torch.Tensor, T: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
        """d l(x_i) / d x_i for every row (n, d): what gradient-based attacks follow."""
        return self.input_grads_and_logits(rows, T, theta)[0]

    def input_grads_and_logits(
        self, rows: torch.Tensor, T: torch.Tensor, theta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d l(x_i) / d x_i (n, d), logits (n, c)) from one forward and one backward pass.

        Plain reverse-mode autograd with respect to the rows only (the parameters are
        constants here): no functional transform is needed for a single gradient, and its
        per-call overhead was most of an FGSM step on small models.
        """
        if not self.inputs.differentiable:
            raise AuditError("the model takes token ids, which have no input gradient; attacks need continuous inputs")
        direct = theta is None and self._module_is_theta()
        th = (self.theta if theta is None else theta).detach()
        rows, T = self.rows(rows), self._as_targets(T)
        with self.context(), torch.enable_grad():
            r = rows.detach().requires_grad_(True)
            logits = self._call_module(r) if direct else self.apply(th, r)
            (g,) = torch.autograd.grad(self.loss.per_sample(logits, T).sum(), r)
        return g, logits.detach()

    # ----------------------------------------------------------------- Hessian
    def hvp_operator(
        self, rows: torch.Tensor, T: torch.Tensor, chunk: int = 4096, theta: torch.Tensor | None = None
    ) -> "HessianVectorProduct":
        """v -> H v, H the Hessian of the mean loss (1/n) sum_i l(z_i) over ``rows``."""
        return HessianVectorProduct(self, rows, T, chunk, self.theta if theta is None else theta)

    # ----------------------------------------------------------------- Jacobians and the eNTK
    def jacobian(
        self, rows: torch.Tensor, theta: torch.Tensor | None = None, sub_batch: int = JACOBIAN_ROWS
    ) -> torch.Tensor:
        """Per-sample Jacobians of the logits (B, c, P) (a language model's: c = L V, position-major).

        ``vmap(jacrev)`` with respect to the parameter tensors (not the flat theta, whose
        split would make autograd concatenate every sub-batch's gradients into a fresh
        buffer), over sub-batches of at most ``sub_batch`` rows (:data:`JACOBIAN_ROWS`), each tensor's
        Jacobian written once into its columns of one preallocated (B, c, P) result. Larger
        vmapped batches were slower on CPU (measured on the MNIST ViT: 1.9 s for 256 rows in
        sub-batches of 8 to 32, 3.5 s in batches of 128), and the transient memory of one
        sub-batch (about :data:`JACOBIAN_TRANSIENT` times its Jacobians) stays small.
        """
        th = self.theta if theta is None else theta
        rows = self.rows(rows)
        names = self.names

        def single(params: tuple, row: torch.Tensor) -> torch.Tensor:
            state = {**self.frozen, **dict(zip(names, params))}
            batch = self.inputs(row.unsqueeze(0))
            if self.inputs.keyword:
                out = functional_call(self.module, state, (), {self.inputs.keyword: batch})
            else:
                out = functional_call(self.module, state, (batch,))
            return to_logits(out, self.loss.logits_ndim).squeeze(0)

        params = tuple(torch.split(th, self.numels))
        params = tuple(p.view(s) for p, s in zip(params, self.shapes))
        fn = self.map_rows(jacrev(single), (None, 0))
        n = rows.shape[0]
        out = None
        with self.context():
            for a, b in ranges(n, max(1, int(sub_batch))):
                parts = fn(params, rows[a:b])  # one (rows, *logits, *shape) per parameter tensor
                if out is None:
                    # c: a row's logits flattened (a language model's (L, V) positions x vocabulary)
                    c = parts[0].numel() // ((b - a) * self.numels[0])
                    out = torch.empty((n, c, self.n_params), dtype=parts[0].dtype, device=parts[0].device)
                offset = 0
                for part, numel in zip(parts, self.numels):
                    out[a:b, :, offset : offset + numel] = part.reshape(b - a, c, numel)
                    offset += numel
                del parts
        if out is None:  # no rows
            out = torch.empty((0, self.n_classes, self.n_params), dtype=th.dtype, device=th.device)
        return out

    def entk(
        self,
        X1: torch.Tensor,
        X2: torch.Tensor | None = None,
        *,
        form: str = "full",
        memory_bytes: int = _DEFAULT_MEMORY_BYTES,
    ) -> torch.Tensor:
        """Empirical NTK by Jacobian contraction: K[i, j, a, b] = J_a(x_i) . J_b(x_j).

        Returns (n1, n2, c, c), or (n1, n2) averaged over the outputs for ``form='trace'``.

        Memory plan (``memory_bytes`` bounds the Jacobians held plus the transient memory of
        computing one sub-batch of them, :data:`JACOBIAN_TRANSIENT` x the sub-batch's rows' worth;
        the sub-batch, :data:`JACOBIAN_ROWS` rows at most, is halved until that transient takes at
        most half the budget, so that a tight budget still leaves room for panels of several
        rows): per-sample Jacobians (c P numbers each) are kept for every column when they fit
        half of what is left (all of it without ``X2``), else computed in panels of rows such
        that two panels fit, the column panels recomputed for every row panel. Each block is
        one matrix product of flattened Jacobians, (rows c) x P times P x (cols c) (the trace
        form contracts (rows, c P) with (cols, c P): c times fewer operations). Without ``X2``
        the kernel is symmetric: only the part on and above the diagonal is formed, in strips
        of :data:`ENTK_STRIP_ROWS` rows (4x for the trace form), and mirrored (about half the
        contraction work), and the rows' Jacobians serve as the columns'.
        """
        if form not in KERNEL_FORMS:
            raise AuditError(f"unknown kernel form {form!r}; use one of {', '.join(KERNEL_FORMS)}")
        X1 = self.rows(X1)
        c = self.logits(X1[:1]).shape[1]
        P = self.n_params
        per_sample = max(1, c * P * self.theta.element_size())
        same = X2 is None
        X2 = X1 if X2 is None else self.rows(X2)
        n1, n2 = X1.shape[0], X2.shape[0]
        sub = min(JACOBIAN_ROWS, max(n1, n2))
        # a 16-row sub-batch's transient could leave room for panels of a row or two, and every
        # column panel is recomputed for every row panel (40 rows of a small ViT in 6 MB: 820
        # one-row Jacobian passes, 8 s; with 8-row sub-batches 4 panels, 0.2 s)
        while sub > 1 and JACOBIAN_TRANSIENT * sub * per_sample > int(memory_bytes) // 2:
            sub //= 2
        transient = JACOBIAN_TRANSIENT * sub * per_sample
        avail = max(int(memory_bytes) - transient, 2 * per_sample)
        panel = max(1, avail // (2 * per_sample))
        # the full form is assembled in the flat (n1 c, n2 c) layout (row i*c + a: every block a
        # plain 2-D write) and permuted to (n1, n2, c, c) once at the end
        k = 1 if form == "trace" else c
        out = torch.empty((n1 * k, n2 * k), dtype=self.dtype, device=self.device)

        def product(J1: torch.Tensor, J2: torch.Tensor) -> torch.Tensor:
            # summed in float64 whatever the Jacobians' precision (attnaudit.core.contraction)
            r1, r2 = J1.shape[0], J2.shape[0]
            if form == "trace":
                return contract(J1.reshape(r1, -1), J2.reshape(r2, -1)) / c
            return contract(J1.reshape(r1 * c, P), J2.reshape(r2 * c, P))

        def put(a1: int, a2: int, B: torch.Tensor, both: bool) -> None:
            a1, a2 = a1 * k, a2 * k
            b1, b2 = a1 + B.shape[0], a2 + B.shape[1]
            out[a1:b1, a2:b2] = B
            if both:
                out[a2:b2, a1:b1] = B.T

        def result() -> torch.Tensor:
            if form == "trace":
                return out
            return out.view(n1, c, n2, c).permute(0, 2, 1, 3).contiguous()

        def diagonal(J: torch.Tensor, a0: int) -> None:
            """The symmetric block of rows [a0, a0 + len(J)) with itself, strip by strip."""
            r = J.shape[0]
            # a product of rows x c rows (full) or rows rows (trace): thin strips save work but
            # a product with few rows runs slowly (measured: 64-row strips best for the trace form)
            for a, b in ranges(r, ENTK_STRIP_ROWS if form == "full" else 4 * ENTK_STRIP_ROWS):
                put(a0 + a, a0 + a, product(J[a:b], J[a:]), both=True)

        if same and n1 * per_sample <= avail:  # every row's Jacobian fits: computed once
            diagonal(self.jacobian(X1, sub_batch=sub), 0)
            return result()
        if not same and 2 * n2 * per_sample <= avail:  # every column's Jacobian fits, with room for row panels
            J2 = self.jacobian(X2, sub_batch=sub)
            rows_panel = max(1, (avail - n2 * per_sample) // per_sample)
            for a1, b1 in ranges(n1, rows_panel):
                put(a1, 0, product(self.jacobian(X1[a1:b1], sub_batch=sub), J2), both=False)
            return result()
        cols = list(ranges(n2, panel))
        for i, (a1, b1) in enumerate(cols if same else ranges(n1, panel)):
            J1 = None  # the previous row panel is released before the next is computed
            J1 = self.jacobian(X1[a1:b1], sub_batch=sub)
            if same:
                diagonal(J1, a1)
            for a2, b2 in cols[i + 1 :] if same else cols:
                put(a1, a2, product(J1, self.jacobian(X2[a2:b2], sub_batch=sub)), both=same)
        return result()

    # ----------------------------------------------------------------- memory
    def probe_bytes_per_sample(self, rows: torch.Tensor, batch: int = 4, wrt: str = "params") -> int:
        """Bytes autograd saves per sample for one loss gradient, measured on a probe batch.

        Counts the tensors saved for backward (``saved_tensors_hooks``) in a forward and
        backward pass over ``batch`` rows; activations of attention layers (tokens x
        tokens) are included, which parameter shapes alone would miss. ``wrt``: the gradient
        with respect to the tracked parameters (``params``) or to the rows (``inputs``, an
        attack's: every layer after the input then saves its activations). Text that drops
        trailing padding is probed on its longest rows (the worst chunk).
        """
        rows = self.rows(rows[self.longest_first(rows)[:batch]])
        theta = self.theta.detach().requires_grad_(wrt == "params")
        r = rows.detach().requires_grad_(wrt == "inputs")

        def loss() -> torch.Tensor:
            with self.context():
                logits = self.apply(theta, r)
                return self.loss.per_sample(logits, self.probe_targets(logits)).sum()

        saved = saved_tensor_bytes(loss, (theta, *self.frozen.values()))
        return max(1, math.ceil(saved / rows.shape[0]))

    def probe_targets(self, logits: torch.Tensor) -> torch.Tensor:
        """Targets of the loss's shape for ``logits``, for probes whose values do not matter: class
        0 one-hot (n, c) for a classifier; for a language model's logits (n, L, V), next id 0 at
        every position with weight 1 (n, 2L), so every position enters the backward pass."""
        n = logits.shape[0]
        if logits.ndim == 3:
            L = logits.shape[1]
            zeros = torch.zeros(n, L, dtype=self.dtype, device=self.device)
            return torch.cat([zeros, torch.ones_like(zeros)], 1)
        return self.targets(torch.zeros(n, dtype=torch.long, device=self.device))

    def plan_chunk(self, rows: torch.Tensor, budget_bytes: float, per_sample_extra: int = 0, limit: int = 4096) -> int:
        """Largest chunk of rows whose activations (measured) plus ``per_sample_extra`` bytes each fit the budget."""
        per = self.probe_bytes_per_sample(rows) + per_sample_extra
        return int(max(1, min(limit, budget_bytes // max(1, per))))


def saved_tensor_bytes(build: Callable[[], torch.Tensor], own: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``build()`` runs (with grad
    enabled), leaving out those that share storage with ``own``: the model's weights, which a
    product saves as its other factor but which are held once whatever the batch."""
    owned = {t.untyped_storage().data_ptr() for t in own}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in owned:
            saved += t.numel() * t.element_size()
        # detached: a node that saves its own output (softmax, exp) would otherwise hold that output
        # with its grad_fn, a cycle through C++ that Python's collector cannot see -- the probe's
        # whole graph (and the weights it read) would outlive it
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        build()
    return saved


class HessianVectorProduct:
    """v -> H v (or a block V (k, P) -> V H) for the mean loss over fixed rows.

    Reverse-over-reverse (``vjp`` of ``grad``: one pass builds the gradient's graph, each
    vector is one pull-back through it), summed over row chunks; a module whose operations
    have no double-backward switches to forward-over-reverse (``jvp`` of ``grad``) on first
    failure. Reverse-over-reverse was measured faster or equal everywhere (one thread,
    float64, one vector): 2-layer nets on digits 1.9-2.9x (P = 2,368), 1.8x (P = 18,944),
    on MNIST n = 2,000 width 256 1.4-2.4x (P = 203,264); the MNIST ViT 0.9-1.2x; the two
    agree to 5e-16 relative (bitwise on the 2-layer nets). ``calls`` counts vectors
    multiplied; ``mode`` says which differentiation was used.
    """

    def __init__(self, engine: Engine, rows: torch.Tensor, T: torch.Tensor, chunk: int, theta: torch.Tensor):
        self.engine = engine
        self.rows, self.T = engine.rows(rows), engine._as_targets(T)
        self.n = int(self.rows.shape[0])
        self.chunk = max(1, int(chunk))
        # every chunk's gradient graph together fits the budget one chunk was given: kept for the next vectors
        self.keep_graphs = self.n <= self.chunk
        # text: rows sorted by length (the Hessian is a sum over rows), each chunk of neighbours
        # run at its own longest sequence
        order, self.spans = engine.sorted_spans(self.rows, self.chunk)
        if order is not None:
            self.rows, self.T = self.rows[order], self.T[order]
        self.theta = theta
        self.size = int(theta.numel())
        self.calls = 0
        self.mode = "reverse-over-reverse"
        self._pullbacks: dict[tuple[int, int], Callable] = {}

    def _grad_fn(self, a: int, b: int) -> Callable[[torch.Tensor], torch.Tensor]:
        rows, T, n, eng = self.rows[a:b], self.T[a:b], self.n, self.engine
        return grad(lambda th: eng.sum_loss(th, rows, T) / n)

    def _one_chunk(self, a: int, b: int, V: torch.Tensor, batched: bool | None = None) -> torch.Tensor:
        if self.mode == "reverse-over-reverse":
            try:
                pullback = self._pullbacks.get((a, b))
                if pullback is None:
                    pullback = vjp(self._grad_fn(a, b), self.theta)[1]
                    if self.keep_graphs:
                        self._pullbacks[(a, b)] = pullback
                if batched is None:
                    # on CPU a vmapped block was measured no faster per vector than a loop of
                    # plain pull-backs (digits 1.5 vs 1.5 ms, MNIST n=2,000 width 256 59-79 vs
                    # 47-59 ms, one thread), so the batching layer is kept for accelerators
                    batched = V.shape[0] > 1 and V.device.type != "cpu"
                if not batched:
                    return torch.stack([pullback(v)[0] for v in V])
                return vmap(lambda v: pullback(v)[0])(V)
            except (RuntimeError, NotImplementedError):
                self.mode = "forward-over-reverse"
                self._pullbacks = {}
        return vmap(lambda v: jvp(self._grad_fn(a, b), (self.theta,), (v,))[1])(V)

    def matmat(self, V: torch.Tensor, batched: bool | None = None) -> torch.Tensor:
        """H applied to each row of V (k, P) -> (k, P). ``batched``: pull the rows back
        through one vmapped call (True) or one by one (False); None: the device's rule."""
        V = V.to(device=self.engine.device, dtype=self.engine.dtype)
        out = torch.zeros_like(V)
        with self.engine.context():
            for a, b in self.spans:
                out += self._one_chunk(a, b, V, batched)
        self.calls += V.shape[0]
        return out.detach()

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.matmat(v.reshape(1, -1)).reshape(-1)

    __call__ = matvec

    def dense(self, block: int = 32) -> torch.Tensor:
        """The P x P Hessian from blocks of products, symmetrised.

        Thousands of products: the first two blocks are timed, one vmapped and one pulled
        back vector by vector, and the faster way builds the rest (measured on CPU: vmapped
        1.7x faster for a width-4 net on MNIST rows, P = 3,176, where per-call overhead
        dominates; 7 % slower at width 32 on digits). The two agree to round-off."""
        P = self.size
        H = torch.empty(P, P, dtype=self.engine.dtype, device=self.engine.device)
        eye = torch.eye(P, dtype=self.engine.dtype, device=self.engine.device)
        blocks = list(ranges(P, block))
        if len(blocks) > 2 and self.mode == "reverse-over-reverse":
            self.matvec(torch.zeros(P, dtype=self.engine.dtype, device=self.engine.device))  # graph built once, untimed
            self.calls -= 1
            seconds = []
            for (a, b), batched in zip(blocks[:2], (True, False)):
                t0 = time.perf_counter()
                H[a:b] = self.matmat(eye[a:b], batched=batched)
                seconds.append((time.perf_counter() - t0) / (b - a))
            choice = seconds[0] <= seconds[1]
            rest = blocks[2:]
        else:
            choice, rest = None, blocks
        for a, b in rest:
            H[a:b] = self.matmat(eye[a:b], batched=choice)
        return 0.5 * (H + H.T)
