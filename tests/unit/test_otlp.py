"""OTLP file mechanics on small hand-built files: where a trace ends, batch sizes, id encodings.
(What the real instrumentations emit is tested in tests/integration/test_otel_instrumentations.py.)"""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.artifacts import ArtifactStore, load_traces
from flywheel.config import load_config
from flywheel.ingest import ingest_paths


def kv(k, v):
    return {"key": k, "value": {"stringValue": v} if isinstance(v, str) else {"intValue": str(v)}}


def chat_span(tid, sid, parent=None, t0=1793610000000000000):
    sp = {"traceId": tid, "spanId": sid, "name": "chat m", "startTimeUnixNano": str(t0), "endTimeUnixNano": str(t0 + 9),
          "attributes": [kv("gen_ai.operation.name", "chat"), kv("gen_ai.request.model", "m"),
                         kv("gen_ai.usage.input_tokens", 5)]}
    if parent:
        sp["parentSpanId"] = parent
    return sp


def event(tid, sid, name, body, t):
    return {"traceId": tid, "spanId": sid, "eventName": name, "timeUnixNano": str(t),
            "body": {"kvlistValue": {"values": [kv(k, v) for k, v in body.items()]}}}


def spans_line(spans):
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "x"}, "spans": spans}]}]})


def logs_line(recs):
    return json.dumps({"resourceLogs": [{"resource": {}, "scopeLogs": [{"scope": {"name": "x"}, "logRecords": recs}]}]})


def tid_of(i):
    return f"{i:02x}" * 16


