"""The ``unused_tool`` generator: a request for a tool the seed offers and never calls, written from that
tool's description and schema; the seed's tool list unchanged; the seed's own answer names the wrong
function on it; every variant solvable by its own verifier."""

from __future__ import annotations

import random

from fixtures.bfcl_seeds import bfcl_tasks

from flywheel.envs.testing import tool_spec
from flywheel.policy.format import render_answer
from flywheel.synth import build_context, check_solvable, generate_candidates, make_generators, seed_tasks
from flywheel.synth.generators.unused_tool import UnusedToolGenerator, instruction
from flywheel.synth.probe import classify_answer
from flywheel.verifiers import ToolCall
from flywheel.vocab.tools import tool_name

CAPITAL = tool_spec("country_info.capital", {"country": {"type": "string", "description": "Name of the country."}},
                    ["country"], "Fetch the capital city of a specified country.")
LARGEST = tool_spec("country_info.largest_city", {"country": {"type": "string", "description": "Name of the country."}},
                    ["country"], "Fetches the largest city of a specified country.")
AREA = tool_spec("geometry.area", {
    "radius": {"type": "integer", "description": "The radius."},
    "units": {"type": "string", "description": "Units of the answer.", "default": "cm"}}, ["radius"],
    "Calculates the area of a circle. Note that the provided function is in Python 3 syntax.")
MATRIX = tool_spec("linalg.det", {"matrix": {"type": "array", "items": {"type": "array"}}}, ["matrix"],
                   "Computes a matrix determinant.")


def _seed(text: str, tools: list[dict], calls: list[dict], tid: str = "eval:00000000000000bb") -> dict:
    return {"task_id": tid, "prompt": {"messages": [{"role": "system", "content": "You are a helpful agent."},
                                                    {"role": "user", "content": text}], "tools": tools},
            "verifier": {"kind": "tool_call", "tools": tools, "order_sensitive": False,
                         "expected": [{"name": c["name"], "arguments": {k: {"one_of": [v], "optional": False}
                                                                        for k, v in c["arguments"].items()}}
                                      for c in calls]},
            "harness": "single_turn", "tool_env": None, "reference": {"tool_calls": calls},
            "metadata": {"split": "train", "deterministic": True, "origin_failure": "failure:x", "cluster": "c-x"}}


BRAZIL = _seed("What is the capital of Brazil?", [CAPITAL, LARGEST],
               [{"name": "country_info.capital", "arguments": {"country": "Brazil"}}])


def _variants(seed: dict, n: int = 12, optional_share: float = 0.3) -> list:
    g = UnusedToolGenerator(optional_share=optional_share)
    ctx = build_context([seed])
    return [c for c in (g.one(seed, k, random.Random(k), ctx) for k in range(n)) if c is not None]


def _answer(calls: list[dict]) -> str:
    return render_answer([ToolCall(c["name"], c["arguments"]) for c in calls])


def test_instruction_makes_the_description_an_order():
    assert instruction("Calculates the area of a circle.") == "Calculate the area of a circle"
    assert instruction("Fetches the largest city of a specified country.") == "Fetch the largest city of a specified country"
    assert instruction("Queries the database for a record") == "Query the database for a record"
    assert instruction("Retrieve stock data. Note that the provided function is in Python 3 syntax.") == "Retrieve stock data"
    assert instruction("Analysis of a genome.") == "Analysis of a genome"  # not a verb in -s: left alone
    assert instruction("  ") is None and instruction("Note that the provided function is in Python 3 syntax.") is None


def test_a_request_for_the_other_tool_with_the_seeds_own_value():
    vs = _variants(BRAZIL)
    assert vs
    for c in vs:
        t = c.task
        assert t["reference"]["tool_calls"] == [{"name": "country_info.largest_city", "arguments": {"country": "Brazil"}}]
        request = t["prompt"]["messages"][-1]["content"]
        assert request.startswith("Fetch the largest city of a specified country")
        assert request.count("Brazil") == 1
        # the tool list and the system prompt are the seed's own
        assert t["prompt"]["tools"] == BRAZIL["prompt"]["tools"]
        assert t["prompt"]["messages"][0] == BRAZIL["prompt"]["messages"][0]
        assert check_solvable(t)[0]
        # what the seed's answer would say here is the wrong function: the contrast the variant teaches
        assert classify_answer(t, _answer(BRAZIL["reference"]["tool_calls"])) == "wrong_function"
        assert t["metadata"]["generator"] == "unused_tool" and t["metadata"]["seed_task"] == BRAZIL["task_id"]


