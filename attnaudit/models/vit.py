"""Built-in vision transformers: ``vit`` (softmax attention) and ``vit-linear`` (the
paper's linearized attention), small enough to train on MNIST on a laptop CPU.

Architecture (one code path for both variants; only the attention weights differ):

* patch embedding: the image (C, H, W) is cut into non-overlapping ``patch`` x ``patch``
  patches (N = (H / patch) * (W / patch) tokens), each flattened (channel-major, C * p * p
  values) and mapped by a Linear layer to ``dim``; a learned position embedding (N, dim)
  is added (no class token: the logits come from the mean over tokens);
* ``depth`` pre-norm blocks ``x + attn(LN(x))``, ``x + mlp(LN(x))``; the attention is
  multi-head with trainable Q, K, V and output projections (all with biases), written
  with plain matmuls (:class:`Attention`) so both variants share every line but one; the
  MLP is Linear(dim, mlp_ratio * dim), GELU (exact erf form), Linear back to dim;
* a final LayerNorm, the mean over tokens, and a Linear ``head`` to ``n_out`` logits.

Attention weights, per head, with d_h = dim / heads and N tokens:

* ``vit``:        A = softmax(q k^T / sqrt(d_h)) (row-wise);
* ``vit-linear``: A = q k^T / (sqrt(d_h) * N), no softmax.

The linearized form follows the paper's linearization exp(s) ~ 1 + s of the softmax
numerator (its parameter-free f_att(X) = X X^T X keeps only the score term, as here).
The extra 1/N is our choice: the first-order expansion of softmax around zero scores is
softmax(s)_ij ~ 1/N + (s_ij - mean_k s_ik) / N, so the score term carries exactly that
1/N; with it the output is an *average* over tokens, ``A v`` does not grow with the number
of tokens, and a model trained at one resolution keeps the scale of its activations.
Without it every block would multiply the residual stream's size by about N (16 for
MNIST at patch 7), which makes Adam training at the defaults diverge.

Initialisation is deterministic from ``spec.seed`` with a local :class:`torch.Generator`
(the global RNG is never touched): Linear weights and the position embedding ~ N(0, 0.02^2)
truncated at 2 standard deviations (the usual ViT initialisation), biases 0, LayerNorm
weight 1 and bias 0. Values are drawn in float64 on the CPU and cast, so the same seed gives
the same (rounded) initial weights in float32 and float64 and on every device.

Nothing is stored between calls (no cached attention maps, no hooks), so the modules work
under ``torch.func`` (``functional_call``, ``vmap(grad)``, ``jvp``) and in any dtype.
"""

from __future__ import annotations

from attnaudit.errors import is_int

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from attnaudit.core.task import Inputs
from attnaudit.errors import AuditError, clip_text, show_value

VIT_ARCHITECTURES = ("vit", "vit-linear")
INIT_STD = 0.02
# The range torch.Generator.manual_seed accepts.
_TORCH_SEED_RANGE = (-(2**63), 2**64 - 1)
# No sane ViT comes near these; they stop a hostile side-car from asking for a module whose
# construction alone would exhaust memory (the file's tensors are checked against the spec
# on the meta device before anything is allocated, see attnaudit.models.builtin.load_model).
_MAX_SIZE = 1 << 20


