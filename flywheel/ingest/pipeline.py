"""The ingest stage: files in, validated/redacted/classified traces and deduplicated failures out.

Data flow per file (one pass, bounded memory)::

    bytes (gzip by magic) -> lines (<= max_line_bytes) -> JSON -> adapter (openai | otel | bfcl)
      -> schema + semantic checks -> redaction -> classification -> batch of batch_size records
      -> [commit] dedup against the store -> GX suite -> Parquet artifacts -> one append_batch

Preparation (everything before ``[commit]``, :mod:`flywheel.ingest.prepare`) is pure per-record
Python, ~30 µs a trace, and holds the GIL. Files of at least :data:`PROCESS_MIN_BYTES` are prepared
in ``ingest.workers`` worker processes (:mod:`flywheel.ingest.worker`; an OpenAI-format file is
split between them by batch number, other formats use one), each at most one batch ahead of the
commit; smaller files (and quarantine replay) use a background thread one batch ahead, which
overlaps only what releases the GIL (DuckDB, Parquet). Either way a batch reaches the commit as an
Arrow table, and the commit works column-wise. Measured on 2 cores (``benchmarks/bench_ingest.py``, 1M traces):
one worker process 21.7k-24.4k traces/s (17.5k-18.4k in runs where this shared host was slower, its
naive peer too), peak RSS 1.77 GB (main + worker); the thread path 4.7k-13k. Bounded by total CPU
(65-80 µs a trace over both processes).

Storage choice (payload size matters at 10^6 traces): the redacted trace itself goes into a
per-batch zstd Parquet artifact (columns :data:`TRACE_COLUMNS`); the ``trace.ingested`` event
carries a ~300-byte summary plus ``trace: {sha256, row}``: the store hashes and JSON-validates every
payload and writes it twice (WAL, then checkpoint), so its append rate falls with payload size. Use
:func:`load_traces` to get the full redacted traces back (the evals stage does, for regression evals
from successes). Failures are the exception: their event payload is self-contained (prompt messages,
bad answer, tools, correction, tests, error, feedback) because evals compile from it directly.

Guarantees
- Idempotent: a trace id is recorded once (``trace:<id>`` streams are checked before appending);
  quarantine, failure and ``ingest.completed`` payloads are functions of the file content, so
  re-ingesting a file appends zero events.
- Crash safe: each batch (its traces, its quarantine record, its failure updates) is one
  ``append_batch`` transaction; artifacts are written before it (an interrupted batch leaves at most
  an unreferenced artifact). After a SIGKILL, re-running the same command ingests every record
  exactly once.
- Nothing is dropped silently: every non-blank line is ingested, counted as a duplicate, or
  quarantined with its file, line number and reason.
- A batch that fails the Great Expectations suite raises :class:`IngestRefused` with the suite's
  report; nothing of that batch is committed (earlier batches stay committed).
- A worker process that dies raises :class:`flywheel.ingest.worker.WorkerDied` after the batches
  received complete are committed; re-running resumes (idempotent). Workers of a killed parent exit.

Not guaranteed
- Quarantine identity is (file content, batch number): changing ``batch_size`` between runs of the
  same file records its quarantined lines again under new streams (traces are unaffected).
- Failure ``trace_ids`` lists keep the first :data:`MAX_TRACE_IDS` ids (``occurrences`` counts all;
  causation links every trace).
"""

from __future__ import annotations

import copy
import json
import os
import queue
import random
import sys
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.artifacts import ArtifactStore
from flywheel.classify import FAILURE_KINDS
from flywheel.config import FlywheelConfig
from flywheel.ingest import formats, otlp
from flywheel.ingest.prepare import PREPARED_SCHEMA, Batch, Preparer
from flywheel.ingest.reader import Line, iter_lines, open_binary, open_source, position
from flywheel.ingest.worker import ParallelBatches
from flywheel.schemas.gx_suites import prewarm_traces_batch, validate_traces_batch
from flywheel.store import BATCH_SCHEMA, ConcurrencyError, EventStore, StoreError
from flywheel.tool_registry import ToolRegistryError, load_registry
from flywheel.vocab.ids import canonical_json, sha256_file

