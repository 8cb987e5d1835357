"""Loss landscape: filter-normalized directions, 1-D/2-D surfaces, Hessian spectra, basin width.

Modules, one job each:

* :mod:`.setup` -- the task analysed (any module or :class:`~attnaudit.core.task.Task`) and its engine;
* :mod:`.directions` -- filter-normalized random directions, Hessian eigenvector directions;
* :mod:`.evaluate` -- loss and accuracy at many points (generic engine path);
* :mod:`.structured` -- the declared fast path for the built-in two-layer nets;
* :mod:`.surfaces` -- 1-D and 2-D surfaces; :mod:`.basin` -- the basin width;
* :mod:`.analysis` -- :class:`LandscapeConfig`, :class:`LandscapeResult`, :func:`analyse_landscape`;
* :mod:`.compare` -- verdicts and warnings comparing models (10 % loss gate, seed tolerances, untrained rule);
* :mod:`.reference` -- the built-in reference models (2L-ReLU, MLP-Attn) and their training;
* :mod:`.pipeline` -- :func:`run_landscape`: train or take saved models, analyse, compare;
* :mod:`.run` -- :class:`LandscapeRequest`, its resolved :class:`LandscapeSetup` and ``run``;
* :mod:`.report` -- table and figure.

Lanczos and Hutchinson live in :mod:`attnaudit.core.linalg` (re-exported here); the
Hessian-vector products are the engine's (:meth:`attnaudit.core.engine.Engine.hvp_operator`).
"""

from attnaudit.core.linalg import EigenResult, TraceResult, hutchinson_trace, lanczos_top_eigen
from attnaudit.analyses.landscape.analysis import LandscapeConfig, LandscapeResult, analyse_landscape
from attnaudit.analyses.landscape.basin import BasinResult, basin_width
from attnaudit.analyses.landscape.compare import (
    EOS_SHARE,
    LOSS_MISMATCH_RATIO,
    RESOLVE_SE,
    compare_landscapes,
    loss_mismatch_warning,
    untrained_status,
    untrained_threshold,
)
from attnaudit.analyses.landscape.directions import (
    DIRECTION_KINDS,
    Params,
    eigenvector_direction,
    filter_normalize,
    params_norm,
    random_direction,
)
from attnaudit.analyses.landscape.evaluate import (
    BACKENDS,
    FAST_PATH,
    GENERIC_PATH,
    PointEval,
    SurfaceEvaluator,
    build_evaluator,
    evaluate_points,
    loss_and_accuracy,
    state_dict_loop,
)
from attnaudit.analyses.landscape.pipeline import LandscapeRun, run_landscape, run_work_units
from attnaudit.analyses.landscape.reference import ARCHS, build_reference_model, train_reference_model
from attnaudit.analyses.landscape.setup import ParameterSelectionError, landscape_engine, landscape_task
from attnaudit.analyses.landscape.surfaces import Surface1D, Surface2D, loss_surface_1d, loss_surface_2d, symmetric_grid

__all__ = [
    "ARCHS",
    "BACKENDS",
    "BasinResult",
    "DIRECTION_KINDS",
    "EOS_SHARE",
    "EigenResult",
    "FAST_PATH",
    "GENERIC_PATH",
    "LOSS_MISMATCH_RATIO",
    "RESOLVE_SE",
    "LandscapeConfig",
    "LandscapeResult",
    "LandscapeRun",
    "ParameterSelectionError",
    "Params",
    "PointEval",
    "Surface1D",
    "Surface2D",
    "SurfaceEvaluator",
    "TraceResult",
    "analyse_landscape",
    "basin_width",
    "build_evaluator",
    "build_reference_model",
    "compare_landscapes",
    "eigenvector_direction",
    "evaluate_points",
    "filter_normalize",
    "hutchinson_trace",
    "landscape_engine",
    "landscape_task",
    "lanczos_top_eigen",
    "loss_and_accuracy",
    "loss_mismatch_warning",
    "loss_surface_1d",
    "loss_surface_2d",
    "params_norm",
    "random_direction",
    "run_landscape",
    "run_work_units",
    "state_dict_loop",
    "symmetric_grid",
    "train_reference_model",
    "untrained_status",
    "untrained_threshold",
]
