"""Rollout stage: K samples per task from the current policy, scored, grouped, written as Parquet.

For every task of an environment version, :func:`run_rollouts` samples a *group* of K episodes
through the task's harness (:func:`flywheel.envs.harness.run_episodes`: single-turn, or the
multi-turn tool loop), scores them with the task's verifier, computes advantages with the configured
scaling (``group`` / ``batch`` / ``none``, :func:`flywheel.advantages.compute_advantages`), and
writes one Parquet dataset (``schemas/rollouts.py``, zstd) per run.

Guarantees
- Publication is all or nothing: the dataset is validated by the ``rollouts`` Great Expectations
  suite (``schemas/gx/rollouts.json``) and only then written as a content-addressed artifact and
  announced by one ``rollouts.published`` event. A crash or kill before that event leaves no
  published dataset (at most an unreferenced artifact or a temp file the artifact store sweeps).
- Idempotent: the rollout id is a hash of its inputs (environment version, policy, group size,
  sampling parameters, seed, task cap). Re-running with the same inputs finds the published dataset
  and returns it without sampling again; a re-run after a crash samples from scratch.
- Samples whose verifier hit an infrastructure error keep ``infra_error`` set, get advantage 0, and are
  excluded from the group statistics and from training (an infrastructure failure is never reward 0).
  So are samples whose verdict is not training data (``Verdict.not_for_training``: a weak sandbox the
  candidate could have forged); their ``infra_error`` column says ``not for training: <why>`` and the
  stats count them as ``untrainable``.
- Several inference servers (``policy.base_url`` a list): each group is sampled whole on one server
  and moves whole to another if that server fails mid-group (:mod:`flywheel.envs.harness`), so the
  dataset holds every group exactly once. Which server sampled each published group is recorded in
  the event payload, ``served_by`` (task id -> endpoint), with ``stats.endpoints`` (groups per
  endpoint); it is deliberately not a Parquet column, so the dataset's content hash (its artifact)
  does not depend on which replica happened to answer.
- Zero-variance groups (all K rewards equal) carry no GRPO signal: their share is reported, and
  ``rollout.dynamic_sampling = "drop"`` removes them from the dataset (DAPO's dynamic sampling, without
  the resampling loop).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore
from flywheel.champion import reconcile_champion
from flywheel.config import FlywheelConfig
from flywheel.envs.harness import run_episodes
from flywheel.policy.base import SamplingParams
from flywheel.policy.registry import ModelRefError, ResolvedPolicy, resolve_policy
from flywheel.schemas.gx_suites import validate_frame
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import Tracker
from flywheel.versioning import load_env
from flywheel.vocab.ids import content_id, digest, short_id


class RolloutError(RuntimeError):
    pass


@dataclass
class RolloutSummary:
    rollout_id: str  # rollouts:<hash>
    env_id: str
    policy: str
    tasks: int
    samples: int
    artifact: dict[str, Any] | None
    stats: dict[str, Any] = field(default_factory=dict)
    reused: bool = False
    published: bool = True
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rollout_id_for(env_id: str, policy_ref: str, params: dict[str, Any]) -> str:
    return content_id("rollouts", {"env": env_id, "policy": policy_ref, "params": params})


def _group_stats(rewards: list[float], passed: list[bool], ok: list[bool]) -> tuple[bool, bool]:
    vals = [r for r, k in zip(rewards, ok, strict=True) if k]
    zero_var = len(vals) < 2 or (max(vals) - min(vals)) < 1e-6
    any_pass = any(p for p, k in zip(passed, ok, strict=True) if k)
    return zero_var, any_pass


def episodes_to_table(
    env_id: str, policy_ref: str, tasks: list[dict], groups: list[list[Any]], *, advantage: str, dynamic_sampling: str
) -> tuple[pa.Table, dict[str, Any]]:
    """Turn harness episodes into rollout rows (ROLLOUT_SCHEMA) and group statistics."""
    import torch  # heavy: only when episodes become a dataset

    from flywheel.advantages import compute_advantages  # torch: heavy, only when episodes become a dataset

    rows: list[dict[str, Any]] = []
    n_groups = zero_var_groups = pass_any = dropped = 0
    rewards_all: list[float] = []
    passed_all: list[bool] = []
    tokens = 0
    gen_ms = 0.0
    infra = untrainable = 0
    for task, eps in zip(tasks, groups, strict=True):
        n_groups += 1
        group_id = short_id(f"{env_id}|{task['task_id']}")
        rewards = [float(e.verdict.reward) for e in eps]
        passed = [bool(e.verdict.passed) for e in eps]
        ok = [e.verdict.ok_for_training for e in eps]
        infra += sum(e.verdict.infra_error is not None for e in eps)
        untrainable += sum(e.verdict.infra_error is None and not e.verdict.ok_for_training for e in eps)
        zero_var, any_pass = _group_stats(rewards, passed, ok)
        zero_var_groups += zero_var
        pass_any += any_pass
        if dynamic_sampling == "drop" and zero_var:
            dropped += 1
            continue
        idx = [i for i, k in enumerate(ok) if k]
        adv = [0.0] * len(eps)
        if idx:
            a = compute_advantages(torch.tensor([rewards[i] for i in idx]), [0] * len(idx), advantage)
            for j, i in enumerate(idx):
                adv[i] = float(a[j])
        for i, e in enumerate(eps):
            if ok[i]:
                rewards_all.append(rewards[i])
                passed_all.append(passed[i])
            tokens += sum(e.loss_mask)
            gen_ms += e.gen_ms
            prompt = {"messages": task["prompt"]["messages"], "tools": task["prompt"].get("tools") or []}
            rows.append({
                "task_id": task["task_id"],
                "env_id": env_id,
                "group_id": group_id,
                "sample_idx": e.sample_idx,
                "policy_version": policy_ref,
                "messages": json.dumps(prompt, ensure_ascii=False),
                "completion": e.completion_text,
                "prompt_token_ids": list(e.prompt_token_ids),
                "completion_token_ids": list(e.completion_token_ids),
                "sampler_logprobs": [float(x) for x in e.logprobs],
                "loss_mask": [int(x) for x in e.loss_mask],
                "truncated": bool(e.truncated),
                "reward": rewards[i],
                "reward_components": {k: float(v) for k, v in (e.verdict.components or {}).items()},
                "passed": passed[i],
                "advantage": adv[i],
                "finish_reason": e.finish_reason if e.finish_reason in ("stop", "length", "max_turns") else "error",
                "infra_error": e.verdict.infra_error or (
                    None if ok[i] else f"not for training: {e.verdict.not_for_training}"),
                "generation_ms": float(e.gen_ms),
                "verify_ms": float(e.verify_ms),
            })
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    n = len(rewards_all)
    stats = {
        "groups": n_groups,
        "samples": len(rows),
        "mean_reward": (sum(rewards_all) / n) if n else 0.0,
        "reward_std": (math.sqrt(sum((r - sum(rewards_all) / n) ** 2 for r in rewards_all) / n)) if n else 0.0,
        "pass_at_1": (sum(passed_all) / n) if n else 0.0,
        "pass_at_k": (pass_any / n_groups) if n_groups else 0.0,
        "zero_variance_share": (zero_var_groups / n_groups) if n_groups else 1.0,
        "dropped_groups": dropped,
        "infra_errors": infra,
        "untrainable": untrainable,
        "tokens": tokens,
        "tokens_per_s": (tokens / (gen_ms / 1000.0)) if gen_ms > 0 else 0.0,
    }
    return table, stats


def served_by_group(tasks: list[dict], groups: list[list[Any]], published: set[str]) -> dict[str, str]:
    """task id -> the endpoint that sampled its group, for the published groups sampled over HTTP
    (empty for in-process backends). A group's episodes share one endpoint (see the harness); should
    they not, the one that sampled most of them is named."""
    out: dict[str, str] = {}
    for task, eps in zip(tasks, groups, strict=True):
        tid = str(task["task_id"])
        named = [e.endpoint for e in eps if getattr(e, "endpoint", None)]
        if tid in published and named:
            out[tid] = Counter(named).most_common(1)[0][0]
    return out


def validate_rollouts(table: pa.Table, group_size: int) -> tuple[bool, list[dict[str, Any]]]:
    """Run the ``rollouts`` GX suite over the dataset (pandas at the boundary)."""
    import pyarrow.compute as pc

    n_ct = pc.list_value_length(table["completion_token_ids"])
    lens_ok = pc.and_(
        pc.equal(n_ct, pc.list_value_length(table["loss_mask"])),
        pc.equal(n_ct, pc.list_value_length(table["sampler_logprobs"])),
    )
    max_lp = [max(x) if x else 0.0 for x in table["sampler_logprobs"].to_pylist()]
    df = table.select(["task_id", "group_id", "sample_idx", "reward", "advantage", "finish_reason"]).to_pandas()
    df["n_prompt_tokens"] = pc.list_value_length(table["prompt_token_ids"]).to_numpy(zero_copy_only=False)
    df["len_mismatch"] = (~lens_ok.to_numpy(zero_copy_only=False)).astype(int)
    df["max_logprob"] = max_lp
    return validate_frame("rollouts", df, {"max_sample_idx": max(group_size - 1, 0)})


def run_rollouts(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    *,
    env: str | None = None,
    policy: str | ResolvedPolicy | None = None,
    group_size: int | None = None,
    max_tasks: int | None = None,
    temperature: float | None = None,
    correlation_id: str | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> RolloutSummary:
    """Sample ``group_size`` episodes per task of env ``env`` (name or ``name@N``; default the training
    env) with ``policy`` (a reference, :func:`flywheel.policy.registry.resolve_policy`) and publish them as one Parquet dataset."""
    rc = cfg.rollout
    env_obj = load_env(store, artifacts, env or cfg.cycle.train_env)
    k = int(group_size or rc.group_size)
    cap = max_tasks if max_tasks is not None else rc.max_tasks
    tasks = list(env_obj.tasks)
    if cap is not None:
        # A stable, content-based subset: the same env version always yields the same tasks.
        tasks = sorted(tasks, key=lambda t: digest(f"{rc.seed}|{t['task_id']}"))[:cap]
    if not tasks:
        raise RolloutError(f"environment {env_obj.entity_id} has no tasks")
    params_dict = {
        "n": k, "temperature": rc.temperature if temperature is None else temperature, "top_p": rc.top_p,
        "max_new_tokens": rc.max_new_tokens, "seed": rc.seed, "max_tasks": cap, "advantage": rc.advantage,
        "dynamic_sampling": rc.dynamic_sampling, "max_turns": rc.max_turns,
    }
    if policy is None or policy == "champion":  # complete an interrupted promotion before sampling from it
        reconcile_champion(store, tracker, cfg.cycle.model_name)
    try:
        resolved = policy if isinstance(policy, ResolvedPolicy) else resolve_policy(cfg, tracker, policy)
    except ModelRefError as e:
        raise RolloutError(str(e)) from None
    rid = rollout_id_for(env_obj.entity_id, resolved.ref, params_dict)

    existing = store.entity(rid)
    if existing is not None and existing["last_type"] == "rollouts.published":
        st = existing["state"]
        return RolloutSummary(rid, env_obj.entity_id, resolved.ref, st.get("tasks", 0), st.get("samples", 0),
                              st.get("artifact"), st.get("stats", {}), reused=True)

    params = SamplingParams(n=k, temperature=params_dict["temperature"], top_p=rc.top_p,
                            max_new_tokens=rc.max_new_tokens, seed=rc.seed)
    t0 = time.perf_counter()
    groups: list[list[Any]] = []
    chunk = max(1, 64 // k)  # bounded generation batches: ~64 sequences at a time
    for i in range(0, len(tasks), chunk):
        part = tasks[i : i + chunk]
        groups.extend(run_episodes(part, resolved.policy, params, context={"cfg": cfg}))
        if progress:
            progress({"tasks_done": min(i + chunk, len(tasks)), "tasks": len(tasks),
                      "samples": sum(len(g) for g in groups),
                      "tokens": sum(sum(e.loss_mask) for g in groups for e in g),
                      "elapsed_s": time.perf_counter() - t0})
    table, stats = episodes_to_table(env_obj.entity_id, resolved.ref, tasks, groups,
                                     advantage=rc.advantage, dynamic_sampling=rc.dynamic_sampling)
    served_by = served_by_group(tasks, groups, set(table.column("task_id").to_pylist()))
    if served_by:
        stats["endpoints"] = dict(sorted(Counter(served_by.values()).items()))
    stats["wall_s"] = time.perf_counter() - t0
    if table.num_rows == 0:
        return RolloutSummary(rid, env_obj.entity_id, resolved.ref, len(tasks), 0, None, stats,
                              published=False, reason="every group was dropped (zero variance)")
    ok, report = validate_rollouts(table, k)
    if not ok:
        raise RolloutError(f"rollout dataset for {env_obj.entity_id} failed its expectation suite; "
                           f"not published: {json.dumps(report)[:800]}")
    ref = artifacts.put_table(table, row_group_size=rc.row_group_size)
    causation = [env_obj.entity_id] + ([resolved.entity_id] if resolved.entity_id else [])
    payload = {
        "entity_id": rid,
        "env_ids": [env_obj.entity_id],
        "policy": resolved.ref,
        "artifact": ref.to_dict(),
        "tasks": len(tasks),
        "samples": table.num_rows,
        "group_size": k,
        "params": params_dict,
        "stats": {k2: (round(v, 6) if isinstance(v, float) else v) for k2, v in stats.items() if k2 != "wall_s"},
    }
    if served_by:
        payload["served_by"] = served_by
    store.append(rid, [NewEvent("rollouts.published", payload, causation)], expected_version=0,
                 correlation_id=correlation_id)
    return RolloutSummary(rid, env_obj.entity_id, resolved.ref, len(tasks), table.num_rows, ref.to_dict(), stats)
