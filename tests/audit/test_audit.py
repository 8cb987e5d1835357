"""`attnaudit audit FILE` (issue 12, docs/audit.md): the audit file's validation (key paths,
'did you mean' hints, the dry run, hostile YAML), pass/fail/error/skipped checks, the JSON
and JUnit reports, shared runs, baselines, determinism and the Python API.

Every run uses the embedded `digits` data and tiny options. The values a check reports are
compared with independent ones: the same command run on its own through the CLI, and numpy's
eigenvalues of the Gram for the kappa metrics.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
import yaml

# tiny malleability settings (relu only, 2 seeds so ci_high is a real interval bound)
MALL = {
    "models": "relu",
    "attacks": "pgd,random",
    "eps": 0.1,
    "n-train": 40,
    "n-test": 20,
    "width": 8,
    "steps": 10,
    "top-k": 10,
    "pgd-steps": 2,
    "seeds": 2,
    "controls": False,
}
MALL_ARGS = [
    "--models",
    "relu",
    "--attacks",
    "pgd,random",
    "--eps",
    "0.1",
    "--n-train",
    "40",
    "--n-test",
    "20",
    "--width",
    "8",
    "--steps",
    "10",
    "--top-k",
    "10",
    "--pgd-steps",
    "2",
    "--seeds",
    "2",
    "--no-controls",
]
KAPPA_N = 200


# ----------------------------------------------------------------------------- helpers
cli = run_cli


def write_audit(path: Path, doc: dict | str) -> Path:
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def kappa_check(name: str, **extra) -> dict:
    check = {"name": name, "analysis": "kappa", "options": {"n": KAPPA_N}, "metric": "log10_kappa_at_rank"}
    check.update(extra)
    return check


def audit_doc(*checks: dict, **top) -> dict:
    return {"version": 1, "seed": 0, "data": {"dataset": "digits"}, **top, "checks": list(checks)}


def values_of(report: dict) -> dict:
    return {c["name"]: c["value"] for c in report["results"]["checks"]}


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["results"]["checks"]}


def junit_cases(path: Path) -> tuple[ET.Element, ET.Element, dict]:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = {case.get("name"): case for case in suite.findall("testcase")}
    return root, suite, cases


def numpy_log10_kappa_at_rank(n: int, seed: int) -> float:
    """log10 lambda_max / lambda_r of X X^T for the rows `kappa --dataset digits --n n --seed seed` reads,
    by numpy: eigvalsh of the Gram, numerical rank by numpy's matrix_rank rule on the singular values of X."""
    from attnaudit.data import DataSpec, load_dataset

    X = load_dataset(DataSpec(dataset="digits", n=n, seed=seed)).X.double().numpy()
    lam = np.linalg.eigvalsh(X @ X.T)[::-1]
    rank = int(np.linalg.matrix_rank(X))
    assert 0 < rank < min(X.shape)  # digits: always-blank pixels, so rank deficient and the cutoff matters
    assert lam[rank - 1] > 1e6 * abs(lam[rank])  # a clear gap: the cutoff is not a judgement call
    return float(np.log10(lam[0] / lam[rank - 1]))


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------- the main audit, run once
@pytest.fixture(scope="module")
def mall_audit(tmp_path_factory):
    """Two malleability checks on one command line (a shared run), a passing and a failing kappa check
    (also one shared run): exit 1; JSON and JUnit written."""
    root = tmp_path_factory.mktemp("mall")
    other_spelling = {k.replace("-", "_"): v for k, v in MALL.items()}  # n_train == n-train
    doc = audit_doc(
        {
            "name": "pgd-flip-rate",
            "analysis": "malleability",
            "description": "PGD flip rate, upper CI bound",
            "options": dict(MALL),
            "metric": "flip_rate",
            "select": {"model": "relu", "attack": "pgd", "eps": 0.1},
            "stat": "ci_high",
            "max": 1.0,
        },
        {
            "name": "pgd-over-random",
            "analysis": "malleability",
            "options": other_spelling,
            "metric": "flip_rate_over_random",
            "select": {"attack": "PGD"},
            "max": 1.0,
        },
        kappa_check("kappa-ok", max=100.0),
        kappa_check("kappa-too-strict", max=1.5),
        name="mall-gate",
    )
    path = write_audit(root / "audit.yaml", doc)
    json_path, junit_path = root / "r.json", root / "r.xml"
    code = cli("audit", path, "--json", json_path, "--junit", junit_path)
    report = json.loads(json_path.read_text())
    return {"code": code, "report": report, "junit": junit_path, "path": path, "root": root}


