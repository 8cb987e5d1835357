"""Influence estimators (a shared part of the analyses): exact, last-layer, CG, TracIn, K-FAC/EK-FAC, projected.

The interface is :mod:`attnaudit.analyses.influence.influence` (``InfluenceConfig``,
``compute_influence``, ``influence_sweep``); the sign convention and the estimators'
mathematics are in its docstring. Each estimator is a class in
:mod:`attnaudit.analyses.influence.estimators`, found by name in the registry
``ESTIMATORS: dict[str, type[Estimator]]``.

Estimator protocol
------------------
``influence_sweep`` owns everything the estimators share: the tracked parameters, the
engine (or a cached-feature fast path), the memory plan and chunk size, the test
gradients B (k, P) -- one row per test point, or one for the summed test loss -- and the
streaming of per-sample training gradients g, each scored -map(g) . s for every
transformed test gradient s. An estimator only says how B is transformed:

* ``prepare(context) -> state``: once per model (per checkpoint for TracIn); fits the
  curvature (a Hessian and its decomposition, K-FAC factors, a projected Hessian). The
  :class:`~attnaudit.analyses.influence.estimators.base.Context` holds the config, the
  engine, the prepared training rows and targets, B, the dampings as given, the chunk
  size and ``hvp`` (Hessian-vector products, built on first use). The returned
  :class:`~attnaudit.analyses.influence.estimators.base.State` carries ``info`` (diagnostics
  shared by every damping) and ``train_map`` (applied to each chunk of training gradients,
  e.g. a random projection; None for the identity).
* ``solve(state, damping) -> Solution``: the transformed test gradients for one damping as
  given (a float, or ``"<m>x"`` for m x lambda_max(H); None when ``uses_damping`` is
  False), with the absolute damping used, per-damping diagnostics and warnings.
* memory, before any compute (:func:`~attnaudit.analyses.influence.influence.plan_influence`, the
  one planner, asks one estimator instance, the one that then runs, with the run's config):
  ``memory_parts(query) -> dict[str, int]``: bytes of the estimator's own structures
  (added to the shared terms of ``influence_memory``); ``factor_bytes(engine)``: sizes
  fitted factors before any compute; ``check_budget(P, max_exact_params, itemsize)`` and
  ``check_params(params)``: refusals (AuditError) before any compute.
* class attributes: ``name`` (what ``--estimator`` takes), ``uses_damping`` (False: one
  result whatever the dampings), ``tracks_parameters`` (a fixed selector such as ``"head"``,
  else None), ``curvatures`` (the ``--curvature`` values taken, with what each means),
  ``allows_fast_path``, ``uses_checkpoints`` (evaluated at weighted training checkpoints),
  ``budget_hint`` (advice when the memory budget is too small).

Adding an estimator: a module in ``estimators/`` with a subclass of
:class:`~attnaudit.analyses.influence.estimators.base.Estimator` decorated with
``@register``, and one import line in ``estimators/__init__.py`` (whose order is the
order shown to the user). Importing this package imports nothing heavy.
"""
