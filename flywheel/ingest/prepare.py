"""Per-record preparation of an ingest batch: lines -> validated, redacted, classified rows.

Everything here is a pure function of the input lines and the ingest configuration; nothing touches
the store. That is what lets :mod:`flywheel.ingest.worker` run it in a separate process (the second
core) while the main process commits the previous batch, and what keeps the thread path (small
files, quarantine replay) and the process path byte-identical.

A prepared :class:`Batch` is columnar: one Arrow table (:data:`PREPARED_SCHEMA`, one row per trace
that survived validation and in-batch dedup) plus the few Python objects the commit needs (the
quarantine rows, the static part of each new failure's payload). Arrow crosses a process boundary
as a few large buffers instead of ~10^6 small Python objects per batch, and the commit works on
columns instead of looping over rows.

Fault isolation: each record (a line, or for OTel an assembled trace) is prepared under
:meth:`Preparer._isolated`. Any exception it raises -- in a reader/adapter, validation, redaction,
classification or serialisation, including readers added later -- quarantines that record with
reason ``internal_error`` and a detail that starts with the exception class; the rest of the file
goes on. Known bad input is not an internal error: a lone surrogate or nesting the store cannot
write is quarantined as ``invalid_unicode`` / ``too_deep`` (named where serialising it fails, see
:meth:`Preparer._accept`), and only real internal errors are logged with a traceback. That holds because :meth:`Preparer._accept` computes everything first, including the JSON
the commit will write for a new failure, and only then adds the record to the batch in one step that
cannot fail. Not covered: an exception in the commit itself (the store, the artifact store, the
expectation suite) still stops the file, as it must: those are not properties of one record; and
the OTLP assembler keeps traces open across lines, so when reading a line raises part-way, what it
had read of that line stays with its traces (the line is quarantined; replaying it later finds
those traces already ingested).

Cost per record (measured on the ``benchmarks/bench_ingest.py`` workload, 2 cores, gc enabled): parse ~7 µs,
validation ~6 µs, classification of a failure ~15 µs (a success: < 1 µs), failure identity ~6 µs,
serialising the redacted trace ~2 µs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from flywheel.classify import classify, failure_identity
from flywheel.config import IngestConfig
from flywheel.ingest import formats
from flywheel.ingest.mlflow_traces import mlflow_to_trace
from flywheel.ingest.otlp import Assembler
from flywheel.ingest.reader import Line
from flywheel.ingest.validate import Limits, validate
from flywheel.redact import Redactor
from flywheel.tool_registry import SOURCES_KEY, load_registry, resolve_undeclared
from flywheel.vocab.ids import canonical_json, short_id
from flywheel.vocab.messages import last_index

log = logging.getLogger(__name__)

# One row per trace that reaches the commit. ``payload_head``/``payload_tail`` are the
# ``trace.ingested`` event payload (canonical JSON) around the artifact reference, which only the
# commit knows: payload = head + <row> + ',"sha256":"<artifact>"' + tail.
PREPARED_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("source", pa.string()),
        ("status", pa.string()),
        ("kinds", pa.list_(pa.string())),
        ("failure_id", pa.string()),
        ("timestamp", pa.string()),
        ("model", pa.string()),
        ("trace", pa.string()),  # canonical JSON of the redacted trace
        ("line", pa.int64()),
        ("timestamp_epoch", pa.float64()),
        ("n_messages", pa.int64()),
        ("roles", pa.string()),
        ("payload_head", pa.string()),
        ("payload_tail", pa.string()),
    ]
)

_SORT = orjson.OPT_SORT_KEYS
_NO_KINDS: list[str] = []
INTERNAL_ERROR = "internal_error"


def utf8_safe(s: str) -> str:
    """``s`` with lone surrogates written as ``\\udXXX`` escapes: Arrow and DuckDB refuse them."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def internal_error_detail(e: BaseException) -> str:
    """The quarantine detail of a record whose preparation raised: the exception class first."""
    return utf8_safe(f"{type(e).__name__}: {e}"[:600] + " (an internal error while preparing this record; the "
                     "rest of the file was ingested. After a fix, `flywheel ingest --replay-quarantine` retries it)")


def _dumps_or_walk(rec: Any) -> bytes:
    """A record's JSON for the redaction prefilter; for one orjson cannot write (a lone surrogate,
    > 255 levels), a text the prefilter always flags, so the record is walked (and fails alone)."""
    try:
        return orjson.dumps(rec)
    except (TypeError, ValueError):
        return b"\\u"


