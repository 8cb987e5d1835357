"""``tracin``: -sum_t w_t g_test(theta_t) . g_train(theta_t) over training checkpoints (no
curvature, no damping)."""

from __future__ import annotations

from attnaudit.analyses.influence.estimators.base import Estimator, Solution, State, register

__all__ = ["TracIn", "tracin_weights"]


@register
class TracIn(Estimator):
    """The identity curvature at every checkpoint; the sweep weights and sums the checkpoints."""

    name = "tracin"
    uses_damping = False
    uses_checkpoints = True

    def solve(self, state: State, damping: float | str | None) -> Solution:
        return Solution(state.context.test_grads, None)


def tracin_weights(n_checkpoints: int, every: int, steps_run: int, lr: float) -> list[float]:
    """Weights for checkpoints saved by :func:`attnaudit.core.training.train` every ``every`` steps.

    Checkpoint j was taken before step j*every and stands for the GD steps
    j*every .. min((j+1)*every, steps_run) - 1, so its weight is lr times their number; a
    final snapshot taken after the last step stands for no step (weight 0).
    """
    return [lr * max(0, min(every, steps_run - j * every)) for j in range(n_checkpoints)]
