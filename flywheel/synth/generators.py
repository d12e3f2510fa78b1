"""Synthetic tasks: widen each training eval into verified, deduplicated, decontaminated variants.

A handful of production failures is too few to train on. :func:`run_synth` takes the training
environment's eval tasks as *seeds*, asks each generator for variants, and keeps only those that
pass every gate of the funnel::

    generated -> valid -> solvable -> unique -> uncontaminated -> accepted

Generators (pluggable: :data:`GENERATORS`; each records ``metadata.generator`` and
``metadata.generator_params`` on every task it makes, and what it did in ``metadata.synth_detail``)
----------------------------------------------------------------------------------------------------
- ``mutate`` (schema-driven mutation, deterministic per seed): picks arguments of the reference
  answer whose value the user request states *exactly once* (a number, an enum member, a string,
  a date or a time; a value stated twice or shared by two arguments is ambiguous and left alone),
  draws a new value inside the argument's JSON Schema (enum members, ``minimum``/``maximum``, the
  original's magnitude and decimals, the date/time format; strings from the values other training
  seeds use for a parameter of the same name, then a small built-in vocabulary by parameter name),
  rewrites that span of the request in the original's style (thousands separators, decimals), and
  sets the reference and the expected answer to the new value. Never uses held-out values: the
  pool is built from training seeds only.
- ``distractor`` (BFCL ``multiple`` style): adds 1..``max_distractors`` tools from the pool of every
  training seed's tools, the most *plausible* first (largest word overlap of name + description
  with the task's own tools), at seeded positions; the expected answer is unchanged, so calling a
  distractor fails.
- ``parallel`` (BFCL ``parallel`` / ``parallel_multiple`` style): joins the request with a second
  one -- a mutation of itself (same function, other values) or another seed with compatible tools --
  into one request whose answer is both calls, order-insensitive.
- ``paraphrase`` (optional; needs a policy): asks any chat model through the policy interface to
  reword the request, keeping the reference. The output must keep every value the request stated
  (else the candidate is invalid); a paraphrase too close to its seed is caught as a near-duplicate.

Validation (:func:`validate_candidates`)
----------------------------------------
- **valid**: the task-record contract (:func:`flywheel.tasks.validate_task`), the verifier spec
  (:func:`flywheel.verifiers.validate_spec`), a renderable reference, generator-reported problems,
  and the Great Expectations suite ``schemas/gx/synth_batch.json`` over the batch's feature rows
  (required fields, lengths in bounds, tools are valid JSON Schema, reference present); a row failing
  an expectation is rejected naming it.
- **solvable**: the reference answer, rendered exactly as the policy is trained to write it
  (:func:`flywheel.policy.format.render_answer`), must pass the task's own verifier.
- **difficulty** (optional, ``[synth] difficulty_samples = K > 0`` and a policy): the pass rate of
  K samples is recorded as ``metadata.difficulty = {pass_rate, k, policy, zero_advantage}`` (all
  pass or none pass: a GRPO group with zero advantage); ``difficulty_drop`` can drop such tasks.

Deduplication and decontamination (:mod:`flywheel.dedup` does the text work)
----------------------------------------------------------------------------
A task's **request** is its user turns (its system turns only when it has no user text: an agent's
system prompt is shared by all its requests), normalised (whitespace, case, punctuation, number
formatting). Against everything already in the training environment (seeds and every earlier
batch's accepted tasks) and the batch's own earlier accepted candidates:

- **exact duplicate**: same normalised request and same set of offered tools;
- **near duplicate**: word-bigram Jaccard >= ``near_dup_jaccard`` (MinHash LSH proposes, exact
  Jaccard confirms) *and* the same tools *and* the same expected answer (canonical calls). Why the
  answer: a mutation changes one value of a long request, leaving its Jaccard near 1, yet asks for
  a different call -- that is the point of the generator, not a duplicate;
- **semantic duplicate** (``semantic_dedup``): embedding cosine >= ``semantic_threshold``, same
  tools and answer.

Against the held-out suite (``suite:<cycle.heldout_suite>@latest``) and the failures those evals
came from, *regardless of tools and answers* (a held-out request with other values is still a
leak of the held-out template): exact request, near duplicate at ``contamination_jaccard``,
a shared long n-gram (``contamination_ngram`` words, GPT-3's 13-gram check), and the semantic check
when enabled.

Records and identity
--------------------
- Candidate ids are content hashes ``synth:<16 hex>`` of (prompt, verifier, harness, reference).
- The batch id ``synth:b-<16 hex>`` hashes the environment name, the suites its seeds come from, the
  seeds' content, the generators and their parameters, the seed, ``per_seed``, the dedup and
  decontamination settings, the held-out suite version, and (with the difficulty filter) the policy.
  It deliberately does not hash the environment *version*: accepting a batch creates a new one, and
  re-running the same batch must find the batch already recorded and append nothing.
- Accepted tasks go into the environment as a new version (:func:`flywheel.versioning.add_tasks_to_env`),
  then one ``synth.batch_accepted`` event on ``synth:b-<id>`` records the funnel counts, rejections
  by reason, the accepted and rejected Parquet artifacts, the held-out suite version it was checked
  against and the new environment version; causation = the environment version it widened and the
  seed evals. Crash between the two appends: the re-run excludes its own batch's tasks from the
  dedup reference, recomputes the same accepted set, finds the env already holding it (no new
  version) and records the event.

Not guaranteed: that a mutated request reads naturally (values are swapped in place); that a
string drawn from the pool fits every nuance of the request ("Paris" where the seed said "Berlin's
Mitte"); detection of paraphrases with little word overlap unless the semantic check is enabled.
"""

from __future__ import annotations

import copy
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.contamination import (
    find_contamination,
    protected_texts,
    request_text,
    synthetic_batches,
    synthetic_tasks,
)
from flywheel.dedup import (
    NearDupIndex,
    SemanticIndex,
    _canon_number,
    normalize_text,
    tokens,
)
from flywheel.store import EventStore, NewEvent
from flywheel.vocab.ids import canonical_json, json_id
from flywheel.vocab.messages import last_index, request_content_text
from flywheel.vocab.tools import function_of, tool_name

__all__ = [
    "GENERATORS",
    "LIMITS",
    "Candidate",
    "Generator",
    "GenContext",
    "Rejection",
    "SynthSummary",
    "batch_id",
    "decontaminate",
    "dedup_candidates",
    "generate_candidates",
    "make_generators",
    "run_synth",
    "seed_tasks",
    "synth_task_id",
    "validate_candidates",
    "check_solvable",
    "answer_key",
    "tool_key",
]

SYNTH_VERSION = 1

#: Bounds of the GX suite and the per-task checks.
LIMITS = {"max_messages": 64, "max_request_chars": 8000, "max_tools": 32, "max_calls": 8}

FUNNEL = ("generated", "valid", "solvable", "unique", "uncontaminated", "accepted")

Progress = Callable[[str, int, int], None]


# ================================================================================ helpers


def tool_key(task: dict) -> str:
    """Sorted names of the offered tools: a different tool menu is a different task."""
    return ",".join(sorted(tool_name(t) for t in (task.get("prompt") or {}).get("tools") or []))