@dataclass
class Batch:
    """A prepared batch (picklable: it crosses the worker's pipe)."""

    no: int
    table: pa.Table
    # failure id -> its payload without the per-occurrence fields (kinds, trace_ids, occurrences,
    # first/last seen), from the batch's first trace of that failure
    first_payloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    read: int = 0
    in_batch_duplicates: int = 0
    bytes_done: int = 0
    redactions: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.table.num_rows


@dataclass
class PrepStats:
    """What the ``ingest.completed`` payload needs once a file has been read to its end."""

    records: int = 0
    lines: int = 0
    cut: str | None = None
    content_counts: dict[str, int] = field(default_factory=dict)  # quarantine reasons
    kind_counts: dict[str, int] = field(default_factory=dict)


def failure_static_payload(rec: dict[str, Any], fid: str, chash: str, details: list[str]) -> dict[str, Any]:
    """The part of a new failure's payload that comes from its first trace."""
    msgs = rec["messages"]
    idx = last_index(msgs, "assistant")
    outcome = rec["outcome"]
    return {
        "entity_id": fid,
        "tools": rec.get("tools") or [],
        "messages": msgs[:idx] if idx is not None else msgs,
        "bad_answer": msgs[idx] if idx is not None else None,
        "correction": rec.get("correction"),
        "tests": outcome.get("tests"),
        "error": outcome.get("error"),
        "feedback": outcome.get("feedback"),
        "declared_kind": outcome.get("kind"),
        "details": details,
        "model": rec["model"],
        "source": rec.get("source") or "openai",
        "source_id": rec.get("source_id"),
        "content_hash": chash,
        # where each called tool's schema came from, when not all from the trace (flywheel.tool_registry)
        **({"tool_schema_sources": rec["metadata"][SOURCES_KEY]}
           if SOURCES_KEY in (rec.get("metadata") or {}) else {}),
    }


def _utf8_column(xs: list[bytes]) -> pa.Array:
    """orjson's outputs as one string column: one join and one offsets array instead of a decode and
    a copy per row (``pa.array(xs, pa.binary()).cast(pa.string())`` measured ~3 µs a row here, a
    Python ``decode`` ~0.3 µs, this ~0.05 µs). orjson only ever writes valid UTF-8, so the
    validation of the bytes that a cast would do is skipped."""
    data = b"".join(xs)
    if len(data) >= 2**31 - 1:  # beyond 32-bit offsets: let pyarrow chunk or refuse it
        return pa.array([x.decode() for x in xs], pa.string())
    offsets = np.zeros(len(xs) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, xs), dtype=np.int32, count=len(xs)), out=offsets[1:])
    arr = pa.StringArray.from_buffers(len(xs), pa.py_buffer(offsets), pa.py_buffer(data))
    arr.validate()
    return arr


class _Rows:
    """Column lists of one batch under construction."""

    __slots__ = ("trace_id", "source", "status", "kinds", "failure_id", "timestamp", "model", "trace", "line",
                 "epoch", "n_messages", "roles", "head", "tail")

    def __init__(self) -> None:
        for s in self.__slots__:
            setattr(self, s, [])

    def add(self, trace_id: str, source: str, status: str, kinds: list[str], failure_id: str | None, timestamp: str,
            model: str, trace: bytes, line: int, epoch: float, n_messages: int, roles: str, head: bytes,
            tail: bytes) -> None:
        """One row, all columns at once (list appends: nothing here can fail half-way)."""
        self.trace_id.append(trace_id)
        self.source.append(source)
        self.status.append(status)
        self.kinds.append(kinds)
        self.failure_id.append(failure_id)
        self.timestamp.append(timestamp)
        self.model.append(model)
        self.trace.append(trace)
        self.line.append(line)
        self.epoch.append(epoch)
        self.n_messages.append(n_messages)
        self.roles.append(roles)
        self.head.append(head)
        self.tail.append(tail)

    def table(self) -> pa.Table:
        return pa.table([
            pa.array(self.trace_id, pa.string()), pa.array(self.source, pa.string()),
            pa.array(self.status, pa.string()), pa.array(self.kinds, pa.list_(pa.string())),
            pa.array(self.failure_id, pa.string()), pa.array(self.timestamp, pa.string()),
            pa.array(self.model, pa.string()), _utf8_column(self.trace), pa.array(self.line, pa.int64()),
            pa.array(self.epoch, pa.float64()), pa.array(self.n_messages, pa.int64()),
            pa.array(self.roles, pa.string()), _utf8_column(self.head), _utf8_column(self.tail),
        ], schema=PREPARED_SCHEMA)


