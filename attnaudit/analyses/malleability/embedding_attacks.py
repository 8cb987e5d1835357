"""Continuous attacks on text: FGSM, PGD and MIM on the input embeddings, and their random controls.

The continuous analogue of the pixel attacks (:mod:`.attacks`). A text is a row of token
ids; the attacked model sees ``inputs_embeds = E[ids] + delta`` (the rows are
:class:`~attnaudit.models.hf.HFEmbeddingShiftClassifier` rows: ids plus a shift per token, or
for a causal language model :class:`~attnaudit.models.hf_causal.HFCausalLMShift` rows:
[ids | attention | delta]).
Each token may move inside a ball whose radius is relative to its own embedding's norm:

* ``l2``: ``||delta_p||_2 <= eps * ||E[ids_p]||_2`` (eps = 0.1 moves each token by at most
  10% of its embedding's length);
* ``linf``: ``|delta_pj| <= eps * ||E[ids_p]||_2 / sqrt(h)``, the cube whose corners lie on
  that sphere (same reach along the diagonals, smaller along the axes).

Padding and the row-framing special tokens (:func:`.token_attacks.protected_ids`; for a
language model the padding its attention block marks and the config's BOS/EOS/pad ids) have
radius 0. The methods follow :mod:`.attacks`, token by token: ``fgsm`` one step to the
boundary along sign(g) (linf) or g_p / ||g_p|| (l2); ``pgd`` a random start inside the
balls, ``steps`` steps of 2.5 eps / steps (relative; ``step_size`` overrides it, relative
too) each projected back onto every token's ball; ``mim`` momentum on g / ||g||_1 (per
text), steps eps / steps, no random start. The random controls spend the same radius
without the gradient: ``sign`` a random corner (linf) or a random sign vector scaled to the
radius (l2), ``random`` uniform in the cube (linf) or uniform on each token's sphere (l2).

The model is a :class:`~attnaudit.core.task.Task` evaluated in eval mode, never trained or
changed; the loss it maximises is the task's own per-sample loss. Randomness comes from a
CPU generator seeded with the attack's seed (one draw for all rows, so results do not
depend on the chunk size).
"""

from __future__ import annotations

import math
from functools import partial
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnaudit.analyses.malleability.token_attacks import protected_ids
from attnaudit.core.engine import saved_tensor_bytes
from attnaudit.core.task import Task, as_loss
from attnaudit.errors import AuditError
from attnaudit.models.hf import HFEmbeddingShiftClassifier, embedding_shift_rows
from attnaudit.models.hf_causal import HFCausalLMShift, causal_shift_rows

EMBEDDING_ATTACKS = ("fgsm", "pgd", "mim", "sign", "random", "none")
TEXT_CHUNK = 64  # texts per forward/backward graph (a transformer's graph per text is large)


@dataclass
class EmbeddingAttackOutcome:
    """The perturbed rows, and each text's largest relative token shift (in the attack's norm)."""

    rows: torch.Tensor
    relative_radius: torch.Tensor  # (n,): max over tokens of ||delta_p|| / (its ball's radius / eps)


def token_radii(E: torch.Tensor, ids: torch.Tensor, protected: tuple[int, ...], eps: float, norm: str) -> torch.Tensor:
    """Each token's ball radius (n, L) in ``norm``: eps ||E[id]||_2 (l2) or that over sqrt(h) (linf); 0 where protected."""
    keep = torch.ones_like(ids, dtype=torch.bool)
    for t in protected:
        keep &= ids != t
    return radii_where(E, ids, keep, eps, norm)


