"""OTLP content -> OpenAI chat messages, one function per convention (the conventions are listed in
:mod:`flywheel.ingest.otlp`): GenAI semconv messages with parts (:func:`messages_value`), flattened
``gen_ai.prompt.N.*`` attributes, OpenInference ``llm.*_messages.N.message.*`` attributes, and GenAI
event log records (``gen_ai.*.message``, ``gen_ai.choice``).
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.ingest.otlp_decode import _json_attr
from flywheel.vocab.messages import json_text, text_of
from flywheel.vocab.tools import call_function

_EVENT_ROLE = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
               "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


def _args_string(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _text_of(v: Any) -> str:
    # Frozen (the stored trace, and so its failure id, is built from it): parts hold their text under
    # "text" or "content", every object part counts, any other value is written as JSON.
    return text_of(v, nonstring_text="stringify", keys=("text", "content"), other=json_text)


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
