"""The ``paraphrase`` generator (optional; needs a policy): a chat model rewords the request; every
value the request stated must survive."""

from __future__ import annotations

import copy
import random
import re

from flywheel.dedup import _canon_number
from flywheel.policy.base import SamplingParams
from flywheel.synth.generators.base import (
    _NUM_RE,
    Candidate,
    GenContext,
    Generator,
    _locate_number,
    _locate_string,
    _new_task,
    _tool_call_seed,
)
from flywheel.vocab.ids import json_id
from flywheel.vocab.messages import last_index, request_content_text

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


