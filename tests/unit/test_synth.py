"""Synthetic tasks: every generator's tasks are solvable by their reference (property test), the
funnel's gates reject what they must (invalid, unsolvable, duplicates, contamination), and a batch
is recorded once: re-running it appends nothing."""

from __future__ import annotations

import copy
import json
import re

import pytest
from fixtures.bfcl_seeds import bfcl_tasks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.contamination import request_text
from flywheel.envs.testing import ScriptedPolicy, append_failures, failure_payload, tool_spec
from flywheel.evals import eval_id
from flywheel.synth import (
    Candidate,
    build_context,
    check_solvable,
    decontaminate,
    dedup_candidates,
    generate_candidates,
    make_generators,
    mutate_task,
    run_synth,
    seed_tasks,
    synth_task_id,
    validate_candidates,
)
from flywheel.verifiers import ToolCall, verify
from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl


@pytest.fixture(scope="module")
def seeds() -> list[dict]:
    out = []
    for cat, n in (("simple_python", 14), ("multiple", 8), ("parallel", 8), ("parallel_multiple", 6)):
        out += bfcl_tasks(cat, n)
    return seed_tasks(out)


def _answer(calls: list[dict]) -> list[dict]:
    from flywheel.policy.format import render_answer

    return [{"role": "assistant", "content": render_answer([ToolCall(c["name"], c["arguments"]) for c in calls])}]


# ------------------------------------------------------------------------------ generators
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), gen=st.sampled_from(["mutate", "distractor", "parallel"]))
def test_every_generated_task_passes_its_own_verifier_with_its_reference(seeds, seed, gen):
    cands, _ = generate_candidates(seeds, make_generators([gen]), 1, seed=seed)
    assert cands, f"{gen} produced nothing from {len(seeds)} seeds"
    for c in cands:
        ok, why = check_solvable(c.task)
        assert ok, f"{gen} seed={seed} {c.task_id}: {why}"
        meta = c.task["metadata"]
        assert meta["generator"] == gen and meta["generator_params"] == make_generators([gen])[0].params
        assert meta["seed_task"].startswith("eval:") and meta["split"] == "train" and meta["source"] == "synth"
        assert c.task["task_id"] == synth_task_id(c.task) and re.fullmatch(r"synth:[0-9a-f]{16}", c.task_id)


def test_generators_are_deterministic_given_the_seed(seeds):
    gens = make_generators(["mutate", "distractor", "parallel"])
    a, na = generate_candidates(seeds, gens, 3, seed=5)
    b, nb = generate_candidates(seeds, make_generators(["mutate", "distractor", "parallel"]), 3, seed=5)
    c, _ = generate_candidates(seeds, gens, 3, seed=6)
    assert [x.task_id for x in a] == [x.task_id for x in b] and na == nb
    assert [x.task_id for x in a] != [x.task_id for x in c]


WEATHER = tool_spec("get_weather", {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "days"])


def _eval(text: str, args: dict, tools=None, tid="eval:00000000000000aa") -> dict:
    tools = tools or [WEATHER]
    return {"task_id": tid, "prompt": {"messages": [{"role": "user", "content": text}], "tools": tools},
            "verifier": {"kind": "tool_call", "tools": tools, "order_sensitive": False,
                         "expected": [{"name": "get_weather", "arguments": {k: {"one_of": [v], "optional": False}
                                                                            for k, v in args.items()}}]},
            "harness": "single_turn", "tool_env": None,
            "reference": {"tool_calls": [{"name": "get_weather", "arguments": dict(args)}]},
            "metadata": {"split": "train", "deterministic": True, "origin_failure": "failure:x", "cluster": "c-x"}}


def test_mutation_rewrites_the_request_and_the_answer_together_within_the_schema():
    import random

    seed = _eval("Forecast for Oslo for the next 3 days in celsius please", {"city": "Oslo", "days": 3, "unit": "celsius"})
    ctx = build_context([seed])
    seen = set()
    for s in range(30):
        c = mutate_task(seed, random.Random(s), ctx, max_args=3, params={"max_args": 3})
        assert c is not None
        args = c.task["reference"]["tool_calls"][0]["arguments"]
        text = c.task["prompt"]["messages"][0]["content"]
        assert 1 <= args["days"] <= 14 and args["unit"] in ("celsius", "fahrenheit")
        # Every argument value is what the request now says.
        assert args["city"] in text and f" {args['days']} days" in text and args["unit"] in text
        assert c.task["verifier"]["expected"][0]["arguments"]["days"]["one_of"] == [args["days"]]
        assert check_solvable(c.task)[0]
        # The seed's own answer no longer passes the variant when a value changed.
        changed = {d["param"] for d in c.task["metadata"]["synth_detail"]["changed"]}
        assert changed and not verify(c.task["verifier"], _answer(seed["reference"]["tool_calls"])).passed
        seen |= changed
    assert seen == {"city", "days", "unit"}  # strings (from the vocabulary), integers, enums


