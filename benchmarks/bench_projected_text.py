"""Benchmark: ``--estimator projected`` on a text encoder with a realistic vocabulary, its
embedding tables projected from the token ids against the per-sample-Jacobian route they took
before, in one process.

Workload: a BERT-shaped sequence classifier built offline from a config (vocabulary 30,522 as
BERT-base's, width ``--width`` (128), ``--layers`` (2), 2 heads, 2 classes), float64,
``--n-train`` (64) training and ``--n-test`` (16) held-out sequences of random token ids,
``--length`` (64) tokens each with trailing padding (lengths drawn from 8 to the maximum),
cross-entropy, Gauss-Newton curvature in the projected space, damping 1e-3, ``--proj-dim``
(512). Both sides start with an empty row cache.

* ``ids``: the default; the word, position and token-type tables are linear layers on one-hot
  rows, projected from the ids and the output gradients of the backward passes the linear
  layers take anyway;
* ``jacobian``: the same estimator with the tables left to the other parameters (what it did
  before): their per-sample Jacobians from ``vmap(jacrev)`` of the whole network, then a
  random sign projection.

The two projections differ (the tables' share of k is Kronecker-structured on one side,
random signs on the other), so the influence vectors differ too; printed: each side's time,
the Spearman correlation between them, and ``RATIO projected_text_ids_over_jacobian=<ids
time / jacobian time>``.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_projected_text.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--n-test", type=int, default=16)
    parser.add_argument("--proj-dim", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install -e '.[hf]'); skipped")
        return 0
    from scipy.stats import spearmanr

    import attnaudit.analyses.influence.estimators.projected as pj
    import attnaudit.analyses.influence.projection as layout
    from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
    from attnaudit.core.task import Inputs, Task
    from attnaudit.models.hf import HFSequenceClassifier

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        intermediate_size=4 * args.width,
        max_position_embeddings=args.length,
        num_labels=2,
        pad_token_id=0,
    )
    bert = transformers.BertForSequenceClassification(config).eval().double()
    wrapper = HFSequenceClassifier(bert, pad_token_id=0, trim_padding=True)
    task = Task(wrapper, 2, "ce", Inputs(kind="tokens", keyword="input_ids"), "all")
    g = torch.Generator().manual_seed(1)
    n = args.n_train + args.n_test
    ids = torch.randint(1000, 30522, (n, args.length), generator=g)
    lengths = torch.randint(8, args.length + 1, (n,), generator=g)
    for i, k in enumerate(lengths.tolist()):
        ids[i, 0], ids[i, k - 1], ids[i, k:] = 101, 102, 0
    y = torch.randint(0, 2, (n,), generator=g)
    X = ids.to(torch.float64)
    cfg = InfluenceConfig(
        estimator="projected", proj_dim=args.proj_dim, damping=1e-3, params="all", curvature="ggn", chunk_size=16
    )
    P = sum(p.numel() for p in bert.parameters())
    print(
        f"BERT-shaped: {P:,} parameters ({30522 * args.width:,} in the word table), {args.n_train} / {args.n_test} "
        f"sequences of up to {args.length} tokens, k {args.proj_dim}, {args.threads} thread(s), torch {torch.__version__}"
    )

    def run(label: str):
        pj.clear_row_cache()
        t0 = time.perf_counter()
        res = compute_influence(task, X[: args.n_train], y[: args.n_train], X[args.n_train :], y[args.n_train :], cfg)
        seconds = time.perf_counter() - t0
        d = res.diagnostics
        print(
            f"{label:9s} {seconds:8.2f} s  tables from ids: {d.get('embeddings_from_ids')}; by Jacobians: "
            f"{d.get('other_parameters_by_jacobian')}"
        )
        return seconds, res.total

    t_ids, ids_total = run("ids")
    real = layout.embedding_modules
    layout.embedding_modules = lambda module, names: []  # the tables back with the other parameters
    try:
        t_jac, jac_total = run("jacobian")
    finally:
        layout.embedding_modules = real
    rho = spearmanr(ids_total.numpy(), jac_total.numpy()).statistic
    print(f"Spearman(ids, jacobian) = {rho:.3f} (different projections of the tables)")
    print(f"RATIO projected_text_ids_over_jacobian={t_ids / t_jac:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
