"""Fixtures shared by several test modules (a module's own fixture of the same name wins)."""

import signal

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


_SIGINT_AT_START = signal.getsignal(signal.SIGINT)


@pytest.fixture(autouse=True)
def _restore_sigint():
    """``attnaudit.cli.main`` ignores SIGINT just before it exits (so a late Ctrl-C cannot break
    interpreter shutdown); in a test process that outlives it (tests and module fixtures call
    it), put the session's handler back before and after every test, or later subprocesses
    would inherit an ignored SIGINT."""
    if _SIGINT_AT_START is not None:
        signal.signal(signal.SIGINT, _SIGINT_AT_START)
    yield
    if _SIGINT_AT_START is not None:
        signal.signal(signal.SIGINT, _SIGINT_AT_START)


def run_cli(*args) -> int:
    """`attnaudit ARGS` in-process; the exit code (tests import it: ``from conftest import run_cli``)."""
    from attnaudit.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return 0 if exc.code is None else int(exc.code)
    return 0