MAX_TRACE_IDS = 100
# The quarantine reason of a trace whose ``trace:`` id the store cannot record: another entity id holds
# its 64-bit node id (an MD5 prefix collision; flywheel.store.node_id).
ENTITY_ID_COLLISION = "entity_id_collision"
# Tries of one batch's commit when other writers keep appending to its streams meanwhile, with a
# randomised, growing pause between tries (up to COMMIT_BACKOFF_S * 2**attempt): without it a writer that
# reaches the store through the owner's socket kept losing the race to the owner's own faster appends
# (two ingests of the same failure: 5 of 5 tries lost in ~1 run of 5).
COMMIT_ATTEMPTS = 10
COMMIT_BACKOFF_S = 0.01
# Failure states kept in memory between batches (a few KB each: ~50-100 MB at the bound).
FAILURE_STATE_CACHE = 20_000
# Files at least this large are prepared in a worker process (flywheel.ingest.worker) instead of a
# thread. Starting it costs ~0.7 s of CPU (interpreter + imports) on the other core and only pays
# off from the second batch on (the first batch is prepared while the commit waits either way):
# 32 MiB is ~30,000 traces of ~1 KB, ~1 s of preparation.
PROCESS_MIN_BYTES = 32 * 1024 * 1024
# Preparation processes per file come from ``ingest.workers`` (0: the thread path for every file).
# OpenAI-format files can be split between several by batch number; OTel and BFCL files use one
# (OTel traces span lines). Measured on the 1M-trace benchmark (2 cores, load ~2.5 from other work):
# 2 workers 14.6k traces/s but 1,157 MB (main) + 2 x 587 MB (workers) peak RSS, over the 2 GB
# target; 1 worker (the default) keeps the sum ~1.75 GB. Raise it where cores and memory allow.
SUFFIXES = (".jsonl", ".ndjson", ".json", ".gz", ".jsonl.gz")

# The per-batch trace artifact: the prepared columns a reader needs (``trace`` is the canonical JSON
# of the redacted trace), plus the file they came from.
TRACE_SCHEMA = pa.schema(
    [PREPARED_SCHEMA.field(n) for n in ("trace_id", "source", "status", "kinds", "failure_id", "timestamp", "model", "trace")]
    + [pa.field("file_sha256", pa.string()), PREPARED_SCHEMA.field("line")]
)
TRACE_COLUMNS = TRACE_SCHEMA.names

QUARANTINE_SCHEMA = pa.schema(
    [
        ("file", pa.string()),  # base name of the input file
        ("file_sha256", pa.string()),
        ("line", pa.int64()),
        ("format", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.string()),  # redacted raw text; invalid UTF-8 bytes as \\xNN
        ("raw_bytes", pa.int64()),  # length of the line as read
        ("replayable", pa.bool_()),  # False when raw is a prefix (over-long line) or absent (cut file)
    ]
)


class IngestError(RuntimeError):
    """A path cannot be ingested at all (missing, unreadable, not a file)."""


class IngestRefused(RuntimeError):
    """A batch failed the Great Expectations suite; ``report`` lists the failed expectations."""

    def __init__(self, message: str, report: list[dict[str, Any]]):
        super().__init__(message)
        self.report = report


@dataclass
class IngestSummary:
    read: int = 0
    ingested: int = 0
    duplicates: int = 0
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    new_failures: int = 0
    updated_failures: int = 0
    redactions_by_rule: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    successes: int = 0
    events_appended: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def quarantined(self) -> int:
        return sum(self.quarantined_by_reason.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quarantined"] = self.quarantined
        return d


# -- the stage ------------------------------------------------------------------------------------
def _expand_paths(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise IngestError(f"{p}: no such file or directory")
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES))
            if not found:
                raise IngestError(f"{p}: directory holds no {'/'.join(SUFFIXES)} files")
            out += found
        elif p.is_file():
            if not os.access(p, os.R_OK):
                raise IngestError(f"{p}: not readable (permission denied)")
            out.append(p)
        else:
            raise IngestError(f"{p}: not a regular file")
    return out


