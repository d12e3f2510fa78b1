"""build_evals through the event store: events, suites, idempotency, updates, lineage."""

from __future__ import annotations

import pytest

from flywheel.artifacts import open_artifacts
from flywheel.envs.testing import (
    append_failure,
    append_failures,
    append_success_trace,
    failure_payload,
    openai_call,
    tool_spec,
)
from flywheel.evals import build_evals, eval_id, load_suite, suite_version_hash
from flywheel.store import ConcurrencyError

WEATHER = tool_spec("get_weather", {"city": {"type": "string"}}, ["city"])


# Distinct requests: one template with only the city changed would be one near-duplicate cluster.
ASKS = {
    "Oslo": "is it raining in Oslo", "Lima": "should I pack a coat for Lima tomorrow",
    "Porto": "how hot does Porto get at noon", "Quito": "any snow expected around Quito this week",
    "Cairo": "give me the Cairo forecast", "Dakar": "will the wind be strong in Dakar tonight",
    "Hanoi": "humidity level in Hanoi", "Perth": "can we have a picnic in Perth on Sunday",
    "Tunis": "temperature right now at Tunis airport", "Sofia": "is Sofia foggy this morning",
    "Minsk": "do I need an umbrella in Minsk", "Riga": "sunset time and sky over Riga",
    "Accra": "rainy season status for Accra", "Bern": "weather for hiking near Bern",
    "Doha": "how humid is Doha in the evening", "Kyiv": "frost warning for Kyiv",
    "Valletta": "sea breeze conditions along the Valletta coast",
}
CITIES = [c for c in ASKS if c != "Valletta"]


def weather_failure(city: str, *, correction: bool = True, kinds=("wrong_arg_value",), **kw) -> dict:
    corr = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]} if correction else None
    return failure_payload([{"role": "user", "content": ASKS[city]}], [WEATHER],
                           openai_call("get_weather", {"city": "Nowhere"}), list(kinds), correction=corr, **kw)


@pytest.fixture
def arts(cfg):
    return open_artifacts(cfg)


def test_one_eval_per_failure_with_events_suites_and_lineage(cfg, store, arts):
    fids = append_failures(store, [weather_failure(c) for c in CITIES])
    s = build_evals(cfg, store, arts, correlation_id="run-1")
    assert s.created == {"tool_call": 16} and not s.skipped and s.empty_suites == ["regression"]
    assert s.splits["train"] + s.splits["heldout"] == 16 and s.splits["heldout"] > 0 and s.splits["train"] > 0
    evs = {e["entity_id"]: e["state"] for e in store.entities("eval")}
    assert set(evs) == {eval_id(f) for f in fids}
    st = evs[eval_id(fids[0])]
    # The payload is the task record plus the facts other stages query at the top level.
    assert st["task_id"] == eval_id(fids[0]) and st["origin_failure"] == fids[0]
    assert st["split"] == st["metadata"]["split"] and st["cluster"] == st["metadata"]["cluster"]
    assert st["failure_kinds"] == ["wrong_arg_value"] and st["tools"] == ["get_weather"]
    assert st["metadata"]["origin_trace"].startswith("trace:")

    train, held = load_suite(store, arts, "train"), load_suite(store, arts, "heldout")
    assert (train.entity_id, held.version) == ("suite:train@1", 1)
    assert len(train.tasks) + len(held.tasks) == 16
    assert all(t["metadata"]["split"] == "train" for t in train.tasks)
    assert train.version_hash == suite_version_hash("train", train.tasks)
    assert train.task_ids == sorted(train.task_ids)
    # Lineage: suite version -> evals -> failure -> trace.
    down = {e for e, _ in store.lineage("suite:heldout@1")}
    assert {t["task_id"] for t in held.tasks} <= down
    assert any(e.startswith("failure:") for e in down) and any(e.startswith("trace:") for e in down)
    ev = store.read(stream=f"suite:{'train'}", types="suite.versioned")[0]
    assert ev.correlation_id == "run-1" and sorted(ev.causation) == train.task_ids
    assert load_suite(store, arts, "suite:train@1").task_ids == train.task_ids


def test_rebuilding_from_the_same_inputs_appends_nothing(cfg, store, arts):
    append_failures(store, [weather_failure(c) for c in CITIES[:6]])
    append_success_trace(store, "ok-1", [{"role": "user", "content": "Weather in Oslo"},
                                         openai_call("get_weather", {"city": "Oslo"})], [WEATHER])
    first = build_evals(cfg, store, arts)
    assert first.events_appended > 0
    seq = store.last_seq()
    again = build_evals(cfg, store, arts)
    assert store.last_seq() == seq and again.events_appended == 0
    assert again.unchanged == 7 and not again.created and not again.updated
    assert all(not x["new_version"] for x in again.suites)


