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
from flywheel.evals import build_evals, eval_id
from flywheel.store import ConcurrencyError
from flywheel.versioning import load_suite, suite_version_hash

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


def test_a_new_compiler_version_updates_only_the_evals_it_compiles_differently(cfg, store, arts, monkeypatch):
    """Compiler 3 judges broken-JSON content to a request with tools by its correction; an eval that
    compiler 2 recorded as ``json_schema {}`` is updated (with version 3), every other eval keeps its event."""
    import flywheel.evals.compiler as compiler
    import flywheel.evals.stage as stage

    fids = append_failures(store, [weather_failure(c) for c in CITIES[:5]])
    truncated = weather_failure("Valletta", kinds=("invalid_json",))
    truncated["bad_answer"] = {"role": "assistant", "content": "[get_weather(city='Vall"}
    fids.append(append_failure(store, truncated))
    # what compiler 2 made of the truncated call: "any JSON"
    old_rule = compiler._invalid_json_is_a_call
    monkeypatch.setattr(compiler, "_invalid_json_is_a_call", lambda failure, bad, expected: bool((bad or {}).get("tool_calls")))
    monkeypatch.setattr(stage, "COMPILER_VERSION", 2)
    build_evals(cfg, store, arts)
    tid = eval_id(fids[-1])
    assert store.entity(tid)["state"]["verifier"] == {"kind": "json_schema", "schema": {}}
    monkeypatch.setattr(compiler, "_invalid_json_is_a_call", old_rule)
    monkeypatch.setattr(stage, "COMPILER_VERSION", 3)
    s = build_evals(cfg, store, arts)
    assert s.updated == {"tool_call": 1} and s.unchanged == 5 and not s.created, (s.to_dict(), s.skipped, s.splits)
    after = store.entity(tid)["state"]
    assert after["verifier"]["kind"] == "tool_call" and after["compiler_version"] == 3
    assert all(store.entity(eval_id(f))["state"]["compiler_version"] == 2 for f in fids[:5])
    assert build_evals(cfg, store, arts).events_appended == 0


def _weather_success(store, trace_id: str, city: str) -> str:
    msgs = [{"role": "user", "content": ASKS[city]}, openai_call("get_weather", {"city": city})]
    return append_success_trace(store, trace_id, msgs, [WEATHER])


def test_successes_are_dealt_by_cluster_train_side_to_regression_heldout_side_to_heldout(cfg, store, arts):
    for i in range(3):  # the same success, three times in production: one eval
        _weather_success(store, f"ok-oslo-{i}", "Oslo")
    for city in CITIES[1:]:
        _weather_success(store, f"ok-{city}", city)
    s = build_evals(cfg, store, arts)
    reg = load_suite(store, arts, "regression")
    held = load_suite(store, arts, "heldout")
    assert len(reg.tasks) + len(held.tasks) == len(CITIES)  # the duplicates made one eval
    assert reg.tasks and held.tasks, "successes are dealt to both sides"
    assert s.splits == {"regression": len(reg.tasks), "heldout": len(held.tasks)}
    assert all(t["metadata"]["split"] == "regression" for t in reg.tasks)
    assert all(t["metadata"]["split"] == "heldout" and t["metadata"]["origin_outcome"] == "success" for t in held.tasks)
    assert not {t["metadata"]["cluster"] for t in reg.tasks} & {t["metadata"]["cluster"] for t in held.tasks}
    assert "trace:ok-oslo-0" in {t["metadata"]["origin_trace"] for t in reg.tasks + held.tasks}
    assert s.heldout == {"items": len(held.tasks), "failures": 0, "successes": len(held.tasks),
                         "clusters": len(held.tasks)}
    # No failures: the train suite is not versioned empty.
    assert s.empty_suites == ["train"] and not s.skipped
    with pytest.raises(LookupError, match="flywheel evals build"):
        load_suite(store, arts, "train")


def test_a_failure_near_a_train_side_success_never_goes_to_heldout(cfg, store, arts):
    # Successes recorded before this change sit in the regression suite (split "regression"): their
    # answers are SFT demonstrations, so a near-copy failure must join the train side.
    for city in CITIES[:4]:
        _weather_success(store, f"ok-{city}", city)
    cfg.evals.heldout_fraction = 0.01
    build_evals(cfg, store, arts)
    assert len(load_suite(store, arts, "regression").tasks) == 4
    cfg.evals.heldout_fraction = 0.99  # a fresh deal would almost surely say held-out
    f = failure_payload([{"role": "user", "content": ASKS[CITIES[0]] + "?"}], [WEATHER],
                        openai_call("get_weather", {"city": "Nowhere"}), ["wrong_arg_value"],
                        correction={"tool_calls": [{"name": "get_weather", "arguments": {"city": CITIES[0]}}]})
    append_failure(store, f)
    build_evals(cfg, store, arts)
    st = store.entity(eval_id(f["entity_id"]))["state"]
    assert st["split"] == "train"
    ok = next(t for t in load_suite(store, arts, "regression").tasks if t["metadata"]["origin_trace"] == f"trace:ok-{CITIES[0]}")
    assert st["cluster"] == ok["metadata"]["cluster"]


def test_a_heldout_suite_too_small_to_decide_is_reported_before_training(cfg, store, arts):
    append_failures(store, [weather_failure(c) for c in CITIES])
    s = build_evals(cfg, store, arts)
    assert 0 < s.heldout["items"] < cfg.gate.min_paired_items
    (warning,) = s.warnings
    assert f"the held-out suite has {s.heldout['items']} items, fewer than gate.min_paired_items = 30" in warning
    assert "insufficient evidence" in warning and "request clusters" in warning and "ingest more traffic" in warning
    # Enough held-out items: nothing to say.
    cfg.gate.min_paired_items = s.heldout["items"]
    assert build_evals(cfg, store, arts).warnings == []


def test_an_empty_heldout_suite_says_why(cfg, store, arts):
    cfg.evals.heldout_fraction = 0.001
    append_failures(store, [weather_failure(c) for c in CITIES[:3]])
    s = build_evals(cfg, store, arts)
    assert s.empty_suites == ["heldout", "regression"]
    (warning,) = s.warnings
    assert warning.startswith("the held-out suite is empty") and "3 evals in 3 request clusters, 0 of them held out" in warning


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
