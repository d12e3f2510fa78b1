"""End to end: evaluate -> gate -> promote -> rollback, through the real harness, verifiers, event
store and MLflow registry.

The models are scripted policies behind the real ``Policy`` interface (``generate`` returning
``Sample`` objects), registered as real MLflow versions. Why not tiny trained models: a tiny random
model passes 0% of tool-call evals and making one *reliably* better in seconds on 2 CPU cores is
not possible (FACTS.md: SFT to a useful pass rate takes ~20 minutes on SmolLM2-135M). A scripted
policy gives exact control of which held-out items each version solves, which is what the gate's
decisions depend on; everything downstream of ``generate`` (harness, tool-call parser, verifier,
caching, statistics, events, aliases) is the production code.
"""

from __future__ import annotations

import json

import pytest

from flywheel.artifacts import open_artifacts
from flywheel.champion import deployments
from flywheel.deploy import DeployError, PromotionRefused, promote, rollback
from flywheel.evaluate import ModelRef, evaluate_model
from flywheel.gate import run_gate
from flywheel.policy.base import Sample, SamplingParams
from flywheel.store import NewEvent
from flywheel.tracking import Tracker
from flywheel.versioning import suite_version_hash

pytestmark = pytest.mark.slow

TOOLS = {
    name: {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
    for name in ("get_weather", "get_time", "convert_currency")
}
N_PER_TOOL = 10


def _task(i: int, tool: str, split: str = "heldout") -> dict:
    return {
        "task_id": f"eval:{split}{i:02d}",
        "prompt": {"messages": [{"role": "user", "content": f"item {i}: call {tool} with arg v{i}"}], "tools": [TOOLS[tool]]},
        "verifier": {"kind": "tool_call", "tools": [TOOLS[tool]], "expected": [{"name": tool, "arguments": {"arg": f"v{i}"}}]},
        "harness": "single_turn",
        "tool_env": None,
        "reference": {"tool_calls": [{"name": tool, "arguments": {"arg": f"v{i}"}}]},
        "metadata": {"failure_kinds": ["wrong_arg_value"], "tools": [tool], "source": "bfcl", "split": split,
                     "cluster": f"{split}-c{i}", "origin_failure": f"failure:{split}{i}", "weak": False,
                     "deterministic": True},
    }


HELDOUT = [_task(i, tool) for i, tool in enumerate(t for t in TOOLS for _ in range(N_PER_TOOL))]
JUDGE_TASK = {**_task(99, "get_time"), "task_id": "eval:heldout-judge",
              "verifier": {"kind": "llm_judge", "rubric": "helpful"}}
JUDGE_TASK["metadata"] = {**JUDGE_TASK["metadata"], "deterministic": False}


class ScriptedPolicy:
    """Answers item i correctly iff i is in ``solves``; otherwise a valid call with a wrong value. An item
    in ``cuts`` is answered with half of its call, stopped at the decoding budget (finish reason "length")."""

    def __init__(self, version: str, solves: set[int], cuts: set[int] = frozenset()):
        self.name, self.version, self.solves, self.cuts = "scripted", version, set(solves), set(cuts)
        self.calls = 0

    def generate(self, prompts, params=None, *, tools=None):
        params = params if isinstance(params, SamplingParams) else SamplingParams()
        self.calls += 1
        out = []
        for msgs in prompts:
            text = msgs[-1]["content"]
            i = int(text.split(":")[0].split()[1])
            tool = text.split("call ")[1].split()[0]
            value = f"v{i}" if i in self.solves else "wrong"
            answer = f"[{tool}(arg='{value}')]"
            cut = i in self.cuts
            answer = answer[: len(answer) // 2] if cut else answer
            out.append([Sample(answer, [1, 2], [3], [-0.1], "length" if cut else "stop", cut, 1.0)
                        for _ in range(params.n)])
        return out


ALL = set(range(3 * N_PER_TOOL))
SOLVES = {
    "base": set(range(0, 30, 5)),  # 6/30
    1: set(range(0, 24)) | set(range(0, 30, 5)),  # 25/30
    2: set(range(0, 12)),  # worse than 1
    3: set(range(0, 24)) | set(range(0, 30, 5)),  # equal to 1
    4: ALL,  # 30/30, superset of 1: 5 wins, 0 losses (p = 1/32)
    5: set(range(0, 24)) | set(range(0, 30, 5)),
}


def _put_suite(store, artifacts, name: str, members: list[dict]) -> str:
    members = sorted(members, key=lambda t: t["task_id"])
    prev = store.read(stream=f"suite:{name}", types="suite.versioned")
    version = len(prev) + 1
    vh = suite_version_hash(name, members)
    ref = artifacts.put_json({"kind": "suite", "name": name, "version_hash": vh, "members": members})
    entity = f"suite:{name}@{version}"
    store.append(f"suite:{name}", NewEvent("suite.versioned", {
        "entity_id": entity, "name": name, "version": version, "artifact": ref.to_dict(),
        "members": len(members), "version_hash": vh}, [t["task_id"] for t in members]))
    return entity


@pytest.fixture(scope="module")
def template_home(tmp_path_factory):
    """Registry, suites and lineage built once per module (MLflow's first open costs ~10 s here);
    each test gets a private copy of the whole home directory."""
    from flywheel.config import load_config
    from flywheel.store import open_store

    root = tmp_path_factory.mktemp("gate-template")
    cfg = load_config(environ={}, overrides={"home": str(root / "home")})
    artifacts = open_artifacts(cfg)
    tracker = Tracker(cfg)
    ids = {}
    with open_store(cfg) as store:
        # training lineage: failure -> train eval -> train suite -> env (shared by every version)
        train = [_task(100 + i, "get_weather", "train") for i in range(3)]
        for t in train:
            fid = t["metadata"]["origin_failure"]
            store.append(fid, NewEvent("failure.classified", {"kinds": ["wrong_arg_value"]}, ["trace:x"]))
            store.append(t["task_id"], NewEvent("eval.created", {
                "entity_id": t["task_id"], **t, "split": "train", "cluster": t["metadata"]["cluster"],
                "origin_failure": fid, "failure_kinds": ["wrong_arg_value"], "tools": ["get_weather"]}, [fid]))
        train_suite = _put_suite(store, artifacts, "train", train)
        store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@1"}, [train_suite]))
        ids["heldout"] = _put_suite(store, artifacts, "heldout", HELDOUT + [JUDGE_TASK])
        ids["regression"] = _put_suite(store, artifacts, "regression", [
            {**_task(i, "get_weather"), "task_id": f"eval:reg{i}",
             "metadata": {**_task(i, "get_weather")["metadata"], "split": "regression"}} for i in (0, 5)])
        model_dir = root / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text("{}")
        for v in range(1, 6):
            with tracker.run("train", consumes=["env:train@1"]) as run:
                got = tracker.register_model("policy", model_dir, run_id=run.run_id,
                                             tags={"adapter": "false", "base_model": "scripted-base"})
            assert got == v
            store.append(f"run:r{v}", NewEvent("training.completed", {"entity_id": f"run:r{v}"}, ["env:train@1"]))
            store.append("model:policy", NewEvent("model.registered",
                         {"entity_id": f"model:policy/{v}", "version": v}, [f"run:r{v}"]))
    return cfg.home, ids


@pytest.fixture
def world(cfg, template_home):
    import shutil

    from flywheel.store import open_store

    src, ids = template_home
    shutil.copytree(src, cfg.home, dirs_exist_ok=True)
    cfg.gate.bootstrap_samples = 1000
    policies = {key: ScriptedPolicy(str(key), s) for key, s in SOLVES.items()}
    loads: list[str] = []

    def loader(ref: ModelRef):
        loads.append(str(ref))
        assert ref.spec == "scripted-base" if ref.is_base else True
        return policies["base" if ref.is_base else ref.version]

    store = open_store(cfg)
    yield {"cfg": cfg, "store": store, "artifacts": open_artifacts(cfg), "tracker": Tracker(cfg), "loader": loader,
           "loads": loads, **ids}
    store.close()


def _gate(w, v):
    return run_gate(w["cfg"], w["store"], w["artifacts"], w["tracker"], v, policy_loader=w["loader"])


def test_gate_promote_refuse_rollback(world):
    w = world
    cfg, store, tracker = w["cfg"], w["store"], w["tracker"]

    # -- a better challenger passes against the base model (no champion yet) and is promoted
    d1 = _gate(w, 1)
    assert d1.passed, d1.reasons
    n = d1.numbers
    assert n["champion"] == "base:scripted-base" and n["suite"] == w["heldout"]
    assert (n["paired_items"], n["infra_excluded"]) == (30, 1)  # the judge item: infra error, both sides
    assert "eval:heldout-judge" in n["infra_error_ids"]
    assert (n["wins"], n["losses"]) == (19, 0)
    assert n["challenger_pass_rate"] == pytest.approx(25 / 30) and n["champion_pass_rate"] == pytest.approx(6 / 30)
    assert n["ci_lo"] > 0 and n["regression"]["n"] == 2
    slices = {s["name"]: s for s in n["slices"]}
    assert slices["originating_failures"]["n"] == 10  # held-out wrong_arg_value on get_weather (trained tool)
    assert "tool:get_time" in slices and n["decontamination"]["decontaminated"] is True
    ev = store.read(stream=d1.gate_id, types="gate.decided")
    assert len(ev) == 1 and ev[0].payload["passed"] is True
    assert set(ev[0].causation) >= {"model:policy/1", w["heldout"], w["regression"]}
    assert {r["rule"] for r in ev[0].payload["rules"]} == {
        "min_paired_items", "significance", "min_improvement", "min_pass_rate", "max_slice_regression",
        "max_regression_failures", "require_decontaminated"}
    assert ev[0].payload["outcome"] == "passed" and ev[0].payload["p_value"] == pytest.approx(0.5**19)
    assert d1.report_path.exists() and "PASSED" in d1.report_path.read_text()
    run = tracker.get_run(ev[0].payload["mlflow_run_id"])
    assert run.data.tags["flywheel.gate.passed"] == "true" and run.data.metrics["passed"] == 1.0
    dep = promote(cfg, store, tracker, 1)
    assert (dep.from_version, dep.to_version, dep.gate, dep.forced) == (None, 1, d1.gate_id, False)
    assert tracker.get_alias_version("policy", "champion") == 1

    # -- a worse one and an equal one are refused with the reason; the champion is not re-evaluated
    loads_before = list(w["loads"])
    d2 = _gate(w, 2)
    assert not d2.passed
    assert w["loads"][len(loads_before):] == ["model:policy/2"]  # champion v1 came from the cache
    assert d2.numbers["champion_evaluation_cached"] is True
    failed = {r.rule: r for r in d2.rules if not r.passed}
    assert {"significance", "min_improvement", "max_slice_regression"} <= set(failed) and d2.outcome == "refused"
    assert any("does not exceed" in r for r in d2.reasons)
    d3 = _gate(w, 3)
    assert not d3.passed and [r.rule for r in d3.rules if not r.passed] == ["significance", "min_improvement"]
    assert d3.numbers["diff"] == 0.0 and (d3.numbers["wins"], d3.numbers["losses"]) == (0, 0)

    # -- promotion refused without a passing decision (refused decision / none at all)
    with pytest.raises(PromotionRefused, match="refused model:policy/2"):
        promote(cfg, store, tracker, 2)
    with pytest.raises(PromotionRefused, match="no gate decision for model:policy/5"):
        promote(cfg, store, tracker, 5)
    assert tracker.get_alias_version("policy", "champion") == 1

    # -- re-running a gate is a no-op: same decision, no new event, nothing re-evaluated
    n_loads, n_events = len(w["loads"]), store.last_seq()
    again = _gate(w, 3)
    assert again.cached and again.gate_id == d3.gate_id and store.last_seq() == n_events and len(w["loads"]) == n_loads

    # -- a truly better challenger against the champion passes and is promoted; rollback restores v1
    d4 = _gate(w, 4)
    assert d4.passed and d4.numbers["champion"] == "model:policy/1", d4.reasons
    promote(cfg, store, tracker, 4, decision=d4)
    assert tracker.get_alias_version("policy", "champion") == 4
    rb = rollback(cfg, store, tracker, reason="latency regression")
    assert (rb.from_version, rb.to_version) == (4, 1)
    assert tracker.get_alias_version("policy", "champion") == 1
    ev = store.read(stream="deploy:policy", types="model.rolled_back")[-1]
    assert ev.payload["to_version"] == 1 and ev.payload["reason"] == "latency regression"

    # -- the v4 decision was against champion v1; after a move to v5 it no longer applies
    with pytest.raises(DeployError, match="--force needs --reason"):
        promote(cfg, store, tracker, 5, force=True, reason="")
    forced = promote(cfg, store, tracker, 5, force=True, reason="hotfix for incident 42")
    assert forced.forced and forced.reason == "hotfix for incident 42" and forced.from_version == 1
    p = store.read(stream="deploy:policy", types="model.promoted")[-1].payload
    assert p["forced"] is True and p["gate_passed"] is False and "no gate decision" in p["refusal_overridden"]
    with pytest.raises(PromotionRefused, match="compared against model:policy/1"):
        promote(cfg, store, tracker, 4, decision=d4)

    hist = deployments(store, "policy")
    assert [(d.action, d.from_version, d.to_version) for d in hist] == [
        ("promote", None, 1), ("promote", 1, 4), ("rollback", 4, 1), ("promote", 1, 5)]
    assert all(d.user for d in hist) and hist[1].gate == d4.gate_id


def test_gate_counts_answers_cut_at_the_decoding_budget(world):
    """An answer stopped at gate.max_new_tokens is a cut-off call: the item's row counts it, the evaluation
    totals it, and the gate records (and its report says) the items both models failed with a cut answer --
    ties a larger budget could change (the demo's 48 tokens cut 5 of its cycle-2 held-out
    references short)."""
    w = world
    champion = ScriptedPolicy("base", SOLVES["base"], cuts={26, 27})
    challenger = ScriptedPolicy("1", SOLVES[1], cuts={3, 24, 26, 27, 28, 29})  # 3: it knows the call, cut short

    def loader(ref: ModelRef):
        return champion if ref.is_base else challenger

    d = run_gate(w["cfg"], w["store"], w["artifacts"], w["tracker"], 1, policy_loader=loader)
    cut = d.numbers["truncated"]
    assert cut["max_new_tokens"] == w["cfg"].gate.max_new_tokens and cut["counted"] is True
    assert (cut["challenger"], cut["champion"]) == (6, 2)
    # neither model passes 3, 24, 26-29 and an answer was cut: ties a larger budget could change (3 would be a win)
    assert cut["undecided"] == 6
    assert sorted(cut["undecided_ids"]) == [f"eval:heldout{i:02d}" for i in (3, 24, 26, 27, 28, 29)]
    assert (d.numbers["wins"], d.numbers["losses"]) == (18, 0)  # 19 without the cut
    assert "answers cut at max_new_tokens" in d.report_path.read_text()
    ev = w["store"].read(stream=d.numbers["challenger_evaluation"], types="eval.completed")[-1].payload
    assert ev["truncated"] == 6
    rows = evaluate_model(w["cfg"], w["store"], w["artifacts"], w["tracker"], 1, w["heldout"], policy_loader=loader)
    assert rows.cached and rows.by_task()["eval:heldout24"]["n_truncated"] == 1
    assert rows.by_task()["eval:heldout25"]["n_truncated"] == 0


def test_evaluation_is_cached_per_model_and_suite_version(world):
    w = world
    cfg, store, artifacts, tracker = w["cfg"], w["store"], w["artifacts"], w["tracker"]
    r1 = evaluate_model(cfg, store, artifacts, tracker, 1, "heldout", policy_loader=w["loader"])
    r2 = evaluate_model(cfg, store, artifacts, tracker, 1, w["heldout"], policy_loader=w["loader"])
    assert not r1.cached and r2.cached and r1.evaluation_id == r2.evaluation_id
    assert w["loads"] == ["model:policy/1"]
    assert r2.items.equals(r1.items) and r1.summary()["passed"] == 25
    ev = store.read(stream=r1.evaluation_id, types="eval.completed")
    assert len(ev) == 1 and ev[0].causation == ["model:policy/1", w["heldout"]]
    # a new suite version is a new evaluation; the items it shares with the earlier version (same
    # task records) are reused, so a subset needs no model at all ...
    _put_suite(store, artifacts, "heldout", HELDOUT[:5])
    r3 = evaluate_model(cfg, store, artifacts, tracker, 1, "heldout", policy_loader=w["loader"])
    assert not r3.cached and r3.suite == "suite:heldout@2" and r3.n_items == 5
    assert w["loads"] == ["model:policy/1"]
    assert store.read(stream=r3.evaluation_id)[-1].payload["reused_items"] == 5
    assert r3.items.to_pylist() == [r for r in r1.items.to_pylist() if r["task_id"] in {t["task_id"] for t in HELDOUT[:5]}]
    # ... and a grown version generates only its new items.
    new_items = [_task(200 + i, "get_time") for i in range(3)]
    _put_suite(store, artifacts, "heldout", HELDOUT[:5] + new_items)
    calls_before = sum(1 for _ in w["loads"])
    r5 = evaluate_model(cfg, store, artifacts, tracker, 1, "heldout", policy_loader=w["loader"])
    payload = store.read(stream=r5.evaluation_id)[-1].payload
    assert payload["reused_items"] == 5 and r5.n_items == 8 and len(w["loads"]) == calls_before + 1
    # a changed task record (same id) is not reused
    changed = {**HELDOUT[0], "reference": {"tool_calls": [{"name": "get_weather", "arguments": {"arg": "other"}}]}}
    _put_suite(store, artifacts, "heldout", [changed] + HELDOUT[1:5])
    r6 = evaluate_model(cfg, store, artifacts, tracker, 1, "heldout", policy_loader=w["loader"])
    assert store.read(stream=r6.evaluation_id)[-1].payload["reused_items"] == 4
    # a different decoding is a different cache key
    cfg.gate.max_new_tokens = 32
    r4 = evaluate_model(cfg, store, artifacts, tracker, 1, w["heldout"], policy_loader=w["loader"])
    assert not r4.cached and r4.evaluation_id != r1.evaluation_id


def test_cli_exit_codes(world, monkeypatch):
    from typer.testing import CliRunner

    from flywheel.cli import app

    w = world
    monkeypatch.setattr("flywheel.evaluate.default_policy_loader", lambda cfg, tracker: w["loader"])
    w["store"].close()  # the CLI opens the warehouse itself
    runner = CliRunner()
    res = runner.invoke(app, ["gate", "2", "--json"])
    assert res.exit_code == 3, res.output
    body = json.loads(res.stdout)
    assert body["passed"] is False and body["outcome"] == "refused"
    assert any(r["rule"] == "significance" and not r["passed"] for r in body["rules"])
    res = runner.invoke(app, ["promote", "2"])
    assert res.exit_code == 3 and "promotion refused" in res.output
    res = runner.invoke(app, ["gate", "1"])
    assert res.exit_code == 0, res.output
    assert "PASSED" in res.stdout
    assert runner.invoke(app, ["promote", "1"]).exit_code == 0
    res = runner.invoke(app, ["promote", "3", "--force"])
    assert res.exit_code == 1 and "--reason" in res.output
    assert runner.invoke(app, ["promote", "3", "--force", "--reason", "manual"]).exit_code == 0
    assert runner.invoke(app, ["rollback"]).exit_code == 0
    res = runner.invoke(app, ["deployments", "--json"])
    rows = json.loads(res.stdout)
    assert [(r["action"], r["to_version"], r["forced"]) for r in rows] == [
        ("promote", 1, False), ("promote", 3, True), ("rollback", 1, False)]
    res = runner.invoke(app, ["gate", "99"])
    assert res.exit_code == 1 and "model:policy/99 is not a registered version" in res.output


def test_gate_and_promote_take_the_model_references_of_rollout(world, monkeypatch):
    """`flywheel gate` / `promote` take what `rollout --policy` takes (challenger, champion,
    model:<name>/<N>, <name>/<N>) besides a bare version number; all name the same decision."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    w = world
    monkeypatch.setattr("flywheel.evaluate.default_policy_loader", lambda cfg, tracker: w["loader"])
    w["tracker"].set_alias("policy", "challenger", 2)
    w["store"].close()
    runner = CliRunner()
    by_number = json.loads(runner.invoke(app, ["gate", "2", "--json"]).stdout)
    for ref in ("challenger", "model:policy/2", "policy/2"):
        res = runner.invoke(app, ["gate", ref, "--json"])
        assert res.exit_code == 3, (ref, res.output)
        assert json.loads(res.stdout)["gate_id"] == by_number["gate_id"], ref
    res = runner.invoke(app, ["gate", "--json"])  # default: the challenger
    assert res.exit_code == 3 and json.loads(res.stdout)["gate_id"] == by_number["gate_id"]
    res = runner.invoke(app, ["promote", "challenger"])
    assert res.exit_code == 3 and "promotion refused" in res.output
    assert runner.invoke(app, ["gate", "policy/1"]).exit_code == 0
    assert runner.invoke(app, ["promote", "model:policy/1"]).exit_code == 0
    assert json.loads(runner.invoke(app, ["deployments", "--json"]).stdout)[-1]["to_version"] == 1
    for bad, why in (("model:other/2", "not a registered version"), ("smollm2-135m", "not a registered model version"),
                     ("http://127.0.0.1:1/v1", "not a registered model version")):
        res = runner.invoke(app, ["gate", bad])
        assert res.exit_code == 1 and why in res.output, (bad, res.output)


def test_too_few_paired_items_is_insufficient_evidence_and_the_champion_stays(world):
    from typer.testing import CliRunner

    from flywheel.cli import app

    w = world
    small = _put_suite(w["store"], w["artifacts"], "heldout", HELDOUT[:12])
    d = run_gate(w["cfg"], w["store"], w["artifacts"], w["tracker"], 4, suite=small, policy_loader=w["loader"])
    assert d.outcome == "insufficient_evidence" and not d.passed
    assert d.numbers["paired_items"] == 12 and d.numbers["wins"] > 0
    assert d.reasons[0].startswith("only 12 paired held-out items (< 30): insufficient evidence")
    ev = w["store"].read(stream=d.gate_id, types="gate.decided")[-1]
    assert ev.payload["outcome"] == "insufficient_evidence" and ev.payload["passed"] is False
    assert "INSUFFICIENT EVIDENCE" in d.report_path.read_text()
    with pytest.raises(PromotionRefused):
        promote(w["cfg"], w["store"], w["tracker"], 4)
    assert w["tracker"].get_alias_version("policy", "champion") is None
    # The CLI says so with its own exit code (4), distinct from a refusal (3).
    w["store"].close()
    import flywheel.evaluate as ev_mod

    orig = ev_mod.default_policy_loader
    ev_mod.default_policy_loader = lambda cfg, tracker: w["loader"]
    try:
        res = CliRunner().invoke(app, ["gate", "4", "--suite", "heldout@2", "--json"])
    finally:
        ev_mod.default_policy_loader = orig
    assert res.exit_code == 4, res.output
    assert json.loads(res.stdout)["outcome"] == "insufficient_evidence"


def test_an_unreadable_regression_suite_is_a_gate_error_not_a_passing_rule(world):
    from flywheel.gate import GateError

    w = world
    reg = w["store"].read(stream="suite:regression", types="suite.versioned")[-1].payload
    path = w["artifacts"].path(reg["artifact"]["sha256"], "json")
    path.chmod(0o600)
    path.write_text('{"kind": "suite", "members": "not a list"')  # bit rot: hash no longer matches
    with pytest.raises(GateError, match="regression suite 'regression' is recorded but unreadable"):
        _gate(w, 1)
    assert not w["store"].read(types="gate.decided")
