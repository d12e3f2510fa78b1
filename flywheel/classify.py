"""Failure classification: deterministic from the trace and its tools' JSON Schemas.

The *bad answer* is the last assistant message of the trace. Kinds (a trace may carry several, listed
in :data:`FAILURE_KINDS` order):

``invalid_json``
    a tool call's ``function.arguments`` break the one arguments rule (invalid JSON, JSON that is not
    an object, a non-finite number; empty and ``null`` arguments are ``{}``:
    :func:`flywheel.vocab.toolcalls.decode_arguments`, the verifier's rule), or call-shaped text in
    the answer does not parse (the shared parser :func:`flywheel.vocab.parse_tool_calls` reports an
    error).
``unknown_tool``
    a call names a function that is not in ``tools`` (BFCL's ``math_factorial`` for ``math.factorial``
    is accepted, as the verifier does). A tool the trace marks as recorded without a schema
    (``metadata.tool_schema_sources[name] == "none"``: the telemetry kept the call, not the
    definition) is not unknown; its arguments cannot be checked and ``details`` says so.
``missing_required_arg``
    a parameter in the tool schema's ``required`` list (or a non-optional parameter of the correction)
    is absent.
``wrong_arg_type``
    an argument's JSON type is not the schema's ``type`` (``true`` is never an integer; ``4.0`` is an
    integer, as JSON Schema says).
``wrong_arg_value``
    a value outside the schema's ``enum``, or, when a correction gives expected calls, a value the
    correction does not allow (compared with the verifier's rules: ``values_equal``).
``no_tool_call``
    a correction expects calls and the answer made none.
``extra_tool_call``
    more calls than the correction expects.
``test_failure`` / ``runtime_exception``
    the outcome carries ``tests`` and failed: ``runtime_exception`` when the error names an exception
    other than ``AssertionError`` (``ZeroDivisionError: ...``, a ``Traceback``), else ``test_failure``.
    Without tests, an error naming an exception is a ``runtime_exception``.
``negative_feedback``
    ``outcome.feedback.score < 0`` (thumbs-down is -1 in the examples; 0 is neutral).
``other``
    the trace failed and none of the above explains it (e.g. the wrong, declared function was called,
    or fewer calls than expected were made); ``details`` says what was seen.

A trace *failed* when ``outcome.status == "failure"`` or it carries negative feedback. A declared
``outcome.kind`` that is one of the kinds above is added to the derived kinds (the producer may know
more, e.g. a test run); an unknown declared kind is kept in ``details``.

Not covered: nested argument schemas are checked one level deep (types of top-level arguments, the
items of arrays); ``$ref``/``oneOf`` schemas are not interpreted. The verifier does the full check.
Malformed schema parts (``"required": 5``, ``"type": [{}]``, non-object ``properties``) are read
as absent rather than raising: a tool schema is the producer's data, and one bad schema must not cost
its trace (ingest quarantines any record whose classification still raises, as ``internal_error``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from flywheel.tool_registry import undeclared_names
from flywheel.verifiers.matching import values_equal
from flywheel.vocab.ids import digest
from flywheel.vocab.kinds import FAILURE_KINDS
from flywheel.vocab.messages import last_index, text_of
from flywheel.vocab.text import failure_text
from flywheel.vocab.toolcalls import decode_tool_calls, parse_tool_calls
from flywheel.vocab.tools import call_function, function_of

__all__ = ["FAILURE_KINDS", "Call", "Classification", "classify", "could_hold_a_call", "extract_calls",
           "failure_identity", "normalise_text", "tool_schemas"]

_KIND_ORDER = {k: i for i, k in enumerate(FAILURE_KINDS)}
_EXCEPTION = re.compile(r"Traceback \(most recent call last\)|\b(?!AssertionError\b)[A-Z][A-Za-z0-9_]*(?:Error|Exception)\b")

#: The unit of failure identity (:func:`flywheel.vocab.text.failure_text`), under its historical name.
normalise_text = failure_text


@dataclass
class Call:
    """A call of the bad answer: ``arguments`` is None when they did not parse."""

    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str | None = None


@dataclass
class Classification:
    failed: bool
    kinds: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


def could_hold_a_call(text: str) -> bool:
    """False only when :func:`flywheel.verifiers.parse_tool_calls` is sure to find neither calls nor
    a call-shaped error in ``text``, so it need not run (it compiles the text with ``ast``: ~40 µs
    for a sentence, most of a prose failure's classification time).

    Why this is exact: a pythonic call needs ``(``, a JSON call an object or array (``{``/``[``), and
    the parser reports an error only when its ``_CALLISH`` pattern matches, which needs ``(``, ``{``
    or the text ``"name"`` (followed by ``:``). ``tests/unit/test_classify.py`` checks the
    equivalence against the parser on generated texts.
    """
    return "(" in text or "{" in text or "[" in text or '"name"' in text


def extract_calls(message: dict[str, Any] | None, has_tools: bool) -> tuple[list[Call], list[str]]:
    """Calls of an assistant message and the problems met parsing them (``invalid_json`` evidence).

    OpenAI ``tool_calls`` are read call by call with the one arguments rule
    (:func:`flywheel.vocab.toolcalls.decode_tool_calls`: empty or ``null`` arguments are ``{}``), so
    one malformed call does not hide the others; without them, text content is read with the shared
    parser when the trace declares tools.
    """
    if message is None:
        return [], []
    tcs = message.get("tool_calls")
    if tcs:
        calls, problems = [], []
        for j, dc in enumerate(decode_tool_calls(tcs)):
            if dc.error:
                problems.append(f"tool_calls[{j}] {dc.name}: {dc.error}")
            calls.append(Call(dc.name, dc.arguments, dc.raw))
        return calls, problems
    text = text_of(message.get("content"))
    if not has_tools or not text.strip() or not could_hold_a_call(text):
        return [], []
    res = parse_tool_calls(text)
    if res.calls:
        return [Call(c.name, dict(c.arguments)) for c in res.calls], []
    if res.error:
        return [], [f"call-shaped text did not parse: {res.error}"]
    return [], []


_JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _any_type(value: Any) -> bool:
    return True


def _type_ok(value: Any, schema: Any) -> bool:
    if not isinstance(schema, dict):
        return True
    t = schema.get("type")
    if isinstance(t, str):
        if not _JSON_TYPES.get(t, _any_type)(value):
            return False
    elif isinstance(t, list) and t and not any(_JSON_TYPES.get(x, _any_type)(value) for x in t if isinstance(x, str)):
        return False
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return all(_type_ok(v, schema["items"]) for v in value)
    return True


def tool_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: parameters schema}`` of the declared tools (nameless specs left out; a function
    without parameters gets an open object schema)."""
    out = {}
    for t in tools or ():
        fn = function_of(t)
        if fn is not None and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return out


def _resolve(name: str, schemas: dict[str, Any]) -> str | None:
    if name in schemas:
        return name
    alias = [n for n in schemas if n.replace(".", "_") == name]
    return alias[0] if len(alias) == 1 else None


def _check_against_schema(call: Call, schema: dict[str, Any], kinds: set[str], details: list[str]) -> None:
    args = call.arguments or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    # Malformed schema parts (``"required": 5``, a non-string name) are read as absent: the trace is
    # still classified by what is well-formed, and the verifier reports the schema itself.
    required = schema.get("required")
    for req in required if isinstance(required, list) else ():
        if isinstance(req, str) and req not in args:
            kinds.add("missing_required_arg")
            details.append(f"{call.name}: missing required argument {req!r}")
    for k, v in args.items():
        ps = props.get(k)
        if ps is None:
            if props and schema.get("additionalProperties") is False:
                details.append(f"{call.name}: unexpected argument {k!r}")
            continue
        if not _type_ok(v, ps):
            kinds.add("wrong_arg_type")
            details.append(f"{call.name}: argument {k!r} should be {ps.get('type')}, got {type(v).__name__}")
        elif isinstance(ps, dict) and isinstance(ps.get("enum"), list) and v not in ps["enum"]:
            kinds.add("wrong_arg_value")
            details.append(f"{call.name}: argument {k!r}={v!r} is not in enum {ps['enum']!r}"[:300])


def _check_against_correction(
    calls: list[Call], expected: list[dict[str, Any]], schemas: dict[str, Any], kinds: set[str], details: list[str]
) -> None:
    if not calls:
        if expected:
            kinds.add("no_tool_call")
            details.append(f"expected {len(expected)} call(s), none made")
        return
    if len(calls) > len(expected):
        kinds.add("extra_tool_call")
        details.append(f"{len(calls)} calls made, {len(expected)} expected")
    unused = list(range(len(calls)))
    for exp in expected:
        name = exp["name"]
        match = next(
            (i for i in unused if calls[i].name == name or _resolve(calls[i].name, {name: {}}) == name), None
        )
        if match is None:
            details.append(f"expected call {name} not made")
            continue
        unused.remove(match)
        call = calls[match]
        if call.arguments is None:
            continue
        props = (schemas.get(name) or {}).get("properties")
        props = props if isinstance(props, dict) else {}
        for p, spec in exp["arguments"].items():
            if isinstance(spec, dict) and "one_of" in spec:
                allowed, optional = spec["one_of"], bool(spec.get("optional", False))
            else:
                allowed, optional = [spec], False
            if p not in call.arguments:
                if not optional:
                    kinds.add("missing_required_arg")
                    details.append(f"{name}: missing argument {p!r} (correction)")
                continue
            got = call.arguments[p]
            if not any(values_equal(got, a, props.get(p), True) for a in allowed):
                same_type = any(type(got) is type(a) or (isinstance(got, int | float) and isinstance(a, int | float)
                                and not isinstance(got, bool) and not isinstance(a, bool)) for a in allowed)
                if allowed and not same_type:
                    kinds.add("wrong_arg_type")
                    details.append(f"{name}: argument {p!r} has type {type(got).__name__}, correction expects {type(allowed[0]).__name__}")
                else:
                    kinds.add("wrong_arg_value")
                    details.append(f"{name}: argument {p!r}={got!r} not in {allowed!r}"[:300])
        for p in call.arguments:
            if p not in exp["arguments"]:
                details.append(f"{name}: unexpected argument {p!r}")
    if len(calls) < len(expected):
        details.append(f"{len(calls)} of {len(expected)} expected calls made")


def classify(trace: dict[str, Any]) -> Classification:
    """Classify a (validated) trace. Pure and deterministic."""
    outcome = trace.get("outcome") or {}
    feedback = outcome.get("feedback") or None
    negative = bool(feedback) and isinstance(feedback.get("score"), int | float) and feedback["score"] < 0
    failed = outcome.get("status") == "failure" or negative
    messages = trace.get("messages") or []
    idx = last_index(messages, "assistant")
    tools = trace.get("tools") or []
    if not failed:
        return Classification(False)
    kinds: set[str] = set()
    details: list[str] = []
    calls, problems = extract_calls(messages[idx] if idx is not None else None, bool(tools))
    if problems:
        kinds.add("invalid_json")
        details += problems
    schemas = tool_schemas(tools)
    no_schema = undeclared_names(trace)
    for c in calls:
        resolved = _resolve(c.name, schemas)
        if resolved is None and c.name in no_schema:
            details.append(f"call to {c.name!r}: no schema was recorded, its arguments are not checked")
        elif resolved is None:
            kinds.add("unknown_tool")
            details.append(f"call to undeclared tool {c.name!r}")
        elif c.arguments is not None:
            _check_against_schema(c, schemas[resolved], kinds, details)
    correction = trace.get("correction")
    if isinstance(correction, dict) and isinstance(correction.get("tool_calls"), list) and not problems:
        _check_against_correction(calls, correction["tool_calls"], schemas, kinds, details)
    error = outcome.get("error") or ""
    if outcome.get("tests"):
        if _EXCEPTION.search(error):
            kinds.add("runtime_exception")
        else:
            kinds.add("test_failure")
    elif error and _EXCEPTION.search(error) and not (problems and not calls):
        # An answer whose calls did not even parse never ran: an exception named in its error is the
        # parser's (``SyntaxError`` from a BFCL replay), already counted as ``invalid_json``.
        kinds.add("runtime_exception")
    if negative:
        kinds.add("negative_feedback")
    declared = outcome.get("kind")
    if declared:
        if declared in _KIND_ORDER:
            kinds.add(declared)
        else:
            details.append(f"declared kind {declared!r} is not a known failure kind")
    if not kinds:
        kinds.add("other")
    return Classification(True, sorted(kinds, key=_KIND_ORDER.__getitem__), details[:20], calls)


_TOOLS_NORMALISED: dict[bytes, str] = {}
_TOOLS_CACHE_MAX = 4096


def _normalised_tools(tools: Any) -> str:
    # Production traces repeat a few tool lists (one per agent version): the normalised text is
    # cached by the canonical JSON, which has to be computed anyway (bounded: cleared when full).
    key = orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)
    out = _TOOLS_NORMALISED.get(key)
    if out is None:
        if len(_TOOLS_NORMALISED) >= _TOOLS_CACHE_MAX:
            _TOOLS_NORMALISED.clear()
        out = _TOOLS_NORMALISED[key] = normalise_text(key.decode())
    return out


def failure_identity(trace: dict[str, Any]) -> tuple[str, str]:
    """``(failure entity id, content hash)`` of a failed trace.

    The content is the tools (canonical JSON), every user message, and the bad answer (its text and
    its tool calls as name + raw arguments), each normalised with :func:`normalise_text`. Distinct
    traces with the same content are one failure. Timestamps, ids, model and metadata are excluded.
    Frozen (failure ids are recorded): the content reader's default rule, :func:`failure_text`, the
    ``\x1e`` join, and each call as ``name(raw arguments)`` of its nested ``function`` only.
    """
    messages = trace.get("messages") or []
    idx = last_index(messages, "assistant")
    bad = messages[idx] if idx is not None else {}
    parts = [_normalised_tools(trace.get("tools"))]
    parts += [failure_text(text_of(m.get("content")))
              for m in messages[: idx if idx is not None else len(messages)] if m.get("role") == "user"]
    parts.append(failure_text(text_of(bad.get("content"))))
    for tc in bad.get("tool_calls") or ():
        fn = call_function(tc, flat=False)
        parts.append(failure_text(f"{fn.get('name')}({fn.get('arguments')})"))
    h = digest("\x1e".join(parts))
    return f"failure:{h[:16]}", h
