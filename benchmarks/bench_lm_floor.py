"""Benchmark: the arithmetic floor of a language-model malleability audit on this machine.

A static audit of ``--documents`` (512) documents of ``--length`` (256) tokens with one
embedding attack and its control makes four passes over the documents: the attack's input
gradient, then influence on the clean, attacked and control documents. Each pass is a forward
pass and a backward pass to the layers' outputs (no weight gradients). This script times plain
Hugging Face GPT-2-small (random weights, its default configuration, float32, eval mode, batches
of ``--batch`` (8) documents) doing exactly that, with no attnaudit code in the loop, and a
2,048-square float32 matrix product for the machine's matmul rate, in one process.

Printed: seconds per document forward and forward plus backward (to the input embeddings),
the four passes over the documents at that rate (``passes_s``) and at the matmul peak
(``peak_passes_s``: 2 x the forward's flops per document per pass), and
``RATIO lm_pass_over_matmul_peak=<measured forward-plus-backward time / its time at the matmul
peak>``. An audit cannot take less than ``passes_s`` on this machine without measuring less.

Run: .venv/bin/python benchmarks/bench_lm_floor.py [--threads 2] (needs attnaudit[hf]).
"""

from __future__ import annotations

import argparse
import time

import torch


def forward_flops(n_weights: int, layers: int, width: int, length: int) -> float:
    """Flops of one forward pass over one document: 2 per weight that multiplies per token (every
    parameter but the position table, which is looked up; the word table counts once, as the tied
    output head) plus the attention scores and their weighted sums, 4 L T^2 d."""
    return 2.0 * n_weights * length + 4.0 * layers * length * length * width


def matmul_rate(threads: int) -> float:
    """Flop/s of a 2,048-square float32 matrix product (best of 10)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * 2048**3 / best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--documents", type=int, default=512)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("SKIP: needs attnaudit[hf] (transformers)")
        return 0
    config = GPT2Config()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length))
    embeddings = model.transformer.wte(ids).detach().requires_grad_(True)

    def one_pass(backward: bool) -> None:
        logits = model(inputs_embeds=embeddings).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        if backward:
            torch.autograd.grad(loss, embeddings)

    per_doc = {}
    for backward in (False, True):
        one_pass(backward)  # warm-up
        t = time.perf_counter()
        for _ in range(args.repeats):
            one_pass(backward)
        per_doc[backward] = (time.perf_counter() - t) / (args.repeats * args.batch)
    n_params = sum(p.numel() for p in model.parameters())
    n_weights = n_params - model.transformer.wpe.weight.numel()
    flops = forward_flops(n_weights, config.n_layer, config.n_embd, args.length)
    rate = matmul_rate(args.threads)
    passes_s = 4 * args.documents * per_doc[True]
    peak_passes_s = 4 * args.documents * 2 * flops / rate
    print(
        f"gpt2-small params={n_params} length={args.length} threads={args.threads}: forward "
        f"{per_doc[False]:.3f} s/doc, forward+backward {per_doc[True]:.3f} s/doc; forward "
        f"{flops / 1e9:.1f} GFLOP/doc; matmul {rate / 1e9:.1f} GFLOP/s"
    )
    print(
        f"four passes over {args.documents} documents: passes_s={passes_s:.0f} "
        f"({passes_s / 60:.1f} min) at the measured rate, peak_passes_s={peak_passes_s:.0f} "
        f"({peak_passes_s / 60:.1f} min) at the matmul peak"
    )
    print(f"RATIO lm_pass_over_matmul_peak={per_doc[True] / (2 * flops / rate):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
