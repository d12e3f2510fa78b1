"""Versioned suites and environments: ``suite:<name>@N`` and ``env:<name>@N``.

A version is a content-addressed JSON artifact (its members, sorted by task id) announced by one
event on the stream ``suite:<name>`` / ``env:<name>`` (``suite.versioned`` / ``env.versioned``) whose
payload names the artifact, the version number and a ``version_hash`` of the content. The evals
stage versions suites, the envs stage and synth version environments, and every stage that reads
them (rollouts, SFT, the gate, the evaluator) loads them from here.

Guarantees
- A version is appended only when its ``version_hash`` differs from the latest version's: rebuilding
  from the same inputs appends nothing.
- Appends use ``expected_version`` (optimistic concurrency): two concurrent builds cannot both write
  version N (the second gets :class:`flywheel.store.ConcurrencyError` and nothing half-written).
- Loading verifies the artifact's hash (:class:`flywheel.artifacts.ArtifactCorruptError` when it
  was tampered with).

The two version hashes are recorded in users' event stores and are frozen: a suite hashes
``{"name", "members"}``, an environment ``{"name", "harness", "verifier_config", "tasks"}`` (each in
canonical JSON, members sorted by task id).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.store import Event, EventStore, NewEvent
from flywheel.tasks import TaskError, validate_task
from flywheel.vocab.ids import canonical_json, digest
from flywheel.vocab.refs import parse_versioned_ref, versioned_entity

__all__ = [
    "Env",
    "Suite",
    "add_tasks_to_env",
    "env_harness",
    "env_verifier_config",
    "env_version_hash",
    "latest_versions",
    "load_env",
    "load_suite",
    "suite_version_hash",
    "version_env",
    "version_suite",
    "versioned_event",
]


@dataclass
class Suite:
    """One loaded suite version."""

    entity_id: str
    name: str
    version: int
    version_hash: str
    tasks: list[dict]
    artifact: dict = field(default_factory=dict)

    @property
    def task_ids(self) -> list[str]:
        return [t["task_id"] for t in self.tasks]


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


def _by_task_id(tasks: list[dict]) -> list[dict]:
    return sorted(tasks, key=lambda t: t["task_id"])


def suite_version_hash(name: str, members: list[dict]) -> str:
    return digest(canonical_json({"name": name, "members": _by_task_id(members)}))


def env_version_hash(name: str, tasks: list[dict], harness: dict, verifier_config: dict) -> str:
    return digest(canonical_json({"name": name, "harness": harness, "verifier_config": verifier_config,
                                  "tasks": _by_task_id(tasks)}))


def versioned_event(store: EventStore, kind: str, type_: str, ref: str) -> Event | None:
    """The ``<kind>.versioned`` event for ``name`` (latest) or ``name@N``; ``None`` if absent."""
    name, version = parse_versioned_ref(ref, kind)
    events = store.read(stream=f"{kind}:{name}", types=type_)
    if not events:
        return None
    if version is None:
        return events[-1]
    return next((e for e in events if e.payload.get("version") == version), None)


def load_suite(store: EventStore, artifacts: ArtifactStore, ref: str) -> Suite:
    """Load ``"heldout"`` (latest version), ``"heldout@3"`` or ``"suite:heldout@3"``.

    Raises ``LookupError`` naming the suite when it has no such version, ``ValueError`` for a
    malformed reference."""
    ev = versioned_event(store, "suite", "suite.versioned", ref)
    if ev is None:
        raise LookupError(f"suite {ref!r} has no such version; run `flywheel evals build` first")
    p = ev.payload
    body = artifacts.read_json(p["artifact"]["sha256"])
    return Suite(p["entity_id"], p["name"], int(p["version"]), p["version_hash"], body["members"], p["artifact"])


def load_env(store: EventStore, artifacts: ArtifactStore, ref: str) -> Env:
    """Load ``"train"`` (latest version), ``"train@3"`` or ``"env:train@3"``.

    Raises ``LookupError`` naming the env when it has no such version; the artifact is verified.
    """
    ev = versioned_event(store, "env", "env.versioned", ref)
    if ev is None:
        raise LookupError(f"environment {ref!r} has no such version; run `flywheel envs build` first")
    return _env_from_payload(ev.payload, artifacts)


def _env_from_payload(p: dict, artifacts: ArtifactStore) -> Env:
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


def latest_versions(store: EventStore, kind: str) -> list[dict]:
    """The latest version payload of every ``suite`` or ``env`` name, sorted by name."""
    latest: dict[str, dict] = {}
    for ent in store.entities(kind):
        st = ent["state"]
        if st.get("name") and st.get("version", 0) >= latest.get(st["name"], {}).get("version", 0):
            latest[st["name"]] = st
    return [latest[k] for k in sorted(latest)]


def _append_version(store: EventStore, artifacts: ArtifactStore, kind: str, name: str, version_hash: str,
                    body: dict[str, Any], payload: dict[str, Any], causation: list[str],
                    correlation_id: str | None) -> tuple[str, bool]:
    """Append ``<kind>:<name>@N+1`` holding ``body`` unless the latest version has ``version_hash``.
    Returns ``(entity id, appended?)``."""
    stream = f"{kind}:{name}"
    latest = store.read(stream=stream, types=f"{kind}.versioned")
    if latest and latest[-1].payload.get("version_hash") == version_hash:
        return latest[-1].payload["entity_id"], False
    current = store.stream_version(stream)
    version = latest[-1].payload["version"] + 1 if latest else 1
    ref = artifacts.put_json({"kind": kind, "name": name, "version_hash": version_hash, **body})
    entity = versioned_entity(kind, name, version)
    store.append(
        stream,
        NewEvent(f"{kind}.versioned", {"entity_id": entity, "name": name, "version": version,
                                        "artifact": ref.to_dict(), **payload, "version_hash": version_hash},
                 causation),
        expected_version=current,
        correlation_id=correlation_id,
    )
    return entity, True


def version_suite(store: EventStore, artifacts: ArtifactStore, name: str, members: list[dict],
                  correlation_id: str | None = None) -> tuple[str, bool]:
    """Version suite ``name`` with ``members`` (task records); causation = the member ids."""
    members = _by_task_id(members)
    vh = suite_version_hash(name, members)
    return _append_version(store, artifacts, "suite", name, vh, {"members": members}, {"members": len(members)},
                           [t["task_id"] for t in members], correlation_id)


def env_harness(cfg: FlywheelConfig) -> dict:
    """The harness settings an environment version records (and hashes)."""
    return {"max_turns": int(cfg.rollout.max_turns)}


def env_verifier_config(cfg: FlywheelConfig) -> dict:
    """The verifier settings an environment version records (and hashes)."""
    return {
        "sandbox": cfg.sandbox.model_dump(mode="json"),
        "judge_model": cfg.judge.model,
        "judge_configured": bool(cfg.judge.base_url),
    }


def version_env(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, name: str, tasks: list[dict],
                suites: list[str], synth_batches: list[str], correlation_id: str | None = None,
                extra_causation: list[str] = ()) -> tuple[str, bool, str]:
    """Version environment ``name`` with ``tasks``; causation = its suites, synth batches and
    ``extra_causation``. Returns ``(entity id, appended?, version hash)``."""
    harness, vcfg = env_harness(cfg), env_verifier_config(cfg)
    tasks = _by_task_id(tasks)
    vh = env_version_hash(name, tasks, harness, vcfg)
    body = {"harness": harness, "verifier_config": vcfg, "suites": suites, "synth_batches": synth_batches,
            "tasks": tasks}
    payload = {"tasks": len(tasks), "suites": suites, "synth_batches": synth_batches, "harness": harness,
               "harness_kinds": dict(Counter(t["harness"] for t in tasks))}
    entity, new = _append_version(store, artifacts, "env", name, vh, body, payload,
                                  list(dict.fromkeys([*suites, *synth_batches, *extra_causation])), correlation_id)
    return entity, new, vh


def add_tasks_to_env(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, name: str, tasks: list[dict],
                     causation: list[str], *, correlation_id: str | None = None) -> str:
    """Add (or replace, by ``task_id``) ``tasks`` in the latest version of env ``name``.

    For the synth stage: each task must satisfy the task-record contract
    (:func:`flywheel.tasks.validate_task`); its ``metadata.synth_batch`` is set to the ``synth:``
    id in ``causation`` when missing, so rebuilds carry it. Returns the resulting version's entity id
    (the latest one, unchanged, when the tasks were already there). Raises ``LookupError`` when the
    env has no version yet, :class:`flywheel.tasks.TaskError` on a bad record.
    """
    name, _ = parse_versioned_ref(name, "env")
    ev = versioned_event(store, "env", "env.versioned", name)
    if ev is None:
        raise LookupError(f"environment {name!r} has no version yet; run `flywheel envs build` before adding tasks")
    env = _env_from_payload(ev.payload, artifacts)
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
    entity, _new, _vh = version_env(cfg, store, artifacts, name, list(merged.values()), env.suites, batches,
                                    correlation_id, others)
    return entity