def _sniff_format(path: Path, max_line_bytes: int) -> str:
    """The format of the first parseable record among the first 20 non-blank lines (default openai)."""
    with open_binary(path) as stream:
        n = 0
        try:
            for line in iter_lines(stream, max_line_bytes):
                if line.error or line.oversize or not line.data.strip():
                    continue
                obj, prob = formats.parse_json(line.data.lstrip(b"\xef\xbb\xbf"), strict_unicode=False)
                if prob is None:
                    return formats.detect_format(obj)
                n += 1
                if n >= 20:
                    break
        except (EOFError, OSError, zlib.error):
            pass
    return "openai"


def _whole_document(path: Path, max_line_bytes: int) -> bytes | None:
    """A pretty-printed JSON document (first non-blank line is just '{' or '[') read whole, when small."""
    try:
        with open_binary(path) as stream:
            head = stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096)
    except (EOFError, OSError, zlib.error):  # a cut or corrupt gzip: the line reader reports it
        return None
    first = next((ln.strip() for ln in head.splitlines() if ln.strip()), b"")
    if first not in (b"{", b"["):
        return None
    try:
        with open_binary(path) as stream:
            data = stream.read(max_line_bytes + 1)
    except (EOFError, OSError, zlib.error) as e:
        raise IngestError(f"{path}: cannot read the JSON document ({e})") from None
    if len(data) > max_line_bytes:
        raise IngestError(f"{path}: a multi-line JSON document larger than ingest.max_line_bytes; write JSON Lines")
    return data


def _record_bytes(x: Any) -> bytes:
    """One element of a JSON array document as a JSON line, for the per-record path. orjson refuses
    what the fallback parser accepted (lone surrogates, integers beyond 64 bits, > 255 levels): the
    standard library writes those back as they were written (``\\ud800`` escapes, all digits), so
    the record meets the same per-record checks as it would on a line of its own. Its recursion
    limit is raised for the call: the element was parsed, so it is at most ~1,000 levels deep."""
    try:
        return orjson.dumps(x)
    except (TypeError, ValueError):
        pass
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        return json.dumps(x, ensure_ascii=True).encode()
    finally:
        sys.setrecursionlimit(limit)


@dataclass(frozen=True)
class _EventRow:
    """One event of a batch's second table (its quarantine record and failure updates), as
    ``append_batch`` takes it: ``payload`` is canonical JSON."""

    stream: str
    type: str
    payload: str
    causation: list[str]


def _rows_table(rows: list[_EventRow]) -> pa.Table:
    return pa.table({"stream": [r.stream for r in rows], "type": [r.type for r in rows],
                     "payload": [r.payload for r in rows], "causation": [r.causation for r in rows]},
                    schema=BATCH_SCHEMA)


@dataclass(frozen=True)
class _FailureMerge:
    """A batch's failures merged with their stored states: the ``failure.classified`` events, the
    states they write and the stream versions they build on (by failure id), and how many are new
    and how many updated."""

    rows: list[_EventRow]
    states: dict[str, dict[str, Any]]
    versions: dict[str, int]
    new: int
    updated: int


def _first_failure_state(first: dict[str, Any], tids: list[str], tss: list[str], kinds: list[str]) -> dict[str, Any]:
    """The state of a failure first seen in this batch: the content of its first trace, plus the
    occurrence fields of the batch's traces."""
    payload = dict(first)
    payload.update(kinds=kinds, trace_ids=tids[:MAX_TRACE_IDS],
                   trace_ids_truncated=len(tids) > MAX_TRACE_IDS, occurrences=len(tids),
                   first_seen=min(tss), last_seen=max(tss))
    return payload