def _either(values: list[int]) -> str:
    """``[4, 7, 14]`` -> ``'4, 7 or 14'``."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"


@dataclass(frozen=True)
class ViTSpec:
    """Everything needed to rebuild a built-in ViT (stored in the checkpoint's side-car).

    ``image_shape``: (C, H, W) of the input images; H and W must be multiples of
    ``patch``. ``dim`` must be a multiple of ``heads``. Integers only (numpy integers are
    converted, so the spec survives ``json.dumps``); ``image_shape`` may be given as a
    list (as read back from JSON) and is stored as a tuple.
    """

    arch: Literal["vit", "vit-linear"]
    image_shape: tuple[int, int, int]
    n_out: int
    depth: int = 2
    dim: int = 64
    heads: int = 4
    patch: int = 7
    mlp_ratio: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.arch, str) or self.arch not in VIT_ARCHITECTURES:
            raise AuditError(f"unknown transformer {show_value(self.arch)}; use one of {', '.join(VIT_ARCHITECTURES)}")
        shape = self.image_shape
        if not isinstance(shape, (tuple, list)) or len(shape) != 3 or not all(is_int(s) for s in shape):
            raise AuditError(
                f"ViT image_shape must be three integers (channels, height, width), got {show_value(shape)}; "
                "give image data such as (1, 28, 28)"
            )
        object.__setattr__(self, "image_shape", tuple(int(s) for s in shape))
        for name in ("n_out", "depth", "dim", "heads", "patch", "mlp_ratio", "seed"):
            value = getattr(self, name)
            if not is_int(value):
                raise AuditError(f"ViT {name} must be an integer, got {show_value(value)} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))
        for name in ("n_out", "depth", "dim", "heads", "patch", "mlp_ratio"):
            value = getattr(self, name)
            if not 1 <= value <= _MAX_SIZE:
                raise AuditError(f"ViT {name} must be a positive integer up to {_MAX_SIZE}, got {clip_text(value, 60)}")
        c, h, w = self.image_shape
        if not all(1 <= s <= _MAX_SIZE for s in self.image_shape):
            raise AuditError(f"ViT image_shape must be positive (channels, height, width), got {self.image_shape}")
        lo, hi = _TORCH_SEED_RANGE
        if not lo <= self.seed <= hi:
            raise AuditError(f"ViT seed must be an integer in {lo}..{hi}, got {clip_text(self.seed, 60)}")
        if self.dim % self.heads:
            divisors = [k for k in range(1, min(self.dim, 64) + 1) if self.dim % k == 0][:6]
            raise AuditError(
                f"ViT dim {self.dim} is not divisible by heads {self.heads}; choose --heads among "
                f"{', '.join(map(str, divisors))} or a --dim that is a multiple of {self.heads}"
            )
        if h % self.patch or w % self.patch:
            fits = [p for p in range(1, min(h, w)) if h % p == 0 and w % p == 0] or [1]
            raise AuditError(
                f"ViT patch size {self.patch} does not divide the image size {h}x{w}; choose a --patch that divides "
                f"both, e.g. {_either(fits[-3:])}"
            )

    @property
    def tokens(self) -> int:
        """Number of tokens N = (H / patch) * (W / patch)."""
        return (self.image_shape[1] // self.patch) * (self.image_shape[2] // self.patch)

    @property
    def patch_features(self) -> int:
        """Values per flattened patch, C * patch * patch."""
        return self.image_shape[0] * self.patch * self.patch


class Attention(nn.Module):
    """Multi-head self-attention with trainable Q, K, V and output projections.

    ``linear=False``: softmax(q k^T / sqrt(d_h)); ``linear=True``: q k^T / (sqrt(d_h) N),
    the linearized attention of the module docstring. Stateless between calls.
    """

    def __init__(self, dim: int, heads: int, linear: bool, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.heads = heads
        self.linear = linear
        self.q = nn.Linear(dim, dim, **kw)
        self.k = nn.Linear(dim, dim, **kw)
        self.v = nn.Linear(dim, dim, **kw)
        self.proj = nn.Linear(dim, dim, **kw)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        B, L, D = t.shape
        return t.reshape(B, L, self.heads, D // self.heads).transpose(1, 2)  # (B, heads, L, d_h)

    def weights(self, h: torch.Tensor) -> torch.Tensor:
        """Attention weights (B, heads, L, L) for token states ``h`` (B, L, dim) (already normalised)."""
        return self._weights(self._split(self.q(h)), self._split(self.k(h)))

    def _weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        L, d_head = q.shape[-2], q.shape[-1]
        scores = q @ k.transpose(-2, -1)
        if self.linear:
            return scores / (math.sqrt(d_head) * L)
        return torch.softmax(scores / math.sqrt(d_head), dim=-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, L, D = h.shape
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        out = self._weights(q, k) @ v  # (B, heads, L, d_h)
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class MLP(nn.Module):
    """Linear(dim, hidden), GELU, Linear(hidden, dim)."""

    def __init__(self, dim: int, hidden: int, *, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))


class Block(nn.Module):
    """Pre-norm transformer block: h + attn(LN(h)), then h + mlp(LN(h))."""

    def __init__(self, spec: ViTSpec, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(spec.dim, **kw)
        self.attn = Attention(spec.dim, spec.heads, spec.arch == "vit-linear", **kw)
        self.norm2 = nn.LayerNorm(spec.dim, **kw)
        self.mlp = MLP(spec.dim, spec.mlp_ratio * spec.dim, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class ViT(nn.Module):
    """A small vision transformer (see the module docstring); input images (B, C, H, W).

    Parameter names: ``embed.{weight,bias}``, ``pos_embed``, ``blocks.<i>.norm1``,
    ``blocks.<i>.attn.{q,k,v,proj}``, ``blocks.<i>.norm2``, ``blocks.<i>.mlp.{fc1,fc2}``,
    ``norm``, ``head.{weight,bias}``. ``device``: where the parameters live (they are
    drawn on the CPU and copied, so the weights do not depend on it; ``"meta"`` builds
    the structure without allocating or initialising anything).
    """

    def __init__(self, spec: ViTSpec, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if not isinstance(spec, ViTSpec):
            raise AuditError(f"ViT needs a ViTSpec, got {type(spec).__name__}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise AuditError(f"ViT dtype must be a floating dtype such as torch.float32, got {dtype}")
        self.spec = spec
        # Built on the meta device so that no layer draws from the global RNG; then given
        # real storage and initialised from the local generator.
        meta = "meta"
        self.embed = nn.Linear(spec.patch_features, spec.dim, device=meta, dtype=dtype)
        self.pos_embed = nn.Parameter(torch.empty(spec.tokens, spec.dim, device=meta, dtype=dtype))
        self.blocks = nn.ModuleList([Block(spec, device=meta, dtype=dtype) for _ in range(spec.depth)])
        self.norm = nn.LayerNorm(spec.dim, device=meta, dtype=dtype)
        self.head = nn.Linear(spec.dim, spec.n_out, device=meta, dtype=dtype)
        target = torch.device(device) if device is not None else torch.device("cpu")
        if target.type != "meta":
            self.to_empty(device=target)
            self.reset_parameters(spec.seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic initialisation from ``seed`` (see the module docstring)."""
        gen = torch.Generator().manual_seed(int(seed))

        def normal(t: torch.Tensor) -> torch.Tensor:
            values = torch.randn(t.shape, generator=gen, dtype=torch.float64)
            # truncated at 2 std: redraw the tail (a handful of values, deterministic)
            bad = values.abs() > 2
            while bool(bad.any()):
                values[bad] = torch.randn(int(bad.sum()), generator=gen, dtype=torch.float64)
                bad = values.abs() > 2
            return values * INIT_STD

        with torch.no_grad():
            for name, p in self.named_parameters():  # registration order: deterministic
                leaf = name.rsplit(".", 1)[-1]
                owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
                if isinstance(owner, nn.LayerNorm):
                    value = (
                        torch.ones(p.shape, dtype=torch.float64)
                        if leaf == "weight"
                        else torch.zeros(p.shape, dtype=torch.float64)
                    )
                elif leaf == "bias":
                    value = torch.zeros(p.shape, dtype=torch.float64)
                else:  # Linear weights and the position embedding
                    value = normal(p)
                p.copy_(value.to(p.dtype))

    def head_parameter_names(self) -> list[str]:
        """The layer that produces the logits."""
        return ["head.weight", "head.bias"]

    def audit_inputs(self) -> Inputs:
        """How the data layer's flat rows become this model's input: images of ``spec.image_shape``."""
        return Inputs(kind="images", shape=self.spec.image_shape)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """Non-overlapping patches (B, N, C * p * p), row-major over the patch grid."""
        B = x.shape[0]
        C, H, W = self.spec.image_shape
        p = self.spec.patch
        return x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, self.spec.tokens, C * p * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or tuple(x.shape[1:]) != self.spec.image_shape:
            raise AuditError(
                f"the ViT takes images of shape (batch, {', '.join(map(str, self.spec.image_shape))}), got "
                f"{tuple(x.shape)}; reshape flat rows with its audit_inputs()"
            )
        h = self.embed(self.patches(x)) + self.pos_embed
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


def default_patch(image_shape, min_tokens: int = 16) -> int:
    """The largest patch size that divides H and W and still leaves at least ``min_tokens``
    tokens (7 for 28x28 MNIST, 8 for 32x32 CIFAR-10, 2 for 8x8 digits); 1 for tiny images."""
    h, w = int(image_shape[-2]), int(image_shape[-1])
    fits = [p for p in range(1, min(h, w) + 1) if h % p == 0 and w % p == 0 and (h // p) * (w // p) >= min_tokens]
    return max(fits) if fits else 1


def n_parameters(module: nn.Module) -> int:
    """Number of scalar parameters of ``module``."""
    return int(sum(p.numel() for p in module.parameters()))
