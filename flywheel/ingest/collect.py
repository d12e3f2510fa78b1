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
service never comes), when more than ``max_pending`` traces are held (the oldest first), and at
shutdown (SIGINT/SIGTERM). Log records without a trace id go out with the next batch. A batch is one
file in the inbox: written under a temporary name in the same directory, fsynced, renamed to
``otlp-<UTC time>-<pid>-<n>.jsonl``; one export request per line (spans, then logs), what a Collector's
file exporter writes and what ``flywheel ingest`` reads.

Guarantees
- A file in the inbox is complete (the rename is atomic) and never rewritten.
- A trace's spans and log records land in one file (unless it outlives the settle window, then its
  later records go to a later file and are reported at ingest), so ingest joins them.
- With an API key set, every request must carry ``Authorization: Bearer <key>``; binding to anything
  but loopback requires one.

Not guaranteed: data acknowledged but still held in memory is lost when the process is SIGKILLed (up
to ``settle_s`` of traffic; put a Collector with a persistent queue in front where that matters).
Not covered: OTLP/gRPC (port 4317), metrics, partial-success responses.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hmac
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
from flywheel.net import bind

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


@dataclass
class _Trace:
    first: float
    last: float
    root: bool = False
    spans: list[tuple[bytes, bytes, dict]] = field(default_factory=list)  # (resource key, scope key, span)
    logs: list[tuple[bytes, bytes, dict]] = field(default_factory=list)


@dataclass
class CollectStats:
    requests: int = 0
    rejected: int = 0
    spans: int = 0
    log_records: int = 0
    traces_written: int = 0
    files: list[str] = field(default_factory=list)


class Batcher:
    """Groups records by trace and writes finished traces to the inbox (see the module docstring).
    Thread-safe; ``clock`` is injectable for tests."""

    def __init__(self, inbox: Path, *, settle_s: float = 10.0, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, on_write: Callable[[Path, int], None] | None = None):
        self.inbox = Path(inbox)
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.settle_s, self.max_pending, self.clock, self.on_write = settle_s, max_pending, clock, on_write
        self._lock = threading.Lock()
        self._traces: dict[str, _Trace] = {}
        self._loose_logs: list[tuple[bytes, bytes, dict]] = []
        self._objs: dict[bytes, Any] = {}  # resource/scope key -> the dict
        self._seq = 0
        self.stats = CollectStats()

    def add(self, signal: str, req: dict[str, Any]) -> None:
        now = self.clock()
        outer, inner, leaf = ("resourceSpans", "scopeSpans", "spans") if signal == "traces" else \
            ("resourceLogs", "scopeLogs", "logRecords")
        with self._lock:
            for r in req.get(outer) or ():
                res = {k: v for k, v in r.items() if k != inner}
                rk = _key(res)
                self._objs.setdefault(rk, res)
                for s in r.get(inner) or ():
                    scope = {k: v for k, v in s.items() if k != leaf}
                    sk = _key(scope)
                    self._objs.setdefault(sk, scope)
                    for rec in s.get(leaf) or ():
                        tid = rec.get("traceId") or ""
                        if signal == "logs" and not tid:
                            self._loose_logs.append((rk, sk, rec))
                            self.stats.log_records += 1
                            continue
                        t = self._traces.get(tid)
                        if t is None:
                            t = self._traces[tid] = _Trace(now, now)
                        t.last = now
                        if signal == "traces":
                            t.spans.append((rk, sk, rec))
                            t.root = t.root or not rec.get("parentSpanId")
                            self.stats.spans += 1
                        else:
                            t.logs.append((rk, sk, rec))
                            self.stats.log_records += 1
            over = len(self._traces) - self.max_pending
        if over > 0:
            self.flush(oldest=over)

    def due(self) -> list[str]:
        now = self.clock()
        with self._lock:
            return [tid for tid, t in self._traces.items()
                    if (t.root and now - t.last >= self.settle_s) or now - t.last >= 10 * self.settle_s]

    def flush(self, tids: list[str] | None = None, *, oldest: int = 0, everything: bool = False) -> Path | None:
        """Write the given traces (or the ``oldest`` n, or all) as one inbox file; None when empty."""
        with self._lock:
            if everything:
                tids = list(self._traces)
            elif oldest:
                tids = sorted(self._traces, key=lambda t: self._traces[t].first)[:oldest]
            picked = [self._traces.pop(t) for t in tids or () if t in self._traces]
            loose, self._loose_logs = self._loose_logs, []
            if not picked and not loose:
                return None
            spans = [x for t in picked for x in t.spans]
            logs = [x for t in picked for x in t.logs] + loose
            lines = []
            if spans:
                lines.append(orjson.dumps({"resourceSpans": self._group(spans, "scopeSpans", "spans")}))
            if logs:
                lines.append(orjson.dumps({"resourceLogs": self._group(logs, "scopeLogs", "logRecords")}))
            self._seq += 1
            name = f"otlp-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{self._seq:06d}.jsonl"
            path = self._write(name, b"\n".join(lines) + b"\n")
            self.stats.traces_written += len(picked)
            self.stats.files.append(str(path))
        if self.on_write:
            self.on_write(path, len(picked))
        return path

    def _group(self, items: list[tuple[bytes, bytes, dict]], inner: str, leaf: str) -> list[dict[str, Any]]:
        by_res: dict[bytes, dict[bytes, list[dict]]] = {}
        for rk, sk, rec in items:
            by_res.setdefault(rk, {}).setdefault(sk, []).append(rec)
        return [{**self._objs[rk], inner: [{**self._objs[sk], leaf: recs} for sk, recs in scopes.items()]}
                for rk, scopes in by_res.items()]

    def _write(self, name: str, data: bytes) -> Path:
        final = self.inbox / name
        tmp = self.inbox / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
            fsync_dir(self.inbox)
        return final


