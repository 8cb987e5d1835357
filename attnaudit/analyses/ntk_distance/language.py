"""The kernel of a causal language model: the eNTK of each document's log-likelihood of its targets.

The eNTK of the logits has n L V outputs (V = 50,257 for GPT-2), out of reach. The kernel movement
of a language model therefore uses one scalar per document, the same function at both checkpoints:

    f_theta(doc) = sum_t w_t log p_theta(next_t | tokens 0..t)

the log-likelihood (nats) of the document's own counted next tokens, with the weights w_t and the
next ids of its targets Y (:mod:`attnaudit.core.lm_rows`; padding and uncounted prompt tokens
have w_t = 0). The kernel is K_ij = <grad_theta f(doc_i), grad_theta f(doc_j)>, an n x n matrix
(c = 1 output). Since the per-document loss is the mean next-token cross-entropy
l_i = -f(doc_i) / count_i (count_i = sum_t w_t), grad f(doc_i) = -count_i grad l_i: the kernel
is that of the per-document loss gradients, each scaled by its number of counted tokens. The
targets are fixed data, so comparing two checkpoints measures only how the Jacobian of the
log-likelihood changed.

:class:`DocumentLogLikelihood` wraps the model as a module of document rows [X | Y] (n, 4L) with
one output, f; :func:`likelihood_tasks` wraps a pair of language-model tasks, their rows and their
parameter groups (the default rule of :func:`~.movement.group_of` on the model's own parameter
names), so :func:`~.movement.kernel_movement` runs on it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attnaudit.analyses.ntk_distance.movement import group_of
from attnaudit.core.lm_rows import pack_rows, pack_targets, split_rows, split_targets
from attnaudit.core.task import Inputs, NextTokenLoss, Task, as_loss, to_logits
from attnaudit.errors import AuditError

#: the name the wrapped model's parameters are prefixed with in :class:`DocumentLogLikelihood`
PREFIX = "lm."
KERNEL_LM = (
    "eNTK of each document's log-likelihood of its own targets, f(doc) = sum_t w_t log p(next_t | tokens <= t) "
    "(nats; next ids and weights w from the targets, so padding and uncounted prompt tokens add nothing): "
    "K_ij = <grad_theta f(doc_i), grad_theta f(doc_j)>, one output per document (c = 1). f(doc_i) = -count_i "
    "l_i with l_i the document's mean next-token cross-entropy and count_i = sum_t w_t, so grad f = -count_i "
    "grad l_i. The targets are fixed, so the movement measures only the change of the Jacobian. The logits' "
    "eNTK (n L V outputs) is out of reach for real vocabularies"
)
KERNEL_LOGITS = "eNTK of the logits: Theta[i, j, a, b] = J_a(x_i) . J_b(x_j) over the c outputs"
LOSS_LM = "next-token cross-entropy"
NO_LINEARIZED_LM = (
    "not applicable to language models: the linearized comparator trains on class labels and reports accuracy, "
    "and a language model's kernel here is that of a scalar log-likelihood per document, not of its logits"
)


def is_language_model(task: Task | nn.Module) -> bool:
    """Whether ``task`` is a causal language model's (its loss is the next-token cross-entropy)."""
    return isinstance(task, Task) and isinstance(as_loss(task.loss), NextTokenLoss)


