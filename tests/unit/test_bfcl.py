"""BFCL loaders and the tool-call matcher on the installed BFCL data (4 categories)."""

from __future__ import annotations

import copy
import random

import pytest

from flywheel.verifiers import ToolCall, format_tool_calls, verify
from flywheel.verifiers.bfcl import (
    CATEGORIES,
    bfcl_answer_to_expected,
    bfcl_function_to_tool,
    load_bfcl,
    reference_calls,
)

SAMPLE = 25  # items per category: enough to hit dict/list/float/optional cases, fast enough for CI


def _sample(category):
    items = load_bfcl(category)
    rng = random.Random(f"bfcl-{category}")
    picked = rng.sample(items, SAMPLE)
    # Always include the items with dict-valued and nested answers (alternative expansion paths).
    extra = {"simple_python": ["simple_python_89", "simple_python_96", "simple_python_17", "simple_python_149"],
             "parallel": ["parallel_152", "parallel_29"], "multiple": ["multiple_8"], "parallel_multiple": ["parallel_multiple_66"]}
    by_id = {it.id: it for it in items}
    return picked + [by_id[i] for i in extra.get(category, []) if by_id[i] not in picked]


def _spec(item):
    return {"kind": "tool_call", "tools": item.tools, "expected": bfcl_answer_to_expected(item.possible_answer)}


def _answer(calls):
    return [{"role": "assistant", "content": format_tool_calls(calls)}]


def _all_possible_answers(item, cap=64):
    """Every combination of allowed values (omitting optional params is one choice), capped."""
    expected = bfcl_answer_to_expected(item.possible_answer)
    per_call = []
    for e in expected:
        combos = [{}]
        for p, spec in e["arguments"].items():
            choices = list(spec["one_of"]) + (["__omit__"] if spec["optional"] else [])
            combos = [{**c, p: v} for c in combos for v in choices][:cap]
        per_call.append([ToolCall(e["name"], {k: v for k, v in c.items() if v != "__omit__"}) for c in combos])
    answers = [[]]
    for options in per_call:
        answers = [a + [o] for a in answers for o in options][:cap]
    return answers


def test_load_bfcl_shapes_and_tool_conversion():
    for cat in CATEGORIES:
        items = load_bfcl(cat, limit=3)
        assert len(items) == 3
        it = items[0]
        assert it.id.startswith(cat) and it.question_messages[0]["role"] == "user"
        tool = it.tools[0]["function"]
        assert tool["parameters"]["type"] == "object"
        assert len(it.tools) == len(it.functions)
    with pytest.raises(ValueError, match="unsupported"):
        load_bfcl("simple_java")


def test_type_mapping_float_tuple_any_dict():
    fn = {"name": "m.f", "description": "d", "parameters": {"type": "dict", "required": ["a"], "properties": {
        "a": {"type": "float"}, "b": {"type": "tuple", "items": {"type": "integer"}}, "c": {"type": "any", "optional": True},
        "d": {"type": "dict", "properties": {"x": {"type": "string"}}}}}}
    p = bfcl_function_to_tool(fn)["function"]["parameters"]
    assert p["type"] == "object" and p["required"] == ["a"]
    assert p["properties"]["a"] == {"type": "number"}
    assert p["properties"]["b"] == {"type": "array", "items": {"type": "integer"}}
    assert p["properties"]["c"] == {}
    assert p["properties"]["d"]["type"] == "object"


def test_answer_conversion_optional_and_dict_alternatives():
    gt = [{"db_fetch_records": {"conditions": [{"department": ["Science"], "school": ["Bluebird High School", "Bluebird HS"]}], "limit": ["", 10]}}]
    exp = bfcl_answer_to_expected(gt)
    args = exp[0]["arguments"]
    assert args["limit"] == {"one_of": [10], "optional": True}
    assert args["conditions"]["one_of"] == [
        {"department": "Science", "school": "Bluebird High School"},
        {"department": "Science", "school": "Bluebird HS"},
    ]
    assert reference_calls(gt) == [ToolCall("db_fetch_records", {"conditions": {"department": "Science", "school": "Bluebird High School"}})]


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_possible_answer_passes(category):
    n = 0
    for item in _sample(category):
        spec = _spec(item)
        for answer in _all_possible_answers(item):
            v = verify(spec, _answer(answer))
            assert v.passed and v.reward == 1.0, (item.id, format_tool_calls(answer), v.details.get("why"))
            n += 1
        # Order of parallel calls does not matter; the reversed order passes too.
        ref = reference_calls(item.possible_answer)
        assert verify(spec, _answer(list(reversed(ref)))).passed, item.id
    assert n >= SAMPLE


