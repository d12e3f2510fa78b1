"""Real tiny Hugging Face models through the gate: a registered full model and a registered LoRA
adapter load through :func:`flywheel.policy.registry.load_policy_for_version`, and a challenger with the champion's exact
weights is refused as "equal" (both generate the same answers greedily, through the real harness)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {"name": "echo", "description": "echo", "parameters": {
    "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}


def _put_heldout(store, artifacts, n: int) -> str:
    from flywheel.store import NewEvent
    from flywheel.versioning import suite_version_hash

    members = [{
        "task_id": f"eval:h{i}", "prompt": {"messages": [{"role": "user", "content": f"echo v{i}"}], "tools": [TOOL]},
        "verifier": {"kind": "tool_call", "tools": [TOOL], "expected": [{"name": "echo", "arguments": {"arg": f"v{i}"}}]},
        "harness": "single_turn", "tool_env": None, "reference": None,
        "metadata": {"failure_kinds": ["wrong_arg_value"], "tools": ["echo"], "source": "test", "split": "heldout"},
    } for i in range(n)]
    vh = suite_version_hash("heldout", members)
    ref = artifacts.put_json({"kind": "suite", "name": "heldout", "version_hash": vh, "members": members})
    store.append("suite:heldout", NewEvent("suite.versioned", {"entity_id": "suite:heldout@1", "name": "heldout", "version": 1,
                 "artifact": ref.to_dict(), "members": n, "version_hash": vh}, [m["task_id"] for m in members]))
    return "suite:heldout@1"


def test_full_and_adapter_versions_load_and_equal_weights_are_refused(cfg, store, tmp_path):
    import torch

    from flywheel.artifacts import open_artifacts
    from flywheel.deploy import promote
    from flywheel.gate import run_gate
    from flywheel.policy.hf import HFPolicy
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.store import NewEvent
    from flywheel.tracking import Tracker
    from flywheel.train.trainer import apply_lora

    torch.manual_seed(0)
    cfg.policy.base_model = "tiny"
    cfg.gate.max_new_tokens = 8
    cfg.gate.bootstrap_samples = 200
    cfg.gate.require_decontaminated = False  # no training lineage in this test
    artifacts = open_artifacts(cfg)
    tracker = Tracker(cfg)
    _put_heldout(store, artifacts, 6)

    base = HFPolicy.from_spec("tiny", cfg.home)
    full_dir = tmp_path / "full"
    base.model.save_pretrained(full_dir)
    base.tokenizer.save_pretrained(full_dir)
    lora = apply_lora(base.model, r=2, alpha=4)
    with torch.no_grad():  # make the adapter non-trivial (peft initialises B = 0)
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapter_dir = tmp_path / "adapter"
    lora.save_pretrained(adapter_dir)

    versions = []
    for d, is_adapter in ((full_dir, "false"), (full_dir, "false"), (adapter_dir, "true")):
        with tracker.run("train") as run:  # one run per version: each run's "model" folder is its files
            versions.append(tracker.register_model("policy", d, run_id=run.run_id,
                                                   tags={"adapter": is_adapter, "base_model": "tiny"}))
    v1, v2, v3 = versions
    for v in (v1, v2, v3):
        store.append("model:policy", NewEvent("model.registered", {"entity_id": f"model:policy/{v}"}, []))

    p1 = load_policy_for_version(cfg, tracker, "policy", v1)
    p3 = load_policy_for_version(cfg, tracker, "policy", v3)
    assert (p1.name, p1.version, p1.adapter) == ("policy", str(v1), None)
    assert p3.adapter == "default" and p3.adapter_names() == {"default"}
    prompt = [[{"role": "user", "content": "hello"}]]
    from flywheel.policy.base import SamplingParams

    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
    assert p1.generate(prompt, greedy)[0][0].completion_token_ids != p3.generate(prompt, greedy)[0][0].completion_token_ids

    promote(cfg, store, tracker, v1, force=True, reason="seed champion for the test")
    decision = run_gate(cfg, store, artifacts, tracker, v2)
    assert not decision.passed
    assert decision.numbers["diff"] == 0.0 and decision.numbers["losses"] == 0 and decision.numbers["wins"] == 0
    # Six held-out items are far below gate.min_paired_items: no decision; on enough items, refused.
    assert decision.outcome == "insufficient_evidence"
    assert [r.rule for r in decision.rules if not r.passed] == ["min_paired_items", "significance", "min_improvement"]
    cfg.gate.min_paired_items = 6
    decision = run_gate(cfg, store, artifacts, tracker, v2)
    assert decision.outcome == "refused" and decision.numbers["p_value"] == 1.0
    assert [r.rule for r in decision.rules if not r.passed] == ["significance", "min_improvement"]