def test_failing_audit_exits_1_and_reports_every_check(mall_audit):
    assert mall_audit["code"] == 1
    report = mall_audit["report"]
    assert report["schema"] == "attnaudit.audit/1"
    res = report["results"]
    assert res["file"]["name"] == "mall-gate" and res["file"]["version"] == 1 and len(res["file"]["sha256"]) == 64
    assert res["model"] is None
    status = {c["name"]: c["status"] for c in res["checks"]}
    assert status == {
        "pgd-flip-rate": "pass",
        "pgd-over-random": "pass",
        "kappa-ok": "pass",
        "kappa-too-strict": "fail",
    }
    assert res["summary"]["checks"] == 4 and res["summary"]["passed"] == 3 and res["summary"]["failed"] == 1
    assert res["summary"]["errors"] == 0 and res["summary"]["skipped"] == 0 and res["summary"]["exit_code"] == 1
    checks = by_name(report)
    assert checks["pgd-flip-rate"]["stat"] == "ci_high" and checks["pgd-flip-rate"]["max"] == 1.0
    assert checks["pgd-flip-rate"]["description"] == "PGD flip rate, upper CI bound"
    assert checks["pgd-over-random"]["stat"] == "mean"  # the metric's first stat is the default
    for c in res["checks"]:
        assert c["command"].startswith(f"attnaudit {c['analysis']} ")
        assert "--seed 0" in c["command"]  # the file's seed reaches every run
        assert isinstance(c["values"], list) and c["values"]
    assert checks["kappa-too-strict"]["value"] > 1.5


def test_junit_xml_one_case_per_check_and_the_right_failure(mall_audit):
    report = mall_audit["report"]
    root, suite, cases = junit_cases(mall_audit["junit"])
    assert suite.get("name") == "mall-gate"
    assert suite.get("tests") == "4" and suite.get("failures") == "1"
    assert suite.get("errors") == "0" and suite.get("skipped") == "0"
    assert float(suite.get("time")) >= 0
    assert len(suite.findall("testcase")) == 4 and set(cases) == set(values_of(report))
    for c in report["results"]["checks"]:
        case = cases[c["name"]]
        assert case.get("classname") == f"attnaudit.{c['analysis']}"
        assert float(case.get("time")) >= 0
        failures = case.findall("failure")
        if c["name"] == "kappa-too-strict":
            assert len(failures) == 1 and failures[0].get("type") == "threshold"
        else:
            assert failures == [] and case.findall("error") == [] and case.findall("skipped") == []
    fail = cases["kappa-too-strict"].find("failure")
    message = fail.get("message")
    value = by_name(report)["kappa-too-strict"]["value"]
    assert any(text in message for text in (f"{value:.6g}", f"{value:.4g}", repr(value)))  # the value
    assert "1.5" in message  # the threshold
    command = by_name(report)["kappa-too-strict"]["command"]
    assert command in message  # the command that reproduces it


def test_reproduce_command_in_the_failure_gives_the_same_value_and_numpy_agrees(mall_audit, tmp_path):
    _, _, cases = junit_cases(mall_audit["junit"])
    message = cases["kappa-too-strict"].find("failure").get("message")
    command = by_name(mall_audit["report"])["kappa-too-strict"]["command"]
    argv = shlex.split(command)
    assert argv[0] == "attnaudit" and argv[1] == "kappa"
    out = tmp_path / "k.json"
    assert cli(*argv[1:], "--json", out, "-q") == 0
    standalone = json.loads(out.read_text())["results"]["gram"]["log10_kappa_at_numerical_rank"]
    value = by_name(mall_audit["report"])["kappa-too-strict"]["value"]
    assert value == standalone
    assert command in message
    # independent: numpy's eigenvalues of X X^T on the same rows
    assert value == pytest.approx(numpy_log10_kappa_at_rank(KAPPA_N, 0), abs=1e-8)


