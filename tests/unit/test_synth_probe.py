"""The probe that aims the synthesis: error kinds of recorded answers counted by hand, the plan
following the counts, and greedy decoding through the policy interface (scripted and tiny HF)."""

from __future__ import annotations

import pytest

from flywheel.envs.testing import ScriptedPolicy, tool_spec
from flywheel.synth.probe import (
    ERROR_KINDS,
    PLANNED_GENERATORS,
    UNSCORED,
    answer_kinds,
    classify_answer,
    plan_generators,
    probe_counts,
    run_probe,
)

WEATHER = tool_spec("get_current_weather", {
    "location": {"type": "string", "description": "The city and country, e.g. Paris, France. Format: City, Country."},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"], "Current weather of a city.")
CURRENCY = tool_spec("convert_currency", {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                                          "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"],
                     "Convert an amount between currencies.")
AREA = tool_spec("geometry.area_circle", {"radius": {"type": "number"}}, ["radius"], "Area of a circle.")
RESTAURANTS = tool_spec("find_restaurants", {"location": {"type": "string"}, "cuisine": {"type": "string"}},
                        ["location"], "Restaurants near a place.")
FLIGHT = tool_spec("book_flight", {"origin": {"type": "string"}, "destination": {"type": "string"},
                                   "date": {"type": "string", "description": "Format: yyyy-mm-dd."}},
                   ["origin", "destination", "date"], "Book a flight.")


def _task(tid: str, text: str, tools: list[dict], expected: list[dict], **verifier) -> dict:
    ref = ({"tool_calls": [{"name": e["name"], "arguments": {k: (v["one_of"][0] if isinstance(v, dict) else v)
                                                             for k, v in e["arguments"].items()
                                                             if not (isinstance(v, dict) and v.get("optional"))}}
                           for e in expected]} if expected else {"content": "No function fits."})
    return {"task_id": tid, "prompt": {"messages": [{"role": "user", "content": text}], "tools": tools},
            "verifier": {"kind": "tool_call", "tools": tools, "expected": expected, **verifier},
            "harness": "single_turn", "tool_env": None, "reference": ref, "metadata": {"split": "train"}}


TEL_AVIV = [{"name": "get_current_weather", "arguments": {"location": {"one_of": ["Tel Aviv, Israel"], "optional": False},
                                                          "unit": {"one_of": ["celsius", ""], "optional": True}}}]
CONVERT = [{"name": "convert_currency", "arguments": {"amount": 100, "from_currency": "USD", "to_currency": "EUR"}}]
BOOK = [{"name": "book_flight", "arguments": {"origin": "Boston", "destination": "Denver", "date": "2024-05-01"}}]
TWO_AREAS = [{"name": "geometry.area_circle", "arguments": {"radius": 3}},
             {"name": "geometry.area_circle", "arguments": {"radius": 5}}]
MANY = [AREA, WEATHER, CURRENCY, RESTAURANTS]

# (task, recorded answer, its primary kind as worked out by hand)
RECORDED = [
    (_task("t01", "How is the weather in Tel Aviv?", [WEATHER], TEL_AVIV),
     "[get_current_weather(location='Tel Aviv')]", "wrong_value"),
    (_task("t02", "How is the weather in Tel Aviv?", [WEATHER], TEL_AVIV),
     "[get_current_weather(location='Tel Aviv, Israel')]", None),
    (_task("t03", "Convert 100 USD to EUR.", MANY, CONVERT),
     "[get_current_weather(location='Paris, France')]", "wrong_function"),
    (_task("t04", "Book a flight from Boston to Denver on May 1, 2024.", [FLIGHT], BOOK),
     "[book_flight(origin='Boston', destination='Denver')]", "missing_argument"),
    (_task("t05", "Book a flight from Boston to Denver on May 1, 2024.", [FLIGHT], BOOK),
     "[book_flight(origin='Boston', destination='Denver', date='2024-05", "unparseable"),
    (_task("t06", "Tell me a joke about cats.", [WEATHER, AREA], []),
     "[get_current_weather(location='Paris, France')]", "unexpected_call"),
    (_task("t07", "Areas of circles of radius 3 and 5?", [AREA], TWO_AREAS),
     "[geometry.area_circle(radius=3)]", "missing_call"),
    (_task("t08", "Book a flight from Boston to Denver on May 1, 2024.", [FLIGHT], BOOK),
     "[book_flight(origin='Boston', destination='Denver', date='2024-05-01', seat='aisle')]", "extra_argument"),
    (_task("t09", "Areas of circles of radius 3 and 5?", [AREA], TWO_AREAS),
     "[geometry.area_circle(radius=3), geometry.area_circle(radius=5), geometry.area_circle(radius=4)]", "extra_call"),
    (_task("t10", "Convert 100 USD to EUR.", MANY, CONVERT), "Sorry, I cannot convert currencies.", "missing_call"),
    (_task("t11", "Tell me a joke about cats.", [WEATHER, AREA], []),
     "Why did the cat sit on the computer? To keep an eye on the mouse.", None),
]


@pytest.mark.parametrize("task,answer,kind", RECORDED, ids=[t["task_id"] for t, _, _ in RECORDED])
def test_each_recorded_answer_gets_its_hand_worked_error_kind(task, answer, kind):
    assert classify_answer(task, answer) == kind


def test_probe_counts_on_recorded_answers_match_the_hand_count():
    report = probe_counts([t for t, _, _ in RECORDED], [a for _, a, _ in RECORDED])
    assert (report.total, report.scored, report.passed, report.failed) == (11, 11, 2, 9)
    assert report.counts == {"unparseable": 1, "unexpected_call": 1, "wrong_function": 1, "missing_call": 2,
                             "extra_call": 1, "missing_argument": 1, "extra_argument": 1, "wrong_value": 1, "other": 0}
    assert report.per_task["t02"] == [] and report.per_task["t01"] == ["wrong_value"]
    assert report.shares["missing_call"] == pytest.approx(2 / 9) and report.pass_rate == pytest.approx(2 / 11)
    assert set(report.to_dict()["counts"]) == set(ERROR_KINDS)


def test_an_answer_with_several_faults_keeps_them_all_and_counts_the_first():
    task = _task("t20", "Book a flight from Boston to Denver on May 1, 2024.", [FLIGHT], BOOK)
    kinds = answer_kinds(task, "[book_flight(origin='Austin', destination='Denver', seat='aisle')]")
    assert kinds == ["missing_argument", "extra_argument", "wrong_value"]
    assert classify_answer(task, "[book_flight(origin='Austin', destination='Denver', seat='aisle')]") == "missing_argument"
    # A call to a function no tool declares is a wrong function too.
    assert classify_answer(task, "[book_train(origin='Boston', destination='Denver', date='2024-05-01')]") == "wrong_function"


def test_a_verifier_that_cannot_judge_is_not_counted_as_a_failure(monkeypatch):
    from flywheel.synth import probe
    from flywheel.verifiers import Verdict

    monkeypatch.setattr(probe, "verify_task", lambda *a, **k: Verdict(0.0, False, {}, infra_error="sandbox down"))
    task = RECORDED[0][0]
    assert classify_answer(task, "anything") == UNSCORED
    r = probe_counts([task], ["anything"])
    assert (r.scored, r.failed, r.passed) == (0, 0, 0) and sum(r.counts.values()) == 0


def test_plan_follows_the_counts_with_the_floor_worked_by_hand():
    report = probe_counts([t for t, _, _ in RECORDED], [a for _, a, _ in RECORDED])
    # floor: max(1, floor(0.05 * 40)) = 2 each -> 12, 28 left. Weights: schema_values 0.75 + 0.5 = 1.25,
    # masked_names 0.5 + 0.5 = 1, distractor 0.5, parallel 2 (the missing calls), irrelevance 1,
    # mutate 0.25 + 0.5 + 1 + 0.5 + 1 (the extra call) = 3.25 (total 9). 28 * w / 9 = 3.89, 3.11, 1.56, 6.22,
    # 3.11, 10.11: floors 3, 3, 1, 6, 3, 10 (26); the 2 largest remainders go to schema_values and distractor.
    plan = plan_generators(report, 40)
    assert plan == {"schema_values": 6, "masked_names": 5, "distractor": 4, "parallel": 8, "irrelevance": 5,
                    "mutate": 12}
    assert sum(plan.values()) == 40


def test_plan_sends_value_errors_to_schema_values_and_spreads_evenly_without_failures():
    # 10 * 0.75 = 7.5 and 10 * 0.25 = 2.5: the tie on the remainder goes to the first in order.
    assert plan_generators({"wrong_value": 4}, 10, floor=0.0) == {
        "schema_values": 8, "masked_names": 0, "distractor": 0, "parallel": 0, "irrelevance": 0, "mutate": 2}
    assert plan_generators({"unexpected_call": 3}, 10, floor=0.0, generators=["irrelevance", "parallel"]) == {
        "irrelevance": 10, "parallel": 0}
    assert plan_generators({}, 12) == dict.fromkeys(PLANNED_GENERATORS, 2)
    # A budget smaller than the floors: the first generators get one each, in order.
    assert plan_generators({"wrong_value": 1}, 3) == {"schema_values": 1, "masked_names": 1, "distractor": 1,
                                                      "parallel": 0, "irrelevance": 0, "mutate": 0}
    with pytest.raises(ValueError, match="unknown error kind"):
        plan_generators({"bogus": 1}, 10)


def test_extra_calls_are_answered_with_single_shape_variants_not_more_parallel_ones():
    """A model that makes more calls than were due needs requests answered with exactly the calls they need
    (``mutate`` keeps a seed's shape), not more multi-call requests: ``extra_call`` sent weight to
    ``parallel`` until it was measured (the shipped model made more extra calls than plain SFT)."""
    plan = plan_generators({"extra_call": 5}, 10, floor=0.0)
    assert plan["parallel"] == 0 and plan["mutate"] == 10
    assert plan_generators({"missing_call": 5}, 10, floor=0.0)["parallel"] == 10


def test_run_probe_decodes_greedily_with_the_tools_and_counts():
    seen = []

    def responder(prompt: str, j: int) -> str:
        seen.append(prompt)
        return "[geometry.area_circle(radius=3)]" if "radius" in prompt else "Sorry."

    pol = ScriptedPolicy(responder)
    tasks = [RECORDED[6][0], RECORDED[2][0]]
    report = run_probe(pol, tasks, max_new_tokens=64, batch_size=1)
    # t07 offers only the circle tool: one call of two. t03 offers it among others (its prompt
    # mentions "radius" too): the scripted model calls it instead of convert_currency.
    assert report.per_task == {"t07": ["missing_call"], "t03": ["wrong_function"]}
    assert len(seen) == 2 and all("geometry.area_circle" in p for p in seen)  # the tools reached the prompt
    assert pol.calls == [("generate", 1), ("generate", 1)]


@pytest.mark.slow
def test_run_probe_works_with_the_tiny_hf_model(tmp_path_factory):
    pytest.importorskip("torch")
    from flywheel.policy.testing import session_tiny_home, tiny_policy

    pol = tiny_policy(session_tiny_home(tmp_path_factory))
    tasks = [t for t, _, _ in RECORDED[:4]]
    a = run_probe(pol, tasks, max_new_tokens=8)
    b = run_probe(pol, tasks, max_new_tokens=8)
    assert a.total == 4 and a.scored == 4 and a.passed + a.failed == 4
    assert a.per_task == b.per_task  # greedy: the same answers twice
