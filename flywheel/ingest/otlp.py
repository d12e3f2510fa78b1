"""OTLP/JSON spans and log records -> trace records: OpenTelemetry GenAI (both generations) and OpenInference.

Input: OTLP/JSON export requests, one per line, as an OpenTelemetry Collector's file exporter writes
them (``{"resourceSpans": [...]}`` and/or ``{"resourceLogs": [...]}``; one file may mix both), or one
JSON document. Ids are lowercase hex as OTLP/JSON specifies; base64 ids (protobuf's generic JSON
mapping) are accepted too. Attributes are ``{key, value: {stringValue | intValue | doubleValue |
boolValue | arrayValue | kvlistValue | bytesValue}}``.

What is read (tested against spans and logs produced by the real packages: see
``tests/integration/test_otel_instrumentations.py``)
-----------------------------------------------------------------------------------------------
Conventions, per inference span (the conversation is taken from the *last* inference span that
carries content: each call records the full history it sent):

``genai-span`` (``opentelemetry-instrumentation-openai-v2`` >= 2.4 with ``span_only`` /
``span_and_event``; other GenAI instrumentations)
    span attributes ``gen_ai.input.messages``, ``gen_ai.output.messages``,
    ``gen_ai.system_instructions``, ``gen_ai.tool.definitions`` (JSON strings or structured values;
    parts ``text``, ``tool_call`` {id, name, arguments}, ``tool_call_response`` {id, response}).
``genai-details`` (openai-v2 >= 2.4 with ``event_only``)
    the same attributes on a ``gen_ai.client.inference.operation.details`` log record correlated to
    the span by trace and span id.
``genai-events`` (openai-v2 <= 2.3, content as log records)
    ``gen_ai.system.message``, ``gen_ai.user.message``, ``gen_ai.assistant.message``,
    ``gen_ai.tool.message`` (the input, in record order) and ``gen_ai.choice`` (the output; choice
    ``index`` 0 when ``n`` > 1) log records correlated by trace and span id; the event name is the
    record's ``eventName`` or its ``event.name`` attribute (older SDKs).
``openinference`` (``openinference-instrumentation-openai``, Arize Phoenix)
    ``llm.input_messages.N.message.{role, content, contents.M.message_content.text, name,
    tool_call_id, tool_calls.K.tool_call.{id, function.name, function.arguments}}``,
    ``llm.output_messages.*`` alike, ``llm.tools.N.tool.json_schema``, ``llm.invocation_parameters``,
    ``llm.token_count.{prompt, completion}``, ``llm.model_name``; errors from the span status and its
    ``exception`` event.
``genai-flattened`` (older instrumentations)
    ``gen_ai.prompt.N.*``, ``gen_ai.completion.N.*`` (+ ``tool_calls.M.*``),
    ``llm.request.functions.N.*``.

Kept as trace metadata (``metadata``): ``usage`` (input/output tokens summed over the trace's
inference calls), ``finish_reasons``, ``response_id``, ``request`` (temperature, max_tokens, top_p,
seed, ... of the last call), ``calls`` (per inference call: span, response id, model, finish reasons,
tokens) and ``otel`` (spans, service, provider, convention, instrumentation scope). Outcome: failure
when a span has status ERROR or ``error.type``; ``error`` = ``<type>: <message>`` from
``error.type`` / the ``exception`` event / the status message. Feedback from a
``gen_ai.evaluation.result`` span event.

When is a trace complete
------------------------
A file is scanned once before it is read (:func:`scan`, a regex over the raw bytes: ~1 GB/s) for
the last line that mentions each trace id; a trace is assembled right after that line, so spans and
log records of one trace may come in any order and on any lines of the file. Without a scan (a
single JSON document) every trace is assembled at the end.

Paired files: a file holding only log records (``resourceLogs``) is joined to the span-bearing OTLP
files given in the same ingest (a Collector with one file exporter per signal writes such pairs):
its GenAI records are held in memory (:class:`LogIndex`) while those files are read. Alone, it is
refused up front with a message that says where the spans are (:func:`plan_files`). Its own records
are then counted as joined, or quarantined ``otel_log_without_span`` when no span of their trace was
found.

Quarantine reasons
------------------
``otel_no_genai`` (no span is a GenAI inference call), ``otel_content_not_captured`` (GenAI spans
without any message content: the instrumentation's content capture is off; the detail names the
setting for each instrumentation), ``otel_log_without_span`` (GenAI log records whose spans are in
none of the files read), ``otel_nothing_to_read`` (an export request with neither spans nor log
records carrying a trace id), ``otel_late_span`` (a trace id met again after its trace was assembled:
only possible when the scan could not run), ``otel_unreadable`` (a span or record of an unexpected
shape, e.g. a ``status`` that is not an object; the detail names the error), ``otel_bad_value`` (a
value no mapping can read, e.g. a kvlist entry whose key is not a string: the line or trace holding it
is quarantined, also when it sits in a logs companion file; the other records go on).

Not supported: a trace's spans split across two span-bearing files (the first part is read, the
later one is a duplicate id); content uploaded elsewhere by reference (``gen_ai.input.messages.ref``);
several independent conversations in one trace (the last inference call's conversation is kept, the
other calls appear only in ``metadata.calls``); ``n`` > 1 choices beyond the first.
Memory: the scan keeps one small entry per trace id of the file; open traces are held until their
last line.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from flywheel.ingest.formats import parse_json
from flywheel.ingest.reader import iter_lines, open_binary
from flywheel.tool_registry import normalise_tool
from flywheel.vocab.messages import json_text, text_of
from flywheel.vocab.tools import call_function

Problem = tuple[str, str]

GENAI_EVENTS = frozenset({
    "gen_ai.system.message", "gen_ai.user.message", "gen_ai.assistant.message", "gen_ai.tool.message",
    "gen_ai.choice", "gen_ai.client.inference.operation.details",
})
_EVENT_ROLE = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
               "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
_INFERENCE_OPS = {"chat", "text_completion", "generate_content"}
_REQUEST_PARAMS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                   "stop_sequences", "choice.count", "encoding_formats")
_REQUEST_KEYS = tuple((p, f"gen_ai.request.{p}") for p in _REQUEST_PARAMS)
MAX_CALLS_KEPT = 64

# How to turn content capture on, per instrumentation (the reason of otel_content_not_captured).
CAPTURE_HINT = (
    "opentelemetry-instrumentation-openai-v2 >= 2.4: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only "
    "(or span_and_event / event_only; the value 'true' is not accepted there and means no content); "
    "openai-v2 <= 2.3: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true and export the log records "
    "(content is in logs, not spans); OpenInference: unset OPENINFERENCE_HIDE_INPUTS, "
    "OPENINFERENCE_HIDE_OUTPUTS, OPENINFERENCE_HIDE_INPUT_MESSAGES and OPENINFERENCE_HIDE_OUTPUT_MESSAGES"
)


# -- OTLP/JSON values ------------------------------------------------------------------------------
class BadValue(ValueError):
    """An OTLP value no mapping can read (a kvlist entry whose key is not a string): the record that
    holds it is quarantined as ``otel_bad_value`` with this message, the rest of the file goes on."""


def _kv_key(e: dict[str, Any]) -> str:
    k = e.get("key")
    if type(k) is not str:
        raise BadValue(f"a kvlistValue entry's key is not a string ({type(k).__name__} {str(k)[:40]})")
    return k


def any_value(v: Any) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value (int64 strings as ints, kvlists as dicts).
    Raises :class:`BadValue` for a kvlist entry whose key is not a string (a dict key must be one)."""
    if type(v) is not dict or len(v) != 1:
        return _any_value_slow(v)
    ((k, x),) = v.items()  # one key: the common shape, read without a lookup per candidate key
    if k == "stringValue":
        return x
    if k == "kvlistValue" and type(x) is dict:
        try:
            out = {e["key"]: any_value(e["value"]) for e in _values(x)}
        except (KeyError, TypeError):
            return _any_value_slow(v)
        if all(type(kk) is str for kk in out):
            return out
        return _any_value_slow(v)
    if k == "arrayValue" and type(x) is dict:
        return [any_value(e) for e in _values(x)]
    return _any_value_slow(v)


