"""Preference pairs: built from hand-made eval tasks (held-out refused, skips counted), published
idempotently as Parquet with lineage, and trained with RPO on the tiny model (learning asserted)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from flywheel.envs.testing import append_failure, failure_payload, openai_call, tool_spec
from flywheel.evals import compile_failure
from flywheel.store import NewEvent
from flywheel.train.preference import (
    HeldOutPairError,
    PreferencePair,
    check_pairs,
    failed_answers,
    load_pairs,
    pairs_from_samples,
    pairs_from_tasks,
    publish_pairs,
    scored_samples,
)
from flywheel.verifiers import ToolCall

WEATHER = tool_spec("get_weather", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    ["city"], "Current weather of a city")
CORRECT = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Porto"}}]}


def failure(city: str, bad: dict, trace: str) -> dict:
    return failure_payload([{"role": "user", "content": f"Weather in {city}?"}], [WEATHER], bad,
                           ["missing_required_arg"],
                           correction={"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]},
                           trace_id=f"trace:{trace}")


def task(payload: dict, split: str = "train") -> dict:
    t = compile_failure(payload)
    t["metadata"]["split"] = split
    return t


def record_eval(store, payload: dict, split: str = "train") -> dict:
    """The events ingest and the evals stage would append: failure (caused by its trace), eval (caused by
    the failure)."""
    fid = append_failure(store, payload)
    t = task(payload, split)
    store.append(t["task_id"], NewEvent("eval.created", {"entity_id": t["task_id"], **t, "split": split}, [fid]))
    return t


def test_pairs_from_tasks_uses_the_failed_production_answer(store):
    ok = record_eval(store, failure("Porto", openai_call("get_weather", {"unit": "celsius"}), "t1"))
    malformed = record_eval(store, failure("Oslo", openai_call("get_weather", '{"city": "Oslo"'), "t2"))
    # A "failure" whose recorded answer is the correction itself (a mislabelled trace): no pair.
    same = record_eval(store, failure("Lima", openai_call("get_weather", {"city": "Lima"}), "t3"))
    no_answer = task(failure("Rome", openai_call("get_weather", {}), "t4"))  # its failure was never recorded
    regression = task(failure("Nice", openai_call("get_weather", {}), "t5"), split="regression")
    tasks = [ok, malformed, same, no_answer, regression]
    skipped: Counter[str] = Counter()
    pairs = pairs_from_tasks(tasks, failed_answers(store, tasks), skipped=skipped)
    assert [p.task_id for p in pairs] == [ok["task_id"], malformed["task_id"]]
    assert skipped == {"same_as_chosen": 1, "no_failed_answer": 1, "not_train": 1}
    p = pairs[0]
    # Rendered as the policy writes answers: the failed call in the pythonic format, the reference likewise.
    assert p.rejected_text == "[get_weather(unit='celsius')]"
    assert p.chosen_text == "[get_weather(city='Porto')]"
    assert p.chosen_calls == [ToolCall("get_weather", {"city": "Porto"})]
    assert (p.source, p.source_entity_id, p.split, p.chosen_reward, p.rejected_reward) == \
        ("production", ok["task_id"], "train", 1.0, 0.0)
    assert p.messages == [{"role": "user", "content": "Weather in Porto?"}] and p.tools == [WEATHER]
    # A malformed call has no pythonic form: kept verbatim, never tidied into a well-formed one.
    assert json.loads(pairs[1].rejected_text)[0]["function"]["arguments"] == '{"city": "Oslo"'
    # A bad answer kept on the task itself is read without the store.
    inline = task(failure("Bern", openai_call("get_weather", {"unit": "kelvin"}), "t6"))
    inline["metadata"]["bad_answer"] = openai_call("get_weather", {"unit": "kelvin"})
    (q,) = pairs_from_tasks([inline])
    assert q.rejected_text == "[get_weather(unit='kelvin')]"
    # Given the store instead of the mapping, the same pairs.
    assert pairs_from_tasks(tasks, store=store) == pairs


def test_heldout_tasks_are_refused(store):
    train = record_eval(store, failure("Porto", openai_call("get_weather", {}), "t1"))
    held = record_eval(store, failure("Oslo", openai_call("get_weather", {}), "t2"), split="heldout")
    with pytest.raises(HeldOutPairError, match=f"{held['task_id']}.*held-out"):
        pairs_from_tasks([train, held], failed_answers(store, [train, held]))
    with pytest.raises(HeldOutPairError):
        pairs_from_samples([held], {held["task_id"]: [{"completion": "x", "reward": 0.0, "passed": False}]})
    # A pair labelled "train" whose source descends from a held-out eval is caught through lineage.
    store.append("synth:s1", NewEvent("synth.batch_accepted", {"entity_id": "synth:s1"}, [held["task_id"]]))
    leak = PreferencePair(task_id="synth-1", messages=[{"role": "user", "content": "hi"}], tools=None,
                          chosen_content="a", rejected_text="b", source="sampled", source_entity_id="synth:s1")
    check_pairs([leak])  # by split alone it looks fine
    with pytest.raises(HeldOutPairError, match="descends from held-out eval"):
        check_pairs([leak], store)


def test_pairs_from_samples_takes_distinct_verified_failures_lowest_reward_first():
    t = task(failure("Porto", openai_call("get_weather", {}), "t1"))
    rows = [
        {"completion": "[get_weather(city='Porto')]", "reward": 1.0, "passed": True, "infra_error": None},
        {"completion": "It is sunny.", "reward": 0.2, "passed": False, "infra_error": None},
        {"completion": "[get_weather()]", "reward": 0.0, "passed": False, "infra_error": "sandbox died"},
        {"completion": "[get_weather(city='Paris')]", "reward": 0.1, "passed": False, "infra_error": None},
        {"completion": "It is sunny.", "reward": 0.2, "passed": False, "infra_error": None},
        {"completion": "[get_weather(city='Porto')]", "reward": 0.5, "passed": False, "infra_error": None},
    ]
    skipped: Counter[str] = Counter()
    pairs = pairs_from_samples([t], {t["task_id"]: rows}, max_per_task=3, skipped=skipped)
    # The infra error is never a failed answer; the passing sample is no failure; the duplicate prose counts
    # once; a "failed" sample identical to the reference is skipped.
    assert [(p.rejected_text, p.rejected_reward) for p in pairs] == [
        ("[get_weather(city='Paris')]", pytest.approx(0.1)), ("It is sunny.", pytest.approx(0.2))]
    assert all(p.source == "sampled" and p.chosen_reward == 1.0 for p in pairs)
    assert skipped == {"same_as_chosen": 1}
    (only,) = pairs_from_samples([t], {t["task_id"]: rows}, max_per_task=1)
    assert only.rejected_text == "[get_weather(city='Paris')]"
    skipped.clear()
    assert pairs_from_samples([t], {}, skipped=skipped) == [] and skipped == {"no_failed_sample": 1}


def test_scored_samples_reads_a_rollout_table():
    import pyarrow as pa
    from flywheel.schemas.rollouts import ROLLOUT_SCHEMA

    row = {f.name: None for f in ROLLOUT_SCHEMA}
    rows = []
    for i, (tid, text) in enumerate([("eval:b", "y"), ("eval:a", "x"), ("eval:b", "z")]):
        rows.append({**row, "task_id": tid, "env_id": "env:train@1", "group_id": tid, "sample_idx": i,
                     "policy_version": "p", "messages": "[]", "completion": text, "prompt_token_ids": [1],
                     "completion_token_ids": [2], "sampler_logprobs": [0.0], "loss_mask": [1], "truncated": False,
                     "reward": 0.0, "reward_components": [], "passed": False, "advantage": 0.0,
                     "finish_reason": "stop", "generation_ms": 1.0, "verify_ms": 1.0})
    got = scored_samples(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA))
    assert {k: [r["completion"] for r in v] for k, v in got.items()} == {"eval:a": ["x"], "eval:b": ["y", "z"]}


def test_publish_is_idempotent_and_hash_verified(cfg, store):
    from flywheel.artifacts import ArtifactCorruptError, open_artifacts

    artifacts = open_artifacts(cfg)
    tasks = [record_eval(store, failure(c, openai_call("get_weather", {"unit": "celsius"}), f"t{i}"))
             for i, c in enumerate(["Porto", "Oslo", "Lima"])]
    pairs = pairs_from_tasks(tasks, failed_answers(store, tasks))
    n_events = len(store.read())
    pid = publish_pairs(cfg, store, artifacts, pairs, correlation_id="cycle:c1")
    assert pid.startswith("preferences:")
    (ev,) = store.read(pid)
    assert ev.type == "preferences.published" and ev.correlation_id == "cycle:c1"
    assert set(ev.causation) == {t["task_id"] for t in tasks}
    assert ev.payload["pairs"] == 3 and ev.payload["by_source"] == {"production": 3}
    assert len(store.read()) == n_events + 1
    # Again, and in another order: the same dataset, nothing appended.
    assert publish_pairs(cfg, store, artifacts, list(reversed(pairs))) == pid
    assert len(store.read()) == n_events + 1
    # The artifact is the zstd Parquet the event names, read back with its hash verified.
    sha = ev.payload["artifact"]["sha256"]
    path = artifacts.verify(sha)
    import pyarrow.parquet as pq

    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    back = load_pairs(store, artifacts, pid)
    assert sorted(back, key=lambda p: p.task_id) == sorted(pairs, key=lambda p: p.task_id)
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-8] + b"tampered")
    with pytest.raises(ArtifactCorruptError):
        load_pairs(store, artifacts, pid)


# -- RPO training on the tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from flywheel.policy.models import ensure_base_model

    return str(ensure_base_model("tiny", tmp_path_factory.mktemp("models")))


def margins(cfg, tracker, base: str, pairs: list[PreferencePair]) -> list[float]:
    """logp(chosen) - logp(rejected) of each pair under ``base`` (summed over answer tokens)."""
    import torch

    from flywheel.train.data import make_micro_batches
    from flywheel.train.preference import preference_samples
    from flywheel.train.stage import load_policy
    from flywheel.train.trainer import sequence_logprobs

    model, tok, _ = load_policy(cfg, tracker, base)
    model.eval()
    out = []
    with torch.no_grad():
        for s in preference_samples(tok, pairs):
            (mb,) = make_micro_batches([s.chosen, s.rejected], token_budget=100_000, pad_id=tok.pad_token_id or 0)
            logp, _ = sequence_logprobs(model, mb, impl="naive")
            seq = {id(x): float((logp[k] * mb.mask[k]).sum()) for k, x in enumerate(mb.samples)}
            out.append(seq[id(s.chosen)] - seq[id(s.rejected)])
    return out


@pytest.mark.slow
def test_train_rpo_learns_registers_and_keeps_lineage(cfg, store, tiny_dir):
    import time

    from safetensors.torch import load_file

    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.preference import train_rpo

    cfg.train.lora_r = 4
    cfg.train.batch_size = 4  # 2 pairs a step
    artifacts = open_artifacts(cfg)
    tracker = Tracker(cfg)
    tasks = [record_eval(store, failure(c, openai_call("get_weather", {"unit": "celsius"}), f"t{i}"))
             for i, c in enumerate(["Porto", "Oslo"])]
    pairs = pairs_from_tasks(tasks, store=store)
    pid = publish_pairs(cfg, store, artifacts, pairs)
    before = margins(cfg, tracker, tiny_dir, pairs)
    t0 = time.perf_counter()
    res = train_rpo(cfg, store, artifacts, tracker, pairs, base=tiny_dir, steps=2, lr=1e-2, beta=0.5, alpha=0.1,
                    preferences_id=pid)
    print(f"train_rpo 2 steps (load + reference + register): {time.perf_counter() - t0:.2f} s; "
          f"steps {[round(h['seconds'], 3) for h in res.history]} s")
    assert res.mode == "rpo" and res.steps == 2 and res.adapter == "lora"
    assert res.history[0]["margin"] == pytest.approx(0.0, abs=1e-5)  # the reference is the starting policy
    after = margins(cfg, tracker, res.model_entity, pairs)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

    # Registered like SFT, and lineage walks from the model down to the evals, failures and traces.
    assert tracker.get_alias_version(cfg.cycle.model_name, "challenger") == res.model_version
    ev = store.read(res.run_id)[0]
    assert ev.type == "training.completed" and ev.payload["mode"] == "rpo" and ev.payload["preferences"] == pid
    assert set(ev.causation) == {*(t["task_id"] for t in tasks), pid, "model:base/tiny"}
    down = {a for a, _ in store.lineage(res.model_entity, "down")}
    for t in tasks:
        assert {t["task_id"], t["metadata"]["origin_failure"], t["metadata"]["origin_trace"]} <= down
    assert pid in down
    assert {t["metadata"]["origin_trace"] for t in tasks} <= {a for a, _ in store.lineage(pid, "down")}

    # Continuing from the registered adapter (B != 0, so every LoRA matrix has a gradient): two steps
    # change every LoRA tensor.
    res2 = train_rpo(cfg, store, artifacts, tracker, pairs, base=res.model_entity, steps=2, lr=1e-2)
    w1 = load_file(str(tracker.model_dir(cfg.cycle.model_name, res.model_version) / "adapter_model.safetensors"))
    w2 = load_file(str(tracker.model_dir(cfg.cycle.model_name, res2.model_version) / "adapter_model.safetensors"))
    assert w1.keys() == w2.keys() and all("lora_" in k for k in w1)
    unchanged = [k for k in w1 if (w1[k] == w2[k]).all()]
    assert not unchanged, unchanged
    assert res.model_entity in store.read(res2.run_id)[0].causation


def test_train_rpo_refuses_heldout_and_unpublished_before_loading(cfg, store):
    from flywheel.tracking import Tracker
    from flywheel.train.preference import train_rpo
    from flywheel.train.stage import TrainStageError

    held = PreferencePair(task_id="eval:h", messages=[{"role": "user", "content": "hi"}], tools=None,
                          chosen_content="a", rejected_text="b", source_entity_id="eval:h", split="heldout")
    with pytest.raises(HeldOutPairError):
        train_rpo(cfg, store, None, Tracker(cfg), [held], base="/nonexistent")
    ok = PreferencePair(task_id="eval:t", messages=held.messages, tools=None, chosen_content="a",
                        rejected_text="b", source_entity_id="eval:t")
    with pytest.raises(TrainStageError, match="preferences:nope"):
        train_rpo(cfg, store, None, Tracker(cfg), [ok], base="/nonexistent", preferences_id="preferences:nope")
    assert store.read("run:*") == []
