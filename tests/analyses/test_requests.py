"""Requests are the one table from flag to field: argv -> request -> argv round-trips for every
command, the library's parse of a command line agrees with the CLI's, errors name the field as
the caller spelled it, and the CLI's options are exactly the request's (plus output/execution)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from attnaudit.analyses.registry import COMMANDS, request_type
from attnaudit.analyses.request import FieldError
from attnaudit.claims.run import ClaimsRequest
from attnaudit.errors import AuditError

# per command: command lines in canonical form (declaration order, defaults left out)
SAMPLES = {
    "kappa": [
        [],
        ["--n", "64,128", "--seeds", "3", "--stratify", "--no-direct-check", "--seed", "7"],
        [
            "--dataset",
            "synthetic",
            "--split",
            "test",
            "--classes",
            "0,1,7",
            "--preprocess",
            "center",
            "--n",
            "100",
            "--rank-tol",
            "1e-08",
        ],
        [
            "--checkpoint",
            "a.safetensors",
            "--checkpoint",
            "b.safetensors",
            "--n",
            "32",
            "--layers",
            "blocks.*.attn,head",
            "--gram",
            "entk",
            "--device",
            "cpu",
        ],
    ],
    "ntk-distance": [
        [],
        ["--preset", "paper", "--widths", "16,64", "--seed", "3"],
        ["--checkpoint", "m.safetensors"],
        ["--arch", "vit,vit-linear", "--widths", "16,32"],
    ],
    "malleability": [
        [],
        ["--preset", "paper", "--eps", "0.05,0.1", "--attacks", "pgd,random", "--seeds", "2"],
        ["--dataset", "digits", "--models", "relu", "--match-loss", "auto"],
    ],
    "landscape": [
        [],
        ["--preset", "paper", "--seed", "2"],
        ["--dataset", "digits", "--match-loss", "0.5"],
    ],
    "alignment": [
        [],
        ["--dataset", "digits", "--seed", "1"],
    ],
    "train": [
        ["--out", "m.safetensors"],
        ["--arch", "relu", "--dataset", "synthetic", "--steps", "3", "--seed", "1", "--out", "relu.safetensors"],
    ],
}


def _canonical(request_cls, argv):
    """``argv`` reordered the way to_argv writes it (fields in declaration order)."""
    return request_cls.from_argv(argv).to_argv()


def test_every_registered_command_has_samples():
    assert set(SAMPLES) == set(COMMANDS)


@pytest.mark.parametrize(
    "command,argv",
    [(c, a) for c, samples in SAMPLES.items() for a in samples]
    + [
        ("claims", a) for a in ([], ["--preset", "paper", "--seeds", "3"], ["--preset", "quick", "--match-loss", "0.5"])
    ],
)
def test_argv_request_argv_round_trips_through_the_cli(command, argv):
    from attnaudit.cli import request_of

    cls = ClaimsRequest if command == "claims" else request_type(command)
    via_cli = request_of([command, *argv])
    assert type(via_cli) is cls
    assert sorted(via_cli.to_argv()) == sorted(argv)  # nothing lost, nothing added
    assert via_cli == cls.from_argv(argv)  # the library parses the line as the CLI does
    assert cls.from_argv(via_cli.to_argv()) == via_cli
    assert cls.from_dict(via_cli.to_dict()) == via_cli
    assert via_cli.command_line().split()[:2] == ["attnaudit", command]


@pytest.mark.parametrize("command", sorted(COMMANDS) + ["claims"])
def test_the_cli_options_are_the_request_fields(command):
    import typer

    from attnaudit.cli import app

    cls = ClaimsRequest if command == "claims" else request_type(command)
    cli = typer.main.get_command(app).commands[command]
    cli_flags = {opt for p in cli.params for opt in (*p.opts, *p.secondary_opts)}
    for name, option in cls.options().items():
        missing = {*option.flags, *([option.negative] if option.negative else [])} - cli_flags
        assert not missing, f"{command}: field {name} has no CLI option {missing}"
    request_flags = {
        f for o in cls.options().values() for f in (*o.flags, *o.deprecated, *([o.negative] if o.negative else []))
    }
    extra = cli_flags - request_flags
    from attnaudit.cli.options import ExecutorOptions, OutputBundle

    allowed = {
        "--help",
        "-h",
        "--quiet",
        "-q",
        "--json",
        "--png",
        "--html",
        "--out-dir",
        "--overwrite",
        "--debug",
        "--save-models",
    }
    allowed |= {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ExecutorOptions)}
    allowed |= {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(OutputBundle)}
    assert extra <= allowed, f"{command}: CLI options outside the request: {sorted(extra - allowed)}"


def test_a_field_error_names_the_field_in_python_and_the_flag_on_the_command_line(capsys):
    from attnaudit.analyses.kappa.run import KappaRequest
    from attnaudit.cli import main

    with pytest.raises(FieldError) as exc:
        KappaRequest(seeds=0)
    assert exc.value.field == "seeds" and str(exc.value) == "seeds must be >= 1, got 0"
    with pytest.raises(FieldError, match=r"^seed must be an integer in 0\.\."):
        KappaRequest(seed=-1)
    with pytest.raises(SystemExit) as code:
        main(["kappa", "--seeds", "0", "-q"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "--seeds must be >= 1, got 0" in err and "Traceback" not in err


def test_unknown_options_are_refused_with_a_hint():
    from attnaudit.analyses.kappa.run import KappaRequest

    with pytest.raises(AuditError, match="no option --sedes; did you mean '--seeds'"):
        KappaRequest.from_argv(["--sedes", "3"])
    with pytest.raises(AuditError, match="did you mean 'seeds'"):
        KappaRequest.from_options({"sedes": 3})


def test_yaml_values_and_command_line_text_give_the_same_request():
    from attnaudit.analyses.kappa.run import KappaRequest

    from_yaml = KappaRequest.from_options({"n": [64, 128], "direct-check": False, "classes": [0, 1], "rank_tol": 1e-8})
    from_text = KappaRequest.from_argv(["--n", "64,128", "--no-direct-check", "--classes", "0,1", "--rank-tol", "1e-8"])
    assert from_yaml == from_text and from_yaml.n == (64, 128)


def test_a_request_holding_in_memory_data_runs_and_says_no_command_line_reproduces_it():
    from attnaudit.analyses.kappa.run import KappaRequest, run
    from attnaudit.data import DataSpec, load_dataset

    ds = load_dataset(DataSpec(dataset="digits", n=80, seed=0))
    request = KappaRequest(loaded_data=ds)
    result = run(request)
    assert result.to_dict()["command"] is None
    assert result.results["gram"]["n"] == 80
    with pytest.raises(AuditError, match="in-memory loaded_data"):
        request.command_line()
    # the same rows read from the data set give the same numbers
    again = run(KappaRequest(dataset="digits", n=(80,)))
    assert again.results["gram"]["kappa_at_numerical_rank"] == pytest.approx(
        result.results["gram"]["kappa_at_numerical_rank"], rel=1e-10
    )


def test_requests_are_frozen_and_replace_validates():
    from attnaudit.analyses.kappa.run import KappaRequest

    request = KappaRequest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.seeds = 3  # type: ignore[misc]
    assert request.replace(seeds=3).seeds == 3
    with pytest.raises(FieldError):
        request.replace(seeds=0)


@pytest.mark.parametrize("flag", ["--top-k", "--dtype", "--model"])
def test_the_spellings_removed_in_0_2_0_are_refused_with_a_hint(flag):
    """landscape --top-k, --dtype and --model were renamed (--eigenvalues, --precision, --checkpoint)
    and removed in 0.2.0: an old command line stops with exit 2 instead of meaning something else."""
    LandscapeRequest = request_type("landscape")
    with pytest.raises(AuditError, match=re.escape(flag)):
        LandscapeRequest.from_argv([flag, "3"])


def test_help_shows_defaults_and_hides_the_older_spellings():
    from typer.testing import CliRunner

    from attnaudit.cli import app

    text = CliRunner().invoke(app, ["landscape", "--help"], env={"COLUMNS": "200"}).output
    assert "--eigenvalues" in text and "[default: 5]" in text and "--precision" in text
    rows = [line.strip(" │") for line in text.splitlines()]
    assert not any(row.startswith(("--top-k", "--model ", "--dtype")) for row in rows)
