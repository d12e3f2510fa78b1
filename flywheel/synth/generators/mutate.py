"""The ``mutate`` generator: schema-driven mutation of the values a request states exactly once
(:func:`mutate_task`, also the ``parallel`` generator's self-pairing)."""

from __future__ import annotations

import copy
import datetime as dt
import math
import random
import re
from collections import Counter
from typing import Any

from flywheel.dedup import normalize_text
from flywheel.synth.generators.base import (
    Candidate,
    GenContext,
    Generator,
    _is_one_of,
    _locate_string,
    _locate_value,
    _new_task,
    _schema_of,
)
from flywheel.synth.keys import _canon_value
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.messages import last_index, request_content_text

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
            spans = _locate_value(text, v)
            if spans is not None and len(spans) == 1:
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


