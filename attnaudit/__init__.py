"""attnaudit: audit attention models through the neural tangent kernel (NTK) lens.

The public Python API mirrors the CLI: every command is a plain function that takes
tensors and a small config dataclass and returns a result dataclass with ``to_dict()``.
"""

__version__ = "0.1.0"
