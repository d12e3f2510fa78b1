"""The Prefect artifacts of a cycle, rendered from a cycle result (pure functions; the artifacts on a
real Prefect server are checked in tests/integration/test_real_servers.py)."""

from __future__ import annotations

from flywheel.flows.ui_artifacts import artifact_keys, cycle_markdown, stage_markdown, stage_rows

GATE = {
    "gate_id": "gate:abc", "outcome": "refused", "passed": False, "p_value": 0.0625,
    "reasons": ["exact sign test on 4 wins / 0 losses (9 items): one-sided p = 0.0625 >= 0.05"],
    "rules": [{"rule": "significance", "passed": False, "value": 0.0625, "threshold": 0.05, "reason": "..."},
              {"rule": "min_pass_rate", "passed": True, "value": 0.444, "threshold": 0.0, "reason": "..."},
              {"rule": "max_slice_regression", "passed": True, "value": -0.0, "threshold": 0.1, "reason": "..."}],
    "numbers": {"wins": 4, "losses": 0, "paired_items": 9, "champion_pass_rate": 0.0, "challenger_pass_rate": 4 / 9,
                "by_origin": {"failure": {"n": 7, "champion_rate": 0.0, "challenger_rate": 3 / 7, "wins": 3, "losses": 0},
                              "success": {"n": 2, "champion_rate": 0.0, "challenger_rate": 0.5, "wins": 1, "losses": 0}}},
    "model": "policy", "challenger_version": 3, "champion": "model:policy/1", "suite": "suite:heldout@1",
}
RESULT = {
    "cycle": "cycle:1234", "outcome": "refused", "reason": "model:policy/3 was refused by the gate", "wall_s": 88.5,
    "timings": {"ingest": 2.1, "evals": 1.0, "envs": 0.4, "rollouts": 10.2, "train-sft": 30.0,
                "rollouts-after-sft": 9.9, "train-grpo": 20.3, "gate": 12.0},
    "stages": {
        "ingest": {"read": 22, "ingested": 22, "quarantined": 0, "new_failures": 19, "files": [{"path": "x"}]},
        "new_failures": 19,
        "evals": {"splits": {"train": 12, "heldout": 9}, "suites": ["suite:train@1", "suite:heldout@1"], "skipped": []},
        "envs": {"envs": [{"env": "env:train@1", "tasks": 12, "synth_tasks": 0, "new_version": True}], "skipped": []},
        "rollouts": {"policy": "base:tiny", "samples": 12, "tasks": 6, "published": True,
                     "stats": {"pass_at_1": 0.0, "pass_at_k": 0.0, "zero_variance_share": 1.0}},
        "train_mode": {"mode": "sft", "why": "pass@K is 0"},
        "sft": {"model_entity": "model:policy/2", "steps": 2, "metrics": {"loss": 3.21}},
        "rollouts_after_sft": {"policy": "model:policy/2", "samples": 12, "tasks": 6, "published": True,
                               "stats": {"pass_at_1": 0.25, "pass_at_k": 0.5, "zero_variance_share": 0.5}},
        "grpo": {"model_entity": "model:policy/3", "steps": 1, "metrics": {"loss": 0.01}},
        "gate": GATE,
    },
}


def test_artifact_keys_are_stable_per_deployment_and_valid_prefect_keys():
    import re

    a, b = artifact_keys("flywheel-cycle/nightly Policy"), artifact_keys("flywheel-cycle/nightly Policy")
    assert a == b == {"summary": "flywheel-flywheel-cycle-nightly-policy-cycle-summary",
                      "stages": "flywheel-flywheel-cycle-nightly-policy-cycle-stages"}
    assert artifact_keys(None)["summary"] == "flywheel-adhoc-cycle-summary"
    assert artifact_keys("other")["summary"] != a["summary"]
    for k in [*a.values(), *artifact_keys(None).values(), *artifact_keys("Ünïcode ✓")]:
        assert re.fullmatch(r"[a-z0-9-]+", k), k  # Prefect: lowercase letters, numbers and dashes only


