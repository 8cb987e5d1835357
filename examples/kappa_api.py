"""Condition numbers and attention amplification from the Python API.

Run: python examples/kappa_api.py
Uses the embedded digits set and a synthetic matrix with a known spectrum, so it needs no
files and no network.
"""

from attnaudit.data import DataSpec, load_dataset
from attnaudit.analyses.kappa.dataset import KappaConfig, analyse_kappa

# A synthetic matrix with singular-value ratio 100: kappa(G) = 1e4 exactly, kappa(G~) = 1e12.
synthetic = load_dataset(DataSpec(dataset="synthetic", synthetic_kappa=100.0, synthetic_d=32, n=256))
result = analyse_kappa(synthetic.X, KappaConfig())
print(f"synthetic: kappa_d(G) = {result.base.kappa_full:.6g} (exact 1e4)")
print(f"           amplification check: {result.check.verdict}, measured kappa(G~) = {result.check.measured_kappa:.6g}")

# Digits, raw and centred per subset: blank pixels keep the rank below 64 either way.
for preprocess in ("raw", "center"):
    digits = load_dataset(DataSpec(dataset="digits", n=500, seed=0, preprocess=preprocess))
    r = analyse_kappa(digits.X)
    kd = "inf" if r.base.rank_deficient else f"{r.base.kappa_full:.4g}"
    print(
        f"digits ({preprocess}): rank {r.base.numerical_rank}/{r.base.k}, kappa_d = {kd}, "
        f"kappa at numerical rank = {r.base.kappa_rank:.4g}"
    )
    for w in r.widths[1::2]:
        print(f"   {w.label}: log10 m = {w.log10_width:.1f} ({w.gap_orders:.1f} orders beyond 1e12)")