def test_logs_before_and_far_from_their_spans_are_joined(cfg, store, tmp_path):
    t, s = tid_of(1), "a1a2a3a4a5a6a7a8"
    lines = [
        logs_line([event(t, s, "gen_ai.user.message", {"content": "Hello?"}, 1),
                   event(t, s, "gen_ai.choice", {"index": 0, "finish_reason": "stop"}, 2)]),
        spans_line([chat_span(tid_of(2), "b1b2b3b4b5b6b7b8")]),  # an unrelated trace in between
        logs_line([event(tid_of(2), "b1b2b3b4b5b6b7b8", "gen_ai.user.message", {"content": "Other"}, 3)]),
        spans_line([chat_span(t, s)]),
    ]
    # the choice body carries its message as a kvlist inside the kvlist
    choice = json.loads(lines[0])
    rec = choice["resourceLogs"][0]["scopeLogs"][0]["logRecords"][1]
    rec["body"]["kvlistValue"]["values"].append({"key": "message", "value": {"kvlistValue": {"values": [
        kv("role", "assistant"), kv("content", "Hi there.")]}}})
    lines[0] = json.dumps(choice)
    p = tmp_path / "o.jsonl"
    p.write_text("\n".join(lines) + "\n")
    s_ = ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [p])
    assert s_.ingested == 2 and s_.quarantined == 0
    full = load_traces(ArtifactStore(cfg.artifacts_dir), [store.entity(f"trace:{t}")["state"]])[0]
    assert full["messages"] == [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there."}]
    assert full["metadata"]["otel"]["convention"] == "genai-events" and full["metadata"]["usage"]["input_tokens"] == 5


def test_batches_are_sized_by_traces_not_lines(cfg, store, tmp_path):
    """A Collector line holds hundreds of traces: 30 traces on one line with batch_size 10 are three
    batches (three trace artifacts), not one batch of the whole file."""
    spans = []
    for i in range(30):
        sp = chat_span(tid_of(i + 1), f"{i + 1:016x}")
        sp["attributes"].append(kv("gen_ai.input.messages", json.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": f"q{i}"}]}])))
        spans.append(sp)
    p = tmp_path / "o.jsonl"
    p.write_text(spans_line(spans[:15]) + "\n" + spans_line(spans[15:]) + "\n")
    cfg = load_config(overrides={"home": str(cfg.home), "ingest": {"batch_size": 10}})
    s = ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [p])
    assert s.ingested == 30
    shas = {e["state"]["trace"]["sha256"] for e in store.entities("trace")}
    assert len(shas) == 2  # one batch per line of 15 (>= 10) traces


def test_base64_ids_are_read_as_hex(cfg, store, tmp_path):
    """protobuf's generic JSON mapping writes ids as base64; OTLP/JSON (the Collector) as hex."""
    raw_t, raw_s = bytes(range(16)), bytes(range(8))
    sp = chat_span(base64.b64encode(raw_t).decode(), base64.b64encode(raw_s).decode())
    sp["attributes"].append(kv("gen_ai.input.messages", json.dumps([{"role": "user", "content": "hi"}])))
    p = tmp_path / "o.json"
    p.write_text(json.dumps(json.loads(spans_line([sp])), indent=2))
    assert ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [p]).ingested == 1
    assert store.entity(f"trace:{raw_t.hex()}") is not None


def test_usage_finish_reasons_and_response_ids_show_up_in_the_report(cfg, store, tmp_path):
    from flywheel.report import trace_facts

    t, s = tid_of(3), "c1c2c3c4c5c6c7c8"
    sp = chat_span(t, s)
    sp["attributes"] += [kv("gen_ai.usage.output_tokens", 7),
                         kv("gen_ai.response.id", "chatcmpl-abc"),
                         {"key": "gen_ai.response.finish_reasons", "value": {"arrayValue": {"values": [
                             {"stringValue": "stop"}]}}},
                         kv("gen_ai.input.messages", json.dumps([{"role": "user", "parts": [
                             {"type": "text", "content": "hi"}]}]))]
    p = tmp_path / "o.jsonl"
    p.write_text(spans_line([sp]) + "\n")
    arts = ArtifactStore(cfg.artifacts_dir)
    assert ingest_paths(cfg, store, arts, [p]).ingested == 1
    facts = trace_facts(arts, store, [{"trace": f"trace:{t}"}])
    assert facts[f"trace:{t}"] == {"source": "genai-span", "model": "m", "tokens": "5 in / 7 out", "finish": "stop",
                                   "response": "chatcmpl-abc"}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
        ["status", "events", "attributes", "body", "key", "value", "stringValue", "kvlistValue", "arrayValue",
         "values", "spanId", "parentSpanId", "name", "startTimeUnixNano", "eventName", "code"]), c, max_size=4),
    max_leaves=12)


def test_any_shape_of_span_or_record_is_quarantined_never_raised():
    """Whatever a span or log record holds, the reader answers with a trace or a reason."""
    from flywheel.ingest.otlp import Assembler

    class L:
        lineno = 1

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(st.sampled_from(["status", "events", "spanId", "parentSpanId", "name",
                                            "startTimeUnixNano"]), JSON, max_size=5),
           st.dictionaries(st.sampled_from(["body", "attributes", "spanId", "eventName", "timeUnixNano"]), JSON,
                           max_size=4))
    def check(span, record):
        # a span the mapping reads in full (a chat call with content), its other fields anything
        base = chat_span(tid_of(9), "d1d2d3d4d5d6d7d8")
        base["attributes"].append(kv("gen_ai.input.messages", json.dumps([{"role": "user", "content": "hi"}])))
        span = {**base, **span, "traceId": tid_of(9)}
        record = {**record, "traceId": tid_of(9), "eventName": record.get("eventName") or "gen_ai.choice"}
        a = Assembler(None, [], 1 << 20)
        a.feed(json.loads(spans_line([span])), L)
        a.feed(json.loads(logs_line([record])), L)
        a.feed({"resourceSpans": [{"resource": record.get("body"), "scopeSpans": [{"scope": span.get("name"),
                                                                                  "spans": span.get("events")}]}],
                "resourceLogs": record.get("attributes")}, L)
        for tid in a.remaining():
            rec, prob, _ = a.take(tid)
            assert (rec is None) != (prob is None)

    check()