def test_identical_command_lines_share_one_run(mall_audit):
    res = mall_audit["report"]["results"]
    runs = res["runs"]
    assert len(runs) == 2  # one malleability run, one kappa run
    mall = [r for r in runs if r["analysis"] == "malleability"]
    assert len(mall) == 1 and sorted(mall[0]["checks"]) == ["pgd-flip-rate", "pgd-over-random"]
    assert mall[0]["report"]["schema"].startswith("attnaudit.malleability/")  # the command's full report
    checks = by_name(mall_audit["report"])
    assert checks["pgd-flip-rate"]["run"] == checks["pgd-over-random"]["run"] == mall[0]["id"]
    assert checks["pgd-flip-rate"]["shared_with"] == ["pgd-over-random"]
    assert checks["pgd-over-random"]["shared_with"] == ["pgd-flip-rate"]
    assert checks["kappa-ok"]["shared_with"] == ["kappa-too-strict"]
    assert checks["pgd-flip-rate"]["command"] == checks["pgd-over-random"]["command"] == mall[0]["command"]


def test_malleability_values_equal_a_separate_cli_run(mall_audit, tmp_path):
    out = tmp_path / "m.json"
    assert cli("malleability", "--dataset", "digits", *MALL_ARGS, "--seed", "0", "--json", out, "-q") == 0
    summary = json.loads(out.read_text())["results"]["summary"]
    pgd = [r for r in summary if r["model"] == "relu" and r["attack"] == "pgd" and r["eps"] == pytest.approx(0.1)]
    rnd = [r for r in summary if r["model"] == "relu" and r["attack"] == "random" and r["eps"] == pytest.approx(0.1)]
    assert len(pgd) == 1 and len(rnd) == 1
    checks = by_name(mall_audit["report"])
    assert checks["pgd-flip-rate"]["value"] == pgd[0]["flip_rate"]["ci_high"]
    # flip rate above the random-noise floor: the PGD mean minus the random control's mean flip rate
    assert checks["pgd-over-random"]["value"] == pytest.approx(
        pgd[0]["flip_rate"]["mean"] - rnd[0]["flip_rate"]["mean"], abs=1e-12
    )
    # the flip rates are shares of top-k = 10 points: multiples of 1/10 per seed
    assert 0.0 <= checks["pgd-flip-rate"]["value"] <= 1.0


@pytest.fixture(scope="module")
def api_result(mall_audit):
    from attnaudit.audit import load_audit_file, run_audit

    plan = load_audit_file(mall_audit["path"])
    return run_audit(plan, baseline=None, fail_fast=False)


def test_same_file_same_seed_same_numbers_twice(mall_audit, api_result):
    first = values_of(mall_audit["report"])
    second = {c["name"]: c["value"] for c in api_result.to_dict()["checks"]}
    assert first == second  # exact equality, not approx
    again = {c["name"]: c["values"] for c in api_result.to_dict()["checks"]}
    assert again == {c["name"]: c["values"] for c in mall_audit["report"]["results"]["checks"]}


def test_python_api_gives_the_cli_values_and_writes_junit(mall_audit, api_result, tmp_path):
    from attnaudit.audit import AuditResult, write_junit

    assert isinstance(api_result, AuditResult)
    assert api_result.exit_code == 1
    assert {c.name: c.value for c in api_result.checks} == values_of(mall_audit["report"])
    assert {c.name: c.status for c in api_result.checks}["kappa-too-strict"] == "fail"
    cli_commands = {c["name"]: c["command"] for c in mall_audit["report"]["results"]["checks"]}
    assert {c.name: c.command for c in api_result.checks} == cli_commands
    d = api_result.to_dict()
    assert set(d) >= {"file", "model", "checks", "runs", "summary"}
    assert d["summary"]["exit_code"] == 1
    xml = tmp_path / "api.xml"
    write_junit(api_result, xml)
    _, suite, cases = junit_cases(xml)
    assert suite.get("failures") == "1" and set(cases) == set(cli_commands)
    assert cases["kappa-too-strict"].find("failure") is not None


def test_api_load_audit_file_raises_audit_error_with_exit_code_2(tmp_path):
    from attnaudit import AuditError
    from attnaudit.audit import load_audit_file

    path = write_audit(tmp_path / "bad.yaml", audit_doc(kappa_check("k", maxx=3.0)))
    with pytest.raises(AuditError) as info:
        load_audit_file(path)
    assert info.value.exit_code == 2
    assert "checks[0].maxx" in str(info.value) and "did you mean 'max'" in str(info.value)


