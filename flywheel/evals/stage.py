"""The evals stage: compile every failure and successful trace into evals, deal their split, version
the suites (:func:`build_evals`). The compiler itself is :mod:`flywheel.evals.compiler`.

Events and guarantees
---------------------
- ``eval.created`` on ``eval:<id>`` where ``id = sha256(origin)[:16]`` (origin = the failure or
  trace entity id): payload = the task record + ``entity_id``, ``split``, ``cluster``,
  ``origin_failure``, ``failure_kinds``, ``tools``, ``verifier_kind``, ``compiler_version``;
  causation = the failure (or the successful trace).
- A failure's split is dealt once and reused from its recorded event forever; recompiling a failure
  whose payload changed (say a correction arrived) appends a new ``eval.created`` on the same stream
  with the same split and cluster.
- ``suite.versioned`` on ``suite:<name>``: payload ``{entity_id: "suite:<name>@N", name, version,
  artifact, members, version_hash}``, causation = member eval ids. The artifact is JSON
  ``{"kind": "suite", "name", "version_hash", "members": [task records sorted by task_id]}``.
- Rebuilding from the same inputs appends nothing: unchanged evals are skipped, and a suite whose
  ``version_hash`` (sha256 of its canonical member records) equals its latest version's is not
  versioned again. Appends use ``expected_version`` (optimistic concurrency): a concurrent build
  gets :class:`flywheel.store.ConcurrencyError` and nothing half-written.
- The held-out suite excludes non-deterministic evals unless ``evals.include_llm_judge_in_gate``;
  the regression suite likewise.

Not guaranteed: that a correction supplied by a person is itself right (it is trusted); that a
weak (validity-only) eval distinguishes a wrong value from a right one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore, load_traces
from flywheel.config import EvalsConfig, FlywheelConfig, SynthConfig
from flywheel.contamination import contaminated_by_synthetic
from flywheel.evals.compiler import COMPILER_VERSION, CompileSkip, compile_failure, compile_success
from flywheel.split import REQUEST_TEXT_VERSION, SplitIndex, request_key
from flywheel.store import BATCH_SCHEMA, ConcurrencyError, EventStore
from flywheel.tasks import task_from_state
from flywheel.versioning import version_suite, versioned_event
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.kinds import SUITES
from flywheel.vocab.refs import with_prefix

__all__ = ["ConcurrencyError", "EvalsSummary", "build_evals"]


@dataclass
class EvalsSummary:
    """What one ``build_evals`` did. ``created``/``updated`` count evals by verifier kind."""

    created: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    unchanged: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    suites: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    excluded_from_gate: int = 0
    events_appended: int = 0
    empty_suites: list[str] = field(default_factory=list)
    created_by_failure_kind: dict[str, int] = field(default_factory=dict)
    heldout: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    excluded_contaminated: int = 0
    # evals (created or updated) that call a tool whose schema the trace did not record
    evals_with_tools_without_schema: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "created": dict(self.created),
            "created_by_failure_kind": dict(self.created_by_failure_kind),
            "updated": dict(self.updated),
            "unchanged": self.unchanged,
            "splits": dict(self.splits),
            "suites": list(self.suites),
            "skipped": list(self.skipped),
            "skipped_by_reason": dict(Counter(s["reason_kind"] for s in self.skipped)),
            "excluded_from_gate": self.excluded_from_gate,
            "empty_suites": list(self.empty_suites),
            "events_appended": self.events_appended,
            "heldout": dict(self.heldout),
            "warnings": list(self.warnings),
            "excluded_contaminated": self.excluded_contaminated,
            "evals_with_tools_without_schema": self.evals_with_tools_without_schema,
        }


def _successful_traces(store: EventStore) -> list[tuple[str, dict]]:
    """Successful ``trace:`` entities, filtered in SQL so failures' payloads are never parsed."""
    return store.trace_states("success")


def _full_traces(artifacts: ArtifactStore, states: list[dict]) -> list[dict]:
    """The full trace records behind ``trace.ingested`` states.

    Ingest keeps the redacted trace in a per-batch Parquet artifact and only a reference
    ``trace: {sha256, row}`` in the event (see :mod:`flywheel.ingest.pipeline`); states that carry
    the messages themselves (older payloads, test fixtures) are used as they are.
    """
    refs = [i for i, st in enumerate(states) if isinstance(st.get("trace"), dict) and "sha256" in st["trace"]]
    out = list(states)
    if refs:
        for i, full in zip(refs, load_traces(artifacts, [states[i] for i in refs]), strict=True):
            out[i] = {**full, "source": full.get("source") or states[i].get("source")}
    return out