def _perturbations(item, rng):
    """(label, calls) pairs that must fail."""
    ref = reference_calls(item.possible_answer)
    expected = bfcl_answer_to_expected(item.possible_answer)
    props = {t["function"]["name"]: t["function"]["parameters"].get("properties", {}) for t in item.tools}
    out = []
    i = rng.randrange(len(ref))
    call, exp = ref[i], expected[i]

    def swap(new):
        calls = list(ref)
        calls[i] = new
        return calls

    out.append(("wrong function", swap(ToolCall(call.name + "_v2", call.arguments))))
    required = [p for p, s in exp["arguments"].items() if not s["optional"] and p in call.arguments]
    if required:
        p = rng.choice(required)
        out.append(("missing required", swap(ToolCall(call.name, {k: v for k, v in call.arguments.items() if k != p}))))
        allowed = exp["arguments"][p]["one_of"]
        v = call.arguments[p]
        if isinstance(v, bool):
            bad = not v
        elif isinstance(v, int | float):
            bad = v + 7919
        elif isinstance(v, str):
            bad = v + " zzqx"
        elif isinstance(v, list):
            bad = v + v + ["zzqx"]
        else:
            bad = {"zzqx": 1}
        if bad not in allowed:
            out.append(("value outside allowed set", swap(ToolCall(call.name, {**call.arguments, p: bad}))))
        # Wrong type: a number sent as its string, a string sent as a number, a list sent as a string.
        if isinstance(v, bool):
            wrong = str(v).lower()
        elif isinstance(v, int | float):
            wrong = str(v)
        elif isinstance(v, str):
            wrong = 12345
        else:
            wrong = repr(v)
        if not any(isinstance(a, str) for a in allowed) or isinstance(v, str):
            out.append(("wrong type", swap(ToolCall(call.name, {**call.arguments, p: wrong}))))
    out.append(("extra call", ref + [copy.deepcopy(ref[0])]))
    unexpected = next((k for k in props.get(call.name, {}) if k not in exp["arguments"]), None)
    out.append(("unexpected argument", swap(ToolCall(call.name, {**call.arguments, (unexpected or "zz_unknown"): 1}))))
    return out


@pytest.mark.parametrize("category", CATEGORIES)
def test_perturbed_answers_fail(category):
    rng = random.Random(f"perturb-{category}")
    labels = set()
    for item in _sample(category):
        spec = _spec(item)
        for label, calls in _perturbations(item, rng):
            v = verify(spec, _answer(calls))
            assert not v.passed and v.reward == 0.0, (item.id, label, format_tool_calls(calls))
            labels.add(label)
    assert {"wrong function", "missing required", "value outside allowed set", "wrong type", "extra call"} <= labels


def test_partial_credit_components_for_a_near_miss():
    item = next(it for it in load_bfcl("simple_python", limit=5) if it.id == "simple_python_0")
    spec = _spec(item)
    v = verify(spec, _answer([ToolCall("calculate_triangle_area", {"base": 10, "height": 6})]))
    assert not v.passed
    assert v.components["parseable"] == 1.0 and v.components["function_names"] == 1.0
    assert v.components["required_args"] == 1.0
    assert v.components["values"] == pytest.approx(2 / 3)  # base ok, unit omitted (optional) ok, height wrong
    partial = verify({**spec, "reward_mode": "partial"}, _answer([ToolCall("calculate_triangle_area", {"base": 10, "height": 6})]))
    assert 0.0 < partial.reward < 1.0 and not partial.passed


def test_underscore_alias_of_dotted_name_and_int_for_float():
    item = next(it for it in load_bfcl("simple_python", limit=3) if it.id == "simple_python_1")  # math.factorial
    spec = _spec(item)
    assert verify(spec, _answer([ToolCall("math_factorial", {"number": 5})])).passed
    assert not verify(spec, _answer([ToolCall("math_factorial", {"number": 5.0})])).passed  # float for integer
    assert not verify(spec, _answer([ToolCall("math.factorial", {"number": True})])).passed
