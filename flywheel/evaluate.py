"""Evaluate a model version on a suite version, with results cached per (model, suite, decoding).

What an evaluation is
- Every task of one suite version, through the same env harness and verifier the training side
  uses (:func:`flywheel.envs.harness.run_episodes`), with the decoding fixed by ``[gate]``:
  greedy pass@1 by default (``temperature 0``, ``max_new_tokens``, ``seed``); pass@k when
  ``pass_k > 1`` (``k`` samples at ``pass_k_temperature``, an item passes when any sample passes).
  Champion and challenger therefore see identical prompts, seeds and decoding.
- One item row per task (Parquet artifact, :data:`ITEM_SCHEMA`) and one ``eval.completed`` event
  on ``evaluation:<model>@<suite name>@<suite version>#<decoding hash>`` with causation to the model
  version and the suite version.

Caching: before running anything, :func:`evaluate_model` looks for that event; when it exists and
its artifact verifies, the recorded items are returned (``cached=True``) and no model is loaded, so
the nightly gate evaluates the champion once per suite version. Registered model versions are
immutable in MLflow, which is what makes the cache key sound. Not cached across decoding changes
(the hash covers every decoding knob) or harness code changes (not covered: bump the suite version
or delete the event's artifact to force a re-run).

Item reuse across suite versions: a held-out suite grows version by version (new items join, none
leave or change), and the same model is evaluated on each version (the challenger of one night is
the champion of the next). An item whose *task record* (hash in ``task_hash``) was already evaluated
for the same model and decoding on an earlier version is taken from that evaluation instead of being
generated again (``reused_items`` in the event); items with an infrastructure error are run again.
This assumes an item's result depends only on (model, task record, decoding): true for greedy
decoding up to floating-point differences between batch compositions, which can flip a borderline
token (rare; not covered).

Infrastructure errors: an item with ``Verdict.infra_error`` on any of its samples is recorded with
that error and excluded from pass rates here and from both sides of the gate's comparison.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from flywheel.artifacts import ArtifactError, ArtifactStore
from flywheel.config import FlywheelConfig, GateConfig
from flywheel.envs.harness import Episode, HarnessContext, run_episodes
from flywheel.policy.base import Policy, SamplingParams
from flywheel.policy.hf import HFPolicy
from flywheel.policy.registry import ModelRefError, load_policy_for_version
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import Tracker
from flywheel.versioning import Suite, load_suite
from flywheel.vocab.ids import SHORT_HEX, canonical_json, digest, short_id
from flywheel.vocab.records import EvalItemRow, TaskRecord
from flywheel.vocab.refs import model_entity, parse_versioned_ref

ITEM_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("passed", pa.bool_()),  # pass@k (k = n_samples); pass@1 under the default greedy decoding
        ("n_samples", pa.int32()),
        ("n_passed", pa.int32()),
        ("reward", pa.float64()),  # mean verifier reward over the samples
        ("infra_error", pa.string()),  # first infrastructure error, null when none
        ("deterministic", pa.bool_()),
        ("failure_kinds", pa.list_(pa.string())),
        ("tools", pa.list_(pa.string())),
        ("source", pa.string()),
        ("cluster", pa.string()),
        ("origin_failure", pa.string()),
        ("split", pa.string()),
        ("completion", pa.string()),  # first sample's final answer text (truncated), for reports
        ("task_hash", pa.string()),  # sha256 of the canonical task record: the key of item reuse
        # samples whose answer stopped at decoding.max_new_tokens (finish reason "length"): cut off, not
        # finished; null in evaluations recorded before it was counted
        ("n_truncated", pa.int32()),
    ]
)
_COMPLETION_CHARS = 2000


class EvaluationError(RuntimeError):
    """An evaluation could not run (unknown model, unreadable suite, harness missing)."""


# --------------------------------------------------------------------------------------------
# model references


@dataclass(frozen=True)
class ModelRef:
    """What is evaluated: a registered MLflow version, or a base model spec (the implicit champion
    before the first promotion).

    Not the same thing as the other two model types: :class:`flywheel.vocab.refs.ModelRefSpec` is a
    reference as typed, parsed (it may still be an alias), and
    :class:`flywheel.policy.registry.ResolvedModel` is what one resolves to (a URL included). A base
    model's ``name`` is ``"base"`` here: it is recorded (``model_name`` of ``eval.completed``) and
    :attr:`key` is part of every evaluation id, so this type stays as it is."""

    name: str
    version: int | None = None
    spec: str | None = None

    @classmethod
    def registered(cls, name: str, version: int) -> ModelRef:
        return cls(name=name, version=int(version))

    @classmethod
    def base(cls, spec: str) -> ModelRef:
        return cls(name="base", spec=str(spec))

    @property
    def is_base(self) -> bool:
        return self.version is None

    @property
    def key(self) -> str:
        """``policy/3`` or ``base/<spec tail>-<hash8>`` (a path spec is hashed, not embedded)."""
        if self.version is not None:
            return f"{self.name}/{self.version}"
        tail = Path(self.spec or "").name or "model"
        return f"base/{tail}-{short_id(self.spec or '', SHORT_HEX)}"

    @property
    def entity_id(self) -> str | None:
        return model_entity(self.name, self.version) if self.version is not None else None

    def __str__(self) -> str:
        return self.entity_id or f"base:{self.spec}"


# Returns a Policy; typed Any because loaders are also handed on as plain callables (the gate's
# shares one loaded model between suites and declares it ``object``).
PolicyLoader = Callable[[ModelRef], Any]


def default_policy_loader(cfg: FlywheelConfig, tracker: Tracker) -> PolicyLoader:
    """Load a :class:`ModelRef` with the HF backend (registered versions through
    :func:`flywheel.policy.registry.load_policy_for_version`)."""

    def load(ref: ModelRef) -> Policy:
        if ref.is_base:
            return HFPolicy.from_config(cfg.policy, ref.spec, cfg.home, name="base", version="base")
        try:
            return load_policy_for_version(cfg, tracker, ref.name, int(ref.version))
        except ModelRefError as e:
            raise EvaluationError(str(e)) from None

    return load


# --------------------------------------------------------------------------------------------
# suites


def parse_suite_spec(spec: str) -> tuple[str, int | None]:
    """``heldout`` -> (heldout, None); ``heldout@3`` or ``suite:heldout@3`` -> (heldout, 3):
    :func:`flywheel.vocab.refs.parse_versioned_ref`, its ``ValueError`` (empty name, a name with ``@``,
    a version that is not an integer >= 1) raised as :class:`EvaluationError`."""
    try:
        return parse_versioned_ref(spec, "suite")
    except ValueError as e:
        raise EvaluationError(str(e)) from None


def resolve_suite(store: EventStore, artifacts: ArtifactStore, suite: Suite | str) -> Suite:
    """A suite object (``entity_id``, ``name``, ``version``, ``tasks``) from an object or a spec string."""
    if not isinstance(suite, str):
        return suite
    parse_suite_spec(suite)  # validates the spec before touching the store
    try:
        return load_suite(store, artifacts, suite)
    except (LookupError, ValueError) as e:
        raise EvaluationError(f"suite {suite!r} cannot be loaded: {e}") from None


# --------------------------------------------------------------------------------------------
# results


@dataclass
class EvalResult:
    """Item-level results of one model on one suite version."""

    evaluation_id: str
    model: ModelRef
    suite: str
    decoding: dict[str, Any]
    items: pa.Table
    artifact: dict[str, Any]
    cached: bool = False
    wall_s: float = 0.0

    def rows(self) -> list[EvalItemRow]:
        return self.items.to_pylist()

    def by_task(self) -> dict[str, EvalItemRow]:
        return {r["task_id"]: r for r in self.rows()}

    @property
    def n_items(self) -> int:
        return self.items.num_rows

    def scorable(self, include_nondeterministic: bool = False) -> list[EvalItemRow]:
        return [r for r in self.rows() if r["infra_error"] is None and (include_nondeterministic or r["deterministic"])]

    @property
    def pass_rate(self) -> float:
        s = self.scorable()
        return sum(r["passed"] for r in s) / len(s) if s else float("nan")

    def summary(self) -> dict[str, Any]:
        rows = self.rows()
        s = self.scorable()
        return {
            "evaluation_id": self.evaluation_id,
            "model": str(self.model),
            "suite": self.suite,
            "items": len(rows),
            "scorable": len(s),
            "passed": sum(r["passed"] for r in s),
            "pass_rate": (sum(r["passed"] for r in s) / len(s)) if s else None,
            "infra_errors": sum(r["infra_error"] is not None for r in rows),
            "nondeterministic": sum((not r["deterministic"]) for r in rows),
            # items with an answer cut at max_new_tokens: a cut-off call rarely parses, so a high count says
            # the decoding budget may have decided those items (or that the model rambles)
            "truncated": sum(bool(r.get("n_truncated")) for r in rows),
            "cached": self.cached,
        }


def decoding_for(gate_cfg: GateConfig) -> dict[str, Any]:
    """The decoding every gate evaluation uses (part of the cache key)."""
    k = int(getattr(gate_cfg, "pass_k", 1))
    return {
        "k": k,
        "temperature": 0.0 if k == 1 else float(getattr(gate_cfg, "pass_k_temperature", 0.8)),
        "top_p": 1.0,
        "max_new_tokens": int(gate_cfg.max_new_tokens),
        "seed": int(gate_cfg.seed),
    }


def evaluation_id_for(model: ModelRef, suite_id: str, decoding: Mapping[str, Any]) -> str:
    h = short_id(json.dumps(dict(decoding), sort_keys=True), SHORT_HEX)  # default separators: frozen
    return f"evaluation:{model.key}@{suite_id.removeprefix('suite:')}#{h}"


def _get(task: object, key: str, default: object = None) -> Any:
    if isinstance(task, Mapping):
        return task.get(key, default)
    return getattr(task, key, default)


def _episode_text(ep: object) -> str | None:
    for attr in ("completion_text", "completion", "text"):
        v = getattr(ep, attr, None)
        if isinstance(v, str):
            return v[:_COMPLETION_CHARS]
    samples = getattr(ep, "samples", None)
    if samples:
        v = getattr(samples[-1], "text", None)
        if isinstance(v, str):
            return v[:_COMPLETION_CHARS]
    return None


def item_row(task: TaskRecord, episodes: Sequence[Episode]) -> EvalItemRow:
    """One :data:`ITEM_SCHEMA` row from a task and its episodes (one per sample)."""
    md = _get(task, "metadata", {}) or {}
    verdicts = [ep.verdict for ep in episodes]
    infra = next((str(v.infra_error) for v in verdicts if getattr(v, "infra_error", None)), None)
    n_passed = sum(bool(v.passed) for v in verdicts if not getattr(v, "infra_error", None))
    deterministic = all(getattr(v, "deterministic", True) for v in verdicts) and md.get("deterministic", True) is not False
    rewards = [float(v.reward) for v in verdicts]

    def strs(v: str | Iterable[object] | None) -> list[str]:
        return [str(x) for x in (v or [])] if not isinstance(v, str) else [v]

    def opt(v: object) -> str | None:
        return None if v is None else str(v)

    return {
        "task_id": str(_get(task, "task_id")),
        "passed": infra is None and n_passed > 0,
        "n_samples": len(verdicts),
        "n_passed": n_passed,
        "reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "infra_error": infra,
        "deterministic": bool(deterministic),
        "failure_kinds": strs(md.get("failure_kinds")),
        "tools": strs(md.get("tools")),
        "source": opt(md.get("source")),
        "cluster": opt(md.get("cluster")),
        "origin_failure": opt(md.get("origin_failure")),
        "split": opt(md.get("split")),
        "completion": _episode_text(episodes[0]) if episodes else None,
        "task_hash": task_hash(task),
        "n_truncated": sum(bool(getattr(ep, "truncated", False)) for ep in episodes),
    }


def task_hash(task: TaskRecord) -> str:
    """SHA-256 of the canonical JSON of a task record (what decides an item's result with the model)."""

    body = dict(task) if isinstance(task, Mapping) else {k: _get(task, k) for k in ("task_id", "prompt", "verifier",
                                                                                   "harness", "tool_env", "reference")}
    return digest(canonical_json(body))


def _reusable_rows(store: EventStore, artifacts: ArtifactStore, ref: ModelRef, decoding: Mapping[str, Any]) -> tuple[dict[tuple[str, str], dict[str, Any]], list[str]]:
    """Item rows of earlier evaluations of ``ref`` with ``decoding``, keyed by (task id, task hash)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    sources: list[str] = []
    for ev in store.read(types="eval.completed"):
        p = ev.payload
        if p.get("model") != str(ref) or p.get("decoding") != dict(decoding):
            continue
        try:
            table = artifacts.read_table(p["items"]["sha256"])
        except ArtifactError:
            continue  # a missing or corrupt artifact is simply not reused
        if "task_hash" not in table.column_names:
            continue  # recorded before item reuse existed
        sources.append(p["entity_id"])
        for r in table.to_pylist():
            if r["infra_error"] is None and r.get("task_hash"):
                rows.setdefault((r["task_id"], r["task_hash"]), r)
    return rows, sources


def _cached(store: EventStore, artifacts: ArtifactStore, evaluation_id: str) -> tuple[dict[str, Any], pa.Table] | None:
    events = store.read(stream=evaluation_id, types="eval.completed")
    if not events:
        return None
    payload = events[-1].payload
    try:
        table = artifacts.read_table(payload["items"]["sha256"])
    except ArtifactError:
        return None  # missing or corrupt: evaluate again (the new event references a fresh artifact)
    return payload, table


def evaluate_model(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    model_version: int | ModelRef,
    suite: Suite | str,
    *,
    policy: Policy | None = None,
    policy_loader: PolicyLoader | None = None,
    correlation_id: str | None = None,
    context: HarnessContext = None,
) -> EvalResult:
    """Evaluate ``model_version`` (of ``[cycle] model_name``, or a :class:`ModelRef`) on ``suite``.

    ``suite``: a suite object from :func:`flywheel.versioning.load_suite` or a spec (``heldout@3``).
    ``policy`` (already loaded) or ``policy_loader`` override how the model is loaded; by default
    :func:`flywheel.policy.registry.load_policy_for_version`. Returns the cached result when one exists (see module doc).
    """
    ref = model_version if isinstance(model_version, ModelRef) else ModelRef.registered(cfg.cycle.model_name, int(model_version))
    suite_obj = resolve_suite(store, artifacts, suite)
    suite_id = str(suite_obj.entity_id)
    decoding = decoding_for(cfg.gate)
    evaluation_id = evaluation_id_for(ref, suite_id, decoding)
    hit = _cached(store, artifacts, evaluation_id)
    if hit is not None:
        payload, table = hit
        return EvalResult(evaluation_id, ref, suite_id, decoding, table, payload["items"], cached=True,
                          wall_s=float(payload.get("wall_s", 0.0)))

    tasks = list(suite_obj.tasks)
    hashes = [task_hash(t) for t in tasks]
    prior, prior_sources = _reusable_rows(store, artifacts, ref, decoding)
    todo = [i for i, (t, h) in enumerate(zip(tasks, hashes, strict=True)) if (str(_get(t, "task_id")), h) not in prior]
    if policy is None and todo:
        loader = policy_loader or default_policy_loader(cfg, tracker)
        policy = loader(ref)
    params = SamplingParams(
        n=decoding["k"], temperature=decoding["temperature"], top_p=decoding["top_p"],
        max_new_tokens=decoding["max_new_tokens"], seed=decoding["seed"],
    )
    t0 = time.perf_counter()
    # The harness takes sandbox limits, judge endpoint and max_turns from the config by default.
    run = [tasks[i] for i in todo]
    # policy is not None here: run is non-empty only when todo is, and then it was loaded above
    episodes = run_episodes(run, policy, params,  # type: ignore[arg-type]
                            context=context if context is not None else cfg) if run else []
    wall = time.perf_counter() - t0
    if len(episodes) != len(run):
        raise EvaluationError(f"harness returned {len(episodes)} episode groups for {len(run)} tasks of {suite_id}")
    fresh = {i: item_row(tasks[i], eps) for i, eps in zip(todo, episodes, strict=True)}
    rows = [fresh[i] if i in fresh else prior[(str(_get(t, "task_id")), hashes[i])] for i, t in enumerate(tasks)]
    table = pa.Table.from_pylist(rows, schema=ITEM_SCHEMA)
    ref_art = artifacts.put_table(table)
    result = EvalResult(evaluation_id, ref, suite_id, decoding, table, ref_art.to_dict(), cached=False, wall_s=wall)
    s = result.summary()
    payload = {
        "entity_id": evaluation_id,
        "model": str(ref),
        "model_name": ref.name,
        "model_version": ref.version,
        "base_spec": ref.spec,
        "suite": suite_id,
        "suite_name": str(getattr(suite_obj, "name", "")),
        "suite_version": getattr(suite_obj, "version", None),
        "decoding": decoding,
        "items": ref_art.to_dict(),
        "n_items": s["items"],
        "n_scorable": s["scorable"],
        "n_passed": s["passed"],
        "pass_rate": s["pass_rate"],
        "infra_errors": s["infra_errors"],
        "nondeterministic": s["nondeterministic"],
        "truncated": s["truncated"],
        "wall_s": round(wall, 3),
        "reused_items": len(tasks) - len(todo),
        "reused_from": prior_sources[:20] if len(todo) < len(tasks) else [],
    }
    served_by = {str(_get(tasks[i], "task_id")): eps[0].endpoint for i, eps in zip(todo, episodes, strict=True)
                 if eps and getattr(eps[0], "endpoint", None)}
    if served_by:  # several inference servers: which one answered each item (not part of the items' hash)
        payload["served_by"] = served_by
    causation = [c for c in (ref.entity_id, suite_id) if c]
    store.append(evaluation_id, NewEvent("eval.completed", payload, causation), correlation_id=correlation_id)
    return result
