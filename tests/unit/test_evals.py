"""Failure kind -> verifier: every compiled eval passes with the correction and fails with the
original failing answer, end to end through the verifier library (and the sandbox for code)."""

from __future__ import annotations

import httpx
import pytest

from flywheel.envs.harness import verify_task
from flywheel.envs.testing import failure_payload, openai_call, tool_spec
from flywheel.evals import (
    CompileSkip,
    compile_failure,
    compile_success,
    reference_from_correction,
)
from flywheel.policy.format import render_answer
from flywheel.tasks import validate_task
from flywheel.verifiers import ToolCall, VerifyContext

WEATHER = tool_spec(
    "get_weather",
    {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    ["city"],
)
BOOK = tool_spec(
    "book_table",
    {"restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1}, "time": {"type": "string"}},
    ["restaurant", "people", "time"],
)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def answer_text(task: dict) -> dict:
    """The reference answer as the model would write it (the shared pythonic format)."""
    ref = task["reference"]
    if "tool_calls" in ref:
        text = render_answer([ToolCall(c["name"], c["arguments"]) for c in ref["tool_calls"]])
    else:
        text = ref["content"]
    return {"role": "assistant", "content": text}


def grade(task: dict, answer: dict, context=None):
    return verify_task(task, [*task["prompt"]["messages"], answer], context)


TOOL_CASES = [
    # kind, request, tools, bad answer, correction
    ("missing_required_arg", "Weather in Porto please, in celsius.", [WEATHER],
     openai_call("get_weather", {"unit": "celsius"}),
     {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Porto", "unit": {"one_of": ["celsius"], "optional": True}}}]}),
    ("unknown_tool", "Table for 4 at Tasca at 20:30", [BOOK],
     openai_call("reserve", {"restaurant": "Tasca", "people": 4, "time": "20:30"}),
     {"tool_calls": [{"name": "book_table", "arguments": {"restaurant": "Tasca", "people": 4, "time": "20:30"}}]}),
    ("wrong_arg_type", "Book 2 people at Nomad, 19:00", [BOOK],
     openai_call("book_table", {"restaurant": "Nomad", "people": "two", "time": "19:00"}),
     {"tool_calls": [{"name": "book_table", "arguments": {"restaurant": "Nomad", "people": 2, "time": "19:00"}}]}),
    ("wrong_arg_value", "Weather in Lima in fahrenheit", [WEATHER],
     openai_call("get_weather", {"city": "Lima", "unit": "celsius"}),
     {"tool_calls": [{"name": "get_weather", "arguments": {"city": {"one_of": ["Lima", "Lima, Peru"]}, "unit": "fahrenheit"}}]}),
    ("no_tool_call", "Weather in Oslo?", [WEATHER],
     {"role": "assistant", "content": "It is probably cold in Oslo."},
     {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}),
    ("extra_tool_call", "Weather in Oslo?", [WEATHER, BOOK],
     {"role": "assistant", "content": None, "tool_calls": [
         openai_call("get_weather", {"city": "Oslo"})["tool_calls"][0],
         openai_call("book_table", {"restaurant": "X", "people": 1, "time": "10:00"}, "call_2")["tool_calls"][0]]},
     {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}),
    ("invalid_json", "Weather in Oslo?", [WEATHER],
     openai_call("get_weather", '{"city": "Oslo"'),
     {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}),
]


@pytest.mark.parametrize("kind,request_,tools,bad,correction", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_tool_kinds_compile_to_tool_call_pass_with_correction_fail_with_bad_answer(kind, request_, tools, bad, correction):
    f = failure_payload(user(request_), tools, bad, [kind], correction=correction)
    task = compile_failure(f)
    validate_task(task)
    assert task["verifier"]["kind"] == "tool_call"
    assert task["verifier"]["expected"] == correction["tool_calls"]
    assert task["metadata"]["weak"] is False and task["metadata"]["deterministic"] is True
    assert task["harness"] == "single_turn"
    assert task["task_id"].startswith("eval:")
    assert not grade(task, bad).passed, f"{kind}: the original failing answer must fail"
    good = grade(task, answer_text(task))
    assert good.passed and good.reward == 1.0, f"{kind}: the correction must pass ({good.details})"
    # The correction also passes in OpenAI tool_calls form, not only as pythonic text.
    calls = task["reference"]["tool_calls"]
    as_openai = {"role": "assistant", "content": None,
                 "tool_calls": [ToolCall(c["name"], c["arguments"]).to_openai(f"c{i}") for i, c in enumerate(calls)]}
    assert grade(task, as_openai).passed


def test_tool_kind_without_correction_checks_validity_only_and_is_weak():
    bad = openai_call("book_table", {"restaurant": "Nomad", "people": "two", "time": "19:00"})
    task = compile_failure(failure_payload(user("Book 2 people at Nomad, 19:00"), [BOOK], bad, ["wrong_arg_type"]))
    assert task["verifier"] == {"kind": "tool_call", "tools": [BOOK], "expected": None, "order_sensitive": False}
    assert task["metadata"]["weak"] is True and task["reference"] is None
    assert not grade(task, bad).passed
    fixed = {"role": "assistant", "content": "[book_table(restaurant='Nomad', people=2, time='19:00')]"}
    assert grade(task, fixed).passed


def test_wrong_arg_value_without_correction_is_skipped_with_a_reason():
    f = failure_payload(user("Weather in Lima"), [WEATHER], openai_call("get_weather", {"city": "Rome"}),
                        ["wrong_arg_value"])
    with pytest.raises(CompileSkip, match="wrong_arg_value without a correction"):
        compile_failure(f)


def test_content_correction_on_a_tool_kind_means_no_call_is_right():
    bad = openai_call("book_table", {"restaurant": "Tasca", "people": 2, "time": "20:00"})
    f = failure_payload(user("Cancel my booking"), [BOOK], bad, ["extra_tool_call"],
                        correction={"content": "I cannot cancel bookings."})
    task = compile_failure(f)
    assert task["verifier"]["expected"] == []
    assert not grade(task, bad).passed
    assert grade(task, {"role": "assistant", "content": "Sorry, I cannot cancel bookings."}).passed


def test_invalid_json_on_content_compiles_to_json_schema_with_the_response_format():
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"}},
              "required": ["city", "temp"]}
    f = failure_payload(user("Give me Oslo's weather as JSON"), [], {"role": "assistant", "content": '{"city": "Oslo", temp: 3}'},
                        ["invalid_json"])
    f["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    task = compile_failure(f)
    assert task["verifier"] == {"kind": "json_schema", "schema": schema}
    assert task["metadata"]["weak"] is False
    assert not grade(task, f["bad_answer"]).passed
    assert not grade(task, {"role": "assistant", "content": '{"city": "Oslo"}'}).passed  # valid JSON, wrong shape
    assert grade(task, {"role": "assistant", "content": '{"city": "Oslo", "temp": 3}'}).passed


def test_invalid_json_on_content_without_schema_is_weak_any_json():
    f = failure_payload(user("JSON please"), [], {"role": "assistant", "content": "{oops"}, ["invalid_json"])
    task = compile_failure(f)
    assert task["verifier"] == {"kind": "json_schema", "schema": {}} and task["metadata"]["weak"] is True
    assert not grade(task, f["bad_answer"]).passed
    assert grade(task, {"role": "assistant", "content": '{"ok": true}'}).passed


def test_invalid_json_on_a_tool_call_without_correction_checks_the_tool_schema():
    bad = openai_call("get_weather", '{"city": "Oslo"')
    task = compile_failure(failure_payload(user("Weather in Oslo?"), [WEATHER], bad, ["invalid_json"]))
    assert task["verifier"]["kind"] == "tool_call" and task["verifier"]["expected"] is None
    assert not grade(task, bad).passed
    assert not grade(task, {"role": "assistant", "content": "[get_weather(city=3)]"}).passed  # schema: string
    assert grade(task, {"role": "assistant", "content": "[get_weather(city='Oslo')]"}).passed


@pytest.mark.parametrize("bad_content", [
    "[get_weather(city='Os",  # a pythonic call cut off at the token limit (the demo's BFCL traffic)
    '{"name": "get_weather", "arguments": {"city": "Oslo"',  # a call written as broken JSON text
])
def test_invalid_json_content_to_a_request_with_tools_is_judged_against_the_correction(bad_content):
    # Found by the learning stage's probe: a quarter of the demo's evals (31 of 96 train-side, 11 of 44
    # held-out) compiled to json_schema {} ("any JSON"), which failed the correction itself and passed "{}".
    bad = {"role": "assistant", "content": bad_content}
    correction = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    task = compile_failure(failure_payload(user("Weather in Oslo?"), [WEATHER], bad, ["invalid_json"],
                                           correction=correction))
    assert task["verifier"]["kind"] == "tool_call" and task["verifier"]["expected"] == correction["tool_calls"]
    assert task["metadata"]["verifier_kind"] == "tool_call" and task["metadata"]["weak"] is False
    assert grade(task, answer_text(task)).passed, "the correction must pass its own eval"
    assert not grade(task, bad).passed
    assert not grade(task, {"role": "assistant", "content": "{}"}).passed  # any JSON is not an answer
    assert not grade(task, {"role": "assistant", "content": "[get_weather(city='Lima')]"}).passed
    # no correction: the calls must still be valid against the tool's schema (weak)
    weak = compile_failure(failure_payload(user("Weather in Oslo?"), [WEATHER], bad, ["invalid_json"]))
    assert weak["verifier"]["kind"] == "tool_call" and weak["verifier"].get("expected") is None
    assert weak["metadata"]["weak"] is True
    assert grade(weak, {"role": "assistant", "content": "[get_weather(city='Oslo')]"}).passed
    assert not grade(weak, {"role": "assistant", "content": "{}"}).passed


def test_invalid_json_content_with_tools_stays_json_schema_when_json_was_the_answer():
    # a response format: the content had to follow it, tools or not
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    f = failure_payload(user("Oslo's weather as JSON"), [WEATHER], {"role": "assistant", "content": '{"city": Oslo}'},
                        ["invalid_json"])
    f["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    assert compile_failure(f)["verifier"] == {"kind": "json_schema", "schema": schema}
    # a text correction: the right answer was content, not a call
    f2 = failure_payload(user("Reply with JSON"), [WEATHER], {"role": "assistant", "content": "{oops"}, ["invalid_json"],
                         correction={"content": '{"ok": true}'})
    assert compile_failure(f2)["verifier"]["kind"] == "json_schema"


SLUG_TESTS = (
    "from solution import slugify\n\n"
    "def test_basic():\n    assert slugify('Hello World') == 'hello-world'\n\n"
    "def test_punct():\n    assert slugify('Hello, World!') == 'hello-world'\n"
)


def test_test_failure_compiles_to_python_tests_and_runs_in_the_sandbox():
    bad = {"role": "assistant", "content": "```python\ndef slugify(s):\n    return s.lower().replace(' ', '-')\n```"}
    f = failure_payload(user("Write slugify(s): lowercase, words joined by '-', drop non-alphanumerics."), [], bad,
                        ["test_failure"], tests=SLUG_TESTS)
    task = compile_failure(f)
    assert task["verifier"] == {"kind": "python_tests", "tests": SLUG_TESTS}
    v_bad = grade(task, bad)
    assert not v_bad.passed and v_bad.infra_error is None and v_bad.components["tests"] == 0.5
    good = ("```python\nimport re\n\ndef slugify(s):\n"
            "    return '-'.join(re.findall(r'[a-z0-9]+', s.lower()))\n```")
    v_good = grade(task, {"role": "assistant", "content": good})
    assert v_good.passed and v_good.components["tests"] == 1.0


WEATHER_CODE = (
    "def get_weather(city, unit='celsius'):\n"
    "    table = {'Oslo': 3, 'Lima': 20}\n"
    "    return {'city': city, 'temp': table[city], 'unit': unit}\n"
)


def test_runtime_exception_with_tool_code_replays_the_answer_in_the_sandbox():
    bad = openai_call("get_weather", {"city": "Olso"})  # KeyError in the implementation
    f = failure_payload(user("Weather in Oslo?"), [WEATHER], bad, ["runtime_exception"], error="KeyError: 'Olso'")
    task = compile_failure(f, trace_state={"metadata": {"tool_code": WEATHER_CODE}})
    assert task["verifier"]["kind"] == "tool_call" and task["metadata"]["verifier_kind"] == "tool_call+replay"
    assert task["tool_env"] == {"recorded": [], "python": WEATHER_CODE, "replay": True}
    v_bad = grade(task, bad)
    assert not v_bad.passed and v_bad.components["replay_no_raise"] == 0.0
    assert "KeyError" in str(v_bad.details["replay"])
    v_good = grade(task, {"role": "assistant", "content": "[get_weather(city='Oslo')]"})
    assert v_good.passed and v_good.components["replay_no_raise"] == 1.0


def test_runtime_exception_without_code_falls_back_to_tool_call_validity():
    bad = openai_call("get_weather", {"town": "Oslo"})
    task = compile_failure(failure_payload(user("Weather in Oslo?"), [WEATHER], bad, ["runtime_exception"]))
    assert task["verifier"]["kind"] == "tool_call" and task["tool_env"] is None and task["metadata"]["weak"]
    assert not grade(task, bad).passed
    assert grade(task, {"role": "assistant", "content": "[get_weather(city='Oslo')]"}).passed


def _judge(score_for: dict[str, float]):
    """A fake OpenAI-compatible judge: the score depends on which phrase the graded answer holds."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = request.read().decode()
        score = next((s for phrase, s in score_for.items() if phrase in body.split("<<<ANSWER")[-1]), 0.0)
        return httpx.Response(200, json={"choices": [{"message": {"content": f"SCORE: {score}"}}]})

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_negative_feedback_compiles_to_a_non_deterministic_llm_judge():
    bad = {"role": "assistant", "content": "Sure! I have cancelled it."}
    f = failure_payload(user("Cancel my booking"), [BOOK], bad, ["negative_feedback"],
                        feedback={"score": -1, "comment": "there is no cancel tool; should say it cannot"})
    task = compile_failure(f)
    assert task["verifier"]["kind"] == "llm_judge" and task["metadata"]["deterministic"] is False
    assert "there is no cancel tool" in task["verifier"]["rubric"] and "Cancel my booking" in task["verifier"]["rubric"]
    from flywheel.config import JudgeConfig

    ctx = VerifyContext(judge=JudgeConfig(base_url="http://judge.test"), http_client=_judge({"cannot": 0.9}))
    v_bad = grade(task, bad, ctx)
    assert not v_bad.passed and v_bad.deterministic is False and v_bad.infra_error is None
    assert grade(task, {"role": "assistant", "content": "I cannot cancel bookings, sorry."}, ctx).passed
    # No endpoint: an infrastructure error, never a candidate failure.
    assert grade(task, bad).infra_error


def test_deterministic_kind_wins_over_negative_feedback():
    bad = openai_call("get_weather", {"city": "Rome"})
    corr = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    task = compile_failure(failure_payload(user("Weather in Oslo?"), [WEATHER], bad,
                                           ["negative_feedback", "wrong_arg_value"], correction=corr))
    assert task["verifier"]["kind"] == "tool_call" and task["metadata"]["deterministic"] is True


def test_other_kind_without_correction_is_skipped_and_with_content_correction_is_exact():
    f = failure_payload(user("Hi"), [], {"role": "assistant", "content": "Bye"}, ["other"])
    with pytest.raises(CompileSkip, match="no verifier"):
        compile_failure(f)
    f["correction"] = {"content": "Hello!"}
    task = compile_failure(f)
    assert task["verifier"] == {"kind": "exact", "expected": "Hello!"}
    assert not grade(task, f["bad_answer"]).passed and grade(task, answer_text(task)).passed


def test_reference_takes_literals_first_allowed_values_and_omits_optional_args():
    corr = {"tool_calls": [{"name": "get_weather", "arguments": {
        "city": {"one_of": ["", "Porto", "Oporto"]}, "unit": {"one_of": ["celsius"], "optional": True}}}]}
    assert reference_from_correction(corr, [WEATHER]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Porto"}}]}
    # An argument the *schema* requires is kept even when the correction calls it optional.
    corr["tool_calls"][0]["arguments"]["city"] = {"one_of": ["Porto"], "optional": True}
    assert reference_from_correction(corr, [WEATHER])["tool_calls"][0]["arguments"] == {"city": "Porto"}
    assert reference_from_correction({"content": "x"}) == {"content": "x"}
    assert reference_from_correction(None) is None


def test_success_single_turn_call_becomes_a_strict_regression_eval():
    msgs = [*user("Weather in Lima in fahrenheit"), openai_call("get_weather", {"city": "Lima", "unit": "fahrenheit"})]
    task = compile_success("trace:s1", {"messages": msgs, "tools": [WEATHER], "status": "success"})
    assert task["harness"] == "single_turn" and task["verifier"]["kind"] == "tool_call"
    assert grade(task, msgs[-1]).passed  # the recorded answer must still verify
    assert not grade(task, {"role": "assistant", "content": "[get_weather(city='Lima')]"}).passed


def test_success_multi_turn_becomes_a_tool_loop_with_recorded_outputs():
    msgs = [
        *user("Weather in Lima in fahrenheit"),
        openai_call("get_weather", {"city": "Lima", "unit": "fahrenheit"}, "call_5"),
        {"role": "tool", "tool_call_id": "call_5", "content": '{"temp": 68, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 68F and clear in Lima."},
    ]
    task = compile_success("trace:s2", {"messages": msgs, "tools": [WEATHER], "outcome": {"status": "success"}})
    validate_task(task)
    assert task["harness"] == "tool_loop" and task["verifier"]["scope"] == "all"
    assert task["tool_env"]["recorded"] == [
        {"name": "get_weather", "arguments": {"city": "Lima", "unit": "fahrenheit"}, "content": '{"temp": 68, "sky": "clear"}'}]
    assert task["prompt"]["messages"] == msgs[:1]
    assert verify_task(task, msgs).passed  # the whole recorded episode still verifies
    assert not verify_task(task, [msgs[0], msgs[-1]]).passed  # answering without the call does not


def test_invalid_specs_become_compile_skips_not_crashes():
    f = failure_payload(user("Write f"), [], {"role": "assistant", "content": "x"}, ["test_failure"],
                        tests="print('no test functions here')\n")
    with pytest.raises(CompileSkip, match="invalid verifier spec"):
        compile_failure(f)
