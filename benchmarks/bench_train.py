"""Training-phase throughput (tokens/s) and peak RSS on SmolLM2-135M, CPU: LoRA vs full FT, fused vs naive.

Runs optimizer steps of the real :class:`flywheel.train.trainer.Trainer` (dapo loss) on synthetic
rollout-shaped samples (prompt 192 + completion 64 tokens, 8 sequences per step) and prints, per
configuration, tokens/s and the process's peak RSS, then the ratio fused / naive log-prob path
(the named peer, measured in the same run). Peak RSS is the process high-water mark (ru_maxrss), so
configurations run in fresh subprocesses.

    .venv/bin/python benchmarks/bench_train.py [--quick] [--home DIR]

Hook for the TRL comparison (later work, see the kernel issue): add a runner to RUNNERS that trains
the same samples with ``trl.GRPOTrainer`` and returns the same dict; it then appears in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def run_one(kind: str, lora_r: int, impl: str, steps: int, home: str) -> dict:
    import torch

    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.data import TrainSample
    from flywheel.train.trainer import Trainer, TrainerOptions

    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", home=home)
    g = torch.Generator().manual_seed(0)
    samples = [
        TrainSample(prompt_ids=torch.randint(10, 49000, (192,), generator=g).tolist(),
                    completion_ids=torch.randint(10, 49000, (64,), generator=g).tolist(), loss_mask=[1] * 64,
                    advantage=float(i % 2) - 0.5, sampler_logprobs=[-5.0] * 64, group_id=str(i // 4))
        for i in range(8)
    ]
    tr = Trainer(model, TrainerOptions(objective="dapo", lr=1e-5, total_steps=steps + 1, train=TrainConfig(
        lora_r=lora_r, logprob_impl=impl, micro_batch_tokens=1024, warmup_steps=0)))
    tr.step(samples)  # warm-up step (allocations, lazy imports) not timed
    t0, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += tr.step(samples).tokens
    dt = time.perf_counter() - t0
    return {"config": kind, "impl": impl, "tokens_per_s": tokens / dt, "s_per_step": dt / steps,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


RUNNERS = {  # name -> (lora_r, logprob impl)
    "lora-fused": (16, "fused"), "lora-naive": (16, "naive"),
    "full-fused": (0, "fused"), "full-naive": (0, "naive"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 timed step per configuration (else 3)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    steps = 1 if a.quick else 3
    if a.child:
        r, impl = RUNNERS[a.child]
        print(json.dumps(run_one(a.child, r, impl, steps, a.home)))
        return
    from flywheel.policy.models import ensure_base_model

    ensure_base_model("smollm2-135m", a.home)  # convert once, outside the timings
    rows = {}
    for name in RUNNERS:
        cmd = [sys.executable, __file__, "--child", name, "--home", a.home] + (["--quick"] if a.quick else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows[name] = json.loads(out)
        r = rows[name]
        print(f"{name:12s} {r['tokens_per_s']:8.1f} tok/s  {r['s_per_step']:7.2f} s/step  peak RSS {r['peak_rss_gb']:.2f} GB",
              flush=True)
    for kind in ("lora", "full"):
        f, n = rows[f"{kind}-fused"], rows[f"{kind}-naive"]
        print(f"{kind}: fused/naive throughput x{f['tokens_per_s'] / n['tokens_per_s']:.2f}, "
              f"peak RSS x{f['peak_rss_gb'] / n['peak_rss_gb']:.2f}")


if __name__ == "__main__":
    main()