def _merged_failure_state(old: dict[str, Any], tids: list[str], tss: list[str], kinds: list[str]) -> dict[str, Any]:
    """The stored state ``old`` of a failure, with the occurrences of this batch's traces added."""
    payload = dict(old)
    all_ids = list(old.get("trace_ids", [])) + [t for t in tids if t not in set(old.get("trace_ids", []))]
    payload["trace_ids"] = all_ids[:MAX_TRACE_IDS]
    payload["trace_ids_truncated"] = old.get("trace_ids_truncated", False) or len(all_ids) > MAX_TRACE_IDS
    payload["occurrences"] = int(old.get("occurrences", 0)) + len(tids)
    payload["first_seen"] = min([old.get("first_seen") or tss[0], *tss])
    payload["last_seen"] = max([old.get("last_seen") or tss[0], *tss])
    payload["kinds"] = sorted(set(old.get("kinds", [])) | set(kinds), key=FAILURE_KINDS.index)
    return payload


class _Committer:
    """Commits prepared batches (main thread: the only one touching the store)."""

    def __init__(self, cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, summary: IngestSummary,
                 correlation_id: str | None):
        self.cfg, self.store, self.artifacts, self.summary = cfg, store, artifacts, summary
        self.correlation_id = correlation_id
        self._suite = None
        # Failure states this committer wrote, with their stream versions, so the next batch need not
        # read and parse them back (~60 µs per state; 0.75 s per 300k traces in the benchmark). Other
        # writers may append meanwhile (an ingest beside this one, a team on PostgreSQL): every append
        # names the versions it builds on (expected_versions), and a ConcurrencyError clears the cache
        # and commits the batch again from fresh reads. An entry is kept only when its event was
        # appended (a batch with any already-recorded row clears the cache). Bounded: least recently
        # used states go first.
        self._failure_states: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()

    def gx(self, b: Batch, kept: pa.Table) -> None:
        if not kept.num_rows:
            return
        df = kept.select(["trace_id", "timestamp_epoch", "n_messages", "roles", "status", "source"]).to_pandas()
        ok, report = validate_traces_batch(df, self.cfg.ingest)
        if not ok:
            raise IngestRefused(
                f"batch {b.no} failed the traces_batch expectation suite; nothing from it was committed: "
                + "; ".join(f"{r['expectation']}({r.get('column')}): {r.get('unexpected_count')} unexpected, e.g. "
                            f"{r.get('examples')}" for r in report),
                report,
            )

    def commit(self, b: Batch, ingest_id: str, file_sha: str, *, causation: list[str],
               quarantine_stream: str | None, quarantine_payload_extra: dict[str, Any] | None = None,
               file: str = "", fmt: str = "") -> None:
        """Dedup against the store, GX, artifacts, then one ``append_batch``; committed again from fresh
        reads when another writer appended to one of the batch's streams in between."""
        for attempt in range(COMMIT_ATTEMPTS):
            saved = copy.deepcopy(self.summary)
            try:
                return self._commit(b, ingest_id, file_sha, causation=causation, quarantine_stream=quarantine_stream,
                                    quarantine_payload_extra=quarantine_payload_extra, file=file, fmt=fmt)
            except ConcurrencyError:
                self.summary.__dict__.update(saved.__dict__)
                self._failure_states.clear()
                if attempt == COMMIT_ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0, COMMIT_BACKOFF_S * 2 ** min(attempt, 6)))

    def _commit(self, b: Batch, ingest_id: str, file_sha: str, *, causation: list[str],
                quarantine_stream: str | None, quarantine_payload_extra: dict[str, Any] | None = None,
                file: str = "", fmt: str = "") -> None:
        """One try of :meth:`commit`. Column-wise: the only per-row Python loop left here is over the
        batch's failures (and over traces whose id collides, :meth:`_collisions`).

        The GX suite runs before anything is written, and the artifacts are written before the batch's
        one ``append_batch``: an interrupted commit leaves at most an unreferenced artifact."""
        self._count_read(b)
        kept, streams = self._unrecorded(b.table)
        # A trace whose stream's node id another name holds (a 64-bit MD5 collision) cannot be recorded:
        # it is quarantined (reason entity_id_collision) and the rest of the batch goes on.
        quarantine = list(b.quarantine)  # a retried commit starts again from the batch's own
        if kept.num_rows:
            kept, streams = self._collisions(kept, streams, quarantine, file or (quarantine[0]["file"] if quarantine else ""),
                                             file_sha, fmt)
        n = kept.num_rows
        self.gx(b, kept)
        events: list[pa.Table] = []
        if n:
            events.append(self._trace_events(kept, streams, file_sha, causation))
        rows: list[_EventRow] = []
        if quarantine and quarantine_stream:
            rows.append(self._quarantine_event(b, quarantine, ingest_id, file_sha, quarantine_stream,
                                               quarantine_payload_extra))
        failures = self._merge_failures(b, kept)
        rows += failures.rows
        # The versions this batch builds on: new traces must still be new, failures at the version read.
        expected: dict[str, int] = dict.fromkeys(streams.to_pylist(), 0) if n else {}
        expected.update(failures.versions)
        if rows:
            events.append(_rows_table(rows))
        if events:
            self._append(events, expected, failures.states)
        self._tally(kept, quarantine, failures)

    def _count_read(self, b: Batch) -> None:
        """The batch's reads, in-batch duplicates and redactions, into the summary."""
        s = self.summary
        s.read += b.read
        s.duplicates += b.in_batch_duplicates
        for k, v in b.redactions.items():
            s.redactions_by_rule[k] = s.redactions_by_rule.get(k, 0) + v

    def _unrecorded(self, tbl: pa.Table) -> tuple[pa.Table, pa.ChunkedArray]:
        """The batch's traces the store does not hold yet, and their ``trace:`` streams; the others are
        counted as duplicates."""
        streams = pc.binary_join_element_wise("trace:", tbl.column("trace_id"), "")
        # Straight from events: the ``streams`` view aggregates every stream before it could filter.
        existing = self.store.existing_streams(streams)
        if existing:
            mask = pc.invert(pc.is_in(streams, value_set=pa.array(existing, pa.string())))
            kept, streams = tbl.filter(mask), streams.filter(mask)
        else:
            kept = tbl
        self.summary.duplicates += tbl.num_rows - kept.num_rows
        return kept, streams

    def _trace_events(self, kept: pa.Table, streams: pa.ChunkedArray, file_sha: str,
                      causation: list[str]) -> pa.Table:
        """Write the batch's trace artifact; the ``trace.ingested`` events that point into it (row by row)."""
        n = kept.num_rows
        art = pa.table({c: (pa.array([file_sha] * n, pa.string()) if c == "file_sha256" else kept.column(c))
                        for c in TRACE_COLUMNS}, schema=TRACE_SCHEMA)
        ref = self.artifacts.put_table(art)
        rows = pa.array(np.arange(n, dtype=np.int64)).cast(pa.string())
        payload = pc.binary_join_element_wise(kept.column("payload_head"), rows, f',"sha256":"{ref.sha256}"',
                                              kept.column("payload_tail"), "")
        return pa.table({
            "stream": streams, "type": pa.array(["trace.ingested"] * n, pa.string()), "payload": payload,
            "causation": pa.array([causation] * n, pa.list_(pa.string())),
        }, schema=BATCH_SCHEMA)

    def _quarantine_event(self, b: Batch, quarantine: list[dict[str, Any]], ingest_id: str, file_sha: str,
                          stream: str, extra: dict[str, Any] | None) -> _EventRow:
        """Write the batch's quarantine artifact; the ``trace.quarantined`` event that records it."""
        qt = pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA)
        qref = self.artifacts.put_table(qt)
        by_reason = dict(sorted(Counter(q["reason"] for q in quarantine).items()))
        qpayload = {
            "ingest": ingest_id, "file": quarantine[0]["file"], "file_sha256": file_sha, "batch": b.no,
            "records": len(quarantine), "by_reason": by_reason,
            "artifact": {"sha256": qref.sha256, "rows": qt.num_rows},
            "resolved_lines": [], "remaining": len(quarantine),
        }
        qpayload.update(extra or {})
        return _EventRow(stream, "trace.quarantined", canonical_json(qpayload), [ingest_id])

    def _merge_failures(self, b: Batch, kept: pa.Table) -> _FailureMerge:
        """Group the batch's new failure traces by identity and merge each group with the stored state
        (from this committer's cache, else the store): one ``failure.classified`` event per failure."""
        fails = kept.filter(pc.is_valid(kept.column("failure_id"))) if kept.num_rows else kept
        groups: dict[str, list[int]] = {}
        for i, fid in enumerate(fails.column("failure_id").to_pylist()):
            groups.setdefault(fid, []).append(i)
        if groups:
            f_tids = fails.column("trace_id").to_pylist()
            f_tss = fails.column("timestamp").to_pylist()
            f_kinds = fails.column("kinds").to_pylist()
        cache = self._failure_states
        states = {fid: cache[fid] for fid in groups if fid in cache}
        missing = [fid for fid in groups if fid not in cache]
        states.update((k, (orjson.loads(v), ver)) for k, (v, ver) in self.store.entity_heads(missing).items())
        rows: list[_EventRow] = []
        written: dict[str, dict[str, Any]] = {}
        versions: dict[str, int] = {}
        new = upd = 0
        for fid, idxs in groups.items():
            tids = [f_tids[i] for i in idxs]
            tss = [f_tss[i] for i in idxs]
            kinds = sorted({k for i in idxs for k in f_kinds[i]}, key=FAILURE_KINDS.index)
            old, version = states.get(fid, (None, 0))
            versions[fid] = version
            if old is None:
                # The batch's first trace of this failure carries the content (identical by definition).
                payload = _first_failure_state(b.first_payloads[fid], tids, tss, kinds)
                new += 1
            else:
                payload = _merged_failure_state(old, tids, tss, kinds)
                upd += 1
            written[fid] = payload
            rows.append(_EventRow(fid, "failure.classified", canonical_json(payload), [f"trace:{t}" for t in tids]))
        return _FailureMerge(rows=rows, states=written, versions=versions, new=new, updated=upd)

    def _append(self, events: list[pa.Table], expected: dict[str, int], written: dict[str, dict[str, Any]]) -> None:
        """The batch's one ``append_batch``; then the failure states it wrote go into the cache."""
        table = events[0] if len(events) == 1 else pa.concat_tables(events)
        res = self.store.append_batch(table, correlation_id=self.correlation_id, validated=True,
                                      expected_versions=expected)
        if res.rejected:
            # Checked just before (_collisions): only a name another writer recorded since can be
            # refused here. Those rows are not in the store; say which, loudly, and go on.
            raise StoreError("ingest: the store refused events of this batch after the collision check "
                             f"(another writer recorded a colliding entity id meanwhile): {res.rejected[0]['reason']}; "
                             f"{len(res.rejected)} event(s) refused, the rest appended; run the ingest again "
                             "to quarantine them")
        self.summary.events_appended += res.appended
        cache = self._failure_states
        if res.already_recorded:
            cache.clear()
        else:
            for fid, payload in written.items():
                cache[fid] = (payload, expected[fid] + 1)
                cache.move_to_end(fid)
            while len(cache) > FAILURE_STATE_CACHE:
                cache.popitem(last=False)

    def _tally(self, kept: pa.Table, quarantine: list[dict[str, Any]], failures: _FailureMerge) -> None:
        """The committed batch's traces, successes, failure kinds, quarantine reasons and failures, into
        the summary."""
        s = self.summary
        n = kept.num_rows
        s.ingested += n
        if n:
            s.successes += pc.sum(pc.equal(kept.column("status"), "success")).as_py() or 0
            for item in pc.value_counts(pc.list_flatten(kept.column("kinds"))).to_pylist():
                s.failures_by_kind[item["values"]] = s.failures_by_kind.get(item["values"], 0) + item["counts"]
        for q in quarantine:
            s.quarantined_by_reason[q["reason"]] = s.quarantined_by_reason.get(q["reason"], 0) + 1
        s.new_failures += failures.new
        s.updated_failures += failures.updated

    def _collisions(self, kept: pa.Table, streams: pa.Array, quarantine: list[dict[str, Any]], file: str,
                    file_sha: str, fmt: str) -> tuple[pa.Table, pa.Array]:
        """``kept`` and ``streams`` without the traces whose ``trace:`` id the store would refuse (its
        node id held by another name: :meth:`EventStore.colliding_names`), which are added to
        ``quarantine`` with reason :data:`ENTITY_ID_COLLISION` and the redacted trace as raw text."""
        clashes = self.store.colliding_names(streams)
        if not clashes:
            return kept, streams
        bad = pc.is_in(streams, value_set=pa.array(list(clashes), pa.string()))
        for stream, line, trace in zip(streams.filter(bad).to_pylist(), kept.column("line").filter(bad).to_pylist(),
                                       kept.column("trace").filter(bad).to_pylist(), strict=True):
            quarantine.append({
                "file": file, "file_sha256": file_sha, "line": line, "format": fmt, "reason": ENTITY_ID_COLLISION,
                "detail": (f"entity id {stream!r} collides with {clashes[stream]!r}: they share a 64-bit node id "
                           "(MD5 prefix), which the store keeps for the name it recorded first; "
                           "give this trace another trace_id to ingest it")[:1000],
                "raw": trace, "raw_bytes": len(trace.encode()), "replayable": False,
            })
        keep = pc.invert(bad)
        return kept.filter(keep), streams.filter(keep)


