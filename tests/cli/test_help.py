"""`--help` reads like a manual: options in panels, plain metavars, a runnable example (docs/cli.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.core import TyperOption

from attnaudit.cli import app, main
from attnaudit.cli.options import PANELS

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["kappa", "ntk-distance", "malleability", "landscape", "train", "audit", "claims", "report"]
PLAIN_METAVARS = {"TEXT", "INTEGER", "FLOAT", "PATH"}
PATH_OPTIONS = {
    "--json",
    "--png",
    "--html",
    "--out-dir",
    "--data",
    "--data-dir",
    "--checkpoint",
    "--weights",
    "--resume",
    "--out",
    "--junit",
    "--save-baseline",
    "--baseline",
    "--save-models",
    "--reference-checkpoint",
}


def _group():
    return typer.main.get_command(app)


def _options(name: str) -> list[TyperOption]:
    """The options --help shows (older spellings are hidden: tests/analyses/test_requests.py covers them)."""
    return [p for p in _group().commands[name].params if isinstance(p, TyperOption) and not p.hidden]


def _help(capsys, monkeypatch, *args: str) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # rich would wrap or cut at 80 columns
    with pytest.raises(SystemExit) as exc:
        main([*args, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _panel(out: str, title: str) -> str:
    """The text of one panel: from its title line to its bottom border."""
    start = out.index(f"─ {title} ─")
    return out[start : out.index("╰", start)]


def _examples(epilog: str) -> list[list[str]]:
    """The command lines of 'Example: attnaudit ... [&& attnaudit ...]' (first line after 'Example:')."""
    line = epilog.split("Example:", 1)[1].strip().splitlines()[0]
    return [shlex.split(part) for part in line.split("&&")]


def test_root_help_lists_every_command(capsys, monkeypatch):
    out = _help(capsys, monkeypatch)
    for name in COMMANDS:
        assert re.search(rf"│ {re.escape(name)}\s", out), name


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_sits_in_a_panel_in_the_manual_order(name, capsys, monkeypatch):
    options = _options(name)
    assert [p.opts[0] for p in options if p.rich_help_panel not in PANELS] == []
    out = _help(capsys, monkeypatch, name)
    used = [panel for panel in PANELS if any(p.rich_help_panel == panel for p in options)]
    positions = [out.index(f"─ {panel} ─") for panel in used]
    assert positions == sorted(positions), used
    assert re.findall(r"--[\w-]+", _panel(out, "Options")) == ["--help"]
    for p in options:  # each flag, in the panel the option names
        panel = _panel(out, p.rich_help_panel)
        for flag in p.opts + p.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", panel), (flag, p.rich_help_panel)


@pytest.mark.parametrize("name", COMMANDS)
def test_plain_metavars_and_no_type_labels(name, capsys, monkeypatch):
    for p in _options(name):
        if p.is_flag:
            assert p.metavar == "", p.opts
        else:
            assert p.metavar in PLAIN_METAVARS, (p.opts, p.metavar)
            if set(p.opts) & PATH_OPTIONS:
                assert p.metavar == "PATH", p.opts
    out = _help(capsys, monkeypatch, name)
    assert "<bool>" not in out
    options_part = out[out.index("─ Options ─") :]  # arguments keep typer's own labels
    assert re.findall(r"<(?:str|int|float|bool|list\[\w+\])>", options_part) == []
    for p in _options(name):  # a value option's row: its flag, then its metavar
        if not p.is_flag:
            assert re.search(rf"{re.escape(','.join(p.opts))}\s+{p.metavar}\s", out), (p.opts, p.metavar)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_ends_with_an_example_that_parses(name, capsys, monkeypatch):
    command = _group().commands[name]
    assert command.epilog and command.epilog.startswith("Example: attnaudit ")
    out = _help(capsys, monkeypatch, name)
    assert command.epilog.splitlines()[0] in out
    assert out.rstrip().splitlines()[-1].strip().startswith("Example:")
    examples = _examples(command.epilog)
    assert any(args[1] == name for args in examples)
    for args in examples:
        assert args[0] == "attnaudit"
        sub = _group().commands[args[1]]
        # strict parsing (not resilient): unknown options, bad values and missing required options fail here
        with sub.make_context(args[1], args[2:]) as ctx:
            assert ctx.params
        for arg in args[2:]:
            if arg.startswith("examples/"):
                assert (REPO / arg).is_file(), arg


def test_help_texts_are_not_eaten_as_markup(capsys, monkeypatch):
    out = _help(capsys, monkeypatch, "kappa")
    assert "attnaudit[hf]" in out
    out = _help(capsys, monkeypatch, "ntk-distance")
    assert "attnaudit[ray]" in out


def _run_cli(*args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "attnaudit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )


def test_dash_h_is_help_for_the_program_and_every_command():
    root = _run_cli("-h")
    assert root.returncode == 0 and "Usage: attnaudit" in root.stdout and "kappa" in root.stdout
    for name in ("kappa", "audit"):
        sub = _run_cli(name, "-h")
        assert sub.returncode == 0, sub.stderr
        assert f"Usage: attnaudit {name}" in sub.stdout


def test_threads_works_after_the_command_name_too():
    import json

    before = _run_cli("--threads", "1", "kappa", "--n", "40", "--json", "-", "-q")
    after = _run_cli("kappa", "--n", "40", "--threads", "1", "--json", "-", "-q")
    assert before.returncode == 0 and after.returncode == 0, after.stderr
    rules = [json.loads(r.stdout)["environment"]["threads_rule"] for r in (before, after)]
    assert rules == ["explicit request: --threads 1"] * 2
    bad = _run_cli("kappa", "--threads", "-3")
    assert bad.returncode == 2 and "--threads must be >= 0" in bad.stderr


def test_usage_lines_write_positional_arguments_plainly():
    for name, usage in (
        ("audit", "Usage: attnaudit audit [OPTIONS] AUDIT.yaml"),
        ("report", "Usage: attnaudit report [OPTIONS] RUN.json..."),
    ):
        out = _run_cli(name, "-h").stdout
        assert usage in out and "{" not in out.split("\n\n")[0], out[:300]
