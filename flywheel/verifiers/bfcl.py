"""Loaders for the Berkeley Function Calling Leaderboard data installed with ``bfcl-eval``.

Categories: ``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple`` (files
``bfcl_eval/data/BFCL_v4_<category>.json`` and ``possible_answer/`` with the same name, JSON lines).

Conversions (documented because graders and prompts depend on them):

- **Function specs -> OpenAI tools** (:func:`bfcl_function_to_tool`), types as BFCL's own
  ``GORILLA_TO_OPENAPI`` map: ``dict`` -> ``object``, ``float`` -> ``number``, ``tuple`` -> ``array``,
  ``bool`` -> ``boolean``; ``any`` drops the ``type`` keyword (any JSON value validates; BFCL maps it to
  string for OpenAI, which would reject the numbers its answers contain). Non-standard keys (``optional``,
  a boolean ``required`` on a property) are removed; ``description``, ``enum``, ``default``, ``items``,
  ``properties`` and ``required`` lists are kept. Names keep their dots (``math.factorial``): the
  pythonic format the policy emits uses them, and the matcher maps ``math_factorial`` back.
- **Possible answers -> expected calls** (:func:`bfcl_answer_to_expected`): each parameter becomes
  ``{"one_of": [...], "optional": bool}``; BFCL's ``""`` in a value list means "may be omitted" and is
  removed from ``one_of``. BFCL dict values are themselves alternative lists (``{"school": ["Bluebird
  High School", "Bluebird HS"]}``); they are expanded to every concrete dict (capped at
  :data:`MAX_EXPANSION`), keys whose alternatives include ``""`` may be absent.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.vocab.toolcalls import ToolCall

__all__ = [
    "BfclItem",
    "CATEGORIES",
    "MAX_EXPANSION",
    "bfcl_data_dir",
    "load_bfcl",
    "bfcl_function_to_tool",
    "bfcl_answer_to_expected",
    "reference_calls",
]

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
MAX_EXPANSION = 256
_OMIT = object()

_TYPE_MAP = {
    "integer": "integer",
    "number": "number",
    "float": "number",
    "double": "number",
    "string": "string",
    "char": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "dict": "object",
    "object": "object",
    "any": None,
}


@dataclass(frozen=True)
class BfclItem:
    id: str
    question_messages: list[dict]
    functions: list[dict]
    tools: list[dict]
    possible_answer: list[dict]


@functools.lru_cache(maxsize=1)
def bfcl_data_dir() -> Path:
    """The installed ``bfcl_eval/data`` directory (found without importing bfcl_eval, whose
    ``__init__`` pulls in heavy dependencies that are deliberately not installed)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bfcl-eval is not installed (pip install --no-deps bfcl-eval)")
    d = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not d.is_dir():
        raise FileNotFoundError(f"bfcl-eval data directory missing: {d}")
    return d


def _convert_schema(s: Any, where: str) -> Any:
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k == "type":
            if v not in _TYPE_MAP:
                raise ValueError(f"{where}: unknown BFCL type {v!r}")
            if _TYPE_MAP[v] is not None:
                out["type"] = _TYPE_MAP[v]
        elif k == "properties" and isinstance(v, dict):
            out["properties"] = {p: _convert_schema(ps, f"{where}.{p}") for p, ps in v.items()}
        elif k == "items":
            out["items"] = _convert_schema(v, f"{where}[]")
        elif k == "required":
            if isinstance(v, list):
                out["required"] = list(v)
        elif k == "optional":
            continue
        else:
            out[k] = copy.deepcopy(v)
    return out


def bfcl_function_to_tool(fn: dict) -> dict:
    """One BFCL function spec as an OpenAI tool spec (see the module docstring for the mapping)."""
    params = _convert_schema(fn.get("parameters", {"type": "dict", "properties": {}}), fn["name"])
    params.setdefault("type", "object")
    return {
        "type": "function",
        "function": {"name": fn["name"], "description": fn.get("description", ""), "parameters": params},
    }


