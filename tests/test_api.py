"""The public Python API: lazy top-level names, and a user-written transformer audited end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attnaudit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformer_api.py"


def test_every_public_name_resolves_and_unknown_names_raise():
    for name in attnaudit.__all__:
        assert getattr(attnaudit, name) is not None
    try:
        attnaudit.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("unknown attribute did not raise")


def test_user_transformer_runs_influence_landscape_and_entk_without_special_cases(capsys):
    spec = importlib.util.spec_from_file_location("transformer_api", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "tracked by 'head': ['head.weight', 'head.bias']" in out  # the logits layer, found structurally
    assert "influence (fast: nn.Linear head, cached features)" in out and "empirical NTK (generic: engine): shape (16, 16, 10, 10)" in out
    assert "model untouched: True torch.float32" in out  # train mode and dtype as the user left them
