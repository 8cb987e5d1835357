"""`attnaudit claims --keep-reports DIR` and `--reports DIR`: keep every run's report, and score kept
reports again without running anything (the same scoring code as a run).

One real quick scorecard (shrunk like tests/claims/test_claims.py's end-to-end test) is run once per module;
the other tests copy its folder and edit it."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

from attnaudit.claims import plan as P
from attnaudit.claims import run as R

try:
    from test_claims import SMALL
except ImportError:  # run from elsewhere than tests/
    from tests.test_claims import SMALL

MAIN_FILES = {
    "kappa": "kappa.json",
    "ntk": "ntk-distance.json",
    "malleability": "malleability.json",
    "landscape": "landscape.json",
    "alignment": "alignment.json",
}


def small(real_plan):
    """``plan.plan`` with every run shrunk (SMALL), as the end-to-end test of tests/claims/test_claims.py does."""
    takes_resample = "resample" in inspect.signature(real_plan).parameters

    def small_plan(mode, data_args, seed, n_seeds=P.DEFAULT_SEEDS, match_loss=None, resample=True):
        extra = {"resample": resample} if takes_resample else {}
        runs, variants = real_plan(mode, data_args, seed, n_seeds=n_seeds, match_loss=match_loss, **extra)
        return [P.RunSpec(r.id, r.command, (*r.args, *SMALL[r.command]), r.purpose) for r in runs], variants

    return small_plan


def claims(*args) -> int:
    """``attnaudit --threads 1 claims ARGS`` in-process; the exit code."""
    from attnaudit.cli import main

    try:
        main(["--threads", "1", "claims", *[str(a) for a in args]])
    except SystemExit as exc:
        return 0 if exc.code is None else int(exc.code)
    return 0


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """(the folder --keep-reports wrote, the scorecard's JSON report) of one shrunk quick run over 3 seeds."""
    root = tmp_path_factory.mktemp("kept")
    folder, out = root / "reports", root / "claims.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "plan", small(P.plan))
        code = claims("--preset", "quick", "--seeds", "3", "-q", "--keep-reports", folder, "--json", out)
    report = json.loads(out.read_text())
    failed = {r["id"]: r["error"] for r in report["results"]["runs"] if r["error"]}
    assert code == 0 and not failed, failed
    return folder, report


@pytest.fixture
def copy(kept, tmp_path):
    """A copy of the kept folder to edit."""
    return shutil.copytree(kept[0], tmp_path / "reports")


def rescore(folder, tmp_path, *extra) -> tuple[int, dict | None]:
    out = tmp_path / "rescored.json"
    code = claims("--reports", folder, "-q", "--json", out, *extra)
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_kept_reports_score_the_same_scorecard_again(kept, tmp_path):
    folder, first = kept
    runs = [r["id"] for r in first["results"]["runs"]]
    assert {r for r in runs if "-v" in r} and set(runs) - {r for r in runs if "-v" in r} <= set(MAIN_FILES)
    names = {MAIN_FILES.get(rid, f"{rid}.json") for rid in runs}
    assert {p.name for p in folder.iterdir()} == names | {"manifest.json"}
    for r in first["results"]["runs"]:  # each file is the run's report
        assert json.loads((folder / MAIN_FILES.get(r["id"], f"{r['id']}.json")).read_text()) == r["report"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(m["id"], m["file"], m["command"], m["error"]) for m in manifest["runs"]] == [
        (r["id"], MAIN_FILES.get(r["id"], f"{r['id']}.json"), r["command"], None) for r in first["results"]["runs"]
    ]
    assert (manifest["mode"], manifest["seed"], manifest["n_seeds"], manifest["slope_margin"]) == ("quick", 0, 3, 0.1)
    commands = {r["id"]: r["command"] for r in first["results"]["runs"]}
    assert [(v["name"], commands[v["run"]]) for v in manifest["variants"]] == [
        (v["variant"], v["command"]) for v in first["results"]["protocol_variants"]
    ]
    assert first["results"]["protocol"]["resample_data"] is True and first["inputs"]["rescored_from"] is None

    code, again = rescore(folder, tmp_path)  # the real plan: commands and variants come from the manifest
    assert code == 0 and again is not None
    assert again["results"]["claims"] == first["results"]["claims"]
    assert again["results"]["protocol_variants"] == first["results"]["protocol_variants"]
    assert again["results"]["protocol"] == first["results"]["protocol"]
    assert again["verdicts"] == first["verdicts"] and again["warnings"] == first["warnings"]
    assert again["inputs"]["rescored_from"] == str(folder)
    assert {k: v for k, v in again["inputs"].items() if k != "rescored_from"} == {
        k: v for k, v in first["inputs"].items() if k != "rescored_from"
    }
    assert again["seeds"] == first["seeds"]


def test_without_a_manifest_the_options_rebuild_the_plan(copy, kept, tmp_path, monkeypatch):
    (copy / "manifest.json").unlink()
    monkeypatch.setattr(P, "plan", small(P.plan))
    code, again = rescore(copy, tmp_path, "--preset", "quick", "--seeds", "3")
    assert code == 0 and again is not None
    assert again["results"]["claims"] == kept[1]["results"]["claims"]
    assert again["results"]["protocol_variants"] == kept[1]["results"]["protocol_variants"]


def test_a_missing_report_makes_only_its_rows_not_testable(copy, kept, tmp_path):
    first = kept[1]["results"]
    (copy / "landscape.json").unlink()
    (copy / "malleability-v1.json").unlink()
    code, again = rescore(copy, tmp_path)
    assert code == 1 and again is not None  # the scorecard is written, and the run says rows are missing
    res = again["results"]
    assert len(res["claims"]) == len(first["claims"])
    for before, after in zip(first["claims"], res["claims"]):
        if after["run"] == "landscape":
            assert after["verdict"] == "not testable here"
            assert after["why"] == f"the run failed: no report (landscape.json not in {copy})"
            assert after["command"] == before["command"]
        else:
            assert after == before
    v1 = next(r["command"] for r in first["runs"] if r["id"] == "malleability-v1")
    for before, after in zip(first["protocol_variants"], res["protocol_variants"]):
        if after["command"] == v1:
            assert after["error"] == f"no report (malleability-v1.json not in {copy})"
        else:
            assert after == before
    errors = {r["id"]: r["error"] for r in res["runs"]}
    assert {rid for rid, e in errors.items() if e} == {"landscape", "malleability-v1"}


@pytest.mark.parametrize(
    "name,text,problem",
    [
        ("kappa.json", "{not json", "not valid JSON"),
        ("ntk-distance.json", '{"schema": "attnaudit.ntk-distance/1", "verdicts": []}', "no 'results' mapping"),
        ("malleability-v2.json", "[1, 2]", "not an object"),
        ("landscape.json", '{"schema": "attnaudit.kappa/1", "results": {}}', "where the landscape run's belongs"),
        ("manifest.json", '{"mode": "slow"}', "'mode' must be quick or full"),
        ("manifest.json", "", "not valid JSON"),
    ],
)
def test_a_corrupt_file_is_refused_in_one_line(copy, tmp_path, capsys, name, text, problem):
    (copy / name).write_text(text)
    capsys.readouterr()
    code, again = rescore(copy, tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and again is None
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert name in err and problem in err


def test_keep_reports_refuses_to_replace_files_unless_overwrite(kept, copy, tmp_path, capsys, monkeypatch):
    def no_runs(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(R, "run_cells", no_runs)
    monkeypatch.setattr(P, "plan", small(P.plan))
    capsys.readouterr()
    code = claims("--preset", "quick", "--seeds", "3", "-q", "--keep-reports", copy, "--json", tmp_path / "c.json")
    err = capsys.readouterr().err
    assert code == 2 and "already exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c.json").exists()
    # the library's rule, and --overwrite's
    ids = [r["id"] for r in kept[1]["results"]["runs"]]
    with pytest.raises(R.FieldError, match="already exists"):
        R.check_keep(R.ClaimsRequest(keep_reports=str(copy)), ids)
    R.check_keep(R.ClaimsRequest(keep_reports=str(copy), overwrite=True), ids)
    R.check_keep(R.ClaimsRequest(keep_reports=str(tmp_path / "new" / "folder")), ids)
    assert R.ClaimsRequest(keep_reports="k", overwrite=True).to_argv() == ["--keep-reports", "k"]
    (tmp_path / "file").write_text("")
    with pytest.raises(R.FieldError, match="is a file"):
        R.check_keep(R.ClaimsRequest(keep_reports=str(tmp_path / "file")), ids)


def test_keep_with_overwrite_replaces_the_set_and_drops_a_failed_runs_old_report(copy, kept):
    records = [
        {**r, "analysis": None, "seeds": [0], "report": None if r["id"] == "kappa" else r["report"]}
        for r in kept[1]["results"]["runs"]
    ]
    protocol = R.RunsProtocol("quick", 0, 3, None, 0.1, True, ("--dataset", "digits"))
    with pytest.raises(R.AuditError, match="pass --overwrite"):
        R.keep(str(copy), protocol, records, [])
    R.keep(str(copy), protocol, records, [], overwrite=True)
    assert not (copy / "kappa.json").exists()
    assert json.loads((copy / "manifest.json").read_text())["variants"] == []
    assert not [p for p in copy.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_reports_and_keep_reports_together_are_refused(tmp_path, capsys):
    code = claims("--reports", tmp_path, "--keep-reports", tmp_path / "k", "-q")
    err = capsys.readouterr().err
    assert code == 2 and "--keep-reports" in err and "--reports" in err and "Traceback" not in err


def test_rescoring_options_must_agree_with_the_kept_runs(copy, tmp_path, capsys):
    capsys.readouterr()
    code, _ = rescore(copy, tmp_path, "--seeds", "4")  # (5, the default, reads as not given)
    err = capsys.readouterr().err
    assert code == 2 and "--seeds 4 disagrees" in err and "records 3" in err
    code, _ = rescore(copy, tmp_path, "--fixed-split")
    assert code == 2 and "--fixed-split disagrees" in capsys.readouterr().err
    code, _ = rescore(tmp_path / "nowhere", tmp_path)
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_a_given_slope_margin_rescores_the_kept_reports(copy, tmp_path):
    code, again = rescore(copy, tmp_path, "--slope-margin", "0.3")
    assert code == 0 and again is not None
    assert again["results"]["protocol"]["slope_margin"] == 0.3 and again["inputs"]["slope_margin"] == 0.3


def test_fixed_split_reaches_the_plan_and_the_protocol(monkeypatch):
    asked = []

    def record(mode, data_args, seed, n_seeds=P.DEFAULT_SEEDS, match_loss=None, resample=True):
        asked.append(resample)
        return [], []

    monkeypatch.setattr(P, "plan", record)
    R.ClaimsRequest(fixed_split=True).planned()
    R.ClaimsRequest().planned()
    assert asked == [False, True]
    assert R.RunsProtocol.of(R.ClaimsRequest(fixed_split=True), None).resample_data is False
    assert R.ClaimsRequest.from_argv(["--fixed-split"]).fixed_split is True