def _canon_value(v: Any) -> Any:
    from flywheel.verifiers.matching import standardize_string

    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int | float):
        return float(v) if not float(v).is_integer() else int(v)
    if isinstance(v, str):
        return standardize_string(v)
    if isinstance(v, list):
        return [_canon_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _canon_value(x) for k, x in sorted(v.items())}
    return v


def answer_key(task: dict) -> str | None:
    """Canonical expected answer: the reference calls with strings standardised as the verifier
    compares them (BFCL's ``standardize_string``), numbers as values, calls in sorted order; or the
    normalised content. ``None`` without a reference."""
    ref = task.get("reference")
    if not isinstance(ref, dict):
        return None
    if isinstance(ref.get("tool_calls"), list):
        calls = sorted(canonical_json({"n": c.get("name"), "a": _canon_value(c.get("arguments") or {})})
                       for c in ref["tool_calls"])
        return canonical_json(calls)
    if ref.get("content") is not None:
        return normalize_text(str(ref["content"]))
    return None


def synth_task_id(task: dict) -> str:
    """``synth:<16 hex>``: a hash of what the model sees and how it is graded (not the metadata)."""
    return "synth:" + json_id({k: task.get(k) for k in ("prompt", "verifier", "harness", "tool_env", "reference")})


def _is_one_of(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("one_of"), list)


# ================================================================================ seeds
def seed_tasks(tasks: Sequence[dict]) -> list[dict]:
    """Eval tasks of a training environment that generators may widen: ``eval:`` ids, the train
    split, single-turn, deterministic, with a reference answer. Sorted by task id."""
    out = []
    for t in tasks:
        meta = t.get("metadata") or {}
        if not str(t.get("task_id", "")).startswith("eval:"):
            continue
        if meta.get("split") not in (None, "train") or t.get("harness") != "single_turn":
            continue
        if meta.get("deterministic") is False or not isinstance(t.get("reference"), dict):
            continue
        out.append(t)
    return sorted(out, key=lambda t: t["task_id"])


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


# ================================================================================ candidates
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


@dataclass(frozen=True)
class Rejection:
    task_id: str
    seed_task: str
    generator: str
    stage: str  # the funnel stage it failed: valid | solvable | unique | uncontaminated | difficulty
    reason_kind: str  # invalid | unsolvable | duplicate | near_duplicate | semantic_duplicate | contaminated | too_easy | too_hard
    reason: str
    matched: str | None = None
    similarity: float | None = None


@dataclass
class GenContext:
    """What generators may look at: every seed (for partners), the tool pool and the value pool
    (both from training seeds only), and the policy (paraphrase)."""

    seeds: list[dict]
    tool_pool: dict[str, dict]
    value_pool: dict[str, list[Any]]
    policy: Any = None
    seed: int = 0
    idf: dict[str, float] = field(default_factory=dict)


def build_context(seeds: list[dict], *, policy: Any = None, seed: int = 0) -> GenContext:
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
    from flywheel.split import request_hash, request_key

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


# -------------------------------------------------------------------------------- mutate
_NUM_RE = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")
_DATE_RE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_TIME_RE = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")

#: Fallback vocabularies by parameter-name hint, used when no training seed has a value for a
#: parameter of that name. Small on purpose: plausible, not exhaustive.
VOCAB: dict[str, list[str]] = {
    "city": ["Amsterdam", "Austin", "Barcelona", "Berlin", "Boston", "Cairo", "Chicago", "Denver", "Dublin",
             "Istanbul", "Lagos", "Lima", "Lisbon", "London", "Madrid", "Melbourne", "Miami", "Mumbai", "Nairobi",
             "Oslo", "Paris", "Porto", "Prague", "Rome", "Seattle", "Seoul", "Sydney", "Tokyo", "Toronto", "Vienna"],
    "country": ["Argentina", "Australia", "Brazil", "Canada", "Chile", "Egypt", "France", "Germany", "India",
                "Italy", "Japan", "Kenya", "Mexico", "Norway", "Peru", "Portugal", "Spain", "Sweden"],
    "person": ["Alice Martin", "Carlos Diaz", "Chen Wei", "Fatima Khan", "John Smith", "Maria Rossi",
               "Olga Petrova", "Priya Patel", "Tom Baker", "Yuki Tanaka"],
    "company": ["Acme Corp", "Apple", "Globex", "Microsoft", "Netflix", "Nvidia", "Tesla", "Umbrella Inc"],
    "language": ["English", "French", "German", "Italian", "Japanese", "Portuguese", "Spanish"],
    "color": ["black", "blue", "green", "orange", "purple", "red", "white", "yellow"],
    "currency": ["USD", "EUR", "GBP", "JPY", "CHF", "CAD"],
}
_HINTS = [
    (re.compile(r"city|town|location|place|destination|origin|venue|from_|to_|departure|arrival"), "city"),
    (re.compile(r"country|nation"), "country"),
    (re.compile(r"company|brand|organi[sz]ation|firm|stock"), "company"),
    (re.compile(r"language|lang"), "language"),
    (re.compile(r"colou?r"), "color"),
    (re.compile(r"currency"), "currency"),
    (re.compile(r"(^|_)(name|person|author|artist|player|user|customer|patient|employee)"), "person"),
]


def _locate_number(text: str, value: int | float) -> list[re.Match[str]]:
    want = _canon_number(repr(value) if isinstance(value, float) else str(value))
    return [m for m in _NUM_RE.finditer(text) if _canon_number(m.group(0)) == want]


def _locate_string(text: str, value: str) -> list[re.Match[str]]:
    if len(value) < 2:
        return []
    return list(re.finditer(r"(?<!\w)" + re.escape(value) + r"(?!\w)", text, flags=re.IGNORECASE))


def _decimals(s: str) -> int:
    s = s.replace(",", "")
    return len(s.split(".", 1)[1]) if "." in s else 0


def _render_number(value: float | int, like: str) -> str:
    """``value`` written in the style of the span ``like`` (thousands separators, decimals)."""
    d = _decimals(like)
    body = f"{abs(value):,.{d}f}" if "," in like else f"{abs(value):.{d}f}"
    sign = "-" if value < 0 else ("+" if like.startswith("+") else "")
    return sign + body