def test_cycle_summary_names_decision_p_value_rates_champion_and_links(tmp_path):
    report = tmp_path / "reports" / "1234.html"
    md = cycle_markdown(RESULT, champion="model:policy/1", report=str(report), report_error=None,
                        model_link="http://127.0.0.1:5000/#/models/policy/versions/3")
    assert md.startswith("# flywheel cycle: refused\n")
    assert "| gate decision | **refused** |" in md
    assert "| evidence | exact sign test p = 0.0625: 4 wins / 0 losses on 9 paired held-out items |" in md
    assert "| held-out pass rate | champion 0.0%, challenger 44.4% |" in md
    assert "fix rate (held-out production failures) | champion 0.0%, challenger 42.9% (7 items)" in md
    assert "keep rate (held-out production successes) | champion 0.0%, challenger 50.0% (2 items)" in md
    assert "| champion after the cycle | `model:policy/1` |" in md
    assert f"[1234.html]({report.as_uri()})" in md
    assert "[http://127.0.0.1:5000/#/models/policy/versions/3](http://127.0.0.1:5000/#/models/policy/versions/3)" in md
    assert "| significance | FAIL | 0.0625 | 0.05 |" in md and "| max_slice_regression | pass | 0 | 0.1 |" in md and "- exact sign test on 4 wins" in md


def test_cycle_summary_without_gate_or_report_says_so():
    md = cycle_markdown({"cycle": "cycle:9", "outcome": "nothing_new", "reason": "no new failures", "stages": {}},
                        champion=None, report=None, report_error="ReportError: no cycle", model_link="models:/policy/1")
    assert "gate decision" not in md and "| champion after the cycle | `none` |" in md
    assert "not written: ReportError: no cycle" in md and "`models:/policy/1`" in md


def test_stage_table_has_one_row_per_stage_in_run_order_with_counts():
    rows = stage_rows(RESULT)
    assert [r["stage"] for r in rows] == list(RESULT["timings"])
    assert [r["seconds"] for r in rows] == list(RESULT["timings"].values())
    by = {r["stage"]: r["counts"] for r in rows}
    assert by["ingest"] == "22 read, 22 ingested, 0 quarantined, 19 new failures"
    assert by["evals"] == "heldout 9, train 12"
    assert by["envs"] == "env:train@1 (12 tasks)"
    assert by["rollouts-after-sft"].startswith("model:policy/2: 12 samples of 6 tasks, pass@1 0.25, pass@K 0.50")
    assert by["train-grpo"] == "model:policy/3: 1 steps, loss 0.0100"
    assert by["gate"] == "refused: p = 0.0625, 4 wins / 0 losses on 9 paired items"


def test_stage_markdown_shows_counts_and_scalar_fields():
    md = stage_markdown("ingest", RESULT["stages"]["ingest"])
    assert md.splitlines()[:3] == ["### ingest", "", "22 read, 22 ingested, 0 quarantined, 19 new failures"]
    assert "| read | 22 |" in md and "| files | 1 items |" in md
    assert "skipped: no demonstrations" in stage_markdown("train-sft", {"skipped": "no demonstrations"})


def test_stage_counts_fall_back_to_numeric_fields_for_an_unknown_shape():
    from flywheel.flows.ui_artifacts import stage_counts

    assert stage_counts("envs", {"envs": 3, "events_appended": 2}) == "envs 3, events_appended 2"
    assert stage_counts("custom", {"items": 4, "note": "x"}) == "items 4"


def test_cli_cycle_summary_points_to_the_report_and_the_prefect_artifacts(capsys):
    from flywheel.cli.cycle import print_cycle_summary

    print_cycle_summary({**RESULT, "published": {"report": "/h/reports/1234.html", "summary": "flywheel-adhoc-cycle-summary",
                                                 "stages": "flywheel-adhoc-cycle-stages"}})
    out = capsys.readouterr().out
    assert "/h/reports/1234.html" in out and "flywheel-adhoc-cycle-summary" in out
