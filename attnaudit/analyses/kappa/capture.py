"""Capturing attention layers during a forward pass (`attnaudit kappa --checkpoint`).

Forward hooks on every layer record, per chunk of samples, the spectra of its input and
output token Grams and the singular values of its attention maps: from the module's own
``weights(h)`` (built-in ViT), a re-run with ``need_weights=True`` (``nn.MultiheadAttention``)
or the second output of a Hugging Face eager attention. The model runs as a float64 copy
(:func:`float64_copy`) with softmax kept in float64 (:func:`softmax_in_input_dtype`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from attnaudit.analyses.kappa.discovery import AttentionLayer
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.engine import math_attention, ranges
from attnaudit.core.task import Task, as_loss, to_logits
from attnaudit.models.vit import Attention

_INPUT_KEYWORDS = ("hidden_states", "query", "x", "h", "input", "inputs")


def _as_tokens(t: Any, name: str, role: str, multihead: bool = False, batch_first: bool = True) -> torch.Tensor:
    """The (batch, tokens, features) tensor of a layer's input or output."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise FieldError(
            "layers",
            f"layer {literal(name)}: no floating-point token tensor in its {role}; choose attention layers with {{name}}",
        )
    if multihead:
        t = t.unsqueeze(0) if t.ndim == 2 else (t if batch_first else t.transpose(0, 1))
    if t.ndim != 3:
        raise FieldError(
            "layers",
            f"layer {literal(name)}: its {role} has shape {tuple(t.shape)}; per-layer kappa needs token tensors "
            "(batch, tokens, features) -- choose attention layers with {name}",
        )
    return t


def _layer_input(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    for key in _INPUT_KEYWORDS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _layer_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    for attr in ("last_hidden_state", "hidden_states"):
        if isinstance(getattr(output, attr, None), torch.Tensor):
            return getattr(output, attr)
    return None


def _mha_weights(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    """Per-head maps (B, H, L, S) of one MultiheadAttention call, from the module itself."""
    bound = inspect.signature(mod.forward).bind(*args, **kwargs)
    bound.arguments["need_weights"] = True
    bound.arguments["average_attn_weights"] = False
    _, w = mod.forward(*bound.args, **bound.kwargs)  # forward, not __call__: the hooks do not fire again
    assert w is not None  # need_weights=True
    return w.unsqueeze(0) if w.ndim == 3 else w


def _attention_maps(
    layer: AttentionLayer, args: tuple, kwargs: dict, output: Any, tokens_in: torch.Tensor
) -> tuple[torch.Tensor | None, str]:
    mod = layer.module
    if layer.kind == "builtin":
        assert isinstance(mod, Attention)  # attention_kind
        return mod.weights(tokens_in), "attnaudit.models.vit.Attention.weights(h): the module's own maps"
    if layer.kind == "multihead":
        assert isinstance(mod, nn.MultiheadAttention)  # attention_kind
        return _mha_weights(mod, args, kwargs), "re-run with need_weights=True, average_attn_weights=False"
    if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], torch.Tensor):
        w = output[1]
        B, L = tokens_in.shape[0], tokens_in.shape[1]
        if w.ndim == 4 and w.shape[0] == B and w.shape[2] == L:
            return w, "returned by the module as its second output (eager attention)"
    return None, "the module does not expose its attention maps: token Grams only"


class LayerRecord:
    """Spectra captured for one layer, chunk by chunk (:func:`capture_call` fills it)."""

    def __init__(self, layer: AttentionLayer):
        self.layer = layer
        self.calls = 0
        self.order: int | None = None
        self.spec_in: list[np.ndarray] = []
        self.spec_out: list[np.ndarray] = []
        self.svals: list[np.ndarray] = []
        self.shape_in: tuple[int, int] | None = None
        self.shape_out: tuple[int, int] | None = None
        self.maps_shape: tuple[int, int] | None = None
        self.note = ""
        self.real_tokens: list[np.ndarray] = []  # per sample, when padding is excluded
        self.padding_note = ""