def _values(container: dict[str, Any]) -> list[Any] | tuple[()]:
    """The ``values`` list of a kvlist or array value; anything else there (``true``, an object) is no values."""
    vs = container.get("values")
    return vs if type(vs) is list else ()


def _any_value_slow(v: Any) -> Any:
    if type(v) is not dict:
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
    kv = v.get("kvlistValue")
    if kv is not None:
        return {_kv_key(x): any_value(x.get("value")) for x in _values(kv) if type(x) is dict} \
            if type(kv) is dict else {}
    arr = v.get("arrayValue")
    if arr is not None:
        return [any_value(x) for x in _values(arr)] if type(arr) is dict else []
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def attrs(items: Any) -> dict[str, Any]:
    if type(items) is not list:
        return {}
    try:  # well-formed attributes: {key, value} objects with a string key
        out = {a["key"]: any_value(a["value"]) for a in items}
        if all(type(k) is str for k in out):
            return out
    except (KeyError, TypeError):
        pass
    out = {}
    for a in items:
        if type(a) is dict:
            k = a.get("key")
            if type(k) is str:
                out[k] = any_value(a.get("value"))
    return out


def norm_id(v: Any) -> str:
    """A trace/span id as lowercase hex: hex is kept, base64 (protobuf's JSON mapping) is converted."""
    if type(v) is not str or not v:
        return ""
    if len(v) in (16, 32):  # hex (base64 of 8 or 16 bytes is 12 or 24 characters long)
        return v.lower()
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return v
    return raw.hex() if len(raw) in (8, 16) else v


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


def _text_of(v: Any) -> str:
    # Frozen (the stored trace, and so its failure id, is built from it): parts hold their text under
    # "text" or "content", every object part counts, any other value is written as JSON.
    return text_of(v, nonstring_text="stringify", keys=("text", "content"), other=json_text)


