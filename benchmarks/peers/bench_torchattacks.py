"""Peer benchmark: FGSM against torchattacks 3.5.1 on the same model, data and loss.

Both sides: one signed-gradient step of radius eps = 0.1 (L-inf) on the cross-entropy
loss, clipped to the valid range [0, 1], float64, the whole set in one batch.
attnaudit: ``attnaudit.analyses.malleability.attacks.perturb(model, X, y, AttackConfig("fgsm", eps=0.1, clip 0..1),
loss="ce")``, which also reports the model's loss and accuracy before and after the attack
(torchattacks returns the images only): the attack alone is timed with ``evaluate=False``,
the same work as the peer's; with evaluation is printed as its own ratio. Peer:
``torchattacks.FGSM(model, eps=0.1)(X, y)``. Each side's set-up is built once, outside the
timed call, as a user attacking many times would: the peer's attack object, and attnaudit's
``attack_engine(model, X, "ce")`` (which probes the logits' width and wraps the module). The
call still validates the data range on every call (the peer does not).

Agreement: the adversarial inputs of the two sides (max |difference|; identical signs of
the gradient give exactly equal inputs).

Tolerance: ``fgsm_fraction_differing`` <= 1e-4, the fraction of adversarial input entries
that differ by more than 1e-12 (measured 0 on both workloads: identical inputs; a gradient
entry within round-off of 0 could take the other sign on one side, so a few entries in
10,000 are allowed, while a wrong eps, sign, clip or loss changes most of them). The script
prints ``AGREEMENT <workload>/fgsm_fraction_differing=<value> tol=0.0001 ok=<true|false>``
and exits 1 after its RATIO lines when it is exceeded.

Workloads: digits (1,437 x 64, width 32) and MNIST (n = 10,000 x 784, width 256; skipped
when ../shared/data is absent). Prints ``RATIO fgsm_vs_torchattacks=<x>`` and ``RATIO fgsm_evaluated_vs_torchattacks=<x>``
per workload.
Run: python benchmarks/peers/bench_torchattacks.py [--workload digits|mnist|both]
"""

from __future__ import annotations

import torch

from _common import best_time, check, finish, report, require, workload, workload_args
from attnaudit.analyses.malleability.attacks import AttackConfig, attack_engine, perturb

torchattacks = require("torchattacks", "torchattacks")

TOL = 1e-4  # see the docstring


def run(name: str, n: int | None, width: int, repeats: int) -> None:
    w = workload(name, n=n, width=width)
    if w is None:
        return
    print(w.describe(), f"threads={torch.get_num_threads()}")
    X, y, model = w.X, w.y, w.model
    lo, hi = float(X.min()), float(X.max())
    assert 0.0 <= lo and hi <= 1.0, (lo, hi)
    config = AttackConfig("fgsm", eps=0.1, norm="linf", clip_min=0.0, clip_max=1.0, chunk_size=X.shape[0])
    attack = torchattacks.FGSM(model, eps=0.1)
    engine = attack_engine(model, X, "ce")  # set-up, like the peer's attack object
    t_ours, ours = best_time(lambda: perturb(engine, X, y, config, evaluate=False), repeats)
    t_peer, theirs = best_time(lambda: attack(X, y), repeats)
    t_eval, evaluated = best_time(lambda: perturb(engine, X, y, config), repeats)
    t_bare, _ = best_time(lambda: perturb(model, X, y, config, loss="ce", evaluate=False), repeats)
    print(
        f"  attnaudit with the set-up inside the timed call (perturb(model, ...)): {t_bare:.4f} s "
        f"(RATIO fgsm_with_setup_vs_torchattacks={t_bare / t_peer:.3f})"
    )
    diff = float((ours.X_adv - theirs).abs().max())
    changed = float(((ours.X_adv - theirs).abs() > 0).double().mean())
    report(
        "fgsm_vs_torchattacks",
        t_ours,
        t_peer,
        f"adversarial inputs max |diff| {diff:.1e} ({changed:.1e} of entries differ)",
    )
    # what the malleability command runs: the attack plus the model's loss and accuracy
    # before (from the gradient pass) and after (one more forward pass)
    print(
        f"  with evaluation: {t_eval:.4f} s (loss {evaluated.loss_before:.4f} -> {evaluated.loss_after:.4f}, "
        f"accuracy {evaluated.accuracy_before:.3f} -> {evaluated.accuracy_after:.3f})"
    )
    print(f"RATIO fgsm_evaluated_vs_torchattacks={t_eval / t_peer:.3f}")
    check(f"{name}/fgsm_fraction_differing", float(((ours.X_adv - theirs).abs() > 1e-12).double().mean()), TOL)


def main() -> None:
    args = workload_args(__doc__, repeats=7)
    if args.workload in ("digits", "both"):
        run("digits", None, 32, args.repeats)
    if args.workload in ("mnist", "both"):
        run("mnist", 10000, 256, max(1, args.repeats - 2))


if __name__ == "__main__":
    main()
    finish()
