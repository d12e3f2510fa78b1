"""Plain-Python pieces of the flywheel cycle that the Prefect flow (``flows/cycle.py``) strings together.

The flow owns orchestration (order, retries, caching, schedules); this module owns the decisions
that must be testable without Prefect:

- :func:`inputs_key`: the cache key of a stage, a hash of the *entity versions* it consumes, so a
  re-run after a crash skips stages whose inputs did not change;
- :func:`new_failures_since_last_cycle`: the "nothing new to learn" early exit;
- :class:`CycleResources`: the store, artifact store and tracker one cycle shares between stages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from flywheel.artifacts import ArtifactStore, open_artifacts
from flywheel.config import FlywheelConfig
from flywheel.policy.base import PolicyRequestError
from flywheel.store import EventStore, StoreUnavailableError, open_store
from flywheel.tracking import Tracker
from flywheel.vocab.errors import InfraError
from flywheel.vocab.ids import CACHE_KEY_HEX, canonical_json, short_id


def is_infra_error(exc: BaseException | None) -> bool:
    """Retry only what infrastructure causes; never a refused gate, invalid data or a bug."""
    if exc is None:
        return False
    if isinstance(exc, InfraError | StoreUnavailableError | ConnectionError | TimeoutError | httpx.TransportError):
        return True
    if isinstance(exc, PolicyRequestError):
        status = getattr(exc, "status", None)
        return status is None or status == 429 or status >= 500
    return False


def inputs_key(stage: str, **inputs: Any) -> str:
    """``<stage>-<hash of the canonical inputs>``: the Prefect cache key of one stage run."""
    body = canonical_json({"stage": stage, "inputs": inputs})
    return f"{stage}-{short_id(body, CACHE_KEY_HEX)}"


def latest_version(store: EventStore, kind: str, name: str) -> str | None:
    """Entity id of the latest ``suite:<name>@N`` / ``env:<name>@N``, or None."""
    return store.latest_entity_id(f"{kind}:{name}@")


def failure_watermark(store: EventStore) -> dict[str, int]:
    """What the evals stage reads: the count and last seq of failure and trace events."""
    n, last = store.event_stats(["failure.classified", "trace.ingested"])
    return {"events": n, "last_seq": last}


def last_completed_cycle(store: EventStore) -> dict[str, Any] | None:
    evs = store.read(types=["cycle.completed"], limit=1, newest_first=True)
    if not evs:
        return None
    e = evs[0]
    return {"seq": e.seq, "stream": e.stream, "payload": e.payload}


def new_failures_since_last_cycle(store: EventStore) -> tuple[int, int | None]:
    """(number of ``failure.classified`` events after the last completed cycle, that cycle's seq)."""
    last = last_completed_cycle(store)
    after = last["seq"] if last else 0
    n, _ = store.event_stats(["failure.classified"], after_seq=after)
    return n, (last["seq"] if last else None)


@dataclass
class CycleResources:
    """What one cycle's stages share: one connection to the event store (on the embedded backend this
    process then owns the file and serves the other flywheel processes), the artifact store and the
    MLflow tracker."""

    cfg: FlywheelConfig
    store: EventStore
    artifacts: ArtifactStore
    tracker: Tracker

    @classmethod
    def open(cls, cfg: FlywheelConfig) -> CycleResources:
        artifacts = open_artifacts(cfg)
        artifacts.sweep_temp()  # a crashed earlier run may have left temp files, never artifacts
        return cls(cfg, open_store(cfg), artifacts, Tracker(cfg))

    def close(self) -> None:
        self.store.close()


def sandbox_warning(result: dict[str, Any]) -> str | None:
    """The loud line for a cycle whose sandboxed verifiers were weak, or whose rewards were dropped
    (shown by the CLI's summary and the HTML report)."""
    st = result.get("stages", {})
    sb = st.get("sandbox") or {}
    parts = [sb["warning"]] if sb.get("warning") else []
    for key in ("rollouts", "rollouts_after_sft"):
        s = (st.get(key) or {}).get("stats") or {}
        if s.get("untrainable"):
            parts.append(f"{key}: {s['untrainable']} samples kept out of training (weak-sandbox verdicts)")
        if s.get("infra_errors"):
            parts.append(f"{key}: {s['infra_errors']} samples had verifier infrastructure errors")
    return "; ".join(parts) or None


def summarize(value: Any) -> Any:
    """A JSON-safe view of a stage summary (dataclasses with ``to_dict``/``to_json``)."""
    for attr in ("to_dict", "to_json"):
        fn = getattr(value, attr, None)
        if callable(fn):
            return json.loads(json.dumps(fn(), default=str))
    return json.loads(json.dumps(value, default=str))