# ----------------------------------------------------------------------------- pass / fail / threshold flip
def test_passing_audit_exits_0_and_a_lowered_threshold_flips_it(tmp_path, capsys):
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            kappa_check("at-rank", max=100.0),
            {
                "name": "at-rank-by-path",
                "analysis": "kappa",
                "options": {"n": KAPPA_N},
                "metric": {"path": "results.gram.log10_kappa_at_numerical_rank"},
                "max": 100.0,
            },
            {
                "name": "paper-width",
                "analysis": "kappa",
                "options": {"n": KAPPA_N},
                "metric": "log10_required_width",
                "select": {"basis": "numerical_rank"},
                "max": 1000.0,
            },
        ),
    )
    out = tmp_path / "r.json"
    assert cli("audit", path, "--json", out) == 0
    stdout = capsys.readouterr().out
    assert "at-rank" in stdout and "PASS" in stdout  # the summary table
    report = json.loads(out.read_text())
    values = values_of(report)
    assert values["at-rank"] == values["at-rank-by-path"]  # a {path:} metric reads the same field
    assert values["at-rank"] == pytest.approx(numpy_log10_kappa_at_rank(KAPPA_N, 0), abs=1e-8)
    assert len(report["results"]["runs"]) == 1  # the three checks share one kappa run
    # the paper's width kappa_r^6 n ln n at the numerical rank: 6 log10 kappa + log10(n ln n)
    assert values["paper-width"] == pytest.approx(6 * values["at-rank"] + np.log10(KAPPA_N * np.log(KAPPA_N)), abs=1e-9)

    # the same file with the threshold just below the measured value fails
    lowered = audit_doc(kappa_check("at-rank", max=values["at-rank"] - 0.01))
    path2 = write_audit(tmp_path / "b.yaml", lowered)
    out2 = tmp_path / "r2.json"
    assert cli("audit", path2, "--json", out2, "-q") == 1
    check = json.loads(out2.read_text())["results"]["checks"][0]
    assert check["status"] == "fail" and check["value"] == values["at-rank"]
    # and with a min above it
    path3 = write_audit(tmp_path / "c.yaml", audit_doc(kappa_check("at-rank", min=values["at-rank"] + 0.01)))
    assert cli("audit", path3, "-q") == 1
    path4 = write_audit(tmp_path / "d.yaml", audit_doc(kappa_check("at-rank", min=values["at-rank"] - 0.01)))
    assert cli("audit", path4, "-q") == 0


def test_json_to_stdout(tmp_path, capsys):
    path = write_audit(tmp_path / "a.yaml", audit_doc(kappa_check("at-rank", max=100.0)))
    capsys.readouterr()
    assert cli("audit", path, "--json", "-") == 0
    payload = json.loads(capsys.readouterr().out)  # nothing else on stdout
    assert payload["schema"] == "attnaudit.audit/1" and payload["results"]["checks"][0]["status"] == "pass"


def test_fail_fast_leaves_later_checks_skipped(tmp_path):
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            kappa_check("first-fails", max=1.0),
            {**kappa_check("second", max=100.0), "options": {"n": 150}},
            {**kappa_check("third", max=100.0), "options": {"n": 120}},
        ),
    )
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert cli("audit", path, "--fail-fast", "--json", out, "--junit", xml, "-q") == 1
    report = json.loads(out.read_text())
    status = {c["name"]: c["status"] for c in report["results"]["checks"]}
    assert status == {"first-fails": "fail", "second": "skipped", "third": "skipped"}
    assert report["results"]["summary"]["skipped"] == 2
    assert all(c["value"] is None for c in report["results"]["checks"] if c["status"] == "skipped")
    _, suite, cases = junit_cases(xml)
    assert suite.get("skipped") == "2" and suite.get("failures") == "1"
    assert cases["second"].find("skipped") is not None and cases["third"].find("skipped") is not None
    assert cases["first-fails"].find("failure") is not None
    # without --fail-fast every check runs
    assert cli("audit", path, "--json", out, "--overwrite", "-q") == 1
    status = {c["name"]: c["status"] for c in json.loads(out.read_text())["results"]["checks"]}
    assert status == {"first-fails": "fail", "second": "pass", "third": "pass"}