def test_unstated_optional_parameter_is_expected_absent_or_at_its_default():
    seed = _seed("Capital of Peru?", [CAPITAL, AREA], [{"name": "country_info.capital", "arguments": {"country": "Peru"}}])
    vs = _variants(seed, optional_share=0.0)
    assert vs
    t = vs[0].task
    (call,) = t["reference"]["tool_calls"]
    assert call["name"] == "geometry.area" and set(call["arguments"]) == {"radius"}
    assert isinstance(call["arguments"]["radius"], int)
    assert str(call["arguments"]["radius"]) in t["prompt"]["messages"][-1]["content"]
    assert t["prompt"]["messages"][-1]["content"].startswith("Calculate the area of a circle")
    r = call["arguments"]["radius"]
    assert classify_answer(t, _answer([{"name": "geometry.area", "arguments": {"radius": r}}])) is None
    assert classify_answer(t, _answer([{"name": "geometry.area", "arguments": {"radius": r, "units": "cm"}}])) is None
    assert classify_answer(t, _answer([{"name": "geometry.area", "arguments": {"radius": r, "units": "m"}}])) == "wrong_value"


def test_a_tool_whose_required_value_cannot_be_stated_is_ruled_out():
    seed = _seed("Capital of Chile?", [CAPITAL, MATRIX], [{"name": "country_info.capital", "arguments": {"country": "Chile"}}])
    assert _variants(seed) == []
    # a string parameter no seed ever passed and the schema gives no example for: ruled out as well
    other = tool_spec("zoo.find", {"animal": {"type": "string"}}, ["animal"], "Find a zoo.")
    seed2 = _seed("Capital of Chile?", [CAPITAL, other], [{"name": "country_info.capital", "arguments": {"country": "Chile"}}])
    assert _variants(seed2) == []


def test_own_value_of_another_type_is_not_reused():
    counted = tool_spec("count.things", {"country": {"type": "integer"}}, ["country"], "Counts things.")
    seed = _seed("Capital of Chile?", [CAPITAL, counted], [{"name": "country_info.capital", "arguments": {"country": "Chile"}}])
    vs = _variants(seed)
    assert vs and all(isinstance(c.task["reference"]["tool_calls"][0]["arguments"]["country"], int) for c in vs)


def test_not_applicable_when_the_answer_calls_every_offered_tool():
    seed = _seed("Capital of Chile?", [CAPITAL], [{"name": "country_info.capital", "arguments": {"country": "Chile"}}])
    assert not UnusedToolGenerator().applicable(seed)
    # a dotted name called in its underscore spelling still counts as called
    under = _seed("Capital of Chile?", [CAPITAL], [{"name": "country_info_capital", "arguments": {"country": "Chile"}}])
    assert not UnusedToolGenerator().applicable(under)


def test_bfcl_variants_are_solvable_and_call_a_tool_the_seed_does_not():
    seeds = seed_tasks(bfcl_tasks("multiple", 60) + bfcl_tasks("parallel_multiple", 40))
    cands, _ = generate_candidates(seeds, make_generators(["unused_tool"]), 1, seed=3)
    assert len(cands) >= 30
    by_id = {s["task_id"]: s for s in seeds}
    for c in cands:
        ok, why = check_solvable(c.task)
        assert ok, (c.task_id, why)
        seed = by_id[c.seed_ids[0]]
        called = {x["name"] for x in seed["reference"]["tool_calls"]}
        (call,) = c.task["reference"]["tool_calls"]
        assert call["name"] not in called
        assert call["name"] in {tool_name(t) for t in seed["prompt"]["tools"]}
        assert c.task["prompt"]["tools"] == seed["prompt"]["tools"]
