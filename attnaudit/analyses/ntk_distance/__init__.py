"""``ntk-distance``: how far finite networks are from their kernel regime.

Modules, one job each:

* :mod:`.config` -- the analyses' configurations and the one resolved configuration of a run;
* :mod:`.planning` -- the sweeps' cells, the memory of the widest cell, each seed's rows;
* :mod:`.cells` -- one cell of the 2-layer width sweep (a model x width x seed trained and measured);
* :mod:`.widths` -- the 2-layer width sweep against the infinite-width NTK predictor;
* :mod:`.aggregate` -- statistics over seeds and widths; :mod:`.verdicts` -- trends and verdicts;
* :mod:`.movement` -- the kernel movement of a trained model (eNTK per parameter group),
  :mod:`.layerwise` its layer-by-layer plan, :mod:`.linearized` -- the linearized model;
* :mod:`.checkpoint` -- a trained model against its initialization;
* :mod:`.language` -- a causal language model's kernel (its documents' log-likelihood eNTK);
* :mod:`.transformers` -- the width sweep of the built-in transformers;
* :mod:`.report` -- tables and figures;
* :mod:`.run` -- :class:`~.run.NtkDistanceRequest` and :func:`~.run.run`.
"""