def test_select_matching_no_row_is_an_error_naming_the_available_values(tmp_path):
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            {
                "name": "width-of-nothing",
                "analysis": "kappa",
                "options": {"n": KAPPA_N},
                "metric": "log10_required_width",
                "select": {"model": "transformer"},
                "max": 100.0,
            },
            {**kappa_check("fine", max=100.0), "options": {"n": 150}},
        ),
    )
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert cli("audit", path, "--json", out, "--junit", xml, "-q") == 2
    checks = by_name(json.loads(out.read_text()))  # the reports are still written
    assert checks["width-of-nothing"]["status"] == "error"
    msg = checks["width-of-nothing"]["message"]
    assert "transformer" in msg and "attn" in msg and "numerical_rank" in msg
    assert checks["fine"]["status"] == "pass"  # the other checks still run
    _, suite, cases = junit_cases(xml)
    assert suite.get("errors") == "1" and cases["width-of-nothing"].find("error") is not None


def test_check_options_that_differ_only_in_spelling_or_a_default_seed_share_one_run(tmp_path):
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            {**kappa_check("a", max=100.0), "options": {"n": KAPPA_N, "rank-tol": 1e-10}},
            {**kappa_check("b", max=100.0), "options": {"n": KAPPA_N, "rank_tol": 1e-10}},
            {
                **kappa_check("c", max=100.0),
                "options": {"n": KAPPA_N, "--rank-tol": 1e-10, "seed": 0},
            },  # the file's seed
        ),
    )
    out = tmp_path / "r.json"
    assert cli("audit", path, "--json", out, "-q") == 0
    runs = json.loads(out.read_text())["results"]["runs"]
    assert len(runs) == 1 and sorted(runs[0]["checks"]) == ["a", "b", "c"]


def test_check_options_in_another_order_share_one_run(tmp_path):
    # spec: "same analysis, same options after defaults/data/model are merged" share one run; the
    # options are a mapping, so the order they are written in does not make them different options
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            {**kappa_check("a", max=100.0), "options": {"n": KAPPA_N, "rank-tol": 1e-10}},
            {**kappa_check("b", max=100.0), "options": {"rank-tol": 1e-10, "n": KAPPA_N}},
        ),
    )
    out = tmp_path / "r.json"
    assert cli("audit", path, "--json", out, "-q") == 0
    runs = json.loads(out.read_text())["results"]["runs"]
    assert len(runs) == 1 and sorted(runs[0]["checks"]) == ["a", "b"]


def test_top_level_data_options_reach_every_check_and_check_options_override_them(tmp_path):
    # spec: data options are dataset, data, data_dir, split, n, stratify, classes, preprocess
    path = write_audit(
        tmp_path / "a.yaml",
        {
            "version": 1,
            "data": {"dataset": "digits", "n": 150, "stratify": False},
            "checks": [
                {"name": "from-data", "analysis": "kappa", "metric": "log10_kappa_at_rank", "max": 100.0},
                {
                    "name": "overridden",
                    "analysis": "kappa",
                    "options": {"n": KAPPA_N},
                    "metric": "log10_kappa_at_rank",
                    "max": 100.0,
                },
            ],
        },
    )
    out = tmp_path / "r.json"
    assert cli("audit", path, "--json", out, "-q") == 0
    checks = by_name(json.loads(out.read_text()))
    assert "--n 150" in checks["from-data"]["command"] and "--n 200" in checks["overridden"]["command"]
    assert checks["overridden"]["value"] == pytest.approx(numpy_log10_kappa_at_rank(KAPPA_N, 0), abs=1e-8)


def test_a_built_in_model_is_trained_once_and_audited_by_checkpoint(tmp_path):
    saved = tmp_path / "relu.safetensors"
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            {
                "name": "sharpness",
                "analysis": "landscape",
                "metric": "lambda_max",
                "max": 1000.0,
                "options": {
                    "n-train": 40,
                    "eigenvalues": 1,
                    "hutchinson-samples": 5,
                    "basin-directions": 1,
                    "points": 0,
                    "grid": 0,
                },
            },
            {**kappa_check("data-only", max=100.0), "use_model": False},
            model={"arch": "relu", "train": {"steps": 30, "width": 8}, "save": str(saved)},
        ),
    )
    out = tmp_path / "r.json"
    assert cli("audit", path, "--json", out, "-q") == 0
    res = json.loads(out.read_text())["results"]
    assert res["model"]["kind"] == "trained"
    assert res["model"]["train_report"]["schema"].startswith("attnaudit.train/")
    assert saved.exists() and Path(str(saved) + ".json").exists()
    checks = by_name({"results": res})
    assert f"--checkpoint {saved}" in checks["sharpness"]["command"]
    assert "--checkpoint" not in checks["data-only"]["command"]
    # model.save is never overwritten without --overwrite (checked before anything trains)
    before = saved.read_bytes()
    assert cli("audit", path, "-q") == 2
    assert saved.read_bytes() == before


