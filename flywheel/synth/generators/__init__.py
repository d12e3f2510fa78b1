"""Synthetic-task generators: variants of training seeds, each a :class:`Candidate` for the funnel
(:mod:`flywheel.synth.funnel`).

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

Targeted generators (aimed by :mod:`flywheel.synth.probe`; each makes a variant only where it applies)
----------------------------------------------------------------------------------------------------
- ``schema_values``: re-asks a seed with a new value for an argument whose parameter *states a
  format* -- a string ``enum`` (another member), a date format in the description (``yyyy-mm-dd``,
  ``MM-DD-YYYY``, ISO 8601, ``format: date``: the request says the new date in words, the reference
  writes it in that format), "City, State" / "City, Country" (the request names a well-known city,
  usually alone as BFCL's requests do; the reference writes "City, ST" when the description's example
  abbreviates, and the verifier accepts the abbreviation and the full state name), quoted example
  values in the description (another one, never the stated default). The request must state the
  seed's value in exactly one place; no variant where nothing states a format.
- ``masked_names``: neutral function and/or parameter names (``fn_3fa2``, ``a_1c9``) in the tools,
  their ``required`` lists and descriptions, the request (identifier-like names only) and the
  reference, so a memorised name fails and the descriptions must be read.
- ``irrelevance``: the seed's request with the tools it needs removed and unrelated ones added; the
  expected answer is no call (``expected: []``, reference ``{"content": NO_CALL_ANSWER}``).

:func:`generate_planned` makes a given number of variants per generator (a probe's plan) instead of
``per_seed`` variants of every seed.

Not guaranteed: that a swapped enum or example value still fits every other word of the request
("remove the columns" with ``operation='add'``): the funnel checks the answer, not the prose.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.dedup import _canon_number, normalize_text, tokens
from flywheel.policy.base import Policy, SamplingParams
from flywheel.split import request_hash, request_key
from flywheel.synth.keys import LIMITS, SYNTH_VERSION, _canon_value, synth_task_id
from flywheel.verifiers.matching import standardize_string
from flywheel.vocab.ids import canonical_json, json_id
from flywheel.vocab.messages import last_index, request_content_text
from flywheel.vocab.tools import function_of, tool_name

#: ``progress(stage, done, total)``: called as long work advances (the CLI draws its bars from it).
Progress = Callable[[str, int, int], None]


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


# -------------------------------------------------------------------------------- schema_values
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")

#: Well-known cities a request may name without their region (as BFCL's requests do: "in New York"
#: for ``New York, NY``), with their US state (abbreviation, name) or their country.
CITY_STATES: tuple[tuple[str, str, str], ...] = (
    ("New York", "NY", "New York"), ("Los Angeles", "CA", "California"), ("Chicago", "IL", "Illinois"),
    ("Houston", "TX", "Texas"), ("Austin", "TX", "Texas"), ("Seattle", "WA", "Washington"),
    ("Boston", "MA", "Massachusetts"), ("Miami", "FL", "Florida"), ("Denver", "CO", "Colorado"),
    ("San Francisco", "CA", "California"), ("Phoenix", "AZ", "Arizona"), ("Atlanta", "GA", "Georgia"),
    ("Las Vegas", "NV", "Nevada"), ("Nashville", "TN", "Tennessee"), ("New Orleans", "LA", "Louisiana"),
    ("San Diego", "CA", "California"), ("Philadelphia", "PA", "Pennsylvania"), ("Detroit", "MI", "Michigan"),
)
CITY_COUNTRIES: tuple[tuple[str, str], ...] = (
    ("Tel Aviv", "Israel"), ("Paris", "France"), ("Tokyo", "Japan"), ("Berlin", "Germany"), ("Madrid", "Spain"),
    ("Rome", "Italy"), ("Cairo", "Egypt"), ("Toronto", "Canada"), ("Sydney", "Australia"), ("Mumbai", "India"),
    ("Lisbon", "Portugal"), ("Nairobi", "Kenya"), ("Lima", "Peru"), ("Oslo", "Norway"), ("Seoul", "South Korea"),
    ("Istanbul", "Turkey"), ("Buenos Aires", "Argentina"), ("Amsterdam", "Netherlands"), ("Dublin", "Ireland"),
    ("Vienna", "Austria"),
)
_STATE_FMT = re.compile(r"\bcity,?\s+(?:and\s+)?state\b", re.IGNORECASE)
_COUNTRY_FMT = re.compile(r"\bcity,?\s+(?:and\s+)?country\b", re.IGNORECASE)
_ABBR_EXAMPLE = re.compile(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*, [A-Z]{2}\b")
_DATE_FMT = re.compile(r"\b(yyyy|mm|dd)([-/.])(yyyy|mm|dd)\2(yyyy|mm|dd)\b", re.IGNORECASE)
_ISO_DATE = re.compile(r"\bISO[- ]?8601\b|\bISO date\b|\bISO format\b", re.IGNORECASE)
_QUOTED = re.compile(r"'([^'\n]{1,40})'|\"([^\"\n]{1,40})\"")
_DEFAULT_Q = re.compile(r"default(?:s)?(?: value)?(?: is| to| of|:)?\s*(?:'([^'\n]{1,40})'|\"([^\"\n]{1,40})\")",
                        re.IGNORECASE)
#: What the ``schema_values`` generator recognises, in the order it prefers one reading of a parameter.
SCHEMA_FORMATS = ("enum", "date", "city_state", "city_country", "described")


def _description(schema: dict) -> str:
    d = schema.get("description")
    return d if isinstance(d, str) else ""


def _date_strftime(schema: dict) -> str | None:
    """The ``strftime`` pattern of the date format a string parameter's schema or description
    states (``yyyy-mm-dd``, ``MM-DD-YYYY``, ``dd/mm/yyyy``, ``ISO 8601``, ``format: date``), or None."""
    d = _description(schema)
    m = _DATE_FMT.search(d)
    if m:
        parts = [m.group(1).lower(), m.group(3).lower(), m.group(4).lower()]
        if sorted(parts) == ["dd", "mm", "yyyy"]:
            return m.group(2).join({"yyyy": "%Y", "mm": "%m", "dd": "%d"}[p] for p in parts)
        return None
    if schema.get("format") == "date" or _ISO_DATE.search(d):
        return "%Y-%m-%d"
    return None


def _described_values(schema: dict) -> tuple[list[str], str | None]:
    """Quoted example values a description lists (``e.g., 'fastest', 'scenic'``) and its quoted
    default, if any."""
    d = _description(schema)
    vals = list(dict.fromkeys(a or b for a, b in _QUOTED.findall(d)))
    m = _DEFAULT_Q.search(d)
    return vals, (m.group(1) or m.group(2)) if m else None


def _value_format(schema: dict, v: Any) -> str | None:
    """Which stated format (:data:`SCHEMA_FORMATS`) the parameter's schema or description gives for
    the string value ``v``; None when it states none."""
    if not isinstance(v, str) or isinstance(schema.get("type"), str) and schema.get("type") != "string":
        return None
    enum = schema.get("enum")
    if isinstance(enum, list):
        strs = [e for e in enum if isinstance(e, str)]
        return "enum" if len(strs) >= 2 and any(standardize_string(e) == standardize_string(v) for e in strs) else None
    if _date_strftime(schema):
        return "date"
    d = _description(schema)
    if _STATE_FMT.search(d):
        return "city_state"
    if _COUNTRY_FMT.search(d):
        return "city_country"
    vals, _ = _described_values(schema)
    if len(vals) >= 2 and any(standardize_string(x) == standardize_string(v) for x in vals):
        return "described"
    return None


def _format_slots(seed: dict) -> list[dict]:
    """Reference arguments whose parameter states a format, each value used by one argument only."""
    calls = seed["reference"]["tool_calls"]
    usage = Counter(canonical_json(_canon_value(v)) for c in calls for v in (c.get("arguments") or {}).values())
    out = []
    for ci, c in enumerate(calls):
        for p, v in (c.get("arguments") or {}).items():
            schema = _schema_of(seed["prompt"]["tools"], c["name"], p)
            if schema is None or usage[canonical_json(_canon_value(v))] != 1:
                continue
            kind = _value_format(schema, v)
            if kind is not None:
                out.append({"call": ci, "param": p, "value": v, "schema": schema, "format": kind})
    return out


def _one_span(text: str, needles: Sequence[str]) -> tuple[int, int] | None:
    """The one place ``text`` states any of ``needles`` (spans inside a longer match merged); None
    when it states none or several."""
    spans = {m.span() for n in needles if isinstance(n, str) for m in _locate_string(text, n)}
    outer = {s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)}
    return next(iter(outer)) if len(outer) == 1 else None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _date_renderings(d: dt.date, fmt: str) -> list[str]:
    m = _MONTHS[d.month - 1]
    return [d.strftime(fmt), d.isoformat(), d.strftime("%m/%d/%Y"), f"{m} {d.day}, {d.year}",
            f"{m} {_ordinal(d.day)}, {d.year}", f"{d.day} {m} {d.year}", f"{m} {d.day} {d.year}",
            f"{m}.{d.day}, {d.year}", f"{m[:3]}.{d.day}, {d.year}", f"{m[:3]} {d.day}, {d.year}"]


def _parse_date(v: str, fmt: str) -> dt.date | None:
    for f in (fmt, "%Y-%m-%d"):
        try:
            return dt.datetime.strptime(v.strip(), f).date()
        except ValueError:
            continue
    return None


def _allowed_values(seed: dict, slot: dict) -> list[Any]:
    spec = ((seed["verifier"]["expected"][slot["call"]].get("arguments") or {}).get(slot["param"]))
    vals = spec["one_of"] if _is_one_of(spec) else [spec]
    return [slot["value"], *[x for x in vals if isinstance(x, str)]]


def _format_edit(seed: dict, slot: dict, text: str, rng: random.Random,
                 taken: set[str]) -> tuple[tuple[int, int], str, Any, list[Any], dict] | None:
    """(span of the request, its new text, the new reference value, the values the verifier
    accepts, detail) for one format-stated argument; None when the request does not state its value
    in one place or no other value fits."""
    kind, v, schema = slot["format"], slot["value"], slot["schema"]

    def free(c: str) -> bool:
        return standardize_string(c) not in taken and not _locate_string(text, c)

    if kind == "enum":
        span = _one_span(text, [v, v.replace("_", " ")])
        opts = [e for e in schema["enum"] if isinstance(e, str) and standardize_string(e) != standardize_string(v)
                and free(e) and free(e.replace("_", " "))]
        if span is None or not opts:
            return None
        new = rng.choice(opts)
        return span, new.replace("_", " "), new, [new], {}
    if kind == "described":
        vals, default = _described_values(schema)
        span = _one_span(text, [v])
        opts = [x for x in vals if standardize_string(x) != standardize_string(v) and free(x)
                and (default is None or standardize_string(x) != standardize_string(default))]
        if span is None or not opts:
            return None
        new = rng.choice(opts)
        return span, new, new, [new], {"described_values": vals, "default": default}
    if kind == "date":
        fmt = _date_strftime(schema)
        old = _parse_date(v, fmt) if fmt else None
        if old is None:
            return None
        span = _one_span(text, _date_renderings(old, fmt))
        if span is None:
            return None
        for _ in range(10):
            new_d = dt.date(rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))
            if new_d != old:
                break
        m = _MONTHS[new_d.month - 1]
        said = rng.choice([f"{m} {new_d.day}, {new_d.year}", f"{new_d.day} {m} {new_d.year}",
                           f"{m} {_ordinal(new_d.day)}, {new_d.year}"])
        new = new_d.strftime(fmt)
        return span, said, new, [new], {"date_format": fmt}
    # city_state / city_country: the request names the city (the region maybe in prose), the
    # answer writes "City, Region" as the description asks.
    seen = _allowed_values(seed, slot)
    if not any("," in a for a in seen):
        return None  # the seed's answer is not a "City, Region" itself: not a city to swap
    needles = [x for a in seen for x in (a, a.split(",")[0].strip())]
    span = _one_span(text, needles)
    if span is None:
        return None
    if kind == "city_state":
        abbr = bool(_ABBR_EXAMPLE.search(_description(schema)))
        opts = [c for c in CITY_STATES if free(c[0])]
        if not opts:
            return None
        city, code, state = rng.choice(opts)
        new = f"{city}, {code}" if abbr else f"{city}, {state}"
        allowed = list(dict.fromkeys([new, f"{city}, {code}", f"{city}, {state}"]))
        said = city if rng.random() < 0.7 else f"{city}, {state}"
    else:
        opts2 = [c for c in CITY_COUNTRIES if free(c[0])]
        if not opts2:
            return None
        city, country = rng.choice(opts2)
        new = allowed_one = f"{city}, {country}"
        allowed = [allowed_one]
        said = city if rng.random() < 0.7 else f"{city} in {country}"
    return span, said, new, allowed, {}


class SchemaValuesGenerator(Generator):
    """Re-asks a seed with a new value for an argument whose parameter *states a format* (an enum,
    a date format, "City, State" / "City, Country", quoted example values in the description), the
    request saying it naturally and the reference writing it as the schema asks. No variant where
    the schema and description state no format."""

    name = "schema_values"

    def __init__(self, max_args: int = 1):
        super().__init__(max_args=max_args)

    def applicable(self, seed: dict) -> bool:
        return _tool_call_seed(seed) and bool(_format_slots(seed))

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        ui = last_index(msgs, "user")
        if ui is None:
            return None
        text = request_content_text(msgs[ui].get("content"))
        slots = _format_slots(seed)
        rng.shuffle(slots)
        taken = {standardize_string(str(s["value"])) for s in slots}
        edits: list[tuple[tuple[int, int], str, dict, Any, list[Any], dict]] = []
        for s in slots:
            if len(edits) >= self.params["max_args"]:
                break
            got = _format_edit(seed, s, text, rng, taken)
            if got is None:
                continue
            span, said, new, allowed, extra = got
            if any(not (span[1] <= a or b <= span[0]) for (a, b), *_ in edits):
                continue
            taken.add(standardize_string(str(new)))
            edits.append((span, said, s, new, allowed, extra))
        if not edits:
            return None
        calls = copy.deepcopy(seed["reference"]["tool_calls"])
        expected = copy.deepcopy(seed["verifier"]["expected"])
        for (a, b), said, s, new, allowed, _ in sorted(edits, key=lambda e: -e[0][0]):
            text = text[:a] + said + text[b:]
            calls[s["call"]]["arguments"][s["param"]] = new
            expected[s["call"]].setdefault("arguments", {})[s["param"]] = {"one_of": allowed, "optional": False}
        msgs[ui] = {**msgs[ui], "content": text}
        detail = {"changed": [{"call": calls[s["call"]]["name"], "param": s["param"], "format": s["format"],
                               "from": s["value"], "to": new, "said": said, **extra}
                              for _, said, s, new, _, extra in edits]}
        task = _new_task(seed, messages=msgs, tools=copy.deepcopy(seed["prompt"]["tools"]), expected=expected,
                         reference={"tool_calls": calls}, generator=self.name, params=self.params, detail=detail,
                         seeds=[seed["task_id"]])
        return Candidate(task, self.name, [seed["task_id"]])


# -------------------------------------------------------------------------------- masked_names
_MASK_MODES = ("functions", "parameters", "both")


def _sub_word(text: str, old: str, new: str) -> str:
    return re.sub(r"(?<![\w.])" + re.escape(old) + r"(?![\w])", new, text)


def _rename_in_schema(schema: Any, pmap: dict[str, str], texts: Callable[[str], str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items()}
    if isinstance(out.get("description"), str):
        out["description"] = texts(out["description"])
    props = out.get("properties")
    if isinstance(props, dict):
        new_props = {}
        for p, s in props.items():
            s2 = dict(s) if isinstance(s, dict) else s
            if isinstance(s2, dict) and isinstance(s2.get("description"), str):
                s2["description"] = texts(s2["description"])
            new_props[pmap.get(p, p)] = s2
        out["properties"] = new_props
    if isinstance(out.get("required"), list):
        out["required"] = [pmap.get(r, r) if isinstance(r, str) else r for r in out["required"]]
    return out


class MaskedNamesGenerator(Generator):
    """Renames the functions and/or their parameters to neutral names (``fn_3fa2``, ``a_1c9``),
    consistently in the tools (names, ``required``, descriptions that mention them), the request
    (names written as identifiers, with ``_`` or ``.``, are replaced; plain words are left alone)
    and the reference, so the model must choose by the descriptions. ``mode`` "auto" cycles
    functions / parameters / both with the variant number."""

    name = "masked_names"

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", *_MASK_MODES):
            raise ValueError(f"masked_names mode must be auto|functions|parameters|both, got {mode!r}")
        super().__init__(mode=mode)

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        mode = self.params["mode"] if self.params["mode"] != "auto" else _MASK_MODES[k % len(_MASK_MODES)]
        tools = seed["prompt"]["tools"]
        fmap: dict[str, str] = {}
        pmaps: dict[str, dict[str, str]] = {}
        used: set[str] = set()

        def fresh(prefix: str, width: int) -> str:
            while True:
                n = f"{prefix}_{rng.randrange(16 ** width):0{width}x}"
                if n not in used:
                    used.add(n)
                    return n

        for t in tools:
            fn = function_of(t) or {}
            name = str(fn.get("name", ""))
            if mode in ("functions", "both"):
                fmap[name] = fresh("fn", 4)
            props = (fn.get("parameters") or {}).get("properties") or {}
            if mode in ("parameters", "both") and isinstance(props, dict):
                pmaps[name] = {p: fresh("a", 3) for p in props}
        if not fmap and not any(pmaps.values()):
            return None
        # Every spelling of a function name that the verifier accepts ("a.b" and "a_b").
        spell = {**{o.replace(".", "_"): n for o, n in fmap.items()}, **fmap}

        def in_docs(s: str, pmap: dict[str, str]) -> str:
            for o, n in sorted(spell.items(), key=lambda x: -len(x[0])):
                s = _sub_word(s, o, n)
            for o, n in sorted(pmap.items(), key=lambda x: -len(x[0])):
                s = _sub_word(s, o, n)
            return s

        new_tools = []
        for t in tools:
            t2 = copy.deepcopy(t)
            fn = function_of(t2)
            name = str(fn.get("name", ""))
            pmap = pmaps.get(name, {})
            fn["name"] = fmap.get(name, name)
            if isinstance(fn.get("description"), str):
                fn["description"] = in_docs(fn["description"], pmap)
            if isinstance(fn.get("parameters"), dict):
                fn["parameters"] = _rename_in_schema(fn["parameters"], pmap, lambda s, m=pmap: in_docs(s, m))
            new_tools.append(t2)

        def resolve(n: str) -> str:
            return n if n in pmaps or n in fmap else next((o for o in fmap if o.replace(".", "_") == n), n)

        def rename_call(c: dict) -> dict:
            orig = resolve(c["name"])
            pmap = pmaps.get(orig, {})
            return {**c, "name": spell.get(c["name"], c["name"]),
                    "arguments": {pmap.get(p, p): v for p, v in (c.get("arguments") or {}).items()}}

        calls = [rename_call(c) for c in seed["reference"]["tool_calls"]]
        expected = [rename_call(e) for e in seed["verifier"]["expected"]]
        if calls == seed["reference"]["tool_calls"]:
            return None  # nothing the answer names was renamed (parameters mode, calls without arguments)
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        all_params = {o: n for m in pmaps.values() for o, n in m.items()}
        code_like = {o: n for o, n in {**spell, **all_params}.items() if "_" in o or "." in o}
        for i, m in enumerate(msgs):
            if m.get("role") in ("user", "system") and isinstance(m.get("content"), str):
                s = m["content"]
                for o, n in sorted(code_like.items(), key=lambda x: -len(x[0])):
                    s = _sub_word(s, o, n)
                msgs[i] = {**m, "content": s}
        detail = {"mode": mode, "functions": fmap, "parameters": {f: m for f, m in pmaps.items() if m}}
        task = _new_task(seed, messages=msgs, tools=new_tools, expected=expected, reference={"tool_calls": calls},
                         generator=self.name, params=self.params, detail=detail, seeds=[seed["task_id"]])
        return Candidate(task, self.name, [seed["task_id"]])


# -------------------------------------------------------------------------------- irrelevance
#: The reference answer of a task where no call is due (what the policy is trained to say).
NO_CALL_ANSWER = "None of the available functions can do this, so I will not call any of them."


class IrrelevanceGenerator(Generator):
    """BFCL ``irrelevance`` style: keeps the request, removes the function(s) it needs, keeps the
    seed's other tools and adds unrelated ones from the pool (the *least* plausible: lowest
    IDF-weighted overlap with the needed tools' docs and the request); the expected answer is no
    call (``expected == []``, reference ``{"content": NO_CALL_ANSWER}``), so any call fails."""

    name = "irrelevance"

    def __init__(self, max_tools: int = 3, candidates: int = 8, max_overlap: float = 0.05):
        super().__init__(max_tools=max_tools, candidates=candidates, max_overlap=max_overlap)

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        tools = seed["prompt"]["tools"]
        index_names = [tool_name(t) for t in tools]
        needed = set()
        for c in seed["reference"]["tool_calls"]:
            n = c["name"]
            alias = [x for x in index_names if x.replace(".", "_") == n]
            needed.add(n if n in index_names or len(alias) != 1 else alias[0])
        keep = [copy.deepcopy(t) for t in tools if tool_name(t) not in needed]
        spellings = set(index_names) | {n.replace(".", "_") for n in index_names}
        need_words = set().union(*(_words(t) for t in tools if tool_name(t) in needed)) if needed else set()
        msgs = seed["prompt"]["messages"]
        ui = last_index(msgs, "user")
        req_words = set(tokens(request_content_text(msgs[ui].get("content")))) if ui is not None else set()
        own = need_words | req_words
        scored = []
        for name, t in ctx.tool_pool.items():
            if name in spellings or name.replace(".", "_") in spellings:
                continue
            w = _words(t)
            inter = sum(ctx.idf.get(x, 1.0) for x in w & own)
            union = sum(ctx.idf.get(x, 1.0) for x in w | own)
            score = inter / union if union else 0.0
            if score <= self.params["max_overlap"]:
                scored.append((score, name))
        scored.sort()
        pool = [n for _, n in scored[: self.params["candidates"]]]
        if not pool:
            return None
        n_add = rng.randint(1, min(self.params["max_tools"], len(pool)))
        picked = sorted(rng.sample(pool, n_add))
        new_tools = keep
        for name in picked:
            new_tools.insert(rng.randint(0, len(new_tools)), copy.deepcopy(ctx.tool_pool[name]))
        if len(new_tools) > LIMITS["max_tools"]:
            return None
        task = _new_task(seed, messages=copy.deepcopy(msgs), tools=new_tools, expected=[],
                         reference={"content": NO_CALL_ANSWER}, generator=self.name, params=self.params,
                         detail={"removed": sorted(needed), "added": picked}, seeds=[seed["task_id"]])
        task["verifier"]["order_sensitive"] = False
        return Candidate(task, self.name, [seed["task_id"]])


GENERATORS: dict[str, type[Generator]] = {
    "mutate": MutateGenerator,
    "distractor": DistractorGenerator,
    "parallel": ParallelGenerator,
    "paraphrase": ParaphraseGenerator,
    "schema_values": SchemaValuesGenerator,
    "masked_names": MaskedNamesGenerator,
    "irrelevance": IrrelevanceGenerator,
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
                        policy: Policy | None = None, context_seeds: list[dict] | None = None,
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


def generate_planned(seeds: list[dict], generators: list[Generator], counts: dict[str, int], *, seed: int = 0,
                     policy: Policy | None = None, context_seeds: list[dict] | None = None,
                     progress: Progress | None = None) -> tuple[list[Candidate], int]:
    """Variants by plan: generator ``g`` makes ``counts[g.name]`` variants, spread round-robin over
    the seeds it applies to (from an offset hashed from the batch seed and the generator, so small
    plans do not all start on the same seeds); the ``j``-th pass over the seeds is variant ``k = j``
    of each, with the same per-variant randomness as :func:`generate_candidates` gives variant ``k``.

    Returns (candidates, generator by generator in the order given, then slot order; number of
    slots that produced nothing: no applicable seed, or the generator found nothing to vary).
    Deterministic like :func:`generate_candidates`.
    """
    ctx = build_context(context_seeds if context_seeds is not None else seeds, policy=policy, seed=seed)
    out: list[Candidate] = []
    na = 0
    total = sum(max(0, int(counts.get(g.name, 0))) for g in generators)
    done = 0
    for g in generators:
        n = max(0, int(counts.get(g.name, 0)))
        if n == 0:
            continue
        eligible = [s for s in seeds if g.applicable(s)]
        if not eligible:
            na += n
            done += n
            continue
        offset = int(json_id([seed, "plan", g.name, g.params], 8), 16) % len(eligible)
        items = []
        for j in range(n):
            s = eligible[(offset + j) % len(eligible)]
            k = j // len(eligible)
            content = json_id({key: s.get(key) for key in ("prompt", "verifier", "reference")})
            rng = random.Random(int(json_id([seed, g.name, g.params, s["task_id"], content, k]), 16))
            items.append((s, k, rng))
        got = g.generate(items, ctx)
        na += sum(1 for c in got if c is None)
        out += [c for c in got if c is not None]
        done += n
        if progress:
            progress("generate", done, total)
    return out, na
