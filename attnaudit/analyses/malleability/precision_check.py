"""The float64 spot check of a malleability run at a lower precision.

The influence computation (the run's heavy part) is repeated on a subsample -- the first
:data:`CHECK_TRAIN_ROWS` training rows and :data:`CHECK_TEST_ROWS` held-out rows, the first
damping, the clean model of the first seed -- once at the run's precision and once in float64,
with every other setting the run's own. The score matrices (test row x training row) are compared
by :func:`attnaudit.core.precision.compare`: Spearman over all scores and the worst test row's,
and the relative error. The subsample defines its own curvature (it is a smaller training set),
so the check measures the numerics of the pipeline on this model and data, not the run's scores.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from attnaudit.analyses.influence.influence import influence_sweep
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.core.precision import PrecisionCheck, compare

#: the check runs influence twice on these rows, once in float64 (DeiT-tiny, EK-FAC, 2 cores: 133 s at
#: 256 rows, 16 % of its malleability audit)
CHECK_TRAIN_ROWS = 64
CHECK_TEST_ROWS = 8


def influence_precision_check(
    model: Any,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    config: MalleabilityConfig,
    n_classes: int,
) -> PrecisionCheck:
    """Per-test influence scores on the subsample at ``config.precision`` against float64."""
    m, t = min(int(X_train.shape[0]), CHECK_TRAIN_ROWS), min(int(X_test.shape[0]), CHECK_TEST_ROWS)
    rows = (X_train[:m], y_train[:m], X_test[:t], y_test[:t])
    # both sides computed afresh: the check neither reads nor writes the run's gradient store
    low = dataclasses.replace(
        config.influence, per_test=True, store=None, store_executor="local", ray_address=None, store_workers=None
    )
    t0 = time.perf_counter()
    scores = []
    for cfg in (low, dataclasses.replace(low, dtype="float64")):
        (res,) = influence_sweep(model, *rows, cfg, loss=config.loss, n_classes=n_classes, dampings=config.damping[:1])
        assert res.per_test is not None  # per_test=True
        scores.append(res.per_test.T)  # (test, train)
    return compare(
        scores[0],
        scores[1],
        quantity="influence scores",
        precision=config.precision,
        subsample={"train_rows": m, "test_rows": t, "damping": config.damping[0], "estimator": config.estimator},
        rows=True,
        seconds=time.perf_counter() - t0,
    )
