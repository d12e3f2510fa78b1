"""Failures -> evals -> suites: the compiler from production failures to verifiable tasks.

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
                                           required args, values among the allowed ones,
                                           order-insensitive). No correction -> validity only, weak.
``invalid_json`` on content                ``json_schema`` with the response format's schema (weak
                                           ``{}`` = any JSON when the trace has none)
``negative_feedback`` (nothing else)       ``llm_judge`` rubric from the feedback; non-deterministic
``other`` with a correction                ``tool_call`` / ``exact`` against the correction
=========================================  =====================================================

A ``python_tests`` eval keeps the trace's ``outcome.tests`` source as it is: that source is the
eval's contract. When every test in it is an input -> expected-output check (``assert f(<literals>) ==
<literal>``, the usual shape), the sandbox judges it outside the candidate's process
(:mod:`flywheel.io_tests`); otherwise the tests run beside the candidate. Verdicts say which
(``details["isolation"]["grading"]``).

Why ``invalid_json`` on a *tool call* compiles to ``tool_call``: the shared answer format is BFCL's
pythonic ``[fn(a=1)]`` (:mod:`flywheel.policy.format`), so a model never writes the arguments as
JSON text; the JSON Schema that matters is the tool's ``parameters`` schema, which ``tool_call``
enforces strictly (types, required, enums). A content answer that had to be JSON gets
``json_schema``.

Events and guarantees
---------------------
- ``eval.created`` on ``eval:<id>`` where ``id = sha256(origin)[:16]`` (origin = the failure or
  trace entity id): payload = the task record + ``entity_id``, ``split``, ``cluster``,
  ``origin_failure``, ``failure_kinds``, ``tools``, ``verifier_kind``, ``compiler_version``;
  causation = the failure (or the successful trace).
- A failure's split is dealt once and reused from its recorded event forever; recompiling a failure
  whose payload changed (say a correction arrived) appends a new ``eval.created`` on the same stream
  with the same split and cluster.
- ``suite.versioned`` on ``suite:<name>``: payload ``{entity_id: "suite:<name>@N", name, version,
  artifact, members, version_hash}``, causation = member eval ids. The artifact is JSON
  ``{"kind": "suite", "name", "version_hash", "members": [task records sorted by task_id]}``.
- Rebuilding from the same inputs appends nothing: unchanged evals are skipped, and a suite whose
  ``version_hash`` (sha256 of its canonical member records) equals its latest version's is not
  versioned again. Appends use ``expected_version`` (optimistic concurrency): a concurrent build
  gets :class:`flywheel.store.ConcurrencyError` and nothing half-written.
- The held-out suite excludes non-deterministic evals unless ``evals.include_llm_judge_in_gate``;
  the regression suite likewise.

Not guaranteed: that a correction supplied by a person is itself right (it is trusted); that a
weak (validity-only) eval distinguishes a wrong value from a right one.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore, load_traces
from flywheel.config import FlywheelConfig
from flywheel.contamination import contaminated_by_synthetic
from flywheel.split import REQUEST_TEXT_VERSION, SplitIndex, request_hash, request_key
from flywheel.store import BATCH_SCHEMA, ConcurrencyError, EventStore
from flywheel.tasks import task_from_state
from flywheel.tool_registry import SOURCES_KEY
from flywheel.verifiers import SpecError, validate_spec
from flywheel.versioning import version_suite, versioned_event
from flywheel.vocab.ids import canonical_json, short_id
from flywheel.vocab.kinds import SUITES, TOOL_CALL_KINDS
from flywheel.vocab.messages import last_index, text_of
from flywheel.vocab.refs import with_prefix
from flywheel.vocab.toolcalls import decode_tool_calls
from flywheel.vocab.tools import called_names, tool_name, tool_parameters

# 2: metadata.origin_outcome; request_hash of the user turns + tool names; metadata.tool_schema_sources
# (tools without a schema get an open placeholder).
COMPILER_VERSION = 2


__all__ = [
    "COMPILER_VERSION",
    "CompileSkip",
    "EvalsSummary",
    "build_evals",
    "compile_failure",
    "compile_success",
    "eval_id",
    "reference_from_correction",
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
        or ("invalid_json" in kinds and (bad or {}).get("tool_calls"))
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


# --------------------------------------------------------------------------------- the stage
@dataclass
class EvalsSummary:
    """What one ``build_evals`` did. ``created``/``updated`` count evals by verifier kind."""

    created: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    unchanged: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    suites: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    excluded_from_gate: int = 0
    events_appended: int = 0
    empty_suites: list[str] = field(default_factory=list)
    created_by_failure_kind: dict[str, int] = field(default_factory=dict)
    heldout: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    excluded_contaminated: int = 0
    # evals (created or updated) that call a tool whose schema the trace did not record
    evals_with_tools_without_schema: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "created": dict(self.created),
            "created_by_failure_kind": dict(self.created_by_failure_kind),
            "updated": dict(self.updated),
            "unchanged": self.unchanged,
            "splits": dict(self.splits),
            "suites": list(self.suites),
            "skipped": list(self.skipped),
            "skipped_by_reason": dict(Counter(s["reason_kind"] for s in self.skipped)),
            "excluded_from_gate": self.excluded_from_gate,
            "empty_suites": list(self.empty_suites),
            "events_appended": self.events_appended,
            "heldout": dict(self.heldout),
            "warnings": list(self.warnings),
            "excluded_contaminated": self.excluded_contaminated,
            "evals_with_tools_without_schema": self.evals_with_tools_without_schema,
        }


def _successful_traces(store: EventStore) -> list[tuple[str, dict]]:
    """Successful ``trace:`` entities, filtered in SQL so failures' payloads are never parsed."""
    return store.trace_states("success")


