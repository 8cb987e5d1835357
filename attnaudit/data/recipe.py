"""A data recipe: how to rebuild a sweep's (training, held-out) rows anywhere.

Sweep cells ship this small description instead of tensors; each worker process loads the
rows once through :func:`attnaudit.data.load_dataset` and :func:`attnaudit.data.holdout_split`
(the same calls as the CLI, so the same rows) and keeps them in its cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from attnaudit.data.spec import DataSpec
from attnaudit.runtime.sweep import cached
from attnaudit.data.loader import load_dataset
from attnaudit.data.selection import holdout_split
from attnaudit.report.envelope import Record


@dataclass(frozen=True)
class HoldoutRecipe(Record):
    """``load_dataset(spec)`` then ``holdout_split(ds, n_train, n_test, seed, stratify)``."""

    spec: dict
    n_train: int
    n_test: int
    seed: int
    stratify: bool = True

    @classmethod
    def of(cls, spec: DataSpec, n_train: int, n_test: int, seed: int, stratify: bool = True) -> "HoldoutRecipe":
        return cls(
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()},
            int(n_train),
            int(n_test),
            int(seed),
            bool(stratify),
        )

    @property
    def key(self) -> str:
        return "holdout:" + hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:24]

    def load(self):
        """(train, held_out) :class:`~attnaudit.data.Dataset` pair, cached per process."""

        def build():
            spec = DataSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in self.spec.items()})
            return holdout_split(load_dataset(spec), self.n_train, self.n_test, self.seed, stratify=self.stratify)

        return cached(self.key, build)
