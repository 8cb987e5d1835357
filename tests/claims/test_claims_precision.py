"""The claims scorecard passes --precision to every run whose analysis takes it (kappa,
ntk-distance, malleability, landscape), never to alignment (closed-form float64 kernels), and
nothing at all for auto (each analysis' own default)."""

from __future__ import annotations

import pytest

from attnaudit.analyses.registry import request_from_argv, request_type
from attnaudit.claims.run import ClaimsRequest
from attnaudit.errors import FieldError

TAKES_PRECISION = {"kappa", "ntk-distance", "malleability", "landscape"}


def _runs(precision: str) -> list:
    runs, _ = ClaimsRequest(precision=precision).planned()
    assert {r.command for r in runs} >= TAKES_PRECISION | {"alignment"}  # the plan has every kind of run
    return runs


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float64"])
def test_an_explicit_precision_reaches_every_run_but_alignment(precision):
    for r in _runs(precision):
        args = list(r.args)
        if r.command in TAKES_PRECISION:
            assert args.count("--precision") == 1, (r.id, args)
            assert args[args.index("--precision") + 1] == precision, (r.id, args)
            assert request_from_argv(r.command, args).precision == precision, r.id  # the run's request parses it
        else:
            assert r.command == "alignment" and "--precision" not in args, (r.id, args)
            request_from_argv(r.command, args)  # alignment's command line stays valid
    assert "precision" not in request_type("alignment").options()  # why alignment gets none


def test_auto_adds_nothing_and_every_run_keeps_its_own_default():
    for r in _runs("auto"):
        assert "--precision" not in r.args, (r.id, r.args)
        if r.command in TAKES_PRECISION:
            assert request_from_argv(r.command, list(r.args)).precision == "auto"
    assert ClaimsRequest().precision == "auto"


def test_the_claims_request_round_trips_and_refuses_an_unknown_precision():
    r = ClaimsRequest.from_argv(["--precision", "float32"])
    assert r.precision == "float32" and ClaimsRequest.from_argv(r.to_argv()) == r
    assert "--precision" not in ClaimsRequest().to_argv()
    with pytest.raises(FieldError) as err:
        ClaimsRequest(precision="float16")
    assert err.value.field == "precision" and "float16" in str(err.value)
