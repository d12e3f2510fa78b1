"""What every generator shares: the :class:`Candidate` it returns, the :class:`GenContext` it may
look at (built by :func:`build_context` from the training seeds), the :class:`Generator` base class,
:func:`_new_task` (a variant with the synth metadata and its id), and the helpers that find where a
request states a value (:func:`_locate_number`, :func:`_locate_string`) and a parameter's schema.
"""

from __future__ import annotations

import copy
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flywheel.dedup import _canon_number, tokens
from flywheel.policy.base import Policy
from flywheel.split import request_hash, request_key
from flywheel.synth.keys import SYNTH_VERSION, synth_task_id
from flywheel.vocab.tools import function_of, tool_name

#: ``progress(stage, done, total)``: called as long work advances (the CLI draws its bars from it).
Progress = Callable[[str, int, int], None]


# ---------------------------------------------------------------- the candidate, the context, the base class
@dataclass
class Candidate:
    """A generated task before the funnel. ``problems`` are reasons the generator itself found the
    task invalid (kept, so the funnel reports them)."""

    task: dict
    generator: str
    seed_ids: list[str]
    problems: list[str] = field(default_factory=list)

    @property
    def task_id(self) -> str:
        return self.task["task_id"]


@dataclass
class GenContext:
    """What generators may look at: every seed (for partners), the tool pool and the value pool
    (both from training seeds only), and the policy (paraphrase)."""

    seeds: list[dict]
    tool_pool: dict[str, dict]
    value_pool: dict[str, list[Any]]
    policy: Policy | None = None
    seed: int = 0
    idf: dict[str, float] = field(default_factory=dict)


def build_context(seeds: list[dict], *, policy: Policy | None = None, seed: int = 0) -> GenContext:
    tool_pool: dict[str, dict] = {}
    values: dict[str, set[str]] = {}
    for s in seeds:
        for t in (s.get("prompt") or {}).get("tools") or []:
            tool_pool.setdefault(tool_name(t), t)
        for c in (s.get("reference") or {}).get("tool_calls") or []:
            for p, v in (c.get("arguments") or {}).items():
                if isinstance(v, str) and 2 <= len(v) <= 60:
                    values.setdefault(p.lower(), set()).add(v)
    # Inverse document frequency of the words of the pool's tool docs: "get" or "calculate" say
    # little about a tool's domain, "hemoglobin" says a lot (distractor plausibility).
    df: Counter[str] = Counter()
    for t in tool_pool.values():
        df.update(_words(t))
    n = max(1, len(tool_pool))
    idf = {w: math.log((1 + n) / (1 + c)) + 1.0 for w, c in df.items()}
    return GenContext(seeds, dict(sorted(tool_pool.items())), {k: sorted(v) for k, v in sorted(values.items())},
                      policy, seed, idf)


def _new_task(seed: dict, *, messages: list[dict], tools: list[dict], expected: list[dict] | None,
              reference: dict, generator: str, params: dict, detail: dict, seeds: list[str]) -> dict:
    verifier = copy.deepcopy(seed["verifier"])
    if verifier.get("kind") == "tool_call":
        verifier["tools"] = tools
        if expected is not None:
            verifier["expected"] = expected
    meta = dict(seed.get("metadata") or {})
    meta.update({
        "source": "synth",
        "split": "train",
        "seed_task": seed["task_id"],
        "seed_tasks": seeds,
        "generator": generator,
        "generator_params": params,
        "synth_detail": detail,
        "tools": sorted({tool_name(t) for t in tools} - {""}),
        "request_hash": request_hash(*request_key(messages, tools)),
        "synth_version": SYNTH_VERSION,
    })
    task = {
        "task_id": "",
        "prompt": {"messages": messages, "tools": tools},
        "verifier": verifier,
        "harness": "single_turn",
        "tool_env": None,
        "reference": reference,
        "metadata": meta,
    }
    task["task_id"] = synth_task_id(task)
    return task


class Generator:
    """Base class. ``generate(items, ctx)`` gets ``(seed, k, rng)`` triples (``k`` = the variant
    number for that seed, ``rng`` seeded from the batch seed, generator, seed content and ``k``) and
    returns one :class:`Candidate` or ``None`` (not applicable) per item."""

    name = "base"

    def __init__(self, **params: Any):
        self.params = dict(params)

    def applicable(self, seed: dict) -> bool:
        return _tool_call_seed(seed)

    def generate(self, items: list[tuple[dict, int, random.Random]], ctx: GenContext) -> list[Candidate | None]:
        return [self.one(s, k, rng, ctx) if self.applicable(s) else None for s, k, rng in items]

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        raise NotImplementedError


# ---------------------------------------------------------------- which seeds apply, where a request states a value
def _is_one_of(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("one_of"), list)


def _tool_call_seed(task: dict) -> bool:
    """A seed the tool-call generators can work on: a strict ``tool_call`` verifier with expected
    calls and a reference that makes calls."""
    v = task.get("verifier") or {}
    ref = task.get("reference") or {}
    return (
        v.get("kind") == "tool_call"
        and isinstance(v.get("expected"), list)
        and len(v["expected"]) > 0
        and v.get("scope", "last") == "last"
        and not task.get("tool_env")
        and isinstance(ref.get("tool_calls"), list)
        and len(ref["tool_calls"]) == len(v["expected"])
    )


_NUM_RE = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")


def _locate_number(text: str, value: int | float) -> list[re.Match[str]]:
    want = _canon_number(repr(value) if isinstance(value, float) else str(value))
    return [m for m in _NUM_RE.finditer(text) if _canon_number(m.group(0)) == want]


def _locate_string(text: str, value: str) -> list[re.Match[str]]:
    if len(value) < 2:
        return []
    return list(re.finditer(r"(?<!\w)" + re.escape(value) + r"(?!\w)", text, flags=re.IGNORECASE))


def _locate_value(text: str, value: Any) -> list[re.Match[str]] | None:
    """Where ``text`` states the argument ``value`` (:func:`_locate_number` or :func:`_locate_string`);
    ``None`` for a value no request states as such (a bool, None, a list or an object)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return _locate_number(text, value)
    if isinstance(value, str):
        return _locate_string(text, value)
    return None


def _schema_of(tools: list[dict], call_name: str, param: str) -> dict | None:
    for t in tools:
        fn = function_of(t) or {}
        if fn.get("name") == call_name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            s = props.get(param)
            return s if isinstance(s, dict) else None
    return None


def _words(tool: dict) -> set[str]:
    fn = function_of(tool) or {}
    return set(tokens(str(fn.get("name", "")).replace(".", " ").replace("_", " ") + " " + str(fn.get("description", ""))))
