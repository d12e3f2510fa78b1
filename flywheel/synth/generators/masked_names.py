"""The targeted ``masked_names`` generator: neutral function and/or parameter names, so the model must
choose by the descriptions."""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable
from typing import Any

from flywheel.synth.generators.base import Candidate, GenContext, Generator, _new_task
from flywheel.vocab.tools import function_of

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