def _threaded(gen: Iterator[Batch]) -> Iterator[Batch]:
    """Run a batch generator one batch ahead in a daemon thread (exceptions re-raised here)."""
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop = threading.Event()
    _END = object()

    def run() -> None:
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    t = threading.Thread(target=run, name="flywheel-ingest-parse", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=5)


ProgressFn = Callable[[dict[str, Any]], None]


def ingest_paths(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    paths: list[Path],
    *,
    fmt: str = "auto",
    correlation_id: str | None = None,
    progress: ProgressFn | None = None,
) -> IngestSummary:
    """Ingest trace files (directories are expanded to their ``*.jsonl[.gz]``/``*.json`` files).

    ``fmt``: ``auto`` (per file, from the first parseable record), ``openai``, ``otel`` or ``bfcl``.
    ``progress`` is called after every batch with ``{"file", "records", "bytes_done", "bytes_total"}``.
    Raises :class:`IngestError` before reading anything when a path is unusable, and
    :class:`IngestRefused` when a batch fails the expectation suite.
    """
    if fmt not in ("auto", *formats.FORMATS):
        raise IngestError(f"unknown format {fmt!r}; expected auto, openai, otel or bfcl")
    t0 = time.perf_counter()
    files = _expand_paths(list(paths))
    companions = plan_otlp(cfg, files, fmt)
    summary = IngestSummary()
    committer = _Committer(cfg, store, artifacts, summary, correlation_id)
    # DuckDB defaults to 80% of RAM and never gives pages back on its own: measured here, peak RSS grew
    # from 1.2 GB (10^5 traces) to 2.0 GB (10^6) without a cap (a no-op on PostgreSQL).
    with store.memory_limit(cfg.ingest.duckdb_memory_mb):
        for path in files:
            _ingest_file(cfg, committer, path, fmt, progress, companions.get(path, []))
    summary.elapsed_s = round(time.perf_counter() - t0, 3)
    return summary


