"""The train/held-out split: stable, by cluster, near-duplicates together, no cluster on both sides."""

from __future__ import annotations

import itertools

from fixtures import agent_traffic

from flywheel.artifacts import open_artifacts
from flywheel.dedup import char_shingles, jaccard
from flywheel.envs.testing import append_failures, failure_payload, openai_call
from flywheel.evals import build_evals
from flywheel.split import (
    SHINGLE,
    SplitIndex,
    deal,
    normalise,
    normalised_tool_names,
    request_key,
    request_text,
)
from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl
from flywheel.versioning import load_suite


def _j5(a: str, b: str) -> float:
    """The exact Jaccard of two request texts' character 5-gram sets: what the split confirms with."""
    return jaccard(char_shingles(a, SHINGLE), char_shingles(b, SHINGLE))


def test_request_text_is_the_user_turns_normalised_and_ignores_answers():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in  PORTO, please!"},
            {"role": "assistant", "content": "whatever"}, {"role": "tool", "content": "{}"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    # The system prompt and the tools are what an agent's requests share: not in the text.
    assert request_text(msgs, tools) == "weather in porto please"
    assert request_key(msgs, tools) == ("weather in porto please", ("get weather",))
    assert normalise("Ｗｅａｔｈｅｒ—in Porto?") == "weather in porto"  # NFKC + punctuation runs
    # No user text at all: the system text is what varies.
    assert request_text([{"role": "system", "content": "Summarise ticket #42"}]) == "summarise ticket 42"


def test_the_same_words_put_to_another_agent_are_another_request():
    idx = SplitIndex(heldout_fraction=0.5, seed="s", jaccard=0.7)
    q = [{"role": "user", "content": "What can you do for me today?"}]
    travel = normalised_tool_names([{"type": "function", "function": {"name": n}} for n in ("get_weather", "search_hotels")])
    bank = normalised_tool_names([{"type": "function", "function": {"name": n}} for n in ("get_balance", "transfer_funds")])
    a = idx.assign("a", request_text(q), travel)
    b = idx.assign("b", request_text(q), bank)
    assert a.cluster != b.cluster and a.request_hash != b.request_hash
    # ... while a tool list that mostly overlaps (one tool added in a later deploy) is the same agent.
    travel2 = tuple(sorted(travel + ("convert currency",)))
    c = idx.assign("c", request_text([{"role": "user", "content": "what can you do for me today"}]), travel2)
    assert c.cluster == a.cluster


def _place(traffic, seed="flywheel-split-v1", fraction=0.3):
    idx = SplitIndex(heldout_fraction=fraction, seed=seed, jaccard=0.7)
    return [idx.assign(f"r{i}", *request_key(r.messages, r.tools)) for i, r in enumerate(traffic)]


def test_an_agent_with_a_long_shared_system_prompt_gets_a_heldout_share():
    """80 requests of a travel agent (1,479-character system prompt, 4 tools, 68 distinct questions
    in 20 cities + 12 near-paraphrases). Clustered on the whole request text they all looked alike:
    one cluster, 80 train and 0 held-out. Clustered on what varies, the held-out share is near 0.3
    and every paraphrase sits with its original."""
    traffic = agent_traffic.travel_traffic()
    assert len(traffic) == 80 and len(agent_traffic.TRAVEL_SYSTEM) > 1400
    for seed in ("flywheel-split-v1", "another-seed"):
        placed = _place(traffic, seed)
        share = sum(p.split == "heldout" for p in placed) / len(placed)
        assert 0.2 <= share <= 0.4, (seed, share)
        assert len({p.cluster for p in placed}) >= 60  # distinct questions are distinct clusters
        by_question: dict[str, set[str]] = {}
        for r, p in zip(traffic, placed, strict=True):
            by_question.setdefault(r.paraphrase_of or r.question, set()).add(p.cluster)
        assert all(len(c) == 1 for c in by_question.values()), "a near-paraphrase left its original's cluster"


def test_several_agents_templated_and_free_form_questions_split_by_cluster():
    traffic = agent_traffic.travel_traffic() + agent_traffic.bank_traffic() + agent_traffic.code_traffic()
    placed = _place(traffic)
    share = sum(p.split == "heldout" for p in placed) / len(placed)
    assert abs(share - 0.3) <= 0.1, share
    clusters: dict[str, set[str]] = {}
    agents: dict[str, set[str]] = {}
    for r, p in zip(traffic, placed, strict=True):
        clusters.setdefault(p.cluster, set()).add(p.split)
        agents.setdefault(p.cluster, set()).add(r.agent)
    assert all(len(v) == 1 for v in clusters.values())  # a cluster lives on one side
    assert all(len(v) == 1 for v in agents.values())  # and never spans two agents
    # Each agent contributes to both sides.
    for agent in ("travel", "bank", "code"):
        sides = {p.split for r, p in zip(traffic, placed, strict=True) if r.agent == agent}
        assert sides == {"train", "heldout"}, (agent, sides)


def test_deal_is_a_pure_function_of_cluster_and_seed():
    clusters = [f"c-{i:04d}" for i in range(2000)]
    first = [deal(c, "s", 0.3) for c in clusters]
    assert first == [deal(c, "s", 0.3) for c in clusters]
    share = first.count("heldout") / len(first)
    assert 0.26 < share < 0.34  # ~Binomial(2000, 0.3): 4 standard deviations is +-0.041
    assert first != [deal(c, "other-seed", 0.3) for c in clusters]


VARIANTS = [
    "Find the area of a triangle with a base of 10 units and height of 5 units.",
    "find the area of a triangle with a base of 10 units and height of 5 units",
    "Find the area of a triangle, with a base of 10 units and a height of 5 units!",
    "Find the area of the triangle with a base of 10 units and height of 5 units?",
]


def test_near_duplicates_join_one_cluster_whatever_the_order():
    for order in itertools.permutations(VARIANTS):
        idx = SplitIndex(heldout_fraction=0.5, seed="s", jaccard=0.7)
        placed = [idx.assign(f"f{i}", request_text([{"role": "user", "content": t}])) for i, t in enumerate(order)]
        assert len({p.cluster for p in placed}) == 1
        assert len({p.split for p in placed}) == 1
    # ... and a different request does not join it.
    other = idx.assign("g", request_text([{"role": "user", "content": "Calculate the factorial of 5 using math."}]))
    assert other.cluster != placed[0].cluster and other.matched == ()


def test_recorded_placements_never_move_even_when_the_config_changes():
    idx = SplitIndex(heldout_fraction=0.5, seed="s", jaccard=0.7)
    text = request_text([{"role": "user", "content": VARIANTS[0]}])
    # Recorded as held-out although a fresh deal with these settings may say otherwise.
    p = idx.add_existing("f0", text, "c-recorded", "heldout")
    assert (p.split, p.cluster, p.new) == ("heldout", "c-recorded", False)
    assert idx.assign("f0", text) is p
    # A near-duplicate arriving later joins the recorded cluster and side.
    q = idx.assign("f1", request_text([{"role": "user", "content": VARIANTS[2]}]))
    assert (q.cluster, q.split) == ("c-recorded", "heldout")


def test_a_request_bridging_train_and_heldout_is_excluded_from_both():
    idx = SplitIndex(heldout_fraction=0.5, seed="s", jaccard=0.7)
    words = "please book a table for four people at the tasca restaurant tonight at half past eight near the old harbour"
    base = words
    left = " ".join(words.split()[:-4])  # drops the tail
    right = " ".join(words.split()[4:])  # drops the head
    # left and right are not near each other (~0.59) but the full request is near both (~0.83, ~0.76):
    # exact 5-gram Jaccards, which is what the index confirms with.
    assert _j5(left, right) < 0.7
    assert min(_j5(base, left), _j5(base, right)) >= 0.7
    idx.add_existing("a", left, "c-a", "train")
    idx.add_existing("c", right, "c-c", "heldout")
    b = idx.assign("b", base)
    assert b.split == "excluded" and set(b.matched) == {"c-a", "c-c"}
    # A near-copy of the bridge stays out too.
    assert idx.assign("b2", base + " ").split == "excluded"


# ------------------------------------------------------------------------------ through the store
def _bfcl_failures(n: int, start: int = 0) -> list[dict]:
    """BFCL questions as wrong_arg_value failures, plus two near-duplicate re-phrasings of each of
    the first five (so clusters with several members exist)."""
    out = []
    for i, item in enumerate(load_bfcl("simple_python", limit=start + n)[start:]):
        corr = {"tool_calls": bfcl_answer_to_expected(item.possible_answer)}
        bad = openai_call(corr["tool_calls"][0]["name"], {"wrong": 1})
        q = item.question_messages[-1]["content"]
        variants = [q] + ([q.upper(), q.rstrip(".?!") + " please."] if i < 5 else [])
        for v in variants:
            out.append(failure_payload([{"role": "user", "content": v}], item.tools, bad, ["wrong_arg_value"],
                                       correction=corr, source="bfcl"))
    return out


def _placements(store) -> dict[str, tuple[str, str]]:
    return {e["state"]["origin_failure"]: (e["state"]["split"], e["state"]["cluster"])
            for e in store.entities("eval") if e["state"]["split"] != "regression"}


def test_split_is_stable_across_rebuilds_new_failures_and_config_changes(cfg, store):
    arts = open_artifacts(cfg)
    failures = _bfcl_failures(60)
    append_failures(store, failures)
    build_evals(cfg, store, arts)
    before = _placements(store)
    assert len(before) == 70
    assert {s for s, _ in before.values()} == {"train", "heldout"}

    # Near-duplicates share a cluster (and so a side).
    clusters = {}
    for split, cluster in before.values():
        clusters.setdefault(cluster, set()).add(split)
    assert max(len(v) for v in clusters.values()) == 1
    for i in range(5):  # each question and its two re-phrasings (failures 3i..3i+2)
        group = {before[f["entity_id"]][1] for f in failures[3 * i : 3 * i + 3]}
        assert len(group) == 1, f"variants of question {i} landed in clusters {group}"
    # BFCL itself holds near-duplicates: simple_python_0 and _11 ask for the same triangle area
    # (5-gram Jaccard ~0.82); the split must keep them together.
    q0, q11 = failures[0]["entity_id"], failures[15 + 11 - 5]["entity_id"]
    assert "what is the area of a triangle" in failures[15 + 11 - 5]["messages"][0]["content"].lower()
    assert before[q0] == before[q11]

    # Change the deal entirely, add new failures, rebuild: no recorded failure moves.
    cfg.evals.heldout_fraction = 0.9
    cfg.evals.split_seed = "another-seed"
    append_failures(store, _bfcl_failures(20, start=60))
    build_evals(cfg, store, arts)
    after = _placements(store)
    assert {k: after[k] for k in before} == before
    assert len(after) == 100

    # Held-out and train never share a cluster, and no cross pair is a near-duplicate.
    train, held = load_suite(store, arts, "train"), load_suite(store, arts, "heldout")
    assert not {t["metadata"]["cluster"] for t in train.tasks} & {t["metadata"]["cluster"] for t in held.tasks}
    text = {t["task_id"]: request_text(t["prompt"]["messages"]) for t in train.tasks + held.tasks}
    worst = max(_j5(text[a["task_id"]], text[b["task_id"]]) for a in train.tasks for b in held.tasks)
    assert worst < cfg.evals.cluster_jaccard