class DocumentLogLikelihood(nn.Module):
    """f(doc) = sum_t w_t log p(next_t | tokens <= t) of a causal language model, per document.

    ``forward(rows)``: rows (n, 4L) = [ids | attention | next ids | weights] (the document rows X
    and targets Y of :mod:`attnaudit.core.lm_rows` side by side) -> (n, 1) log-likelihoods in
    nats. The model is registered as ``lm`` (its parameters are named ``lm.<name>``) and called
    with X through its input adapter; its logits (n, L, V) are read in their own dtype.
    """

    def __init__(self, lm: nn.Module, inputs: Inputs | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.lm_inputs = inputs or Inputs()

    def audit_inputs(self) -> Inputs:
        return Inputs()

    @property
    def trim_padding(self) -> bool:
        """The model's own: when it drops trailing padding per batch, the engine probes and orders
        rows by their real length (:meth:`token_mask`), so a probe row is a longest document."""
        return bool(getattr(self.lm, "trim_padding", False))

    def token_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, L) bool: the real tokens of rows (n, 4L) (the attention block of their documents X)."""
        rows = rows if rows.ndim == 2 else rows.unsqueeze(0)
        return split_rows(rows[:, : rows.shape[-1] // 2])[1]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.ndim == 1:
            rows = rows.unsqueeze(0)
        if rows.shape[-1] % 4:
            raise AuditError(
                f"document rows for the log-likelihood are (n, 4L) = [ids | attention | next ids | weights], got "
                f"{rows.shape[-1]} columns; build them with document_rows(X, Y)"
            )
        half = rows.shape[-1] // 2
        X, Y = rows[:, :half], rows[:, half:]
        logits = to_logits(self.lm_inputs.call(self.lm, self.lm_inputs(X)), 3)
        next_ids, weights = split_targets(Y)
        log_p = torch.log_softmax(logits, dim=-1).gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
        return (weights.to(log_p.dtype) * log_p).sum(-1, keepdim=True)


def document_rows(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """[X | Y] (n, 4L') for documents X (n, 2L) and their targets Y (n, 2L), cut to L' = the
    longest document's real length: the columns after it are padding in every row and carry
    weight 0 (weight t counts the token at t + 1), so f is unchanged and the per-row Jacobians,
    which ``vmap`` computes at the rows' full width, cost no padding beyond the longest document."""
    if X.ndim != 2 or Y.shape != X.shape:
        raise AuditError(
            f"documents X and targets Y must both be (n, 2L), got {tuple(X.shape)} and {tuple(Y.shape)}; "
            "build them with attnaudit.core.lm_rows"
        )
    ids, attention = split_rows(X)
    next_ids, weights = split_targets(Y)
    used = attention | (weights != 0)
    positions = torch.arange(1, used.shape[1] + 1, device=used.device)
    keep = max(1, int((used.long() * positions).amax()))
    return torch.cat(
        [
            pack_rows(ids[:, :keep], attention[:, :keep], X.dtype),
            pack_targets(next_ids[:, :keep], weights[:, :keep], Y.dtype),
        ],
        dim=1,
    )


def likelihood_task(task: Task) -> Task:
    """The task of ``task``'s document log-likelihood (:class:`DocumentLogLikelihood`), one output."""
    return Task(DocumentLogLikelihood(task.module, task.inputs), 1, "mse", Inputs(), name=f"{task.name} log-likelihood")


def likelihood_groups(task: Task, probe: torch.Tensor) -> dict[str, Sequence[str]]:
    """The parameter groups of a :func:`likelihood_task`: :func:`~.movement.group_of` of the model's
    own parameter names (without :data:`PREFIX`), so they read as a classifier's would."""
    groups: dict[str, list[str]] = {}
    for name in task.parameter_names(probe):
        groups.setdefault(group_of(name.removeprefix(PREFIX)), []).append(name)
    return dict(groups)


def likelihood_tasks(
    task_trained: Task, task_init: Task | nn.Module, X: torch.Tensor, Y: torch.Tensor | None
) -> tuple[Task, Task, torch.Tensor, dict[str, Sequence[str]]]:
    """(trained, initial, rows, groups) for :func:`~.movement.kernel_movement` of two language
    models: both wrapped as :func:`likelihood_task`, the rows :func:`document_rows` of the
    documents X and their targets Y, the groups :func:`likelihood_groups`."""
    if Y is None:
        raise AuditError("a language model's kernel needs the documents' next-token targets; give documents")
    if not isinstance(task_init, Task):
        raise AuditError("give the initial language model as a Task with the next-token loss, like the trained one")
    rows = document_rows(X, Y)
    trained, init = likelihood_task(task_trained), likelihood_task(task_init)
    return trained, init, rows, likelihood_groups(trained, rows[:1])
