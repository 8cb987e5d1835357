"""Model-agnostic core: the audit :class:`Task` and the functional :class:`Engine` built from it."""

from .engine import Engine, HessianVectorProduct, math_attention
from .task import CrossEntropyLoss, Inputs, Loss, MSELoss, Task, as_loss, eval_mode, select_parameter_names, to_logits

__all__ = [
    "CrossEntropyLoss", "Engine", "HessianVectorProduct", "Inputs", "Loss", "MSELoss", "Task", "as_loss",
    "eval_mode", "math_attention", "select_parameter_names", "to_logits",
]
