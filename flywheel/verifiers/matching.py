"""Match parsed tool calls against tool schemas and expected calls (the ``tool_call`` verifier's core).

Rules, in the spirit of BFCL's AST checker (``bfcl_eval/eval_checker/ast_eval/ast_checker.py``):

- **Names**: exact. A call named ``math_factorial`` is accepted for tool ``math.factorial`` when no tool
  is literally named ``math_factorial`` and the mapping is unique (OpenAI-style APIs forbid dots in
  names, so BFCL replaces them with underscores for those models).
- **Expected arguments**: ``{param: literal}`` means exactly that value; ``{param: {"one_of": [..],
  "optional": bool}}`` lists the acceptable values, and ``optional`` lets the parameter be omitted.
  The expected answer wins over the schema's ``required`` list: BFCL checks ``required`` first, so it
  rejects omissions its own answer key allows (5 of the 1,000 items in the four categories, e.g.
  ``simple_python_17``); here those answers pass and only ``valid_schema`` records the omission.
  An argument the expected call does not mention is unexpected and fails the call.
- **Types**: ``True`` is never ``1``. An integer is accepted where the value is a float and the schema
  type is ``number`` (Python auto-conversion, as BFCL allows); a float is never accepted for an
  ``integer`` parameter. Numbers compare exactly. Tuples arrive as lists.
- **Strings** (when ``normalize_strings``, the default): BFCL's ``standardize_string``: spaces and
  ``,./-_*^`` removed, lower-cased, ``'`` read as ``"``; so ``"April 1, 2024"`` equals ``"april 1 2024"``.
  Applied inside lists and dicts too. With ``normalize_strings=False`` strings compare exactly.
- **Lists** compare element-wise in order; **dicts** need the same keys and matching values.
- **Order**: calls are paired with expected calls by the best assignment unless ``order_sensitive``;
  extra calls fail unless ``allow_extra_calls``. ``expected == []`` means "no call is correct".
- **Schema validity** (``valid_schema`` component): the call names a known tool and its arguments
  validate against the tool's JSON Schema; arguments absent from ``properties`` are invalid. With
  expected calls given, the expected values win over the schema (BFCL's answers sometimes put a variable
  name where the schema says integer), so ``passed`` does not require ``valid_schema``; without expected
  calls it is the whole check.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from flywheel.vocab.toolcalls import ToolCall
from flywheel.vocab.tools import function_of

__all__ = ["MatchReport", "match_tool_calls", "tool_index", "standardize_string", "normalize_expected"]

_STD = re.compile(r"[ \,\.\/\-\_\*\^]")


def standardize_string(s: str) -> str:
    """BFCL's string standardisation (ast_checker.standardize_string)."""
    return _STD.sub("", s).lower().replace("'", '"')


@dataclass
class MatchReport:
    passed: bool
    components: dict[str, float]
    details: dict = field(default_factory=dict)


def tool_index(tools: list[dict]) -> dict[str, dict]:
    """``{name: parameters JSON Schema}`` from OpenAI tool specs (``{"type": "function", "function":
    {...}}``) or bare function specs. Raises ValueError on a spec without a name."""
    out: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        fn = function_of(t)
        if fn is None or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] has no function name")
        out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


@functools.lru_cache(maxsize=512)
def _validator(schema_json: str):
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(args: dict, schema: dict) -> list[str]:
    """Validation errors of ``args`` against a parameters schema; unknown arguments count as errors."""
    errs: list[str] = []
    props = schema.get("properties")
    if isinstance(props, dict):
        errs += [f"unknown argument {k!r}" for k in args if k not in props]
    v = _validator(json.dumps(schema, sort_keys=True))
    errs += [f"{'/'.join(map(str, e.path)) or '<args>'}: {e.message[:200]}" for e in v.iter_errors(args)]
    return errs


def _resolve_name(name: str, index: dict[str, dict]) -> str:
    if name in index or not index:
        return name
    alias = [n for n in index if n.replace(".", "_") == name]
    return alias[0] if len(alias) == 1 else name


def normalize_expected(expected: list[dict]) -> list[tuple[str, dict[str, tuple[list, bool]]]]:
    """``[(name, {param: (allowed values, optional)})]``; raises ValueError on a malformed entry."""
    out = []
    for i, e in enumerate(expected):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ValueError(f"expected[{i}] needs a 'name'")
        args = e.get("arguments", {})
        if not isinstance(args, dict):
            raise ValueError(f"expected[{i}].arguments must be an object")
        norm = {}
        for k, spec in args.items():
            if isinstance(spec, dict) and "one_of" in spec and set(spec) <= {"one_of", "optional"}:
                if not isinstance(spec["one_of"], list):
                    raise ValueError(f"expected[{i}].arguments.{k}.one_of must be a list")
                norm[k] = (list(spec["one_of"]), bool(spec.get("optional", False)))
            else:
                norm[k] = ([spec], False)
        out.append((e["name"], norm))
    return out