def test_a_changed_failure_updates_its_eval_in_place_and_keeps_its_split(cfg, store, arts):
    f = weather_failure("Oslo", correction=False, kinds=("missing_required_arg",))
    append_failure(store, f)
    build_evals(cfg, store, arts)
    tid = eval_id(f["entity_id"])
    before = store.entity(tid)["state"]
    assert before["metadata"]["weak"] is True
    # Later a person supplies a correction (ingest appends a new event on the same failure stream).
    f2 = {**f, "correction": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}, "occurrences": 3}
    append_failure(store, f2)
    s = build_evals(cfg, store, arts)
    assert s.updated == {"tool_call": 1} and not s.created
    after = store.entity(tid)["state"]
    assert after["metadata"]["weak"] is False and after["verifier"]["expected"]
    assert (after["split"], after["cluster"]) == (before["split"], before["cluster"])
    assert store.stream_version(tid) == 2
    # The suite that holds it got a new version; the other did not.
    name = after["split"]
    assert load_suite(store, arts, name).version == 2


def test_regression_evals_from_successes_deduplicated_in_their_own_suite(cfg, store, arts):
    msgs = [{"role": "user", "content": "Weather in Oslo"}, openai_call("get_weather", {"city": "Oslo"})]
    for i in range(3):  # the same success, three times in production
        append_success_trace(store, f"ok-{i}", msgs, [WEATHER])
    append_success_trace(store, "ok-x", [{"role": "user", "content": "Weather in Lima"},
                                         openai_call("get_weather", {"city": "Lima"})], [WEATHER])
    s = build_evals(cfg, store, arts)
    reg = load_suite(store, arts, "regression")
    assert len(reg.tasks) == 2 and s.splits == {"regression": 2}
    assert {t["metadata"]["origin_trace"] for t in reg.tasks} == {"trace:ok-0", "trace:ok-x"}
    assert all(t["metadata"]["split"] == "regression" for t in reg.tasks)
    # No failures: train and held-out suites are not versioned empty.
    assert s.empty_suites == ["train", "heldout"] and not s.skipped
    with pytest.raises(LookupError, match="flywheel evals build"):
        load_suite(store, arts, "heldout")


def test_llm_judge_evals_stay_out_of_the_gate_suite_unless_configured(cfg, store, arts):
    fb = [failure_payload([{"role": "user", "content": ASKS[c].replace("is", "tell me honestly if")}], [],
                          {"role": "assistant", "content": "Done!"}, ["negative_feedback"],
                          feedback={"score": -1, "comment": "made up an answer"}) for c in CITIES]
    append_failures(store, fb)
    s = build_evals(cfg, store, arts)
    states = [e["state"] for e in store.entities("eval")]
    n_held = sum(1 for st in states if st["split"] == "heldout")
    assert n_held > 0 and s.excluded_from_gate == n_held
    assert all(not st["metadata"]["deterministic"] for st in states)
    assert not any(x["suite"].startswith("suite:heldout") for x in s.suites)
    cfg.evals.include_llm_judge_in_gate = True
    s2 = build_evals(cfg, store, arts)
    assert len(load_suite(store, arts, "heldout").tasks) == n_held and s2.excluded_from_gate == 0


def test_skipped_failures_are_reported_with_reasons(cfg, store, arts):
    append_failures(store, [
        weather_failure("Oslo", correction=False),  # wrong_arg_value needs a correction
        failure_payload([{"role": "user", "content": "hi"}], [], {"role": "assistant", "content": "x"}, ["other"]),
        weather_failure("Lima"),
    ])
    s = build_evals(cfg, store, arts)
    assert s.created == {"tool_call": 1}
    reasons = sorted(x["reason_kind"] for x in s.skipped)
    assert reasons == ["no verifier for kinds ['other'] without a correction",
                       "wrong_arg_value without a correction cannot be checked"]
    assert s.to_dict()["skipped_by_reason"]


def test_a_stale_suite_version_is_refused_not_overwritten(cfg, store, arts, monkeypatch):
    append_failures(store, [weather_failure(c) for c in CITIES])
    build_evals(cfg, store, arts)
    before = {n: store.stream_version(f"suite:{n}") for n in ("train", "heldout")}
    append_failure(store, weather_failure("Valletta"))
    # Simulate a writer that read the suite streams before another process versioned them.
    real = store.stream_version
    monkeypatch.setattr(store, "stream_version", lambda s: 0 if s.startswith("suite:") else real(s))
    with pytest.raises(ConcurrencyError):
        build_evals(cfg, store, arts)
    monkeypatch.undo()
    assert {n: store.stream_version(f"suite:{n}") for n in ("train", "heldout")} == before
