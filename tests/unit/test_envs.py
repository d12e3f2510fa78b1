"""Versioned environments: build, load, idempotency, synth tasks, judge handling."""

from __future__ import annotations

import copy

import pytest

from flywheel.artifacts import open_artifacts
from flywheel.envs.build import build_envs, list_envs
from flywheel.envs.testing import append_failures, failure_payload, openai_call, tool_spec
from flywheel.evals import build_evals
from flywheel.tasks import TaskError
from flywheel.versioning import add_tasks_to_env, load_env, load_suite

WEATHER = tool_spec("get_weather", {"city": {"type": "string"}}, ["city"])
REQUESTS = [
    "is it raining in Oslo", "should I pack a coat for Lima tomorrow", "how hot does Porto get at noon",
    "any snow expected around Quito this week", "give me the Cairo forecast", "will the wind be strong in Dakar",
    "humidity level in Hanoi", "can we have a picnic in Perth on Sunday", "temperature at Tunis airport",
    "is Sofia foggy this morning", "do I need an umbrella in Minsk", "sunset time and sky over Riga",
]


def failures(judge: int = 0) -> list[dict]:
    out = [failure_payload([{"role": "user", "content": r}], [WEATHER], openai_call("get_weather", {"city": "X"}),
                           ["wrong_arg_value"], correction={"tool_calls": [{"name": "get_weather", "arguments": {"city": r.split()[-1]}}]})
           for r in REQUESTS]
    out += [failure_payload([{"role": "user", "content": f"please cancel reservation {i} at the harbour restaurant"}], [],
                            {"role": "assistant", "content": "Cancelled!"}, ["negative_feedback"],
                            feedback={"score": -1, "comment": "cannot cancel"}) for i in range(judge)]
    return out


@pytest.fixture
def built(cfg, store):
    """Evals built with train-split members (held-out share lowered so train surely has members)."""
    cfg.evals.heldout_fraction = 0.2
    arts = open_artifacts(cfg)
    append_failures(store, failures())
    build_evals(cfg, store, arts)
    return arts


def synth_task(i: int, seed: dict) -> dict:
    t = copy.deepcopy(seed)
    t["task_id"] = f"synth:b1-{i}"
    t["prompt"]["messages"][-1]["content"] += f" (variant {i})"
    t["metadata"] = {"seed_eval": seed["task_id"], "split": "train"}
    return t


def test_env_is_the_train_suite_with_harness_and_verifier_config(cfg, store, built):
    s = build_envs(cfg, store, built, correlation_id="c1")
    assert [e["env"] for e in s.envs] == ["env:train@1"] and s.events_appended == 1
    env = load_env(store, built, "train")
    suite = load_suite(store, built, "train")
    assert env.entity_id == "env:train@1" and env.version == 1
    assert env.task_ids == suite.task_ids and env.suites == [suite.entity_id]
    assert env.harness == {"max_turns": cfg.rollout.max_turns}
    assert env.verifier_config["sandbox"] == cfg.sandbox.model_dump(mode="json")
    ev = store.read(stream="env:train", types="env.versioned")[0]
    assert ev.causation == [suite.entity_id] and ev.correlation_id == "c1"
    assert ev.payload["tasks"] == len(env.tasks) and ev.payload["harness_kinds"] == {"single_turn": len(env.tasks)}
    assert load_env(store, built, "env:train@1").version_hash == env.version_hash
    assert [e["entity_id"] for e in list_envs(store)] == ["env:train@1"]


def test_rebuilding_envs_appends_nothing_and_a_config_change_makes_a_new_version(cfg, store, built):
    build_envs(cfg, store, built)
    seq = store.last_seq()
    again = build_envs(cfg, store, built)
    assert store.last_seq() == seq and again.events_appended == 0 and not again.envs[0]["new_version"]
    cfg.rollout.max_turns = 7  # the harness changed: rewards may differ, so a new version
    third = build_envs(cfg, store, built)
    assert third.envs[0]["env"] == "env:train@2"
    assert load_env(store, built, "train").harness["max_turns"] == 7
    assert load_env(store, built, "train@1").harness["max_turns"] != 7