def test_mutation_leaves_ambiguous_values_alone():
    import random

    # "2" appears twice (days and inside "2 people"): ambiguous, never rewritten.
    seed = _eval("Weather in Lima for 2 days, for 2 people", {"city": "Lima", "days": 2})
    ctx = build_context([seed])
    for s in range(10):
        c = mutate_task(seed, random.Random(s), ctx, max_args=2, params={})
        assert c is not None
        assert c.task["reference"]["tool_calls"][0]["arguments"]["days"] == 2
        assert c.task["prompt"]["messages"][0]["content"].count("2") == 2


def test_distractors_are_new_tools_and_calling_one_fails(seeds):
    gen = make_generators(["distractor"])
    cands, _ = generate_candidates(seeds, gen, 1, seed=1)
    for c in cands:
        seed = next(s for s in seeds if s["task_id"] == c.seed_ids[0])
        added = set(c.task["metadata"]["synth_detail"]["distractors"])
        names = {t["function"]["name"] for t in c.task["prompt"]["tools"]}
        assert added and added <= names and not added & set(seed["metadata"]["tools"])
        assert c.task["verifier"]["expected"] == seed["verifier"]["expected"]
        wrong = [{"name": sorted(added)[0], "arguments": {}}]
        assert not verify(c.task["verifier"], _answer(wrong)).passed


def test_parallel_composition_needs_both_calls(seeds):
    cands, _ = generate_candidates(seeds, make_generators(["parallel"]), 2, seed=3)
    assert cands
    for c in cands:
        calls = c.task["reference"]["tool_calls"]
        assert len(calls) >= 2 and len(c.task["verifier"]["expected"]) == len(calls)
        assert check_solvable(c.task)[0]
        assert not verify(c.task["verifier"], _answer(calls[:-1])).passed  # one call short
        assert verify(c.task["verifier"], _answer(list(reversed(calls)))).passed  # order-insensitive


@pytest.mark.slow  # first GX validation in the process imports great_expectations (~3.5 s)
def test_paraphrase_keeps_values_or_is_invalid():
    seed = _eval("Forecast for Oslo for the next 3 days please", {"city": "Oslo", "days": 3})

    def responder(prompt: str, j: int) -> str:
        return "Could you give me the 3-day forecast for Oslo?" if "Oslo" in prompt else "?"

    gen = make_generators(["paraphrase"])
    good, _ = generate_candidates([seed], gen, 1, policy=ScriptedPolicy(responder))
    assert good[0].problems == [] and "Could you give me" in request_text(good[0].task)
    assert check_solvable(good[0].task)[0]
    lossy, _ = generate_candidates([seed], gen, 1, policy=ScriptedPolicy(lambda p, j: "Could you give me the forecast?"))
    valid, rejected, _ = validate_candidates(lossy, ["paraphrase"])
    assert not valid and "lost value" in rejected[0].reason and rejected[0].reason_kind == "invalid"


# ------------------------------------------------------------------------------ validation
@pytest.mark.slow
def test_gx_suite_and_per_task_checks_reject_broken_candidates_naming_the_reason(seeds):
    cands, _ = generate_candidates(seeds[:4], make_generators(["distractor"]), 1, seed=0)
    bad_schema = copy.deepcopy(cands[0])
    bad_schema.task["prompt"]["tools"][0]["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": 7}}}
    bad_schema.task["task_id"] = synth_task_id(bad_schema.task)
    no_ref = copy.deepcopy(cands[1])
    no_ref.task["reference"] = {"tool_calls": []}
    no_ref.task["task_id"] = synth_task_id(no_ref.task)
    valid, rejected, gx = validate_candidates([bad_schema, no_ref, cands[2]], ["distractor"])
    assert [c.task_id for c in valid] == [cands[2].task_id]
    reasons = {r.task_id: r.reason for r in rejected}
    assert "tools_valid_schema" in reasons[bad_schema.task_id] and "not a valid JSON Schema" in reasons[bad_schema.task_id]
    assert "has_reference" in reasons[no_ref.task_id]
    assert gx["success"] is False and {f["column"] for f in gx["failed_expectations"]} >= {"tools_valid_schema", "has_reference"}