def _new_number(v: int | float, schema: dict, span: str, rng: random.Random) -> tuple[int | float, str] | None:
    """A new value for the number ``v`` stated as ``span``: inside the schema's bounds, else within
    the original's order of magnitude (half to double, at least 1..10 for integers), same sign, same
    decimals as written. Returns (value, its text in the span's style) or ``None``."""
    integer = schema.get("type") == "integer" or isinstance(v, int)
    d = _decimals(span)
    mag = abs(float(v))
    if integer:
        lo, hi = max(1.0, mag // 2), max(10.0, mag * 2)
    else:
        lo, hi = (mag / 2, mag * 2) if mag > 0 else (0.0, 1.0)
    if v < 0:
        lo, hi = -hi, -lo
    if "minimum" in schema:
        lo = max(lo, float(schema["minimum"]))
    if "exclusiveMinimum" in schema:
        lo = max(lo, float(schema["exclusiveMinimum"]) + (1 if integer else 10 ** -max(d, 1)))
    if "maximum" in schema:
        hi = min(hi, float(schema["maximum"]))
    if "exclusiveMaximum" in schema:
        hi = min(hi, float(schema["exclusiveMaximum"]) - (1 if integer else 10 ** -max(d, 1)))
    for _ in range(20):
        if integer:
            a, b = math.ceil(lo), math.floor(hi)
            if a > b:
                return None
            new: int | float = rng.randint(a, b)
        else:
            if lo > hi:
                return None
            # As many decimals as the request wrote (a whole number written "2" stays whole).
            new = float(round(rng.uniform(lo, hi), d))
        text = _render_number(new, span)
        if new != v and lo <= new <= hi:
            return new, text
    return None


def _new_string(param: str, v: str, schema: dict, text: str, rng: random.Random, ctx: GenContext,
                taken: set[str]) -> str | None:
    def ok(c: str) -> bool:
        return (
            normalize_text(c) != normalize_text(v)
            and normalize_text(c) not in taken
            and not _locate_string(text, c)
            and (not schema.get("maxLength") or len(c) <= schema["maxLength"])
            and (not schema.get("minLength") or len(c) >= schema["minLength"])
        )

    if isinstance(schema.get("enum"), list):
        opts = [e for e in schema["enum"] if isinstance(e, str) and ok(e)]
        return rng.choice(opts) if opts else None
    m = _DATE_RE.match(v)
    if m:
        import datetime as dt

        base = dt.date(int(m[1]), int(m[2]), int(m[3])) if 1 <= int(m[2]) <= 12 else None
        if base is None:
            return None
        for _ in range(10):
            c = (base + dt.timedelta(days=rng.randint(-400, 400))).isoformat()
            if ok(c):
                return c
        return None
    m = _TIME_RE.match(v)
    if m:
        width = len(m[1])
        for _ in range(10):
            c = f"{rng.randint(0, 23):0{width}d}:{rng.choice(['00', '15', '30', '45'])}"
            if ok(c):
                return c
        return None
    if schema.get("format") or schema.get("pattern"):
        return None  # an email, a URL, a pattern: no safe generic rewrite
    pool = [c for c in ctx.value_pool.get(param.lower(), []) if ok(c)]
    if not pool:
        for rx, cat in _HINTS:
            if rx.search(param.lower()):
                pool = [c for c in VOCAB[cat] if ok(c)]
                break
    return rng.choice(pool) if pool else None


def _schema_of(tools: list[dict], call_name: str, param: str) -> dict | None:
    for t in tools:
        fn = function_of(t) or {}
        if fn.get("name") == call_name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            s = props.get(param)
            return s if isinstance(s, dict) else None
    return None


def _mutation_plan(seed: dict) -> list[dict]:
    """Arguments of the reference that the request states exactly once, unambiguously."""
    msgs = seed["prompt"]["messages"]
    ui = last_index(msgs, "user")
    if ui is None:
        return []
    text = request_content_text(msgs[ui].get("content"))
    calls = seed["reference"]["tool_calls"]
    # How often each canonical value is used across all arguments: shared values are ambiguous.
    usage = Counter(canonical_json(_canon_value(v)) for c in calls for v in (c.get("arguments") or {}).values())
    plan = []
    for ci, c in enumerate(calls):
        for p, v in (c.get("arguments") or {}).items():
            if usage[canonical_json(_canon_value(v))] != 1:
                continue
            schema = _schema_of(seed["prompt"]["tools"], c["name"], p)
            if schema is None:
                continue
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, int | float):
                spans = _locate_number(text, v)
            elif isinstance(v, str):
                spans = _locate_string(text, v)
            else:
                continue
            if len(spans) == 1:
                plan.append({"call": ci, "param": p, "value": v, "schema": schema, "span": spans[0].span()})
    return plan


def _set_expected(spec: Any, new: Any) -> Any:
    if _is_one_of(spec):
        return {**spec, "one_of": [new]}
    return new


def mutate_task(seed: dict, rng: random.Random, ctx: GenContext, *, max_args: int,
                params: dict) -> Candidate | None:
    """One schema-driven mutation of ``seed`` (``None`` when nothing can be mutated)."""
    plan = _mutation_plan(seed)
    if not plan:
        return None
    msgs = copy.deepcopy(seed["prompt"]["messages"])
    ui = last_index(msgs, "user")
    text = request_content_text(msgs[ui].get("content"))
    rng.shuffle(plan)
    chosen = plan[: rng.randint(1, min(max_args, len(plan)))]
    taken = {normalize_text(str(p["value"])) for p in plan}
    edits: list[tuple[tuple[int, int], str, dict, Any]] = []
    for p in chosen:
        v, schema, (a, b) = p["value"], p["schema"], p["span"]
        span = text[a:b]
        if isinstance(v, int | float):
            if isinstance(schema.get("enum"), list):
                opts = [e for e in schema["enum"] if isinstance(e, int | float) and not isinstance(e, bool) and e != v]
                if not opts:
                    continue
                new: Any = rng.choice(opts)
                new_text = _render_number(new, span)
            else:
                got = _new_number(v, schema, span, rng)
                if got is None:
                    continue
                new, new_text = got
        else:
            new = _new_string(p["param"], v, schema, text, rng, ctx, taken)
            if new is None:
                continue
            new_text = new
            taken.add(normalize_text(new))
        edits.append(((a, b), new_text, p, new))
    if not edits:
        return None
    calls = copy.deepcopy(seed["reference"]["tool_calls"])
    expected = copy.deepcopy(seed["verifier"]["expected"])
    for (a, b), new_text, p, new in sorted(edits, key=lambda e: -e[0][0]):
        text = text[:a] + new_text + text[b:]
        calls[p["call"]]["arguments"][p["param"]] = new
        exp_args = expected[p["call"]].setdefault("arguments", {})
        exp_args[p["param"]] = _set_expected(exp_args.get(p["param"], new), new)
    msgs[ui] = {**msgs[ui], "content": text}
    detail = {"changed": [{"call": calls[p["call"]]["name"], "param": p["param"], "from": p["value"], "to": new}
                          for _, _, p, new in edits]}
    task = _new_task(seed, messages=msgs, tools=copy.deepcopy(seed["prompt"]["tools"]), expected=expected,
                     reference={"tool_calls": calls}, generator=params.get("_name", "mutate"), params=params,
                     detail=detail, seeds=[seed["task_id"]])
    return Candidate(task, task["metadata"]["generator"], [seed["task_id"]])


class MutateGenerator(Generator):
    name = "mutate"

    def __init__(self, max_args: int = 2):
        super().__init__(max_args=max_args)

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        return mutate_task(seed, rng, ctx, max_args=self.params["max_args"], params=self.params)


# -------------------------------------------------------------------------------- distractor
def _words(tool: dict) -> set[str]:
    fn = function_of(tool) or {}
    return set(tokens(str(fn.get("name", "")).replace(".", " ").replace("_", " ") + " " + str(fn.get("description", ""))))


