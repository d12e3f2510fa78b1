"""Tool-call parsing and canonical formatting (flywheel.vocab.toolcalls)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.verifiers import ToolCall, format_tool_calls, parse_tool_calls


def test_openai_tool_calls_with_json_string_arguments():
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}},
        ],
    }
    r = parse_tool_calls(msg)
    assert r.format == "openai" and r.error is None
    assert r.calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_time", {"tz": "UTC"})]


def test_openai_malformed_arguments_is_an_error_not_a_crash():
    msg = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad json"}}]}
    r = parse_tool_calls(msg)
    assert r.calls == [] and r.format == "none" and "not valid JSON" in r.error


def test_json_in_text_fenced_bare_and_tagged():
    fenced = 'Sure.\n```json\n{"name": "f", "arguments": {"x": 1}}\n```'
    bare = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "arguments": "{\\"y\\": 2}"}]'
    tagged = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse_tool_calls(fenced).calls == [ToolCall("f", {"x": 1})]
    assert parse_tool_calls(bare).calls == [ToolCall("f", {"x": 1}), ToolCall("g", {"y": 2})]
    r = parse_tool_calls(tagged)
    assert r.format == "json" and [c.name for c in r.calls] == ["f", "g"]


def test_pythonic_bfcl_style_with_dotted_names_and_nested_literals():
    r = parse_tool_calls('[fn(a=1, b="x"), mod.sub.fn2(x=[1, 2], d={"k": (1, 2)}, n=-3.5, z=None, t=True)]')
    assert r.format == "pythonic" and r.error is None
    assert r.calls == [
        ToolCall("fn", {"a": 1, "b": "x"}),
        ToolCall("mod.sub.fn2", {"x": [1, 2], "d": {"k": [1, 2]}, "n": -3.5, "z": None, "t": True}),
    ]
    assert parse_tool_calls("calculate(x=2)").calls == [ToolCall("calculate", {"x": 2})]


def test_pythonic_never_evaluates_code(tmp_path):
    marker = tmp_path / "pwned"
    attacks = [
        f'f(a=__import__("os").system("touch {marker}"))',
        f'__import__("os").system("touch {marker}")',
        f'f(a=open("{marker}", "w"))',
        "f(a=[x for x in range(10**9)])",
        "f(a=1+2)",
        "f(a={1, 2})",
        "f(1, 2)",
        "f(**{'a': 1})",
        "f(a=1, a=2)",
    ]
    for text in attacks:
        r = parse_tool_calls(text)
        assert r.calls == [], text
        assert r.error, text
    assert not marker.exists()


def test_prose_is_no_call_and_malformed_call_is_an_error():
    prose = parse_tool_calls("The capital of France is Paris.")
    assert prose.calls == [] and prose.format == "none" and prose.error is None
    broken = parse_tool_calls('[get_weather(city="Paris"')
    assert broken.calls == [] and broken.error is not None


def test_strict_json_rejects_nan_duplicate_keys_and_huge_input():
    assert parse_tool_calls('{"name": "f", "arguments": {"x": NaN}}').calls == []
    assert parse_tool_calls('{"name": "f", "arguments": {"x": 1, "x": 2}}').calls == []
    assert parse_tool_calls("[" * 300_000).error is not None
    deep = "f(a=" + "[" * 5000 + "]" * 5000 + ")"
    assert parse_tool_calls(deep).calls == []


def test_toolcall_equality_is_type_strict_and_hashable():
    assert ToolCall("f", {"a": 1}) != ToolCall("f", {"a": True})
    assert ToolCall("f", {"a": 1}) != ToolCall("f", {"a": 1.0})
    assert ToolCall("f", {"a": 1, "b": 2}) == ToolCall("f", {"b": 2, "a": 1})
    assert len({ToolCall("f", {"a": [1]}), ToolCall("f", {"a": [1]})}) == 1
    oa = ToolCall("f", {"a": 1}).to_openai("id1")
    assert json.loads(oa["function"]["arguments"]) == {"a": 1}


def test_format_is_canonical_and_deterministic():
    calls = [ToolCall("m.f", {"b": "it's", "a": [1.5, None, True], "d": {"k": "v"}}), ToolCall("g", {})]
    s = format_tool_calls(calls)
    assert s == "[m.f(b=\"it's\", a=[1.5, None, True], d={'k': 'v'}), g()]"
    assert parse_tool_calls(s).calls == calls
    assert format_tool_calls([]) == "[]"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: s not in {"if", "in", "is", "or", "as", "and", "not", "for", "def", "del", "try", "else", "elif", "from", "with", "pass", "None", "True", "False"})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(identifiers, min_size=1, max_size=3), st.dictionaries(identifiers, json_values, max_size=4)), max_size=3))
def test_format_parse_round_trip(spec):
    calls = [ToolCall(".".join(parts), args) for parts, args in spec]
    text = format_tool_calls(calls)
    r = parse_tool_calls(text)
    if calls:
        assert r.error is None and r.calls == calls
    else:
        assert r.calls == []


def test_decision_spans_mark_names_and_the_character_after_each_value_and_call():
    from flywheel.vocab.toolcalls import ToolCall, format_tool_calls, tool_call_decisions

    calls = [ToolCall("geo.find", {"city": "Tel Aviv, Israel", "n": 2}), ToolCall("now", {})]
    text, spans = tool_call_decisions(calls)
    assert text == format_tool_calls(calls) == "[geo.find(city='Tel Aviv, Israel', n=2), now()]"
    assert [(text[a:b], kind) for a, b, kind in spans] == [
        ("geo.find", "function"), ("city", "argument"), (",", "arguments_end"), ("n", "argument"),
        (")", "arguments_end"), (",", "calls_end"), ("now", "function"), (")", "arguments_end"), ("]", "calls_end"),
    ]