def test_a_task_whose_reference_fails_its_verifier_is_unsolvable():
    t = _eval("Weather in Oslo for 3 days", {"city": "Oslo", "days": 3})
    t["reference"]["tool_calls"][0]["arguments"]["days"] = 4
    ok, why = check_solvable(t)
    assert not ok and "reference fails its verifier" in why


# ------------------------------------------------------------------------------ dedup / decontamination
def _cand(task: dict, text: str | None = None, tools=None) -> Candidate:
    t = copy.deepcopy(task)
    if text is not None:
        t["prompt"]["messages"][-1]["content"] = text
    if tools is not None:
        t["prompt"]["tools"] = tools
        t["verifier"]["tools"] = tools
    t["task_id"] = synth_task_id(t)
    return Candidate(t, "test", [task["task_id"]])


def test_planted_duplicates_are_caught_and_real_variants_kept():
    base = _eval("Find the weather forecast for Oslo for the next 1000 days in celsius, with hourly detail", {"city": "Oslo", "days": 1000, "unit": "celsius"})
    other_tool = tool_spec("get_news", {"topic": {"type": "string"}}, ["topic"])
    planted = {
        "exact": _cand(base, "  find the WEATHER forecast for oslo for the next 1000 days in celsius with hourly detail!! "),
        "numbers": _cand(base, "Find the weather forecast for Oslo for the next 1,000 days in celsius, with hourly detail"),
        "reworded": _cand(base, "Please find the weather forecast for Oslo for the next 1000 days in celsius, with detail per hour"),
    }
    mutated = _eval("Find the weather forecast for Lima for the next 1000 days in celsius, with hourly detail",
                    {"city": "Lima", "days": 1000, "unit": "celsius"})
    keep = {
        "mutated": _cand(mutated),  # near-identical words, different answer: a real variant
        "distractor": _cand(base, tools=[WEATHER, other_tool]),  # same words, different tool menu
    }
    kept, rejected = dedup_candidates([*planted.values(), *keep.values()], [base], threshold=0.6)
    why = {r.task_id: r for r in rejected}
    assert why[planted["exact"].task_id].reason_kind == "duplicate"
    assert why[planted["numbers"].task_id].reason_kind == "duplicate"
    assert why[planted["reworded"].task_id].reason_kind == "near_duplicate"
    assert why[planted["reworded"].task_id].reason.startswith(f"near-duplicate-of {base['task_id']} (jaccard 0.")
    assert {c.task_id for c in kept} == {c.task_id for c in keep.values()}
    # Within a batch: the second copy of a kept candidate is a duplicate of the first.
    kept2, rej2 = dedup_candidates([keep["mutated"], _cand(mutated, "find the weather forecast for LIMA for the next 1000 days in celsius with hourly detail")], [], threshold=0.6)
    assert len(kept2) == 1 and rej2[0].matched == keep["mutated"].task_id


def test_false_positive_rate_on_known_distinct_tasks_is_at_most_one_percent():
    """BFCL simple_python: 400 distinct questions, one known reworded twin pair (triangle area,
    same answer): everything else must be kept."""
    tasks = bfcl_tasks("simple_python")
    kept, rejected = dedup_candidates([Candidate(t, "bfcl", [t["task_id"]]) for t in tasks], [], threshold=0.6)
    assert len(rejected) / len(tasks) <= 0.01, [r.reason for r in rejected]
    for r in rejected:  # each rejection is a real same-answer rewording
        a = next(t for t in tasks if t["task_id"] == r.task_id)
        assert "triangle" in request_text(a).lower()


def test_planted_contamination_of_a_held_out_task_is_caught():
    held = _eval("Give me the detailed hourly weather forecast for Reykjavik for the next 5 days in fahrenheit including wind speed and humidity",
                 {"city": "Reykjavik", "days": 5, "unit": "fahrenheit"}, tid="eval:heldout000000001")
    protected = [(held["task_id"], request_text(held))]
    leak_values = _cand(_eval(request_text(held).replace("Reykjavik", "Oslo").replace("5", "7"),
                              {"city": "Oslo", "days": 7, "unit": "fahrenheit"}))
    leak_ngram = _cand(_eval("Quick one: the detailed hourly weather forecast for Reykjavik for the next 5 days in fahrenheit including wind please, and also book me a taxi to the airport for tomorrow morning at nine",
                             {"city": "Reykjavik", "days": 5, "unit": "fahrenheit"}))
    clean = _cand(_eval("Weather in Lima for 2 days", {"city": "Lima", "days": 2}))
    kept, rejected = decontaminate([leak_values, leak_ngram, clean], protected, jaccard_threshold=0.5, ngram=13)
    assert [c.task_id for c in kept] == [clean.task_id]
    why = {r.task_id: r.reason for r in rejected}
    assert why[leak_values.task_id].startswith("contaminates held-out eval:heldout000000001 (near-duplicate")
    assert "eval:heldout000000001" in why[leak_ngram.task_id]


