"""Influence flip rates under PGD against the random-noise and re-initialisation floors.

Run: python examples/malleability_api.py   (digits, embedded; about 15 s on 2 cores)
Sign convention: influence < 0 means helpful (up-weighting the sample lowers the test loss).
"""

from attnaudit.data import DataSpec, holdout_split, load_dataset
from attnaudit.analyses.malleability.malleability import MalleabilityConfig, run_malleability

digits = load_dataset(DataSpec(dataset="digits"))
train, test = holdout_split(digits, n_train=200, n_test=80, seed=0)
config = MalleabilityConfig(
    attacks=("pgd", "random"), eps=(0.3,), seeds=(0, 1, 2), width=32, steps=200, lr=4.0, top_k=20
)
result = run_malleability(train.X, train.y, test.X, test.y, digits.n_classes, config, value_range=digits.value_range)
report = result.to_dict()
for row in report["summary"]:
    f = row["flip_rate"]
    print(
        f"{row['model']:>4} {row['attack']:>6}: flip rate {f['mean']:.1%} [{f['ci_low']:.1%}, {f['ci_high']:.1%}] over seeds {row['seeds']}"
    )
for r in report["ratios"]:
    ratio = "undefined" if r["ratio"] is None else f"{r['ratio']:.2f}"
    high = "+inf (unbounded)" if r["ci_high"] is None else f"{r['ci_high']:.2f}"
    low = "-" if r["ci_low"] is None else f"{r['ci_low']:.2f}"
    print(f"ratio {r['numerator']}/{r['denominator']} under {r['attack']}: {ratio} [{low}, {high}]")
