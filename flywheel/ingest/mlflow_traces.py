"""MLflow Tracing traces as flywheel trace records (format ``mlflow``): a pure mapping, no MLflow import.

Input: one trace as MLflow serialises it (``mlflow.entities.Trace.to_dict()``, the shape of the
tracking server's ``get-trace`` answer): ``{"info": {trace_id, request_time, state, trace_metadata,
tags, assessments, trace_location}, "data": {"spans": [...]}}``. Span attribute values are JSON
strings (``"mlflow.spanType": "\\"CHAT_MODEL\\""``), as MLflow stores them.

What becomes what
- messages: the *last* span (by start time) of type ``CHAT_MODEL`` or ``LLM``: its inputs'
  ``messages`` (OpenAI chat format, what ``mlflow.openai.autolog()`` records as the request) followed
  by its output's assistant message (``choices[0].message``: content and ``tool_calls``, arguments as
  the JSON string OpenAI sends). A completion-style ``LLM`` span (inputs ``prompt``, output text or
  ``choices[0].text``) becomes one user and one assistant message. An agent loop records the whole
  history on each call, so the last call holds the conversation.
- tools: the same span's inputs ``tools`` (else its ``mlflow.chat.tools`` attribute).
- model: inputs ``model``, else the output's ``model``, else ``mlflow.llm.model``.
- outcome: ``failure`` when a span has status ERROR (``error`` = ``<SPAN TYPE> <span name>:
  <exception type>: <message>`` of the innermost failed span, earliest first, so a failing ``TOOL``
  span is named rather than the agent span around it) or the trace's state is ``ERROR``.
- assessments (``info.assessments``): feedback is a failure signal: ``False``, a negative number, or
  ``"no"``/``"fail"``/``"bad"``/... becomes ``outcome.feedback = {score: -1 (or the number),
  comment: rationale}`` (negative feedback, classified as ``negative_feedback``); human feedback wins
  over an LLM judge's or code's, and the most negative one is kept. An expectation named
  ``expected_response`` (text) becomes ``correction.content``; an expectation whose value holds
  ``tool_calls`` (``[{name, arguments}]``) becomes ``correction.tool_calls``. Invalid (overridden)
  assessments and assessments that carry an error are ignored.
- ids: ``trace_id`` and ``source_id`` are MLflow's trace id (``tr-...``), ``timestamp`` its
  ``request_time``; ``metadata.mlflow`` keeps the experiment id, trace name, state, span counts by
  type and every assessment's name, value and source.

Problems (the record is quarantined with the reason): ``mlflow_not_a_trace`` (no ``info``/``data``),
``mlflow_no_chat_span`` (no CHAT_MODEL/LLM span: nothing to learn from), ``mlflow_unreadable_span``
(a chat span whose inputs are not OpenAI chat messages).

Not supported: provider formats other than OpenAI chat/completions (Anthropic messages, the
Responses API) in span inputs; numeric ratings on a positive-only scale (1-5 stars) are passed on
as they are and so never count as negative.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from flywheel.vocab.tools import call_function

Problem = tuple[str, str]

CHAT_SPAN_TYPES = ("CHAT_MODEL", "LLM")
_NEGATIVE_WORDS = frozenset({"no", "fail", "failed", "false", "bad", "incorrect", "wrong", "thumbs_down", "negative"})
_POSITIVE_WORDS = frozenset({"yes", "pass", "passed", "true", "good", "correct", "right", "thumbs_up", "positive"})
_SOURCE_RANK = {"HUMAN": 0, "LLM_JUDGE": 1, "CODE": 2}
# Keys of an OpenAI assistant message that carry content; the rest (refusal, annotations, audio,
# function_call: null in autologged outputs) is dropped.
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def _attr(attrs: dict[str, Any], key: str) -> Any:
    """An MLflow span attribute: stored as a JSON string; a value that is not JSON is returned as is."""
    v = attrs.get(key)
    if isinstance(v, str):
        try:
            return orjson.loads(v)
        except orjson.JSONDecodeError:
            return v
    return v


def _nanos(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _is_error(span: dict[str, Any]) -> bool:
    code = (span.get("status") or {}).get("code")
    return code in ("STATUS_CODE_ERROR", "ERROR", 2, "2")


def _error_text(span: dict[str, Any], attrs: dict[str, Any]) -> str:
    etype = emsg = None
    for ev in span.get("events") or ():
        if isinstance(ev, dict) and ev.get("name") == "exception":
            ea = ev.get("attributes") or {}
            etype, emsg = ea.get("exception.type"), ea.get("exception.message")
            break
    detail = ": ".join(str(x) for x in (etype, emsg) if x) or (span.get("status") or {}).get("message") or "status ERROR"
    kind = _attr(attrs, "mlflow.spanType") or "span"
    return f"{kind} {span.get('name')}: {detail}"


def _clean_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: m[k] for k in _MESSAGE_KEYS if k in m and m[k] is not None}
    if out.get("role") == "assistant":
        out.setdefault("content", None)
        calls = out.get("tool_calls")
        if isinstance(calls, list):
            clean = []
            for c in calls:
                if not isinstance(c, dict):
                    continue
                fn = call_function(c, flat=False)
                args = fn.get("arguments")
                clean.append({"id": str(c.get("id") or f"call_{len(clean)}"), "type": "function",
                              "function": {"name": fn.get("name"),
                                           "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
            if clean:
                out["tool_calls"] = clean
            else:
                out.pop("tool_calls")
    elif "content" not in out:
        out["content"] = ""
    return out


def _output_message(outputs: Any) -> dict[str, Any] | None:
    """The assistant message of a chat completion (or completion) output."""
    if isinstance(outputs, str):
        return {"role": "assistant", "content": outputs}
    if not isinstance(outputs, dict):
        return None
    choices = outputs.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
        if isinstance(c.get("message"), dict):
            return _clean_message({"role": "assistant", **c["message"]})
        if isinstance(c.get("text"), str):
            return {"role": "assistant", "content": c["text"]}
    if outputs.get("role") == "assistant":
        return _clean_message(outputs)
    return None


def _span_conversation(inputs: Any, outputs: Any, attrs: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """(messages, why-not) of one chat/LLM span."""
    history = _attr(attrs, "mlflow.chat.messages")  # older autologgers record the whole conversation here
    if isinstance(history, list) and history and all(isinstance(m, dict) for m in history):
        return [_clean_message(m) for m in history], ""
    msgs: list[dict[str, Any]] | None = None
    if isinstance(inputs, dict) and isinstance(inputs.get("messages"), list):
        raw = inputs["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in raw):
            return None, "inputs.messages are not OpenAI chat messages (each needs a string 'role')"
        msgs = [_clean_message(m) for m in raw]
    elif isinstance(inputs, dict) and isinstance(inputs.get("prompt"), str):
        msgs = [{"role": "user", "content": inputs["prompt"]}]
    elif isinstance(inputs, str):
        msgs = [{"role": "user", "content": inputs}]
    if msgs is None:
        keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        return None, f"inputs hold neither OpenAI 'messages' nor a 'prompt' ({keys})"
    answer = _output_message(outputs)
    return msgs + ([answer] if answer is not None else []), ""


def _tools(inputs: Any, attrs: dict[str, Any]) -> list[dict[str, Any]]:
    tools = inputs.get("tools") if isinstance(inputs, dict) else None
    if not isinstance(tools, list):
        tools = _attr(attrs, "mlflow.chat.tools")
    if not isinstance(tools, list):
        return []
    out = []
    for t in tools:
        if isinstance(t, dict) and isinstance(t.get("function"), dict):
            out.append({"type": "function", "function": t["function"]})
    return out


def _feedback_score(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return 1 if value else -1
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        v = value.strip().lower().replace(" ", "_").replace("-", "_")
        if v in _NEGATIVE_WORDS:
            return -1
        if v in _POSITIVE_WORDS:
            return 1
    return None


def _assessments(info: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]]]:
    """(feedback for the outcome, correction, summary of every assessment for metadata)."""
    best: tuple[tuple[int, float], dict[str, Any]] | None = None
    correction: dict[str, Any] | None = None
    summary = []
    for a in info.get("assessments") or ():
        if not isinstance(a, dict) or a.get("valid") is False:
            continue
        name = str(a.get("assessment_name") or a.get("name") or "")
        source = (a.get("source") or {}).get("source_type") or "UNKNOWN"
        fb, ex = a.get("feedback"), a.get("expectation")
        if isinstance(fb, dict):
            if fb.get("error"):
                continue
            summary.append({"name": name, "kind": "feedback", "value": fb.get("value"), "source": source})
            score = _feedback_score(fb.get("value"))
            if score is None:
                continue
            key = (_SOURCE_RANK.get(source, 3), float(score))
            if best is None or key < best[0]:
                comment = a.get("rationale")
                best = (key, {"score": score, "comment": f"{name}: {comment}" if comment else name})
        elif isinstance(ex, dict):
            value = ex.get("value")
            summary.append({"name": name, "kind": "expectation", "source": source})
            if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
                correction = {"tool_calls": value["tool_calls"]}
            elif name == "expected_response" and isinstance(value, str) and correction is None:
                correction = {"content": value}
    return (best[1] if best else None), correction, summary


def mlflow_to_trace(obj: Any) -> tuple[dict[str, Any] | None, Problem | None]:
    """One serialised MLflow trace -> (trace record, None) or (None, (reason, detail))."""
    if not isinstance(obj, dict) or not isinstance(obj.get("info"), dict) or not isinstance(obj.get("data"), dict):
        return None, ("mlflow_not_a_trace", "an MLflow trace is an object with 'info' and 'data' (Trace.to_dict())")
    info, spans = obj["info"], obj["data"].get("spans") or []
    tid = info.get("trace_id") or info.get("request_id")
    if not isinstance(tid, str) or not tid:
        return None, ("mlflow_not_a_trace", "info.trace_id is missing")
    parsed = []
    for sp in spans:
        if isinstance(sp, dict):
            parsed.append((sp, sp.get("attributes") or {}))
    parsed.sort(key=lambda p: (_nanos(p[0].get("start_time_unix_nano")), str(p[0].get("span_id"))))
    by_type: dict[str, int] = {}
    for _, a in parsed:
        t = str(_attr(a, "mlflow.spanType") or "UNKNOWN")
        by_type[t] = by_type.get(t, 0) + 1
    chat = [(sp, a) for sp, a in parsed if _attr(a, "mlflow.spanType") in CHAT_SPAN_TYPES]
    if not chat:
        return None, ("mlflow_no_chat_span", f"trace {tid}: no CHAT_MODEL or LLM span ({len(parsed)} spans: "
                                             f"{', '.join(f'{k}={v}' for k, v in sorted(by_type.items())) or 'none'})")
    last, la = chat[-1]
    inputs, outputs = _attr(la, "mlflow.spanInputs"), _attr(la, "mlflow.spanOutputs")
    messages, why = _span_conversation(inputs, outputs, la)
    if messages is None:
        return None, ("mlflow_unreadable_span", f"trace {tid}, span {last.get('name')!r}: {why}")

    # The innermost failed span: one whose failed descendants (if any) are not below it.
    failed = [(sp, a) for sp, a in parsed if _is_error(sp)]
    failed_parents = {sp.get("parent_span_id") for sp, _ in failed}
    leaves = [(sp, a) for sp, a in failed if sp.get("span_id") not in failed_parents]
    error = _error_text(*leaves[0]) if leaves else None
    if error is None and str(info.get("state") or "").upper() == "ERROR":
        error = "MLflow trace state ERROR"
    feedback, correction, assessments = _assessments(info)
    outcome: dict[str, Any] = {"status": "failure" if error else "success"}
    if error:
        outcome["error"] = error[:2000]
    if feedback is not None:
        outcome["feedback"] = feedback
    model = ""
    if isinstance(inputs, dict) and isinstance(inputs.get("model"), str):
        model = inputs["model"]
    elif isinstance(outputs, dict) and isinstance(outputs.get("model"), str):
        model = outputs["model"]
    else:
        model = str(_attr(la, "mlflow.llm.model") or "")
    loc = (info.get("trace_location") or {}).get("mlflow_experiment") or {}
    rec: dict[str, Any] = {
        "trace_id": tid,
        "timestamp": info.get("request_time"),
        "model": model,
        "messages": messages,
        "tools": _tools(inputs, la),
        "outcome": outcome,
        "metadata": {"mlflow": {
            "experiment_id": loc.get("experiment_id"), "trace_name": (info.get("tags") or {}).get("mlflow.traceName"),
            "state": info.get("state"), "spans": by_type, "chat_spans": len(chat), "assessments": assessments,
        }},
        "source": "mlflow",
        "source_id": tid,
    }
    if correction is not None:
        rec["correction"] = correction
    return rec, None
