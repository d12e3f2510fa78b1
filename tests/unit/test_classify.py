"""Failure classification: one trace per kind, hand-built; identity normalisation."""

from __future__ import annotations

import json

import pytest

from flywheel.classify import FAILURE_KINDS, classify, failure_identity

TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"people": {"type": "integer"}, "time": {"type": "string"},
                                     "size": {"type": "string", "enum": ["s", "m"]}},
    "required": ["people"]}}}]


def _t(assistant, outcome=None, correction=None, tools=TOOLS, user="book 2"):
    t = {"trace_id": "t", "timestamp": "2026-11-02T09:00:00Z", "model": "m", "tools": tools,
         "messages": [{"role": "user", "content": user}, assistant], "outcome": outcome or {"status": "failure"}}
    if correction is not None:
        t["correction"] = correction
    return t


def _call(name, args):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}]}


CORR = {"tool_calls": [{"name": "book", "arguments": {"people": 2, "time": {"one_of": ["19:00"], "optional": True}}}]}

CASES = {
    "invalid_json": _t(_call("book", '{"people": 2')),
    "unknown_tool": _t(_call("reserve", {"people": 2})),
    "missing_required_arg": _t(_call("book", {"time": "19:00"})),
    "wrong_arg_type": _t(_call("book", {"people": "two"})),
    "wrong_arg_value": _t(_call("book", {"people": 3}), correction=CORR),
    "no_tool_call": _t({"role": "assistant", "content": "Done!"}, correction=CORR),
    "extra_tool_call": _t({"role": "assistant", "content": None, "tool_calls": [
        _call("book", {"people": 2})["tool_calls"][0], _call("book", {"people": 2})["tool_calls"][0]]}, correction=CORR),
    "test_failure": _t({"role": "assistant", "content": "def f(): return 1"}, tools=[],
                       outcome={"status": "failure", "tests": "def test(): assert False", "error": "AssertionError"}),
    "runtime_exception": _t({"role": "assistant", "content": "def f(): return 1/0"}, tools=[],
                            outcome={"status": "failure", "tests": "x", "error": "Traceback (most recent call last):\n ZeroDivisionError"}),
    "negative_feedback": _t({"role": "assistant", "content": "Sure."}, outcome={"status": "success", "feedback": {"score": -1}}),
    "other": _t({"role": "assistant", "content": "Hmm."}),
}


@pytest.mark.parametrize("kind", FAILURE_KINDS)
def test_each_kind(kind):
    c = classify(CASES[kind])
    assert c.failed and c.kinds == [kind], (c.kinds, c.details)


def test_enum_violation_pythonic_text_and_success():
    assert classify(_t(_call("book", {"people": 2, "size": "xl"}))).kinds == ["wrong_arg_value"]
    # text answers are read with the shared parser (BFCL pythonic format)
    c = classify(_t({"role": "assistant", "content": "[book(people='2')]"}))
    assert c.kinds == ["wrong_arg_type"] and c.calls[0].name == "book"
    ok = classify(_t(_call("book", {"people": 2}), outcome={"status": "success"}))
    assert not ok.failed and ok.kinds == []
    # a declared kind is kept; an unknown declared kind is recorded in details
    assert "wrong_arg_value" in classify(_t({"role": "assistant", "content": "x"},
                                            outcome={"status": "failure", "kind": "wrong_arg_value"})).kinds
    c = classify(_t({"role": "assistant", "content": "x"}, outcome={"status": "failure", "kind": "weird"}))
    assert c.kinds == ["other"] and "weird" in c.details[0]


def test_identity_normalises_whitespace_and_case_only():
    a = _t(_call("book", {"people": 3}), user="Book  2\nplease")
    b = _t(_call("book", {"people": 3}), user="book 2 PLEASE")
    c = _t(_call("book", {"people": 4}), user="book 2 please")
    b["trace_id"], b["timestamp"], b["model"] = "other", "2026-12-01T00:00:00Z", "m2"
    assert failure_identity(a) == failure_identity(b)
    assert failure_identity(a)[0] != failure_identity(c)[0]
    fid, h = failure_identity(a)
    assert fid == "failure:" + h[:16] and len(h) == 64


def test_parser_exception_in_an_unparsed_answer_is_not_a_runtime_exception():
    # A BFCL replay of a half-written call: the adapter's error names the parser's SyntaxError. Nothing
    # ran, so the failure is a malformed call, not a runtime exception of the tool.
    assistant = {"role": "assistant", "content": "[book(people=2, time="}
    c = classify(_t(assistant, outcome={"status": "failure",
                                        "error": "not valid Python call syntax (SyntaxError: invalid syntax)"}))
    assert c.failed and "invalid_json" in c.kinds and "runtime_exception" not in c.kinds
    # The same error text after a call that parsed and ran is a runtime exception.
    ran = _call("book", {"people": 2, "time": "19:00"})
    c2 = classify(_t(ran, outcome={"status": "failure", "error": "ValueError: kitchen closed"}))
    assert "runtime_exception" in c2.kinds


# -- the fast paths agree with what they skip --------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Texts made of call-like tokens, so the parser's branches (tags, fences, JSON, pythonic, "name":) are hit.
_CALLISH_TEXT = st.lists(st.sampled_from(list("ab_.=:,'\" \n\t()[]{}<>`12\u00a0\x1e") + [
    '"name"', "<tool_call>", "</tool_call>", "```", "f(x=1)", '{"name": "f"}', "name:"]), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_CALLISH_TEXT, st.text(max_size=40)))
def test_could_hold_a_call_is_false_only_when_the_parser_finds_nothing(text):
    from flywheel.classify import could_hold_a_call
    from flywheel.vocab.toolcalls import parse_tool_calls

    if not could_hold_a_call(text):
        res = parse_tool_calls(text)
        assert res.calls == [] and res.error is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aB \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\u00a0\u2028\u3000ß")), max_size=30))
def test_normalise_text_equals_the_regex_definition(text):
    import re

    from flywheel.classify import normalise_text

    assert normalise_text(text) == re.sub(r"\s+", " ", text).strip().casefold()


def test_prose_answers_with_tools_still_classify_through_the_parser():
    # "Done!" cannot hold a call (no_tool_call, as before); call-shaped text still goes to the parser.
    assert classify(CASES["no_tool_call"]).kinds == ["no_tool_call"]
    c = classify(_t({"role": "assistant", "content": "I will call book(people=2"}))
    assert c.kinds == ["invalid_json"]
