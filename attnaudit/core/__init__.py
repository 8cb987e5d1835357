"""Model-agnostic core: the audit :class:`Task`, the functional :class:`Engine` built from it,
and the linear algebra every analysis shares (Lanczos, Hutchinson, conjugate gradients)."""

from attnaudit.core.cg import batched_cg
from attnaudit.core.engine import Engine, HessianVectorProduct, math_attention
from attnaudit.core.linalg import EigenResult, TraceResult, hutchinson_trace, lanczos_top_eigen
from attnaudit.core.task import (
    CrossEntropyLoss,
    Inputs,
    Loss,
    MSELoss,
    Task,
    as_loss,
    as_task,
    eval_mode,
    head_parameter_names,
    select_parameter_names,
    to_logits,
)

__all__ = [
    "CrossEntropyLoss",
    "EigenResult",
    "Engine",
    "HessianVectorProduct",
    "Inputs",
    "Loss",
    "MSELoss",
    "Task",
    "TraceResult",
    "as_loss",
    "as_task",
    "batched_cg",
    "eval_mode",
    "head_parameter_names",
    "hutchinson_trace",
    "lanczos_top_eigen",
    "math_attention",
    "select_parameter_names",
    "to_logits",
]