class DistractorGenerator(Generator):
    name = "distractor"

    def __init__(self, max_distractors: int = 3, candidates: int = 8):
        super().__init__(max_distractors=max_distractors, candidates=candidates)

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        tools = seed["prompt"]["tools"]
        names = {tool_name(t) for t in tools}
        # BFCL matching maps "a_b" to tool "a.b" when unambiguous: a distractor must not create a
        # second spelling of a task tool's name.
        spellings = names | {n.replace(".", "_") for n in names}
        own = set().union(*(_words(t) for t in tools)) if tools else set()
        scored = []
        for name, t in ctx.tool_pool.items():
            if name in spellings or name.replace(".", "_") in spellings:
                continue
            w = _words(t)
            # IDF-weighted Jaccard of the docs' words: shared rare words make a plausible confusion.
            inter = sum(ctx.idf.get(x, 1.0) for x in w & own)
            union = sum(ctx.idf.get(x, 1.0) for x in w | own)
            scored.append((-(inter / union if union else 0.0), name))
        scored.sort()
        top = [n for _, n in scored[: self.params["candidates"]]]
        if not top:
            return None
        n = rng.randint(1, min(self.params["max_distractors"], len(top)))
        picked = sorted(rng.sample(top, n))
        new_tools = copy.deepcopy(list(tools))
        for name in picked:
            new_tools.insert(rng.randint(0, len(new_tools)), copy.deepcopy(ctx.tool_pool[name]))
        if len(new_tools) > LIMITS["max_tools"]:
            return None
        task = _new_task(seed, messages=copy.deepcopy(seed["prompt"]["messages"]), tools=new_tools,
                         expected=copy.deepcopy(seed["verifier"]["expected"]),
                         reference=copy.deepcopy(seed["reference"]), generator=self.name, params=self.params,
                         detail={"distractors": picked}, seeds=[seed["task_id"]])
        return Candidate(task, self.name, [seed["task_id"]])


# -------------------------------------------------------------------------------- parallel
_JOINS = ("{a} Also, {b}", "{a} In addition, {b}", "{a} Then {b}", "{a}\n{b}")


def _join(a: str, b: str, template: str) -> str:
    a = a.strip()
    if a and a[-1] not in ".?!":
        a += "."
    b = b.strip()
    if template != "{a}\n{b}" and len(b) > 1 and b[0].isupper() and b[1].islower():
        b = b[0].lower() + b[1:]
    return template.format(a=a, b=b)


class ParallelGenerator(Generator):
    name = "parallel"

    def __init__(self, max_calls: int = 4, self_pair_rate: float = 0.5):
        super().__init__(max_calls=max_calls, self_pair_rate=self_pair_rate)

    def _partner(self, seed: dict, rng: random.Random, ctx: GenContext) -> tuple[dict, str] | None:
        if rng.random() < self.params["self_pair_rate"]:
            m = mutate_task(seed, rng, ctx, max_args=2, params={"_name": "mutate", "max_args": 2})
            if m is not None:
                return m.task, "self"
        others = [s for s in ctx.seeds if s["task_id"] != seed["task_id"] and _tool_call_seed(s)]
        rng.shuffle(others)
        mine = {tool_name(t): canonical_json(t) for t in seed["prompt"]["tools"]}
        sys_a = [m for m in seed["prompt"]["messages"] if m.get("role") == "system"]
        for o in others[:16]:
            theirs = {tool_name(t): canonical_json(t) for t in o["prompt"]["tools"]}
            if any(n in mine and mine[n] != s for n, s in theirs.items()):
                continue  # same name, different spec: cannot offer both
            sys_b = [m for m in o["prompt"]["messages"] if m.get("role") == "system"]
            if sys_b and canonical_json(sys_b) != canonical_json(sys_a):
                continue
            if [m.get("role") for m in o["prompt"]["messages"] if m.get("role") != "system"] != ["user"]:
                continue
            return o, "other"
        return None

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        if [m.get("role") for m in seed["prompt"]["messages"] if m.get("role") != "system"] != ["user"]:
            return None  # multi-turn history: joining two conversations is not a parallel request
        got = self._partner(seed, rng, ctx)
        if got is None:
            return None
        other, kind = got
        n_calls = len(seed["reference"]["tool_calls"]) + len(other["reference"]["tool_calls"])
        if n_calls > self.params["max_calls"]:
            return None
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        ui = last_index(msgs, "user")
        b_text = request_content_text(other["prompt"]["messages"][last_index(other["prompt"]["messages"], "user")].get("content"))
        template = rng.choice(_JOINS)
        msgs[ui] = {**msgs[ui], "content": _join(request_content_text(msgs[ui].get("content")), b_text, template)}
        tools = copy.deepcopy(list(seed["prompt"]["tools"]))
        have = {tool_name(t) for t in tools}
        for t in other["prompt"]["tools"]:
            if tool_name(t) not in have:
                tools.append(copy.deepcopy(t))
                have.add(tool_name(t))
        expected = copy.deepcopy(seed["verifier"]["expected"]) + copy.deepcopy(other["verifier"]["expected"])
        reference = {"tool_calls": copy.deepcopy(seed["reference"]["tool_calls"]) + copy.deepcopy(other["reference"]["tool_calls"])}
        partner_seed = other["metadata"].get("seed_task", other["task_id"])
        seeds = list(dict.fromkeys([seed["task_id"], partner_seed]))
        task = _new_task(seed, messages=msgs, tools=tools, expected=expected, reference=reference,
                         generator=self.name, params=self.params,
                         detail={"partner": partner_seed, "partner_kind": kind, "join": template,
                                 **({"partner_detail": other["metadata"].get("synth_detail")} if kind == "self" else {})},
                         seeds=seeds)
        task["verifier"]["order_sensitive"] = False
        return Candidate(task, self.name, seeds)


# -------------------------------------------------------------------------------- paraphrase
PARAPHRASE_SYSTEM = (
    "You rewrite user requests in different words. Keep the meaning and keep every name, number, date, "
    "code and quoted value exactly as written. Reply with the rewritten request only."
)


def _anchors(seed: dict, text: str) -> list[str]:
    """Values the request states that a paraphrase must keep: reference argument values found in
    the text, else every number in it."""
    out = []
    for c in (seed.get("reference") or {}).get("tool_calls") or []:
        for v in (c.get("arguments") or {}).values():
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, int | float) and _locate_number(text, v):
                out.append(_canon_number(repr(v) if isinstance(v, float) else str(v)))
            elif isinstance(v, str) and _locate_string(text, v):
                out.append(v)
    if not out:
        out = [_canon_number(m.group(0)) for m in _NUM_RE.finditer(text)]
    return list(dict.fromkeys(out))


def _clean_paraphrase(s: str) -> str:
    s = s.strip()
    s = re.sub(r"^(?:rewritten request|rewritten|paraphrase|request)\s*:\s*", "", s, flags=re.IGNORECASE)
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
        s = s[1:-1].strip()
    return s


