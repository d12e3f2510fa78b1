"""Smoke test of benchmarks/bench_vs_trl.py: both training loops run one step on the tiny model.

No timing assertions (house rule): the test proves the benchmark code works (TRL hooks, rollout
lookup, memory probe, equal work on both sides), not how fast either trainer is.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_trl.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_both_loops_train_one_step_on_the_same_batch(home):
    b = _bench()
    # --quick-like, smaller still: 2 prompts x 2 generations x 8 tokens, 1 step, no warm-up.
    spec = b.BenchSpec(model="tiny", home=str(home), prompts=2, generations=2, completion_len=8, steps=1,
                       warmup_steps=0, micro_batch=2, completions="random")
    ro = b.prepare_rollouts(spec)
    assert ro.n_sequences == 4 and all(len(c) == 8 for c in ro.completion_ids)
    assert ro.completion_tokens_per_step == 32

    ours = b.run_flywheel(spec, ro)
    trl = b.run_trl(spec, ro)
    for r in (ours, trl):
        assert len(r["step_seconds"]) == 1
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"])
        assert r["tokens_per_step"] == ro.tokens_per_step
        assert r["train_peak_rss_gb"] > 0
    # Same work: same trainable parameters (full fine-tuning), same micro-batch count, and the
    # same step-1 gradient (same data, advantages and dapo loss) up to float32 reduction order.
    assert ours["trainable_params"] == trl["trainable_params"]
    assert ours["micro_batches"] == trl["micro_batches"] == 2
    assert ours["grad_norm_step1"] == pytest.approx(trl["grad_norm_step1"], rel=1e-3)
    table = b.report(spec, {"flywheel": {**ours, "process_peak_rss_gb": 1.0},
                            "trl": {**trl, "process_peak_rss_gb": 1.0}})
    assert "throughput ours/TRL" in table and "MET" in table


def test_spec_rejects_batches_trl_cannot_split():
    b = _bench()
    with pytest.raises(ValueError, match="must divide"):
        b.BenchSpec(prompts=3, generations=2, micro_batch=4).validate()
    with pytest.raises(ValueError, match="group of one"):
        b.BenchSpec(generations=1, micro_batch=1).validate()


def test_stand_in_reward_is_the_share_of_even_ids():
    b = _bench()
    assert b.stand_in_reward([2, 3, 4, 5]) == 0.5
    assert b.stand_in_reward([1, 3]) == 0.0
