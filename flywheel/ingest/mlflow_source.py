"""``flywheel ingest --from mlflow``: production traces recorded by MLflow Tracing, read from a tracking
server, through the same preparation, validation, quarantine, redaction, classification and commit as
a trace file.

Flow: :meth:`flywheel.tracking.Tracker.iter_traces` pages through the experiment's traces oldest
first (``--since``: from that time on) -> each finished trace is serialised (``Trace.to_dict()``) as
one record of format ``mlflow`` (mapping: :mod:`flywheel.ingest.mlflow_traces`) -> chunks of
``ingest.batch_size`` records are prepared and committed exactly like the batches of a file.

Guarantees
- Idempotent by MLflow trace id: a trace whose ``trace:<id>`` stream exists, or that an earlier run
  quarantined (the quarantine event lists the MLflow trace ids it holds), is counted as a duplicate
  and not prepared again; a second run over the same traces appends nothing.
- Each chunk is one "file" of the file pipeline: its identity is the sha256 of its serialised
  traces, its ``ingest.completed`` event (``ingest:<sha[:16]>``, payload: experiment, tracking URI
  without credentials, counts) is appended before its batch, and the batch (traces, quarantine,
  failures) is one transaction. A crash between the two leaves an ``ingest.completed`` that the
  re-run appends again as a no-op (same content, same event id); no trace is recorded twice.
- Traces still in progress (state ``IN_PROGRESS``) are skipped, not recorded: a later run reads
  them once they are finished.
- A trace larger than ``ingest.max_line_bytes`` serialised is quarantined as ``line_too_long``, as
  an over-long line of a file is.

Not guaranteed: an MLflow trace changed after it was ingested (a feedback added later) is not read
again; its id is already recorded. Quarantined MLflow traces can be replayed
(``flywheel ingest --replay-quarantine``) like any other quarantined record.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
import pyarrow as pa

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.ingest.pipeline import IngestError, IngestSummary, ProgressFn, _Committer
from flywheel.ingest.prepare import Preparer
from flywheel.ingest.reader import KEEP_PREFIX, Line
from flywheel.store import BATCH_SCHEMA, EventStore
from flywheel.tracking import Tracker, public_uri
from flywheel.vocab.ids import canonical_json

FORMAT = "mlflow"


class MlflowSourceError(IngestError):
    """The MLflow source cannot be read (no such experiment, server unreachable, bad ``--since``)."""


def parse_since(value: str | None) -> int | None:
    """``--since`` as epoch milliseconds: an ISO 8601 time (a zone-less one is UTC) or epoch ms."""
    if value is None or value == "":
        return None
    v = value.strip()
    if v.isdigit():
        return int(v)
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise MlflowSourceError(f"--since {value!r}: expected an ISO 8601 time (2026-11-30T00:00:00Z) "
                                "or epoch milliseconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def _quarantined_ids(store: EventStore, experiment_id: str) -> set[str]:
    """MLflow trace ids of this experiment that earlier runs quarantined."""
    out: set[str] = set()
    for ent in store.entities("quarantine"):
        st = ent["state"] or {}
        if st.get("source") == FORMAT and str(st.get("experiment_id")) == experiment_id:
            out.update(st.get("source_ids") or ())
    return out


def _recorded(store: EventStore, trace_ids: list[str]) -> set[str]:
    if not trace_ids:
        return set()
    # Through the store's method: on PostgreSQL, or in a process that reaches the warehouse through its
    # owner, there is no DuckDB connection to register a table on.
    return {s.split(":", 1)[1] for s in store.existing_streams([f"trace:{t}" for t in trace_ids])}


def _chunks(traces: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for t in traces:
        chunk.append(t)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def ingest_mlflow(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    experiment: str,
    *,
    since: str | None = None,
    correlation_id: str | None = None,
    progress: ProgressFn | None = None,
) -> IngestSummary:
    """Ingest the traces of MLflow experiment ``experiment`` from ``tracker``'s tracking server.

    ``since``: only traces that started at or after it (ISO 8601 or epoch ms). ``progress`` gets the
    same dicts as file ingest (``file`` is ``mlflow:<experiment>``, ``bytes_*`` are 0). Raises
    :class:`MlflowSourceError` when the experiment does not exist or the server cannot be read.
    """
    t0 = time.perf_counter()
    since_ms = parse_since(since)
    where = f"{public_uri(tracker.tracking_uri)}"
    try:
        exp_id = tracker.find_experiment(experiment)
    except Exception as e:  # noqa: BLE001 - any client error means the source is unreadable
        raise MlflowSourceError(f"MLflow at {where}: cannot read experiment {experiment!r}: {type(e).__name__}: {e}") from None
    if exp_id is None:
        raise MlflowSourceError(f"MLflow at {where} has no experiment named {experiment!r}")
    summary = IngestSummary()
    committer = _Committer(cfg, store, artifacts, summary, correlation_id)
    name = f"mlflow:{experiment}"
    quarantined = _quarantined_ids(store, exp_id)
    max_line = cfg.ingest.max_line_bytes
    skipped_in_progress = done = 0
    try:
        pages = tracker.iter_traces(exp_id, since_ms=since_ms)
        with store.memory_limit(cfg.ingest.duckdb_memory_mb):
            for chunk in _chunks(pages, cfg.ingest.batch_size):
                ids = [str((t.get("info") or {}).get("trace_id")) for t in chunk]
                recorded = _recorded(store, ids)
                lines: list[Line] = []
                source_ids: list[str] = []
                for t, tid in zip(chunk, ids, strict=True):
                    if str((t.get("info") or {}).get("state") or "").upper() == "IN_PROGRESS":
                        skipped_in_progress += 1
                        continue
                    if tid in recorded or tid in quarantined:
                        summary.read += 1
                        summary.duplicates += 1
                        continue
                    data = orjson.dumps(t, option=orjson.OPT_SORT_KEYS)
                    n = len(lines) + 1
                    lines.append(Line(n, data[:KEEP_PREFIX], oversize=len(data)) if len(data) > max_line else Line(n, data))
                    source_ids.append(tid)
                done += len(chunk)
                if lines:
                    _commit_chunk(cfg, committer, lines, source_ids, name=name, experiment=experiment, exp_id=exp_id,
                                  where=where, since_ms=since_ms)
                if progress:
                    progress({"file": name, "records": done, "bytes_done": 0, "bytes_total": 0})
    except MlflowSourceError:
        raise
    except Exception as e:
        if type(e).__module__.startswith(("mlflow", "requests", "urllib3")):
            raise MlflowSourceError(f"MLflow at {where}: reading traces of {experiment!r} failed: "
                                    f"{type(e).__name__}: {e}") from e
        raise
    summary.elapsed_s = round(time.perf_counter() - t0, 3)
    summary.files.append({"path": name, "format": FORMAT, "experiment_id": exp_id, "tracking_uri": where,
                          "since_ms": since_ms, "skipped_in_progress": skipped_in_progress})
    return summary


def _commit_chunk(cfg: FlywheelConfig, committer: _Committer, lines: list[Line], source_ids: list[str], *, name: str,
                  experiment: str, exp_id: str, where: str, since_ms: int | None) -> None:
    h = hashlib.sha256()
    for ln in lines:
        h.update(ln.data)
        h.update(b"\n")
    sha = h.hexdigest()
    ingest_id = f"ingest:{sha[:16]}"
    prep = Preparer(cfg.ingest, FORMAT, name, sha)
    batches = list(prep.batches(iter(lines), lambda: 0))
    stats = prep.stats()
    payload = {
        "entity_id": ingest_id, "file_sha256": sha, "bytes": sum(ln.oversize or len(ln.data) for ln in lines),
        "format": FORMAT, "source": FORMAT, "experiment": experiment, "experiment_id": exp_id, "tracking_uri": where,
        "since_ms": since_ms, "lines": stats.lines, "records": stats.records,
        "quarantined": sum(stats.content_counts.values()),
        "quarantined_by_reason": dict(sorted(stats.content_counts.items())),
        "failures_by_kind": dict(sorted(stats.kind_counts.items())), "cut_short": None,
    }
    table = pa.table({"stream": [ingest_id], "type": ["ingest.completed"], "payload": [canonical_json(payload)],
                      "causation": [[]]}, schema=BATCH_SCHEMA)
    res = committer.store.append_batch(table, correlation_id=committer.correlation_id, validated=True)
    committer.summary.events_appended += res.appended
    for b in batches:
        extra = {"source": FORMAT, "experiment_id": exp_id,
                 "source_ids": [source_ids[q["line"] - 1] for q in b.quarantine]}
        committer.commit(b, ingest_id, sha, causation=[ingest_id], quarantine_stream=f"quarantine:{sha[:16]}-{b.no:05d}",
                         quarantine_payload_extra=extra)