class ParaphraseGenerator(Generator):
    name = "paraphrase"

    def __init__(self, temperature: float = 0.7, max_new_tokens: int = 160):
        super().__init__(temperature=temperature, max_new_tokens=max_new_tokens)

    def applicable(self, seed: dict) -> bool:
        kind = (seed.get("verifier") or {}).get("kind")
        return kind in ("tool_call", "exact", "numeric", "regex", "json_schema") and (
            kind != "tool_call" or _tool_call_seed(seed)
        )

    def generate(self, items: list[tuple[dict, int, random.Random]], ctx: GenContext) -> list[Candidate | None]:
        from flywheel.policy.base import SamplingParams

        if ctx.policy is None:
            raise ValueError("the paraphrase generator needs a policy (pass policy= to run_synth, or drop "
                             "'paraphrase' from [synth] generators)")
        todo = [(i, s, k, rng) for i, (s, k, rng) in enumerate(items) if self.applicable(s)]
        out: list[Candidate | None] = [None] * len(items)
        if not todo:
            return out
        prompts = []
        for _, s, k, _ in todo:
            text = request_content_text(s["prompt"]["messages"][last_index(s["prompt"]["messages"], "user")].get("content"))
            prompts.append([{"role": "system", "content": PARAPHRASE_SYSTEM},
                            {"role": "user", "content": f"Rewrite this request (variant {k + 1}):\n{text}"}])
        # One seed per call keeps samples reproducible whatever the batch composition.
        seed_val = int(json_id([ctx.seed, self.params], 8), 16)
        params = SamplingParams(n=1, temperature=self.params["temperature"], max_new_tokens=self.params["max_new_tokens"],
                                seed=seed_val)
        samples = ctx.policy.generate(prompts, params)
        for (i, s, _k, _), sample_list in zip(todo, samples, strict=True):
            msgs = copy.deepcopy(s["prompt"]["messages"])
            ui = last_index(msgs, "user")
            original = request_content_text(msgs[ui].get("content"))
            new = _clean_paraphrase(sample_list[0].text if sample_list else "")
            problems = []
            if not new:
                problems.append("paraphrase is empty")
            elif not 0.3 <= len(new) / max(1, len(original)) <= 3.0:
                problems.append(f"paraphrase length {len(new)} is out of bounds for a {len(original)}-char request")
            else:
                lost = [a for a in _anchors(s, original)
                        if not (_locate_number(new, float(a) if "." in a else int(a)) if re.fullmatch(r"-?\d+(\.\d+)?", a)
                                else _locate_string(new, a))]
                if lost:
                    problems.append(f"paraphrase lost value(s) {lost[:3]}")
            msgs[ui] = {**msgs[ui], "content": new or original}
            task = _new_task(s, messages=msgs, tools=copy.deepcopy(s["prompt"].get("tools") or []),
                             expected=copy.deepcopy((s["verifier"] or {}).get("expected")),
                             reference=copy.deepcopy(s["reference"]), generator=self.name, params=self.params,
                             detail={"policy": f"{getattr(ctx.policy, 'name', '?')}@{getattr(ctx.policy, 'version', '?')}"},
                             seeds=[s["task_id"]])
            out[i] = Candidate(task, self.name, [s["task_id"]], problems)
        return out


GENERATORS: dict[str, type[Generator]] = {
    "mutate": MutateGenerator,
    "distractor": DistractorGenerator,
    "parallel": ParallelGenerator,
    "paraphrase": ParaphraseGenerator,
}


def make_generators(names: Sequence[str], params: dict[str, dict] | None = None) -> list[Generator]:
    """Instantiate generators by name (``params`` per name override the defaults)."""
    out = []
    for n in names:
        if n not in GENERATORS:
            raise ValueError(f"unknown synth generator {n!r}; known: {sorted(GENERATORS)}")
        out.append(GENERATORS[n](**(params or {}).get(n, {})))
    return out


def generate_candidates(seeds: list[dict], generators: list[Generator], per_seed: int, *, seed: int = 0,
                        policy: Any = None, context_seeds: list[dict] | None = None,
                        progress: Progress | None = None) -> tuple[list[Candidate], int]:
    """Variants of every seed: variant ``k`` of a seed comes from ``generators[k % len]``.

    Returns (candidates in a deterministic order, number of slots no generator could fill).
    Deterministic: the same seeds, generators, ``per_seed`` and ``seed`` give the same candidates
    (paraphrase: with a policy that is deterministic under its sampling seed).
    """
    ctx = build_context(context_seeds if context_seeds is not None else seeds, policy=policy, seed=seed)
    per_gen: dict[int, list[tuple[dict, int, random.Random]]] = {i: [] for i in range(len(generators))}
    order: list[tuple[int, int]] = []
    for s in seeds:
        content = json_id({k: s.get(k) for k in ("prompt", "verifier", "reference")})
        for k in range(per_seed):
            gi = k % len(generators)
            g = generators[gi]
            rng = random.Random(int(json_id([seed, g.name, g.params, s["task_id"], content, k]), 16))
            order.append((gi, len(per_gen[gi])))
            per_gen[gi].append((s, k, rng))
    results: dict[int, list[Candidate | None]] = {}
    done = 0
    for gi, g in enumerate(generators):
        results[gi] = g.generate(per_gen[gi], ctx) if per_gen[gi] else []
        done += len(per_gen[gi])
        if progress:
            progress("generate", done, len(order))
    out, na = [], 0
    for gi, j in order:
        c = results[gi][j]
        if c is None:
            na += 1
        else:
            out.append(c)
    return out, na


# ================================================================================ validation
def _reference_answer(task: dict) -> dict:
    from flywheel.policy.format import render_answer
    from flywheel.verifiers import ToolCall

    ref = task["reference"]
    if isinstance(ref.get("tool_calls"), list):
        return {"role": "assistant", "content": render_answer([ToolCall(c["name"], c.get("arguments") or {})
                                                               for c in ref["tool_calls"]])}
    return {"role": "assistant", "content": render_answer(content=str(ref.get("content", "")))}


def _per_task_problems(c: Candidate) -> list[str]:
    from flywheel.schemas.gx_synth import tools_schema_valid
    from flywheel.tasks import TaskError, validate_task
    from flywheel.verifiers import SpecError, validate_spec

    problems = list(c.problems)
    t = c.task
    try:
        validate_task(t)
    except TaskError as e:
        problems.append(f"task record: {e}")
        return problems
    try:
        validate_spec(t["verifier"])
    except SpecError as e:
        problems.append(f"verifier spec: {e}")
    ok, why = tools_schema_valid(t["prompt"].get("tools") or [])
    if not ok:
        problems.append(why or "invalid tool schema")
    ref = t.get("reference")
    if not isinstance(ref, dict) or not (ref.get("tool_calls") or str(ref.get("content") or "").strip()):
        problems.append("no reference answer")
    else:
        try:
            _reference_answer(t)
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"reference cannot be rendered: {e}")
    if synth_task_id(t) != t["task_id"]:
        problems.append("task_id is not the content hash of the task")
    return problems


def validate_candidates(cands: list[Candidate], generator_names: Sequence[str]) -> tuple[list[Candidate], list[Rejection], dict]:
    """Per-task checks plus the GX suite over the batch. Returns (valid, rejections, GX summary)."""
    from flywheel.schemas.gx_synth import candidate_features, validate_synth_batch

    rows = [candidate_features(c.task) for c in cands]
    values = {"generators": sorted(set(generator_names)), **LIMITS}
    success, per_row, report = validate_synth_batch(rows, values)
    valid, rejected = [], []
    for i, c in enumerate(cands):
        problems = _per_task_problems(c)
        problems += [f"GX {x}" for x in per_row.get(i, [])]
        if problems:
            rejected.append(_reject(c, "valid", "invalid", "invalid: " + "; ".join(problems)))
        else:
            valid.append(c)
    return valid, rejected, {"success": success, "failed_expectations": report}


