"""``flywheel collect``: an OTLP/HTTP receiver that writes what agents export into the ingest inbox.

An agent (or an OpenTelemetry Collector's ``otlphttp`` exporter) sends to
``http://<host>:<port>/v1/traces`` and ``/v1/logs``: ``ExportTraceServiceRequest`` /
``ExportLogsServiceRequest`` as ``application/x-protobuf`` or ``application/json`` (OTLP/JSON: hex
ids, base64 accepted too), optionally ``Content-Encoding: gzip``. Bodies are parsed with the
OpenTelemetry protobuf definitions (``opentelemetry-proto``: ``FromString`` for protobuf,
``json_format.ParseDict`` for JSON), never by hand; a body that does not parse gets 400 and nothing of
it is kept. A parsed body gets 200 with an empty ``Export*ServiceResponse`` in the request's encoding.

Batches: records are grouped by trace id in memory. A trace is written when it has its root span and
nothing of it arrived for ``settle_s`` (spans and log records come from separate exporters, each
batching for up to 5 s by default: the SDK's ``BatchSpanProcessor`` schedule delay is 5000 ms, so the
default ``settle_s`` is 10), when nothing arrived for ``10 * settle_s`` (a root that lives in another
service never comes), ``max_age_s`` after its first record however busy it is, at once when a request
would take it past ``max_trace_bytes`` (that request gets 429), when more than ``max_pending`` traces are
held (the oldest first), when everything held would pass ``max_held_bytes`` (503; the oldest first, down
to half), and at shutdown (SIGINT/SIGTERM). Log records without a trace id are written once the oldest
is ``settle_s`` old. Resource and scope entries are held only while a held record uses them. Every
request is redacted (:class:`flywheel.redact.Redactor`, ingest's rules) before it is held. A batch is one
file in the inbox: written under a temporary name in the same directory, fsynced, renamed to
``otlp-<UTC time>-<pid>-<n>.jsonl``; one export request per line (spans, then logs), what a Collector's
file exporter writes and what ``flywheel ingest`` reads.

Guarantees
- A file in the inbox is complete (the rename is atomic) and never rewritten.
- A trace's spans and log records land in one file (unless it outlives the settle window, then its
  later records go to a later file and are reported at ingest), so ingest joins them.
- With an API key set, every request must carry ``Authorization: Bearer <key>``; binding to anything
  but loopback requires one. The ``Host`` header must name the bound address or an allowed name
  (400 otherwise: DNS rebinding). ``flywheel serve``'s connection bounds apply (:class:`CollectLimits`).
- Memory is bounded by ``max_held_bytes`` (plus one request being decoded).
- Acknowledged records leave memory only once the file holding them is durably written; a write error
  keeps them (logged, counted, retried every round), and never stops the flush thread.

Not guaranteed: data acknowledged but still held in memory is lost when the process is SIGKILLed (up
to ``max_age_s`` of traffic; put a Collector with a persistent queue in front where that matters).
Not covered: OTLP/gRPC (port 4317), metrics, partial-success responses.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hmac
import logging
import os
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from flywheel.artifacts import fsync_dir
from flywheel.net import LOOPBACK_HOSTS, allowed_hosts_for, bind, head_timeout_protocol, host_name

log = logging.getLogger(__name__)

_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


class CollectError(ValueError):
    """A request body that cannot be read as an OTLP export request (the message says why)."""


def _ids_to_hex(node: Any) -> Any:
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants trace and span ids as hex."""
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _ids_to_hex(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_ids_to_hex(x) for x in node]
    return node