# ------------------------------------------------------------------------------ the stage
def _populate(store, cfg) -> None:
    from flywheel.artifacts import open_artifacts
    from flywheel.envs.build import build_envs
    from flywheel.evals import build_evals

    payloads = []
    for cat, n in (("simple_python", 16), ("parallel", 8), ("multiple", 8)):
        for it in load_bfcl(cat, n):
            payloads.append(failure_payload(it.question_messages, it.tools, {"role": "assistant", "content": "no"},
                                            ["no_tool_call"], correction={"tool_calls": bfcl_answer_to_expected(it.possible_answer)},
                                            source="bfcl", trace_id=f"trace:bfcl-{it.id}"))
    append_failures(store, payloads)
    a = open_artifacts(cfg)
    build_evals(cfg, store, a)
    build_envs(cfg, store, a)


@pytest.mark.slow
def test_run_synth_records_the_funnel_widens_the_env_and_rerunning_appends_nothing(cfg, store):
    from flywheel.artifacts import open_artifacts
    from flywheel.versioning import load_env

    _populate(store, cfg)
    a = open_artifacts(cfg)
    before = load_env(store, a, "train")
    stages = []
    s = run_synth(cfg, store, a, per_seed=3, progress=lambda st, d, n: stages.append(st))
    assert s.new and s.widened_env == before.entity_id and s.env == f"env:train@{before.version + 1}"
    f = s.to_dict()["funnel"]
    assert f["generated"] >= f["valid"] >= f["solvable"] >= f["unique"] >= f["uncontaminated"] >= f["accepted"] > 0
    assert sum(s.rejected_by_reason.values()) == f["generated"] - f["accepted"]
    assert {"generate", "validate", "verify", "dedup", "decontaminate"} <= set(stages)
    after = load_env(store, a, "train")
    synth = [t for t in after.tasks if t["task_id"].startswith("synth:")]
    assert len(synth) == f["accepted"] and s.batch in after.synth_batches
    assert all(t["metadata"]["seed_task"].startswith("eval:") and t["metadata"]["synth_batch"] == s.batch for t in synth)
    ev = store.read(stream=s.batch)
    assert len(ev) == 1 and ev[0].type == "synth.batch_accepted"
    p = ev[0].payload
    assert p["entity_id"] == s.batch and p["env"] == s.env and p["counts"]["accepted"] == f["accepted"]
    assert p["decontaminated_against"] and p["decontaminated_against"][0].startswith("suite:heldout@")
    assert before.entity_id in ev[0].causation and {t["metadata"]["seed_task"] for t in synth} <= set(ev[0].causation)
    acc = a.read_table(p["accepted_artifact"]["sha256"])
    rej = a.read_table(p["rejected_artifact"]["sha256"])
    assert acc.num_rows == f["accepted"] and rej.num_rows == f["generated"] - f["accepted"]
    assert {json.loads(x)["task_id"] for x in acc.column("task_json").to_pylist()} == {t["task_id"] for t in synth}

    # Re-running the same batch appends nothing and returns the recorded summary.
    n_events = store.last_seq()
    again = run_synth(cfg, store, a, per_seed=3)
    assert not again.new and again.batch == s.batch and again.env == s.env and again.counts == p["counts"]
    assert store.last_seq() == n_events and load_env(store, a, "train").version == after.version

    # A bigger batch dedups against the first batch's accepted tasks (not only within itself).
    bigger = run_synth(cfg, store, a, per_seed=4)
    assert bigger.batch != s.batch and bigger.rejected_by_reason.get("duplicate", 0) >= f["accepted"]
    firsts = set(synth_ids := {t["task_id"] for t in synth})
    rej2 = a.read_table(bigger.rejected_artifact["sha256"]).to_pylist()
    assert sum(1 for r in rej2 if r["reason_kind"] == "duplicate" and r["matched"] in firsts) >= len(synth_ids) * 0.9