def radii_where(E: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    """:func:`token_radii` with the attacked positions given as a mask ``keep`` (n, L; 0 elsewhere)."""
    norms = E.detach().to(torch.float64).norm(dim=1)[ids.to(E.device)].to(keep.device)
    if norm == "linf":
        norms = norms / math.sqrt(E.shape[1])
    return torch.where(keep, eps * norms, torch.zeros_like(norms))


#: flat rows of a chunk of texts from their shifts (n, L, h): what the attacked model reads
RowsOf = Callable[[int, int, torch.Tensor], torch.Tensor]


def _layout(module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowsOf, Callable]:
    """(ids (n, L), the shifts rows hold (n, L, h), the attacked positions (n, L), the chunk's rows
    from shifts, the output rows from shifts) of a shift model's rows."""
    if isinstance(module, HFEmbeddingShiftClassifier):
        ids, delta0 = module.split_rows(rows)
        keep = torch.ones_like(ids, dtype=torch.bool)
        for t in protected_ids(ids, module.pad_token_id):
            keep &= ids != t

        def chunk(a: int, b: int, shift: torch.Tensor) -> torch.Tensor:
            return torch.cat([ids[a:b].to(shift.dtype).unsqueeze(-1), shift], dim=-1).reshape(b - a, -1)

        return ids, delta0, keep, chunk, lambda d: embedding_shift_rows(ids, module.hidden, d)
    if isinstance(module, HFCausalLMShift):
        ids, attention, delta0 = module.split_shift(rows)
        keep = attention.clone()
        for t in module.special_ids():
            keep &= ids != t

        def lm_chunk(a: int, b: int, shift: torch.Tensor) -> torch.Tensor:
            parts = [ids[a:b].to(shift.dtype), attention[a:b].to(shift.dtype), shift.reshape(b - a, -1)]
            return torch.cat(parts, dim=1)

        return ids, delta0, keep, lm_chunk, lambda d: causal_shift_rows(ids, attention, module.hidden, d)
    raise AuditError(
        "embedding attacks need a text model fed embedding-shift rows (HFEmbeddingShiftClassifier or HFCausalLMShift)"
    )


def _unit(g: torch.Tensor, norm: str) -> torch.Tensor:
    """Steepest-ascent direction of unit size per token: sign(g) (linf) or g_p / ||g_p||_2 (l2)."""
    if norm == "linf":
        return g.sign()
    return g / g.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _project(delta: torch.Tensor, rho: torch.Tensor, norm: str) -> torch.Tensor:
    """Each token's shift back onto its ball of radius rho (n, L)."""
    r = rho.unsqueeze(-1)
    if norm == "linf":
        return torch.maximum(torch.minimum(delta, r), -r)
    n = delta.norm(dim=-1, keepdim=True)
    return delta * torch.where(n > r, r / n.clamp_min(1e-300), torch.ones_like(n))


def _draw(shape: tuple[int, ...], rho: torch.Tensor, norm: str, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Random shifts (n, L, h): ``cube`` uniform in it (linf) / ``ball`` uniform in it (l2) /
    ``sphere`` uniform on it (l2) / ``corner`` random signs at the radius."""
    h = shape[-1]
    r = rho.unsqueeze(-1)
    if kind == "corner":
        s = torch.randint(0, 2, shape, generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        return s * (r if norm == "linf" else r / math.sqrt(h))
    if norm == "linf":
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * r
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    if kind == "ball":
        z = z * (torch.rand(shape[:-1], generator=gen, dtype=torch.float64) ** (1.0 / h)).unsqueeze(-1)
    return z * r


def _delta_grad(task: Task, rows_of: Callable, delta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d l_i / d delta_i for every text (rows are independent in eval mode)."""
    shift = delta.detach().clone().requires_grad_(True)
    logits = task.logits(rows_of(shift))
    loss = as_loss(task.loss).per_sample(logits, task.targets(y, logits.dtype)).sum()
    (g,) = torch.autograd.grad(loss, shift)
    return g


def perturb_embeddings(
    task: Task,
    rows: torch.Tensor,
    y: torch.Tensor,
    *,
    method: str,
    eps: float,
    norm: str = "linf",
    steps: int = 10,
    step_size: float | None = None,
    random_start: bool = True,
    momentum: float = 1.0,
    seed: int = 0,
    memory_mb: float | None = None,
) -> EmbeddingAttackOutcome:
    """Perturb every text of ``rows`` (embedding-shift rows) against ``task`` (module docstring).

    ``eps``, ``step_size``: relative to each token's embedding norm. ``memory_mb``: the bytes of
    autograd graph one chunk of texts may hold (at most :data:`TEXT_CHUNK` texts; measured on the
    first text); None: :data:`TEXT_CHUNK` texts. Returns rows of the same shape and dtype whose ids
    are unchanged."""
    module = task.module
    if method not in EMBEDDING_ATTACKS:
        raise AuditError(f"unknown embedding attack {method!r}; use one of {', '.join(EMBEDDING_ATTACKS)}")
    if norm not in ("linf", "l2"):
        raise AuditError(f"unknown norm {norm!r}; use linf or l2")
    ids, delta0, keep, rows_of, out_rows = _layout(module, rows)
    assert isinstance(module, (HFEmbeddingShiftClassifier, HFCausalLMShift))  # _layout refuses any other
    n, L = ids.shape
    h = int(module.hidden)
    E = module.model.get_input_embeddings().weight  # type: ignore[operator]  # a transformers model's method
    rho = radii_where(E, ids, keep, eps, norm).to(rows.device)
    gen = torch.Generator().manual_seed(int(seed))
    shape = (n, L, h)
    if method == "none":
        delta = delta0.to(torch.float64).clone()
    elif method == "sign":
        delta = _draw(shape, rho.cpu(), norm, "corner", gen).to(rows.device)
    elif method == "random":
        delta = _draw(shape, rho.cpu(), norm, "cube" if norm == "linf" else "sphere", gen).to(rows.device)
    else:
        start = (
            _draw(shape, rho.cpu(), norm, "cube" if norm == "linf" else "ball", gen).to(rows.device)
            if method == "pgd" and random_start
            else torch.zeros(shape, dtype=torch.float64, device=rows.device)
        )
        relative = step_size if step_size is not None else (2.5 if method == "pgd" else 1.0) * eps / steps
        alpha = rho * (1.0 if method == "fgsm" else relative / eps)
        parts = []
        chunk = _texts_per_chunk(task, partial(rows_of, 0, 1), y[:1], start[:1], memory_mb) if n > 1 else 1
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            parts.append(
                _attack_chunk(
                    task,
                    partial(rows_of, a, b),
                    y[a:b],
                    start[a:b],
                    rho[a:b],
                    alpha[a:b],
                    method,
                    norm,
                    steps,
                    momentum,
                )
            )
        delta = torch.cat(parts)
    with torch.no_grad():
        size = delta.abs().amax(-1) if norm == "linf" else delta.norm(dim=-1)
        scale = rho / eps
        rel = torch.where(scale > 0, size / scale.clamp_min(1e-300), torch.zeros_like(size)).amax(-1)
        out = out_rows(delta).to(rows.dtype)
    return EmbeddingAttackOutcome(rows=out.reshape(rows.shape), relative_radius=rel)


def _texts_per_chunk(
    task: Task, first_rows: Callable, y: torch.Tensor, delta: torch.Tensor, memory_mb: float | None
) -> int:
    """Texts per attack graph: :data:`TEXT_CHUNK`, fewer when one text's saved tensors (the graph of
    its input gradient: a language model's logits over its vocabulary dominate) times that number
    would pass ``memory_mb``."""
    if memory_mb is None:
        return TEXT_CHUNK

    def loss() -> torch.Tensor:
        shift = delta.detach().clone().requires_grad_(True)
        logits = task.logits(first_rows(shift))
        return as_loss(task.loss).per_sample(logits, task.targets(y, logits.dtype)).sum()

    per_text = saved_tensor_bytes(loss, task.module.parameters())
    return max(1, min(TEXT_CHUNK, int(memory_mb * 2**20 // max(1, per_text))))


def _attack_chunk(
    task: Task,
    rows_of: Callable[[torch.Tensor], torch.Tensor],
    y: torch.Tensor,
    delta: torch.Tensor,
    rho: torch.Tensor,
    alpha: torch.Tensor,
    method: str,
    norm: str,
    steps: int,
    momentum: float,
) -> torch.Tensor:
    if method == "fgsm":
        g = _delta_grad(task, rows_of, delta, y).to(torch.float64)
        return _project(alpha.unsqueeze(-1) * _unit(g, norm), rho, norm)
    acc = torch.zeros_like(delta)
    for _ in range(steps):
        g = _delta_grad(task, rows_of, delta, y).to(torch.float64)
        if method == "mim":
            l1 = g.reshape(g.shape[0], -1).abs().sum(1).clamp_min(1e-300)
            acc = momentum * acc + g / l1.view(-1, 1, 1)
            g = acc
        delta = _project(delta + alpha.unsqueeze(-1) * _unit(g, norm), rho, norm)
    return delta
