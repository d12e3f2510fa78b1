"""Versioned RL environments: ``env:<name>@N`` = task set + harness config + verifier config.

An environment is what the rollout stage samples from. Version N of ``env:train`` holds the tasks of
the latest ``suite:train`` version (plus tasks synth added with :func:`add_tasks_to_env`), the
harness configuration (``max_turns``) and the verifier configuration that shapes rewards (sandbox
limits, judge model). Its ``version_hash`` is the sha256 of all of that, canonical JSON.

Artifact (JSON, content-addressed)::

    {"kind": "env", "name", "version_hash",
     "harness": {"max_turns": int},
     "verifier_config": {"sandbox": {...}, "judge_model": str, "judge_configured": bool},
     "suites": ["suite:train@3"], "synth_batches": ["synth:..."],
     "tasks": [task records sorted by task_id]}

Event: ``env.versioned`` on ``env:<name>``, payload ``{entity_id: "env:<name>@N", name, version,
artifact, tasks: n, version_hash, suites, synth_batches, harness}``, causation = the suite versions
and synth batches it was made from.

Guarantees
- Rebuilding with the same suites, synth tasks and config appends nothing (same version hash).
- Synth tasks survive rebuilds: tasks carrying ``metadata.synth_batch`` in the latest version are
  carried into the next one (their seeds are train evals, whose split never changes).
- ``llm_judge`` tasks are left out of an environment when no judge endpoint is configured
  (``[judge] base_url``): every sample would be an infrastructure error, not a learning signal.
  They are counted under ``skipped``.
- Appends use ``expected_version``; a concurrent writer gets ``ConcurrencyError``, nothing partial.

Not guaranteed: that every task is solvable by the policy, or that the harness is identical across
versions of the chat template (token accounting is re-derived per tokenizer).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.evals import (
    TaskError,
    load_suite,
    validate_task,
    versioned_event,
)
from flywheel.store import EventStore, NewEvent
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.refs import parse_versioned_ref

#: Which suites feed which environment by default. The held-out and regression suites are never
#: turned into training environments: the gate reads them as suites.
DEFAULT_ENV_SUITES = {"train": ("train",)}


@dataclass
class Env:
    """One loaded environment version."""

    entity_id: str
    name: str
    version: int
    version_hash: str
    tasks: list[dict]
    harness: dict = field(default_factory=dict)
    verifier_config: dict = field(default_factory=dict)
    suites: list[str] = field(default_factory=list)
    synth_batches: list[str] = field(default_factory=list)
    artifact: dict = field(default_factory=dict)

    @property
    def task_ids(self) -> list[str]:
        return [t["task_id"] for t in self.tasks]


@dataclass
class EnvsSummary:
    envs: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    events_appended: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "envs": list(self.envs),
            "skipped": list(self.skipped),
            "skipped_by_reason": dict(Counter(s["reason"] for s in self.skipped)),
            "events_appended": self.events_appended,
        }


def _verifier_config(cfg: Any) -> dict:
    return {
        "sandbox": cfg.sandbox.model_dump(mode="json"),
        "judge_model": cfg.judge.model,
        "judge_configured": bool(cfg.judge.base_url),
    }


def env_version_hash(name: str, tasks: list[dict], harness: dict, verifier_config: dict) -> str:
    body = canonical_json(
        {
            "name": name,
            "harness": harness,
            "verifier_config": verifier_config,
            "tasks": sorted(tasks, key=lambda t: t["task_id"]),
        }
    )
    return hashlib.sha256(body.encode()).hexdigest()


def load_env(store: EventStore, artifacts: Any, ref: str) -> Env:
    """Load ``"train"`` (latest version), ``"train@3"`` or ``"env:train@3"``.

    Raises ``LookupError`` naming the env when it has no such version; the artifact is verified.
    """
    ev = versioned_event(store, "env", "env.versioned", ref)
    if ev is None:
        raise LookupError(f"environment {ref!r} has no such version; run `flywheel envs build` first")
    return _env_from_event(ev.payload, artifacts)


def _env_from_event(p: dict, artifacts: Any) -> Env:
    body = artifacts.read_json(p["artifact"]["sha256"])
    return Env(
        entity_id=p["entity_id"],
        name=p["name"],
        version=int(p["version"]),
        version_hash=p["version_hash"],
        tasks=body["tasks"],
        harness=body.get("harness", {}),
        verifier_config=body.get("verifier_config", {}),
        suites=list(body.get("suites", [])),
        synth_batches=list(body.get("synth_batches", [])),
        artifact=p["artifact"],
    )


def list_envs(store: EventStore) -> list[dict]:
    """Latest version payload of every environment, by name."""
    out = []
    for ent in store.entities("env"):
        st = ent["state"]
        out.append(st)
    latest: dict[str, dict] = {}
    for st in out:
        if st.get("name") and st.get("version", 0) >= latest.get(st["name"], {}).get("version", 0):
            latest[st["name"]] = st
    return [latest[k] for k in sorted(latest)]


def _write_version(
    cfg: Any,
    store: EventStore,
    artifacts: Any,
    name: str,
    tasks: list[dict],
    suites: list[str],
    synth_batches: list[str],
    correlation_id: str | None,
    extra_causation: list[str] = (),
) -> tuple[str, bool, str]:
    """Append ``env:<name>@N+1`` unless the latest version has the same hash.

    Returns (entity id, new?, version hash).
    """
    harness = {"max_turns": int(cfg.rollout.max_turns)}
    vcfg = _verifier_config(cfg)
    tasks = sorted(tasks, key=lambda t: t["task_id"])
    vh = env_version_hash(name, tasks, harness, vcfg)
    stream = f"env:{name}"
    latest = store.read(stream=stream, types="env.versioned")
    if latest and latest[-1].payload.get("version_hash") == vh:
        return latest[-1].payload["entity_id"], False, vh
    current = store.stream_version(stream)
    version = latest[-1].payload["version"] + 1 if latest else 1
    ref = artifacts.put_json(
        {
            "kind": "env",
            "name": name,
            "version_hash": vh,
            "harness": harness,
            "verifier_config": vcfg,
            "suites": suites,
            "synth_batches": synth_batches,
            "tasks": tasks,
        }
    )
    entity = f"env:{name}@{version}"
    payload = {
        "entity_id": entity,
        "name": name,
        "version": version,
        "artifact": ref.to_dict(),
        "tasks": len(tasks),
        "version_hash": vh,
        "suites": suites,
        "synth_batches": synth_batches,
        "harness": harness,
        "harness_kinds": dict(Counter(t["harness"] for t in tasks)),
    }
    store.append(
        stream,
        NewEvent("env.versioned", payload, list(dict.fromkeys([*suites, *synth_batches, *extra_causation]))),
        expected_version=current,
        correlation_id=correlation_id,
    )
    return entity, True, vh


def _synth_carry(store: EventStore, artifacts: Any, name: str) -> tuple[list[dict], list[str]]:
    ev = versioned_event(store, "env", "env.versioned", name)
    if ev is None:
        return [], []
    env = _env_from_event(ev.payload, artifacts)
    tasks = [t for t in env.tasks if (t.get("metadata") or {}).get("synth_batch")]
    return tasks, list(env.synth_batches)


def build_envs(
    cfg: Any,
    store: EventStore,
    artifacts: Any,
    *,
    names: dict[str, tuple[str, ...]] | None = None,
    correlation_id: str | None = None,
) -> EnvsSummary:
    """Version each environment from the latest versions of its suites (default: ``train`` from
    ``suite:train``, named ``cfg.cycle.train_env``). Idempotent."""
    if names is None:
        names = {cfg.cycle.train_env: DEFAULT_ENV_SUITES["train"]}
    summary = EnvsSummary()
    judge = bool(cfg.judge.base_url)
    for name, suite_names in names.items():
        suites, tasks = [], {}
        for sn in suite_names:
            try:
                suite = load_suite(store, artifacts, sn)
            except LookupError:
                continue
            suites.append(suite.entity_id)
            for t in suite.tasks:
                if t["verifier"].get("kind") == "llm_judge" and not judge:
                    summary.skipped.append(
                        {"env": name, "task_id": t["task_id"], "reason": "llm_judge without a judge endpoint"}
                    )
                    continue
                tasks[t["task_id"]] = t
        if not suites:
            summary.skipped.append({"env": name, "task_id": None, "reason": f"no version of suites {list(suite_names)}"})
            continue
        carried, batches = _synth_carry(store, artifacts, name)
        for t in carried:
            tasks.setdefault(t["task_id"], t)
        entity, new, vh = _write_version(
            cfg, store, artifacts, name, list(tasks.values()), suites, batches, correlation_id
        )
        summary.events_appended += int(new)
        summary.envs.append(
            {"env": entity, "tasks": len(tasks), "synth_tasks": len(carried), "suites": suites, "new_version": new,
             "version_hash": vh}
        )
    return summary


def add_tasks_to_env(
    cfg: Any,
    store: EventStore,
    artifacts: Any,
    name: str,
    tasks: list[dict],
    causation: list[str],
    *,
    correlation_id: str | None = None,
) -> str:
    """Add (or replace, by ``task_id``) ``tasks`` in the latest version of env ``name``.

    For the synth stage: each task must satisfy the task-record contract
    (:func:`flywheel.evals.validate_task`); its ``metadata.synth_batch`` is set to the ``synth:``
    id in ``causation`` when missing, so rebuilds carry it. Returns the resulting version's entity id
    (the latest one, unchanged, when the tasks were already there). Raises ``LookupError`` when the
    env has no version yet, :class:`flywheel.evals.TaskError` on a bad record.
    """
    name, _ = parse_versioned_ref(name, "env")
    ev = versioned_event(store, "env", "env.versioned", name)
    if ev is None:
        raise LookupError(f"environment {name!r} has no version yet; run `flywheel envs build` before adding tasks")
    env = _env_from_event(ev.payload, artifacts)
    synth_ids = [c for c in causation if c.startswith("synth:")]
    merged = {t["task_id"]: t for t in env.tasks}
    for i, t in enumerate(tasks):
        try:
            rec = validate_task(t)
        except TaskError as e:
            raise TaskError(f"add_tasks_to_env({name!r}) task {i}: {e}") from None
        if synth_ids and not rec["metadata"].get("synth_batch"):
            rec["metadata"]["synth_batch"] = synth_ids[0]
        merged[rec["task_id"]] = rec
    batches = list(dict.fromkeys([*env.synth_batches, *synth_ids]))
    others = [c for c in causation if not c.startswith("synth:")]
    entity, _new, _vh = _write_version(
        cfg, store, artifacts, name, list(merged.values()), env.suites, batches, correlation_id, others
    )
    return entity