def create_app(batcher: Batcher, *, api_key: str | None = None, max_body_bytes: int = 16 << 20) -> Any:
    """The ASGI app: ``POST /v1/traces``, ``POST /v1/logs``, ``GET /health``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    key = api_key.encode() if api_key else None

    async def export(request: Request) -> Response:
        signal = request.url.path.rsplit("/", 1)[-1]
        ctype = request.headers.get("content-type", "")
        if key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
                batcher.stats.rejected += 1
                return JSONResponse({"code": 16, "message": "missing or invalid API key"}, status_code=401)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                batcher.stats.rejected += 1
                return JSONResponse({"code": 8, "message": f"body over {max_body_bytes} bytes"}, status_code=413)
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
        batcher.add(signal, req)
        batcher.stats.requests += 1
        resp = _response_class(signal)()
        if ctype.startswith("application/x-protobuf"):
            return Response(resp.SerializeToString(), media_type="application/x-protobuf")
        return JSONResponse({})

    def _bad(message: str, ctype: str) -> Response:
        # google.rpc.Status in its JSON shape (code 3 = INVALID_ARGUMENT) for both encodings: exporters
        # log the body of a 4xx, they do not parse it
        return JSONResponse({"code": 3, "message": message}, status_code=400)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "pending_traces": len(batcher._traces)})

    return Starlette(routes=[Route("/v1/traces", export, methods=["POST"]), Route("/v1/logs", export, methods=["POST"]),
                             Route("/health", health, methods=["GET"])])


def run(inbox: Path, *, host: str, port: int, settle_s: float, max_pending: int, api_key: str | None,
        max_body_bytes: int, on_listen: Callable[[str], None] | None = None,
        on_write: Callable[[Path, int], None] | None = None) -> CollectStats:
    """Serve until SIGINT/SIGTERM, then write every trace still held. Returns the counts."""
    import uvicorn

    batcher = Batcher(inbox, settle_s=settle_s, max_pending=max_pending, on_write=on_write)
    app = create_app(batcher, api_key=api_key, max_body_bytes=max_body_bytes)
    stop = threading.Event()

    def settle_loop() -> None:
        while not stop.wait(min(1.0, settle_s / 2)):
            tids = batcher.due()
            if tids:
                batcher.flush(tids)

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

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = _Server(config)

    def on_signal(signum: int, frame: Any) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    t = threading.Thread(target=settle_loop, name="flywheel-collect-settle", daemon=True)
    t.start()
    if on_listen:
        on_listen(url)
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        t.join(timeout=5)
        batcher.flush(everything=True)
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return batcher.stats