def _reject(c: Candidate, stage: str, kind: str, reason: str, matched: str | None = None,
            similarity: float | None = None) -> Rejection:
    return Rejection(c.task_id, c.seed_ids[0] if c.seed_ids else "", c.generator, stage, kind, reason, matched,
                     None if similarity is None else round(float(similarity), 4))


def check_solvable(task: dict, context: Any = None) -> tuple[bool, str]:
    """(passed, why): the reference, rendered as the policy writes answers, must pass the task's
    own verifier. An infrastructure error is not a pass."""
    from flywheel.envs.harness import verify_task

    answer = _reference_answer(task)
    v = verify_task(task, [*task["prompt"]["messages"], answer], context)
    if v.infra_error:
        return False, f"unverifiable: verifier infrastructure error ({v.infra_error})"
    if not v.passed:
        comps = ", ".join(f"{k}={x:.2f}" for k, x in sorted(v.components.items()))
        return False, f"reference fails its verifier ({comps})"
    return True, "ok"


# ================================================================================ dedup / decontamination
def dedup_candidates(cands: list[Candidate], reference_tasks: list[dict], *, threshold: float,
                     semantic: SemanticIndex | None = None) -> tuple[list[Candidate], list[Rejection]]:
    """Drop exact, near and (optionally) semantic duplicates of ``reference_tasks`` and of earlier
    candidates in the list (see the module docstring for the definitions). Order-preserving."""
    from flywheel.dedup import exact_key

    by_exact: dict[str, str] = {}
    info: dict[str, tuple[str, str | None]] = {}  # task id -> (tool key, answer key)
    near = NearDupIndex(threshold)
    ref_ids = [t["task_id"] for t in reference_tasks]
    ref_texts = [request_text(t) for t in reference_tasks]
    for t, text in zip(reference_tasks, ref_texts, strict=True):
        by_exact.setdefault(exact_key(text) + "|" + tool_key(t), t["task_id"])
        info[t["task_id"]] = (tool_key(t), answer_key(t))
    if ref_ids:
        near.add(ref_ids, ref_texts)
        if semantic is not None:
            semantic.add(ref_ids, ref_texts)
    kept, rejected = [], []
    texts = [request_text(c.task) for c in cands]
    # Near matches against the reference set in one vectorised query; matches against earlier
    # candidates of this batch come from a second index that grows as candidates are kept.
    ref_matches = near.query(texts) if ref_ids else [[] for _ in cands]
    batch_near = NearDupIndex(threshold)
    for i, c in enumerate(cands):
        t = c.task
        tk, ak = tool_key(t), answer_key(t)
        ek = exact_key(texts[i]) + "|" + tk
        if ek in by_exact:
            rejected.append(_reject(c, "unique", "duplicate", f"duplicate-of {by_exact[ek]}", by_exact[ek], 1.0))
            continue
        matches = list(ref_matches[i])
        if len(batch_near):
            matches += batch_near.query([texts[i]])[0]
        hit = next((m for m in sorted(matches, key=lambda m: -m.jaccard)
                    if info.get(str(m.key)) == (tk, ak)), None)
        if hit is not None:
            rejected.append(_reject(c, "unique", "near_duplicate",
                                    f"near-duplicate-of {hit.key} (jaccard {hit.jaccard:.2f})", str(hit.key), hit.jaccard))
            continue
        if semantic is not None and len(semantic.keys):
            sem = next((m for m in semantic.query([texts[i]])[0] if info.get(str(m.key)) == (tk, ak)), None)
            if sem is not None:
                rejected.append(_reject(c, "unique", "semantic_duplicate",
                                        f"semantic-duplicate-of {sem.key} (cosine {sem.jaccard:.3f})", str(sem.key),
                                        sem.jaccard))
                continue
        kept.append(c)
        by_exact[ek] = t["task_id"]
        info[t["task_id"]] = (tk, ak)
        batch_near.add([t["task_id"]], [texts[i]])
        if semantic is not None:
            semantic.add([t["task_id"]], [texts[i]])
    return kept, rejected


def decontaminate(cands: list[Candidate], protected: list[tuple[str, str]], *, jaccard_threshold: float,
                  ngram: int, semantic: SemanticIndex | None = None) -> tuple[list[Candidate], list[Rejection]]:
    """Drop candidates whose request is an exact or near duplicate of, shares a long n-gram with,
    or (optionally) is semantically close to any protected ``(id, request text)``
    (:func:`flywheel.contamination.find_contamination`)."""
    found = find_contamination([c.task for c in cands], protected, jaccard_threshold=jaccard_threshold,
                               ngram=ngram, semantic=semantic)
    kept, rejected = [], []
    for c in cands:
        hit = found.get(c.task_id)
        if hit is None:
            kept.append(c)
        else:
            rejected.append(_reject(c, "uncontaminated", "contaminated", hit.reason, hit.matched, hit.similarity))
    return kept, rejected


# ================================================================================ difficulty
def measure_difficulty(cands: list[Candidate], policy: Any, k: int, *, max_new_tokens: int, temperature: float,
                       seed: int, context: Any = None) -> None:
    """Set ``metadata.difficulty`` on every candidate from ``k`` policy samples."""
    from flywheel.envs.harness import verify_task
    from flywheel.policy.base import SamplingParams

    if not cands:
        return
    params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    samples = policy.generate([c.task["prompt"]["messages"] for c in cands], params,
                              tools=[c.task["prompt"].get("tools") or [] for c in cands])
    pol = f"{getattr(policy, 'name', '?')}@{getattr(policy, 'version', '?')}"
    for c, group in zip(cands, samples, strict=True):
        passed = 0
        scored = 0
        for s in group:
            v = verify_task(c.task, [*c.task["prompt"]["messages"], {"role": "assistant", "content": s.text}], context)
            if v.infra_error:
                continue
            scored += 1
            passed += int(v.passed)
        rate = passed / scored if scored else None
        c.task["metadata"]["difficulty"] = {
            "pass_rate": rate, "k": k, "scored": scored, "policy": pol,
            "zero_advantage": rate in (0.0, 1.0),
        }


# ================================================================================ the stage
@dataclass
class SynthSummary:
    """What one :func:`run_synth` did."""

    batch: str
    env: str | None
    widened_env: str | None
    counts: dict[str, int]
    rejected_by_reason: dict[str, int]
    by_generator: dict[str, dict[str, int]] = field(default_factory=dict)
    not_applicable: int = 0
    seeds: int = 0
    accepted_artifact: dict | None = None
    rejected_artifact: dict | None = None
    decontaminated_against: list[str] = field(default_factory=list)
    gx: dict = field(default_factory=dict)
    new: bool = True
    events_appended: int = 0
    seconds: float = 0.0
    accepted_ids: list[str] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "env": self.env,
            "widened_env": self.widened_env,
            "seeds": self.seeds,
            "funnel": {k: self.counts.get(k, 0) for k in FUNNEL},
            "rejected_by_reason": dict(self.rejected_by_reason),
            "by_generator": self.by_generator,
            "not_applicable": self.not_applicable,
            "accepted_artifact": self.accepted_artifact,
            "rejected_artifact": self.rejected_artifact,
            "decontaminated_against": list(self.decontaminated_against),
            "gx": self.gx,
            "new": self.new,
            "events_appended": self.events_appended,
            "seconds": round(self.seconds, 3),
        }