def load_bfcl(category: str, limit: int | None = None) -> list[BfclItem]:
    """Items of one category in file order (``limit`` keeps the first N). Raises ValueError when
    the question and answer files disagree on ids."""
    if category not in CATEGORIES:
        raise ValueError(f"unsupported BFCL category {category!r}; expected one of {CATEGORIES}")
    d = bfcl_data_dir()
    answers: dict[str, list[dict]] = {}
    with open(d / "possible_answer" / f"BFCL_v4_{category}.json", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                answers[rec["id"]] = rec["ground_truth"]
    items: list[BfclItem] = []
    with open(d / f"BFCL_v4_{category}.json", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if limit is not None and len(items) >= limit:
                break
            rec = json.loads(line)
            if rec["id"] not in answers:
                raise ValueError(f"BFCL {category}: question {rec['id']} has no possible answer")
            messages = [m for turn in rec["question"] for m in turn]
            items.append(
                BfclItem(
                    id=rec["id"],
                    question_messages=messages,
                    functions=rec["function"],
                    tools=[bfcl_function_to_tool(fn) for fn in rec["function"]],
                    possible_answer=answers[rec["id"]],
                )
            )
    return items


def _expand(value: Any) -> list[Any]:
    """Concrete alternatives of one BFCL value: dicts hold alternative lists per key."""
    if isinstance(value, dict):
        keys = list(value)
        per_key = []
        for k in keys:
            alts = value[k] if isinstance(value[k], list) else [value[k]]
            opts: list[Any] = []
            for a in alts:
                if a == "":
                    opts.append(_OMIT)
                else:
                    opts.extend(_expand(a) if isinstance(a, dict) else [a])
            per_key.append(opts or [_OMIT])
        out = []
        for combo in itertools.product(*per_key):
            out.append({k: v for k, v in zip(keys, combo, strict=True) if v is not _OMIT})
            if len(out) >= MAX_EXPANSION:
                break
        return out
    if isinstance(value, list) and any(isinstance(x, dict) for x in value):
        per_elem = [_expand(x) if isinstance(x, dict) else [x] for x in value]
        return [list(c) for c in itertools.islice(itertools.product(*per_elem), MAX_EXPANSION)]
    return [value]


def bfcl_answer_to_expected(ground_truth: list[dict]) -> list[dict]:
    """BFCL ``ground_truth`` (``[{fn: {param: [allowed...]}}]``) as expected calls
    ``[{"name", "arguments": {param: {"one_of": [...], "optional": bool}}}]``."""
    out = []
    for i, call in enumerate(ground_truth):
        if not isinstance(call, dict) or len(call) != 1:
            raise ValueError(f"ground_truth[{i}] must be a one-key object {{function: params}}")
        (name, params), = call.items()
        args = {}
        for p, allowed in params.items():
            if not isinstance(allowed, list):
                raise ValueError(f"ground_truth[{i}].{name}.{p} must be a list of allowed values")
            values: list[Any] = []
            for a in allowed:
                if a == "":
                    continue
                for v in _expand(a):
                    if v not in values or not any(_same(v, x) for x in values):
                        values.append(v)
            args[p] = {"one_of": values, "optional": "" in allowed}
        out.append({"name": name, "arguments": args})
    return out


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def reference_calls(ground_truth: list[dict]) -> list[ToolCall]:
    """One concrete correct answer: the first allowed value of every non-optional parameter (optional
    ones are omitted), for SFT demonstrations and solvability checks."""
    calls = []
    for exp in bfcl_answer_to_expected(ground_truth):
        args = {}
        for p, spec in exp["arguments"].items():
            if spec["optional"] or not spec["one_of"]:
                continue
            args[p] = spec["one_of"][0]
        calls.append(ToolCall(exp["name"], args))
    return calls