@pytest.mark.slow
def test_difficulty_is_recorded_and_too_easy_tasks_can_be_dropped(cfg, store):
    from flywheel.artifacts import open_artifacts
    from flywheel.versioning import load_env

    _populate(store, cfg)
    a = open_artifacts(cfg)
    # A policy that always answers with a call to the first tool it sees without arguments: it
    # never passes, so every task is "too hard" and nothing is "too easy".
    def responder(prompt: str, j: int) -> str:
        m = re.search(r'"name": "([\w.]+)"', prompt)
        return f"[{m.group(1)}()]" if m else "no"

    cfg.synth.difficulty_samples = 2
    cfg.synth.difficulty_drop = "too_easy"
    s = run_synth(cfg, store, a, per_seed=1, generators=["distractor"], policy=ScriptedPolicy(responder))
    env = load_env(store, a, "train")
    synth = [t for t in env.tasks if t["task_id"].startswith("synth:")]
    assert synth and s.counts["accepted"] == len(synth)
    for t in synth:
        d = t["metadata"]["difficulty"]
        assert d["k"] == 2 and d["pass_rate"] == 0.0 and d["zero_advantage"] is True and d["policy"] == "scripted@0"


@pytest.mark.slow
def test_cli_synth_prints_the_funnel_as_json(cfg, store, home):
    import typer
    from typer.testing import CliRunner

    from flywheel.cli import synth as synth_cli

    _populate(store, cfg)
    store.close()
    app = typer.Typer()
    synth_cli.register(app)
    app.command("noop")(lambda: None)  # a second command keeps "synth" a sub-command
    r = CliRunner().invoke(app, ["synth", "--per-seed", "2", "--generators", "mutate,distractor", "--json", "--home", str(home)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["new"] is True and set(data["funnel"]) == {"generated", "valid", "solvable", "unique", "uncontaminated", "accepted"}
    assert set(data["by_generator"]) <= {"mutate", "distractor"}
    bad = CliRunner().invoke(app, ["synth", "--generators", "nope", "--home", str(home)])
    assert bad.exit_code == 1 and "unknown generator" in bad.output


@pytest.mark.slow
def test_a_second_cycle_keeps_held_out_items_away_from_earlier_synthetic_tasks(cfg, store):
    """Cycle 1 accepts a synthetic batch decontaminated against heldout@1. Cycle 2's traffic brings a
    question that is a near-copy of one of those synthetic variants: it must not be held out (the
    champion trained on its twin), and the batch is re-checked against heldout@2, so the gate's
    decontamination rule can vouch for every batch in a cycle-2 model's lineage."""
    from flywheel.artifacts import open_artifacts
    from flywheel.envs.build import build_envs
    from flywheel.evals import build_evals
    from flywheel.versioning import load_env, load_suite

    _populate(store, cfg)
    a = open_artifacts(cfg)
    s1 = run_synth(cfg, store, a, per_seed=2)
    held1 = load_suite(store, a, "heldout")
    assert s1.decontaminated_against == [held1.entity_id]
    variant = next(t for t in load_env(store, a, "train").tasks if t["task_id"].startswith("synth:"))

    # Wave 2: the variant's request arrives from production (lightly edited) and fails; with
    # heldout_fraction ~1 a fresh deal would hold it out.
    cfg.evals.heldout_fraction = 0.999
    q = request_text(variant) + " Thanks!"
    f = failure_payload([{"role": "user", "content": q}], variant["prompt"]["tools"],
                        {"role": "assistant", "content": "no"}, ["no_tool_call"],
                        correction={"tool_calls": variant["reference"]["tool_calls"]}, source="bfcl")
    others = [failure_payload([{"role": "user", "content": f"Completely new question number {i} about {w}"}], [],
                              {"role": "assistant", "content": "no"}, ["other"], correction={"content": "ok"})
              for i, w in enumerate(["tides", "volcanoes", "orchids"])]
    append_failures(store, [f, *others])
    summary = build_evals(cfg, store, a)
    state = store.entity(eval_id(f["entity_id"]))["state"]
    assert state["split"] == "excluded" and variant["task_id"] in state["excluded_because"]
    assert summary.excluded_contaminated == 1
    held2 = load_suite(store, a, "heldout")
    assert held2.version == 2 and eval_id(f["entity_id"]) not in held2.task_ids
    assert set(held1.task_ids) < set(held2.task_ids)  # a superset: no item changed side

    # Cycle 2's synth stage re-checks the cycle-1 batch against heldout@2 before anything else.
    build_envs(cfg, store, a)
    run_synth(cfg, store, a, per_seed=2)
    batch = store.entity(s1.batch)["state"]
    assert batch["decontaminated_against"] == [held1.entity_id, held2.entity_id] and batch["contaminated"] == []
    rechecks = store.read(stream=s1.batch, types="synth.batch_rechecked")
    assert len(rechecks) == 1 and rechecks[0].causation == []  # no lineage edge to the held-out suite