def batch_id(*, env_name: str, suites: Sequence[str], seeds: Sequence[dict], generators: Sequence[Generator],
             per_seed: int, seed: int, settings: dict, heldout: str | None, policy: str | None = None) -> str:
    """``synth:b-<16 hex>``; see the module docstring for what it hashes and why."""
    return "synth:b-" + json_id({
        "v": SYNTH_VERSION,
        "env": env_name,
        "suites": sorted(suites),
        "seeds": [[s["task_id"], json_id({k: s.get(k) for k in ("prompt", "verifier", "reference")})] for s in seeds],
        "generators": {g.name: g.params for g in generators},
        "per_seed": per_seed,
        "seed": seed,
        "settings": settings,
        "heldout": heldout,
        "policy": policy,
    })


def reattest_batches(cfg: Any, store: EventStore, artifacts: Any, suite: Any, *,
                     correlation_id: str | None = None) -> dict[str, Any]:
    """Check every recorded batch that was not decontaminated against ``suite`` (a held-out suite
    version that grew since) against it, and record the result as ``synth.batch_rechecked``.

    A batch whose accepted tasks are all clean gets ``suite`` added to its ``decontaminated_against``
    (the gate's decontamination rule reads it); a batch with a contaminated task keeps its list and
    records the pairs (``contaminated``), so a gate on ``suite`` refuses any model trained on it and
    says why. The evals stage keeps new held-out items away from recorded synthetic tasks
    (:func:`flywheel.contamination.contaminated_by_synthetic`), so the second case needs thresholds changed in between.
    """
    ref = str(suite.entity_id)
    protected = protected_texts(store, suite)
    out: dict[str, Any] = {"rechecked": [], "contaminated": {}}
    for ev, tasks in synthetic_batches(store, artifacts):
        bid = ev.stream
        latest = store.read(stream=bid)[-1]
        done = list(latest.payload.get("decontaminated_against") or [])
        if ref in done:
            continue
        cands = [Candidate(task=t, generator=str((t.get("metadata") or {}).get("generator")),
                           seed_ids=[str((t.get("metadata") or {}).get("seed_task"))]) for t in tasks]
        _, rejected = decontaminate(cands, protected, jaccard_threshold=cfg.synth.contamination_jaccard,
                                    ngram=cfg.synth.contamination_ngram)
        pairs = [[r.task_id, r.matched] for r in rejected]
        payload = {**latest.payload, "rechecked_against": ref, "contaminated": pairs,
                   "decontaminated_against": done if pairs else [*done, ref]}
        # No causation: an edge to the held-out suite would put it in the lineage of every model
        # trained on this batch, which is what decontamination forbids.
        store.append(bid, NewEvent("synth.batch_rechecked", payload, []),
                     expected_version=latest.stream_version, correlation_id=correlation_id)
        out["rechecked"].append(bid)
        if pairs:
            out["contaminated"][bid] = pairs[:20]
    return out


def _tables(accepted: list[Candidate], rejections: list[Rejection], by_id: dict[str, Candidate]) -> tuple[Any, Any]:
    import pyarrow as pa

    acc = pa.table({
        "task_id": pa.array([c.task_id for c in accepted], pa.string()),
        "seed_task": pa.array([c.seed_ids[0] for c in accepted], pa.string()),
        "generator": pa.array([c.generator for c in accepted], pa.string()),
        "task_json": pa.array([canonical_json(c.task) for c in accepted], pa.string()),
    })
    rej = pa.table({
        "task_id": pa.array([r.task_id for r in rejections], pa.string()),
        "seed_task": pa.array([r.seed_task for r in rejections], pa.string()),
        "generator": pa.array([r.generator for r in rejections], pa.string()),
        "stage": pa.array([r.stage for r in rejections], pa.string()),
        "reason_kind": pa.array([r.reason_kind for r in rejections], pa.string()),
        "reason": pa.array([r.reason for r in rejections], pa.string()),
        "matched": pa.array([r.matched for r in rejections], pa.string()),
        "similarity": pa.array([r.similarity for r in rejections], pa.float64()),
        "task_json": pa.array([canonical_json(by_id[r.task_id].task) if r.task_id in by_id else None
                               for r in rejections], pa.string()),
    })
    return acc, rej


