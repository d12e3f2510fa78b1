"""The compiler from production failures (and successful traces) to verifiable eval tasks.

One eval case per distinct failure (ingest already deduplicated them), with a verifier derived from
the failure kind, a stable train/held-out split by failure cluster (:mod:`flywheel.split`), and
versioned suites. Successful traces become regression evals in their own suite.

Each eval is a task record (the contract of :mod:`flywheel.tasks`) whose ``metadata`` also carries
``failure_kinds``, ``source``, ``split``, ``cluster``, ``origin_failure``, ``origin_trace``, ``weak``,
``deterministic``, ``verifier_kind``, ``request_hash`` and ``tool_schema_sources``.

Verifier per failure kind (first rule that applies)
---------------------------------------------------
=========================================  =====================================================
``test_failure`` with tests                ``python_tests`` on the trace's tests (sandboxed)
``runtime_exception`` with tool code       ``tool_call`` (+ correction) and a sandboxed replay of
                                           the answer's calls that must not raise
tool-call kinds, ``runtime_exception``     ``tool_call``: valid calls against the declared schemas;
(no code), ``invalid_json`` on a call      with a correction, the calls must match it (names,
(or on content when tools were offered,    required args, values among the allowed ones,
no response format, no text correction)    order-insensitive). No correction -> validity only, weak.
``invalid_json`` on content                ``json_schema`` with the response format's schema (weak
                                           ``{}`` = any JSON when the trace has none)
``negative_feedback`` (nothing else)       ``llm_judge`` rubric from the feedback; non-deterministic
``other`` with a correction                ``tool_call`` / ``exact`` against the correction
=========================================  =====================================================

A ``python_tests`` eval keeps the trace's ``outcome.tests`` source as it is: that source is the
eval's contract. When every test in it is an input -> expected-output check (``assert f(<literals>) ==
<literal>``, the usual shape), the sandbox judges it outside the candidate's process
(:mod:`flywheel.io_grading`); otherwise the tests run beside the candidate. Verdicts say which
(``details["isolation"]["grading"]``).

Why ``invalid_json`` on a *tool call* compiles to ``tool_call``: the shared answer format is BFCL's
pythonic ``[fn(a=1)]`` (:mod:`flywheel.policy.format`), so a model never writes the arguments as
JSON text; the JSON Schema that matters is the tool's ``parameters`` schema, which ``tool_call``
enforces strictly (types, required, enums). The same holds for broken JSON written as *content* to a
request that offered tools and gave no response format: a model that emits its calls as JSON text
fails that way (the BFCL traffic of the demo: a quarter of its evals), and "any JSON" would pass
``{}`` while failing the correction itself. A content answer that had to be JSON (a response format,
or no tools offered, or a text correction) gets ``json_schema``.

The stage that runs the compiler over the store and versions the suites is
:mod:`flywheel.evals.stage`.
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.split import request_hash, request_key
from flywheel.tool_registry import SOURCES_KEY
from flywheel.verifiers import SpecError, validate_spec
from flywheel.vocab.ids import short_id
from flywheel.vocab.kinds import TOOL_CALL_KINDS
from flywheel.vocab.messages import last_index, text_of
from flywheel.vocab.refs import with_prefix
from flywheel.vocab.toolcalls import decode_tool_calls
from flywheel.vocab.tools import called_names, tool_name, tool_parameters

# 2: metadata.origin_outcome; request_hash of the user turns + tool names; metadata.tool_schema_sources
# (tools without a schema get an open placeholder). 3: invalid_json as content to a request with tools and
# no response format compiles to tool_call (was json_schema {}, which failed the correction itself).
COMPILER_VERSION = 3


__all__ = [
    "COMPILER_VERSION",
    "CompileSkip",
    "compile_failure",
    "compile_success",
    "eval_id",
    "reference_from_correction",
    "trace_correction",
]


class CompileSkip(ValueError):
    """A failure or trace cannot become an eval; the message says why (reported, never fatal)."""


# --------------------------------------------------------------------------------- helpers
def eval_id(origin: str) -> str:
    """Stable eval id for an origin entity (``failure:...`` or ``trace:...``)."""
    return "eval:" + short_id(origin)


def _is_one_of(v: Any) -> bool:
    return isinstance(v, dict) and "one_of" in v and isinstance(v["one_of"], list)


def reference_from_correction(correction: dict | None, tools: list[dict] | None = None) -> dict | None:
    """One concrete correct answer from a correction (see the module docstring).

    Literals are kept; a ``one_of`` gives its first value (``""``/``None`` entries are BFCL's
    "may be omitted" markers, never values); an optional argument is omitted unless the tool schema
    requires it (the verifier requires schema-required arguments whatever the correction says), as
    :func:`flywheel.verifiers.bfcl.reference_calls` does.
    """
    if not correction:
        return None
    if isinstance(correction.get("tool_calls"), list):
        required = {
            tool_name(t): set(tool_parameters(t).get("required") or []) for t in tools or [] if isinstance(t, dict)
        }
        calls = []
        for call in correction["tool_calls"]:
            args = {}
            for name, spec in (call.get("arguments") or {}).items():
                if not _is_one_of(spec):
                    args[name] = spec
                    continue
                concrete = [v for v in spec["one_of"] if v not in ("", None)]
                schema_required = name in required.get(call["name"], set())
                if spec.get("optional") and not schema_required:
                    continue
                if concrete:
                    args[name] = concrete[0]
                elif spec["one_of"]:
                    args[name] = spec["one_of"][0]
            calls.append({"name": call["name"], "arguments": args})
        return {"tool_calls": calls}
    if "content" in correction and correction["content"] is not None:
        return {"content": str(correction["content"])}
    return None


def _message_calls(message: dict | None) -> list[dict] | None:
    """OpenAI ``tool_calls`` of an assistant message as ``[{name, arguments(dict)}]``.

    ``None`` when the message has no calls or a call's arguments break the one arguments rule
    (:func:`flywheel.vocab.toolcalls.decode_arguments`: empty or ``null`` arguments are ``{}``).
    """
    if not isinstance(message, dict) or not message.get("tool_calls"):
        return None
    decoded = decode_tool_calls(message["tool_calls"])
    if any(d.error for d in decoded):
        return None
    return [{"name": d.name, "arguments": d.arguments} for d in decoded]


def _last_user(messages: list[dict]) -> str:
    i = last_index(messages, "user")
    return text_of(messages[i].get("content")) if i is not None else ""


def _response_schema(failure: dict) -> dict | None:
    """The JSON Schema a content answer had to follow, when the trace carried one."""
    for holder in (failure, failure.get("metadata") or {}):
        rf = holder.get("response_format")
        if isinstance(rf, dict):
            if isinstance(rf.get("json_schema"), dict):
                js = rf["json_schema"]
                return js.get("schema") if isinstance(js.get("schema"), dict) else js
            if rf.get("type") == "json_object":
                return {"type": "object"}
            if "type" in rf or "properties" in rf:
                return rf
        if isinstance(holder.get("json_schema"), dict):
            return holder["json_schema"]
    return None


def _invalid_json_is_a_call(failure: dict, bad: dict | None, expected_calls: list[dict] | None) -> bool:
    """Whether an ``invalid_json`` failure on a request that offered tools was an attempted tool call:
    the bad answer holds ``tool_calls``, or its content had no response format to follow and the
    correction (if any) is a call. Such a failure is judged by ``tool_call`` against the correction:
    a weak ``json_schema {}`` ("any JSON") would pass ``{}`` and fail the right call written in the
    shared answer format (BFCL's ``[fn(a=1)]``), which is never JSON."""
    if (bad or {}).get("tool_calls"):
        return True
    return _response_schema(failure) is None and expected_calls != []


def _tool_code(failure: dict, trace_state: dict | None) -> str | None:
    """Python source implementing the tools, when the trace carries it (``metadata.tool_code``)."""
    for holder in (failure, failure.get("metadata") or {}, trace_state or {}, (trace_state or {}).get("metadata") or {}):
        code = holder.get("tool_code") if isinstance(holder, dict) else None
        if isinstance(code, str) and code.strip():
            return code
    return None


def _with_schema_sources(tools: list[dict], messages: list[dict], sources: Any) -> tuple[list[dict], dict, bool]:
    """(tools + an open-schema placeholder per called tool recorded without a schema, the source of
    every tool's schema, whether a called tool has no schema). See the module docstring."""
    sources = sources if isinstance(sources, dict) else {}
    out = list(tools)
    names = {tool_name(t) for t in tools} - {""}
    by_name = {n: ("registry" if sources.get(n) == "registry" else "trace") for n in names}
    called = called_names(messages)
    for n in called:
        if n not in names and sources.get(n) == "none":
            out.append({"type": "function", "function": {
                "name": n, "description": "(no schema: the trace recorded calls of this tool, not its definition)",
                "parameters": {"type": "object"}}})
            names.add(n)
            by_name[n] = "none"
    return out, dict(sorted(by_name.items())), any(by_name.get(n) == "none" for n in called)


def _trace_ref(trace_id: Any) -> str | None:
    return with_prefix("trace", trace_id) if trace_id else None


def _tool_call_spec(tools: list[dict], expected: list[dict] | None) -> dict:
    return {"kind": "tool_call", "tools": tools, "expected": expected, "order_sensitive": False}


def _judge_rubric(messages: list[dict], bad: dict | None, feedback: dict | None, reference: dict | None) -> str:
    comment = (feedback or {}).get("comment") or "no comment given"
    score = (feedback or {}).get("score")
    bad_text = text_of((bad or {}).get("content"))
    if (bad or {}).get("tool_calls"):
        bad_text += " " + json.dumps(bad["tool_calls"], ensure_ascii=False)
    lines = [
        "Judge whether the assistant's final answer serves the user's request.",
        f"User request: {_last_user(messages)}",
        f"A previous answer was rated negatively (score {score}): {comment}",
        f"That previous answer was: {bad_text.strip() or '(empty)'}",
        "PASS only if the new answer addresses the request correctly and does not repeat the problem the "
        "feedback describes. FAIL otherwise.",
    ]
    if reference and reference.get("content"):
        lines.append(f"A known good answer: {reference['content']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- compiling
def _check_spec(origin: str, spec: dict) -> None:
    """A spec the verifier library would refuse is a compile skip, not a runtime crash later."""
    try:
        validate_spec(spec)
    except SpecError as e:
        raise CompileSkip(f"{origin}: invalid verifier spec ({e})") from None


def compile_failure(failure: dict, *, trace_state: dict | None = None) -> dict:
    """Compile a ``failure.classified`` payload into a task record *without* its split.

    ``trace_state``: the state of the failure's first trace (consulted for ``metadata.tool_code``).
    Raises :class:`CompileSkip` when no verifier can be derived.
    """
    fid = failure.get("entity_id")
    if not fid:
        raise CompileSkip("failure payload has no entity_id")
    kinds = [str(k) for k in failure.get("kinds") or []]
    messages = failure.get("messages") or []
    tools, schema_sources, no_schema = _with_schema_sources(
        failure.get("tools") or [], [*(failure.get("messages") or []), failure.get("bad_answer") or {}],
        failure.get("tool_schema_sources"))
    if not messages:
        raise CompileSkip(f"{fid}: no prompt messages")
    if not any(m.get("role") == "user" for m in messages if isinstance(m, dict)):
        raise CompileSkip(f"{fid}: prompt has no user message")
    correction = failure.get("correction") or None
    bad = failure.get("bad_answer")
    expected_calls = correction.get("tool_calls") if isinstance(correction, dict) else None
    if isinstance(correction, dict) and "content" in correction and expected_calls is None:
        expected_calls_for_tools: list[dict] | None = []  # the right answer was text: no calls
    else:
        expected_calls_for_tools = expected_calls
    reference = reference_from_correction(correction, tools)
    tool_env = None
    weak = False
    deterministic = True

    if "test_failure" in kinds and failure.get("tests"):
        spec = {"kind": "python_tests", "tests": str(failure["tests"])}
        vkind = "python_tests"
    elif "runtime_exception" in kinds and tools and _tool_code(failure, trace_state):
        spec = _tool_call_spec(tools, expected_calls_for_tools)
        tool_env = {"recorded": [], "python": _tool_code(failure, trace_state), "replay": True}
        vkind = "tool_call+replay"
        weak = expected_calls_for_tools is None
    elif tools and (
        set(kinds) & {*TOOL_CALL_KINDS, "runtime_exception"}
        or ("invalid_json" in kinds and _invalid_json_is_a_call(failure, bad, expected_calls_for_tools))
    ):
        if "wrong_arg_value" in kinds and expected_calls_for_tools is None:
            raise CompileSkip(f"{fid}: wrong_arg_value without a correction cannot be checked")
        spec = _tool_call_spec(tools, expected_calls_for_tools)
        vkind = "tool_call"
        weak = expected_calls_for_tools is None
    elif "invalid_json" in kinds:
        schema = _response_schema(failure)
        weak = schema is None
        spec = {"kind": "json_schema", "schema": schema if schema is not None else {}}
        vkind = "json_schema"
    elif "negative_feedback" in kinds:
        spec = {"kind": "llm_judge", "rubric": _judge_rubric(messages, bad, failure.get("feedback"), reference)}
        if reference and reference.get("content"):
            spec["reference"] = reference["content"]
        vkind = "llm_judge"
        deterministic = False
    elif reference is not None:  # 'other' (or a kind with no rule) but a person said what is right
        if "tool_calls" in reference:
            spec = _tool_call_spec(tools, expected_calls)
            vkind = "tool_call"
        else:
            spec = {"kind": "exact", "expected": reference["content"]}
            vkind = "exact"
    else:
        raise CompileSkip(f"{fid}: no verifier for kinds {kinds or ['<none>']} without a correction")

    _check_spec(fid, spec)
    return {
        "task_id": eval_id(fid),
        "prompt": {"messages": messages, "tools": tools},
        "verifier": spec,
        "harness": "single_turn",
        "tool_env": tool_env,
        "reference": reference,
        "metadata": {
            "failure_kinds": kinds,
            "tools": sorted({tool_name(t) for t in tools} - {""}),
            "source": failure.get("source"),
            "origin_failure": fid,
            "origin_trace": _trace_ref((failure.get("trace_ids") or [None])[0]),
            "weak": weak or (no_schema and vkind.startswith("tool_call")),
            "tool_schema_sources": schema_sources,
            "deterministic": deterministic,
            "verifier_kind": vkind,
            "request_hash": request_hash(*request_key(messages, tools)),
            "origin_outcome": "failure",
        },
    }


def _trace_fields(state: dict) -> tuple[list[dict], list[dict], dict]:
    """(messages, tools, outcome) of a ``trace.ingested`` payload, tolerant of nesting."""
    trace = state.get("trace") if isinstance(state.get("trace"), dict) else state
    messages = trace.get("messages") or []
    tools = trace.get("tools") or []
    outcome = trace.get("outcome") if isinstance(trace.get("outcome"), dict) else {}
    return messages, tools, outcome


def trace_correction(state: dict) -> list[dict] | None:
    trace = state.get("trace") if isinstance(state.get("trace"), dict) else state
    corr = trace.get("correction")
    if isinstance(corr, dict) and isinstance(corr.get("tool_calls"), list):
        return corr["tool_calls"]
    return None


def compile_success(trace_id: str, state: dict) -> dict:
    """Compile a successful trace into a regression task record (the recorded answer must verify).

    - final answer = tool calls, no tool turn after the last user turn -> single turn, ``tool_call``
      with the trace's correction as expectation when it carries one (BFCL's possible answers),
      else the recorded calls as literals;
    - tool calls answered by tool turns, then a final text answer -> ``tool_loop`` with the
      recorded tool outputs as the environment, verified on the calls the model makes
      (``tool_call`` over the trajectory's calls);
    - code answers with tests -> ``python_tests``;
    - free text with nothing to check deterministically -> ``llm_judge`` against the recorded
      answer (non-deterministic; kept out of the gate suite unless configured).
    """
    messages, tools, outcome = _trace_fields(state)
    trace = state.get("trace") if isinstance(state.get("trace"), dict) else state
    tools, schema_sources, no_schema = _with_schema_sources(
        tools, messages, (trace.get("metadata") or {}).get(SOURCES_KEY))
    if not messages:
        raise CompileSkip(f"{trace_id}: no messages")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        raise CompileSkip(f"{trace_id}: no user message")
    episode = messages[last_user + 1 :]
    if not episode or episode[-1].get("role") != "assistant":
        raise CompileSkip(f"{trace_id}: the trace does not end with an assistant answer")
    prompt = messages[: last_user + 1]
    final = episode[-1]
    tool_env = None
    harness = "single_turn"
    deterministic = True
    all_calls: list[dict] = []
    recorded: list[dict] = []
    by_id: dict[str, dict] = {}
    for m in episode:
        if m.get("role") == "assistant":
            calls = _message_calls(m)
            if m.get("tool_calls") and calls is None:
                raise CompileSkip(f"{trace_id}: a recorded call has unparseable arguments")
            for tc, call in zip(m.get("tool_calls") or [], calls or [], strict=False):
                all_calls.append(call)
                by_id[str(tc.get("id"))] = call
        elif m.get("role") == "tool":
            call = by_id.get(str(m.get("tool_call_id")))
            if call is None and m.get("name"):
                call = next((c for c in reversed(all_calls) if c["name"] == m["name"]), None)
            if call is not None:
                recorded.append({"name": call["name"], "arguments": call["arguments"], "content": text_of(m.get("content"))})

    if outcome.get("tests"):
        spec = {"kind": "python_tests", "tests": str(outcome["tests"])}
        reference = {"content": text_of(final.get("content"))}
        vkind = "python_tests"
    elif len(episode) == 1 and _message_calls(final):
        calls = _message_calls(final) or []
        correction = trace_correction(state)
        # A trace that carries the allowed answers (BFCL's possible answers) is checked against them,
        # not against the one literal answer that happened to be given.
        spec = _tool_call_spec(tools, correction if correction is not None else calls)
        reference = {"tool_calls": calls}
        vkind = "tool_call"
    elif all_calls and recorded:
        harness = "tool_loop"
        tool_env = {"recorded": recorded, "python": None, "replay": False}
        spec = {**_tool_call_spec(tools, all_calls), "scope": "all"}
        reference = {"tool_calls": all_calls}
        vkind = "tool_call"
    else:
        answer = text_of(final.get("content"))
        if not answer.strip():
            raise CompileSkip(f"{trace_id}: empty final answer")
        spec = {
            "kind": "llm_judge",
            "rubric": "PASS if the answer is as correct and helpful as the reference answer for the user's "
            f"request, FAIL otherwise.\nUser request: {_last_user(prompt)}",
            "reference": answer,
        }
        reference = {"content": answer}
        vkind = "llm_judge"
        deterministic = False
    _check_spec(trace_id, spec)
    return {
        "task_id": eval_id(trace_id),
        "prompt": {"messages": prompt, "tools": tools},
        "verifier": spec,
        "harness": harness,
        "tool_env": tool_env,
        "reference": reference,
        "metadata": {
            "failure_kinds": [],
            "tools": sorted({tool_name(t) for t in tools} - {""}),
            "source": state.get("source"),
            "origin_failure": None,
            "origin_trace": trace_id,
            "weak": no_schema and vkind == "tool_call",
            "tool_schema_sources": schema_sources,
            "deterministic": deterministic,
            "verifier_kind": vkind,
            "request_hash": request_hash(*request_key(prompt, tools)),
            "origin_outcome": "success",
        },
    }
