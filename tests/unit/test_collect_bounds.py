"""``flywheel collect`` is bounded and loses nothing it acknowledged (issue 31, findings 4 and 5e).

Before: no limit on a trace's size or on what is held in all; a trace that kept receiving spans within
``settle_s`` was never written; log records without a trace id were held until some trace came due
(forever on a receiver that only got logs); resources and scopes were never evicted; any Host header
was answered (DNS rebinding); no request-head deadline or connection limit; a write error killed the
flush thread after the traces had left memory; and every received attribute reached the inbox file in
clear. Batching is checked on a fake clock; the HTTP bounds on a real server on 127.0.0.1; redaction
with the real OTLP/HTTP exporter.

Not covered here: a SIGKILLed receiver loses what it held (documented).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from flywheel.ingest.collect import Batcher, CollectLimits, Flusher, Overloaded, run_in_thread
from flywheel.redact import Redactor

TID = [f"{i:032x}" for i in range(1, 2100)]


def spans_request(tid: str, n: int = 1, *, root: bool = True, pad: int = 0, service: str = "a") -> dict:
    spans = []
    for j in range(n):
        sp = {"traceId": tid, "spanId": f"{j + 1:016x}", "name": "chat m", "kind": 3,
              "startTimeUnixNano": "1793610000000000000", "endTimeUnixNano": "1793610001000000000",
              "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat" + " " * pad}}]}
        if j or not root:
            sp["parentSpanId"] = "00000000000000ff"
        spans.append(sp)
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
                               "scopeSpans": [{"scope": {"name": "s"}, "spans": spans}]}]}


def logs_request(n: int = 1, service: str = "a") -> dict:
    recs = [{"timeUnixNano": "1793610000000000000", "body": {"stringValue": f"log {i}"}} for i in range(n)]
    return {"resourceLogs": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
                              "scopeLogs": [{"scope": {"name": "s"}, "logRecords": recs}]}]}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_trace_past_its_byte_budget_gets_429_and_is_written_at_once(tmp_path):
    """Finding 4: a request that would take a trace past ``max_trace_bytes`` is refused with 429
    (nothing of it kept) and the trace is due at once; the retry starts the trace's next part."""
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock, limits=CollectLimits(max_trace_bytes=4000))
    b.add("traces", spans_request(TID[0], 5, pad=400))
    held = b.held_bytes
    with pytest.raises(Overloaded) as e:
        b.add("traces", spans_request(TID[0], 5, pad=400, root=False))
    assert e.value.status == 429 and b.held_bytes == held
    assert b.due() == [TID[0]]
    b.tick()
    assert b.held_bytes == 0 and b.stats.traces_written == 1
    b.add("traces", spans_request(TID[0], 5, pad=400, root=False))  # the retry: accepted now


def test_past_the_overall_budget_requests_get_503_until_the_oldest_are_written(tmp_path):
    """Finding 4: what is held in all never passes ``max_held_bytes``: past it a request gets 503 and
    the next flush round writes the oldest traces (down to half the budget), then requests pass."""
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock, limits=CollectLimits(max_held_bytes=20_000))
    i = 0
    with pytest.raises(Overloaded) as e:
        while True:
            clock.t += 0.001
            b.add("traces", spans_request(TID[i], 2, pad=300))
            i += 1
            assert i < 200
    assert e.value.status == 503 and b.held_bytes <= 20_000
    b.tick()
    assert b.held_bytes <= 10_000 and b.stats.traces_written > 0
    b.add("traces", spans_request(TID[i], 2, pad=300))


def test_a_trace_that_never_goes_quiet_is_written_after_max_age(tmp_path):
    """Finding 4: spans every 5 s with ``settle_s`` 10 never settled; ``max_age_s`` writes the trace."""
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock, limits=CollectLimits(max_age_s=60))
    b.add("traces", spans_request(TID[0]))
    while clock.t < 55:
        clock.t += 5
        b.add("traces", spans_request(TID[0], root=False))
        assert b.tick() is None  # never quiet for settle_s, younger than max_age_s
    clock.t = 60
    assert b.tick() is not None and b.stats.traces_written == 1 and b.held_bytes == 0


def test_log_records_without_a_trace_id_are_written_once_settled_and_scopes_evicted(tmp_path):
    """Finding 4: 2,000 log-only requests (no trace id) were all held, 0 files. Now they are written
    once the oldest is ``settle_s`` old, and the resource/scope entries they used leave memory."""
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock)
    for i in range(2000):
        b.add("logs", logs_request(1, service=f"svc-{i}"))  # 2,000 distinct resources
    assert b.tick() is None  # not settled yet
    clock.t = 10
    path = b.tick()
    assert path is not None and b.stats.log_records == 2000
    assert sum(len(sl["logRecords"]) for rl in json.loads(path.read_text())["resourceLogs"]
               for sl in rl["scopeLogs"]) == 2000
    assert b.held_bytes == 0 and b._objs == {} and b._refs == {}


