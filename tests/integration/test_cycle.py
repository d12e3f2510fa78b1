"""A full flywheel cycle with a tiny model on CPU: every stage's events, lineage from the registered
model down to the ingested trace ids, a gate decision, and promotion or refusal consistent with it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def cycle_run(tmp_path_factory, it):
    """One tiny-model cycle on BFCL traffic answered in prose (settings and traffic from conftest)."""
    from flywheel.flows.cycle import run_cycle

    from flywheel.config import load_config

    root = tmp_path_factory.mktemp("cycle")
    home = root / "home"
    traffic = it.bfcl_traffic(root / "traffic.jsonl")
    cfg = load_config(overrides={"home": str(home), **it.TINY}, environ={})
    stages = []
    result = run_cycle(cfg, traces=[str(traffic)], overrides={**it.TINY}, on_progress=lambda s, i: stages.append(s))
    return cfg, result, traffic, stages


def test_cycle_runs_every_stage_and_records_events(cycle_run):
    from flywheel.store import open_store

    cfg, result, _, progress = cycle_run
    # The tiny cycle's held-out suite is far below gate.min_paired_items: its gate cannot decide.
    assert result["outcome"] == "insufficient_evidence", result
    assert result["stages"]["gate"]["outcome"] == "insufficient_evidence"
    assert "insufficient evidence" in result["stages"]["evals"]["warnings"][0]
    with open_store(cfg) as store:
        types = {e.type for e in store.read()}
        cycle_events = store.read(stream=result["cycle"])
    for t in ("cycle.started", "trace.ingested", "failure.classified", "eval.created", "suite.versioned",
              "env.versioned", "rollouts.published", "training.completed", "model.registered", "gate.decided",
              "cycle.completed"):
        assert t in types, t
    assert [e.type for e in cycle_events] == ["cycle.started", "cycle.completed"]
    # The flow run id is the correlation id of the cycle's events.
    run_id = result["cycle"].split(":", 1)[1]
    assert all(e.correlation_id == run_id for e in cycle_events)
    assert {"ingest", "rollouts", "gate"} <= set(progress)


def test_lineage_reaches_the_ingested_traces(cycle_run):
    from flywheel.lineage import traces_of
    from flywheel.store import open_store

    cfg, result, traffic, _ = cycle_run
    model = result["stages"].get("grpo", {}).get("model_entity") or result["stages"]["sft"]["model_entity"]
    with open_store(cfg) as store:
        traces = traces_of(store, model)
        ingested = {e.stream for e in store.read(types=["trace.ingested"])}
    assert traces, "the model's lineage reaches no production trace"
    assert {t["trace"] for t in traces} <= ingested
    assert all(t["failure_kinds"] for t in traces)


def test_gate_decision_and_deployment_agree(cycle_run):
    from flywheel.store import open_store
    from flywheel.tracking import Tracker

    cfg, result, _, _ = cycle_run
    gate = result["stages"]["gate"]
    champion = Tracker(cfg).get_alias_version(cfg.cycle.model_name, "champion")
    with open_store(cfg) as store:
        promoted = store.read(types=["model.promoted"])
    if gate["outcome"] == "passed":
        assert result["outcome"] == "promoted" and champion == gate["challenger_version"] and promoted
    else:  # refused, or insufficient evidence: the champion stays and the cycle says why
        assert result["outcome"] == gate["outcome"] and gate["reasons"] and not promoted
        assert champion != gate["challenger_version"]


def test_second_cycle_without_new_failures_ends_early(cycle_run, it):
    from flywheel.flows.cycle import run_cycle

    from flywheel.store import open_store

    cfg, _, traffic, _ = cycle_run
    with open_store(cfg) as store:
        before = store.last_seq()
    again = run_cycle(cfg, traces=[str(traffic)], overrides={**it.TINY})
    assert again["outcome"] == "nothing_new" and "no new failures" in again["reason"]
    with open_store(cfg) as store:
        new = store.read(after_seq=before)
    # Re-ingesting the same file appends nothing; only the new cycle's own pair is recorded.
    assert sorted(e.type for e in new) == ["cycle.completed", "cycle.started"]