class Preparer:
    """Turns lines into prepared batches. Holds no store state (it runs off the main thread, or in
    the worker process)."""

    def __init__(self, icfg: IngestConfig, fmt: str, file_name: str, file_sha: str, *, path: Path | None = None,
                 otel_companions: Sequence[Path] = ()):
        # ``path``: the file the lines come from (OTLP files are scanned once for where each trace
        # ends; None for a single JSON document). ``otel_companions``: see flywheel.ingest.otlp.plan_files.
        self.icfg = icfg
        self.tool_registry = load_registry(getattr(icfg, "tool_registry", None))
        self.redactor = Redactor.from_config(icfg)
        self.limits = Limits.from_config(icfg)
        self.fmt = fmt
        self.file_name = utf8_safe(file_name)  # a file name with undecodable bytes
        self.file_sha = file_sha
        self.bfcl = formats.BfclAdapter() if fmt == "bfcl" else None
        self.content_counts: Counter[str] = Counter()  # content-derived, for ingest.completed
        self.kind_counts: Counter[str] = Counter()
        self.records = 0
        self.internal_errors = 0
        self.lines = 0
        self.cut: str | None = None
        self.otel = Assembler(path, otel_companions, icfg.max_line_bytes) if fmt == "otel" else None
        self._otel_ready: list[tuple[Line, dict[str, Any]]] = []
        self._raw_kept: set[int] = set()  # OTLP lines whose raw text a quarantine row holds already
        # Per-batch state, set by _process.
        self._rows = _Rows()
        self._first: dict[str, dict[str, Any]] = {}

    def stats(self) -> PrepStats:
        return PrepStats(self.records, self.lines, self.cut, dict(self.content_counts), dict(self.kind_counts))

    # quarantine ---------------------------------------------------------------------------------
    def _quarantine(self, b: Batch, line: Line, reason: str, detail: str, replayable: bool = True) -> None:
        if line.lineno in self._raw_kept:
            # An OTLP line holds many traces, each quarantined on its own: the line's raw text is stored
            # once, with the first of them (a replay reads it from there), not once per trace.
            try:
                detail = self.redactor.text(utf8_safe(detail))
            except Exception:  # noqa: BLE001 - quarantining must not fail; unchecked text is never kept
                detail = utf8_safe(detail.split(":", 1)[0])
            b.quarantine.append({
                "file": self.file_name, "file_sha256": self.file_sha, "line": line.lineno, "format": self.fmt,
                "reason": reason, "detail": detail[:1000], "raw": f"[raw text of line {line.lineno}: stored once, "
                "with the first record quarantined from it]", "raw_bytes": line.oversize or len(line.data),
                "replayable": False,
            })
            self.content_counts[reason] += 1
            return
        if self.fmt == "otel":
            self._raw_kept.add(line.lineno)
        raw = line.data.decode("utf-8", errors="backslashreplace").rstrip("\r\n")
        try:
            raw = self.redactor.raw(raw)
            detail = self.redactor.text(utf8_safe(detail))
        except Exception as e:  # noqa: BLE001 - quarantining must not fail; unchecked text is never kept
            raw, replayable = f"[raw text withheld: its redaction raised {type(e).__name__}]", False
            detail = utf8_safe(detail.split(":", 1)[0])
        b.quarantine.append({
            "file": self.file_name, "file_sha256": self.file_sha, "line": line.lineno, "format": self.fmt,
            "reason": reason, "detail": detail[:1000], "raw": raw, "raw_bytes": line.oversize or len(line.data),
            "replayable": replayable,
        })
        self.content_counts[reason] += 1

    def _isolated(self, b: Batch, line: Line, counted: bool, step: Callable[..., None], *args: Any) -> None:
        """Run one record's ``step``; an exception quarantines the record as ``internal_error`` instead
        of stopping the file (see the module docstring for why the batch needs no undo). ``counted``:
        the record is already in ``b.read`` (else the step counts it, or this does if it fails first)."""
        read = b.read
        try:
            step(*args)
        except Exception as e:  # noqa: BLE001 - isolation is the point: one record never stops a file
            self.internal_errors += 1
            # The first few are logged with their traceback (a bug to report); the summary counts all.
            (log.warning if self.internal_errors <= 3 else log.debug)(
                "%s line %d: internal error while preparing the record (%s: %s); quarantined",
                self.file_name, line.lineno, type(e).__name__, e, exc_info=True)
            if not counted and b.read == read:
                b.read += 1
            self._quarantine(b, line, INTERNAL_ERROR, internal_error_detail(e))

    # records --------------------------------------------------------------------------------------
    def _accept(self, b: Batch, line: Line, rec: Any, needs_redaction: bool, seen: set[str]) -> None:
        """Accept one record; one the store cannot hold (a lone surrogate, nesting deeper than orjson's 255
        levels) is quarantined as bad input (``invalid_unicode``, ``too_deep``), not as an internal error.
        Serialisation is where such a record fails: the walk that names the reason runs only then."""
        try:
            self._accept_record(b, line, rec, needs_redaction, seen)
        except (TypeError, ValueError, RecursionError):
            prob = formats.bad_input_problem(rec)
            if prob is None:
                raise  # not the input's shape: a real internal error (_isolated logs it)
            self._quarantine(b, line, *prob)

    def _accept_record(self, b: Batch, line: Line, rec: Any, needs_redaction: bool, seen: set[str]) -> None:
        rec = resolve_undeclared(rec, self.tool_registry)
        prob, dt = validate(rec, self.limits)
        if prob:
            self._quarantine(b, line, prob[0], prob[1])
            return
        if needs_redaction and self.redactor.enabled:
            before = dict(self.redactor.counts)
            original_id = rec["trace_id"]
            rec = self.redactor.trace(rec)
            if rec["trace_id"] != original_id:
                # An id that itself carries PII is replaced by a stable pseudonym.
                rec["trace_id"] = "redacted-" + short_id(utf8_safe(original_id))
            for k, v in self.redactor.counts.items():
                if v != before.get(k, 0):
                    b.redactions[k] = b.redactions.get(k, 0) + v - before.get(k, 0)
        tid = rec["trace_id"]
        if tid in seen:
            self.records += 1
            b.in_batch_duplicates += 1
            return
        cls = classify(rec)
        first = None
        if cls.failed:
            fid, chash = failure_identity(rec)
            kinds = cls.kinds
            status = "failure"
            # Only the first trace of each failure in the batch is needed (a new failure's payload).
            if fid not in self._first:
                first = failure_static_payload(rec, fid, chash, cls.details)
                # The commit writes this payload as the store's canonical JSON (strict: no lone
                # surrogates, no infinities, bounded depth). Writing it here makes a record that
                # cannot be written fail alone, instead of failing the commit of its whole batch.
                canonical_json(first).encode("utf-8")
        else:
            fid, kinds, status = None, _NO_KINDS, "success"
        msgs = rec["messages"]
        source = rec.get("source") or "openai"
        model = rec["model"]
        ts = dt.isoformat().replace("+00:00", "Z")  # type: ignore[union-attr]
        n_msgs = len(msgs)
        trace = orjson.dumps(rec, option=_SORT)
        # The trace.ingested payload, keys in sorted order (it is canonical JSON, so the store's event
        # id of a re-ingested trace is the same): everything but the artifact reference, which the
        # commit splices in between head and tail. No floats here, so orjson's output equals
        # store.canonical_json.
        head = orjson.dumps({
            "failure_id": fid, "kinds": kinds, "model": model, "n_messages": n_msgs, "source": source,
            "source_id": rec.get("source_id"), "status": status, "timestamp": ts,
        })
        tail = b'},"trace_id":' + orjson.dumps(tid) + b"}"
        roles = ",".join([m["role"] for m in msgs])
        # Everything that can fail has run: count the record and add its row.
        self.records += 1
        seen.add(tid)
        for k in kinds:
            self.kind_counts[k] += 1
        if first is not None:
            self._first[fid] = first  # type: ignore[index]
        self._rows.add(tid, source, status, kinds, fid, ts, model, trace, line.lineno,
                       dt.timestamp(), n_msgs, roles, head[:-1] + b',"trace":{"row":', tail)  # type: ignore[union-attr]

    def _otel_line(self, b: Batch, line: Line, obj: Any, seen: set[str]) -> None:
        problems, ready = self.otel.feed(obj, line)  # type: ignore[union-attr]
        for reason, detail in problems:
            self._quarantine(b, line, reason, detail)
        for tid in ready:
            self._emit_otel(b, tid, seen)

    def _emit_otel(self, b: Batch, tid: str, seen: set[str]) -> None:
        line = self.otel.line_of(tid)  # type: ignore[union-attr]
        self._isolated(b, line, False, self._take_otel, b, tid)

    def _take_otel(self, b: Batch, tid: str) -> None:
        b.read += 1
        rec, prob, line = self.otel.take(tid)  # type: ignore[union-attr]
        if prob:
            self._quarantine(b, line, prob[0], prob[1])
            return
        self._otel_ready.append((line, rec))

    def _accept_otel(self, b: Batch, seen: set[str]) -> None:
        """Accept the traces assembled in this batch. They get the vectorised redaction prefilter that
        OpenAI lines get, on their serialised form: walking every string of every trace cost ~65 µs a
        trace in the OTLP benchmark, the batch check a few µs."""
        ready, self._otel_ready = self._otel_ready, []
        if not ready:
            return
        needs = self.redactor.lines_need_redaction([_dumps_or_walk(rec) for _, rec in ready])
        for (line, rec), need in zip(ready, needs, strict=True):
            self._isolated(b, line, True, self._accept, b, line, rec, need, seen)

    def batches(self, lines: Iterator[Line], pos: Callable[[], int], *, stride: int = 1,
                offset: int = 0) -> Iterator[Batch]:
        """Batches of ``batch_size`` non-blank lines (OTLP: lines holding the ends of about that many
        traces), numbered from 0. With ``stride`` > 1 only the
        batches numbered ``offset`` mod ``stride`` are prepared (the lines of the others are counted,
        not parsed), so that ``stride`` workers can share one file; their batches interleave back
        into the single-worker sequence. Only for formats without state across lines (not OTel)."""
        if stride > 1 and self.fmt == "otel":
            raise ValueError("OTel traces span lines: one preparer must read the whole file")
        size = self.icfg.batch_size
        no = 0
        chunk: list[Line] = []
        n_chunk = 0
        mine = offset == 0
        end: Line | None = None
        for line in lines:
            if line.error:
                end = line
                break
            self.lines = line.lineno
            if line.lineno == 1 and line.data.startswith(b"\xef\xbb\xbf"):
                line = Line(1, line.data[3:], line.oversize)
            if line.oversize or line.data.strip():
                if mine:
                    chunk.append(line)
                # An OTLP line holds many traces: its weight is the traces that end on it.
                n_chunk += 1 if self.otel is None else self.otel.line_weight(line.lineno)
            if n_chunk >= size:
                if mine:
                    yield self._process(no, chunk, None, pos)
                no += 1
                mine = no % stride == offset
                chunk = []
                n_chunk = 0
        if mine:
            yield self._process(no, chunk, end, pos, last=True)

    def _process(self, no: int, chunk: list[Line], end: Line | None, pos: Callable[[], int],
                 last: bool = False) -> Batch:
        b = Batch(no, PREPARED_SCHEMA.empty_table())
        self._rows, self._first = _Rows(), {}
        seen: set[str] = set()
        needs: list[bool] | None = None
        if self.fmt == "openai" and chunk:
            needs = self.redactor.lines_need_redaction([ln.data for ln in chunk])
        for i, line in enumerate(chunk):
            # Drop the raw line once read (``chunk`` is the caller's, which discards it next): the batch's
            # raw text (~50 MB) is freed while its serialised traces accumulate, not held to the end.
            chunk[i] = None  # type: ignore[call-overload]
            if line.oversize:
                b.read += 1
                self._quarantine(b, line, "line_too_long",
                                 f"{line.oversize} bytes > ingest.max_line_bytes={self.icfg.max_line_bytes}",
                                 replayable=False)
            else:
                self._isolated(b, line, False, self._record, b, line, seen, True if needs is None else needs[i])
        if end is not None:
            self.cut = end.error
            b.read += 1
            self._quarantine(b, end, "truncated_file", end.error or "", replayable=False)
        if last and self.otel is not None:  # OTLP traces still open: complete at the end of the file
            for tid in self.otel.remaining():
                self._emit_otel(b, tid, seen)
        if self.otel is not None:
            self._accept_otel(b, seen)
        b.table = self._rows.table()
        b.first_payloads = self._first
        self._rows, self._first = _Rows(), {}
        b.bytes_done = pos()
        return b

    def _record(self, b: Batch, line: Line, seen: set[str], needs_redaction: bool = True) -> None:
        obj, prob = formats.parse_json(line.data)
        if self.fmt != "otel":
            b.read += 1
        if prob:
            if self.fmt == "otel":
                b.read += 1
            self._quarantine(b, line, prob[0], prob[1])
            return
        if self.fmt == "openai":
            self._accept(b, line, obj, needs_redaction, seen)
        elif self.fmt in ("bfcl", "mlflow"):
            rec, prob = self.bfcl.to_trace(obj) if self.bfcl else mlflow_to_trace(obj)
            if prob:
                self._quarantine(b, line, prob[0], prob[1])
            else:
                self._accept(b, line, rec, True, seen)
        else:
            self._otel_line(b, line, obj, seen)