def _stype(schema: dict | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def values_equal(got: Any, want: Any, schema: dict | None, normalize: bool) -> bool:
    """Type-aware equality under the rules in the module docstring."""
    if want is None or got is None:
        return want is None and got is None
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool) and want == got
    if isinstance(want, int | float):
        if not isinstance(got, int | float):
            return False
        if isinstance(got, float) and "integer" in _stype(schema) and "number" not in _stype(schema):
            return False
        return got == want
    if isinstance(want, str):
        if not isinstance(got, str):
            return False
        return standardize_string(got) == standardize_string(want) if normalize else got == want
    if isinstance(want, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            return False
        items = schema.get("items") if isinstance(schema, dict) else None
        return all(values_equal(g, w, items, normalize) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return False
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        return all(values_equal(got[k], want[k], props.get(k), normalize) for k in want)
    return got == want


def _pair(call: ToolCall, name: str, exp: dict, schema: dict, normalize: bool) -> dict:
    """Per-pair scores: name ok, required-present share, value share, full match, reasons."""
    if call.name != name:
        return {"name": False, "required": 0.0, "values": 0.0, "full": False, "why": f"called {call.name}, expected {name}"}
    props = schema.get("properties", {}) or {}
    need = [k for k, (_, opt) in exp.items() if not opt]
    present_need = sum(1 for k in need if k in call.arguments)
    good, why = 0, []
    for k, (allowed, opt) in exp.items():
        if k not in call.arguments:
            if opt:
                good += 1
            else:
                why.append(f"missing required argument {k!r}")
            continue
        if any(values_equal(call.arguments[k], a, props.get(k), normalize) for a in allowed):
            good += 1
        else:
            why.append(f"{k}={call.arguments[k]!r} not in allowed {allowed!r}"[:300])
    extra = [k for k in call.arguments if k not in exp]
    why += [f"unexpected argument {k!r}" for k in extra]
    denom = len(exp) + len(extra)
    return {
        "name": True,
        "required": present_need / len(need) if need else 1.0,
        "values": good / denom if denom else 1.0,
        "full": not why,
        "why": "; ".join(why),
    }


def _best_assignment(score: list[list[float]]) -> list[int | None]:
    """For each expected row, the column (call) it is paired with, maximising the total score.
    Exact DP over subsets of calls for up to 12 calls (4096 states), greedy beyond that."""
    n_rows = len(score)
    n_cols = len(score[0]) if score else 0
    if n_cols <= 12:
        best: dict[int, tuple[float, list[int | None]]] = {0: (0.0, [])}
        for r in range(n_rows):
            nxt: dict[int, tuple[float, list[int | None]]] = {}
            for mask, (tot, assign) in best.items():
                options = [(tot, assign + [None], mask)]
                options += [
                    (tot + score[r][c], assign + [c], mask | (1 << c)) for c in range(n_cols) if not mask & (1 << c)
                ]
                for t, a, m in options:
                    if m not in nxt or t > nxt[m][0]:
                        nxt[m] = (t, a)
            best = nxt
        return max(best.values(), key=lambda x: x[0])[1] if best else []
    used: set[int] = set()
    out: list[int | None] = []
    for r in range(n_rows):
        cands = [(score[r][c], c) for c in range(n_cols) if c not in used]
        s, c = max(cands) if cands else (0.0, None)
        if c is not None and s > 0:
            used.add(c)
            out.append(c)
        else:
            out.append(None)
    return out


def match_tool_calls(
    calls: list[ToolCall],
    tools: list[dict],
    expected: list[dict] | None,
    *,
    order_sensitive: bool = False,
    allow_extra_calls: bool = False,
    normalize_strings: bool = True,
) -> MatchReport:
    index = tool_index(tools)
    calls = [ToolCall(_resolve_name(c.name, index), c.arguments) for c in calls]
    schema_ok = []
    schema_notes = []
    for i, c in enumerate(calls):
        if index and c.name not in index:
            schema_ok.append(False)
            schema_notes.append(f"call[{i}]: unknown function {c.name!r}")
            continue
        errs = schema_errors(c.arguments, index.get(c.name, {"type": "object"}))
        schema_ok.append(not errs)
        schema_notes += [f"call[{i}] {c.name}: {e}" for e in errs[:5]]
    valid_schema = (sum(schema_ok) / len(schema_ok)) if schema_ok else 0.0
    details: dict = {"schema_errors": schema_notes[:20]}
    if expected is None:
        passed = bool(calls) and all(schema_ok)
        details["weak"] = True
        return MatchReport(passed, {"valid_schema": valid_schema}, details)

    exp = normalize_expected(expected)
    if not exp:
        ok = not calls
        return MatchReport(
            ok, {"valid_schema": 1.0 if ok else valid_schema, "function_names": float(ok), "required_args": 1.0, "values": float(ok)},
            {**details, "why": [] if ok else ["expected no call"]},
        )
    pairs = [[_pair(c, name, args, index.get(name, {}), normalize_strings) for c in calls] for name, args in exp]
    if order_sensitive:
        assign: list[int | None] = [i if i < len(calls) else None for i in range(len(exp))]
    else:
        score = [[(100.0 if p["full"] else 0.0) + (10.0 if p["name"] else 0.0) + p["values"] + p["required"] for p in row] for row in pairs]
        assign = _best_assignment(score) if calls else [None] * len(exp)
    why: list[str] = []
    names_ok = req = vals = 0.0
    full = 0
    for r, c in enumerate(assign):
        if c is None:
            why.append(f"expected call {exp[r][0]} not made")
            continue
        p = pairs[r][c]
        names_ok += p["name"]
        req += p["required"]
        vals += p["values"]
        full += p["full"]
        if not p["full"]:
            why.append(f"call[{c}]: {p['why']}")
    n_exp = len(exp)
    extra = len(calls) - sum(1 for c in assign if c is not None)
    if extra > 0 and not allow_extra_calls:
        why.append(f"{extra} extra call(s)")
    denom_names = n_exp if allow_extra_calls else max(n_exp, len(calls))
    passed = full == n_exp and (allow_extra_calls or len(calls) == n_exp)
    details["why"] = why
    details["assignment"] = assign
    return MatchReport(
        passed,
        {
            "valid_schema": valid_schema,
            "function_names": names_ok / denom_names if denom_names else 1.0,
            "required_args": req / n_exp,
            "values": vals / n_exp,
        },
        details,
    )
