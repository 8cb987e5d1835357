"""Is a 2-layer ReLU network near its NTK predictor? A small width sweep from Python.

Run: python examples/ntk_distance_api.py   (digits, embedded; about 10 s on 2 cores)
"""

from attnaudit.data import DataSpec, holdout_split, load_dataset
from attnaudit.analyses.ntk_distance.config import NTKDistanceConfig
from attnaudit.analyses.ntk_distance.widths import run_ntk_distance

digits = load_dataset(DataSpec(dataset="digits"))
train, test = holdout_split(digits, n_train=150, n_test=150, seed=0)
config = NTKDistanceConfig(models=("relu", "attn"), widths=(16, 64, 256), seeds=(0, 1), steps=150)
result = run_ntk_distance(train.X, train.y, test.X, test.y, digits.n_classes, config)
for row in result.summary_rows():
    d, k = row["distance_rel"], row["kernel_movement"]
    print(
        f"{row['model']:>4} m={row['width']:>4}: ||f_m - f_NTK|| / ||f_NTK|| = {d['mean']:.3f} +- {d['std']:.3f}, "
        f"kernel movement {k['mean']:.3f}, net test acc {row['net_test_acc']['mean']:.2f}"
    )
for sentence in result.verdicts():
    print("-", sentence)