def test_resource_entries_are_evicted_when_their_traces_are_written(tmp_path):
    """Finding 4: a resource or scope is held only while a held record refers to it."""
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock)
    b.add("traces", spans_request(TID[0], service="one"))
    b.add("traces", spans_request(TID[1], service="two"))
    assert len(b._objs) == 3  # two resources, one scope
    b.flush([TID[0]], loose=False)
    assert len(b._objs) == 2  # resource "one" evicted, the scope still used by "two"
    b.flush(everything=True)
    assert b._objs == {} and b.held_bytes == 0


def test_a_write_error_keeps_the_records_and_the_flusher_goes_on(tmp_path, monkeypatch):
    """Finding 4: a write error killed the flush thread after the traces had left memory (acknowledged
    data lost). Now the records stay held until their file is durably written, the error is counted,
    and the flusher thread retries at its next round."""
    b = Batcher(tmp_path, settle_s=0.2, limits=CollectLimits(max_age_s=0.2))
    real = b._write
    failures = {"n": 0}

    def flaky(name: str, data: bytes):
        if failures["n"] < 2:
            failures["n"] += 1
            raise OSError(28, "No space left on device")
        return real(name, data)

    monkeypatch.setattr(b, "_write", flaky)
    b.add("traces", spans_request(TID[0]))
    with pytest.raises(OSError):
        b.flush(everything=True)
    assert b.stats.write_errors == 1 and len(b._traces) == 1 and b.held_bytes > 0  # still held
    flusher = Flusher(b).start()
    try:
        deadline = time.monotonic() + 20
        while b.stats.traces_written == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flusher.thread.is_alive()
    finally:
        flusher.close()
    assert b.stats.write_errors == 2 and b.stats.traces_written == 1 and b.held_bytes == 0
    (f,) = tmp_path.glob("otlp-*.jsonl")
    assert TID[0] in f.read_text() and not list(tmp_path.glob(".*.tmp"))


def _post(url: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/traces", content=json.dumps(body), timeout=10,
                      headers={"Content-Type": "application/json", **headers})


def test_host_header_of_a_rebinding_page_is_refused(tmp_path):
    """Finding 4: a page on ``evil.example`` that rebinds its name to 127.0.0.1 sends ``Host:
    evil.example``: 400, nothing held. Loopback names and ``--allowed-host`` names pass."""
    b = Batcher(tmp_path / "inbox", settle_s=10)
    with run_in_thread(b, allowed_hosts=("localhost", "127.0.0.1", "::1", "collector.internal")) as url:
        bad = _post(url, spans_request(TID[0]), Host="evil.example:4318")
        assert bad.status_code == 400 and "Host" in bad.json()["message"]
        assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 400
        assert b.stats.spans == 0
        assert _post(url, spans_request(TID[1])).status_code == 200
        assert _post(url, spans_request(TID[2]), Host="collector.internal:4318").status_code == 200
    assert b.stats.spans == 2


def test_a_connection_without_a_request_head_is_closed_and_connections_are_limited(tmp_path):
    """Finding 4: serve's bounds. A client trickling header bytes is disconnected after
    ``header_timeout_s``; connections past ``max_connections`` get 503."""
    b = Batcher(tmp_path / "inbox", settle_s=10, limits=CollectLimits(header_timeout_s=0.5, max_connections=3))
    with run_in_thread(b) as url:
        host, port = url.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)), timeout=10)
        slow.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no end of head
        t0 = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        slow.close()
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
        try:
            time.sleep(0.2)
            over = _post(url, spans_request(TID[0]))
            assert over.status_code == 503
        finally:
            for s in idle:
                s.close()


def test_collect_writes_no_clear_secret_from_the_real_otlp_exporter(tmp_path):
    """Finding 5 (e): a span exported by the official OTLP/HTTP exporter (protobuf) carrying a tool
    call whose arguments hold ``smtp_password``, a ``db.password`` attribute and an Authorization
    header attribute: the inbox file holds none of them in clear (redacted at the receiver, before
    anything reaches disk), and the rest of the span is kept."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    smtp, db, tok = "Sm7p-Pa55word!x42", "Db-Pa55word!y77", "9f8e7d6c5b4a39281706f5e4d3c2b1a0"
    out_msgs = [{"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "send_mail",
                                                 "arguments": {"to": "ops", "smtp_password": smtp}}]}]
    inbox = tmp_path / "inbox"
    b = Batcher(inbox, settle_s=10, redactor=Redactor())
    with run_in_thread(b) as url:
        provider = TracerProvider(resource=Resource.create({"service.name": "mailer"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
        tracer = provider.get_tracer("agent")
        with tracer.start_as_current_span("chat m") as sp:
            sp.set_attribute("gen_ai.operation.name", "chat")
            sp.set_attribute("gen_ai.output.messages", json.dumps(out_msgs))
            sp.set_attribute("db.password", db)
            sp.set_attribute("http.request.header.authorization", [f"Token {tok}"])
        provider.shutdown()
        assert b.stats.spans == 1
    (f,) = inbox.glob("otlp-*.jsonl")
    data = f.read_bytes()
    for secret in (smtp, db, tok):
        assert secret.encode() not in data, secret
    assert b"[REDACTED:secret]" in data and b"send_mail" in data and b"gen_ai.operation.name" in data
