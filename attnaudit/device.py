"""Device and dtype selection, done once and passed down."""

from __future__ import annotations

import torch

from .errors import AuditError


def resolve_device(spec: str = "auto") -> torch.device:
    """Map ``auto|cpu|cuda|cuda:i`` to a torch device; ``auto`` picks CUDA when present."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise AuditError(
                f"--device {spec}: CUDA is not available on this machine; use --device cpu or --device auto"
            )
        if ":" in spec:
            try:
                index = int(spec.split(":", 1)[1])
            except ValueError:
                raise AuditError(f"--device {spec}: bad device index; use cuda:0, cuda:1, ...") from None
            if index >= torch.cuda.device_count():
                raise AuditError(
                    f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) present; use cuda:0"
                )
        return torch.device(spec)
    raise AuditError(f"--device {spec!r} is not recognised; use auto, cpu, cuda or cuda:<index>")


def resolve_dtype(spec: str = "float64") -> torch.dtype:
    """Map ``float32|float64`` to a torch dtype."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}
    try:
        return table[spec.strip().lower()]
    except KeyError:
        raise AuditError(f"--dtype {spec!r} is not recognised; use float32 or float64") from None
