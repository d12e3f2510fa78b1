"""The ``distractor`` generator (BFCL ``multiple`` style): the most plausible tools of the pool added
to the task's own; the expected answer is unchanged."""

from __future__ import annotations

import copy
import random

from flywheel.synth.generators.base import Candidate, GenContext, Generator, _new_task, _words
from flywheel.synth.keys import LIMITS
from flywheel.vocab.tools import tool_name


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