def detect_file_format(path: Path, fmt: str, doc: bytes | None, max_line: int, size: int) -> str:
    """``fmt`` unless ``auto``: then from the whole document, or the first parseable line."""
    if fmt != "auto":
        return fmt
    if doc is not None:
        obj, _ = formats.parse_json(doc, strict_unicode=False)
        # An array of records is OpenAI format unless its first record is a BFCL replay record (the
        # first record may be anything: ``[5, {...}]`` is still an array of records).
        fmt = formats.detect_format(obj[0] if isinstance(obj, list) and obj else obj)
        return "openai" if isinstance(obj, list) and fmt != "bfcl" else fmt
    return _sniff_format(path, max_line) if size else "openai"


def document_lines(doc: bytes) -> Iterator[Line]:
    """The records of a whole JSON document: the items of a top-level array, else the document."""
    obj, prob = formats.parse_json(doc, strict_unicode=False)  # a bad element is quarantined alone
    if prob is None and isinstance(obj, list):
        return iter([Line(i + 1, _record_bytes(x)) for i, x in enumerate(obj)])
    return iter([Line(1, doc.replace(b"\n", b" ").replace(b"\r", b" "))])


def plan_otlp(cfg: FlywheelConfig, files: list[Path], fmt: str) -> dict[Path, list[Path]]:
    """Check the tool registry, and pair OTLP span and log-record files (:func:`otlp.plan_files`):
    raises :class:`IngestError` before anything is read when either cannot be used."""
    try:
        load_registry(cfg.ingest.tool_registry)
    except ToolRegistryError as e:
        raise IngestError(str(e)) from None
    if fmt not in ("auto", "otel"):
        return {}
    otel_files = [p for p in files if fmt == "otel" or otlp.looks_like_otlp(p)]
    try:
        return otlp.plan_files(otel_files, cfg.ingest.max_line_bytes)
    except otlp.PairingError as e:
        raise IngestError(str(e)) from None


