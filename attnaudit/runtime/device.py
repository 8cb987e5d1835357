"""Device and dtype selection, done once and passed down."""

from __future__ import annotations

import torch

from attnaudit.errors import AuditError, FieldError, literal


def resolve_device(spec: str = "auto") -> torch.device:
    """Map ``auto|cpu|cuda|cuda:i`` to a torch device; ``auto`` picks CUDA when present. A device
    that cannot be used is a :class:`FieldError` on the ``device`` field."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        named = "{name} " + literal(spec)
        if not torch.cuda.is_available():
            raise FieldError("device", named + ": CUDA is not available on this machine; use {name} cpu or {name} auto")
        if ":" in spec:
            try:
                index = int(spec.split(":", 1)[1])
            except ValueError:
                raise FieldError("device", named + ": bad device index; use cuda:0, cuda:1, ...") from None
            if index >= torch.cuda.device_count():
                raise FieldError(
                    "device", named + f": only {torch.cuda.device_count()} CUDA device(s) present; use cuda:0"
                )
        return torch.device(spec)
    raise FieldError(
        "device", "{name} " + literal(repr(spec)) + " is not recognised; use auto, cpu, cuda or cuda:<index>"
    )


def resolve_dtype(spec: str = "float64") -> torch.dtype:
    """Map ``float32|float64`` to a torch dtype (another name: a :class:`FieldError` on ``dtype``)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}
    try:
        return table[spec.strip().lower()]
    except KeyError:
        raise FieldError(
            "dtype", "{name} " + literal(repr(spec)) + " is not recognised; use float32 or float64"
        ) from None


def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory free for new tensors on ``device`` in bytes (None when it cannot be read).

    CUDA: the driver's free memory. CPU: ``MemAvailable`` from /proc/meminfo (Linux), else
    the free physical pages reported by ``os.sysconf``.
    """
    import os

    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            free, _total = torch.cuda.mem_get_info(dev)
            return int(free)
        except Exception:  # noqa: BLE001 - no driver answer: nothing to compare with
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def refuse_if_too_big(needed_bytes: float, device: torch.device | str, what: str, fix: str, share: float = 0.8) -> None:
    """Raise :class:`AuditError` before any compute when ``needed_bytes`` exceeds ``share`` of free memory."""
    free = available_memory_bytes(device)
    if free is None or needed_bytes <= share * free:
        return
    raise AuditError(
        f"{what} needs about {needed_bytes / 2**30:,.1f} GiB of memory, more than the {free / 2**30:,.1f} GiB free on "
        f"{torch.device(device)}; {fix}"
    )
