"""The ``parallel`` generator (BFCL ``parallel`` / ``parallel_multiple`` style): a request joined with a
second one (a mutation of itself or another seed) into one whose answer is both calls."""

from __future__ import annotations

import copy
import random

from flywheel.synth.generators.base import Candidate, GenContext, Generator, _new_task, _tool_call_seed
from flywheel.synth.generators.mutate import mutate_task
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.messages import last_index, request_content_text
from flywheel.vocab.tools import tool_name

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