def _ids_to_b64(node: Any) -> Any:
    """OTLP/JSON hex ids -> the base64 that ``json_format.ParseDict`` expects for ``bytes`` fields."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _ID_KEYS and isinstance(v, str):
                try:
                    out[k] = base64.b64encode(bytes.fromhex(v)).decode() if v else ""
                except ValueError:
                    out[k] = v  # not hex: base64 already, or invalid (ParseDict says which)
            else:
                out[k] = _ids_to_b64(v)
        return out
    if isinstance(node, list):
        return [_ids_to_b64(x) for x in node]
    return node


def _message_class(signal: str) -> Any:
    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        return ExportTraceServiceRequest
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    return ExportLogsServiceRequest


def _response_class(signal: str) -> Any:
    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        return ExportTraceServiceResponse
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

    return ExportLogsServiceResponse


def decode_request(signal: str, body: bytes, content_type: str, *, max_bytes: int) -> dict[str, Any]:
    """An OTLP/HTTP request body (``signal``: traces | logs) as an OTLP/JSON dict with hex ids.

    Raises :class:`CollectError` for an unknown content type or a body that does not parse."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError

    cls = _message_class(signal)
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/x-protobuf":
        try:
            msg = cls.FromString(body)
        except DecodeError as e:
            raise CollectError(f"body is not a protobuf {cls.__name__}: {e}") from None
    elif ctype == "application/json":
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise CollectError(f"body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise CollectError(f"body must be a JSON object ({cls.__name__})")
        try:
            msg = json_format.ParseDict(_ids_to_b64(data), cls())
        except json_format.ParseError as e:
            raise CollectError(f"body is not an OTLP/JSON {cls.__name__}: {str(e)[:300]}") from None
    else:
        raise CollectError(f"Content-Type must be application/x-protobuf or application/json, not {content_type!r}")
    return _ids_to_hex(json_format.MessageToDict(msg, use_integers_for_enums=True))


def _key(d: Any) -> bytes:
    return orjson.dumps(d or {}, option=orjson.OPT_SORT_KEYS)


class Overloaded(Exception):
    """A request refused for a bound (``status``: 429 one trace over its budget, 503 the receiver as a
    whole); nothing of it was kept. OTLP exporters retry both, after ``retry_after_s``."""

    def __init__(self, status: int, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


@dataclass
class CollectLimits:
    """The receiver's bounds (``flywheel collect`` options; see docs/connect-your-agent.md).

    ``max_trace_bytes``: records held for one trace (their OTLP/JSON size); a request that would take
    a trace past it gets 429 and the trace is written at once, so the retry starts its next part.
    ``max_held_bytes``: records held in memory in all (resources and scopes included); past it a
    request gets 503 while the oldest traces are written. ``max_age_s``: a trace is written this long
    after its first record however busy it is (a trace that kept receiving spans within ``settle_s``
    was never written). ``header_timeout_s``/``body_timeout_s``/``max_connections``: as ``flywheel
    serve``'s (a connection that sends no complete request head in time is closed; a body not received
    in time gets 408; connections plus running requests past ``max_connections`` get 503)."""

    max_trace_bytes: int = 32 << 20
    max_held_bytes: int = 512 << 20
    max_age_s: float = 120.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 64

    def __post_init__(self) -> None:
        for name in ("max_trace_bytes", "max_held_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("max_age_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")


Rec = tuple[bytes, bytes, dict]  # (resource key, scope key, span or log record)


@dataclass
class _Trace:
    first: float
    last: float
    root: bool = False
    spans: list[Rec] = field(default_factory=list)
    logs: list[Rec] = field(default_factory=list)
    size: int = 0
    write_now: bool = False  # over its budget: written at the next tick


@dataclass
class CollectStats:
    requests: int = 0
    rejected: int = 0
    overloaded: int = 0  # 429/503 answers
    spans: int = 0
    log_records: int = 0
    traces_written: int = 0
    write_errors: int = 0
    files: list[str] = field(default_factory=list)


# OTLP fields that are structure, not content: ids and nanosecond timestamps (JSON strings of digits).
# Redaction leaves them alone: a 19-digit timestamp that passes the Luhn check (one in ten) was replaced
# as a card number, and the trace then started in 1970 and was quarantined by ingest.
OTLP_STRUCTURE_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "startTimeUnixNano", "endTimeUnixNano",
                                 "timeUnixNano", "observedTimeUnixNano"})


class Batcher:
    """Groups records by trace and writes finished traces to the inbox (see the module docstring).
    Thread-safe; ``clock`` is injectable for tests.

    Memory is bounded (:class:`CollectLimits`): every held record is counted by its OTLP/JSON size;
    a resource or scope is kept only while a held record refers to it. Records leave memory only once
    the file holding them is durably written (fsync, atomic rename, directory fsync): a write error
    keeps them, is counted and logged, and the write is retried at the next tick."""

    def __init__(self, inbox: Path, *, settle_s: float = 10.0, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, on_write: Callable[[Path, int], None] | None = None,
                 limits: CollectLimits | None = None, redactor: Any = None):
        self.inbox = Path(inbox)
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.settle_s, self.max_pending, self.clock, self.on_write = settle_s, max_pending, clock, on_write
        self.limits = limits or CollectLimits()
        self.redactor = redactor  # flywheel.redact.Redactor: nothing reaches the inbox unredacted
        self._lock = threading.RLock()
        self._traces: dict[str, _Trace] = {}
        self._loose_logs: list[Rec] = []
        self._loose_first: float | None = None
        self._loose_size = 0
        self._objs: dict[bytes, Any] = {}  # resource/scope key -> the dict
        self._refs: dict[bytes, int] = {}  # resource/scope key -> held records referring to it
        self._held = 0  # bytes of every held record, resource and scope
        self._seq = 0
        self._make_room = False  # a request was refused for the overall budget: write the oldest
        self.stats = CollectStats()

    @property
    def held_bytes(self) -> int:
        return self._held

    def _ref(self, key: bytes, obj: dict[str, Any]) -> None:
        if key not in self._objs:
            self._objs[key] = obj
            self._held += len(key)
        self._refs[key] = self._refs.get(key, 0) + 1

    def _unref(self, key: bytes) -> None:
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:  # no held record refers to it: evicted
            del self._refs[key]
            del self._objs[key]
            self._held -= len(key)

    def add(self, signal: str, req: dict[str, Any]) -> None:
        """Hold the records of one export request (redacted first). Raises :class:`Overloaded`
        (nothing of the request kept) when it would take a trace past ``max_trace_bytes`` (429) or
        everything held past ``max_held_bytes`` (503)."""
        if self.redactor is not None:
            req = self.redactor.value(req, keep=OTLP_STRUCTURE_KEYS)
        outer, inner, leaf = ("resourceSpans", "scopeSpans", "spans") if signal == "traces" else \
            ("resourceLogs", "scopeLogs", "logRecords")
        items: list[tuple[str, bytes, dict, bytes, dict, dict, int]] = []
        for r in req.get(outer) or ():
            res = {k: v for k, v in r.items() if k != inner}
            rk = _key(res)
            for sc in r.get(inner) or ():
                scope = {k: v for k, v in sc.items() if k != leaf}
                sk = _key(scope)
                for rec in sc.get(leaf) or ():
                    size = len(orjson.dumps(rec))
                    items.append((rec.get("traceId") or "", rk, res, sk, scope, rec, size))
        lim = self.limits
        with self._lock:
            now = self.clock()
            per: dict[str, int] = {}
            for tid, *_, size in items:
                per[tid] = per.get(tid, 0) + size
            new_objs = {k: 0 for it in items for k in (it[1], it[3]) if k not in self._objs}
            total = sum(per.values()) + sum(len(k) for k in new_objs)
            for tid, n in per.items():
                t = self._traces.get(tid) if tid else None
                if t is not None and t.size and t.size + n > lim.max_trace_bytes:
                    t.write_now = True
                    self.stats.overloaded += 1
                    raise Overloaded(429, f"trace {tid} holds {t.size} bytes; this request would take it past "
                                          f"{lim.max_trace_bytes} (--max-trace-mb): it is being written, retry", 1)
            if self._held and self._held + total > lim.max_held_bytes:
                self.stats.overloaded += 1
                self._make_room = True
                raise Overloaded(503, f"the receiver holds {self._held} bytes; this request would take it past "
                                      f"{lim.max_held_bytes} (--max-held-mb): writing the oldest traces, retry", 2)
            for tid, rk, res, sk, scope, rec, size in items:
                self._ref(rk, res)
                self._ref(sk, scope)
                self._held += size
                if signal == "logs" and not tid:
                    self._loose_logs.append((rk, sk, rec))
                    self._loose_size += size
                    if self._loose_first is None:
                        self._loose_first = now
                    self.stats.log_records += 1
                    continue
                t = self._traces.get(tid)
                if t is None:
                    t = self._traces[tid] = _Trace(now, now)
                t.last = now
                t.size += size
                if signal == "traces":
                    t.spans.append((rk, sk, rec))
                    t.root = t.root or not rec.get("parentSpanId")
                    self.stats.spans += 1
                else:
                    t.logs.append((rk, sk, rec))
                    self.stats.log_records += 1
            over = len(self._traces) - self.max_pending
        if over > 0:
            self._flush_logged(oldest=over)

    def due(self) -> list[str]:
        """Trace ids to write now: settled with their root, silent for ``10 * settle_s``, older than
        ``max_age_s``, or over their byte budget."""
        now = self.clock()
        with self._lock:
            return [tid for tid, t in self._traces.items()
                    if t.write_now or now - t.first >= self.limits.max_age_s
                    or (t.root and now - t.last >= self.settle_s) or now - t.last >= 10 * self.settle_s]

    def loose_due(self) -> bool:
        """Log records without a trace id are written once the oldest is ``settle_s`` old (they were
        held until some trace came due: forever, on a receiver that only got logs)."""
        with self._lock:
            return self._loose_first is not None and self.clock() - self._loose_first >= self.settle_s

    def tick(self) -> Path | None:
        """One round of the flusher: what is due, log-only records that are due, and the oldest traces
        when a request was refused for the overall budget (down to half of it)."""
        tids = self.due()
        with self._lock:
            if self._make_room:
                self._make_room = False
                goal = self.limits.max_held_bytes // 2
                freed = 0
                for tid in sorted(self._traces, key=lambda t: self._traces[t].first):
                    if self._held - freed <= goal:
                        break
                    if tid not in tids:
                        tids.append(tid)
                    freed += self._traces[tid].size
        if tids or self.loose_due():
            return self.flush(tids, loose=True)
        return None

    def _flush_logged(self, **kw: Any) -> Path | None:
        try:
            return self.flush(**kw)
        except OSError:
            return None  # counted and logged by flush; the records stay held

    def flush(self, tids: list[str] | None = None, *, oldest: int = 0, everything: bool = False,
              loose: bool = True) -> Path | None:
        """Write the given traces (or the ``oldest`` n, or all), with the log records that have no
        trace id when ``loose``, as one inbox file; None when there is nothing. The records leave
        memory only after the file is durably written; an ``OSError`` leaves them held (counted in
        ``stats.write_errors``, logged) and is raised."""
        with self._lock:
            if everything:
                tids = list(self._traces)
            elif oldest:
                tids = sorted(self._traces, key=lambda t: self._traces[t].first)[:oldest]
            picked_ids = [t for t in dict.fromkeys(tids or ()) if t in self._traces]
            picked = [self._traces[t] for t in picked_ids]
            loose_recs = list(self._loose_logs) if loose or everything else []
            if not picked and not loose_recs:
                return None
            spans = [x for t in picked for x in t.spans]
            logs = [x for t in picked for x in t.logs] + loose_recs
            lines = []
            if spans:
                lines.append(orjson.dumps({"resourceSpans": self._group(spans, "scopeSpans", "spans")}))
            if logs:
                lines.append(orjson.dumps({"resourceLogs": self._group(logs, "scopeLogs", "logRecords")}))
            self._seq += 1
            name = f"otlp-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{self._seq:06d}.jsonl"
            try:
                path = self._write(name, b"\n".join(lines) + b"\n")
            except OSError as e:
                self.stats.write_errors += 1
                log.error("collect: could not write %s to %s (%s); its %d trace(s) stay in memory and are "
                          "retried", name, self.inbox, e, len(picked))
                raise
            # Durably written: only now do the records leave memory.
            for tid, t in zip(picked_ids, picked, strict=True):
                del self._traces[tid]
                self._held -= t.size
                for rk, sk, _ in (*t.spans, *t.logs):
                    self._unref(rk)
                    self._unref(sk)
            if loose_recs:
                del self._loose_logs[:len(loose_recs)]
                self._held -= self._loose_size
                self._loose_size = 0
                self._loose_first = None if not self._loose_logs else self.clock()
                for rk, sk, _ in loose_recs:
                    self._unref(rk)
                    self._unref(sk)
            self.stats.traces_written += len(picked)
            self.stats.files.append(str(path))
        if self.on_write:
            self.on_write(path, len(picked))
        return path

    def _group(self, items: list[Rec], inner: str, leaf: str) -> list[dict[str, Any]]:
        by_res: dict[bytes, dict[bytes, list[dict]]] = {}
        for rk, sk, rec in items:
            by_res.setdefault(rk, {}).setdefault(sk, []).append(rec)
        return [{**self._objs[rk], inner: [{**self._objs[sk], leaf: recs} for sk, recs in scopes.items()]}
                for rk, scopes in by_res.items()]

    def _write(self, name: str, data: bytes) -> Path:
        final = self.inbox / name
        tmp = self.inbox / f".{name}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(self.inbox)  # the rename itself survives a crash once the directory is synced
        return final


def create_app(batcher: Batcher, *, api_key: str | None = None, max_body_bytes: int = 16 << 20,
               allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> Any:
    """The ASGI app: ``POST /v1/traces``, ``POST /v1/logs``, ``GET /health``. Every request's ``Host``
    header must name one of ``allowed_hosts`` (400 otherwise: a DNS-rebinding page names its own)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    key = api_key.encode() if api_key else None
    hosts = frozenset(allowed_hosts)
    body_timeout_s = batcher.limits.body_timeout_s

    def _guard(request: Request) -> Response | None:
        if "*" not in hosts and host_name(request.headers.get("host")) not in hosts:
            batcher.stats.rejected += 1
            return JSONResponse({"code": 3, "message": "this receiver does not answer to that Host header "
                                 "(flywheel collect --allowed-host)"}, status_code=400, headers={"Connection": "close"})
        if key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
                batcher.stats.rejected += 1
                return JSONResponse({"code": 16, "message": "missing or invalid API key"}, status_code=401)
        return None

    async def export(request: Request) -> Response:
        signal = request.url.path.rsplit("/", 1)[-1]
        ctype = request.headers.get("content-type", "")
        refused = _guard(request)
        if refused is not None:
            return refused
        body = bytearray()
        try:
            async with asyncio.timeout(body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > max_body_bytes:
                        batcher.stats.rejected += 1
                        return JSONResponse({"code": 8, "message": f"body over {max_body_bytes} bytes"},
                                            status_code=413, headers={"Connection": "close"})
        except TimeoutError:
            batcher.stats.rejected += 1
            return JSONResponse({"code": 4, "message": f"request body not received within {body_timeout_s:g} s"},
                                status_code=408, headers={"Connection": "close"})
        data = bytes(body)
        if request.headers.get("content-encoding", "").lower() == "gzip":
            try:
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                data = d.decompress(data, max_body_bytes + 1)
                if len(data) > max_body_bytes or d.unconsumed_tail:
                    batcher.stats.rejected += 1
                    return JSONResponse({"code": 8, "message": f"decompressed body over {max_body_bytes} bytes"},
                                        status_code=413)
            except (zlib.error, gzip.BadGzipFile) as e:
                batcher.stats.rejected += 1
                return _bad(f"gzip body does not decompress: {e}", ctype)
        try:
            req = decode_request(signal, data, ctype, max_bytes=max_body_bytes)
        except CollectError as e:
            batcher.stats.rejected += 1
            return _bad(str(e), ctype)
        try:
            batcher.add(signal, req)
        except Overloaded as e:
            # google.rpc.Status RESOURCE_EXHAUSTED (8) / UNAVAILABLE (14); OTLP exporters retry 429 and
            # 503, honouring Retry-After
            return JSONResponse({"code": 8 if e.status == 429 else 14, "message": str(e)}, status_code=e.status,
                                headers={"Retry-After": str(e.retry_after_s)})
        batcher.stats.requests += 1
        resp = _response_class(signal)()
        if ctype.startswith("application/x-protobuf"):
            return Response(resp.SerializeToString(), media_type="application/x-protobuf")
        return JSONResponse({})

    def _bad(message: str, ctype: str) -> Response:
        # google.rpc.Status in its JSON shape (code 3 = INVALID_ARGUMENT) for both encodings: exporters
        # log the body of a 4xx, they do not parse it
        return JSONResponse({"code": 3, "message": message}, status_code=400)

    async def health(request: Request) -> Response:
        refused = _guard(request)
        if refused is not None:
            return refused
        return JSONResponse({"status": "ok", "pending_traces": len(batcher._traces), "held_bytes": batcher.held_bytes,
                             "write_errors": batcher.stats.write_errors})

    return Starlette(routes=[Route("/v1/traces", export, methods=["POST"]), Route("/v1/logs", export, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


class Flusher:
    """The thread that writes due traces every ``min(1, settle_s / 2)`` seconds. A write error never
    ends it (the records stay held and the write is retried at the next tick)."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="flywheel-collect-flush", daemon=True)

    def _loop(self) -> None:
        interval = min(1.0, self.batcher.settle_s / 2)
        while not self.stop.wait(interval):
            try:
                self.batcher.tick()
            except OSError:
                pass  # counted and logged by Batcher.flush; retried at the next tick
            except Exception:  # noqa: BLE001 - the flusher must outlive any one bad round
                log.exception("collect: the flush round failed; retried at the next tick")

    def start(self) -> Flusher:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def uvicorn_config(app: Any, limits: CollectLimits, **kwargs: Any) -> Any:
    """uvicorn's config with ``flywheel serve``'s bounds: a request-head deadline, a connection limit."""
    import uvicorn

    return uvicorn.Config(app, http=head_timeout_protocol(limits.header_timeout_s),
                          limit_concurrency=limits.max_connections, **kwargs)


@contextlib.contextmanager
def run_in_thread(batcher: Batcher, *, api_key: str | None = None, max_body_bytes: int = 16 << 20,
                  host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] | None = None) -> Iterator[str]:
    """The receiver and its flusher in background threads (tests, embedding); yields the base URL.
    On exit: stopped, joined, and every held trace written."""
    import uvicorn

    app = create_app(batcher, api_key=api_key, max_body_bytes=max_body_bytes,
                     allowed_hosts=allowed_hosts or allowed_hosts_for(host))
    sock = bind(host, 0)
    server = uvicorn.Server(uvicorn_config(app, batcher.limits, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="flywheel-collect")
    flusher = Flusher(batcher).start()
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("collect server thread failed to start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        flusher.close()
        batcher._flush_logged(everything=True)
        sock.close()


def run(inbox: Path, *, host: str, port: int, settle_s: float, max_pending: int, api_key: str | None,
        max_body_bytes: int, on_listen: Callable[[str], None] | None = None,
        on_write: Callable[[Path, int], None] | None = None, limits: CollectLimits | None = None,
        allowed_hosts: tuple[str, ...] | None = None, redactor: Any = None) -> CollectStats:
    """Serve until SIGINT/SIGTERM, then write every trace still held. Returns the counts.
    ``allowed_hosts``: Host header names answered (default: :func:`flywheel.net.allowed_hosts_for`)."""
    import uvicorn

    limits = limits or CollectLimits()
    batcher = Batcher(inbox, settle_s=settle_s, max_pending=max_pending, on_write=on_write, limits=limits,
                      redactor=redactor)
    app = create_app(batcher, api_key=api_key, max_body_bytes=max_body_bytes,
                     allowed_hosts=allowed_hosts or allowed_hosts_for(host))

    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    class _Server(uvicorn.Server):
        # uvicorn re-raises SIGTERM/SIGINT after its shutdown (0.29+), which would kill this process
        # before the traces it still holds are written: the signals are handled here instead.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # the name in uvicorn < 0.29
            pass

    server = _Server(uvicorn_config(app, limits, log_level="warning", access_log=False, lifespan="off"))

    def on_signal(signum: int, frame: Any) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    flusher = Flusher(batcher).start()
    if on_listen:
        on_listen(url)
    try:
        server.run(sockets=[sock])
    finally:
        flusher.close()
        # at shutdown a failing write is retried a few times; what still cannot be written is reported
        for attempt in range(3):
            try:
                batcher.flush(everything=True)
                break
            except OSError:
                time.sleep(0.5 * (attempt + 1))
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return batcher.stats
