"""A full flywheel cycle with a tiny model on CPU: every stage's events, lineage from the registered
model down to the ingested trace ids, a gate decision, and promotion or refusal consistent with it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def cycle_run(tiny_cycle):
    """One tiny-model cycle on BFCL traffic answered in prose (settings and traffic from conftest;
    the run is the session's ``tiny_cycle``, which test_report.py reads too)."""
    c = tiny_cycle
    return c["cfg"], c["result"], c["traffic"], c["stages"]


@pytest.fixture(scope="module")
def second_cycle(tiny_cycle):
    """The same traffic again in the same home (run by ``tiny_cycle`` after the first cycle, before
    any test reads the home): its result and the events recorded after the first cycle."""
    return tiny_cycle["again"], tiny_cycle["events_after_first"]


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


def test_second_cycle_without_new_failures_ends_early(second_cycle):
    again, new = second_cycle
    assert again["outcome"] == "nothing_new" and "no new failures" in again["reason"]
    # Re-ingesting the same file appends nothing; only the new cycle's own pair is recorded.
    assert sorted(e.type for e in new) == ["cycle.completed", "cycle.started"]
