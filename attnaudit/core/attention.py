"""The attention kernel every differentiation runs under (shared by the task and the engine).

torch's fused scaled-dot-product-attention kernels have no forward-mode derivative and no
double backward, and ``nn.MultiheadAttention``'s inference fast path has no vmap batching
rule (measured: ../shared/notes/transformers-and-torch-func.md), so every call that
differentiates a model runs inside :func:`math_attention`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """Force the math kernel of scaled dot-product attention (differentiable twice), and
    switch off ``nn.MultiheadAttention``'s fused inference fast path, which has no vmap
    batching rule (torch falls back to a slow per-sample loop) and no double derivative.
    Both are restored on exit."""
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    kernel: contextlib.AbstractContextManager[object]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: the fused kernels are chosen per call; nothing to force
        kernel = contextlib.nullcontext()
    else:
        kernel = sdpa_kernel(SDPBackend.MATH)  # a generator context manager: runs only on entry
    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        with kernel:
            yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fastpath)