# -- iterating export requests --------------------------------------------------------------------
def _obj(v: Any) -> dict[str, Any]:
    return v if type(v) is dict else {}


def _seq(v: Any) -> list[Any]:
    return v if type(v) is list else []

def iter_spans(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """(trace id, span, resource attributes, scope name) for every span of an export request."""
    for rs in _seq(obj.get("resourceSpans")):
        if not isinstance(rs, dict):
            continue
        res = attrs(_obj(rs.get("resource")).get("attributes"))
        for ss in _seq(rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans")):
            if not isinstance(ss, dict):
                continue
            scope = str(_obj(ss.get("scope") or ss.get("instrumentationLibrary")).get("name") or "")
            for sp in _seq(ss.get("spans")):
                if isinstance(sp, dict):
                    tid = norm_id(sp.get("traceId"))
                    if tid:
                        yield tid, sp, res, scope


def iter_logs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(trace id or "", log record, scope name) for every log record of an export request."""
    for rl in _seq(obj.get("resourceLogs")):
        if not isinstance(rl, dict):
            continue
        for sl in _seq(rl.get("scopeLogs")):
            if not isinstance(sl, dict):
                continue
            scope = str(_obj(sl.get("scope")).get("name") or "")
            for lr in _seq(sl.get("logRecords")):
                if isinstance(lr, dict):
                    yield norm_id(lr.get("traceId")), lr, scope


def event_name(lr: dict[str, Any], a: dict[str, Any] | None = None) -> str:
    name = lr.get("eventName")
    if isinstance(name, str) and name:
        return name
    if a is None:
        for kv in _seq(lr.get("attributes")):
            if isinstance(kv, dict) and kv.get("key") == "event.name":
                return str(any_value(kv.get("value")) or "")
        return ""
    return str(a.get("event.name") or "")


@dataclass(slots=True)
class LogRec:
    """A GenAI log record, reduced to what the mapping reads."""

    span_id: str
    name: str
    time: int
    attrs: dict[str, Any]
    body: Any


def compact_log(lr: dict[str, Any]) -> LogRec | None:
    """A GenAI log record as a :class:`LogRec` (None for any other record)."""
    name = event_name(lr)
    if name not in GENAI_EVENTS:
        return None
    return LogRec(norm_id(lr.get("spanId")), name, _nanos(lr.get("timeUnixNano") or lr.get("observedTimeUnixNano")),
                  attrs(lr.get("attributes")), any_value(lr.get("body")))


# -- messages -------------------------------------------------------------------------------------
def _parts_message(m: dict[str, Any]) -> list[dict[str, Any]]:
    """One GenAI semconv message (role + parts) as OpenAI chat message(s)."""
    role = m.get("role")
    parts = m.get("parts")
    if not isinstance(parts, list):  # already OpenAI-shaped
        if "content" not in m and role != "assistant":
            m = {**m, "content": ""}
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


def messages_value(v: Any) -> list[dict[str, Any]] | None:
    """``gen_ai.input.messages`` / ``gen_ai.output.messages`` (JSON string or structured) as OpenAI messages."""
    data = _json_attr(v)
    if not isinstance(data, list):
        return None
    out: list[dict[str, Any]] = []
    for m in data:
        if isinstance(m, dict):
            out += _parts_message(m)
    return out


def _system_value(v: Any) -> str | None:
    if v is None:
        return None
    parts = _json_attr(v)
    if isinstance(parts, list):
        return "".join(str(p.get("content", "")) for p in parts if isinstance(p, dict))
    return str(v)


def _flattened(a: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """``gen_ai.prompt.0.role``-style attributes as OpenAI messages."""
    msgs: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    plen = len(prefix)
    for k, v in a.items():
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


def _openinference_messages(a: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """``llm.input_messages.N.message.*`` (OpenInference) as OpenAI messages."""
    msgs: dict[int, dict[str, Any]] = {}
    plen = len(prefix)
    for k, v in a.items():
        if not k.startswith(prefix):
            continue
        idx, _, rest = k[plen:].partition(".message.")
        if not idx.isdigit() or not rest:
            continue
        m = msgs.setdefault(int(idx), {"_calls": {}, "_parts": {}})
        if rest in ("role", "content", "name", "tool_call_id"):
            m[rest] = v
        elif rest.startswith("tool_calls."):
            j, _, field_ = rest[len("tool_calls."):].partition(".tool_call.")
            if j.isdigit():
                m["_calls"].setdefault(int(j), {})[field_] = v
        elif rest.startswith("contents."):
            j, _, field_ = rest[len("contents."):].partition(".message_content.")
            if j.isdigit() and field_ == "text":
                m["_parts"][int(j)] = v
    out = []
    for i in sorted(msgs):
        m = msgs[i]
        calls, parts = m.pop("_calls"), m.pop("_parts")
        role = m.get("role") or "user"
        msg: dict[str, Any] = {"role": role}
        content = m.get("content")
        if content is None and parts:
            content = "".join(str(parts[j]) for j in sorted(parts))
        if calls:
            msg["content"] = content
            msg["tool_calls"] = [
                {"id": str(c.get("id") or f"call_{i}_{j}"), "type": "function",
                 "function": {"name": str(c.get("function.name")), "arguments": _args_string(c.get("function.arguments"))}}
                for j, c in sorted(calls.items())
            ]
        else:
            msg["content"] = content if content is not None else (None if role == "assistant" else "")
        if isinstance(m.get("name"), str) and role != "tool":
            msg["name"] = m["name"]
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
    return out


def _event_message(name: str, body: Any) -> dict[str, Any]:
    """One ``gen_ai.{system,user,assistant,tool}.message`` log body as an OpenAI message."""
    b = body if isinstance(body, dict) else {}
    role = b.get("role") if isinstance(b.get("role"), str) else _EVENT_ROLE[name]
    msg: dict[str, Any] = {"role": role}
    content = b.get("content")
    if role == "tool":
        msg["tool_call_id"] = str(b.get("id") or "")
        msg["content"] = _text_of(content)
        return msg
    tcs = b.get("tool_calls")
    if isinstance(tcs, list) and tcs:
        msg["content"] = _text_of(content) if content is not None else None
        msg["tool_calls"] = [_event_call(tc, j) for j, tc in enumerate(tcs)]
    else:
        msg["content"] = _text_of(content) if content is not None else (None if role == "assistant" else "")
    return msg


def _event_call(tc: Any, j: int) -> dict[str, Any]:
    tc = tc if isinstance(tc, dict) else {}
    fn = call_function(tc, flat=False)
    return {"id": str(tc.get("id") or f"call_{j}"), "type": "function",
            "function": {"name": str(fn.get("name")), "arguments": _args_string(fn.get("arguments", ""))}}


def _choice_message(body: Any) -> tuple[dict[str, Any], Any]:
    b = body if isinstance(body, dict) else {}
    m = b.get("message") if isinstance(b.get("message"), dict) else {}
    return _event_message("gen_ai.assistant.message", {**m, "role": "assistant"}), b.get("finish_reason")


def _has_content(msgs: list[dict[str, Any]]) -> bool:
    """Any text, tool-call arguments or tool result: what content capture adds."""
    for m in msgs:
        c = m.get("content")
        if c:
            return True
        for tc in m.get("tool_calls") or ():
            args = call_function(tc, flat=False).get("arguments")
            if args and args != "{}":
                return True
    return False


# -- one inference call ------------------------------------------------------------------------------
@dataclass
class Call:
    span: dict[str, Any]
    attrs: dict[str, Any]
    scope: str
    start: int
    logs: list[LogRec] = field(default_factory=list)

    def content(self) -> tuple[list[dict[str, Any]], str, list[Any]] | None:
        """(messages, convention, finish reasons seen in the content) or None without messages."""
        a = self.attrs
        details = next((lg for lg in reversed(self.logs) if lg.name == "gen_ai.client.inference.operation.details"),
                       None)
        src, conv = (a, "genai-span")
        if "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a and details is not None:
            src, conv = details.attrs, "genai-details"
        inp = messages_value(src.get("gen_ai.input.messages"))
        out = messages_value(src.get("gen_ai.output.messages"))
        system = _system_value(src.get("gen_ai.system_instructions"))
        finish: list[Any] = []
        if inp is None and out is None:
            events = [lg for lg in self.logs if lg.name in _EVENT_ROLE or lg.name == "gen_ai.choice"]
            if events:
                conv, inp, out = "genai-events", [], []
                choices: dict[int, tuple[dict[str, Any], Any]] = {}
                for lg in events:
                    if lg.name == "gen_ai.choice":
                        b = lg.body if isinstance(lg.body, dict) else {}
                        idx = b.get("index", 0)
                        choices.setdefault(idx if isinstance(idx, int) else 0, _choice_message(lg.body))
                    else:
                        inp.append(_event_message(lg.name, lg.body))
                if choices:
                    msg, fr = choices[min(choices)]
                    out.append(msg)
                    finish = [c[1] for _, c in sorted(choices.items()) if c[1] is not None]
            elif any(k.startswith("llm.input_messages.") or k.startswith("llm.output_messages.") for k in a):
                conv = "openinference"
                inp = _openinference_messages(a, "llm.input_messages.")
                out = _openinference_messages(a, "llm.output_messages.")
            elif any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for k in a):
                conv = "genai-flattened"
                inp = _flattened(a, "gen_ai.prompt.")
                out = _flattened(a, "gen_ai.completion.")
            else:
                return None
        msgs = list(inp or [])
        if system is not None and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})
        msgs += out or []
        return msgs, conv, finish

    def tools(self) -> list[dict[str, Any]] | None:
        a = self.attrs
        data = _json_attr(a.get("gen_ai.tool.definitions"))
        if data is None:
            for lg in self.logs:
                if lg.name == "gen_ai.client.inference.operation.details" and "gen_ai.tool.definitions" in lg.attrs:
                    data = _json_attr(lg.attrs["gen_ai.tool.definitions"])
        if isinstance(data, list):
            return [t for t in (normalise_tool(x) for x in data) if t is not None]
        oi: dict[int, Any] = {}
        flat: dict[int, dict[str, Any]] = {}
        for k, v in a.items():
            if not k.startswith("llm."):
                continue
            if k.startswith("llm.tools."):
                i, _, rest = k[len("llm.tools."):].partition(".")
                if i.isdigit() and rest == "tool.json_schema":
                    oi[int(i)] = _json_attr(v)
            elif k.startswith("llm.request.functions."):
                rest = k[len("llm.request.functions."):].split(".", 1)
                if len(rest) == 2 and rest[0].isdigit():
                    flat.setdefault(int(rest[0]), {})[rest[1]] = _json_attr(v) if rest[1] == "parameters" else v
        src = [oi[i] for i in sorted(oi)] or [flat[i] for i in sorted(flat)]
        if src:
            return [t for t in (normalise_tool(x) for x in src) if t is not None]
        return None

    def info(self) -> dict[str, Any]:
        """Response id, model, finish reasons, tokens and request parameters of this call."""
        a = self.attrs
        out: dict[str, Any] = {"span_id": norm_id(self.span.get("spanId"))}
        rid = a.get("gen_ai.response.id")
        if rid is None and isinstance(a.get("output.value"), str) and a.get("output.mime_type") == "application/json":
            body = _json_attr(a["output.value"])
            rid = body.get("id") if isinstance(body, dict) else None
        if rid is not None:
            out["response_id"] = str(rid)
        model = a.get("gen_ai.response.model") or a.get("gen_ai.request.model") or a.get("llm.model_name")
        if model is not None:
            out["model"] = str(model)
        fr = a.get("gen_ai.response.finish_reasons")
        if fr is None and a.get("llm.finish_reason") is not None:
            fr = [a["llm.finish_reason"]]
        if isinstance(fr, str):
            fr = [fr]
        if fr is not None:
            out["finish_reasons"] = [str(x) for x in fr]
        for ours, keys in (("input_tokens", ("gen_ai.usage.input_tokens", "llm.token_count.prompt")),
                           ("output_tokens", ("gen_ai.usage.output_tokens", "llm.token_count.completion"))):
            for k in keys:
                if isinstance(a.get(k), int) and not isinstance(a.get(k), bool):
                    out[ours] = a[k]
                    break
        req = {p: a[k] for p, k in _REQUEST_KEYS if k in a}
        if not req and "llm.invocation_parameters" in a:
            inv = _json_attr(a["llm.invocation_parameters"])
            if isinstance(inv, dict):
                req = {k: v for k, v in inv.items() if k not in ("model", "messages", "tools")}
        if req:
            out["request"] = req
        return out


def _is_inference(a: dict[str, Any], has_logs: bool) -> bool:
    op = a.get("gen_ai.operation.name")
    if op in _INFERENCE_OPS or has_logs:
        return True
    if a.get("openinference.span.kind") == "LLM":
        return True
    for k in a:
        if k.startswith(("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.prompt.", "gen_ai.completion.",
                         "llm.input_messages.", "llm.output_messages.")):
            return True
    return False


def _error_type(v: Any) -> str:
    s = str(v)
    if s.startswith("<class '") and s.endswith("'>"):  # openai-v2 2.4 writes str(type(exc))
        s = s[len("<class '"):-2]
    return s.rsplit(".", 1)[-1] if "." in s and " " not in s else s


def _error(sp: dict[str, Any], a: dict[str, Any]) -> str | None:
    status = sp.get("status") or {}
    code = status.get("code")
    if not (code in (2, "2", "STATUS_CODE_ERROR") or "error.type" in a):
        return None
    etype = _error_type(a["error.type"]) if "error.type" in a else None
    emsg = None
    for ev in sp.get("events") or ():
        if isinstance(ev, dict) and ev.get("name") == "exception":
            ea = attrs(ev.get("attributes"))
            etype = etype or (_error_type(ea["exception.type"]) if ea.get("exception.type") else None)
            emsg = emsg or ea.get("exception.message")
    emsg = emsg or status.get("message")
    if etype and isinstance(emsg, str) and emsg.startswith(f"{etype}:"):
        emsg = emsg[len(etype) + 1:].strip()
    return ": ".join(str(x) for x in (etype, emsg) if x) or "span status ERROR"


def _no_content_detail(tid: str, calls: list[Call], n_logs: int) -> str:
    names = sorted({str(c.span.get("name")) for c in calls})[:3]
    scopes = {c.scope for c in calls}
    where = ""
    if "opentelemetry.instrumentation.openai_v2" in scopes and not n_logs:
        where = (" These spans come from opentelemetry-instrumentation-openai-v2 <= 2.3, which writes content as "
                 "log records: none were found for this trace (export the logs too, in this file or a file given "
                 "with it).")
    return (f"trace {tid}: {len(calls)} GenAI span(s) {names} but no message content: content capture is off in "
            f"the instrumentation.{where} Turn it on: {CAPTURE_HINT}.")


def to_trace(tid: str, spans: list[tuple[dict[str, Any], dict[str, Any], str]],
             logs: list[LogRec]) -> tuple[dict[str, Any] | None, Problem | None]:
    """Map the spans (span, resource attributes, scope) and GenAI log records of one trace to a trace record."""
    if not spans:
        return None, ("otel_log_without_span",
                      f"trace {tid}: {len(logs)} GenAI log record(s) but none of its spans: spans and log records "
                      "are exported separately (tracer and logger provider); give the file with the spans in the "
                      "same ingest (flywheel ingest SPANS_FILE LOGS_FILE)")
    by_span: dict[str, list[LogRec]] = {}
    for lg in sorted(logs, key=lambda x: x.time):  # stable: records of one time keep file order
        by_span.setdefault(lg.span_id, []).append(lg)
    keyed = sorted(((_nanos(sp.get("startTimeUnixNano")), str(sp.get("spanId")), sp, res, scope)
                    for sp, res, scope in spans), key=lambda x: (x[0], x[1]))
    parsed = [(sp, attrs(sp.get("attributes")), res, scope) for _, _, sp, res, scope in keyed]
    calls: list[Call] = []
    for (t0, _, _, _, _), (sp, a, _, scope) in zip(keyed, parsed, strict=True):
        lg = by_span.get(norm_id(sp.get("spanId")), [])
        if _is_inference(a, bool(lg)):
            calls.append(Call(sp, a, scope, t0, lg))
    if not calls:
        return None, ("otel_no_genai", f"trace {tid}: no span is a GenAI inference call ({len(spans)} spans)")
    chosen = None
    for c in reversed(calls):
        got = c.content()
        if got is not None and _has_content(got[0]):
            chosen = (c, got)
            break
    if chosen is None:
        return None, ("otel_content_not_captured", _no_content_detail(tid, calls, len(logs)))
    last, (messages, convention, content_finish) = chosen
    tools = None
    for c in [last, *(c for c in reversed(calls) if c is not last)]:
        tools = c.tools()
        if tools is not None:
            break
    error = feedback = None
    for sp, a, _, _ in parsed:
        if error is None:
            error = _error(sp, a)
        for ev in sp.get("events") or ():
            if isinstance(ev, dict) and ev.get("name") == "gen_ai.evaluation.result":
                ea = attrs(ev.get("attributes"))
                score = ea.get("gen_ai.evaluation.score.value")
                if isinstance(score, int | float) and not isinstance(score, bool):
                    feedback = {"score": score, "comment": ea.get("gen_ai.evaluation.explanation")}
    outcome: dict[str, Any] = {"status": "failure" if error else "success"}
    if error:
        outcome["error"] = error[:2000]
    if feedback is not None:
        outcome["feedback"] = feedback
    start = keyed[0][0]
    ts = datetime.fromtimestamp(start / 1e9, UTC).isoformat().replace("+00:00", "Z")
    res = parsed[0][2]
    la = last.attrs
    model = la.get("gen_ai.request.model") or la.get("gen_ai.response.model") or la.get("llm.model_name")
    if model is None:  # OpenInference records the requested model only in the invocation parameters
        inv = _json_attr(la.get("llm.invocation_parameters"))
        model = inv.get("model") if isinstance(inv, dict) else None
    infos = [c.info() for c in calls]
    li = infos[calls.index(last)]
    meta: dict[str, Any] = {"otel": {
        "spans": len(spans), "service": res.get("service.name"), "convention": convention, "scope": last.scope,
        "provider": la.get("gen_ai.provider.name") or la.get("gen_ai.system") or la.get("llm.provider")
        or la.get("llm.system"),
    }}
    tin = [i["input_tokens"] for i in infos if "input_tokens" in i]
    tout = [i["output_tokens"] for i in infos if "output_tokens" in i]
    if tin or tout:
        meta["usage"] = {"input_tokens": sum(tin), "output_tokens": sum(tout), "calls": len(infos)}
    fr = li.get("finish_reasons") or [str(x) for x in content_finish]
    if fr:
        meta["finish_reasons"] = fr
    if "response_id" in li:
        meta["response_id"] = li["response_id"]
    if "request" in li:
        meta["request"] = li["request"]
    if len(infos) > 1:
        meta["calls"] = infos[:MAX_CALLS_KEPT]
    rec: dict[str, Any] = {
        "trace_id": tid,
        "timestamp": ts,
        "model": str(model or ""),
        "messages": messages,
        "tools": tools or [],
        "outcome": outcome,
        "metadata": meta,
        "source": "otel",
        "source_id": tid,
    }
    return rec, None


# -- files -------------------------------------------------------------------------------------------
_TRACE_ID = re.compile(rb'"traceId"\s*:\s*"([^"]+)"')


@dataclass
class Scan:
    """What :func:`scan` learnt about a file without parsing it."""

    last_line: dict[str, int] = field(default_factory=dict)  # trace id -> last line mentioning it
    has_spans: bool = False
    has_logs: bool = False


def scan(path: Path, max_line_bytes: int) -> Scan:
    """One pass over the raw lines: the last line of every trace id, and which signals the file holds."""
    out = Scan()
    last = out.last_line
    with open_binary(path) as stream:
        try:
            for line in iter_lines(stream, max_line_bytes):
                if line.error or line.oversize:
                    continue
                data = line.data
                if not out.has_spans and b'"resourceSpans"' in data:
                    out.has_spans = True
                if not out.has_logs and b'"resourceLogs"' in data:
                    out.has_logs = True
                n = line.lineno
                for m in _TRACE_ID.findall(data):
                    tid = m.decode("ascii", "replace")
                    last[tid if len(tid) == 32 else norm_id(tid)] = n
        except (EOFError, OSError):  # a cut file: the line reader reports it when the file is read
            pass
    last.pop("", None)
    return out


def looks_like_otlp(path: Path) -> bool:
    """The first 64 KiB mention ``resourceSpans`` or ``resourceLogs`` (an OTLP/JSON file)."""
    try:
        with open_binary(path) as f:
            head = f.read(64 * 1024)
    except (EOFError, OSError):
        return False
    return b'"resourceSpans"' in head or b'"resourceLogs"' in head


class PairingError(ValueError):
    """A file of log records was given without any file holding their spans."""


def plan_files(paths: Sequence[Path], max_line_bytes: int) -> dict[Path, list[Path]]:
    """Companions of each OTLP file in one ingest: a span-bearing file gets the log-only files (to join
    their records), a log-only file gets the span-bearing files (to know which of its records were
    joined). Raises :class:`PairingError` when there are log-only files but no span-bearing one."""
    spans, logs_only = [], []
    for p in paths:
        s = scan_signals(p)
        if s == "logs":
            logs_only.append(p)
        elif s == "spans":
            spans.append(p)
    if logs_only and not spans:
        names = ", ".join(p.name for p in logs_only[:3]) + (" ..." if len(logs_only) > 3 else "")
        raise PairingError(
            f"{names}: only OTLP log records (resourceLogs), no spans. GenAI log records are joined to their "
            "spans by trace and span id, and the spans are exported separately (the tracer provider's exporter; "
            "a Collector's traces pipeline writes them to its own file): give the spans file in the same "
            "command, e.g. `flywheel ingest traces.jsonl logs.jsonl`, or a directory holding both")
    plan: dict[Path, list[Path]] = {}
    for p in spans:
        plan[p] = list(logs_only)
    for p in logs_only:
        plan[p] = list(spans)
    return plan


def scan_signals(path: Path) -> str:
    """``"spans"`` (the file holds spans, maybe logs too), ``"logs"`` (log records only) or ``""``."""
    has_spans = has_logs = False
    tail = b""
    try:
        with open_binary(path) as f:
            while chunk := f.read(1 << 22):
                buf = tail + chunk  # a key split across two reads is still found
                has_logs = has_logs or b'"resourceLogs"' in buf
                if b'"resourceSpans"' in buf:
                    has_spans = True
                    break
                tail = chunk[-32:]
    except (EOFError, OSError):
        pass
    return "spans" if has_spans else ("logs" if has_logs else "")


class LogIndex:
    """GenAI log records of log-only companion files, by trace id (held in memory while the span
    files are read; a trace's records are handed over once and forgotten)."""

    def __init__(self) -> None:
        self.by_trace: dict[str, list[LogRec]] = {}

    @classmethod
    def load(cls, paths: Sequence[Path], max_line_bytes: int) -> LogIndex:
        idx = cls()
        for p in paths:
            with open_binary(p) as stream:
                try:
                    for line in iter_lines(stream, max_line_bytes):
                        if line.error or line.oversize or not line.data.strip():
                            continue
                        obj, prob = parse_json(line.data)
                        if prob or not isinstance(obj, dict):
                            continue  # reported when the log file itself is read
                        for tid, lr, _ in iter_logs(obj):
                            try:
                                rec = compact_log(lr) if tid else None
                            except BadValue:
                                continue  # quarantined with its reason when the log file itself is read
                            if rec is not None:
                                idx.by_trace.setdefault(tid, []).append(rec)
                except (EOFError, OSError):
                    pass
        return idx

    def take(self, tid: str) -> list[LogRec]:
        return self.by_trace.pop(tid, [])


class Assembler:
    """Per-file state of the OTLP reader: spans and GenAI log records grouped by trace, handed out
    when a trace is complete (see the module docstring).

    ``path``: the file, scanned on first use for the last line of each trace (None: every trace is
    complete at the end). ``companions``: log-only files to join (for a span-bearing file), or the
    span-bearing files (for a log-only file).
    """

    def __init__(self, path: Path | None, companions: Sequence[Path], max_line_bytes: int) -> None:
        self.path = path
        self.companions = list(companions)
        self.max_line_bytes = max_line_bytes
        self._ready = False
        self._last: dict[str, int] = {}
        self._ends: dict[int, list[str]] = {}
        self._logs_only = False
        self._index: LogIndex | None = None
        self._span_tids: set[str] = set()
        self._open: dict[str, dict[str, Any]] = {}
        self._closed: set[str] = set()
        self.joined = 0  # log records of a log-only file whose spans are in a companion

    def _prepare(self) -> None:
        self._ready = True
        if self.path is not None:
            sc = scan(self.path, self.max_line_bytes)
            self._last = sc.last_line
            for tid, n in self._last.items():
                self._ends.setdefault(n, []).append(tid)
            self._logs_only = sc.has_logs and not sc.has_spans
        if self.companions:
            if self._logs_only:
                for p in self.companions:
                    self._span_tids.update(scan(p, self.max_line_bytes).last_line)
            else:
                self._index = LogIndex.load(self.companions, self.max_line_bytes)

    def line_weight(self, lineno: int) -> int:
        """How many traces end on line ``lineno`` (at least 1): batches are sized by traces, not lines
        (a Collector line holds hundreds)."""
        if not self._ready:
            self._prepare()
        return max(1, len(self._ends.get(lineno, ())))

    def _state(self, tid: str, line: Any) -> dict[str, Any]:
        st = self._open.get(tid)
        if st is None:
            st = self._open[tid] = {"spans": [], "logs": [], "line": line}
        return st

    def feed(self, obj: Any, line: Any) -> tuple[list[Problem], list[str]]:
        """Read one export request (the line ``line``). Returns (problems of the line, trace ids that
        are complete after it)."""
        if not self._ready:
            self._prepare()
        if not isinstance(obj, dict) or ("resourceSpans" not in obj and "resourceLogs" not in obj):
            return [("schema", "an OTLP line must be an export request with 'resourceSpans' or 'resourceLogs'")], \
                self._due(line.lineno)
        problems: list[Problem] = []
        n = 0
        try:
            for tid, sp, res, scope in iter_spans(obj):
                n += 1
                if tid in self._closed:
                    problems.append(("otel_late_span", f"span of trace {tid} after its trace was assembled"))
                    continue
                self._state(tid, line)["spans"].append((sp, res, scope))
        except BadValue as e:  # in a resource's attributes: the spans after it on this line are not read
            n += 1
            problems.append(("otel_bad_value", f"resource attributes: {e}"))
        for tid, lr, _ in iter_logs(obj):
            if not tid:
                continue
            n += 1
            try:
                rec = compact_log(lr)
            except BadValue as e:  # this record alone: the line is quarantined, its other records go on
                problems.append(("otel_bad_value", f"log record of trace {tid}: {e}"))
                continue
            if rec is None:
                continue
            if self._logs_only and tid in self._span_tids:
                self.joined += 1
                continue
            if tid in self._closed:
                problems.append(("otel_late_span", f"log record of trace {tid} after its trace was assembled"))
                continue
            self._state(tid, line)["logs"].append(rec)
        if n == 0:
            problems.append(("otel_nothing_to_read", "no span and no log record with a trace id in this export request"))
        return problems, self._due(line.lineno)

    def _due(self, lineno: int) -> list[str]:
        if not self._last:
            return []
        return [t for t in self._ends.pop(lineno, ()) if t in self._open]

    def line_of(self, tid: str) -> Any:
        """The line where the open trace ``tid`` started (where its problems are quarantined)."""
        return self._open[tid]["line"]

    def remaining(self) -> list[str]:
        """Trace ids still open (at the end of the file)."""
        return list(self._open)

    def take(self, tid: str) -> tuple[dict[str, Any] | None, Problem | None, Any]:
        """Assemble one trace: (record, problem, the line where it started)."""
        st = self._open.pop(tid)
        self._closed.add(tid)
        logs = st["logs"]
        if self._index is not None:
            logs = logs + self._index.take(tid)
        try:
            rec, prob = to_trace(tid, st["spans"], logs)
        except BadValue as e:
            rec, prob = None, ("otel_bad_value", f"trace {tid}: {e}"[:500])
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
            # A shape the mapping did not expect (a status that is not an object, ...): this trace is
            # quarantined with the reason, the rest of the file goes on.
            rec, prob = None, ("otel_unreadable", f"trace {tid}: {type(e).__name__}: {e}"[:500])
        if prob and prob[0] == "otel_log_without_span" and self._logs_only:
            where = ", ".join(p.name for p in self.companions[:3]) or "no span file"
            prob = (prob[0], prob[1].split(": spans and", 1)[0] + f": no span of this trace in the files given with "
                    f"it ({where}); spans and log records are exported separately (tracer and logger provider): "
                    "give the file with its spans in the same ingest")
        return rec, prob, st["line"]
