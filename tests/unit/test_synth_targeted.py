"""The targeted generators (schema_values, masked_names, irrelevance): every variant passes its own
verifier with its reference and fails with the answer the probe's error kind names; variants by
plan; and run_synth(plan=...) sends exactly the planned generators through the funnel."""

from __future__ import annotations

import datetime as dt
import random
import re

import pytest
from fixtures.bfcl_seeds import bfcl_tasks

from flywheel.envs.testing import tool_spec
from flywheel.policy.format import render_answer
from flywheel.synth import (
    build_context,
    check_solvable,
    generate_candidates,
    generate_planned,
    make_generators,
    run_synth,
    seed_tasks,
)
from flywheel.synth.generators import CITY_COUNTRIES, CITY_STATES, NO_CALL_ANSWER
from flywheel.synth.probe import classify_answer
from flywheel.verifiers import ToolCall
from flywheel.vocab.tools import tool_name


@pytest.fixture(scope="module")
def seeds() -> list[dict]:
    out = []
    for cat, n in (("simple_python", 40), ("multiple", 16), ("parallel", 8), ("parallel_multiple", 6)):
        out += bfcl_tasks(cat, n)
    return seed_tasks(out)


def _text(calls: list[dict]) -> str:
    return render_answer([ToolCall(c["name"], c["arguments"]) for c in calls])


def _seed(text: str, tool: dict, args: dict, tid: str = "eval:00000000000000bb", others: tuple = ()) -> dict:
    tools = [tool, *others]
    name = tool_name(tool)
    return {"task_id": tid, "prompt": {"messages": [{"role": "user", "content": text}], "tools": tools},
            "verifier": {"kind": "tool_call", "tools": tools, "order_sensitive": False,
                         "expected": [{"name": name, "arguments": {k: {"one_of": [v], "optional": False}
                                                                   for k, v in args.items()}}]},
            "harness": "single_turn", "tool_env": None,
            "reference": {"tool_calls": [{"name": name, "arguments": dict(args)}]},
            "metadata": {"split": "train", "deterministic": True, "origin_failure": "failure:x", "cluster": "c-x"}}