def test_llm_judge_tasks_need_a_judge_endpoint(cfg, store):
    cfg.evals.heldout_fraction = 0.01
    arts = open_artifacts(cfg)
    append_failures(store, failures(judge=3))
    build_evals(cfg, store, arts)
    train = load_suite(store, arts, "train")
    n_judge = sum(1 for t in train.tasks if t["verifier"]["kind"] == "llm_judge")
    assert n_judge >= 1
    s = build_envs(cfg, store, arts)
    assert s.to_dict()["skipped_by_reason"] == {"llm_judge without a judge endpoint": n_judge}
    assert len(load_env(store, arts, "train").tasks) == len(train.tasks) - n_judge
    cfg.judge.base_url = "http://judge.internal:8000"
    build_envs(cfg, store, arts)
    assert len(load_env(store, arts, "train").tasks) == len(train.tasks)


def test_synth_tasks_are_added_kept_across_rebuilds_and_idempotent(cfg, store, built):
    build_envs(cfg, store, built)
    seed = load_env(store, built, "train").tasks[0]
    new = [synth_task(i, seed) for i in range(3)]
    ent = add_tasks_to_env(cfg, store, built, "train", new, ["synth:b1", "env:train@1"])
    assert ent == "env:train@2"
    env = load_env(store, built, "train")
    assert {"synth:b1-0", "synth:b1-1", "synth:b1-2"} <= set(env.task_ids)
    assert env.synth_batches == ["synth:b1"]
    assert all(t["metadata"]["synth_batch"] == "synth:b1" for t in env.tasks if t["task_id"].startswith("synth:"))
    ev = store.read(stream="env:train", types="env.versioned")[-1]
    assert set(ev.causation) == {*env.suites, "synth:b1", "env:train@1"}
    assert "synth:b1" in {e for e, _ in store.lineage("env:train@2")}
    # Adding the same tasks again appends nothing.
    seq = store.last_seq()
    assert add_tasks_to_env(cfg, store, built, "train", new, ["synth:b1"]) == "env:train@2"
    assert store.last_seq() == seq
    # A rebuild from the suites keeps the synth tasks (same content -> no new version).
    assert not build_envs(cfg, store, built).envs[0]["new_version"]
    # A new suite version: the next env version has the new suite *and* the synth tasks.
    append_failures(store, [failure_payload([{"role": "user", "content": "what is the pollen count in Vienna today"}],
                                            [WEATHER], openai_call("get_weather", {"city": "X"}), ["wrong_arg_type"])])
    cfg.evals.heldout_fraction = 0.01
    build_evals(cfg, store, built)
    build_envs(cfg, store, built)
    env3 = load_env(store, built, "train")
    assert env3.version == 3 and {"synth:b1-0"} <= set(env3.task_ids)
    assert len(env3.tasks) == len(env.tasks) + 1


def test_add_tasks_refuses_bad_records_and_missing_envs(cfg, store, built):
    with pytest.raises(LookupError, match="envs build"):
        add_tasks_to_env(cfg, store, built, "train", [], ["synth:b0"])
    build_envs(cfg, store, built)
    bad = {"task_id": "synth:x", "prompt": {"messages": []}, "verifier": {"kind": "exact", "expected": "a"},
           "harness": "single_turn"}
    with pytest.raises(TaskError, match="task 0.*prompt.messages"):
        add_tasks_to_env(cfg, store, built, "train", [bad], ["synth:b0"])
    loop = {**bad, "prompt": {"messages": [{"role": "user", "content": "hi"}]}, "harness": "tool_loop"}
    with pytest.raises(TaskError, match="tool_env"):
        add_tasks_to_env(cfg, store, built, "train", [loop], ["synth:b0"])


def test_unknown_env_versions_are_clear_errors(cfg, store, built):
    with pytest.raises(LookupError, match="no such version"):
        load_env(store, built, "train")
    build_envs(cfg, store, built)
    with pytest.raises(LookupError):
        load_env(store, built, "train@9")
    with pytest.raises(ValueError, match="integer"):
        load_env(store, built, "train@latest")
