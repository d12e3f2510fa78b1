"""The shared vocabulary (flywheel.vocab): one reader per idea, and the frozen variants as parameters."""

from __future__ import annotations

import json

import pytest

from flywheel.classify import classify
from flywheel.evals import CompileSkip, compile_success
from flywheel.verifiers import verify
from flywheel.vocab import (
    ArgumentsError,
    call_function,
    canonical_json,
    content_id,
    decode_arguments,
    decode_tool_calls,
    function_doc,
    function_of,
    json_id,
    model_entity,
    parse_model_entity,
    parse_model_ref,
    parse_tool_calls,
    parse_versioned_ref,
    require_text,
    short_id,
    text_of,
    tool_name,
    tool_names,
    tool_parameters,
    with_prefix,
)

PARTS = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "image_url", "image_url": {}},
         {"type": "text", "text": 5}, {"type": "text"}, "not a part"]


def test_text_of_default_rule_keeps_string_text_of_any_part():
    assert text_of(None) == "" and text_of("x") == "x" and text_of(7) == "7"
    assert text_of(PARTS) == "ab"
    assert text_of([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], sep=" ") == "a b"


def test_text_of_split_rule_is_the_recorded_one():
    # What flywheel.split hashed into request hashes: " " join, every object part's text as a string.
    recorded = " ".join(str(p.get("text", "")) for p in PARTS if isinstance(p, dict))
    assert text_of(PARTS, sep=" ", nonstring_text="stringify") == recorded == "a b  5 "


def test_text_of_otlp_rule_is_the_recorded_one():
    v = [{"content": "x"}, {"text": "y", "content": "z"}, {"type": "image"}]
    recorded = "".join(str(p.get("text", p.get("content", ""))) for p in v if isinstance(p, dict))
    got = text_of(v, nonstring_text="stringify", keys=("text", "content"), other=lambda x: json.dumps(x))
    assert got == recorded == "xy"
    assert text_of({"a": 1}, other=lambda x: json.dumps(x)) == '{"a": 1}'


def test_require_text_refuses_what_a_prompt_would_lose():
    assert require_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "m[0]") == "ab"
    with pytest.raises(ValueError, match="m\\[1\\]: only text content parts"):
        require_text([{"type": "image_url", "image_url": {}}], "m[1]")
    with pytest.raises(ValueError, match="content must be a string"):
        require_text(5, "m[2]")


NESTED = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}}
FLAT = {"type": "function", "name": "f", "parameters": {"type": "object", "required": ["x"]}}
BARE = {"name": "f", "description": "bfcl doc"}


def test_function_of_reads_both_tool_shapes():
    assert function_of(NESTED) is NESTED["function"] and function_of(FLAT) is FLAT and function_of(3) is None
    assert tool_name(NESTED) == tool_name(FLAT) == tool_name(BARE) == "f" and tool_name("x") == ""
    assert tool_parameters(NESTED)["required"] == ["x"] and tool_parameters(BARE) == {"type": "object", "properties": {}}
    assert tool_names([NESTED, {"type": "function", "function": {}}, BARE]) == ["f", "f"]
    assert function_doc(BARE) is BARE
    with pytest.raises(ValueError, match="no function name"):
        function_doc({"type": "function", "function": {"description": "x"}})


def test_call_function_nested_and_flat_entries():
    nested = {"id": "1", "function": {"name": "f", "arguments": "{}"}}
    flat = {"name": "f", "arguments": "{}"}
    assert call_function(nested) == {"name": "f", "arguments": "{}"}
    assert call_function(flat) is flat and call_function(flat, flat=False) == {} and call_function(None) == {}


# (raw arguments, decoded object or the error's reason)
ARGUMENT_CASES = [
    ("", {}), ("   ", {}), ("null", {}), (None, {}), ('{"x": 1}', {"x": 1}), ({"x": 1}, {"x": 1}),
    ('{"x": 1, "x": 2}', {"x": 2}),  # duplicate keys: the last wins, as json.loads and OpenAI's parser
    ("123456789012345678901234567890", "not an object"),
    ('{"n": 123456789012345678901234567890}', {"n": 123456789012345678901234567890}),  # exact, not a float
    ("[]", "a JSON list, not an object"), ("3", "a JSON int, not an object"), ('"s"', "a JSON str, not an object"),
    ('{"x": ', "not valid JSON"), ('{"x": NaN}', "not valid JSON"), ('{"x": Infinity}', "not valid JSON"),
    ('{"x": 1e999}', "non-finite"),
]


@pytest.mark.parametrize("raw,want", ARGUMENT_CASES)
def test_decode_arguments_one_rule(raw, want):
    if isinstance(want, dict):
        assert decode_arguments(raw) == want
    else:
        with pytest.raises(ArgumentsError, match=want):
            decode_arguments(raw)


