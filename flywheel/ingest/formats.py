"""Input formats: line parsing, format detection, and the BFCL adapter (OTLP: :mod:`flywheel.ingest.otlp`).

Every adapter produces the trace shape of ``schemas/trace.schema.json``, which then goes through the same validation,
redaction and classification as an OpenAI-format record.

OpenTelemetry (``otel``)
    OTLP/JSON export requests (``resourceSpans`` and/or ``resourceLogs``), one per line as a
    Collector's file exporter writes them, or one JSON document: OpenTelemetry GenAI conventions
    (content in span attributes or in log records) and OpenInference. See :mod:`flywheel.ingest.otlp`.

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

import json
from typing import Any

import orjson

from flywheel.verifiers.bfcl import CATEGORIES, bfcl_answer_to_expected, load_bfcl
from flywheel.verifiers.matching import match_tool_calls
from flywheel.vocab.ids import short_id
from flywheel.vocab.toolcalls import parse_tool_calls

Problem = tuple[str, str]
FORMATS = ("openai", "otel", "bfcl")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Deepest nesting a record may have. The store and the artifacts are written by orjson, which refuses
# more than 255 levels; a trace is nested a few levels deeper in the events that carry it (a failure's
# payload holds its messages), so records stop well below that.
MAX_DEPTH = 200


def bad_input_problem(obj: Any, max_depth: int = MAX_DEPTH) -> Problem | None:
    """``invalid_unicode`` (a lone surrogate, in a string or a key) or ``too_deep`` (nested deeper than
    ``max_depth``) for a parsed value, else None. Iterative: it never hits Python's recursion limit.
    Run where serialising a record failed, not on every record (a walk costs ~10 µs a trace)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return "invalid_unicode", (f"a string holds a lone surrogate ({_surrogate_at(v)}): not valid "
                                           "Unicode, so it cannot be stored; fix the producer's encoding")
            continue
        if isinstance(v, dict):
            items: Any = v.items()
        elif isinstance(v, list):
            items = ((None, x) for x in v)
        else:
            continue
        deepest = max(deepest, d)
        if deepest > max_depth:
            return "too_deep", f"nested deeper than {max_depth} levels: a trace this deep cannot be stored"
        for k, x in items:
            if isinstance(k, str) and _has_surrogate(k):
                return "invalid_unicode", (f"an object key holds a lone surrogate ({_surrogate_at(k)}): not "
                                           "valid Unicode, so it cannot be stored; fix the producer's encoding")
            stack.append((x, d + 1))
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _surrogate_at(s: str) -> str:
    i = next(i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF)
    return f"\\u{ord(s[i]):04x} at character {i}"


def parse_json(data: bytes, *, strict_unicode: bool = True) -> tuple[Any, Problem | None]:
    """Parse one JSON document; never raises. Problems: ``invalid_utf8``, ``invalid_json``,
    ``invalid_unicode`` (a lone surrogate escape, ``"\\ud800"``: valid JSON text, not valid Unicode),
    ``too_deep`` (nested deeper than the parser's 1,024 levels). ``strict_unicode=False`` accepts lone
    surrogates (a whole document, whose elements are then checked one by one)."""
    try:
        return orjson.loads(data), None
    except orjson.JSONDecodeError as e:
        err = e
    if "depth limit" in str(err):
        return None, ("too_deep", f"nested deeper than 1024 levels ({str(err)[:200]})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as u:
        return None, ("invalid_utf8", f"invalid UTF-8 at byte {u.start}: {u.reason}")
    try:
        # A second opinion for what orjson refuses but JSON allows. (orjson reads integers beyond 64
        # bits as floats: such values lose precision; documented in the ingest module.)
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        pass
    else:
        if strict_unicode and "surrogate" in str(err):  # a lone \\udXXX escape: orjson refuses it, json accepts it
            prob = bad_input_problem(obj)
            if prob is not None:
                return None, prob
        return obj, None
    msg = str(err)
    if text.strip() and not text.rstrip().endswith(("}", "]")):
        msg = f"truncated JSON? {msg}"
    return None, ("invalid_json", msg[:300])


def detect_format(obj: Any) -> str:
    if isinstance(obj, dict):
        if "resourceSpans" in obj or "resourceLogs" in obj:
            return "otel"
        if "bfcl_id" in obj:
            return "bfcl"
    return "openai"


# -- BFCL --------------------------------------------------------------------------------------------
class BfclAdapter:
    """Turns logged answers to BFCL questions into traces (see the module docstring)."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, Any]] = {}
        self._loaded: set[str] = set()

    def _item(self, bfcl_id: str, category: str) -> Any:
        if category not in self._loaded:
            for it in load_bfcl(category):
                self._items[it.id] = it
            self._loaded.add(category)
        return self._items.get(bfcl_id)

    def to_trace(self, obj: Any) -> tuple[dict[str, Any] | None, Problem | None]:
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
            tid = "bfcl-" + short_id("\x1f".join([bid, obj["model"], obj["timestamp"], answer]))
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
