"""Benchmark: the functional engine against a plain Python loop over samples, on a small transformer.

The model is a ViT-like module written here as a user would (``TinyViT``): single-channel
28x28 images cut into 7x7 patches (16 tokens), a linear patch embedding plus a learned
position embedding, ``--layers`` pre-norm blocks of multi-head softmax attention (trainable
Q/K/V/output projections feeding ``torch.nn.functional.scaled_dot_product_attention``)
and an MLP, dropout, mean pooling and a linear head to 10 classes. It is audited through
``Task(model, 10, 'ce', Inputs('images', (1, 28, 28)))`` and ``Engine(task, dtype=...)``
with every parameter tracked.

Measured, on the same batch of ``--batch`` random images and labels, in one process:

1. ``RATIO engine_grads_vs_loop``: per-sample loss gradients (B, P).
   * engine: ``Engine.per_sample_grads`` (``vmap(grad)`` through ``functional_call``);
   * loop: for each sample, one forward and ``torch.autograd.grad(loss_i, params)`` on a
     copy of the model in the same dtype, in eval mode, inside
     ``sdpa_kernel(SDPBackend.MATH)`` (the kernel the engine uses), gradients flattened
     into the same (B, P) matrix.
2. ``RATIO engine_hvp_vs_loop``: Hessian-vector products of the mean loss over the batch
   with ``--vectors`` random vectors (k, P).
   * engine: ``Engine.hvp_operator(X, T).matmat(V)`` (forward-over-reverse, ``vmap`` over
     the k vectors);
   * loop: the textbook double backward: the gradient of the mean loss once with
     ``create_graph=True``, then one ``torch.autograd.grad(g @ v, params, retain_graph=True)``
     per vector (same copy, eval mode, math kernel).
   An extra line times the engine with its reverse-over-reverse fallback forced.

Each side is warmed up once (the first torch.func call in a process pays a one-off
start-up cost), then timed as the best of ``--repeats`` runs with ``time.perf_counter``.
The two sides' results are compared (max abs difference relative to the largest entry)
and the run fails if they disagree. Speed-up = loop time / engine time; goal for the
per-sample gradients: >= 10.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine.py --threads 1 [--batch 256 --layers 2]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, p_drop: float):
        super().__init__()
        self.heads, self.p_drop = heads, p_drop
        self.ln1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))
        self.drop = nn.Dropout(p_drop)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        B, L, D = h.shape

        def split(t):
            return t.reshape(B, L, self.heads, D // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), dropout_p=self.p_drop if self.training else 0.0
        )
        return self.proj(a.transpose(1, 2).reshape(B, L, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.drop(self.attention(self.ln1(h)))
        return h + self.drop(self.mlp(self.ln2(h)))


class TinyViT(nn.Module):
    def __init__(self, image=28, patch=7, dim=64, layers=2, heads=4, mlp=128, classes=10, p_drop=0.1):
        super().__init__()
        self.patch = patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp, p_drop) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        p = self.patch
        patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        h = self.blocks(self.embed(patches) + self.pos)
        return self.head(self.norm(h).mean(1))


def best_of(fn, repeats: int):
    """(result, best seconds) over ``repeats`` calls, after one warm-up call."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="samples B")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vectors", type=int, default=8, help="vectors k for the HVP comparison")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10

    torch.manual_seed(0)
    model = TinyViT(dim=args.dim, layers=args.layers, heads=args.heads, mlp=2 * args.dim)  # float32, train mode
    gen = torch.Generator().manual_seed(1)
    X = torch.rand(args.batch, 28 * 28, generator=gen, dtype=dtype)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    engine = Engine(Task(model, 10, "ce", Inputs("images", (1, 28, 28))), dtype=dtype)
    T = engine.targets(y)
    P = engine.n_params
    print(
        f"TinyViT 28x28/7 (16 tokens), dim {args.dim}, {args.layers} layer(s), {args.heads} heads: P={P}; "
        f"B={args.batch}, k={args.vectors}, {args.dtype}, torch {torch.__version__}, threads={torch.get_num_threads()}",
        file=sys.stderr,
    )

    # the loop's model: a copy in the same dtype, eval mode, math attention kernel
    ref = copy.deepcopy(model).to(dtype).eval()
    params = [dict(ref.named_parameters())[n] for n in engine.names]
    images = X.reshape(-1, 1, 28, 28)

    def loop_grads() -> torch.Tensor:
        out = torch.empty(args.batch, P, dtype=dtype)
        with sdpa_kernel(SDPBackend.MATH):
            for i in range(args.batch):
                loss = F.cross_entropy(ref(images[i : i + 1]), y[i : i + 1], reduction="sum")
                out[i] = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        return out

    G_loop, t_loop = best_of(loop_grads, args.repeats)
    G_eng, t_eng = best_of(lambda: engine.per_sample_grads(X, T), args.repeats)
    d = rel_diff(G_eng, G_loop)
    print(f"per-sample grads (B={args.batch}, P={P}): loop {t_loop:.3f}s, engine {t_eng:.3f}s, max rel diff {d:.1e}")
    assert d < tol, f"engine and loop per-sample gradients disagree: {d:.2e}"

    V = torch.randn(args.vectors, P, generator=gen, dtype=dtype)

    def loop_hvp() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            loss = F.cross_entropy(ref(images), y, reduction="mean")
            g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params, create_graph=True)])
            return torch.stack(
                [torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ v, params, retain_graph=True)]) for v in V]
            )

    op = engine.hvp_operator(X, T)
    HV_loop, t_hloop = best_of(loop_hvp, args.repeats)
    HV_eng, t_heng = best_of(lambda: op.matmat(V), args.repeats)
    d = rel_diff(HV_eng, HV_loop)
    print(
        f"HVPs (k={args.vectors}, mean loss over B={args.batch}): loop {t_hloop:.3f}s, engine {t_heng:.3f}s "
        f"({op.mode}), max rel diff {d:.1e}"
    )
    assert d < tol, f"engine and loop Hessian-vector products disagree: {d:.2e}"
    rr = engine.hvp_operator(X, T)
    rr.mode = "reverse-over-reverse"  # the engine's fallback, for reference (not in the RATIO)
    HV_rr, t_rr = best_of(lambda: rr.matmat(V), args.repeats)
    print(f"HVPs, engine forced to reverse-over-reverse: {t_rr:.3f}s, max rel diff {rel_diff(HV_rr, HV_loop):.1e}")

    print(f"RATIO engine_grads_vs_loop={t_loop / t_eng:.2f}")
    print(f"RATIO engine_hvp_vs_loop={t_hloop / t_heng:.2f}")


if __name__ == "__main__":
    main()