def gram_spectra(tokens: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (B, min(N, D)) of the token Grams X_b X_b^T of tokens (B, N, D), descending, float64.

    Taken from the smaller of X X^T and X^T X (same non-zero spectrum), batched.
    """
    X = tokens.to(torch.float64)
    N, D = X.shape[-2], X.shape[-1]
    M = X @ X.transpose(-2, -1) if N <= D else X.transpose(-2, -1) @ X
    return torch.linalg.eigvalsh(_small_on_cpu(M)).flip(-1)


def _small_on_cpu(M: torch.Tensor) -> torch.Tensor:
    """A batch of small matrices moved to the CPU for its decomposition: CUDA runs a batched
    eigvalsh/svdvals of matrices above 32 x 32 as one solver call per matrix (measured on an
    H200: per-layer kappa of a DeiT-tiny on 512 images took 59 s there against 10 s on 2 CPU
    cores), while LAPACK on the CPU takes the whole batch at once. The products that form the
    matrices stay on the device."""
    return M.cpu() if M.is_cuda and M.shape[-1] <= 1024 and M.shape[-2] <= 1024 else M


def capture_call(record: LayerRecord, args: tuple, kwargs: dict, output: Any, keep: torch.Tensor | None = None) -> None:
    """Spectra of one layer's call. ``keep`` (B, L) bool: the real (non-padding) tokens of the
    batch; when the layer's tokens line up with them (L positions), padding rows of the token
    matrices and padding rows and columns of the attention maps are zeroed, so each sample's
    spectrum is its real tokens' plus zeros, which :meth:`SpectrumSummary.of` cuts off."""
    layer = record.layer
    where = layer.name
    mha = layer.kind == "multihead"
    batch_first = bool(getattr(layer.module, "batch_first", True))
    x_in = _as_tokens(_layer_input(layer.module, args, kwargs), where, "input", mha, batch_first)
    x_out = _as_tokens(_layer_output(output), where, "output", mha, batch_first)
    record.calls += 1
    record.shape_in = (x_in.shape[1], x_in.shape[2])
    record.shape_out = (x_out.shape[1], x_out.shape[2])
    maps, note = _attention_maps(layer, args, kwargs, output, x_in)
    record.note = note
    if keep is not None:
        aligned = keep.shape[0] == x_in.shape[0] and keep.shape[1] == x_in.shape[1] == x_out.shape[1]
        if aligned:
            k = keep.to(device=x_in.device, dtype=torch.float64)
            x_in = x_in.to(torch.float64) * k[:, :, None]
            x_out = x_out.to(torch.float64) * k[:, :, None]
            if maps is not None and maps.shape[-1] == maps.shape[-2] == keep.shape[1]:
                maps = maps.to(torch.float64) * k[:, None, :, None] * k[:, None, None, :]
            record.real_tokens.append(keep.sum(1).cpu().numpy())
            record.padding_note = "padding excluded: each sequence's Grams and maps over its real tokens"
        else:
            record.padding_note = (
                f"padding included: the layer's {x_in.shape[1]} tokens do not line up with the "
                f"{keep.shape[1]} input positions"
            )
    record.spec_in.append(gram_spectra(x_in).cpu().numpy())
    record.spec_out.append(gram_spectra(x_out).cpu().numpy())
    if maps is not None:
        maps = maps.to(torch.float64)
        record.maps_shape = (maps.shape[-2], maps.shape[-1])
        record.svals.append(torch.linalg.svdvals(_small_on_cpu(maps)).cpu().numpy())  # (B, H, min(L, S)), descending


@contextlib.contextmanager
def softmax_in_input_dtype() -> Iterator[None]:
    """Softmax computed in its input's dtype when a lower-precision ``dtype=`` is asked for.

    Hugging Face's eager attention (the path that returns the maps) calls
    ``softmax(scores, dtype=torch.float32)`` even for float64 scores, which would round the
    maps and the outputs of the float64 copy to float32 (measured: 8e-10 off the model's own
    sdpa output on a tiny ViT; kappa of a map above ~1e7 would be noise). Inside this context
    ``torch.nn.functional.softmax``, ``torch.softmax`` and ``Tensor.softmax`` keep float64;
    all three are restored on exit. Not thread-safe: other threads see the wrapped functions
    while it is active.
    """
    import torch.nn.functional as F

    orig_f, orig_t, orig_m = F.softmax, torch.softmax, torch.Tensor.softmax

    def keep(dtype, x):
        if dtype is not None and x.is_floating_point() and torch.finfo(dtype).bits < torch.finfo(x.dtype).bits:
            return None
        return dtype

    def f_softmax(input, dim=None, _stacklevel=3, dtype=None):
        return orig_f(input, dim=dim, dtype=keep(dtype, input))

    def t_softmax(input, dim, dtype=None):
        return orig_t(input, dim, dtype=keep(dtype, input))

    def m_softmax(self, dim, dtype=None):
        return orig_m(self, dim, dtype=keep(dtype, self))

    # patching functions and a method on purpose (restored below), which the type checker refuses
    # patched on purpose (restored below); the stubs type torch.softmax with ``out=`` and refuse method assignment
    F.softmax = f_softmax
    torch.softmax = t_softmax  # type: ignore[assignment]
    torch.Tensor.softmax = m_softmax  # type: ignore[method-assign]
    try:
        yield
    finally:
        F.softmax = orig_f
        torch.softmax = orig_t
        torch.Tensor.softmax = orig_m  # type: ignore[method-assign]


def float64_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A float64 copy on ``device``, Hugging Face models switched to eager attention (maps returned)."""
    twin = copy.deepcopy(module)
    twin.to(device=device, dtype=torch.float64)
    for sub in twin.modules():
        setter = getattr(sub, "set_attn_implementation", None)
        if callable(setter) and hasattr(sub, "config"):
            try:
                setter("eager")
            except Exception:  # noqa: BLE001 - a model without an eager path keeps its own; maps may then be missing
                pass
    twin.eval()
    return twin


def capture_layers(
    task: Task, twin: nn.Module, layers: list[AttentionLayer], X: torch.Tensor, chunk: int, device: torch.device
) -> list[LayerRecord]:
    """Run ``twin`` (the float64 copy of ``task.module`` on ``device``) on the rows ``X``, ``chunk``
    samples per pass, with a forward hook on every layer; the records in forward order.

    No gradients, math attention kernel, softmax kept in float64. Each layer must run exactly
    once per forward pass (a shared-weight layer running twice is refused). A text model's
    padding is excluded through its ``token_mask`` (sequences stay at the data's full length).
    """
    for part in twin.modules():
        if getattr(part, "trim_padding", False):
            # per-layer spectra are stacked over chunks at the data's full length (padding
            # is excluded by the token mask instead)
            setattr(part, "trim_padding", False)  # noqa: B010 - an attribute of HFSequenceClassifier
    records = {layer.name: LayerRecord(layer) for layer in layers}
    order: list[str] = []
    handles = []
    busy = [False]  # a layer's maps are recomputed inside its hook: calls made then are not the model's
    keep_now: list[torch.Tensor | None] = [None]  # the current chunk's real tokens (text models with padding)
    token_mask = getattr(twin, "token_mask", None)
    for layer in layers:
        rec = records[layer.name]

        def hook(mod, args, kwargs, output, rec=rec):
            if busy[0]:
                return
            if rec.order is None:
                rec.order = len(order)
                order.append(rec.layer.name)
            busy[0] = True
            try:
                capture_call(rec, args, kwargs, output, keep_now[0])
            finally:
                busy[0] = False

        handles.append(layer.module.register_forward_hook(hook, with_kwargs=True))
    Xd = X.to(device=device, dtype=torch.float64)
    try:
        with torch.no_grad(), math_attention(), softmax_in_input_dtype():
            for a, b in ranges(Xd.shape[0], chunk):
                before = {k: r.calls for k, r in records.items()}
                batch = task.inputs(Xd[a:b])
                keep_now[0] = token_mask(batch) if callable(token_mask) else None
                to_logits(task.inputs.call(twin, batch), as_loss(task.loss).logits_ndim)
                for name, rec in records.items():
                    _check_ran(name, rec.calls - before[name])
    finally:
        for h in handles:
            h.remove()
    return sorted(records.values(), key=lambda r: r.order if r.order is not None else 1 << 30)


def _check_ran(name: str, ran: int) -> None:
    """Refuse a layer that did not run in a forward pass, or ran more than once (shared weights)."""
    if ran == 0:
        raise FieldError(
            "layers",
            f"layer {literal(name)} did not run in the model's forward pass; choose layers that run with {{name}}",
        )
    if ran > 1:
        raise FieldError(
            "layers",
            f"layer {literal(name)} runs {ran} times per forward pass (shared weights); per-layer kappa needs one call "
            "per layer -- choose other modules with {name}",
        )