def run_synth(
    cfg: Any,
    store: EventStore,
    artifacts: Any,
    *,
    env: str = "train",
    per_seed: int | None = None,
    generators: Sequence[str] | None = None,
    policy: Any = None,
    correlation_id: str | None = None,
    progress: Progress | None = None,
    generator_params: dict[str, dict] | None = None,
) -> SynthSummary:
    """Generate, validate, dedup and decontaminate one batch of synthetic tasks from the training
    environment ``env``; add the accepted ones to it as a new version and record the batch.

    Idempotent: the same inputs give the same batch id, and a recorded batch is returned as it was
    (``new=False``) without generating anything or appending an event. Raises ``LookupError`` when
    the environment has no version, ``ValueError`` for an unknown generator or a paraphrase without
    a policy, :class:`flywheel.dedup.SemanticUnavailable` when semantic dedup is on without its package.
    """
    from flywheel.versioning import add_tasks_to_env, load_env, load_suite

    t0 = time.perf_counter()
    scfg = cfg.synth
    per_seed = scfg.per_seed if per_seed is None else int(per_seed)
    names = list(generators if generators is not None else scfg.generators)
    if not names:
        raise ValueError("no synth generators selected")
    gens = make_generators(names, generator_params)
    if "paraphrase" in names and policy is None:
        raise ValueError("the paraphrase generator needs a policy; drop 'paraphrase' from the generators or pass one")
    cur = load_env(store, artifacts, env)
    seeds = seed_tasks(cur.tasks)
    try:
        suite = load_suite(store, artifacts, cfg.cycle.heldout_suite)
    except LookupError:
        suite = None
    heldout_ref = suite.entity_id if suite else None
    if suite is not None:
        # Batches accepted against an older held-out version (carried over in the environment, and in
        # the lineage of models trained on them) are checked against the items added since.
        reattest_batches(cfg, store, artifacts, suite, correlation_id=correlation_id)
    difficulty_on = policy is not None and scfg.difficulty_samples > 0
    policy_id = f"{getattr(policy, 'name', '?')}@{getattr(policy, 'version', '?')}" if policy is not None else None
    settings = {
        "near_dup_jaccard": scfg.near_dup_jaccard,
        "contamination_jaccard": scfg.contamination_jaccard,
        "contamination_ngram": scfg.contamination_ngram,
        "semantic_dedup": scfg.semantic_dedup,
        "semantic_threshold": scfg.semantic_threshold if scfg.semantic_dedup else None,
        "difficulty_samples": scfg.difficulty_samples if difficulty_on else 0,
        "difficulty_drop": scfg.difficulty_drop if difficulty_on else "none",
    }
    uses_policy = difficulty_on or "paraphrase" in names
    bid = batch_id(env_name=cur.name, suites=cur.suites, seeds=seeds, generators=gens, per_seed=per_seed,
                   seed=scfg.seed, settings=settings, heldout=heldout_ref, policy=policy_id if uses_policy else None)
    recorded = store.read(stream=bid, types="synth.batch_accepted")
    if recorded:
        p = recorded[-1].payload
        return SynthSummary(
            batch=bid, env=p.get("env"), widened_env=p.get("widened_env"), counts=dict(p.get("counts") or {}),
            rejected_by_reason=dict(p.get("rejected_by_reason") or {}), by_generator=p.get("by_generator") or {},
            not_applicable=int(p.get("not_applicable") or 0), seeds=len(p.get("seed_tasks") or []),
            accepted_artifact=p.get("accepted_artifact"), rejected_artifact=p.get("rejected_artifact"),
            decontaminated_against=list(p.get("decontaminated_against") or []), gx=p.get("gx") or {}, new=False,
            events_appended=0, seconds=time.perf_counter() - t0,
        )

    # -- generate
    cands, not_applicable = generate_candidates(seeds, gens, per_seed, seed=scfg.seed, policy=policy,
                                                progress=progress)
    for c in cands:
        c.task["metadata"]["synth_batch"] = bid
    by_id = {c.task_id: c for c in cands}
    counts = {"generated": len(cands)}
    rejections: list[Rejection] = []

    # -- valid
    valid, rej, gx = validate_candidates(cands, names)
    rejections += rej
    counts["valid"] = len(valid)
    if progress:
        progress("validate", len(cands), len(cands))

    # -- solvable
    from flywheel.verifiers import VerifyContext

    vctx = VerifyContext(sandbox=cfg.sandbox, judge=cfg.judge)
    solvable = []
    for i, c in enumerate(valid):
        ok, why = check_solvable(c.task, vctx)
        if ok:
            solvable.append(c)
        else:
            rejections.append(_reject(c, "solvable", "unsolvable", f"unsolvable: {why}"))
        if progress and (i % 50 == 49 or i == len(valid) - 1):
            progress("verify", i + 1, len(valid))
    counts["solvable"] = len(solvable)

    # -- unique (against the env, earlier batches and this batch)
    semantic = SemanticIndex(scfg.semantic_threshold) if scfg.semantic_dedup else None
    if semantic is not None:
        from flywheel.dedup import _semantic_model_dir

        _semantic_model_dir()  # fail now, with the install hint, not halfway through
    reference = [t for t in cur.tasks if (t.get("metadata") or {}).get("synth_batch") != bid]
    seen = {t["task_id"] for t in reference}
    for t in synthetic_tasks(store, artifacts, bid):
        if t["task_id"] not in seen:
            reference.append(t)
            seen.add(t["task_id"])
    unique, rej = dedup_candidates(solvable, reference, threshold=scfg.near_dup_jaccard, semantic=semantic)
    rejections += rej
    counts["unique"] = len(unique)
    if progress:
        progress("dedup", len(solvable), len(solvable))

    # -- uncontaminated
    protected = protected_texts(store, suite) if suite else []
    sem2 = SemanticIndex(scfg.semantic_threshold) if scfg.semantic_dedup else None
    clean, rej = decontaminate(unique, protected, jaccard_threshold=scfg.contamination_jaccard,
                               ngram=scfg.contamination_ngram, semantic=sem2)
    rejections += rej
    counts["uncontaminated"] = len(clean)
    if progress:
        progress("decontaminate", len(unique), len(unique))

    # -- difficulty (optional) -> accepted
    accepted = clean
    if difficulty_on:
        measure_difficulty(clean, policy, scfg.difficulty_samples, max_new_tokens=cfg.rollout.max_new_tokens,
                           temperature=cfg.rollout.temperature, seed=scfg.seed, context=vctx)
        accepted = []
        for c in clean:
            rate = c.task["metadata"]["difficulty"]["pass_rate"]
            if rate == 1.0 and scfg.difficulty_drop in ("too_easy", "both"):
                rejections.append(_reject(c, "difficulty", "too_easy",
                                          f"too easy: all {scfg.difficulty_samples} samples pass"))
            elif rate == 0.0 and scfg.difficulty_drop == "both":
                rejections.append(_reject(c, "difficulty", "too_hard",
                                          f"too hard: none of {scfg.difficulty_samples} samples pass"))
            else:
                accepted.append(c)
        if progress:
            progress("difficulty", len(clean), len(clean))
    counts["accepted"] = len(accepted)

    # -- records
    acc_tbl, rej_tbl = _tables(accepted, rejections, by_id)
    acc_ref = artifacts.put_table(acc_tbl)
    rej_ref = artifacts.put_table(rej_tbl)
    new_env = cur.entity_id
    if accepted:
        new_env = add_tasks_to_env(cfg, store, artifacts, cur.name, [c.task for c in accepted],
                                   [bid, cur.entity_id], correlation_id=correlation_id)
    by_gen: dict[str, dict[str, int]] = {}
    for c in cands:
        by_gen.setdefault(c.generator, {"generated": 0, "accepted": 0})["generated"] += 1
    for c in accepted:
        by_gen[c.generator]["accepted"] += 1
    reasons = dict(sorted(Counter(r.reason_kind for r in rejections).items()))
    seed_ids = sorted({s for c in cands for s in c.seed_ids} | {s["task_id"] for s in seeds})
    payload = {
        "entity_id": bid,
        "env_name": cur.name,
        "generators": {g.name: g.params for g in gens},
        "seed": scfg.seed,
        "per_seed": per_seed,
        "settings": settings,
        "counts": {k: counts.get(k, 0) for k in FUNNEL},
        "rejected_by_reason": reasons,
        "by_generator": by_gen,
        "not_applicable": not_applicable,
        "accepted_artifact": acc_ref.to_dict(),
        "rejected_artifact": rej_ref.to_dict(),
        "decontaminated_against": [heldout_ref] if heldout_ref else [],
        "widened_env": cur.entity_id,
        "env": new_env,
        "seed_tasks": [s["task_id"] for s in seeds],
        "gx": {"success": gx["success"], "failed_expectations": gx["failed_expectations"]},
        **({"policy": policy_id} if uses_policy else {}),
    }
    res = store.append(bid, NewEvent("synth.batch_accepted", payload, [cur.entity_id, *seed_ids]),
                       expected_version=0, correlation_id=correlation_id)
    return SynthSummary(
        batch=bid, env=new_env, widened_env=cur.entity_id, counts=payload["counts"], rejected_by_reason=reasons,
        by_generator=by_gen, not_applicable=not_applicable, seeds=len(seeds), accepted_artifact=acc_ref.to_dict(),
        rejected_artifact=rej_ref.to_dict(), decontaminated_against=payload["decontaminated_against"],
        gx=payload["gx"], new=True, events_appended=res.appended + int(new_env != cur.entity_id),
        seconds=time.perf_counter() - t0, accepted_ids=[c.task_id for c in accepted], rejections=rejections,
    )