def _full_traces(artifacts: ArtifactStore, states: list[dict]) -> list[dict]:
    """The full trace records behind ``trace.ingested`` states.

    Ingest keeps the redacted trace in a per-batch Parquet artifact and only a reference
    ``trace: {sha256, row}`` in the event (see :mod:`flywheel.ingest.pipeline`); states that carry
    the messages themselves (older payloads, test fixtures) are used as they are.
    """
    refs = [i for i, st in enumerate(states) if isinstance(st.get("trace"), dict) and "sha256" in st["trace"]]
    out = list(states)
    if refs:
        for i, full in zip(refs, load_traces(artifacts, [states[i] for i in refs]), strict=True):
            out[i] = {**full, "source": full.get("source") or states[i].get("source")}
    return out


def _trace_entity(store: EventStore, artifacts: ArtifactStore, trace_id: str) -> dict | None:
    ent = store.entity(with_prefix("trace", trace_id))
    if ent is None:
        return None
    return _full_traces(artifacts, [ent["state"]])[0]


def _reason_kind(reason: str) -> str:
    return reason.split(": ", 1)[1] if ": " in reason else reason


def build_evals(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, *,
                correlation_id: str | None = None) -> EvalsSummary:
    """Compile every failure and successful trace into evals, split them, version the suites.

    Idempotent: the same inputs append no event (see the module docstring for all guarantees).
    """
    ecfg = cfg.evals
    summary = EvalsSummary()
    existing = {e["entity_id"]: e["state"] for e in store.entities("eval")}

    index = SplitIndex(heldout_fraction=ecfg.heldout_fraction, seed=ecfg.split_seed, jaccard=ecfg.cluster_jaccard)
    # Recorded placements first, in the order they were made, so new requests see all of them.
    # Successes recorded on the train side ("regression": their answers become demonstrations) sit
    # on the train side of the index, so a near-copy failure can never be dealt to held-out.
    for eid, st in existing.items():
        split = st.get("split")
        if split in ("train", "heldout", "excluded", "regression"):
            prompt = st.get("prompt") or {}
            md = st.get("metadata") or {}
            key = st.get("origin_failure") or md.get("origin_trace") or eid
            text, tools = request_key(prompt.get("messages") or [], prompt.get("tools") or [])
            index.add_existing(key, text, st["cluster"], "train" if split == "regression" else split, tools)

    new_events: list[tuple[str, dict, list[str], int]] = []  # stream, payload, causation, expected

    def stage(task: dict, origin: str, split: str, cluster: str, kinds: list[str]) -> None:
        tid = task["task_id"]
        task["metadata"]["split"] = split
        task["metadata"]["cluster"] = cluster
        payload = {
            "entity_id": tid,
            **task,
            "split": split,
            "cluster": cluster,
            "origin_failure": task["metadata"].get("origin_failure"),
            "failure_kinds": kinds,
            "tools": task["metadata"]["tools"],
            "verifier_kind": task["metadata"]["verifier_kind"],
            "compiler_version": COMPILER_VERSION,
            "request_text_version": REQUEST_TEXT_VERSION,
        }
        old = existing.get(tid)
        vk = task["metadata"]["verifier_kind"]
        if old is not None and canonical_json(old) == canonical_json(payload):
            summary.unchanged += 1
        else:
            bucket = summary.updated if old is not None else summary.created
            bucket[vk] = bucket.get(vk, 0) + 1
            if "none" in (task["metadata"].get("tool_schema_sources") or {}).values():
                summary.evals_with_tools_without_schema += 1
            if old is None:
                for k in kinds or ["success"]:
                    summary.created_by_failure_kind[k] = summary.created_by_failure_kind.get(k, 0) + 1
            new_events.append((tid, payload, [origin], store.stream_version(tid) if old is not None else 0))
        existing[tid] = payload

    placed_now: dict[str, str] = {}  # task id -> origin, for items placed (not reloaded) in this build

    # -- failures -> train / heldout / excluded
    failures = store.entities("failure")
    for f in failures:
        fid, st = f["entity_id"], dict(f["state"])
        st.setdefault("entity_id", fid)
        trace_state = None
        if "runtime_exception" in (st.get("kinds") or []) and st.get("trace_ids"):
            trace_state = _trace_entity(store, artifacts, str(st["trace_ids"][0]))
        try:
            task = compile_failure(st, trace_state=trace_state)
        except CompileSkip as e:
            summary.skipped.append({"origin": fid, "reason": str(e), "reason_kind": _reason_kind(str(e))})
            continue
        prev = existing.get(task["task_id"])
        if prev is not None and prev.get("split") in ("train", "heldout", "excluded"):
            split, cluster = prev["split"], prev["cluster"]  # recorded: never moves
        else:
            p = index.assign(fid, *request_key(task["prompt"]["messages"], task["prompt"]["tools"]))
            split, cluster = p.split, p.cluster
            placed_now[task["task_id"]] = fid
        stage(task, fid, split, cluster, task["metadata"]["failure_kinds"])

    # -- successful traces -> regression
    seen_regression: set[str] = set()
    successes = _successful_traces(store)
    full = _full_traces(artifacts, [st for _, st in successes])
    for (tid_trace, _), st in zip(successes, full, strict=True):
        try:
            task = compile_success(tid_trace, st)
        except CompileSkip as e:
            summary.skipped.append({"origin": tid_trace, "reason": str(e), "reason_kind": _reason_kind(str(e))})
            continue
        # Many production successes repeat the same request and answer: one eval each.
        key = canonical_json([task["metadata"]["request_hash"], task["verifier"], task["reference"]])
        if key in seen_regression:
            continue
        seen_regression.add(key)
        prev = existing.get(task["task_id"])
        if prev is not None and prev.get("split") in ("regression", "heldout", "excluded"):
            split, cluster = prev["split"], prev["cluster"]  # recorded: never moves
        else:
            # Dealt by cluster like the failures: held-out successes measure the keep rate; train-side
            # successes form the regression suite (and SFT demonstrations).
            p = index.assign(tid_trace, *request_key(task["prompt"]["messages"], task["prompt"]["tools"]))
            split, cluster = ("regression" if p.split == "train" else p.split), p.cluster
            placed_now[task["task_id"]] = tid_trace
        stage(task, tid_trace, split, cluster, [])

    # -- a new held-out item that a recorded synthetic task already copies is excluded: models trained
    # on that batch have seen it (synthetic variants are not in the split index).
    fresh_heldout = [task_from_state(existing[t]) for t in placed_now if existing[t].get("split") == "heldout"]
    if fresh_heldout:
        for tid, synth_id in contaminated_by_synthetic(store, artifacts, fresh_heldout, cfg.synth).items():
            st = existing[tid]
            cluster = f"x-{st['metadata']['request_hash'][:16]}"
            st.update(split="excluded", cluster=cluster, excluded_because=f"near-copy of synthetic task {synth_id}")
            st["metadata"].update(split="excluded", cluster=cluster)  # the same dicts as the staged event
            summary.excluded_contaminated += 1

    # -- append the eval events in one transaction
    if new_events:
        table = pa.table(
            {
                "stream": [s for s, _, _, _ in new_events],
                "type": ["eval.created"] * len(new_events),
                "payload": [canonical_json(p) for _, p, _, _ in new_events],
                "causation": [c for _, _, c, _ in new_events],
            },
            schema=BATCH_SCHEMA,
        )
        res = store.append_batch(
            table,
            correlation_id=correlation_id,
            expected_versions={s: v for s, _, _, v in new_events},
            validated=True,
        )
        summary.events_appended += res.appended

    # -- suites
    by_split: dict[str, list[dict]] = {s: [] for s in ("train", "heldout", "excluded", "regression")}
    for st in existing.values():
        by_split.setdefault(st.get("split") or "unknown", []).append(st)
    summary.splits = {k: len(v) for k, v in by_split.items() if v}
    include_nd = ecfg.include_llm_judge_in_gate
    for name in SUITES:
        members = []
        for st in by_split[name]:
            deterministic = (st.get("metadata") or {}).get("deterministic", True)
            if name in ("heldout", "regression") and not deterministic and not include_nd:
                summary.excluded_from_gate += 1
                continue
            members.append(task_from_state(st))
        if not members and versioned_event(store, "suite", "suite.versioned", name) is None:
            summary.empty_suites.append(name)  # never versioned empty: nothing to gate or train on
            continue
        entity, new = version_suite(store, artifacts, name, members, correlation_id)
        summary.events_appended += int(new)
        summary.suites.append({"suite": entity, "members": len(members), "new_version": new})
        if name == "heldout":
            outcomes = Counter((t.get("metadata") or {}).get("origin_outcome", "failure") for t in members)
            summary.heldout = {"items": len(members), "failures": outcomes.get("failure", 0),
                               "successes": outcomes.get("success", 0),
                               "clusters": len({(t.get("metadata") or {}).get("cluster") for t in members})}
    summary.warnings += _heldout_warnings(cfg, summary, existing)
    return summary


