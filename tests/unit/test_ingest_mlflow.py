"""MLflow Tracing traces as flywheel traces: the mapping (on traces shaped exactly as MLflow 3
serialises them, attribute values as JSON strings) and the ingest driver's idempotency, quarantine
and in-progress handling (on a scripted trace source; the real server is in
tests/integration/test_mlflow_tracing_ingest.py)."""

from __future__ import annotations

import json

import pytest

from flywheel.ingest.mlflow_traces import mlflow_to_trace

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _span(name, span_type, *, sid, parent=None, start=0, inputs=None, outputs=None, error=None, attrs=None):
    a = {"mlflow.traceRequestId": json.dumps("tr-1"), "mlflow.spanType": json.dumps(span_type)}
    if inputs is not None:
        a["mlflow.spanInputs"] = json.dumps(inputs)
    if outputs is not None:
        a["mlflow.spanOutputs"] = json.dumps(outputs)
    a.update(attrs or {})
    events = []
    status = {"code": "STATUS_CODE_OK", "message": ""}
    if error:
        etype, msg = error
        events.append({"name": "exception", "time_unix_nano": start + 5,
                       "attributes": {"exception.type": etype, "exception.message": msg, "exception.stacktrace": "..."}})
        status = {"code": "STATUS_CODE_ERROR", "message": f"{etype}: {msg}"}
    return {"trace_id": "AAAA", "span_id": sid, "parent_span_id": parent, "name": name,
            "start_time_unix_nano": 1_796_161_664_000_000_000 + start, "end_time_unix_nano": 1_796_161_664_000_000_000 + start + 10,
            "events": events, "status": status, "attributes": a, "links": []}


def _completion(message):
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "policy", "choices": [
        {"finish_reason": "tool_calls" if message.get("tool_calls") else "stop", "index": 0,
         "message": {"refusal": None, "annotations": None, "audio": None, "function_call": None, **message}}]}


def _trace(spans, *, tid="tr-1", state="OK", assessments=None):
    info = {"trace_id": tid, "trace_location": {"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": "7"}},
            "request_time": "2026-11-30T10:00:00.000Z", "state": state, "trace_metadata": {},
            "tags": {"mlflow.traceName": spans[0]["name"]}, "execution_duration_ms": 12}
    if assessments is not None:
        info["assessments"] = assessments
    return {"info": info, "data": {"spans": spans}}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat_trace(**kw):
    req = {"model": "policy", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
           "max_tokens": 8}
    return _trace([_span("Completions", "CHAT_MODEL", sid="s1", inputs=req,
                         outputs=_completion({"role": "assistant", "content": None, "tool_calls": [CALL]}))], **kw)


