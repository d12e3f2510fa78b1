"""The targeted ``irrelevance`` generator (BFCL ``irrelevance`` style): the needed tools removed,
unrelated ones added; the expected answer is no call (:data:`NO_CALL_ANSWER`)."""

from __future__ import annotations

import copy
import random

from flywheel.dedup import tokens
from flywheel.synth.generators.base import Candidate, GenContext, Generator, _new_task, _words
from flywheel.synth.keys import LIMITS
from flywheel.vocab.messages import last_index, request_content_text
from flywheel.vocab.tools import tool_name

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


