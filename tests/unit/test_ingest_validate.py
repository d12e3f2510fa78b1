"""The hand-written validator agrees with jsonschema on the published schema; the line parser never
raises (hypothesis: arbitrary bytes, arbitrary JSON, mutated valid traces)."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.ingest import formats
from flywheel.ingest.validate import Limits, check_schema, validate

FIX = Path(__file__).parents[1] / "fixtures" / "traces"
SCHEMA = json.loads(resources.files("flywheel.schemas").joinpath("trace.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
LIMITS = Limits("2000-01-01T00:00:00Z", 2, 512)


def _agree(rec) -> None:
    js_ok = VALIDATOR.is_valid(rec)
    mine = check_schema(rec)
    assert js_ok == (mine is None), f"jsonschema={js_ok}, mirror={mine} for {json.dumps(rec)[:400]}"


def test_schema_itself_is_valid():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def _fixture_records():
    out = []
    for name in ("examples.jsonl", "kinds.jsonl"):
        out += [json.loads(x) for x in (FIX / name).read_text().splitlines() if x.strip()]
    return out


@pytest.mark.parametrize("i", range(16))
def test_agrees_on_fixtures(i):
    _agree(_fixture_records()[i])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
PATHS_VALUES = st.sampled_from([
    ("trace_id",), ("timestamp",), ("model",), ("messages",), ("messages", 0), ("messages", 0, "role"),
    ("messages", 0, "content"), ("messages", 1, "tool_calls"), ("messages", 1, "tool_calls", 0, "function"),
    ("messages", 1, "tool_calls", 0, "function", "arguments"), ("messages", 1, "tool_calls", 0, "id"),
    ("tools",), ("tools", 0, "type"), ("tools", 0, "function", "name"), ("tools", 0, "function", "parameters"),
    ("outcome",), ("outcome", "status"), ("outcome", "feedback"), ("outcome", "feedback", "score"),
    ("outcome", "error"), ("correction",), ("correction", "tool_calls", 0, "arguments"),
    ("correction", "tool_calls", 0, "arguments", "city"), ("correction", "tool_calls", 0, "name"), ("metadata",),
    ("source",), ("source_id",), ("extra_top_level",), ("messages", 2),
])
SPECIAL = st.sampled_from([None, True, 1, 1.5, "", "x", "user", "tool", "failure", "function", [], {}, [{}],
                           {"one_of": 3}, {"one_of": [1], "optional": "yes"}, {"score": True}, {"score": -1}])


def _mutate(rec, path, value, delete):
    node = rec
    for k in path[:-1]:
        if isinstance(node, dict) and k in node:
            node = node[k]
        elif isinstance(node, list) and isinstance(k, int) and k < len(node):
            node = node[k]
        else:
            return rec
    last = path[-1]
    if isinstance(node, dict):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int):
        if last < len(node):
            if delete:
                node.pop(last)
            else:
                node[last] = value
        elif not delete:
            node.append(value)
    return rec


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 15), st.lists(st.tuples(PATHS_VALUES, st.one_of(SPECIAL, JSON), st.booleans()), max_size=3))
def test_agrees_on_mutated_traces(i, mutations):
    rec = copy.deepcopy(_fixture_records()[i])
    for path, value, delete in mutations:
        rec = _mutate(rec, path, value, delete)
    _agree(rec)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_agrees_on_arbitrary_json(value):
    _agree(value)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_line_parser_never_raises_on_bytes(data):
    obj, prob = formats.parse_json(data)
    assert (obj is None) == (prob is not None) or obj is None
    if prob is None:
        validate(obj, LIMITS)  # must not raise either
    else:
        assert prob[0] in ("invalid_json", "invalid_utf8")


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_parser_and_validator_never_raise_on_json(value):
    obj, prob = formats.parse_json(json.dumps(value).encode())
    assert prob is None
    p, _ = validate(obj, LIMITS)
    assert p is None or isinstance(p[0], str) and isinstance(p[1], str)
    formats.detect_format(obj)


def test_big_integers_and_nan():
    obj, prob = formats.parse_json(b'{"n": 123456789012345678901234567890}')
    assert prob is None and obj["n"] == pytest.approx(1.2345678901234568e29)  # orjson: beyond 64 bits -> float
    assert formats.parse_json(b'{"n": NaN}')[1][0] == "invalid_json"
    assert formats.parse_json(b'{"a": "\xff"}')[1][0] == "invalid_utf8"
    assert "truncated" in formats.parse_json(b'{"a": [1, 2')[1][1]


def test_semantic_checks():
    rec = _fixture_records()[4]  # ex-005: tool result answering call_5
    assert validate(rec, LIMITS) [0] is None
    bad = copy.deepcopy(rec)
    bad["messages"][2]["tool_call_id"] = "nope"
    assert validate(bad, LIMITS)[0][0] == "dangling_tool_result"
    bad = copy.deepcopy(rec)
    bad["messages"][1]["tool_calls"][0]["function"]["name"] = "undeclared"
    assert validate(bad, LIMITS)[0][0] == "tool_not_declared"
    bad["outcome"] = {"status": "failure"}
    assert validate(bad, LIMITS)[0] is None  # a failed trace may call an unknown tool: that's the failure
    assert validate({**rec, "timestamp": "2026-11-02T08:19:00"}, LIMITS)[0] is None  # zone-less = UTC
    assert validate({**rec, "timestamp": "3000-01-01T00:00:00Z"}, LIMITS)[0][0] == "timestamp_out_of_range"
    assert validate(rec, Limits("2000-01-01T00:00:00Z", 2, 3))[0][0] == "too_many_messages"