def _ingest_file(cfg: FlywheelConfig, committer: _Committer, path: Path, fmt: str, progress: ProgressFn | None,
                 companions: list[Path] | None = None) -> None:
    try:
        sha = sha256_file(path)
        size = path.stat().st_size
    except OSError as e:
        raise IngestError(f"{path}: cannot read ({e.strerror or e})") from None
    ingest_id = f"ingest:{sha[:16]}"
    max_line = cfg.ingest.max_line_bytes
    doc = _whole_document(path, max_line) if size else None
    fmt = detect_file_format(path, fmt, doc, max_line, size)
    done = 0

    def commit_all(batches: Iterator[Batch]) -> None:
        nonlocal done
        for b in batches:
            committer.commit(b, ingest_id, sha, causation=[ingest_id],
                             quarantine_stream=f"quarantine:{sha[:16]}-{b.no:05d}", file=path.name, fmt=fmt)
            done += b.read
            if progress:
                progress({"file": str(path), "records": done, "bytes_done": b.bytes_done, "bytes_total": size})

    workers = cfg.ingest.workers if fmt == "openai" else min(cfg.ingest.workers, 1)
    if doc is None and size >= PROCESS_MIN_BYTES and workers:
        prewarm_traces_batch(cfg.ingest)  # overlaps GX's import with the worker's first batch
        with ParallelBatches(cfg.ingest, fmt, path, path.name, sha, size, workers,
                             otel_companions=companions or []) as children:
            commit_all(iter(children))
        stats = children.stats
        assert stats is not None  # iteration only ends normally on the child's "done"
    else:
        prep = Preparer(cfg.ingest, fmt, path.name, sha, path=None if doc is not None else path,
                        otel_companions=companions or [])
        stream, raw = open_source(path)
        if doc is not None:
            lines: Iterator[Line] = document_lines(doc)
        else:
            lines = iter_lines(stream, max_line)
        try:
            commit_all(_threaded(prep.batches(lines, position(raw, size))))
        finally:
            stream.close()
            raw.close()
        stats = prep.stats()
    payload = {
        "entity_id": ingest_id, "file_sha256": sha, "bytes": size, "format": fmt, "lines": stats.lines,
        "records": stats.records, "quarantined": sum(stats.content_counts.values()),
        "quarantined_by_reason": dict(sorted(stats.content_counts.items())),
        "failures_by_kind": dict(sorted(stats.kind_counts.items())), "cut_short": stats.cut,
    }
    table = pa.table({"stream": [ingest_id], "type": ["ingest.completed"], "payload": [canonical_json(payload)],
                      "causation": [[]]}, schema=BATCH_SCHEMA)
    res = committer.store.append_batch(table, correlation_id=committer.correlation_id, validated=True)
    committer.summary.events_appended += res.appended
    committer.summary.files.append({"path": str(path), "sha256": sha, "format": fmt, "ingest_id": ingest_id,
                                    "bytes": size, "cut_short": stats.cut})
