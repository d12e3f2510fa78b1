"""Input formats: line parsing, format detection, and the OTel GenAI and BFCL adapters.

Every adapter produces the DESIGN.md trace shape, which then goes through the same validation,
redaction and classification as an OpenAI-format record.

OpenTelemetry GenAI (``otel``)
    One OTLP/JSON ``ExportTraceServiceRequest`` per line (what the collector's file exporter writes;
    a single pretty-printed document up to ``max_line_bytes`` is accepted too):
    ``resourceSpans[].scopeSpans[].spans[]`` with attributes as ``{key, value: {stringValue |
    intValue | doubleValue | boolValue | arrayValue | kvlistValue}}``. Spans are grouped by
    ``traceId``; a trace is complete when its root span (no ``parentSpanId``) has been read, or at the
    end of the file. Supported conventions:

    - inference spans: ``gen_ai.operation.name`` in chat/text_completion/generate_content, or any span
      with message attributes. The conversation is the *last* inference span's input + output
      messages (the convention records the full history on each call).
    - messages, newer convention: ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (JSON
      strings; parts ``text``, ``tool_call`` {id, name, arguments}, ``tool_call_response`` {id,
      response}), ``gen_ai.system_instructions``; OpenAI-shaped messages in those attributes are
      accepted as they are.
    - messages, older flattened convention: ``gen_ai.prompt.N.{role,content,tool_call_id}``,
      ``gen_ai.completion.N.{role,content}``, ``gen_ai.completion.N.tool_calls.M.{id,name,arguments}``.
    - tools: ``gen_ai.tool.definitions`` (JSON; flat ``{type, name, description, parameters}`` or
      OpenAI-nested) or the older ``llm.request.functions.N.{name,description,parameters}``.
    - model: ``gen_ai.request.model`` (else ``gen_ai.response.model``).
    - outcome: failure when any span has status code 2 (``STATUS_CODE_ERROR``) or ``error.type``;
      ``error`` = ``<error.type or exception.type>: <status message or exception.message>`` of the
      first such span. Feedback: a ``gen_ai.evaluation.result`` span event with
      ``gen_ai.evaluation.score.value`` (and ``gen_ai.evaluation.explanation`` as the comment).
    - ids: ``trace_id`` = the OTLP ``traceId``; timestamp = earliest span start.

    Not supported: spans of one trace split across files (the first file's part is ingested, the
    later part is a duplicate id); spans arriving after their trace's root span in the same file are
    quarantined as ``otel_late_span``; traces without any GenAI message attribute are quarantined as
    ``otel_no_genai``. Open (root-less) traces are held in memory until the end of the file.

BFCL replay (``bfcl``)
    One logged answer per line: ``{"bfcl_id": "simple_python_12", "category"?: "simple_python",
    "answer": "<raw model answer text>", "model": "...", "timestamp": "...", "trace_id"?: "...",
    "metadata"?: {...}}`` (``category`` defaults to the id without its trailing ``_<n>``). The trace:
    messages = the BFCL question + an assistant message whose content is the raw answer, with
    ``tool_calls`` when the shared parser reads calls from it; tools = BFCL functions as OpenAI specs;
    correction = BFCL's possible answer as expected calls; outcome = the project's ``tool_call``
    matcher (``flywheel.verifiers.matching.match_tool_calls``) against that answer. A missing
    ``trace_id`` becomes ``bfcl-<sha256(bfcl_id, model, timestamp, answer)[:16]>``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson

Problem = tuple[str, str]
FORMATS = ("openai", "otel", "bfcl")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes) -> tuple[Any, Problem | None]:
    """Parse one JSON document; never raises. Problems: ``invalid_utf8``, ``invalid_json``."""
    try:
        return orjson.loads(data), None
    except orjson.JSONDecodeError as e:
        err = e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as u:
        return None, ("invalid_utf8", f"invalid UTF-8 at byte {u.start}: {u.reason}")
    try:
        # A second opinion for what orjson refuses but JSON allows. (orjson reads integers beyond 64
        # bits as floats: such values lose precision; documented in the ingest module.)
        return json.loads(text, parse_constant=_reject_constant), None
    except (ValueError, RecursionError):
        pass
    msg = str(err)
    if text.strip() and not text.rstrip().endswith(("}", "]")):
        msg = f"truncated JSON? {msg}"
    return None, ("invalid_json", msg[:300])


def detect_format(obj: Any) -> str:
    if isinstance(obj, dict):
        if "resourceSpans" in obj:
            return "otel"
        if "bfcl_id" in obj:
            return "bfcl"
    return "openai"


# -- OpenTelemetry --------------------------------------------------------------------------------
def _any_value(v: Any) -> Any:
    if not isinstance(v, dict):
        return v
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        try:
            return int(v["intValue"])  # OTLP/JSON encodes int64 as a string
        except (TypeError, ValueError):
            return v["intValue"]
    if "doubleValue" in v:
        return v["doubleValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "arrayValue" in v:
        return [_any_value(x) for x in (v["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in v:
        return {kv.get("key"): _any_value(kv.get("value")) for kv in (v["kvlistValue"] or {}).get("values", [])}
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attrs(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        return {}
    return {a["key"]: _any_value(a.get("value")) for a in items if isinstance(a, dict) and isinstance(a.get("key"), str)}


def _nanos(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _json_attr(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return orjson.loads(v)
        except orjson.JSONDecodeError:
            return None
    return v


def _args_string(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _parts_message(m: dict[str, Any]) -> list[dict[str, Any]]:
    """One semconv message (role + parts) as OpenAI chat message(s)."""
    role = m.get("role")
    parts = m.get("parts")
    if not isinstance(parts, list):  # already OpenAI-shaped
        return [m]
    texts, calls, results = [], [], []
    for p in parts:
        if not isinstance(p, dict):
            continue
        t = p.get("type")
        if t == "text":
            texts.append(str(p.get("content", "")))
        elif t == "tool_call":
            calls.append({"id": str(p.get("id") or f"call_{len(calls)}"), "type": "function",
                          "function": {"name": str(p.get("name")), "arguments": _args_string(p.get("arguments"))}})
        elif t == "tool_call_response":
            resp = p.get("response")
            results.append({"role": "tool", "tool_call_id": str(p.get("id")),
                            "content": resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False)})
    if results:
        return results
    msg: dict[str, Any] = {"role": role, "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None and role != "assistant":
        msg["content"] = ""
    return [msg]


def _messages_attr(v: Any) -> list[dict[str, Any]] | None:
    data = _json_attr(v)
    if not isinstance(data, list):
        return None
    out = []
    for m in data:
        if isinstance(m, dict):
            out += _parts_message(m)
    return out


def _flattened(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """``gen_ai.prompt.0.role``-style attributes as OpenAI messages."""
    msgs: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    plen = len(prefix)
    for k, v in attrs.items():
        if not k.startswith(prefix):
            continue
        rest = k[plen:].split(".")
        if not rest[0].isdigit():
            continue
        i = int(rest[0])
        if len(rest) == 2 and rest[1] in ("role", "content", "tool_call_id", "name"):
            msgs.setdefault(i, {})[rest[1]] = v
        elif len(rest) == 4 and rest[1] == "tool_calls" and rest[2].isdigit():
            calls.setdefault(i, {}).setdefault(int(rest[2]), {})[rest[3]] = v
    out = []
    for i in sorted(set(msgs) | set(calls)):
        m = dict(msgs.get(i, {}))
        m.setdefault("role", "assistant" if prefix.endswith("completion.") else "user")
        if i in calls:
            m["tool_calls"] = [
                {"id": str(c.get("id") or f"call_{i}_{j}"), "type": "function",
                 "function": {"name": str(c.get("name")), "arguments": _args_string(c.get("arguments"))}}
                for j, c in sorted(calls[i].items())
            ]
            m.setdefault("content", None)
        elif "content" not in m:
            m["content"] = None if m["role"] == "assistant" else ""
        out.append(m)
    return out


def _tools_attr(attrs: dict[str, Any]) -> list[dict[str, Any]] | None:
    data = _json_attr(attrs.get("gen_ai.tool.definitions"))
    if isinstance(data, list):
        tools = []
        for t in data:
            if not isinstance(t, dict):
                continue
            fn = t.get("function") if isinstance(t.get("function"), dict) else {k: v for k, v in t.items() if k != "type"}
            tools.append({"type": "function", "function": fn})
        return tools
    flat: dict[int, dict[str, Any]] = {}
    for k, v in attrs.items():
        if k.startswith("llm.request.functions."):
            rest = k[len("llm.request.functions."):].split(".", 1)
            if len(rest) == 2 and rest[0].isdigit():
                flat.setdefault(int(rest[0]), {})[rest[1]] = _json_attr(v) if rest[1] == "parameters" else v
    if flat:
        return [{"type": "function", "function": flat[i]} for i in sorted(flat)]
    return None


_INFERENCE_OPS = {"chat", "text_completion", "generate_content"}


def _is_inference(attrs: dict[str, Any]) -> bool:
    if attrs.get("gen_ai.operation.name") in _INFERENCE_OPS:
        return True
    return any(k in attrs for k in ("gen_ai.input.messages", "gen_ai.output.messages")) or any(
        k.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for k in attrs
    )


def otel_spans(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(traceId, span, resource attributes) for every span of an OTLP/JSON export request."""
    for rs in obj.get("resourceSpans") or ():
        if not isinstance(rs, dict):
            continue
        res = _attrs((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
            if not isinstance(ss, dict):
                continue
            for sp in ss.get("spans") or ():
                if isinstance(sp, dict) and isinstance(sp.get("traceId"), str) and sp["traceId"]:
                    yield sp["traceId"], sp, res


def _is_error(sp: dict[str, Any], attrs: dict[str, Any]) -> bool:
    code = (sp.get("status") or {}).get("code")
    return code in (2, "2", "STATUS_CODE_ERROR") or "error.type" in attrs


def otel_to_trace(trace_id: str, spans: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[dict[str, Any] | None, Problem | None]:
    """Map the spans of one trace to a trace record."""
    spans = sorted(spans, key=lambda s: (_nanos(s[0].get("startTimeUnixNano")), str(s[0].get("spanId"))))
    parsed = [(sp, _attrs(sp.get("attributes")), res) for sp, res in spans]
    inference = [(sp, a) for sp, a, _ in parsed if _is_inference(a)]
    if not inference:
        return None, ("otel_no_genai", f"trace {trace_id}: no span carries gen_ai messages ({len(spans)} spans)")
    last_sp, last = inference[-1]
    msgs = _messages_attr(last.get("gen_ai.input.messages"))
    if msgs is None:
        msgs = _flattened(last, "gen_ai.prompt.")
    system = last.get("gen_ai.system_instructions")
    if system is not None and not any(m.get("role") == "system" for m in msgs):
        sys_parts = _json_attr(system)
        text = "".join(p.get("content", "") for p in sys_parts if isinstance(p, dict)) if isinstance(sys_parts, list) else str(system)
        msgs = [{"role": "system", "content": text}] + msgs
    out_msgs = _messages_attr(last.get("gen_ai.output.messages"))
    if out_msgs is None:
        out_msgs = _flattened(last, "gen_ai.completion.")
    messages = msgs + out_msgs
    tools = None
    for _, a in reversed(inference):
        tools = _tools_attr(a)
        if tools is not None:
            break
    error = None
    feedback = None
    for sp, a, _ in parsed:
        if error is None and _is_error(sp, a):
            etype = a.get("error.type")
            emsg = (sp.get("status") or {}).get("message")
            for ev in sp.get("events") or ():
                if isinstance(ev, dict) and ev.get("name") == "exception":
                    ea = _attrs(ev.get("attributes"))
                    etype = etype or ea.get("exception.type")
                    emsg = emsg or ea.get("exception.message")
            error = ": ".join(str(x) for x in (etype, emsg) if x) or "span status ERROR"
        for ev in sp.get("events") or ():
            if isinstance(ev, dict) and ev.get("name") == "gen_ai.evaluation.result":
                ea = _attrs(ev.get("attributes"))
                score = ea.get("gen_ai.evaluation.score.value")
                if isinstance(score, int | float) and not isinstance(score, bool):
                    feedback = {"score": score, "comment": ea.get("gen_ai.evaluation.explanation")}
    outcome: dict[str, Any] = {"status": "failure" if error else "success"}
    if error:
        outcome["error"] = error[:2000]
    if feedback is not None:
        outcome["feedback"] = feedback
    start = min(_nanos(sp.get("startTimeUnixNano")) for sp, _, _ in parsed)
    ts = datetime.fromtimestamp(start / 1e9, UTC).isoformat().replace("+00:00", "Z")
    res = parsed[0][2]
    model = last.get("gen_ai.request.model") or last.get("gen_ai.response.model") or ""
    rec: dict[str, Any] = {
        "trace_id": trace_id,
        "timestamp": ts,
        "model": str(model),
        "messages": messages,
        "tools": tools or [],
        "outcome": outcome,
        "metadata": {"otel": {"spans": len(spans), "service": res.get("service.name"),
                              "provider": last.get("gen_ai.provider.name") or last.get("gen_ai.system")}},
        "source": "otel",
        "source_id": trace_id,
    }
    return rec, None


# -- BFCL --------------------------------------------------------------------------------------------
class BfclAdapter:
    """Turns logged answers to BFCL questions into traces (see the module docstring)."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, Any]] = {}
        self._loaded: set[str] = set()

    def _item(self, bfcl_id: str, category: str) -> Any:
        if category not in self._loaded:
            from flywheel.verifiers.bfcl import load_bfcl

            for it in load_bfcl(category):
                self._items[it.id] = it
            self._loaded.add(category)
        return self._items.get(bfcl_id)

    def to_trace(self, obj: Any) -> tuple[dict[str, Any] | None, Problem | None]:
        from flywheel.verifiers.bfcl import CATEGORIES, bfcl_answer_to_expected

        if not isinstance(obj, dict):
            return None, ("not_an_object", "a BFCL replay record must be a JSON object")
        bid, answer = obj.get("bfcl_id"), obj.get("answer")
        if not isinstance(bid, str) or not bid:
            return None, ("missing_field", "BFCL record: 'bfcl_id' must be a non-empty string")
        if not isinstance(answer, str):
            return None, ("wrong_type", "BFCL record: 'answer' must be the raw answer text (a string)")
        for k in ("model", "timestamp"):
            if not isinstance(obj.get(k), str):
                return None, ("missing_field", f"BFCL record: '{k}' must be a string")
        category = obj.get("category") or bid.rsplit("_", 1)[0]
        if category not in CATEGORIES:
            return None, ("bfcl_unknown_id", f"BFCL category {category!r} is not one of {list(CATEGORIES)}")
        item = self._item(bid, category)
        if item is None:
            return None, ("bfcl_unknown_id", f"no BFCL question {bid!r} in category {category}")
        expected = bfcl_answer_to_expected(item.possible_answer)
        from flywheel.verifiers.matching import match_tool_calls
        from flywheel.verifiers.toolcalls import parse_tool_calls

        parsed = parse_tool_calls(answer)
        assistant: dict[str, Any] = {"role": "assistant", "content": answer}
        if parsed.calls:
            assistant["tool_calls"] = [c.to_openai(f"call_{i}") for i, c in enumerate(parsed.calls)]
        report = match_tool_calls(parsed.calls, item.tools, expected)
        outcome: dict[str, Any] = {"status": "success" if report.passed else "failure"}
        if not report.passed:
            why = report.details.get("why") or report.details.get("schema_errors") or []
            outcome["error"] = (parsed.error or "; ".join(str(w) for w in why) or "answer does not match")[:2000]
        tid = obj.get("trace_id")
        if not isinstance(tid, str) or not tid:
            h = hashlib.sha256("\x1f".join([bid, obj["model"], obj["timestamp"], answer]).encode()).hexdigest()
            tid = f"bfcl-{h[:16]}"
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        rec = {
            "trace_id": tid,
            "timestamp": obj["timestamp"],
            "model": obj["model"],
            "messages": [dict(m) for m in item.question_messages] + [assistant],
            "tools": item.tools,
            "outcome": outcome,
            "correction": {"tool_calls": expected},
            "metadata": {**meta, "bfcl": {"category": category, "components": report.components}},
            "source": "bfcl",
            "source_id": bid,
        }
        return rec, None
