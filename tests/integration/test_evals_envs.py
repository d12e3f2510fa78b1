"""Production traffic -> ingest -> evals -> suites -> env -> episodes, through the real stages and CLI.

BFCL questions answered by a "production model" (half right, half wrong in typical ways) are
ingested with the BFCL replay adapter; every compiled eval must pass with its reference and fail
with the recorded failing answer; the env must run through the harness; rebuilding appends nothing.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flywheel.artifacts import open_artifacts
from flywheel.cli import app
from flywheel.envs.harness import run_episodes, verify_task
from flywheel.envs.testing import CharTokenizer, ScriptedPolicy
from flywheel.policy.base import SamplingParams
from flywheel.policy.format import render_answer, render_prompt
from flywheel.store import open_store
from flywheel.verifiers import ToolCall
from flywheel.verifiers.bfcl import load_bfcl, reference_calls
from flywheel.versioning import load_suite

N = 40


def _wrong(calls: list[ToolCall], i: int) -> str:
    """Typical production mistakes, cycling: prose, a dropped argument, a wrong value, a wrong name."""
    c = calls[0]
    mode = i % 4
    if mode == 0:
        return "I think you should look that up yourself."
    if mode == 1 and c.arguments:
        k = sorted(c.arguments)[0]
        return render_answer([ToolCall(c.name, {a: v for a, v in c.arguments.items() if a != k})])
    if mode == 2 and c.arguments:
        k = sorted(c.arguments)[0]
        v = c.arguments[k]
        bad = (v + 1000) if isinstance(v, int | float) and not isinstance(v, bool) else "zzz-not-it"
        return render_answer([ToolCall(c.name, {**c.arguments, k: bad})])
    return render_answer([ToolCall(c.name + "_v2", c.arguments)])


def _write_replay(path, items, hour: int = 8):
    """A BFCL replay log of ``items``: every other answer right, the others wrong in typical ways."""
    lines = []
    for i, item in enumerate(items):
        ref = reference_calls(item.possible_answer)
        answer = render_answer(ref) if i % 2 == 0 else _wrong(ref, i)
        lines.append(json.dumps({"bfcl_id": item.id, "answer": answer, "model": "prod-v1",
                                 "timestamp": f"2026-11-02T{hour:02d}:{i % 60:02d}:00Z"}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def replay_file(tmp_path):
    return _write_replay(tmp_path / "replay.jsonl", load_bfcl("simple_python", limit=N))


def _cli(*args: str) -> dict:
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.slow
def test_bfcl_traffic_to_evals_to_env_to_episodes(cfg, replay_file):
    from flywheel.ingest import ingest_paths

    arts = open_artifacts(cfg)
    with open_store(cfg) as s:
        summary = ingest_paths(cfg, s, arts, [str(replay_file)], fmt="bfcl")
        assert summary.successes == N // 2

    built = _cli("evals", "build")
    assert sum(built["created"].values()) == N  # 20 failures + 20 successes
    # Failures and successes are dealt by request cluster alike: train-side successes form the regression
    # suite, held-out ones join the held-out suite (the keep rate).
    assert sum(built["splits"].values()) == N
    held = built["heldout"]
    assert held["items"] == built["splits"]["heldout"] and held["failures"] + held["successes"] == held["items"]
    envs = _cli("envs", "build")
    assert envs["envs"][0]["env"] == "env:train@1"

    with open_store(cfg) as s:
        # Every failure eval passes with its reference and fails with the answer that failed.
        evals = [e["state"] for e in s.entities("eval")]
        failures = {e["entity_id"]: e["state"] for e in s.entities("failure")}
        for st in evals:
            task = {k: st[k] for k in ("task_id", "prompt", "verifier", "harness", "tool_env", "reference", "metadata")}
            ref = task["reference"]["tool_calls"]
            good = {"role": "assistant", "content": render_answer([ToolCall(c["name"], c["arguments"]) for c in ref])}
            assert verify_task(task, [*task["prompt"]["messages"], good]).passed, task["task_id"]
            if st["metadata"]["origin_outcome"] == "failure":  # (held-out successes are not failures)
                assert st["verifier"]["kind"] == "tool_call" and st["metadata"]["source"] == "bfcl"
                bad = failures[st["origin_failure"]]["bad_answer"]
                assert not verify_task(task, [*task["prompt"]["messages"], bad]).passed, task["task_id"]
        sides: dict[str, dict[str, int]] = {"failure": {}, "success": {}}
        for st in evals:
            o = sides[st["metadata"]["origin_outcome"]]
            o[st["split"]] = o.get(st["split"], 0) + 1
        assert sum(sides["failure"].values()) == sum(sides["success"].values()) == N // 2
        assert set(sides["failure"]) <= {"train", "heldout", "excluded"}
        assert set(sides["success"]) <= {"regression", "heldout", "excluded"}
        assert sides["success"].get("heldout", 0) == held["successes"]
        reg = load_suite(s, arts, "regression")
        assert len(reg.tasks) == built["splits"]["regression"]
        assert all(t["metadata"]["origin_outcome"] == "success" for t in reg.tasks)

    listed = _cli("envs", "list")
    assert listed[0]["env"] == "env:train@1" and listed[0]["tasks"] == envs["envs"][0]["tasks"]
    shown = _cli("envs", "show", "train")
    assert shown["tasks"] == len(shown["task_records"]) and shown["by_verifier"] == {"tool_call": shown["tasks"]}

    # The env runs through the harness: a policy that answers with each task's reference passes all.
    refs = {t["task_id"]: render_answer([ToolCall(c["name"], c["arguments"]) for c in t["reference"]["tool_calls"]])
            for t in shown["task_records"]}
    prompt_of = {json.dumps(t["prompt"]["messages"][-1]["content"]): t["task_id"] for t in shown["task_records"]}

    def oracle(prompt_text: str, j: int) -> str:
        tid = next(t for q, t in prompt_of.items() if json.loads(q) in prompt_text)
        return refs[tid] if j == 0 else "no idea"

    eps = run_episodes(shown["task_records"], ScriptedPolicy(oracle), SamplingParams(n=2, max_new_tokens=512), context=cfg)
    assert all(row[0].passed and not row[1].passed for row in eps)

    # Rebuilding everything from the same inputs appends nothing.
    with open_store(cfg) as s:
        seq = s.last_seq()
    assert _cli("evals", "build")["events_appended"] == 0
    assert _cli("envs", "build")["events_appended"] == 0
    with open_store(cfg) as s:
        assert s.last_seq() == seq


@pytest.mark.slow
def test_every_suite_renders_the_prompt_production_was_served(cfg, tmp_path):
    """The gate, the rollouts and SFT render a task from its stored record; `serve` rendered the request.
    The stores write canonical JSON (sorted keys), so a tool schema comes back from a suite with its keys
    reordered: the champion was judged -- and trained -- on another prompt than production sent it (a
    demo's champion passed 15 of 30 of its production successes rendered from the suite, 28 of 30 as
    served). Every task of every suite
    must render exactly the prompt its production request rendered."""
    from flywheel.ingest import ingest_paths

    items = [*load_bfcl("parallel", limit=12), *load_bfcl("multiple", limit=12)]
    replay = _write_replay(tmp_path / "replay.jsonl", items, hour=9)
    arts = open_artifacts(cfg)
    with open_store(cfg) as s:
        ingest_paths(cfg, s, arts, [str(replay)], fmt="bfcl")
    _cli("evals", "build")
    _cli("envs", "build")
    tok = CharTokenizer()
    served = {item.question_messages[-1]["content"]: render_prompt(tok, item.question_messages, item.tools)
              for item in items}
    seen: dict[str, str] = {}

    def record(prompt_text: str, j: int) -> str:
        question = next(q for q in served if q in prompt_text)
        seen[question] = prompt_text
        return "[]"

    with open_store(cfg) as s:
        tasks = [*load_suite(s, arts, "heldout").tasks, *load_suite(s, arts, "regression").tasks]
    tasks += _cli("envs", "show", "train")["task_records"]
    assert len(tasks) >= len(items) // 2  # (a cluster may be excluded from every suite)
    # The stored schemas really are reordered (otherwise this test would prove nothing).
    assert any(list(t["prompt"]["tools"][0]["function"]) != ["name", "description", "parameters"] for t in tasks)
    run_episodes(tasks, ScriptedPolicy(record, tok), SamplingParams(n=1, max_new_tokens=8), context=cfg)
    assert len(seen) == len(tasks)
    differ = [q for q in seen if seen[q] != served[q]]
    assert not differ, f"{len(differ)} of {len(seen)} tasks render another prompt than production: {differ[:2]}"


def test_cli_tables_and_errors(cfg):
    runner = CliRunner()
    res = runner.invoke(app, ["evals", "build"])
    assert res.exit_code == 0 and "splits" in res.output
    res = runner.invoke(app, ["envs", "show", "train"])
    assert res.exit_code == 1 and "envs build" in res.output
    res = runner.invoke(app, ["envs", "list", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == []
