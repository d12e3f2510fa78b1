"""The ``enumeration`` generator: one call per item a request lists, with the list made longer or shorter.

A parallel request often lists the items one function is called for ("the heat capacity at 300 K and
350 K", "the GCD of 45 and 60, and of 81 and 27"): the answer is one call per item, the calls equal but
for one argument. The commonest error of a small model on such requests is to stop early (issue 30:
``missing_call`` was half of the cycle-1 model's failures on 165 unseen parallel questions). Joining two
requests (``parallel``) teaches two sentences, two calls; this generator teaches the count itself: the
same request with one more item in its list (and one more call), or one fewer.

What a seed must have to apply: a strict ``tool_call`` seed with two or more calls to one function that
differ in exactly one argument (every other argument equal), each value of that argument stated exactly
once in the request, in the order of the list, separated only by a list connector (``,``, ``and``,
``or``, ``, and``, ``&``). Anything else (values repeated, units glued to a value, two varying
arguments) is skipped: this rewrites text it can parse, and only that.

Variants:
- ``extend`` (the default 60%): a new value of the argument's type (numbers within the stated values'
  order of magnitude and the schema's bounds, strings from the schema's enum, the value pool of the
  same parameter or the dates/times rules of ``mutate``), added as the list's last item and as one
  more call; at most ``max_calls`` calls in all.
- ``drop``: one item removed from the list and its call from the answer (a two-item list becomes a
  single call).
The list is rewritten in the request's own style ("a, b and c"); the answer's order does not matter
(the verifier is set order-insensitive, as for ``parallel``). Every variant still goes through the
funnel (valid, solvable by its verifier, deduplicated, decontaminated).
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

from flywheel.dedup import normalize_text
from flywheel.synth.generators.base import (
    Candidate,
    GenContext,
    Generator,
    _locate_string,
    _locate_value,
    _new_task,
    _schema_of,
)
from flywheel.synth.generators.mutate import (
    _DATE_RE,
    _TIME_RE,
    _new_number,
    _new_string,
    _render_number,
    _set_expected,
)
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.messages import last_index, request_content_text

#: Text allowed between two listed values: a comma and/or a conjunction (case-insensitive).
_SEP_RE = re.compile(r"^\s*(?:,\s*(?:(?:and|or|&)\s+)?|(?:and|or|&)\s+)$", re.IGNORECASE)
_CONJ_RE = re.compile(r"^\s*(?:and|or|&)\s+$", re.IGNORECASE)


def find_enumeration(seed: dict) -> dict[str, Any] | None:
    """The list a request states for one function's calls, or ``None``.

    Returns ``{"calls": [call indexes in list order], "param": name, "spans": [(start, end)], "seps":
    [text between items], "text": the request}`` for the first function (by its first call) whose calls
    qualify (module docstring)."""
    msgs = seed["prompt"]["messages"]
    ui = last_index(msgs, "user")
    if ui is None:
        return None
    text = request_content_text(msgs[ui].get("content"))
    calls = seed["reference"]["tool_calls"]
    by_name: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        by_name.setdefault(str(c.get("name", "")), []).append(i)
    for name, idx in by_name.items():
        if len(idx) < 2 or not name:
            continue
        args = [calls[i].get("arguments") or {} for i in idx]
        keys = set().union(*(a.keys() for a in args))
        if any(set(a) != keys for a in args):
            continue
        varying = [k for k in sorted(keys) if len({canonical_json(a[k]) for a in args}) > 1]
        if len(varying) != 1:
            continue
        p = varying[0]
        values = [a[p] for a in args]
        if len({canonical_json(v) for v in values}) != len(values):
            continue
        spans = []
        for v in values:
            found = _locate_value(text, v)
            if found is None or len(found) != 1:
                break
            spans.append(found[0].span())
        else:
            order = sorted(range(len(idx)), key=lambda j: spans[j][0])
            spans_sorted = [spans[j] for j in order]
            seps = [text[spans_sorted[j][1]: spans_sorted[j + 1][0]] for j in range(len(order) - 1)]
            if all(_SEP_RE.match(s) for s in seps) and _schema_of(seed["prompt"]["tools"], name, p) is not None:
                return {"calls": [idx[j] for j in order], "param": p, "spans": spans_sorted, "seps": seps,
                        "text": text}
    return None


def _join(items: list[str], seps: list[str]) -> str:
    """``items`` as a list in the style of ``seps`` (the original's separators): the last one before the
    last item, the first one between the others (a comma when the original had only a conjunction)."""
    if len(items) == 1:
        return items[0]
    last = seps[-1]
    if len(items) == 2 and not _CONJ_RE.match(last) and _CONJ_RE.match(re.sub(r"^\s*,\s*", " ", last)):
        last = re.sub(r"^\s*,\s*", " ", last)  # "a, b, and c" -> "a and b": no serial comma for two
    inner = ", " if _CONJ_RE.match(seps[0]) else seps[0]
    return "".join(x + (inner if j < len(items) - 2 else last) for j, x in enumerate(items[:-1])) + items[-1]


def _next_value(param: str, stated: list[Any], schema: dict, text: str, span: str, rng: random.Random,
                ctx: GenContext) -> tuple[Any, str] | None:
    """A value one more item of the list could have, and its text in the style of the last item ``span``.

    Numbers: the next term when the stated values step evenly (2017, 2018, 2019 -> 2020), else a value
    within the stated range widened by its spread (and the schema's bounds); strings: another member of
    the schema's enum, another date or time (``mutate``'s rules), or a value the same parameter takes in
    another seed -- never a value of an unrelated parameter, which would read as nonsense in a list."""
    if isinstance(schema.get("enum"), list):
        opts = [e for e in schema["enum"] if type(e) is type(stated[-1]) and e not in stated
                and (not isinstance(e, str) or not _locate_string(text, e))]
        if not opts:
            return None
        e = opts[rng.randrange(len(opts))]
        return e, (_render_number(e, span) if isinstance(e, int | float) else str(e))
    last = stated[-1]
    if isinstance(last, int | float):
        nums = [float(x) for x in stated]
        steps = {round(b - a, 9) for a, b in zip(nums, nums[1:], strict=False)}
        lo_b = schema.get("minimum", float("-inf"))
        hi_b = schema.get("maximum", float("inf"))
        if len(steps) == 1 and next(iter(steps)) != 0:
            nxt = nums[-1] + next(iter(steps))
            new: int | float = int(nxt) if isinstance(last, int) and float(nxt).is_integer() else nxt
            if lo_b <= new <= hi_b and new not in stated:
                return new, _render_number(new, span)
        lo, hi = min(nums), max(nums)
        spread = (hi - lo) or abs(hi) / 2 or 1.0
        bounded = {**schema, "minimum": max(lo - spread, lo_b), "maximum": min(hi + spread, hi_b)}
        if lo >= 0:  # a list of non-negative values stays non-negative
            bounded["minimum"] = max(bounded["minimum"], 0)
        for _ in range(8):
            got = _new_number(last, bounded, span, rng)
            if got is None:
                return None
            if got[0] not in stated:
                return got
        return None
    if not isinstance(last, str):
        return None
    taken = {normalize_text(str(x)) for x in stated}
    dated = _DATE_RE.match(last) or _TIME_RE.match(last)
    if not dated and not [c for c in ctx.value_pool.get(param.lower(), []) if normalize_text(c) not in taken]:
        return None  # no same-parameter value to add (mutate's word lists would add e.g. a person to proteins)
    new_s = _new_string(param, last, schema, text, rng, ctx, taken)
    return (new_s, new_s) if new_s is not None else None


class EnumerationGenerator(Generator):
    name = "enumeration"

    def __init__(self, max_calls: int = 6, extend_rate: float = 0.6):
        super().__init__(max_calls=max_calls, extend_rate=extend_rate)

    def applicable(self, seed: dict) -> bool:
        return super().applicable(seed) and find_enumeration(seed) is not None

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        en = find_enumeration(seed)
        if en is None:
            return None
        ops = ["extend", "drop"] if rng.random() < self.params["extend_rate"] else ["drop", "extend"]
        for op in ops:
            got = self._extend(seed, en, rng, ctx) if op == "extend" else self._drop(seed, en, rng)
            if got is not None:
                return got
        return None

    def _variant(self, seed: dict, en: dict, items: list[str], calls: list[dict], expected: list[dict],
                 detail: dict) -> Candidate:
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        ui = last_index(msgs, "user")
        text = en["text"]
        a, b = en["spans"][0][0], en["spans"][-1][1]
        msgs[ui] = {**msgs[ui], "content": text[:a] + _join(items, en["seps"]) + text[b:]}
        task = _new_task(seed, messages=msgs, tools=copy.deepcopy(seed["prompt"]["tools"]), expected=expected,
                         reference={"tool_calls": calls}, generator=self.name, params=self.params, detail=detail,
                         seeds=[seed["task_id"]])
        task["verifier"]["order_sensitive"] = False
        return Candidate(task, self.name, [seed["task_id"]])

    def _drop(self, seed: dict, en: dict, rng: random.Random) -> Candidate | None:
        text, spans, idx = en["text"], en["spans"], en["calls"]
        j = rng.randrange(len(idx))
        items = [text[a:b] for n, (a, b) in enumerate(spans) if n != j]
        gone = idx[j]
        calls = [c for n, c in enumerate(copy.deepcopy(seed["reference"]["tool_calls"])) if n != gone]
        expected = [e for n, e in enumerate(copy.deepcopy(seed["verifier"]["expected"])) if n != gone]
        ref_call = seed["reference"]["tool_calls"][gone]
        return self._variant(seed, en, items, calls, expected,
                             {"op": "drop", "call": ref_call["name"], "param": en["param"],
                              "value": ref_call["arguments"][en["param"]], "items": len(items)})

    def _extend(self, seed: dict, en: dict, rng: random.Random, ctx: GenContext) -> Candidate | None:
        ref_calls = seed["reference"]["tool_calls"]
        if len(ref_calls) + 1 > self.params["max_calls"]:
            return None
        text, spans, idx, p = en["text"], en["spans"], en["calls"], en["param"]
        last = idx[-1]
        schema = _schema_of(seed["prompt"]["tools"], ref_calls[last]["name"], p) or {}
        stated = [ref_calls[i]["arguments"][p] for i in idx]
        got = _next_value(p, stated, schema, text, text[spans[-1][0]: spans[-1][1]], rng, ctx)
        if got is None:
            return None
        new, new_text = got
        items = [text[a:b] for a, b in spans] + [new_text]
        calls = copy.deepcopy(ref_calls)
        expected = copy.deepcopy(seed["verifier"]["expected"])
        call = copy.deepcopy(ref_calls[last])
        call["arguments"][p] = new
        spec = copy.deepcopy(expected[last])
        exp_args = spec.setdefault("arguments", {})
        exp_args[p] = _set_expected(exp_args.get(p, new), new)
        calls.insert(last + 1, call)
        expected.insert(last + 1, spec)
        return self._variant(seed, en, items, calls, expected,
                             {"op": "extend", "call": call["name"], "param": p, "value": new, "items": len(items)})