def _heldout_warnings(cfg: FlywheelConfig, summary: EvalsSummary, states: dict[str, dict]) -> list[str]:
    """Say, before any training is spent, when the held-out suite cannot decide a gate, and why."""
    need = cfg.gate.min_paired_items
    have = summary.heldout.get("items", 0)
    if have >= need:
        return []
    placed = [st for st in states.values() if st.get("split") in ("train", "heldout", "excluded", "regression")]
    clusters = {st.get("cluster") for st in placed}
    heldout_clusters = {st.get("cluster") for st in placed if st.get("split") == "heldout"}
    frac = cfg.evals.heldout_fraction
    why = (f"{len(placed)} evals in {len(clusters)} request clusters, {len(heldout_clusters)} of them held out "
           f"(evals.heldout_fraction = {frac})")
    if have == 0:
        head = "the held-out suite is empty"
    else:
        head = f"the held-out suite has {have} items, fewer than gate.min_paired_items = {need}"
    if len(clusters) and len(clusters) * frac < need:
        fix = (f"about {int(need / frac) + 1} distinct requests are needed at this fraction: ingest more traffic "
               "(or raise evals.heldout_fraction)")
    else:
        fix = "ingest more traffic"
    excluded = summary.excluded_from_gate
    extra = f"; {excluded} non-deterministic evals are kept out of it" if excluded else ""
    return [f"{head}: every gate on it will end 'insufficient evidence' and the champion stays. {why}{extra}. "
            f"To decide, {fix}."]


__all__ += ["ConcurrencyError"]