# ----------------------------------------------------------------------------- baselines
def test_baseline_round_trip_then_a_worsened_value_fails(tmp_path):
    path = write_audit(
        tmp_path / "a.yaml",
        audit_doc(
            kappa_check("at-rank", max=100.0, tolerance=0.05),
            {**kappa_check("not-in-baseline", max=100.0), "options": {"n": 150}},
        ),
    )
    base = tmp_path / "baseline.json"
    assert cli("audit", path, "--save-baseline", base, "-q") == 0
    saved = json.loads(base.read_text())
    assert saved["schema"] == "attnaudit.audit-baseline/1"
    entry = saved["checks"]["at-rank"]
    assert entry["metric"] == "log10_kappa_at_rank" and entry["stat"] == "mean" and entry["better"] == "lower"
    value = entry["value"]

    # same data, same file: passes, unchanged
    out = tmp_path / "r.json"
    assert cli("audit", path, "--baseline", base, "--json", out, "-q") == 0
    check = by_name(json.loads(out.read_text()))["at-rank"]
    assert check["value"] == value
    assert check["baseline"]["value"] == value and check["baseline"]["passed"] is True
    assert check["baseline"]["worse_by"] == 0

    # the baseline was better (lower) by more than the tolerance: the current value is a regression
    del saved["checks"]["not-in-baseline"]
    saved["checks"]["at-rank"]["value"] = value - 0.5
    base.write_text(json.dumps(saved))
    xml = tmp_path / "r.xml"
    assert cli("audit", path, "--baseline", base, "--json", out, "--junit", xml, "--overwrite", "-q") == 1
    report = json.loads(out.read_text())
    checks = by_name(report)
    assert checks["at-rank"]["status"] == "fail"
    assert checks["at-rank"]["baseline"]["passed"] is False
    assert checks["at-rank"]["baseline"]["worse_by"] == pytest.approx(0.5, abs=1e-9)
    # a check missing from the baseline: a warning, judged by its thresholds only
    assert checks["not-in-baseline"]["status"] == "pass"
    assert any("not-in-baseline" in w for w in report["warnings"])
    _, _, cases = junit_cases(xml)
    failure = cases["at-rank"].find("failure")
    assert failure is not None and failure.get("type") == "baseline"
    assert cases["not-in-baseline"].find("failure") is None

    # within the tolerance: passes
    saved["checks"]["at-rank"]["value"] = value - 0.04
    base.write_text(json.dumps(saved))
    assert cli("audit", path, "--baseline", base, "-q") == 0


# ----------------------------------------------------------------------------- configuration errors: exit 2
GOOD_CHECK = {
    "name": "m",
    "analysis": "malleability",
    "options": dict(MALL),
    "metric": "flip_rate",
    "select": {"attack": "pgd"},
    "max": 0.9,
}


def _with_check(**changes) -> dict:
    check = {**GOOD_CHECK, "options": dict(GOOD_CHECK["options"])}
    for key, value in changes.items():
        if value is _DROP:
            check.pop(key)
        else:
            check[key] = value
    return audit_doc(check)


_DROP = object()