def test_autologged_chat_span_becomes_messages_tools_and_tool_calls():
    rec, prob = mlflow_to_trace(chat_trace())
    assert prob is None
    assert rec["trace_id"] == rec["source_id"] == "tr-1" and rec["source"] == "mlflow"
    assert rec["timestamp"] == "2026-11-30T10:00:00.000Z" and rec["model"] == "policy"
    assert rec["messages"] == [{"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    assert rec["tools"] == TOOLS
    assert rec["outcome"] == {"status": "success"}
    assert rec["metadata"]["mlflow"]["experiment_id"] == "7" and rec["metadata"]["mlflow"]["spans"] == {"CHAT_MODEL": 1}


def test_agent_history_and_failing_tool_span_name_the_tool():
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    spans = [
        _span("agent", "AGENT", sid="root", start=0, error=("RuntimeError", "weather service down")),
        _span("Completions", "CHAT_MODEL", sid="c1", parent="root", start=1,
              inputs={"model": "policy", "messages": history[:1], "tools": TOOLS},
              outputs=_completion({"role": "assistant", "content": None, "tool_calls": [CALL]})),
        _span("Completions", "CHAT_MODEL", sid="c2", parent="root", start=2,
              inputs={"model": "policy", "messages": history, "tools": TOOLS},
              outputs=_completion({"role": "assistant", "content": "It is sunny."})),
        _span("get_weather", "TOOL", sid="t1", parent="root", start=3, inputs={"city": "Paris"},
              error=("RuntimeError", "weather service down")),
    ]
    rec, prob = mlflow_to_trace(_trace(spans, state="ERROR"))
    assert prob is None
    # The last chat call holds the whole conversation; its answer closes it.
    assert rec["messages"] == history + [{"role": "assistant", "content": "It is sunny."}]
    # The innermost failed span is named, not the agent span around it.
    assert rec["outcome"] == {"status": "failure", "error": "TOOL get_weather: RuntimeError: weather service down"}
    assert rec["metadata"]["mlflow"]["chat_spans"] == 2


def test_feedback_and_expectations_become_failure_signals():
    assessments = [
        {"assessment_name": "relevance", "source": {"source_type": "LLM_JUDGE"}, "feedback": {"value": "yes"}, "valid": True},
        {"assessment_name": "user_thumbs", "source": {"source_type": "HUMAN", "source_id": "u1"},
         "feedback": {"value": False}, "rationale": "wrong city", "valid": True},
        {"assessment_name": "broken_judge", "source": {"source_type": "LLM_JUDGE"},
         "feedback": {"value": None, "error": {"error_code": "TIMEOUT"}}, "valid": True},
        {"assessment_name": "old", "source": {"source_type": "HUMAN"}, "feedback": {"value": -5}, "valid": False},
        {"assessment_name": "expected_calls", "source": {"source_type": "HUMAN"},
         "expectation": {"value": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}]}}},
    ]
    rec, prob = mlflow_to_trace(chat_trace(assessments=assessments))
    assert prob is None
    assert rec["outcome"]["feedback"] == {"score": -1, "comment": "user_thumbs: wrong city"}
    assert rec["correction"] == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}]}
    names = [a["name"] for a in rec["metadata"]["mlflow"]["assessments"]]
    assert names == ["relevance", "user_thumbs", "expected_calls"]  # invalid and errored ones are left out


def test_positive_feedback_and_expected_response():
    assessments = [{"assessment_name": "user_thumbs", "source": {"source_type": "HUMAN"}, "feedback": {"value": True}},
                   {"assessment_name": "expected_response", "source": {"source_type": "HUMAN"},
                    "expectation": {"value": "It is sunny in Paris."}}]
    rec, _ = mlflow_to_trace(chat_trace(assessments=assessments))
    assert rec["outcome"]["feedback"]["score"] == 1
    assert rec["correction"] == {"content": "It is sunny in Paris."}


def test_completion_style_llm_span():
    rec, prob = mlflow_to_trace(_trace([_span("llm", "LLM", sid="s", inputs={"prompt": "hi"}, outputs="hello")]))
    assert prob is None and rec["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(("trace", "reason"), [
    ({"info": {}}, "mlflow_not_a_trace"),
    (_trace([_span("retrieve", "RETRIEVER", sid="r", inputs={"q": "x"}, outputs=[])]), "mlflow_no_chat_span"),
    (_trace([_span("Messages", "CHAT_MODEL", sid="m", inputs={"system": "x", "input": [1]}, outputs={})]),
     "mlflow_unreadable_span"),
    (_trace([_span("c", "CHAT_MODEL", sid="m", inputs={"messages": [{"content": "no role"}]}, outputs={})]),
     "mlflow_unreadable_span"),
])
def test_unusable_traces_are_problems_with_a_reason(trace, reason):
    rec, prob = mlflow_to_trace(trace)
    assert rec is None and prob[0] == reason and prob[1]


# ------------------------------------------------------------------------------------------ driver


class ScriptedTraces:
    """The two calls ingest_mlflow makes of flywheel.tracking.Tracker, over a fixed list of traces."""

    tracking_uri = "http://reader:pw@mlflow.internal:5000"

    def __init__(self, traces):
        self.traces = traces
        self.calls = []

    def find_experiment(self, name):
        return "7" if name == "agent" else None

    def iter_traces(self, experiment_id, *, since_ms=None, page_size=100):
        self.calls.append(since_ms)
        yield from self.traces


def _ingest(cfg, store, source, **kw):
    from flywheel.artifacts import open_artifacts
    from flywheel.ingest.mlflow_source import ingest_mlflow

    return ingest_mlflow(cfg, store, open_artifacts(cfg), source, "agent", **kw)


