"""Planning a malleability run: one memory planner (the estimators' own hooks, with the run's
settings), the work it announces, and the configuration it runs from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnaudit.analyses.influence.estimators import ESTIMATORS
from attnaudit.analyses.influence.influence import compute_influence, plan_influence
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.analyses.malleability.planning import plan_memory, progress_total
from attnaudit.analyses.malleability.run import MalleabilityRequest
from attnaudit.core.task import Task


def _net(hidden: int = 50) -> Task:
    torch.manual_seed(0)
    return Task(nn.Sequential(nn.Linear(20, hidden), nn.Tanh(), nn.Linear(hidden, 3)).double(), 3, "ce")


def _saved(**kw) -> MalleabilityConfig:
    return MalleabilityConfig(models=("net",), saved_models=True, protocol="static", controls=False, **kw)


def test_the_memory_budget_reaches_the_influence_settings_built_once():
    config = MalleabilityConfig(memory_budget=3000, cache="factors")
    assert config.influence.memory_budget_mb == 3000 and config.influence.cache_dir == "factors"
    assert config.influence is config.influence  # derived once, then passed down


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_every_registered_estimator_answers_the_planner(estimator):
    X = torch.randn(40, 20, dtype=torch.float64)
    config = _saved(estimator=estimator, params=None if estimator == "last-layer" else "all")
    plan = plan_memory(config, X, 5, 3, {"net": _net()})
    assert plan["bytes"]["total"] > 0 and plan["tracked_parameters"] > 0
    assert plan["tracked_parameter_names"]["net"]


def test_the_projected_estimate_depends_on_proj_dim():
    X = torch.randn(40, 20, dtype=torch.float64)
    small, large = (
        plan_memory(_saved(estimator="projected", params="all", proj_dim=k), X, 5, 3, {"net": _net()}) for k in (8, 128)
    )
    assert small["bytes"]["projected_rows"] < large["bytes"]["projected_rows"]
    assert small["bytes"]["total"] < large["bytes"]["total"]


@pytest.mark.parametrize("estimator", ["ekfac", "projected", "exact"])
def test_the_estimate_is_the_plan_the_influence_run_makes(estimator):
    """One planner: what the run announces before any compute is what its influence run plans."""
    X, y = torch.randn(40, 20, dtype=torch.float64), torch.randint(0, 3, (40,))
    config = _saved(estimator=estimator, params="all", proj_dim=32)
    plan = plan_memory(config, X, 5, 3, {"net": _net()})
    res = compute_influence(_net(), X, y, X[:5], y[:5], config.influence)
    assert plan["bytes"] == res.diagnostics["memory_estimate_bytes"]


def test_the_estimate_fits_the_chunk_to_the_budget_and_counts_what_kfac_captures():
    X = torch.randn(40, 20, dtype=torch.float64)
    est = plan_memory(_saved(estimator="ekfac", params="all"), X, 5, 3, {"net": _net()})
    # per row: the largest layer's gradient (50 x 21) and the captures (2 (21 + 50) + 2 (51 + 3))
    assert est["bytes"]["gradient_chunk"] == 40 * (50 * 21 + 250) * 8
    wide = _net(400)
    X = torch.randn(2000, 20, dtype=torch.float64)
    roomy, tight = (
        plan_memory(_saved(estimator="ekfac", params="all", memory_budget=b), X, 100, 3, {"net": wide})["bytes"]
        for b in (2048, 20)
    )
    assert tight["gradient_chunk"] < roomy["gradient_chunk"] and tight["total"] <= 20 * 2**20
    assert roomy == plan_influence(wide, X, 100, _saved(estimator="ekfac", params="all").influence).bytes


def test_the_request_resolves_one_configuration_under_its_own_names():
    request = MalleabilityRequest(seed=4, seeds=2, memory_budget=512.0, cache="c", top_k=(10, 30))
    config = request.resolve()
    assert config is request.resolve()  # built once, at construction
    assert config.seeds == (4, 5) and config.memory_budget == 512.0 and config.cache == "c"
    assert (config.top_k, config.top_ks) == (10, (10, 30))
    assert progress_total(config) == 2 * 2 * (1 + 1 + 4)
