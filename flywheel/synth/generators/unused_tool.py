"""The ``unused_tool`` generator: a new request for a tool the seed offers but its answer never calls.

Agents send a whole tool list with every request, and a failure's correction calls one or two of them;
the rest of the list is schema the training data never exercises. This generator writes a request for
one of those tools from its own description and parameters, keeps the seed's tool list as it is, and
expects exactly that call, so the model learns to tell the offered tools apart by what a request asks
(``wrong_function``) and to fill a schema it has not seen called (the unseen questions' situation).

The request is the tool's description turned into an instruction ("Calculates the area ..." ->
"Calculate the area ..."; BFCL's "Note that the provided function is in Python 3 syntax." dropped)
followed by every required argument and some optional ones, each stated once: "..., with country
Brazil and year 2020." Values, in the order tried:

- the value the seed's own answer passes to a parameter of the same name (``country``: the same
  country, now asked about with another tool: the contrast is the point);
- the schema's ``enum``; a quoted example or default in the parameter's description;
- the training seeds' values for a parameter of that name (:attr:`GenContext.value_pool`);
- integers and numbers drawn small; booleans only when required (stated as "set to true").

A required parameter none of these can fill (a list, an object, a string no seed ever passed) rules
that tool out. Optional parameters left unstated are expected absent, or at the schema's ``default``
where it has one. Every variant goes through the funnel like any other.
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

from flywheel.synth.generators.base import Candidate, GenContext, Generator, _new_task
from flywheel.synth.generators.schema_values import _described_values
from flywheel.vocab.messages import last_index
from flywheel.vocab.tools import function_of, tool_name

#: Sentences a description carries that say nothing about what the tool does.
_NOISE = re.compile(r"\s*Note that the provided function is in [^.]*\.\s*", re.IGNORECASE)
_FIRST_WORD = re.compile(r"^([A-Za-z]+)(.*)$", re.DOTALL)
#: Third-person verbs a description opens with that do not lose just their final "s" ("Fetches").
_ES_ENDINGS = ("sses", "shes", "ches", "xes", "zes")
_CONNECTORS = (", with {args}.", " for {args}.", ". Use {args}.")


def instruction(description: str) -> str | None:
    """A tool description as an instruction: noise sentences dropped, an opening third-person verb made
    imperative ("Retrieves" -> "Retrieve", "Fetches" -> "Fetch", "Queries" -> "Query"), no final period.
    None when nothing is left."""
    d = _NOISE.sub(" ", description or "").strip()
    if not d:
        return None
    m = _FIRST_WORD.match(d)
    if m:
        word, rest = m.group(1), m.group(2)
        low = word.lower()
        if low.endswith("ies") and len(low) > 4:
            word = word[:-3] + "y"
        elif low.endswith(_ES_ENDINGS):
            word = word[:-2]
        elif low.endswith("s") and not low.endswith(("ss", "us", "is")) and len(low) > 3:
            word = word[:-1]
        d = word[:1].upper() + word[1:] + rest
    return d.rstrip(" .") or None


def _phrase(param: str) -> str:
    return param.replace("_", " ").strip()


def _render(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _types(schema: dict) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _fits(v: Any, types: set[str]) -> bool:
    """Whether ``v`` is a plain value of one of the schema ``types`` (any plain value when none is stated)."""
    if isinstance(v, list | dict) or v is None:
        return False
    kind = ("boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
            else "number" if isinstance(v, float) else "string" if isinstance(v, str) else "")
    return not types or kind in types or (kind == "integer" and "number" in types)


def _value_for(param: str, schema: dict, own: dict[str, Any], ctx: GenContext, rng: random.Random,
               required: bool) -> tuple[bool, Any]:
    """(found, value) for ``param``: see the module docstring for the order."""
    types = _types(schema)
    if param in own and _fits(own[param], types):
        return True, own[param]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        vals = [e for e in enum if isinstance(e, str | int | float) and not isinstance(e, bool)]
        if vals:
            return True, rng.choice(vals)
    if types <= {"string"}:
        examples, default = _described_values(schema)
        pool = [x for x in examples if x != default] or ctx.value_pool.get(param.lower(), [])
        if pool:
            return True, rng.choice(pool)
        return False, None
    if types == {"integer"}:
        return True, rng.randint(2, 40)
    if types == {"number"}:
        return True, rng.choice([1.5, 2.5, 3.75, 12.5, 0.25, 7.0, 10.0, 25.0])
    if types == {"boolean"} and required:
        return True, rng.random() < 0.5
    return False, None


class UnusedToolGenerator(Generator):
    """A request for one of the seed's offered tools that its answer never calls (module docstring)."""

    name = "unused_tool"

    def __init__(self, optional_share: float = 0.3, max_args: int = 4):
        super().__init__(optional_share=optional_share, max_args=max_args)

    def applicable(self, seed: dict) -> bool:
        return super().applicable(seed) and bool(self._unused(seed))

    @staticmethod
    def _unused(seed: dict) -> list[dict]:
        called = {c.get("name") for c in seed["verifier"]["expected"]}
        called |= {str(n).replace(".", "_") for n in called}
        out = []
        for t in seed["prompt"].get("tools") or []:
            n = tool_name(t)
            if n and n not in called and n.replace(".", "_") not in called:
                out.append(t)
        return out

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        ui = last_index(msgs, "user")
        if ui is None:
            return None
        own: dict[str, Any] = {}
        for c in seed["reference"]["tool_calls"]:
            for p, v in (c.get("arguments") or {}).items():
                own.setdefault(p, v)
        tools = self._unused(seed)
        rng.shuffle(tools)
        for tool in tools:
            built = self._call_for(tool, own, ctx, rng)
            if built is None:
                continue
            fname, stated, expected_args, say = built
            body = rng.choice(_CONNECTORS).format(args=" and ".join(say) if len(say) < 3
                                                   else ", ".join(say[:-1]) + " and " + say[-1]) if say else "."
            msgs[ui] = {**msgs[ui], "content": say_request(function_of(tool) or {}) + body}
            task = _new_task(seed, messages=msgs, tools=copy.deepcopy(seed["prompt"]["tools"]),
                             expected=[{"name": fname, "arguments": expected_args}],
                             reference={"tool_calls": [{"name": fname, "arguments": stated}]},
                             generator=self.name, params=self.params,
                             detail={"tool": fname, "stated": sorted(stated)}, seeds=[seed["task_id"]])
            return Candidate(task, self.name, [seed["task_id"]])
        return None

    def _call_for(self, tool: dict, own: dict[str, Any], ctx: GenContext,
                  rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any], list[str]] | None:
        fn = function_of(tool) or {}
        fname = str(fn.get("name") or "")
        if not fname or instruction(str(fn.get("description") or "")) is None:
            return None
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            return None
        required = [p for p in params.get("required") or [] if p in props]
        stated: dict[str, Any] = {}
        expected: dict[str, Any] = {}
        for p, schema in props.items():
            schema = schema if isinstance(schema, dict) else {}
            need = p in required
            if not need and (rng.random() >= self.params["optional_share"]
                             or len(stated) >= self.params["max_args"]):
                if "default" in schema:
                    expected[p] = {"one_of": [schema["default"]], "optional": True}
                continue
            found, v = _value_for(p, schema, own, ctx, rng, need)
            if not found:
                if need:
                    return None
                if "default" in schema:
                    expected[p] = {"one_of": [schema["default"]], "optional": True}
                continue
            stated[p] = v
            expected[p] = {"one_of": [v], "optional": False}
        say = [f"{_phrase(p)} set to {_render(v)}" if isinstance(v, bool) else f"{_phrase(p)} {_render(v)}"
               for p, v in stated.items()]
        return fname, stated, expected, say


def say_request(fn: dict) -> str:
    """The instruction part of a request for function ``fn`` (:func:`instruction` of its description)."""
    return instruction(str(fn.get("description") or "")) or ""
