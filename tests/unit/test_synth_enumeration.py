"""The ``enumeration`` generator: a listed request with one more item (and call) or one fewer; the list
rewritten in the request's own style; every variant solvable by its own verifier, and the seed's answer
wrong on it by exactly the count (``missing_call`` / ``extra_call``)."""

from __future__ import annotations

import random

import pytest
from fixtures.bfcl_seeds import bfcl_tasks

from flywheel.envs.testing import tool_spec
from flywheel.policy.format import render_answer
from flywheel.synth import build_context, check_solvable, generate_candidates, make_generators, seed_tasks
from flywheel.synth.generators.enumeration import EnumerationGenerator, find_enumeration
from flywheel.synth.probe import classify_answer, plan_generators
from flywheel.verifiers import ToolCall
from flywheel.vocab.tools import tool_name

SEASONS = tool_spec("player_status.check", {
    "team": {"type": "string"}, "player_id": {"type": "integer"},
    "season": {"type": "integer", "description": "The season year."}}, ["team", "player_id", "season"],
    "Whether a player was top scorer in a season.")
COLOR = tool_spec("color.info", {"color_name": {"type": "string"}}, ["color_name"], "RGB and HEX of a color.")
PROTEIN = tool_spec("protein.sequence", {"protein_name": {"type": "string"}}, ["protein_name"], "A protein's sequence.")
TRIANGLE = tool_spec("math.hypot", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"], "Hypotenuse.")


def _seed(text: str, tool: dict, calls: list[dict], tid: str = "eval:00000000000000aa") -> dict:
    name = tool_name(tool)
    return {"task_id": tid, "prompt": {"messages": [{"role": "user", "content": text}], "tools": [tool]},
            "verifier": {"kind": "tool_call", "tools": [tool], "order_sensitive": False,
                         "expected": [{"name": name, "arguments": {k: {"one_of": [v], "optional": False}
                                                                   for k, v in c.items()}} for c in calls]},
            "harness": "single_turn", "tool_env": None,
            "reference": {"tool_calls": [{"name": name, "arguments": dict(c)} for c in calls]},
            "metadata": {"split": "train", "deterministic": True, "origin_failure": "failure:x", "cluster": "c-x"}}


def _text(calls: list[dict]) -> str:
    return render_answer([ToolCall(c["name"], c["arguments"]) for c in calls])


def _variants(seed: dict, ctx_seeds: list[dict] | None = None, n: int = 16) -> list:
    g = EnumerationGenerator()
    ctx = build_context(ctx_seeds or [seed])
    return [c for c in (g.one(seed, k, random.Random(k), ctx) for k in range(n)) if c is not None]


def _request(task: dict) -> str:
    return task["prompt"]["messages"][-1]["content"]


SEASON_SEED = _seed("Check if the player with id 3142 in team RocketLeague was top scorer in seasons 2017, 2018 and 2019.",
                    SEASONS, [{"team": "RocketLeague", "player_id": 3142, "season": y} for y in (2017, 2018, 2019)])


def test_extend_continues_an_even_list_and_the_seeds_answer_misses_a_call():
    ext = [c for c in _variants(SEASON_SEED) if c.task["metadata"]["synth_detail"]["op"] == "extend"]
    assert ext
    for c in ext:
        assert _request(c.task) == ("Check if the player with id 3142 in team RocketLeague was top scorer in "
                                    "seasons 2017, 2018, 2019 and 2020.")
        calls = c.task["reference"]["tool_calls"]
        assert [x["arguments"]["season"] for x in calls] == [2017, 2018, 2019, 2020]
        assert all(x["arguments"]["team"] == "RocketLeague" and x["arguments"]["player_id"] == 3142 for x in calls)
        assert c.task["verifier"]["order_sensitive"] is False
        assert check_solvable(c.task)[0]
        assert classify_answer(c.task, _text(SEASON_SEED["reference"]["tool_calls"])) == "missing_call"


def test_drop_removes_one_item_and_its_call_and_the_seeds_answer_has_one_too_many():
    drops = [c for c in _variants(SEASON_SEED) if c.task["metadata"]["synth_detail"]["op"] == "drop"]
    assert {c.task["metadata"]["synth_detail"]["value"] for c in drops} == {2017, 2018, 2019}
    for c in drops:
        gone = c.task["metadata"]["synth_detail"]["value"]
        left = [y for y in (2017, 2018, 2019) if y != gone]
        assert _request(c.task).endswith(f"seasons {left[0]} and {left[1]}.")
        assert [x["arguments"]["season"] for x in c.task["reference"]["tool_calls"]] == left
        assert check_solvable(c.task)[0]
        assert classify_answer(c.task, _text(SEASON_SEED["reference"]["tool_calls"])) == "extra_call"


def test_two_items_left_lose_the_serial_comma_and_one_item_left_is_a_single_call():
    three = _seed("Get the protein sequence of human HbA1c, normal hemoglobin, and rat hemoglobin and their 3D models",
                  PROTEIN, [{"protein_name": p} for p in ("human HbA1c", "normal hemoglobin", "rat hemoglobin")])
    drops = [c for c in _variants(three) if c.task["metadata"]["synth_detail"]["op"] == "drop"]
    assert drops
    for c in drops:
        assert ", and" not in _request(c.task) and len(c.task["reference"]["tool_calls"]) == 2
    two = _seed("What are the RGB and HEX values for navy and maroon?", COLOR,
                [{"color_name": "navy"}, {"color_name": "maroon"}])
    singles = [c for c in _variants(two) if c.task["metadata"]["synth_detail"]["op"] == "drop"]
    assert {_request(c.task) for c in singles} == {"What are the RGB and HEX values for navy?",
                                                   "What are the RGB and HEX values for maroon?"}
    assert all(len(c.task["reference"]["tool_calls"]) == 1 and check_solvable(c.task)[0] for c in singles)


def test_a_new_string_item_comes_from_the_same_parameter_in_other_seeds_never_from_an_unrelated_word_list():
    colors = _seed("What are the RGB and HEX values for navy, purple and maroon?", COLOR,
                   [{"color_name": c} for c in ("navy", "purple", "maroon")])
    other = _seed("What is the HEX value of teal?", COLOR, [{"color_name": "teal"}], tid="eval:00000000000000ab")
    ext = [c for c in _variants(colors, [colors, other]) if c.task["metadata"]["synth_detail"]["op"] == "extend"]
    assert ext and {_request(c.task) for c in ext} == {"What are the RGB and HEX values for navy, purple, maroon and teal?"}
    assert all(check_solvable(c.task)[0] for c in ext)
    # No other seed names a protein: a list of proteins is never extended (mutate's word lists hold people
    # and cities, which would read as nonsense here); it can still be shortened.
    prot = _seed("Get the sequences of human HbA1c, normal hemoglobin and rat hemoglobin.", PROTEIN,
                 [{"protein_name": p} for p in ("human HbA1c", "normal hemoglobin", "rat hemoglobin")])
    ops = {c.task["metadata"]["synth_detail"]["op"] for c in _variants(prot, [prot, colors])}
    assert ops == {"drop"}


@pytest.mark.parametrize("text, calls", [
    # two arguments vary per item: not a one-argument list
    ("Compute the hypotenuse for sides 3 and 4, 5 and 12.", [{"a": 3, "b": 4}, {"a": 5, "b": 12}]),
    # the values are not joined by a list connector
    ("Compute the hypotenuse with a of 3 and b of 4, then with a of 5 and b of 4.", [{"a": 3, "b": 4}, {"a": 5, "b": 4}]),
    # a value stated twice: which one is the item is ambiguous
    ("For a = 3 (a 3 again) and 5 compute it with b = 4.", [{"a": 3, "b": 4}, {"a": 5, "b": 4}]),
    # one call: nothing is listed
    ("Compute the hypotenuse for sides 3 and 4.", [{"a": 3, "b": 4}]),
])
def test_requests_without_a_clean_one_argument_list_are_left_alone(text, calls):
    seed = _seed(text, TRIANGLE, calls)
    assert find_enumeration(seed) is None
    assert not EnumerationGenerator().applicable(seed) and _variants(seed) == []


def test_bfcl_parallel_seeds_give_solvable_variants_and_the_probe_does_not_plan_them_by_default():
    seeds = seed_tasks(bfcl_tasks("parallel", 40) + bfcl_tasks("parallel_multiple", 20))
    cands, _ = generate_candidates(seeds, make_generators(["enumeration"]), 2, seed=5)
    assert len(cands) >= 4
    assert {c.task["metadata"]["synth_detail"]["op"] for c in cands} == {"extend", "drop"}
    for c in cands:
        ok, why = check_solvable(c.task)
        assert ok, (c.task_id, why)
        seed = next(s for s in seeds if s["task_id"] == c.seed_ids[0])
        op = c.task["metadata"]["synth_detail"]["op"]
        assert len(c.task["reference"]["tool_calls"]) == len(seed["reference"]["tool_calls"]) + (1 if op == "extend" else -1)
    # Not planned by the probe by default (two seeds measured no gain; docs/learning.md): a missing call
    # still goes to parallel.
    plan = plan_generators({"missing_call": 5}, 20, floor=0.0)
    assert "enumeration" not in plan and plan["parallel"] == 20


def test_the_probe_counts_items_squeezed_into_one_call_as_missing_calls():
    cities = tool_spec("instrument.availability", {"instrument": {"type": "string"}, "city": {"type": "string"}},
                       ["instrument", "city"], "Whether a store in a city has the instrument.")
    seed = _seed("Is the P125 piano available in Berlin and Moscow?", cities,
                 [{"instrument": "P125", "city": "Berlin"}, {"instrument": "P125", "city": "Moscow"}])
    # What a small model writes for a listed request: one call, the listed argument repeated.
    assert classify_answer(seed, "[instrument.availability(instrument='P125', city='Berlin', city='Moscow')]") \
        == "missing_call"
    # Other parse errors stay unparseable: a truncated answer, and a repeat beside another error.
    assert classify_answer(seed, "[instrument.availability(instrument='P125', city='Berl") == "unparseable"
    assert classify_answer(seed, "[instrument.availability(instrument='P125', city='Berlin', city='Moscow')][x(") \
        == "unparseable"
    assert classify_answer(seed, _text(seed["reference"]["tool_calls"])) is None
