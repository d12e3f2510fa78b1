"""The README's main job, end to end with a tiny random model (`flywheel demo --profile smoke`): the
base model registered as champion, two waves of production traffic through a real
`flywheel serve --champion` process, a Prefect cycle after each, and the closing scoreboard.

It asserts what the demo claims: two waves and two cycles with their stage outcomes; cycle 2 gating
on a superset of cycle 1's held-out suite in which no item changed side; the insufficient-evidence
outcome (the smoke suite is far below gate.min_paired_items) leaving the champion unchanged and
saying so; a scoreboard row per gated model on the same suite version; the cycle-2 challenger's
lineage reaching the traces of both waves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    home = tmp / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["PREFECT_HOME"] = str(tmp / "prefect")
    proc = subprocess.run(
        [sys.executable, "-m", "flywheel", "demo", "--profile", "smoke", "--home", str(home), "--json"],
        capture_output=True, text=True, timeout=2400, env=env, cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return home, json.loads(proc.stdout), proc.stderr


def test_two_waves_of_traffic_through_the_served_champion(demo_run):
    home, res, _ = demo_run
    assert res["champion_before"] == "model:policy/1" and res["profile"] == "smoke"
    w1, w2 = res["waves"]
    assert (w1["requests"], w2["requests"]) == (16, 8)
    assert w1["champion"] == w2["champion"] == "model:policy/1"  # cycle 1 did not promote (see below)
    ids = []
    for w in (w1, w2):
        records = [json.loads(line) for line in Path(w["log"]).read_text().splitlines()]
        assert len(records) == w["requests"] and {r["metadata"]["wave"] for r in records} == {w["wave"]}
        assert all({"bfcl_id", "answer", "model", "timestamp"} <= set(r) for r in records)
        # the server's finish reason is logged; an answer that stopped at max_tokens was cut off
        assert {r["metadata"]["finish_reason"] for r in records} <= {"stop", "tool_calls", "length"}
        assert w["answers_cut"] == sum(r["metadata"]["finish_reason"] == "length" for r in records)
        assert w["max_tokens"] == 12
        ids.append({r["bfcl_id"] for r in records})
    assert not ids[0] & ids[1], "wave 2 must ask questions wave 1 did not"


def test_each_cycle_runs_every_stage_and_says_why_the_champion_stays(demo_run):
    _, res, _ = demo_run
    c1, c2 = res["cycles"]
    assert c1["stages"]["ingest"]["ingested"] == 16 and c2["stages"]["ingest"]["ingested"] == 8
    for c in (c1, c2):
        st = c["stages"]
        assert st["evals"]["warnings"] and "insufficient evidence" in st["evals"]["warnings"][0]
        assert st["train_mode"]["mode"] == "arms"
        learn = st["learn"]
        arms = {a["name"]: a for a in learn["arms"]}
        assert list(arms) == ["control", "targeted", "rpo", "grpo"] and arms["control"]["skipped"] is None
        assert learn["chosen"] in arms and learn["why"] and learn["dev"]["items"] >= 2
        assert learn["first_pass"]["steps"] >= 1 and learn["first_pass"]["cpu_s"] > 0
        for a in arms.values():  # every arm trained within its budget or says why it did not
            assert (a["skipped"] is None) == (a["model_version"] is not None)
            assert a["skipped"] is not None or (a["steps"] == 1 and a["dev_items"] == learn["dev"]["items"])
        # the chosen arm continued from its trial (smoke: continue_steps 1); the control resumes the first
        # pass's data stream, so its continuation starts after first pass + trial
        cont = learn["continuation"]
        assert cont["arm"] == learn["chosen"] and cont["from"] == arms[learn["chosen"]]["model_entity"]
        assert cont["steps"] == 1 and cont["start_step"] == arms[learn["chosen"]]["steps"] + (
            learn["first_pass"]["steps"] if learn["chosen"] == "control" else 0)
        assert arms["control"]["detail"]["start_step"] == learn["first_pass"]["steps"]
        # train.schedule = one_run: first pass, trial and continuation are one schedule with one optimizer;
        # an SFT arm's continuation takes the dev corrections, an RPO/GRPO one is followed by the fold-in
        fp = learn["first_pass"]["steps"]
        assert learn["schedule"] == {"mode": "one_run", "total_steps": fp + 1 + 1, "synthesis_in": "trial"}
        assert arms["control"]["detail"]["schedule"] == {"offset": fp, "total": fp + 2, "resumed_optimizer": True}
        if learn["chosen"] in ("control", "targeted"):
            assert cont["detail"]["schedule"] == {"offset": fp + arms[learn["chosen"]]["steps"], "total": fp + 2,
                                                  "resumed_optimizer": True}
            assert cont["detail"]["dev_folded_in"] >= 1
            assert learn["fold_in"]["into"] == "continuation" and learn["fold_in"]["model_entity"] == cont["model_entity"]
        else:
            assert learn["fold_in"]["base"] == cont["model_entity"]
        assert learn["model_version"] == st["gate"]["challenger_version"]
        gate = st["gate"]
        assert gate["outcome"] == "insufficient_evidence" and gate["passed"] is False
        assert gate["numbers"]["paired_items"] < gate["numbers"]["min_paired_items"] == 30
        assert c["outcome"] == "insufficient_evidence" and "the champion stays" in c["reason"]
        # train.mode = arms: no champion rollouts; synthesis runs inside the learning stage, aimed by its probe.
        assert {"ingest", "evals", "envs", "learn", "gate"} <= set(c["timings"])
        assert "rollouts" not in c["timings"] and "synth" not in c["timings"]
    # Cycle 2 trains from the (unchanged) champion and gates against it.
    assert c2["stages"]["learn"]["first_pass"]["base"] == "model:policy/1"
    assert c2["stages"]["gate"]["numbers"]["champion"] == "model:policy/1"
    assert res["scoreboard"]["champions"] == [1] and res["scoreboard"]["final_champion"] == "model:policy/1"


def test_cycle_two_gates_on_a_superset_of_cycle_ones_heldout_suite(demo_run):
    home, res, _ = demo_run
    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.store import open_store
    from flywheel.versioning import load_suite

    s1, s2 = (c["stages"]["gate"]["suite"] for c in res["cycles"])
    assert (s1, s2) == ("suite:heldout@1", "suite:heldout@2")
    cfg = load_config(environ={}, overrides={"home": str(home)})
    with open_store(cfg) as store:
        arts = open_artifacts(cfg)
        h1, h2 = load_suite(store, arts, s1), load_suite(store, arts, s2)
        assert set(h1.task_ids) < set(h2.task_ids)
        # No item changed side: every eval of cycle 1 keeps its split and cluster.
        for t in h1.tasks:
            st = store.entity(t["task_id"])["state"]
            assert (st["split"], st["cluster"]) == ("heldout", t["metadata"]["cluster"])
        events = store.read(types="eval.created")
        by_eval: dict[str, set[str]] = {}
        for ev in events:
            by_eval.setdefault(ev.stream, set()).add(ev.payload["split"])
        assert all(len(v) == 1 for v in by_eval.values())


def test_the_scoreboard_puts_every_gated_model_on_one_suite_and_lineage_reaches_both_waves(demo_run):
    _, res, _ = demo_run
    board = res["scoreboard"]
    assert board["suite"] == "suite:heldout@2" and board["items"] > 0
    rows = {r["model"]: r for r in board["rows"]}
    challengers = [c["stages"]["gate"]["challenger_version"] for c in res["cycles"]]
    assert set(rows) == {"model:policy/1", *(f"model:policy/{v}" for v in challengers)}
    for r in rows.values():
        assert r["items"] == board["items"] and 0.0 <= r["wilson_lo"] <= (r["pass_rate"] or 0.0) <= r["wilson_hi"] <= 1.0
    assert rows["model:policy/1"]["gate"] is None and rows["model:policy/1"]["champion"]
    for i, v in enumerate(challengers, start=1):
        g = rows[f"model:policy/{v}"]["gate"]
        assert g["outcome"] == "insufficient_evidence" and 0.0 <= g["p_value"] <= 1.0
        assert rows[f"model:policy/{v}"]["cycle"] == i and "SFT" in rows[f"model:policy/{v}"]["trained"]
    last = board["lineage"]["last_challenger"]
    assert last["model"] == f"model:policy/{challengers[-1]}"
    assert last["by_wave"].get("1", 0) > 0 and last["by_wave"].get("2", 0) > 0
    assert last["traces"] == sum(last["by_wave"].values())


def test_per_stage_timings_report_and_home(demo_run):
    home, res, stderr = demo_run
    t = res["timings"]
    for key in ("prepare_s", "wave1_traffic_s", "cycle1_s", "wave2_traffic_s", "cycle2_s", "scoreboard_s", "total_s"):
        assert t[key] >= 0
    assert t["cycle1.learn_s"] > 0 and t["cycle2.gate_s"] > 0
    report = Path(res["report"]["path"])
    assert report.exists() and "<svg" in report.read_text()
    # Library output went to the log under the home, not to the terminal.
    log = Path(res["log"])
    assert log.parent == home / "logs" and log.exists()
    assert "FutureWarning" not in stderr and "Converting and de-quantizing" not in stderr
    # Nothing outside the home directory: everything the demo wrote lives under it.
    assert (home / "warehouse.duckdb").exists() and (home / "mlflow.db").exists()
    assert oct(home.stat().st_mode & 0o777) == "0o700"


def test_the_learning_stage_records_its_decision_and_preference_pairs_with_lineage(demo_run):
    """Issue 30: arms, their budgets and dev scores in one learning.decided event; the RPO arm's pairs in
    Parquet as a preferences.published dataset whose lineage reaches production traces."""
    home, res, _ = demo_run
    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.lineage import traces_of
    from flywheel.store import open_store

    cfg = load_config(environ={}, overrides={"home": str(home)})
    with open_store(cfg) as store:
        arts = open_artifacts(cfg)
        for c in res["cycles"]:
            learn = c["stages"]["learn"]
            ev = store.read(stream=learn["learn_id"], types="learning.decided")
            assert len(ev) == 1 and ev[0].payload["chosen"] == learn["chosen"]
            assert learn["model_entity"] in [a for a, _ in store.lineage(learn["learn_id"], "down")] or \
                learn["model_entity"] in ev[0].causation
            rpo = next(a for a in learn["arms"] if a["name"] == "rpo")
            if rpo["skipped"] is None:
                pid = rpo["detail"]["preferences"]
                pub = store.read(stream=pid, types="preferences.published")
                assert len(pub) == 1
                table = arts.read_table(pub[0].payload["artifact"]["sha256"])
                assert table.num_rows == rpo["detail"]["pairs"] > 0
                assert traces_of(store, pid), "the pairs' lineage must reach production traces"
        # at least one cycle had pairs: wave 1's failures are the base model's prose answers
        assert any(next(a for a in c["stages"]["learn"]["arms"] if a["name"] == "rpo")["skipped"] is None
                   for c in res["cycles"])
