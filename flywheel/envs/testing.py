"""Test helpers for evals, environments and harnesses: plain functions and classes, no pytest.

- :class:`CharTokenizer`: a dependency-free tokenizer with a ChatML template (one id per character,
  ``<|im_start|>``/``<|im_end|>`` as single special ids), so harness token accounting can be
  checked by hand in milliseconds.
- :class:`ScriptedPolicy`: the policy interface (``generate``, ``generate_from_ids``, ``tokenizer``)
  answering from a function of the rendered prompt text; token ids and logprobs are real for its
  tokenizer, so it exercises exactly the bookkeeping a Hugging Face policy goes through.
- :func:`failure_payload`, :func:`append_failure`, :func:`append_success_trace`: write the events the
  ingest stage would (``failure.classified``, ``trace.ingested``) so evals can be built in tests
  without running ingest.

Used by this package's tests; other stages' tests (rollouts, gate) may use them too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from flywheel.policy.base import Sample, coerce_params, per_prompt_tools
from flywheel.policy.format import render_prompt
from flywheel.store import BATCH_SCHEMA, EventStore, NewEvent
from flywheel.vocab.ids import canonical_json, short_id

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class CharTokenizer:
    """One token per character (id = code point + 2); ``<|im_start|>`` = 0, ``<|im_end|>`` = 1."""

    chat_template = "chatml (CharTokenizer)"  # no tool role: tool turns are rendered as user turns
    eos_token = IM_END
    eos_token_id = 1
    pad_token_id = 1
    _special = {IM_START: 0, IM_END: 1}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for tok, tid in self._special.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                ids.append(ord(text[i]) + 2)
                i += 1
        return ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        inv = {v: k for k, v in self._special.items()}
        return "".join(
            ("" if skip_special_tokens else inv[i]) if i in inv else chr(i - 2) for i in ids
        )

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False, **_: Any) -> str:
        text = "".join(f"{IM_START}{m['role']}\n{m.get('content') or ''}{IM_END}\n" for m in messages)
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return text


Responder = Callable[[str, int], str]


class ScriptedPolicy:
    """A policy whose answers come from ``responder(prompt_text, sample_idx) -> answer text``.

    Each answer is tokenised and followed by the end-of-turn token (finish reason ``"stop"``), or
    cut at ``max_new_tokens`` (``"length"``, no end token). Logprobs are ``-(k + 1) / 100`` for the
    k-th token of a turn, so tests can tell model positions apart. ``calls`` records every
    generation call as ``("generate" | "generate_from_ids", batch size)``.
    """

    def __init__(self, responder: Responder, tokenizer: Any = None, *, name: str = "scripted",
                 version: str = "0", end_token: str = IM_END):
        self.responder = responder
        self.tokenizer = tokenizer or CharTokenizer()
        self.name, self.version = name, version
        self.end_id = self.tokenizer(end_token, add_special_tokens=False)["input_ids"][-1]
        self.calls: list[tuple[str, int]] = []

    def _sample(self, prompt_ids: list[int], j: int, params: Any) -> Sample:
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = self.responder(prompt_text, j)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.end_id]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Sample(
            text=text,
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=ids,
            logprobs=[-(k + 1) / 100 for k in range(len(ids))],
            finish_reason=finish,
            truncated=finish == "length",
            gen_ms=1.0,
        )

    def generate(self, prompts: list[list[dict]], params: Any = None, *, tools: Any = None) -> list[list[Sample]]:
        p = coerce_params(params)
        self.calls.append(("generate", len(prompts)))
        per_tools = per_prompt_tools(tools, len(prompts))
        out = []
        for msgs, t in zip(prompts, per_tools, strict=True):
            ids = self.tokenizer(render_prompt(self.tokenizer, msgs, t), add_special_tokens=False)["input_ids"]
            out.append([self._sample(ids, j, p) for j in range(p.n)])
        return out

    def generate_from_ids(self, prompt_token_ids: list[list[int]], params: Any = None) -> list[list[Sample]]:
        p = coerce_params(params)
        self.calls.append(("generate_from_ids", len(prompt_token_ids)))
        return [[self._sample(ids, j, p) for j in range(p.n)] for ids in prompt_token_ids]


# ------------------------------------------------------------------------------ store fixtures
def _h16(*parts: Any) -> str:
    # Not canonical_json: default separators, ASCII escapes and default=str are what the content hashes
    # of the failures tests build (and fixtures record) were made with.
    return short_id(json.dumps(parts, sort_keys=True, default=str))


def failure_payload(
    messages: list[dict],
    tools: list[dict],
    bad_answer: dict,
    kinds: list[str],
    *,
    correction: dict | None = None,
    tests: str | None = None,
    feedback: dict | None = None,
    error: str | None = None,
    source: str = "openai",
    trace_id: str | None = None,
    occurrences: int = 1,
) -> dict:
    """A ``failure.classified`` payload in the ingest contract's shape."""
    content_hash = _h16(messages, tools, bad_answer)
    tid = trace_id or f"trace:t-{content_hash}"
    return {
        "entity_id": f"failure:{content_hash}",
        "kinds": list(kinds),
        "trace_ids": [tid],
        "occurrences": occurrences,
        "first_seen": "2026-11-02T08:15:00Z",
        "last_seen": "2026-11-02T08:15:00Z",
        "tools": tools,
        "messages": messages,
        "bad_answer": bad_answer,
        "correction": correction,
        "tests": tests,
        "error": error,
        "feedback": feedback,
        "source": source,
        "source_id": tid.split(":", 1)[1],
        "content_hash": content_hash,
    }


def append_failure(store: EventStore, payload: dict) -> str:
    """Append ``failure.classified`` for ``payload`` (stream = its entity id). Returns the id."""
    fid = payload["entity_id"]
    store.append(fid, NewEvent("failure.classified", payload, list(payload.get("trace_ids") or [])))
    return fid


def append_failures(store: EventStore, payloads: list[dict]) -> list[str]:
    """Append many ``failure.classified`` events in one transaction (fast fixtures)."""
    table = pa.table(
        {
            "stream": [p["entity_id"] for p in payloads],
            "type": ["failure.classified"] * len(payloads),
            "payload": [canonical_json(p) for p in payloads],
            "causation": [list(p.get("trace_ids") or []) for p in payloads],
        },
        schema=BATCH_SCHEMA,
    )
    store.append_batch(table)
    return [p["entity_id"] for p in payloads]


def append_success_trace(store: EventStore, trace_id: str, messages: list[dict], tools: list[dict],
                         *, tests: str | None = None, metadata: dict | None = None) -> str:
    """Append ``trace.ingested`` for a successful trace (``status: "success"``)."""
    tid = trace_id if trace_id.startswith("trace:") else f"trace:{trace_id}"
    outcome: dict[str, Any] = {"status": "success"}
    if tests:
        outcome["tests"] = tests
    payload = {"entity_id": tid, "trace_id": tid.split(":", 1)[1], "status": "success", "messages": messages,
               "tools": tools, "outcome": outcome, "metadata": metadata or {}, "source": "openai"}
    store.append(tid, NewEvent("trace.ingested", payload, []))
    return tid


def tool_spec(name: str, properties: dict, required: list[str], description: str = "") -> dict:
    """An OpenAI function tool spec."""
    return {"type": "function", "function": {"name": name, "description": description or name,
                                              "parameters": {"type": "object", "properties": properties,
                                                             "required": required}}}


def openai_call(name: str, arguments: dict | str, call_id: str = "call_1") -> dict:
    """An assistant message with one OpenAI tool call (arguments as a JSON string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}
