"""``flywheel trace`` and ``flywheel impact`` on a store built by hand: one production failure that made
it all the way to a deployed model (trace -> failure -> eval -> suite -> env -> rollouts -> run ->
model -> gate -> deploy), next to an unrelated trace whose failure went nowhere. No models, no MLflow."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.store import EventStore, NewEvent

runner = CliRunner()

CHAIN = [
    "model:policy/1", "run:r1", "rollouts:ro1", "env:train@1", "suite:train@1", "eval:e1", "failure:f1", "trace:t1",
    "ingest:b1",  # the ingest batch that recorded the trace
]


def cli(*args: str, ok: bool = True):
    r = runner.invoke(app, list(args))
    if ok:
        assert r.exit_code == 0, (r.output, r.exception)
    return r


@pytest.fixture
def chain(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home.mkdir(parents=True, mode=0o700)
    with EventStore(home / "warehouse.duckdb") as s:
        for tid, ts, status in (("t1", "2026-11-20T10:00:00Z", "failure"), ("t2", "2026-11-21T11:00:00Z", "failure"),
                                ("t3", "2026-11-21T12:00:00Z", "success")):
            s.append(f"trace:{tid}", NewEvent("trace.ingested", {"timestamp": ts, "status": status, "model": "policy/base",
                                                                   "kinds": ["tool_call_malformed"] if status == "failure" else []},
                                               ["ingest:b1"]))
        s.append("failure:f1", NewEvent("failure.classified", {"kinds": ["tool_call_malformed"], "trace_ids": ["t1"],
                                                                "occurrences": 1}, ["trace:t1"]))
        s.append("failure:f2", NewEvent("failure.classified", {"kinds": ["wrong_arguments"], "trace_ids": ["trace:t2"]},
                                        ["trace:t2"]))
        s.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["failure:f1"]))
        s.append("eval:e2", NewEvent("eval.created", {"split": "heldout"}, ["failure:f2"]))
        s.append("suite:train", NewEvent("suite.versioned", {"entity_id": "suite:train@1", "version": 1,
                                                              "members": 1}, ["eval:e1"]))
        s.append("suite:heldout", NewEvent("suite.versioned", {"entity_id": "suite:heldout@1", "version": 1},
                                           ["eval:e2"]))
        s.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@1", "version": 1}, ["suite:train@1"]))
        s.append("rollouts:ro1", NewEvent("rollouts.published", {"policy": "base:tiny", "samples": 4,
                                                                  "stats": {"pass_at_1": 0.25}}, ["env:train@1"]))
        s.append("run:r1", NewEvent("training.completed", {"mode": "grpo", "steps": 1}, ["rollouts:ro1"]))
        s.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/1", "run": "run:r1"},
                                          ["run:r1"]))
        s.append("gate:g1", NewEvent("gate.decided", {"passed": True, "reasons": []}, ["model:policy/1", "suite:heldout@1"]))
        s.append("deploy:policy", NewEvent("model.promoted", {"model": "policy", "to_version": 1}, ["gate:g1",
                                                                                                     "model:policy/1"]))
    return home


def _walk(node: dict) -> list[dict]:
    out = [node]
    for c in node["children"]:
        out += _walk(c)
    return out


def test_trace_json_walks_from_model_to_the_production_trace(chain):
    data = json.loads(cli("trace", "model:policy/1", "--home", str(chain), "--json").stdout)
    assert data["root"] == "model:policy/1"
    nodes = _walk(data["tree"])
    ids = [n["entity_id"] for n in nodes]
    assert ids == CHAIN, "the tree is the chain, model first, nothing else"  # t2/f2, gate, deploy are no causes
    # Each node is a child of the one before it (a path, not a flat list).
    node = data["tree"]
    for eid in CHAIN[1:]:
        assert [c["entity_id"] for c in node["children"]] == [eid]
        node = node["children"][0]
    facts = {n["entity_id"]: n["facts"] for n in nodes}
    assert facts["trace:t1"]["timestamp"] == "2026-11-20T10:00:00Z"
    assert facts["failure:f1"]["kinds"] == ["tool_call_malformed"]
    assert facts["run:r1"]["mode"] == "grpo"
    assert data["traces"] == [{"trace": "trace:t1", "timestamp": "2026-11-20T10:00:00Z", "status": "failure",
                               "failure_kinds": ["tool_call_malformed"]}]


def test_trace_accepts_short_references_and_renders_tree_and_mermaid(chain):
    short = json.loads(cli("trace", "policy/1", "--home", str(chain), "--json").stdout)
    assert short["root"] == "model:policy/1"

    tree = cli("trace", "policy/1", "--home", str(chain)).stdout
    positions = [tree.index(eid) for eid in CHAIN]
    assert positions == sorted(positions), "the tree lists the chain from the model down to the trace"
    assert "tool_call_malformed" in tree and "2026-11-20T10:00:00Z" in tree
    assert "1 production traces behind model:policy/1" in tree
    assert "kinds=['tool_call_malformed']" in tree  # facts print as text, not as rich markup

    mer = cli("trace", "model:policy/1", "--home", str(chain), "--format", "mermaid").stdout
    lines = mer.strip().splitlines()
    assert lines[0] == "graph TD"
    names = {}
    for ln in lines[1:]:
        if "[" in ln:
            nid, label = ln.strip().split("[", 1)
            names[nid] = label.strip('"]')
    assert sorted(names.values()) == sorted(CHAIN)
    edges = {(names[a.strip()], names[b.strip()]) for a, b in (ln.split("-->") for ln in lines if "-->" in ln)}
    assert edges == set(zip(CHAIN, CHAIN[1:], strict=False))


def test_trace_refuses_unknown_and_bad_format(chain):
    r = cli("trace", "model:policy/9", "--home", str(chain), ok=False)
    assert r.exit_code == 1 and "unknown entity 'model:policy/9'" in r.output and "Traceback" not in r.output
    r = cli("trace", "policy/1", "--home", str(chain), "--format", "dot", ok=False)
    assert r.exit_code == 1 and "--format must be tree or mermaid" in r.output


def test_impact_lists_everything_descending_from_a_trace(chain):
    data = json.loads(cli("impact", "trace:t1", "--home", str(chain), "--json").stdout)
    assert data["root"] == "trace:t1"
    imp = data["impact"]
    assert imp["failure"] == ["failure:f1"] and imp["eval"] == ["eval:e1"]
    assert imp["suite"] == ["suite:train@1"] and imp["env"] == ["env:train@1"]
    assert imp["rollouts"] == ["rollouts:ro1"] and imp["run"] == ["run:r1"]
    assert imp["model"] == ["model:policy/1"] and imp["gate"] == ["gate:g1"]
    assert imp["deploy"] == ["deploy:policy#1 (model.promoted)"]
    # The other trace's failure went to the held-out suite only: it trained nothing, deployed nothing.
    other = json.loads(cli("impact", "trace:t2", "--home", str(chain), "--json").stdout)["impact"]
    assert other["failure"] == ["failure:f2"] and other["suite"] == ["suite:heldout@1"]
    assert other["gate"] == ["gate:g1"]  # it gated the model (held-out), so the gate descends from it
    assert "model" not in other and "run" not in other and "rollouts" not in other
    # A successful trace with no failure has no impact at all.
    assert json.loads(cli("impact", "trace:t3", "--home", str(chain), "--json").stdout)["impact"] == {}


def test_impact_table(chain):
    text = cli("impact", "trace:t1", "--home", str(chain)).stdout
    rows = [ln for ln in text.splitlines() if "│" in ln]
    kinds = [ln.split("│")[1].strip() for ln in rows]  # the header row uses ┃
    assert kinds == ["failure", "eval", "suite", "env", "rollouts", "run", "model", "gate", "deploy"]


def test_resolve_champion_through_the_registry(chain):
    from flywheel.lineage import LineageError, resolve_ref

    class Registry:  # the two calls resolve_ref makes of flywheel.tracking.Tracker
        def __init__(self, aliases):
            self.aliases = aliases

        def get_alias_version(self, name, alias):
            return self.aliases.get((name, alias))

    with EventStore(chain / "warehouse.duckdb") as s:
        assert resolve_ref(s, Registry({("policy", "champion"): 1}), "champion") == "model:policy/1"
        with pytest.raises(LineageError, match="no version of 'policy' has the alias 'challenger'"):
            resolve_ref(s, Registry({}), "challenger")
        with pytest.raises(LineageError, match="needs the MLflow registry"):
            resolve_ref(s, None, "champion")
