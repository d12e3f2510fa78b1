"""Versioned RL environments: ``env:<name>@N`` = task set + harness config + verifier config.
This module builds them from suites; :mod:`flywheel.versioning` records and loads versions.

An environment is what the rollout stage samples from. Version N of ``env:train`` holds the tasks of
the latest ``suite:train`` version (plus tasks synth added with
:func:`flywheel.versioning.add_tasks_to_env`), the
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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.store import EventStore
from flywheel.versioning import latest_versions, load_env, load_suite, version_env

__all__ = ["DEFAULT_ENV_SUITES", "EnvsSummary", "build_envs", "list_envs"]

#: Which suites feed which environment by default. The held-out and regression suites are never
#: turned into training environments: the gate reads them as suites.
DEFAULT_ENV_SUITES = {"train": ("train",)}


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


def list_envs(store: EventStore) -> list[dict]:
    """Latest version payload of every environment, by name."""
    return latest_versions(store, "env")


def _synth_carry(store: EventStore, artifacts: ArtifactStore, name: str) -> tuple[list[dict], list[str]]:
    try:
        env = load_env(store, artifacts, name)
    except LookupError:
        return [], []
    tasks = [t for t in env.tasks if (t.get("metadata") or {}).get("synth_batch")]
    return tasks, list(env.synth_batches)


def build_envs(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
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
        entity, new, vh = version_env(cfg, store, artifacts, name, list(tasks.values()), suites, batches, correlation_id)
        summary.events_appended += int(new)
        summary.envs.append(
            {"env": entity, "tasks": len(tasks), "synth_tasks": len(carried), "suites": suites, "new_version": new,
             "version_hash": vh}
        )
    return summary
