"""Reading weight files a user hands in, and checking them against a module.

Every file is untrusted. ``.safetensors`` is the default and only format read without
asking: it holds raw tensors and cannot run code. Pickle-based files (``.pt``, ``.pth``,
``.bin``, ``.ckpt``) can execute arbitrary code while they are read; they are refused
unless the caller passes ``trust_pickle=True`` (``--trust-pickle``), and even then they are
read with ``torch.load(weights_only=True)``, torch's restricted unpickler, which builds
tensors and plain containers only.

:func:`match_state_dict` compares a file's tensors with what a module holds (names,
shapes, dtypes, finiteness) and raises one :class:`AuditError` line naming the problem
before anything is loaded into the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from attnaudit.errors import AuditError, FieldError, clip_text as _clip, key_mismatch, literal, name_list as _names

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
SAFE_SUFFIXES = (".safetensors",)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pickle_refusal(path: Path, what: str = "weights", field: str | None = None) -> AuditError:
    """The one message for a pickle-based file given without ``--trust-pickle``: about ``what``,
    or a :class:`FieldError` on ``field`` when a request field named the file."""
    rest = (
        f" {path} is a pickle-based file ({path.suffix}): loading it can run arbitrary code; convert it to "
        "safetensors, or pass --trust-pickle if you trust its author (it is then read with torch.load(weights_only=True))"
    )
    return AuditError(what + rest) if field is None else FieldError(field, "{name}" + literal(rest))


def read_weights(path: str | Path, *, trust_pickle: bool = False, what: str = "weights") -> dict[str, torch.Tensor]:
    """Tensors of a weights file, on the CPU, keyed by parameter/buffer name.

    ``.safetensors``: read with safetensors (a truncated or corrupted file is an
    :class:`AuditError`). Pickle formats: refused unless ``trust_pickle``, then
    ``torch.load(weights_only=True)``; a dict holding a ``state_dict``/``model`` entry is
    unwrapped; anything that is not a flat mapping of names to tensors is refused.
    """
    path = Path(path)
    if not path.exists():
        raise AuditError(f"{what} {path} not found; check the path")
    if path.is_dir():
        raise AuditError(f"{what} {path} is a folder; give the weights file inside it")
    suffix = path.suffix.lower()
    if suffix in SAFE_SUFFIXES:
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
            raise AuditError(
                f"{what} {path} is not a readable .safetensors file (truncated or corrupted? "
                f"{type(exc).__name__}: {_clip(exc)}); re-save it"
            ) from None
    if suffix in PICKLE_SUFFIXES:
        if not trust_pickle:
            raise pickle_refusal(path, what)
        return _read_trusted_pickle(path, what)
    raise AuditError(
        f"{what} {path}: unknown weights format {suffix or '(no suffix)'}; give a .safetensors file "
        f"(or, with --trust-pickle, one of {', '.join(PICKLE_SUFFIXES)})"
    )


def _read_trusted_pickle(path: Path, what: str) -> dict[str, torch.Tensor]:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the restricted unpickler refuses anything but tensors
        message = str(exc).split("\n")[0]
        raise AuditError(
            f"{what} {path} could not be read with torch.load(weights_only=True) ({type(exc).__name__}: "
            f"{_clip(message)}); it holds more than tensors: convert it to safetensors with code you trust"
        ) from None
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping):
        raise AuditError(
            f"{what} {path} holds a {type(obj).__name__}, not a mapping of names to tensors (a state_dict)"
        )
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise AuditError(f"{what} {path}: entries {_names(bad)} are not named tensors; save the model's state_dict")
    return dict(obj)


def match_state_dict(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
    fix: str = "check that the weights belong to this model",
) -> None:
    """Raise one :class:`AuditError` line unless ``tensors`` fit ``module.state_dict()`` exactly.

    Checks, in order: missing keys, unexpected keys (a few named of each), shapes (the
    tensor and both shapes), floating dtypes, and finite values.
    """
    expected = module.state_dict()
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise AuditError(f"{where}: the weights do not fit the model: {key_mismatch(missing, unexpected)}; {fix}")
    for name, ref in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise AuditError(
                f"{where}: tensor {name} has shape {tuple(got.shape)} in the file but the model expects "
                f"{tuple(ref.shape)}; {fix}"
            )
        if ref.is_floating_point() != got.is_floating_point():
            raise AuditError(
                f"{where}: tensor {name} has dtype {str(got.dtype).replace('torch.', '')} but the model holds "
                f"{str(ref.dtype).replace('torch.', '')}; {fix}"
            )
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise AuditError(f"{where}: tensor {name} holds non-finite values (NaN or inf); the checkpoint is damaged")


def load_into(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
    fix: str = "check that the weights belong to this model",
) -> nn.Module:
    """Check ``tensors`` against ``module`` (:func:`match_state_dict`) and load them (strict)."""
    match_state_dict(module, tensors, where=where, fix=fix)
    module.load_state_dict(dict(tensors), strict=True)
    return module
