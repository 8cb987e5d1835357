"""Report layer shared by every command: the JSON envelope, JSON writing, environment capture.

Every JSON report has the same envelope::

    {"schema": "attnaudit.<command>/<version>", "attnaudit_version": ..., "created": ISO-8601 UTC,
     "inputs": {...}, "seeds": ..., "environment": {...}, "timings_s": {...},
     "results": {...}, "verdicts": [...], "warnings": [...]}

Non-finite floats are not valid JSON, so they are written as ``null``; result dicts that
need to distinguish "infinite" from "missing" carry an explicit flag or string beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from attnaudit import __version__
from attnaudit.runtime.atomic import temp_path_for, write_text_atomic
from attnaudit.errors import AuditError
from attnaudit.runtime.threads import threads_rule


class Record:
    """Mixed into a dataclass whose report form is its fields: :meth:`to_dict` is
    :func:`dataclasses.asdict` (nested dataclasses become dicts too)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # the class is a dataclass


def to_jsonable(obj: Any) -> Any:
    """Convert results to JSON-safe values: tensors/arrays to lists, non-finite floats to None."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return to_jsonable(float(obj))
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (torch.device, torch.dtype, Path)):
        return str(obj).replace("torch.", "")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict"):
            return to_jsonable(obj.to_dict())
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    return str(obj)


def environment_info(device: torch.device | str | None = None, dtype: str | None = None) -> dict:
    """Package versions, platform, device name and thread count (with ``threads_rule``: why
    that count, see attnaudit/runtime/threads.py), for reproducibility."""
    import scipy

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "attnaudit": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads_rule": threads_rule(),
        "cpu_count": os.cpu_count(),
        "device": str(device) if device is not None else "cpu",
        "dtype": dtype,
    }
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def build_report(
    schema: str,
    *,
    inputs: dict,
    seeds: Any,
    device: torch.device | str | None,
    dtype: str | None,
    timings: dict[str, float],
    results: dict,
    warnings: Iterable[str] = (),
    verdicts: Iterable[str] = (),
    request: Any = None,
    command: str | None = None,
) -> dict:
    """The versioned JSON envelope (see module docstring), already JSON-safe.

    ``request`` (an :class:`attnaudit.analyses.request.Request`) records the request's
    options and the command line derived from it (None when it holds in-memory objects);
    ``command`` is the command line of a report without a request."""
    recorded = None
    if request is not None:
        recorded = {"command": request.COMMAND, "options": request.to_dict()}
        try:
            command = request.command_line()
        except AuditError:
            command = None  # in-memory data or models: no command line reproduces the run
    payload = {
        "schema": schema,
        "attnaudit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **({"request": recorded} if recorded is not None else {}),
        "inputs": inputs,
        "seeds": seeds,
        "environment": environment_info(device, dtype),
        "timings_s": timings,
        "results": results,
        "verdicts": list(verdicts),
        "warnings": list(warnings),
    }
    return to_jsonable(payload)


def read_json_file(path: str | Path, label: str, fix: str, max_bytes: int | None = None) -> Any:
    """The parsed JSON in ``path``, or an :class:`AuditError` that names ``label`` (how the
    user gave the file) and ``fix``: missing file, too large, not UTF-8 or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise AuditError(f"{label}: no such file; {fix}")
    if max_bytes is not None and p.stat().st_size > max_bytes:
        raise AuditError(f"{label} is larger than {max_bytes // 2**20} MB, too large for what it should be; {fix}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AuditError(f"{label}: not valid JSON ({exc.__class__.__name__}); {fix}") from None


def dumps(payload: dict) -> str:
    """Strict JSON text (NaN/inf already mapped to null)."""
    return json.dumps(to_jsonable(payload), indent=2, allow_nan=False)


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (None when they can), found by trying.

    Permission bits alone mislead (root ignores them; read-only mounts ignore them the
    other way), so a probe file is created and removed.
    """
    if not folder.exists():
        return f"folder {folder} does not exist; create it or choose another path"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder; choose another path"
    try:
        probe = temp_path_for(folder / "probe")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or exc.__class__.__name__
        return f"cannot write into folder {folder} ({reason}); choose a writable folder"
    return None


def check_target(path: str | Path, overwrite: bool) -> Path:
    """Refuse to clobber a user's file unless ``overwrite``; the parent must be a writable folder."""
    target = Path(path)
    if target.is_dir():
        raise AuditError(f"{target} is a directory; give a file path")
    # Only regular files hold user data; devices and pipes (/dev/null, /dev/stdout) are fine.
    if target.is_file() and not overwrite:
        raise AuditError(f"{target} already exists; pass --overwrite or choose another path")
    if target.exists() and not target.is_file():
        return target
    problem = folder_problem(target.parent)
    if problem:
        raise AuditError(problem)
    return target


def write_json(payload: dict, path: str | Path, overwrite: bool = False) -> None:
    """Write the report to ``path`` atomically; ``'-'`` writes to standard output (and nothing else should)."""
    text = dumps(payload)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    target = check_target(path, overwrite)
    write_text_atomic(target, text + "\n")
