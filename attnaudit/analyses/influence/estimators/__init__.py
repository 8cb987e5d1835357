"""The registry of influence estimators: name -> class (protocol: :mod:`attnaudit.analyses.influence`).

Each module below registers its estimators with ``@register``. Adding an estimator is one
module in this folder and one import line here; the order of these lines is the order of
:data:`ESTIMATORS`, the order shown to the user.
"""

from attnaudit.analyses.influence.estimators.base import *  # noqa: F403  the protocol: base.__all__
from attnaudit.analyses.influence.estimators.base import __all__ as __all__
from attnaudit.analyses.influence.estimators import exact  # noqa: E402,F401  exact, last-layer
from attnaudit.analyses.influence.estimators import cg  # noqa: E402,F401  cg
from attnaudit.analyses.influence.estimators import tracin  # noqa: E402,F401  tracin
from attnaudit.analyses.influence.estimators import kronecker  # noqa: E402,F401  kfac, ekfac
from attnaudit.analyses.influence.estimators import projected  # noqa: E402,F401  projected
