"""`malleability`: how far perturbed training data moves influence rankings.

Modules, one job each:

* :mod:`.run` -- :class:`~.run.MalleabilityRequest` (the options, presets and
  :meth:`~.run.MalleabilityRequest.resolve`) and ``run``: read, plan, run, report;
* :mod:`.config` -- :class:`~.config.MalleabilityConfig`, the one resolved configuration a run
  computes from, validated once, and the settings derived from it;
* :mod:`.planning` -- refusals before any compute, the work announced and the memory planned
  through the influence estimators' own hooks;
* :mod:`.cells` -- one seed x model cell (clean model, control, attacks, influence runs);
  :mod:`.cell_tools` -- what its computations share; :mod:`.training` -- training built-in models;
* :mod:`.attacks`, :mod:`.embedding_attacks`, :mod:`.token_attacks` -- the perturbations;
* :mod:`.stability` -- flip rate, rank correlation, top-k overlap, summaries over seeds;
* :mod:`.aggregate` -- summaries, floors, ratios, the loss gate; :mod:`.verdicts` -- warnings and verdicts;
* :mod:`.malleability` -- :func:`~.malleability.run_malleability`, the protocol on a fixed split;
* :mod:`.report` -- tables and figure.
"""
