"""Fixtures shared by several test modules (a module's own fixture of the same name wins)."""

import pytest
import torch


@pytest.fixture(scope="module")
def digits():
    """A small digits split, pixels scaled to [0, 1]: 60 training rows, 30 held-out rows."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.from_numpy(X / 16.0)
    y = torch.from_numpy(y).long()
    return X[:60], y[:60], X[100:130], y[100:130]
