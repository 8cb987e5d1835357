"""The default CPU thread count (issue 15, item 5): explicit request > ATTNAUDIT_THREADS > idle
cores, decided once per process; the CLI applies it and the JSON report records why."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnaudit.runtime import threads as th
from attnaudit.errors import AuditError


@pytest.fixture(autouse=True)
def _clean_threads(monkeypatch):
    """Each test starts with no cached decision and no ATTNAUDIT_THREADS, and gives torch its
    thread count back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv(th.ENV_VAR, raising=False)
    th._reset_for_tests()
    yield
    th._reset_for_tests()
    torch.set_num_threads(before)


def _machine(monkeypatch, *, cores: int, load: float | None, torch_default: int) -> None:
    """Pretend this process may run on ``cores`` cores under ``load``, torch defaulting to
    ``torch_default`` threads (read at the first choose_threads call)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    if load is None:
        monkeypatch.delattr(os, "getloadavg", raising=False)
    else:
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    torch.set_num_threads(torch_default)


def _cli(args) -> int:
    from attnaudit.cli import main

    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("cores", "load", "torch_default", "expected"),
    [
        (8, 0.0, 4, 4),  # idle machine: torch's default (it is below the usable cores)
        (2, 0.0, 4, 2),  # never more than the usable cores
        (8, 5.4, 8, 3),  # round(8 - 5.4) = 3 idle cores
        (8, 6.0, 8, 2),
        (8, 6.6, 8, 1),  # round(1.4) = 1
        (2, 0.3, 2, 2),  # a load of 0.3 leaves both cores (rounded to the nearest core)
        (2, 0.6, 2, 1),  # 0.6 takes one
        (2, 1.7, 2, 1),
        (2, 50.0, 2, 1),  # busier than the cores: still 1, never 0 or negative
        (4, None, 8, 4),  # no load average on this platform: idle = usable
    ],
)
def test_auto_is_idle_cores_within_usable_and_torch_default(monkeypatch, cores, load, torch_default, expected):
    _machine(monkeypatch, cores=cores, load=load, torch_default=torch_default)
    choice = th.choose_threads()
    assert choice.threads == expected, choice
    assert 1 <= choice.threads <= cores
    assert choice.requested is None
    assert choice.rule.startswith("auto:") and f"{cores} usable cores" in choice.rule, choice.rule
    assert th.choose_threads(0) == choice  # 0 is auto too


def test_high_load_gives_one_thread_and_no_load_gives_torch_default(monkeypatch):
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    default = torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 1000.0, 1000.0))
    assert th.choose_threads().threads == 1
    th._reset_for_tests()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert th.choose_threads().threads == max(1, min(usable, default))


def test_without_affinity_the_cpu_count_is_the_usable_cores(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    torch.set_num_threads(16)
    assert th.choose_threads().threads == 3


def test_auto_is_decided_once_per_process(monkeypatch):
    _machine(monkeypatch, cores=8, load=0.0, torch_default=8)
    first = th.choose_threads()
    assert first.threads == 8
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.5, 7.5))  # the machine got busy
    torch.set_num_threads(2)  # and something changed torch's count in between
    assert th.choose_threads() == first
    th._reset_for_tests()  # a new process would decide again
    assert th.choose_threads().threads == 1  # min(8, 2, round(0.5)) -> 1


def test_an_explicit_request_wins(monkeypatch):
    _machine(monkeypatch, cores=2, load=50.0, torch_default=2)
    monkeypatch.setenv(th.ENV_VAR, "2")
    choice = th.choose_threads(3)  # over the env var, the load and even the usable cores
    assert (choice.threads, choice.requested) == (3, 3)
    assert "explicit" in choice.rule and "3" in choice.rule
    with pytest.raises(AuditError, match=">= 0"):
        th.choose_threads(-1)


def test_the_env_var_overrides_auto_and_is_read_as_given(monkeypatch):
    _machine(monkeypatch, cores=2, load=50.0, torch_default=2)
    monkeypatch.setenv(th.ENV_VAR, " 2 ")
    choice = th.choose_threads()
    assert choice.threads == 2 and choice.requested is None
    assert th.ENV_VAR in choice.rule
    monkeypatch.setenv(th.ENV_VAR, "")  # empty = unset: auto
    assert th.choose_threads().threads == 1


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_an_invalid_env_var_is_an_audit_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(th.ENV_VAR, value)
    with pytest.raises(AuditError) as info:
        th.choose_threads()
    message = str(info.value)
    assert th.ENV_VAR in message and "positive integer" in message and "\n" not in message
    assert th.choose_threads(1).threads == 1  # an explicit request does not read it


def test_apply_sets_torch_and_the_rule_is_recorded(monkeypatch):
    assert th.threads_rule() == "torch default"  # nothing applied: library use
    _machine(monkeypatch, cores=2, load=0.0, torch_default=2)
    choice = th.choose_threads(1)
    assert th.apply_threads(choice) == 2
    assert torch.get_num_threads() == 1
    assert th.threads_rule() == choice.rule
    torch.set_num_threads(2)  # changed behind the choice's back: the report says so
    assert "since changed to 2" in th.threads_rule()

    from attnaudit.report.envelope import environment_info

    env = environment_info()
    assert env["torch_threads"] == 2 and env["threads_rule"].startswith(choice.rule)


# ----------------------------------------------------------------------------- the command line
def test_negative_threads_exit_2_with_one_line(capsys):
    assert _cli(["--threads", "-1", "kappa"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--threads" in err and "Traceback" not in err, err


def test_an_invalid_env_var_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv(th.ENV_VAR, "lots")
    assert _cli(["kappa", "--n", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and th.ENV_VAR in err and "Traceback" not in err, err


def test_the_json_report_records_the_explicit_count_and_rule(tmp_path, monkeypatch):
    monkeypatch.setenv(th.ENV_VAR, "2")  # the explicit option beats the environment
    path = tmp_path / "k.json"
    assert _cli(["--threads", "1", "kappa", "--n", "100", "-q", "--json", str(path)]) == 0
    env = json.loads(path.read_text())["environment"]
    assert env["torch_threads"] == 1
    assert "explicit" in env["threads_rule"] and "--threads 1" in env["threads_rule"], env


def test_auto_in_process_runs_share_one_count_and_bit_identical_numbers(tmp_path, monkeypatch):
    _machine(monkeypatch, cores=2, load=1.5, torch_default=2)  # one core busy: auto takes 1
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert _cli(["kappa", "--n", "100", "-q", "--json", str(a)]) == 0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # idle now: no new decision
    assert _cli(["kappa", "--n", "100", "-q", "--json", str(b)]) == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["environment"]["torch_threads"] == rb["environment"]["torch_threads"] == 1
    assert ra["environment"]["threads_rule"] == rb["environment"]["threads_rule"]
    assert ra["environment"]["threads_rule"].startswith("auto:") and "load 1.50" in ra["environment"]["threads_rule"]
    assert ra["results"] == rb["results"]


def cell_threads(config: dict) -> int:
    """A sweep cell reporting the worker's torch thread count."""
    return torch.get_num_threads()


def test_worker_processes_get_the_drivers_auto_count(monkeypatch):
    from attnaudit.runtime.sweep import CellTask, ExecutorConfig, run_cells

    _machine(monkeypatch, cores=2, load=1.5, torch_default=2)
    th.apply_threads(th.choose_threads())  # what `attnaudit` does by default
    assert torch.get_num_threads() == 1
    tasks = [CellTask(f"{__name__}:cell_threads", {"i": i}, f"cell {i}") for i in range(2)]
    out = run_cells(tasks, ExecutorConfig(jobs=2))  # threads per cell: the driver's, by default
    assert [o.error for o in out] == [None, None]
    assert [o.result for o in out] == [1, 1]  # a fresh spawned worker would default to its cores
