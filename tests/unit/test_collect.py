"""The OTLP/HTTP receiver's batching and decoding, on a fake clock (no wall-clock waits)."""

from __future__ import annotations

import gzip
import json

import pytest
from starlette.testclient import TestClient

from flywheel.ingest.collect import Batcher, CollectError, create_app, decode_request

TID_A, TID_B = "5b8efff798038103d269b633813fc60c", "6c9f00a8a9149214e37ac744924fd71d"


def spans_request(tid: str, span: str, parent: str | None = None) -> dict:
    sp = {"traceId": tid, "spanId": span, "name": "chat m", "kind": 3, "startTimeUnixNano": "1793610000000000000",
          "endTimeUnixNano": "1793610001000000000",
          "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}}]}
    if parent:
        sp["parentSpanId"] = parent
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "a"}}]},
                               "scopeSpans": [{"scope": {"name": "s"}, "spans": [sp]}]}]}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_trace_is_written_once_settled_with_its_root_and_rootless_ones_later(tmp_path):
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, clock=clock)
    b.add("traces", decode_request("traces", json.dumps(spans_request(TID_A, "a1b2c3d4e5f60718")).encode(),
                                   "application/json", max_bytes=1 << 20))
    b.add("traces", decode_request("traces", json.dumps(spans_request(TID_B, "b1b2c3d4e5f60718", "c1b2c3d4e5f60718"))
                                   .encode(), "application/json", max_bytes=1 << 20))
    clock.t = 9.9
    assert b.due() == []
    clock.t = 10.0
    assert b.due() == [TID_A]  # B has no root yet: it may still come
    path = b.flush(b.due())
    (line,) = path.read_text().splitlines()
    req = json.loads(line)
    sp = req["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert sp["traceId"] == TID_A and sp["spanId"] == "a1b2c3d4e5f60718" and sp["kind"] == 3  # hex ids, int enums
    assert req["resourceSpans"][0]["resource"]["attributes"][0]["key"] == "service.name"
    clock.t = 100.0
    assert b.due() == [TID_B]
    assert [p.name.startswith("otlp-") for p in tmp_path.iterdir()] == [True]  # no temporary file left


def test_max_pending_writes_the_oldest_and_shutdown_writes_the_rest(tmp_path):
    clock = Clock()
    b = Batcher(tmp_path, settle_s=10, max_pending=1, clock=clock)
    b.add("traces", spans_request(TID_A, "a1b2c3d4e5f60718"))
    clock.t = 1
    b.add("traces", spans_request(TID_B, "b1b2c3d4e5f60718"))
    (first,) = tmp_path.glob("otlp-*.jsonl")
    assert TID_A in first.read_text() and TID_B not in first.read_text()
    b.flush(everything=True)
    assert b.stats.traces_written == 2 and len(list(tmp_path.glob("otlp-*.jsonl"))) == 2


def test_decode_refuses_what_is_not_an_export_request():
    with pytest.raises(CollectError, match="Content-Type"):
        decode_request("traces", b"{}", "text/plain", max_bytes=100)
    with pytest.raises(CollectError, match="not an OTLP/JSON ExportTraceServiceRequest"):
        decode_request("traces", b'{"resourceSpans": 3}', "application/json", max_bytes=100)
    with pytest.raises(CollectError, match="not a protobuf"):
        decode_request("logs", b"\xff\xff\xff", "application/x-protobuf", max_bytes=100)


def test_http_gzip_json_api_key_and_errors(tmp_path):
    b = Batcher(tmp_path, settle_s=10)
    client = TestClient(create_app(b, api_key="k3y", max_body_bytes=4096, allowed_hosts=("testserver",)))
    body = gzip.compress(json.dumps(spans_request(TID_A, "a1b2c3d4e5f60718")).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    assert client.post("/v1/traces", content=body, headers=headers).status_code == 401
    ok = client.post("/v1/traces", content=body, headers={**headers, "Authorization": "Bearer k3y"})
    assert ok.status_code == 200 and ok.json() == {} and b.stats.spans == 1
    big = client.post("/v1/logs", content=b"x" * 5000, headers={"Content-Type": "application/json",
                                                                  "Authorization": "Bearer k3y"})
    assert big.status_code == 413
    bad = client.post("/v1/logs", content=b"[1]", headers={"Content-Type": "application/json",
                                                            "Authorization": "Bearer k3y"})
    assert bad.status_code == 400 and "JSON object" in bad.json()["message"]
    assert b.stats.requests == 1 and b.stats.rejected == 3


def test_redaction_keeps_otlp_ids_and_timestamps_and_still_redacts_content(tmp_path):
    """A nanosecond timestamp is 19 digits and passes the Luhn check one time in ten: the receiver's
    redaction replaced it as a card number, the trace then started in 1970 and ingest quarantined it as
    ``timestamp_out_of_range`` (seen in the full suite). Structure stays; content is still redacted."""
    from flywheel.redact import Redactor

    luhn_ts = "1793610000000000001"  # passes Luhn: a card number by shape
    card = "4111 1111 1111 1111"
    req = spans_request(TID_A, "a1b2c3d4e5f60718")
    sp = req["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    sp["startTimeUnixNano"] = luhn_ts
    sp["events"] = [{"timeUnixNano": luhn_ts, "name": "e", "attributes": []}]
    sp["attributes"].append({"key": "gen_ai.prompt", "value": {"stringValue": f"pay with {card}"}})
    b = Batcher(tmp_path, settle_s=10, clock=Clock(), redactor=Redactor())
    b.add("traces", req)
    (line,) = b.flush([TID_A]).read_text().splitlines()
    out = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert out["startTimeUnixNano"] == luhn_ts and out["events"][0]["timeUnixNano"] == luhn_ts
    assert out["traceId"] == TID_A and out["spanId"] == "a1b2c3d4e5f60718"
    prompt = next(a for a in out["attributes"] if a["key"] == "gen_ai.prompt")["value"]["stringValue"]
    assert card not in prompt and "REDACTED" in prompt