def _trace_entity(store: EventStore, artifacts: ArtifactStore, trace_id: str) -> dict | None:
    ent = store.entity(with_prefix("trace", trace_id))
    if ent is None:
        return None
    return _full_traces(artifacts, [ent["state"]])[0]


def _reason_kind(reason: str) -> str:
    return reason.split(": ", 1)[1] if ": " in reason else reason


# What passes between the steps of build_evals.


@dataclass(frozen=True)
class _EvalEvent:
    """One ``eval.created`` to append: on the eval's stream, caused by its origin (the failure or the
    successful trace), expecting the stream at ``expected_version`` (0: a new eval)."""

    stream: str
    payload: dict
    causation: list[str]
    expected_version: int


@dataclass
class _Staging:
    """What one build has staged so far; the steps fill it in, in order.

    ``states``: eval id -> state, the recorded states with what this build staged in their place (the
    very payload dicts of ``events``: a later change to a state, an exclusion, is a change to its
    event); ``placed_now``: task id -> origin, for items placed (not reloaded) in this build."""

    states: dict[str, dict]
    summary: EvalsSummary
    events: list[_EvalEvent] = field(default_factory=list)
    placed_now: dict[str, str] = field(default_factory=dict)


# The steps of build_evals, in order.


def _split_index(ecfg: EvalsConfig, states: dict[str, dict]) -> SplitIndex:
    """The split index, holding every recorded placement."""
    index = SplitIndex(heldout_fraction=ecfg.heldout_fraction, seed=ecfg.split_seed, jaccard=ecfg.cluster_jaccard)
    # Recorded placements first, in the order they were made, so new requests see all of them.
    # Successes recorded on the train side ("regression": their answers become demonstrations) sit
    # on the train side of the index, so a near-copy failure can never be dealt to held-out.
    for eid, st in states.items():
        split = st.get("split")
        if split in ("train", "heldout", "excluded", "regression"):
            prompt = st.get("prompt") or {}
            md = st.get("metadata") or {}
            key = st.get("origin_failure") or md.get("origin_trace") or eid
            text, tools = request_key(prompt.get("messages") or [], prompt.get("tools") or [])
            index.add_existing(key, text, st["cluster"], "train" if split == "regression" else split, tools)
    return index


def _stage(store: EventStore, staging: _Staging, task: dict, origin: str, split: str, cluster: str,
           kinds: list[str]) -> None:
    """Stage the eval ``task`` (placed in ``split``/``cluster``) unless its recorded state is the same."""
    summary, states = staging.summary, staging.states
    tid = task["task_id"]
    task["metadata"]["split"] = split
    task["metadata"]["cluster"] = cluster
    payload = {
        "entity_id": tid,
        **task,
        "split": split,
        "cluster": cluster,
        "origin_failure": task["metadata"].get("origin_failure"),
        "failure_kinds": kinds,
        "tools": task["metadata"]["tools"],
        "verifier_kind": task["metadata"]["verifier_kind"],
        "compiler_version": COMPILER_VERSION,
        "request_text_version": REQUEST_TEXT_VERSION,
    }
    old = states.get(tid)
    vk = task["metadata"]["verifier_kind"]
    # A new compiler version alone changes nothing: an eval it compiles exactly as before keeps its recorded
    # event (and the version that compiled it); only a record that really changed is appended, with the new one.
    if old is not None and canonical_json({**old, "compiler_version": None}) == canonical_json(
            {**payload, "compiler_version": None}):
        summary.unchanged += 1
    else:
        bucket = summary.updated if old is not None else summary.created
        bucket[vk] = bucket.get(vk, 0) + 1
        if "none" in (task["metadata"].get("tool_schema_sources") or {}).values():
            summary.evals_with_tools_without_schema += 1
        if old is None:
            for k in kinds or ["success"]:
                summary.created_by_failure_kind[k] = summary.created_by_failure_kind.get(k, 0) + 1
        staging.events.append(_EvalEvent(tid, payload, [origin], store.stream_version(tid) if old is not None else 0))
    states[tid] = payload


