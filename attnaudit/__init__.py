"""attnaudit: audit attention models through the neural tangent kernel (NTK) lens.

The public Python API mirrors the CLI: every command is a plain function that takes
tensors and a small config dataclass and returns a result dataclass with ``to_dict()``.
"""

__version__ = "0.1.0"

import warnings as _warnings

# torch's forward-mode AD (Hessian-vector products) loads a jit-scripted decomposition table
# on first use and warns about torch's own deprecated API; nothing a user of this tool can act on.
_warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*deprecated", category=FutureWarning)
