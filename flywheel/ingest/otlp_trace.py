"""The spans and GenAI log records of one trace -> one trace record (:func:`to_trace`).

Each inference span is a :class:`Call` (its messages, tools, response id, tokens, request parameters);
the conversation is the last call's that carries content; outcome, usage and ``metadata`` are
gathered over the trace (see :mod:`flywheel.ingest.otlp` for what is kept and why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flywheel.ingest.otlp_decode import BadValue, LogRec, Problem, _json_attr, _nanos, attrs, norm_id
from flywheel.ingest.otlp_messages import (
    _EVENT_ROLE,
    _choice_message,
    _event_message,
    _flattened,
    _has_content,
    _openinference_messages,
    _system_value,
    messages_value,
)
from flywheel.tool_registry import normalise_tool

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
    try:
        ts = datetime.fromtimestamp(start / 1e9, UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):  # beyond time_t or year 9999: not a time a span was made at
        raise BadValue(f"startTimeUnixNano {start} is not a representable time") from None
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
