"""Rollout stage end to end: env -> K samples per task -> verified, grouped Parquet -> event."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA

from flywheel.artifacts import open_artifacts
from flywheel.envs import build_envs
from flywheel.envs.testing import ScriptedPolicy, append_failures, failure_payload, tool_spec
from flywheel.evals import build_evals
from flywheel.policy.registry import ResolvedPolicy
from flywheel.rollouts import RolloutError, run_rollouts, validate_rollouts
from flywheel.tracking import Tracker

WEATHER = tool_spec("get_weather", {"city": {"type": "string"}}, ["city"])


def _failures(n: int) -> list[dict]:
    # Distinct requests (different words), so the split clusters them apart and both sides get some.
    openers = ["Quick question about", "Planning a picnic, need", "My grandmother asks for", "Before my flight check",
               "Hiking tomorrow so tell me", "Urgent: deliver", "For the newsletter give", "Curious about",
               "The kids want to know", "Reporting needs", "Dispatch requires", "Festival organisers want"]
    out = []
    for i in range(n):
        city = f"City{i}x{i * 7}"
        msgs = [{"role": "user", "content": f"{openers[i % len(openers)]} the weather in {city} today"}]
        bad = {"role": "assistant", "content": "It is sunny."}
        corr = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}
        out.append(failure_payload(msgs, [WEATHER], bad, ["no_tool_call"], correction=corr, trace_id=f"trace:r{i}"))
    return out


@pytest.fixture
def train_env(cfg, store):
    artifacts = open_artifacts(cfg)
    append_failures(store, _failures(12))
    build_evals(cfg, store, artifacts)
    build_envs(cfg, store, artifacts)
    return artifacts


def _half_right_policy():
    """Answers with the right call on even samples and prose on odd ones: every group has variance."""

    def answer(prompt_text, i):
        city = re.search(r"weather in (\S+) today", prompt_text).group(1)
        return f"[get_weather(city='{city}')]" if i % 2 == 0 else "I think it is sunny."

    return ScriptedPolicy(answer)


def test_rollouts_publish_grouped_parquet(cfg, store, train_env):
    artifacts = train_env
    pol = ResolvedPolicy(_half_right_policy(), "scripted:half", None)
    s = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=pol, group_size=4)
    assert s.published and not s.reused
    table = artifacts.read_table(s.artifact["sha256"])
    assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False)
    assert table.num_rows == s.tasks * 4
    rows = table.to_pylist()
    # Even samples pass, odd fail: reward 1/0 in every group -> group-normalised advantages +-0.866.
    for r in rows:
        assert r["passed"] == (r["sample_idx"] % 2 == 0)
        assert r["advantage"] == pytest.approx(0.866, abs=1e-3) if r["passed"] else r["advantage"] < 0
        assert len(r["completion_token_ids"]) == len(r["loss_mask"]) == len(r["sampler_logprobs"])
    assert s.stats["pass_at_1"] == pytest.approx(0.5)
    assert s.stats["pass_at_k"] == pytest.approx(1.0)
    assert s.stats["zero_variance_share"] == 0.0
    ev = store.entity(s.rollout_id)
    assert ev["last_type"] == "rollouts.published"
    edges = dict(store.lineage(s.rollout_id, "down"))
    assert any(e.startswith("env:train@") for e in edges)
    assert any(e.startswith("trace:r") for e in edges)  # lineage reaches the production traces


def test_rerun_reuses_published_dataset(cfg, store, train_env):
    artifacts = train_env
    pol = ResolvedPolicy(_half_right_policy(), "scripted:half", None)
    a = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=pol, group_size=2)
    n_events = store.last_seq()
    b = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=pol, group_size=2)
    assert b.reused and b.rollout_id == a.rollout_id and b.artifact == a.artifact
    assert store.last_seq() == n_events


def test_zero_variance_groups_reported_and_dropped(cfg, store, train_env):
    artifacts = train_env
    prose = ResolvedPolicy(ScriptedPolicy(lambda m, i: "no idea"), "scripted:prose", None)
    s = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=prose, group_size=2)
    assert s.stats["zero_variance_share"] == 1.0 and s.stats["pass_at_k"] == 0.0
    cfg.rollout.dynamic_sampling = "drop"
    d = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=prose, group_size=2)
    assert not d.published and d.stats["dropped_groups"] == d.tasks


def test_dataset_failing_its_suite_is_not_published(cfg, store, train_env):
    artifacts = train_env
    pol = ResolvedPolicy(_half_right_policy(), "scripted:half", None)
    s = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=pol, group_size=2)
    good = artifacts.read_table(s.artifact["sha256"])
    ok, _ = validate_rollouts(good, 2)
    assert ok
    # Misaligned token columns (a mask shorter than the completion) must fail the suite.
    rows = good.to_pylist()
    rows[0]["loss_mask"] = rows[0]["loss_mask"][:-1] or [1, 1]
    bad = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    ok, report = validate_rollouts(bad, 2)
    assert not ok and any(r["column"] == "len_mismatch" for r in report)


def test_tiny_hf_policy_rollout(cfg, store, train_env, tmp_path):
    from flywheel.policy.testing import tiny_policy

    artifacts = train_env
    pol = ResolvedPolicy(tiny_policy(cfg.home), "base:tiny", None)
    cfg.rollout.max_new_tokens = 8
    s = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=pol, group_size=2, max_tasks=3)
    t = artifacts.read_table(s.artifact["sha256"]).to_pylist()
    assert len(t) == 6
    for r in t:
        assert 0 < len(r["completion_token_ids"]) <= 8
        assert all(lp <= 0 for lp in r["sampler_logprobs"])
        assert set(r["loss_mask"]) == {1}


def test_unknown_env_is_a_clear_error(cfg, store):
    artifacts = open_artifacts(cfg)
    with pytest.raises(Exception, match="train"):
        run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=ResolvedPolicy(ScriptedPolicy(lambda m, i: ""), "x", None))
    _ = RolloutError