CONFIG_ERRORS = {
    # id: (document, key path, words the message must hold)
    "unknown-top-level-key": ({**audit_doc(GOOD_CHECK), "sed": 3}, "sed", ["did you mean 'seed'?"]),
    "unknown-check-key": (_with_check(descripton="x"), "checks[0].descripton", ["did you mean 'description'?"]),
    "unknown-option-epss": (
        _with_check(options={**MALL, "epss": 0.1}),
        "checks[0].options.epss",
        ["did you mean 'eps'?"],
    ),
    "refused-output-option": (_with_check(options={**MALL, "json": "x.json"}), "checks[0].options.json", []),
    "wrong-type-max": (_with_check(max="ten"), "checks[0].max", ["expected a number"]),
    "wrong-type-options": (_with_check(options=["eps", 0.1]), "checks[0].options", ["expected a mapping"]),
    "wrong-type-seed": ({**audit_doc(GOOD_CHECK), "seed": "zero"}, "seed", ["expected an integer"]),
    "wrong-type-checks": ({"version": 1, "checks": {"name": "m"}}, "checks", ["expected a list"]),
    "wrong-type-data": ({**audit_doc(GOOD_CHECK), "data": ["digits"]}, "data", ["expected a mapping"]),
    "missing-metric": (_with_check(metric=_DROP), "checks[0]", ["missing 'metric'"]),
    "missing-name": (_with_check(name=_DROP), "checks[0]", ["missing 'name'"]),
    "missing-version": ({"checks": [GOOD_CHECK]}, "version", []),
    "bad-version": ({"version": 2, "checks": [GOOD_CHECK]}, "version", []),
    "missing-checks": ({"version": 1}, "checks", []),
    "empty-checks": ({"version": 1, "checks": []}, "checks", []),
    "unknown-metric": (_with_check(metric="flip_rat"), "checks[0].metric", ["did you mean 'flip_rate'?"]),
    "unknown-analysis": (_with_check(analysis="malleablity"), "checks[0].analysis", ["did you mean 'malleability'?"]),
    "unknown-stat": (_with_check(stat="ci_hi"), "checks[0].stat", ["did you mean 'ci_high'?"]),
    "bad-select-label": (_with_check(select={"atack": "pgd"}), "checks[0].select.atack", ["did you mean 'attack'?"]),
    "bad-better": (_with_check(better="lowest"), "checks[0].better", []),
    "no-threshold": (_with_check(max=_DROP), "checks[0]", []),
    "duplicate-name": (audit_doc(GOOD_CHECK, GOOD_CHECK), "checks[1].name", []),
    "unknown-model-key": (
        {**audit_doc(GOOD_CHECK), "model": {"checkpont": "m.safetensors"}},
        "model.checkpont",
        ["did you mean 'checkpoint'?"],
    ),
    "wrong-type-checkpoint": ({**audit_doc(GOOD_CHECK), "model": {"checkpoint": 5}}, "model.checkpoint", []),
    "unknown-data-option": (
        {**audit_doc(GOOD_CHECK), "data": {"datset": "digits"}},
        "data.datset",
        ["did you mean 'dataset'?"],
    ),
    # option values: caught by the command's own validation in the dry run, before anything trains
    "bad-option-value-dry-run": (
        _with_check(options={**MALL, "attacks": "pgdd"}),
        "checks[0].options.attacks",
        ["pgdd"],
    ),
    "bad-option-value-dry-run-eps": (_with_check(options={**MALL, "eps": -0.1}), "checks[0].options.eps", []),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_configuration_errors_exit_2_with_one_line_naming_the_key_path(case, tmp_path, capsys):
    doc, key_path, words = CONFIG_ERRORS[case]
    path = write_audit(tmp_path / "audit.yaml", doc)
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    capsys.readouterr()
    assert cli("audit", path, "--json", out, "--junit", xml) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert f"{path}: {key_path}: " in line, line  # <file>: <key path>: <what is wrong>; ...
    for word in words:
        assert word in line, line
    assert not out.exists() and not xml.exists()  # nothing ran, nothing written
    assert "PASS" not in captured.out and "FAIL" not in captured.out


def test_a_field_error_in_the_dry_run_names_the_audit_files_key(tmp_path, capsys):
    """A data option the run refuses (labels not in the data) is named by its key in the file, not a flag."""
    doc = audit_doc(kappa_check("k", max=100.0), data={"dataset": "digits", "classes": "0,77"})
    path = write_audit(tmp_path / "audit.yaml", doc)
    capsys.readouterr()
    assert cli("audit", path) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{path}: data.classes: classes names label(s) 77 not present" in line and "--classes" not in line


@pytest.mark.parametrize(
    "field, data, key_path",
    [
        ("eps", {}, "checks[0].options.eps: eps went wrong"),
        ("n_train", {}, "checks[0].options.n-train: n-train went wrong"),
        ("classes", {"classes": "0,1"}, "data.classes: classes went wrong"),
        ("seed", {}, "seed: seed went wrong"),
    ],
)
def test_a_field_error_while_a_check_runs_names_the_audit_files_key(tmp_path, monkeypatch, field, data, key_path):
    """A FieldError raised anywhere while a check runs is reported with the option key the
    audit file wrote (``checks[0].options.eps``), never a command-line flag."""
    from attnaudit.audit import load_audit_file, run_audit
    from attnaudit.audit import runner
    from attnaudit.errors import FieldError

    def refuse(analysis, args):
        raise FieldError(field, "{name} went wrong at run time")

    monkeypatch.setattr(runner, "invoke", refuse)
    doc = audit_doc({**GOOD_CHECK, "options": dict(GOOD_CHECK["options"])}, data={"dataset": "digits", **data})
    result = run_audit(load_audit_file(write_audit(tmp_path / "audit.yaml", doc)))
    check = result.checks[0]
    assert check.status == "error" and check.error_kind == "input" and result.exit_code == 2
    assert check.message.startswith(key_path + " at run time; reproduce: attnaudit malleability"), check.message
    assert "--" + field.replace("_", "-") + " " not in check.message.partition("; reproduce")[0]


def test_bad_option_value_is_refused_before_the_audit_trains_its_model(tmp_path, capsys):
    saved = tmp_path / "model.safetensors"
    doc = audit_doc(
        {**kappa_check("data-kappa", max=100.0), "use_model": False},
        {**GOOD_CHECK, "options": {"attacks": "pgdd", "eps": 0.1, "n-train": 40, "n-test": 20}},
        model={"arch": "relu", "train": {"steps": 50, "width": 8}, "save": str(saved)},
    )
    path = write_audit(tmp_path / "audit.yaml", doc)
    capsys.readouterr()
    assert cli("audit", path, "--json", tmp_path / "r.json") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "checks[1].options.attacks" in line
    assert not saved.exists() and not (tmp_path / "r.json").exists()


def test_yaml_syntax_error_exit_2_one_line(tmp_path, capsys):
    path = write_audit(tmp_path / "audit.yaml", "version: 1\nchecks: [\n  - name: x\n")
    capsys.readouterr()
    assert cli("audit", path) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(path) in line


def test_missing_audit_file_exit_2(tmp_path, capsys):
    capsys.readouterr()
    assert cli("audit", tmp_path / "nope.yaml") == 2
    one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "tagged",
    [
        '!!python/object/apply:os.system ["touch {marker}"]',
        '!!python/object/apply:subprocess.call [["touch", "{marker}"]]',
        "!!python/name:os.system",
    ],
)
def test_hostile_yaml_with_a_python_tag_is_refused_and_never_runs(tagged, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER"
    text = (
        "version: 1\n"
        f"name: {tagged.format(marker=marker)}\n"
        "checks:\n"
        "  - {name: k, analysis: kappa, options: {n: 200}, metric: log10_kappa_at_rank, max: 100}\n"
    )
    path = write_audit(tmp_path / "audit.yaml", text)
    capsys.readouterr()
    assert cli("audit", path) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "tag" in line.lower()
    assert not marker.exists()
    from attnaudit import AuditError
    from attnaudit.audit import load_audit_file

    with pytest.raises(AuditError):
        load_audit_file(path)
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--junit", "--json", "--save-baseline"])
def test_existing_output_without_overwrite_exit_2_before_running(flag, tmp_path, capsys):
    path = write_audit(tmp_path / "a.yaml", audit_doc(kappa_check("at-rank", max=100.0)))
    target = tmp_path / "existing.out"
    target.write_text("keep me")
    other = tmp_path / "other.xml" if flag != "--junit" else tmp_path / "other.json"
    other_flag = "--junit" if flag != "--junit" else "--json"
    capsys.readouterr()
    assert cli("audit", path, flag, target, other_flag, other) == 2
    captured = capsys.readouterr()
    one_error_line(captured.err)
    assert target.read_text() == "keep me"
    assert not other.exists()  # nothing was written: it stopped before running
    assert "PASS" not in captured.out
    assert cli("audit", path, flag, target, other_flag, other, "--overwrite", "-q") == 0
    assert target.read_text() != "keep me" and other.exists()