def _skip(summary: EvalsSummary, origin: str, e: CompileSkip) -> None:
    summary.skipped.append({"origin": origin, "reason": str(e), "reason_kind": _reason_kind(str(e))})


def _stage_failures(store: EventStore, artifacts: ArtifactStore, index: SplitIndex, staging: _Staging) -> None:
    """Failures -> train / heldout / excluded."""
    failures = store.entities("failure")
    for f in failures:
        fid, st = f["entity_id"], dict(f["state"])
        st.setdefault("entity_id", fid)
        trace_state = None
        if "runtime_exception" in (st.get("kinds") or []) and st.get("trace_ids"):
            trace_state = _trace_entity(store, artifacts, str(st["trace_ids"][0]))
        try:
            task = compile_failure(st, trace_state=trace_state)
        except CompileSkip as e:
            _skip(staging.summary, fid, e)
            continue
        prev = staging.states.get(task["task_id"])
        if prev is not None and prev.get("split") in ("train", "heldout", "excluded"):
            split, cluster = prev["split"], prev["cluster"]  # recorded: never moves
        else:
            p = index.assign(fid, *request_key(task["prompt"]["messages"], task["prompt"]["tools"]))
            split, cluster = p.split, p.cluster
            staging.placed_now[task["task_id"]] = fid
        _stage(store, staging, task, fid, split, cluster, task["metadata"]["failure_kinds"])


def _stage_successes(store: EventStore, artifacts: ArtifactStore, index: SplitIndex, staging: _Staging) -> None:
    """Successful traces -> regression (the train side) / heldout / excluded."""
    seen_regression: set[str] = set()
    successes = _successful_traces(store)
    full = _full_traces(artifacts, [st for _, st in successes])
    for (tid_trace, _), st in zip(successes, full, strict=True):
        try:
            task = compile_success(tid_trace, st)
        except CompileSkip as e:
            _skip(staging.summary, tid_trace, e)
            continue
        # Many production successes repeat the same request and answer: one eval each.
        key = canonical_json([task["metadata"]["request_hash"], task["verifier"], task["reference"]])
        if key in seen_regression:
            continue
        seen_regression.add(key)
        prev = staging.states.get(task["task_id"])
        if prev is not None and prev.get("split") in ("regression", "heldout", "excluded"):
            split, cluster = prev["split"], prev["cluster"]  # recorded: never moves
        else:
            # Dealt by cluster like the failures: held-out successes measure the keep rate; train-side
            # successes form the regression suite (and SFT demonstrations).
            p = index.assign(tid_trace, *request_key(task["prompt"]["messages"], task["prompt"]["tools"]))
            split, cluster = ("regression" if p.split == "train" else p.split), p.cluster
            staging.placed_now[task["task_id"]] = tid_trace
        _stage(store, staging, task, tid_trace, split, cluster, [])


def _exclude_synthetic_copies(store: EventStore, artifacts: ArtifactStore, scfg: SynthConfig, staging: _Staging) -> None:
    """A new held-out item that a recorded synthetic task already copies is excluded: models trained
    on that batch have seen it (synthetic variants are not in the split index)."""
    states = staging.states
    fresh_heldout = [task_from_state(states[t]) for t in staging.placed_now if states[t].get("split") == "heldout"]
    if fresh_heldout:
        for tid, synth_id in contaminated_by_synthetic(store, artifacts, fresh_heldout, scfg).items():
            st = states[tid]
            cluster = f"x-{st['metadata']['request_hash'][:16]}"
            st.update(split="excluded", cluster=cluster, excluded_because=f"near-copy of synthetic task {synth_id}")
            st["metadata"].update(split="excluded", cluster=cluster)  # the same dicts as the staged event
            staging.summary.excluded_contaminated += 1


def _append_evals(store: EventStore, events: list[_EvalEvent], correlation_id: str | None) -> int:
    """Append the eval events in one transaction; how many were appended."""
    if not events:
        return 0
    table = pa.table(
        {
            "stream": [e.stream for e in events],
            "type": ["eval.created"] * len(events),
            "payload": [canonical_json(e.payload) for e in events],
            "causation": [e.causation for e in events],
        },
        schema=BATCH_SCHEMA,
    )
    res = store.append_batch(
        table,
        correlation_id=correlation_id,
        expected_versions={e.stream: e.expected_version for e in events},
        validated=True,
    )
    return res.appended


