"""Quarantine inspection and replay.

Quarantined records live in per-batch Parquet artifacts (0600, like every artifact) referenced by
``trace.quarantined`` events on ``quarantine:<file sha256[:16]>-<batch>``. A replay re-runs every
replayable, unresolved record through the current parser, validation and redaction; records that
now pass are ingested (causation: the quarantine stream), and the quarantine stream gets a new
``trace.quarantined`` event whose ``resolved_lines``/``remaining`` reflect it. Replaying again
appends nothing unless something new passes. Over-long lines (kept as a 64 KiB prefix) and records
lost to a cut file are not replayable. A replay parses the *redacted* raw text (the clear text was
never stored), so the traces it produces are redacted like any other.
"""

from __future__ import annotations

import time
from typing import Any

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.ingest.pipeline import IngestSummary, ProgressFn, _Committer
from flywheel.ingest.prepare import Preparer
from flywheel.ingest.reader import Line
from flywheel.store import EventStore, NewEvent


def list_quarantine(store: EventStore) -> list[dict[str, Any]]:
    """One row per quarantine batch: stream, file, counts by reason, remaining."""
    out = []
    for e in store.entities("quarantine"):
        st = e["state"]
        out.append({
            "stream": e["entity_id"], "file": st.get("file"), "file_sha256": st.get("file_sha256"),
            "batch": st.get("batch"), "records": st.get("records"), "remaining": st.get("remaining"),
            "by_reason": st.get("by_reason"), "artifact": st.get("artifact", {}).get("sha256"),
        })
    return out


def show_quarantine(store: EventStore, artifacts: ArtifactStore, stream: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    """The quarantined records of one batch (``quarantine:…``; a unique prefix of it is accepted)."""
    if not stream.startswith("quarantine:"):
        stream = "quarantine:" + stream
    ent = store.entity(stream)
    if ent is None:
        matches = [e for e in store.entities("quarantine") if e["entity_id"].startswith(stream)]
        if len(matches) != 1:
            raise KeyError(f"{stream}: {'no' if not matches else 'more than one'} quarantine batch matches")
        ent = {"state": matches[0]["state"], "entity_id": matches[0]["entity_id"]}
    st = ent["state"]
    resolved = set(st.get("resolved_lines") or [])
    rows = artifacts.read_table(st["artifact"]["sha256"]).to_pylist()
    for r in rows:
        r["resolved"] = r["line"] in resolved
    return rows[:limit] if limit else rows


def replay_quarantine(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, *,
                      correlation_id: str | None = None, progress: ProgressFn | None = None) -> IngestSummary:
    t0 = time.perf_counter()
    summary = IngestSummary()
    committer = _Committer(cfg, store, artifacts, summary, correlation_id)
    for ent in store.entities("quarantine"):
        st = ent["state"]
        if not st.get("remaining"):
            continue
        resolved = set(st.get("resolved_lines") or [])
        rows = [r for r in artifacts.read_table(st["artifact"]["sha256"]).to_pylist()
                if r["replayable"] and r["line"] not in resolved]
        if not rows:
            continue
        fmt = rows[0]["format"]
        prep = Preparer(cfg.ingest, fmt, st.get("file") or "", st.get("file_sha256") or "")
        lines = iter([Line(r["line"], r["raw"].encode("utf-8", errors="surrogateescape")) for r in rows])
        newly: set[int] = set()
        for b in prep.batches(lines, lambda: 0):
            # Records that fail again are not re-quarantined (they are still in this batch's artifact).
            still = {q["line"] for q in b.quarantine}
            b.quarantine = []
            committer.commit(b, st.get("ingest", ""), st.get("file_sha256", ""),
                             causation=[ent["entity_id"]], quarantine_stream=None)
            newly |= {r["line"] for r in rows} - still
        if progress:
            progress({"file": ent["entity_id"], "records": len(rows), "bytes_done": 0, "bytes_total": 0})
        if newly:
            payload = dict(st)
            payload["resolved_lines"] = sorted(resolved | newly)
            payload["remaining"] = int(st.get("records", 0)) - len(payload["resolved_lines"])
            res = store.append(ent["entity_id"], NewEvent("trace.quarantined", payload, [st.get("ingest")]),
                               correlation_id=correlation_id)
            summary.events_appended += res.appended
    summary.elapsed_s = round(time.perf_counter() - t0, 3)
    return summary