def test_decode_tool_calls_reports_each_call_on_its_own():
    calls = decode_tool_calls([{"function": {"name": "f", "arguments": '{"a": 1}'}},
                               {"function": {"name": "g", "arguments": "{bad"}},
                               {"function": {"name": "h", "arguments": ""}}])
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("f", {"a": 1}, True), ("g", None, False),
                                                                         ("h", {}, True)]
    assert calls[1].raw == "{bad" and "not valid JSON" in calls[1].error


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("raw", ["", "  ", "null", '{"city": "Oslo"}', "[]", "3", '{"city": ', '{"city": NaN}'])
def test_tool_call_arguments_one_rule_in_classify_evals_and_verifier(raw):
    """Finding: three decoders disagreed (for ``arguments: ""`` the verifier and the eval compiler
    read ``{}`` while classification said ``invalid_json``; ``"null"`` skipped every check in
    classification and every regression eval in the compiler; NaN compiled into a record the store
    refuses). Now classification calls it malformed exactly when the verifier does, and a successful
    trace compiles exactly when the verifier accepts its call."""
    user = {"role": "user", "content": "Weather in Oslo?"}
    answer = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": raw}}]}
    verifier_ok = parse_tool_calls(answer).error is None
    trace = {"trace_id": "t", "messages": [user, answer], "tools": [WEATHER], "outcome": {"status": "failure"}}
    assert ("invalid_json" in classify(trace).kinds) == (not verifier_ok)
    spec = {"kind": "tool_call", "tools": [WEATHER], "expected": None}
    assert verify(spec, [user, answer]).components["parseable"] == float(verifier_ok)
    state = {"entity_id": "trace:t", "status": "success", "messages": [user, answer], "tools": [WEATHER],
             "outcome": {"status": "success"}}
    try:
        task = compile_success("trace:t", state)
        canonical_json(task)  # storable
        compiled = True
    except CompileSkip:
        compiled = False
    assert compiled == verifier_ok


def test_ids_and_refs():
    assert short_id("x") == short_id(b"x") and len(short_id("x", 8)) == 8
    assert json_id({"b": 1, "a": 2}) == json_id({"a": 2, "b": 1})
    assert content_id("rollouts", [1]).startswith("rollouts:") and len(content_id("r", [1])) == 2 + 16
    assert with_prefix("trace", "abc") == "trace:abc" == with_prefix("trace", "trace:abc")
    assert model_entity("policy", 3) == "model:policy/3" and parse_model_entity("model:a/b/3") == ("a/b", 3)
    with pytest.raises(ValueError, match="not a model version id"):
        parse_model_entity("model:policy")
    assert parse_versioned_ref("suite:heldout@3", "suite") == ("heldout", 3)
    for bad in ("@3", "heldout@0", "heldout@x"):
        with pytest.raises(ValueError):
            parse_versioned_ref(bad, "suite")


@pytest.mark.parametrize("ref,kind,version", [
    ("champion", "alias", None), ("challenger", "alias", None), ("model:policy/3", "version", 3),
    ("policy/4", "version", 4), ("5", "spec", None), ("http://h:1/v1", "url", None), ("tiny", "spec", None),
    ("./models/3", "spec", None),
])
def test_parse_model_ref(ref, kind, version):
    r = parse_model_ref(ref, model_name="policy")
    assert (r.kind, r.version) == (kind, version)
    assert parse_model_ref("5", model_name="policy", bare_version=True).version == 5


def test_canonical_json_refuses_nan_unless_asked():
    """Event payloads refuse NaN; the recorded-tool matcher and JSON artifacts always wrote it."""
    value = {"é": [1.5, float("nan"), float("-inf")], "a": None}
    with pytest.raises(ValueError):
        canonical_json(value)
    assert canonical_json(value, allow_nan=True) == '{"a":null,"é":[1.5,NaN,-Infinity]}'


@pytest.mark.parametrize("ref,want", [
    ("heldout", ("heldout", None)), ("heldout@3", ("heldout", 3)), ("suite:heldout@3", ("heldout", 3)),
    ("suite:heldout", ("heldout", None)),
])
def test_suite_references_read_alike_in_vocab_and_evaluate(ref, want):
    from flywheel.evaluate import parse_suite_spec

    assert parse_versioned_ref(ref, "suite") == parse_suite_spec(ref) == want


@pytest.mark.parametrize("ref,message", [
    ("x@0", r"'x@0': version 0 is not >= 1 \(versions start at 1\)"),
    ("suite:x@-2", r"'suite:x@-2': version -2 is not >= 1"),
    ("a@b@3", r"'a@b@3': a suite name cannot contain '@'"),
    ("suite:a@b@3", r"'suite:a@b@3': a suite name cannot contain '@'"),
    ("x@", r"'x@': version '' is not an integer"),
    ("x@three", r"'x@three': version 'three' is not an integer"),
    ("@3", r"'@3': empty suite name"),
    ("suite:", r"'suite:': empty suite name"),
])
def test_suite_references_refused_alike_naming_the_input(ref, message):
    """One behaviour for both readers: versions start at 1 and names never contain '@'."""
    from flywheel.evaluate import EvaluationError, parse_suite_spec

    with pytest.raises(ValueError, match=message):
        parse_versioned_ref(ref, "suite")
    with pytest.raises(EvaluationError, match=message):
        parse_suite_spec(ref)
