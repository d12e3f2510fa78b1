"""benchmarks/bench_flywheel_vs_sft.py: how the plain-SFT peer's steps are sized (no timing asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_flywheel_vs_sft.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_flywheel_vs_sft", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_peer_is_sized_from_the_cheapest_plain_sft_phase_not_one_slowed_by_other_work():
    """Run D: a test suite beside the first pass made it 54 CPU-s per step against 28 in the control's
    continuation; sizing from the first pass alone gave plain SFT 28 steps that used 879 of its 1,548 CPU-s."""
    peer_cpu_per_step = _bench().peer_cpu_per_step
    learn = {"first_pass": {"steps": 11, "cpu_s": 594.9},
             "arms": [{"name": "control", "steps": 2, "cpu_s": 92.3}, {"name": "targeted", "steps": 2, "cpu_s": 20.0}],
             "continuation": {"arm": "control", "steps": 16, "cpu_s": 452.9}}
    rate, source = peer_cpu_per_step(learn)
    assert source == "control continuation" and rate == pytest.approx(452.9 / 16)
    assert int(1547.65 // rate) == 54
    # the targeted arm trains on longer synthetic prompts: never a measure of plain SFT's cost
    learn["continuation"] = {"arm": "targeted", "steps": 16, "cpu_s": 100.0}
    assert peer_cpu_per_step(learn) == (pytest.approx(92.3 / 2), "control trial")
    learn["arms"] = []
    assert peer_cpu_per_step(learn) == (pytest.approx(594.9 / 11), "first pass")
    with pytest.raises(ValueError, match="no SFT phase"):
        peer_cpu_per_step({"first_pass": {"steps": 0, "cpu_s": 0.0}})


def test_set_reads_a_section_key_and_a_json_or_string_value_and_refuses_anything_else():
    """--set train.synthesis_in=stream runs the flywheel's cycle with that override (the peers are untouched)."""
    setting = _bench()._setting
    assert setting("train.synthesis_in=stream") == ("train", "synthesis_in", "stream")
    assert setting("train.continue_steps=20") == ("train", "continue_steps", 20)
    assert setting("train.arms=[\"control\", \"targeted\"]") == ("train", "arms", ["control", "targeted"])
    for bad in ("train.synthesis_in", "synthesis_in=stream", ".x=1", "train.=1"):
        with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
            setting(bad)


def test_cycles_home_gives_plain_sft_every_learning_stage_s_cpu_seconds_and_compares_the_last_turn_s_model():
    """--cycles-home (issue 30's two-cycle case): the demo's cycle-2 model against plain SFT of the base model
    on both waves' corrections. The flywheel spent both learning stages to reach that model, so the peer gets
    their CPU-seconds together, in steps at the cheapest plain-SFT rate either stage measured. Figures: the
    demo at d114e55 (cycle 1: 916 CPU-s, first pass 12 steps in 316; cycle 2: 1,238, first pass 18 in 491)."""
    cycles_budget = _bench().cycles_budget
    c1 = {"outcome": "promoted", "stages": {"learn": {"cpu_s": 916.0, "model_version": 3, "chosen": "targeted",
                                                      "first_pass": {"steps": 12, "cpu_s": 316.0}}}}
    skipped = {"outcome": "skipped", "stages": {"learn": {}}}  # a cycle with nothing new to learn from
    c2 = {"outcome": "refused", "stages": {"learn": {"cpu_s": 1238.0, "model_version": 5, "chosen": "targeted",
                                                     "why": "stream", "first_pass": {"steps": 18, "cpu_s": 491.0}}}}
    plan = cycles_budget([c1, skipped, c2])
    assert plan["cycles"] == 2 and plan["learn_cpu_s"] == [916.0, 1238.0]
    assert plan["budget_cpu"] == pytest.approx(2154.0)
    assert plan["cpu_per_step"] == pytest.approx(316.0 / 12) and plan["sized_from"] == "cycle 1: first pass"
    assert plan["steps"] == 81  # 2154 / 26.33 = 81.8
    assert plan["model_version"] == 5 and plan["gates"] == ["promoted", "refused"]
    assert (plan["chosen"], plan["why"]) == ("targeted", "stream")
    # the cheaper rate wins wherever it was measured
    c2["stages"]["learn"]["first_pass"] = {"steps": 18, "cpu_s": 450.0}
    assert cycles_budget([c1, c2])["sized_from"] == "cycle 2: first pass"
    assert cycles_budget([c1, c2])["steps"] == int(2154.0 // 25.0)
    with pytest.raises(ValueError, match="needs two or more"):
        cycles_budget([c1, skipped])
    c2["stages"]["learn"]["cpu_s"] = 0.0
    with pytest.raises(ValueError, match="no CPU-seconds"):
        cycles_budget([c1, c2])


def test_paired_results_split_the_unseen_suite_by_bfcl_category_and_leave_other_suites_whole():
    from types import SimpleNamespace

    paired = _bench().paired
    tasks = [{"task_id": f"t{i}", "metadata": {"cluster": f"unseen-{c}_{i}"}}
             for i, c in enumerate(["simple_python", "parallel_multiple", "parallel", "parallel_multiple"])]
    suite = SimpleNamespace(entity_id="suite:bfcl-unseen@1", tasks=tasks)
    a = {"t0": True, "t1": True, "t2": False, "t3": False}
    b = {"t0": True, "t1": False, "t2": True, "t3": False}
    r = paired(suite, a, b)
    assert r["by_category"] == {"parallel": [0, 1, 1], "parallel_multiple": [1, 0, 2], "simple_python": [1, 1, 1]}
    assert (r["flywheel_only"], r["sft_only"], r["per_item"]["t1"]) == (1, 1, (True, False))
    held = SimpleNamespace(entity_id="suite:heldout@1", tasks=[{"task_id": "t0", "metadata": {"cluster": "c-x"}}])
    assert "by_category" not in paired(held, {"t0": True}, {"t0": False})