def test_ingest_is_idempotent_by_mlflow_trace_id_and_quarantines_with_reason(cfg, store):
    from flywheel.artifacts import load_traces
    from flywheel.ingest import show_quarantine

    bad = _trace([_span("retrieve", "RETRIEVER", sid="r", inputs={"q": "x"}, outputs=[])], tid="tr-bad")
    running = chat_trace(tid="tr-running", state="IN_PROGRESS")
    thumbs = chat_trace(tid="tr-2", assessments=[{"assessment_name": "thumbs", "source": {"source_type": "HUMAN"},
                                                  "feedback": {"value": False}}])
    source = ScriptedTraces([chat_trace(), bad, running, thumbs])
    s1 = _ingest(cfg, store, source)
    assert (s1.read, s1.ingested, s1.quarantined, s1.duplicates) == (3, 2, 1, 0)
    assert s1.quarantined_by_reason == {"mlflow_no_chat_span": 1}
    assert s1.failures_by_kind == {"negative_feedback": 1}
    assert s1.files[0]["skipped_in_progress"] == 1
    assert s1.files[0]["tracking_uri"] == "http://mlflow.internal:5000"  # never the password
    ev = {e.stream: e for e in store.read(types=["trace.ingested"])}
    assert set(ev) == {"trace:tr-1", "trace:tr-2"}
    full = load_traces(open_artifacts_for(cfg), [ev["trace:tr-1"].payload])[0]
    assert full["messages"][-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    (q,) = [e for e in store.entities("quarantine")]
    assert q["state"]["source_ids"] == ["tr-bad"] and q["state"]["file"] == "mlflow:agent"
    rows = show_quarantine(store, open_artifacts_for(cfg), q["entity_id"])
    assert rows[0]["reason"] == "mlflow_no_chat_span" and "tr-bad" in rows[0]["raw"]
    completed = store.read(types=["ingest.completed"])
    assert completed[0].payload["experiment"] == "agent" and "pw" not in completed[0].payload["tracking_uri"]

    # Second run: the same traces, nothing new; the finished trace that was in progress comes in now.
    n_events = len(store.read())
    s2 = _ingest(cfg, store, ScriptedTraces([chat_trace(), bad, running, thumbs]))
    assert s2.events_appended == 0 and len(store.read()) == n_events
    assert (s2.read, s2.duplicates, s2.ingested) == (3, 3, 0)
    s3 = _ingest(cfg, store, ScriptedTraces([chat_trace(), bad, chat_trace(tid="tr-running"), thumbs]))
    assert (s3.ingested, s3.duplicates) == (1, 3)


def open_artifacts_for(cfg):
    from flywheel.artifacts import open_artifacts

    return open_artifacts(cfg)


def test_oversized_trace_is_quarantined_not_dropped(cfg, store):
    cfg.ingest.max_line_bytes = 1500
    big = chat_trace(tid="tr-big")
    big["data"]["spans"][0]["attributes"]["padding"] = json.dumps("x" * 4000)
    s = _ingest(cfg, store, ScriptedTraces([big, chat_trace()]))
    assert s.quarantined_by_reason == {"line_too_long": 1} and s.ingested == 1


def test_since_is_parsed_and_unknown_experiment_is_a_clear_error(cfg, store):
    from flywheel.ingest.mlflow_source import MlflowSourceError, parse_since

    src = ScriptedTraces([])
    _ingest(cfg, store, src, since="2026-11-30T00:00:00Z")
    assert src.calls == [1_795_996_800_000]
    assert parse_since("1795996800000") == 1_795_996_800_000 and parse_since("2026-11-30T00:00:00") == 1_795_996_800_000
    with pytest.raises(MlflowSourceError, match="--since 'yesterday'"):
        parse_since("yesterday")
    from flywheel.artifacts import open_artifacts
    from flywheel.ingest.mlflow_source import ingest_mlflow

    with pytest.raises(MlflowSourceError, match="has no experiment named 'nope'"):
        ingest_mlflow(cfg, store, open_artifacts(cfg), src, "nope")