def test_a_start_time_beyond_any_date_is_quarantined_with_the_reason():
    """Found by the property test above: startTimeUnixNano 67768036191676798846631937 raised OverflowError
    ("timestamp out of range for platform time_t") out of the reader instead of quarantining the trace."""
    from flywheel.ingest.otlp import Assembler

    class L:
        lineno = 1

    for start in (67768036191676798846631937, 10**30):
        span = chat_span(tid_of(9), "d1d2d3d4d5d6d7d8")
        span["attributes"].append(kv("gen_ai.input.messages", json.dumps([{"role": "user", "content": "hi"}])))
        span = {**span, "startTimeUnixNano": start}
        a = Assembler(None, [], 1 << 20)
        a.feed(json.loads(spans_line([span])), L)
        (tid,) = a.remaining()
        rec, prob, _ = a.take(tid)
        assert rec is None and prob[0] == "otel_bad_value" and str(start) in prob[1], prob


def test_array_and_kvlist_values_that_are_not_lists_read_as_empty():
    """Found by the property test above: ``{"arrayValue": {"values": true}}`` raised TypeError."""
    from flywheel.ingest.otlp_decode import any_value

    for bad in (True, 3, "x", {"a": 1}, None):
        assert any_value({"arrayValue": {"values": bad}}) == []
        assert any_value({"kvlistValue": {"values": bad}}) == {}
        assert any_value({"arrayValue": {"values": bad}, "status": None}) == []
        assert any_value({"kvlistValue": {"values": bad}, "status": None}) == {}
    assert any_value({"arrayValue": {"values": [{"intValue": "7"}, {"stringValue": "s"}]}}) == [7, "s"]


def test_otlp_log_with_a_non_string_kvlist_key_is_quarantined_and_the_span_files_traces_go_on(cfg, store, tmp_path):
    """Issue 31, finding 6: a GenAI log record whose kvlist has a non-string key
    (``{"kvlistValue": {"values": [{"key": [1], "value": {}}]}}``) in a logs companion file raised in
    the log index loader, outside per-record isolation, and the span file's good traces were lost.
    Now that record is quarantined (when the logs file itself is read) with a reason that names the
    bad key, and every good trace of both files is ingested."""
    from flywheel.ingest import list_quarantine, show_quarantine

    good = [(tid_of(i), f"{i:02x}" * 8) for i in range(1, 4)]
    bad_tid = tid_of(9)
    spans = tmp_path / "spans.jsonl"
    spans.write_text("\n".join(spans_line([chat_span(t, s)]) for t, s in [*good, (bad_tid, "c1c2c3c4c5c6c7c8")]) + "\n")
    bad = event(bad_tid, "c1c2c3c4c5c6c7c8", "gen_ai.user.message", {"content": "x"}, 1)
    bad["body"] = {"kvlistValue": {"values": [{"key": [1], "value": {}}]}}
    logs = tmp_path / "logs.jsonl"
    logs.write_text("\n".join([
        logs_line([event(t, s, "gen_ai.user.message", {"content": f"Hello {t[:2]}?"}, 1) for t, s in good]),
        logs_line([bad]),
    ]) + "\n")
    arts = ArtifactStore(cfg.artifacts_dir)
    s = ingest_paths(cfg, store, arts, [spans, logs])
    for t, _ in good:
        assert store.entity(f"trace:{t}") is not None, t
    rows = [r for q in list_quarantine(store) for r in show_quarantine(store, arts, q["stream"])]
    bad_rows = [r for r in rows if r["reason"] == "otel_bad_value"]
    assert len(bad_rows) == 1 and bad_rows[0]["file"] == "logs.jsonl" and bad_rows[0]["line"] == 2, rows
    assert "key" in bad_rows[0]["detail"] and "not a string" in bad_rows[0]["detail"], bad_rows[0]["detail"]
    assert "internal_error" not in s.quarantined_by_reason, s.quarantined_by_reason