COUNTRY_WEATHER = tool_spec("weather.current", {
    "location": {"type": "string", "description": "The city and country, e.g. Paris, France."},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"], "Current weather.")
STATE_SEARCH = tool_spec("restaurant.search", {
    "location": {"type": "string", "description": "The city and state, e.g. New York, NY"},
    "cuisine": {"type": "string"}}, ["location", "cuisine"], "Find restaurants.")
STOCK = tool_spec("stock.price", {"company": {"type": "string"},
                                  "date": {"type": "string", "description": "Date of the price. Format: yyyy-mm-dd."}},
                  ["company", "date"], "Closing price of a stock.")
ROUTE = tool_spec("route.plan", {"origin": {"type": "string"}, "destination": {"type": "string"},
                                 "route_type": {"type": "string", "description": "Type of route (e.g., 'fastest', "
                                                "'scenic', 'shortest'). Default is 'fastest'."}},
                  ["origin", "destination"], "Plan a route.")
PLAIN = tool_spec("notes.add", {"title": {"type": "string", "description": "The title."},
                                "body": {"type": "string", "description": "The text."}}, ["title", "body"], "Add a note.")


def _variants(seed: dict, n: int = 12, gen: str = "schema_values") -> list:
    g = make_generators([gen])[0]
    ctx = build_context([seed])
    return [c for c in (g.one(seed, k, random.Random(k), ctx) for k in range(n)) if c is not None]


# ------------------------------------------------------------------------------ schema_values
def test_schema_values_writes_city_country_as_the_description_asks_and_the_bare_city_fails():
    seed = _seed("How is the weather in Tel Aviv today?", COUNTRY_WEATHER, {"location": "Tel Aviv, Israel"})
    variants = _variants(seed)
    assert variants
    cities = {c: k for c, k in CITY_COUNTRIES}
    for c in variants:
        ref = c.task["reference"]["tool_calls"][0]["arguments"]["location"]
        city, country = ref.split(", ")
        text = c.task["prompt"]["messages"][0]["content"]
        assert cities[city] == country and city != "Tel Aviv" and city in text and "Tel Aviv" not in text
        assert check_solvable(c.task)[0]
        bare = [{"name": "weather.current", "arguments": {"location": city}}]
        assert classify_answer(c.task, _text(bare)) == "wrong_value"
        assert c.task["metadata"]["synth_detail"]["changed"][0]["format"] == "city_country"


def test_schema_values_uses_the_state_abbreviation_the_example_shows_and_accepts_the_full_name():
    seed = _seed("Find a vegan restaurant in Chicago.", STATE_SEARCH, {"location": "Chicago, IL", "cuisine": "vegan"})
    variants = _variants(seed)
    assert variants
    table = {c: (ab, full) for c, ab, full in CITY_STATES}
    for c in variants:
        ref = c.task["reference"]["tool_calls"][0]["arguments"]["location"]
        city, code = ref.split(", ")
        assert table[city][0] == code and city != "Chicago"
        allowed = c.task["verifier"]["expected"][0]["arguments"]["location"]["one_of"]
        assert allowed == [f"{city}, {code}", f"{city}, {table[city][1]}"]
        assert check_solvable(c.task)[0]
        full = [{"name": "restaurant.search", "arguments": {"location": allowed[1], "cuisine": "vegan"}}]
        assert classify_answer(c.task, _text(full)) is None
        assert classify_answer(c.task, _text([{**full[0], "arguments": {"location": city, "cuisine": "vegan"}}])) == "wrong_value"


def test_schema_values_says_a_date_in_words_and_answers_it_in_the_described_format():
    seed = _seed("Closing price of Amazon on March 11, 2022?", STOCK, {"company": "Amazon", "date": "2022-03-11"})
    variants = _variants(seed)
    assert variants
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"]
    for c in variants:
        ref = c.task["reference"]["tool_calls"][0]["arguments"]["date"]
        d = dt.date.fromisoformat(ref)
        text = c.task["prompt"]["messages"][0]["content"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", ref) and d != dt.date(2022, 3, 11)
        assert months[d.month - 1] in text and str(d.year) in text and "2022-" not in text
        assert check_solvable(c.task)[0]
        said = c.task["metadata"]["synth_detail"]["changed"][0]["said"]
        wrong = [{"name": "stock.price", "arguments": {"company": "Amazon", "date": said}}]
        assert classify_answer(c.task, _text(wrong)) == "wrong_value"


def test_schema_values_swaps_enum_members_and_described_example_values_but_not_the_default():
    seed = _seed("Weather in Oslo in celsius?", COUNTRY_WEATHER, {"location": "Oslo", "unit": "celsius"})
    variants = _variants(seed)
    assert variants
    for c in variants:  # "Oslo" is not "City, Country" in the seed: only the enum is a format
        args = c.task["reference"]["tool_calls"][0]["arguments"]
        assert args == {"location": "Oslo", "unit": "fahrenheit"} and "fahrenheit" in c.task["prompt"]["messages"][0]["content"]
        assert check_solvable(c.task)[0]
    route = _seed("Plan the scenic route from Austin to Dallas.", ROUTE,
                  {"origin": "Austin", "destination": "Dallas", "route_type": "scenic"})
    got = {c.task["reference"]["tool_calls"][0]["arguments"]["route_type"] for c in _variants(route)}
    assert got == {"shortest"}  # 'fastest' is the default: the variant would not need the argument


def test_schema_values_makes_no_variant_where_no_format_is_stated():
    seed = _seed("Add a note titled groceries saying buy milk.", PLAIN, {"title": "groceries", "body": "buy milk"})
    cands, na = generate_candidates([seed], make_generators(["schema_values"]), 3)
    assert cands == [] and na == 3


def test_schema_values_variants_of_bfcl_seeds_pass_their_verifiers(seeds):
    cands, _ = generate_candidates(seeds, make_generators(["schema_values"]), 2, seed=4)
    assert len(cands) >= 3
    for c in cands:
        assert check_solvable(c.task)[0], c.task_id
        seed = next(s for s in seeds if s["task_id"] == c.seed_ids[0])
        # The seed's own answer no longer fits the re-asked request.
        assert classify_answer(c.task, _text(seed["reference"]["tool_calls"])) == "wrong_value"


# ------------------------------------------------------------------------------ masked_names
def test_masked_names_rename_consistently_and_the_memorised_names_fail(seeds):
    cands, _ = generate_candidates(seeds, make_generators(["masked_names"]), 3, seed=2)
    modes = set()
    assert cands
    for c in cands:
        seed = next(s for s in seeds if s["task_id"] == c.seed_ids[0])
        d = c.task["metadata"]["synth_detail"]
        modes.add(d["mode"])
        assert check_solvable(c.task)[0], c.task_id
        names = {tool_name(t) for t in c.task["prompt"]["tools"]}
        assert c.task["verifier"]["tools"] == c.task["prompt"]["tools"]
        if d["mode"] in ("functions", "both"):
            assert not names & set(seed["metadata"]["tools"]) and all(re.fullmatch(r"fn_[0-9a-f]{4}", n) for n in names)
            for old in d["functions"]:
                if "." in old or "_" in old:
                    assert old not in c.task["prompt"]["messages"][-1]["content"]
        for t in c.task["prompt"]["tools"]:
            params = t["function"]["parameters"]
            assert set(params.get("required", [])) <= set(params["properties"])
        for call in c.task["reference"]["tool_calls"]:
            assert call["name"] in names
        verdict = classify_answer(c.task, _text(seed["reference"]["tool_calls"]))
        assert verdict in ("wrong_function", "extra_argument", "missing_argument"), (d["mode"], verdict)
    assert modes == {"functions", "parameters", "both"}


# ------------------------------------------------------------------------------ irrelevance
def test_irrelevance_removes_the_needed_tools_and_any_call_fails(seeds):
    cands, _ = generate_candidates(seeds, make_generators(["irrelevance"]), 1, seed=3)
    assert cands
    for c in cands:
        seed = next(s for s in seeds if s["task_id"] == c.seed_ids[0])
        t = c.task
        assert t["verifier"]["expected"] == [] and t["reference"] == {"content": NO_CALL_ANSWER}
        assert t["prompt"]["messages"] == seed["prompt"]["messages"]
        needed = set(t["metadata"]["synth_detail"]["removed"])
        assert needed and not needed & {tool_name(x) for x in t["prompt"]["tools"]} and t["prompt"]["tools"]
        assert check_solvable(t)[0]
        assert classify_answer(t, _text(seed["reference"]["tool_calls"])) == "unexpected_call"
        any_tool = tool_name(t["prompt"]["tools"][0])
        assert classify_answer(t, f"[{any_tool}()]") == "unexpected_call"


# ------------------------------------------------------------------------------ plans
def test_generate_planned_makes_the_planned_number_of_slots_per_generator(seeds):
    plan = {"masked_names": 7, "irrelevance": 5, "schema_values": 4, "distractor": 0}
    gens = make_generators(list(plan))
    cands, na = generate_planned(seeds, gens, plan, seed=1)
    made = {g: sum(1 for c in cands if c.generator == g) for g in plan}
    assert made["masked_names"] + made["irrelevance"] + made["schema_values"] + na == 16 and made["distractor"] == 0
    assert made["masked_names"] >= 6 and made["irrelevance"] == 5
    # Spread over seeds: no seed gets a second masked variant before every seed had one.
    assert len({c.seed_ids[0] for c in cands if c.generator == "masked_names"}) == made["masked_names"]
    again, na2 = generate_planned(seeds, make_generators(list(plan)), plan, seed=1)
    assert [c.task_id for c in again] == [c.task_id for c in cands] and na2 == na


def _populate(store, cfg) -> None:
    from flywheel.artifacts import open_artifacts
    from flywheel.envs.build import build_envs
    from flywheel.envs.testing import append_failures, failure_payload
    from flywheel.evals import build_evals
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl

    payloads = []
    for cat, n in (("simple_python", 40), ("parallel", 8), ("multiple", 8)):
        for it in load_bfcl(cat, n):
            payloads.append(failure_payload(it.question_messages, it.tools, {"role": "assistant", "content": "no"},
                                            ["no_tool_call"],
                                            correction={"tool_calls": bfcl_answer_to_expected(it.possible_answer)},
                                            source="bfcl", trace_id=f"trace:bfcl-{it.id}"))
    append_failures(store, payloads)
    a = open_artifacts(cfg)
    build_evals(cfg, store, a)
    build_envs(cfg, store, a)


@pytest.mark.slow
def test_run_synth_with_a_plan_runs_the_planned_generators_through_the_funnel_and_records_the_plan(cfg, store):
    from flywheel.artifacts import open_artifacts
    from flywheel.versioning import load_env

    _populate(store, cfg)
    a = open_artifacts(cfg)
    plan = {"schema_values": 3, "masked_names": 4, "irrelevance": 3, "distractor": 2, "parallel": 0}
    s = run_synth(cfg, store, a, plan=plan)
    assert s.new and s.plan == {"schema_values": 3, "masked_names": 4, "irrelevance": 3, "distractor": 2}
    assert set(s.by_generator) <= set(s.plan)
    assert s.by_generator["masked_names"]["generated"] == 4 and s.by_generator["irrelevance"]["generated"] == 3
    assert sum(g["generated"] for g in s.by_generator.values()) + s.not_applicable == 12
    f = s.to_dict()["funnel"]
    assert f["generated"] >= f["valid"] >= f["solvable"] >= f["unique"] >= f["uncontaminated"] >= f["accepted"] > 0
    p = store.read(stream=s.batch)[0].payload
    assert p["plan"] == s.plan and p["per_seed"] is None and set(p["generators"]) == set(s.plan)
    synth = [t for t in load_env(store, a, "train").tasks if t["metadata"].get("synth_batch") == s.batch]
    assert len(synth) == f["accepted"] and {t["metadata"]["generator"] for t in synth} <= set(s.plan)
    assert all(check_solvable(t)[0] for t in synth)
    # Same plan: the recorded batch; another plan: another batch.
    n = store.last_seq()
    again = run_synth(cfg, store, a, plan=dict(plan))
    assert not again.new and again.batch == s.batch and again.plan == s.plan and store.last_seq() == n
    other = run_synth(cfg, store, a, plan={"irrelevance": 2})
    assert other.batch != s.batch and set(other.by_generator) <= {"irrelevance"}
    with pytest.raises(ValueError, match="unknown synth generator"):
        run_synth(cfg, store, a, plan={"nope": 1})
    with pytest.raises(ValueError, match="no generator any variant"):
        run_synth(cfg, store, a, plan={"mutate": 0})