def _version_suites(ecfg: EvalsConfig, store: EventStore, artifacts: ArtifactStore, states: dict[str, dict],
                    summary: EvalsSummary, correlation_id: str | None) -> None:
    """Version each suite from the evals of its split; the held-out and regression suites keep
    non-deterministic evals out unless ``evals.include_llm_judge_in_gate``."""
    by_split: dict[str, list[dict]] = {s: [] for s in ("train", "heldout", "excluded", "regression")}
    for st in states.values():
        by_split.setdefault(st.get("split") or "unknown", []).append(st)
    summary.splits = {k: len(v) for k, v in by_split.items() if v}
    include_nd = ecfg.include_llm_judge_in_gate
    for name in SUITES:
        members = []
        for st in by_split[name]:
            deterministic = (st.get("metadata") or {}).get("deterministic", True)
            if name in ("heldout", "regression") and not deterministic and not include_nd:
                summary.excluded_from_gate += 1
                continue
            members.append(task_from_state(st))
        if not members and versioned_event(store, "suite", "suite.versioned", name) is None:
            summary.empty_suites.append(name)  # never versioned empty: nothing to gate or train on
            continue
        entity, new = version_suite(store, artifacts, name, members, correlation_id)
        summary.events_appended += int(new)
        summary.suites.append({"suite": entity, "members": len(members), "new_version": new})
        if name == "heldout":
            summary.heldout = _heldout_counts(members)


def _heldout_counts(members: list[dict]) -> dict[str, int]:
    outcomes = Counter((t.get("metadata") or {}).get("origin_outcome", "failure") for t in members)
    return {"items": len(members), "failures": outcomes.get("failure", 0), "successes": outcomes.get("success", 0),
            "clusters": len({(t.get("metadata") or {}).get("cluster") for t in members})}


def build_evals(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, *,
                correlation_id: str | None = None) -> EvalsSummary:
    """Compile every failure and successful trace into evals, split them, version the suites.

    Idempotent: the same inputs append no event (see the module docstring for all guarantees).
    """
    summary = EvalsSummary()
    staging = _Staging({e["entity_id"]: e["state"] for e in store.entities("eval")}, summary)
    index = _split_index(cfg.evals, staging.states)
    _stage_failures(store, artifacts, index, staging)
    _stage_successes(store, artifacts, index, staging)
    _exclude_synthetic_copies(store, artifacts, cfg.synth, staging)
    summary.events_appended += _append_evals(store, staging.events, correlation_id)
    _version_suites(cfg.evals, store, artifacts, staging.states, summary, correlation_id)
    summary.warnings += _heldout_warnings(cfg, summary, staging.states)
    return summary


def _heldout_warnings(cfg: FlywheelConfig, summary: EvalsSummary, states: dict[str, dict]) -> list[str]:
    """Say, before any training is spent, when the held-out suite cannot decide a gate, and why."""
    need = cfg.gate.min_paired_items
    have = summary.heldout.get("items", 0)
    if have >= need:
        return []
    placed = [st for st in states.values() if st.get("split") in ("train", "heldout", "excluded", "regression")]
    clusters = {st.get("cluster") for st in placed}
    heldout_clusters = {st.get("cluster") for st in placed if st.get("split") == "heldout"}
    frac = cfg.evals.heldout_fraction
    why = (f"{len(placed)} evals in {len(clusters)} request clusters, {len(heldout_clusters)} of them held out "
           f"(evals.heldout_fraction = {frac})")
    if have == 0:
        head = "the held-out suite is empty"
    else:
        head = f"the held-out suite has {have} items, fewer than gate.min_paired_items = {need}"
    if len(clusters) and len(clusters) * frac < need:
        fix = (f"about {int(need / frac) + 1} distinct requests are needed at this fraction: ingest more traffic "
               "(or raise evals.heldout_fraction)")
    else:
        fix = "ingest more traffic"
    excluded = summary.excluded_from_gate
    extra = f"; {excluded} non-deterministic evals are kept out of it" if excluded else ""
    return [f"{head}: every gate on it will end 'insufficient evidence' and the champion stays. {why}{extra}. "
            f"To decide, {fix}."]

