"""CPU training on a busy machine: `train.threads = auto` against torch's own thread count, in one run.

The demo's SFT step (SmolLM2-135M, LoRA r 16, the 8 BFCL demonstrations of `bench_cpu_limits.py`) is timed
with torch's own intra-op thread count (the peer: `train.threads = 0`) and with `auto`
(flywheel/train/threads.py), first on the machine as it is and then with one other process keeping one core
busy (a Python loop, as a CI runner's neighbour or a second job would). Printed per condition: the median
step time of each and the ratio peer / auto (above 1: auto is faster), and which thread counts auto used.

    .venv/bin/python benchmarks/bench_train_threads.py                 # bf16 where native, else fp32; ~3 min
    .venv/bin/python benchmarks/bench_train_threads.py --dtype float32 --steps 4 --json

Run it alone: the "idle" condition means nothing else running. Measured figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["fast", "float32", "bfloat16"], default="fast")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm and condition")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch
    from bench_cpu_limits import demo_samples

    from flywheel.config import TrainConfig
    from flywheel.policy.models import ensure_base_model, load_model
    from flywheel.train.trainer import Trainer, TrainerOptions

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    ensure_base_model("smollm2-135m", Path(a.home))
    model, tok = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype=a.dtype)
    samples = demo_samples(tok)
    tc = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=2048, batch_size=len(samples))
    tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-4, total_steps=8 * a.steps + 8, temperature=1.0,
                                       max_completion_len=96, train=tc), device="cpu")
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    log(f"{os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, {dtype}; "
        f"{len(samples)} demonstrations, {sum(len(s) for s in samples)} tokens per step; load {os.getloadavg()[0]:.2f}")
    tr.step(samples)  # warm-up: lazy imports, optimizer state, the lean layers' compile

    def arm(setting: str | int) -> dict:
        """A fresh chooser's first step (auto sees the load during it, as a training run's first step does),
        then the timed steps."""
        tr.threads.setting = setting
        tr.threads.next = tr.threads.original = torch.get_num_threads()
        tr.threads.steps_at, tr.threads.others_max = {}, 0.0
        t0 = time.perf_counter()
        tr.step(samples)
        first = time.perf_counter() - t0
        times, used = [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            m = tr.step(samples)
            times.append(time.perf_counter() - t0)
            used.append(int(m.stats["threads"]))
        return {"median_s": statistics.median(times), "s": [round(t, 2) for t in times], "first_s": round(first, 2), "threads": used,
                "others_max": round(tr.threads.others_max, 2)}

    res: dict = {"dtype": dtype, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "steps": a.steps,
                 "tokens": sum(len(s) for s in samples), "conditions": {}}
    for cond in ("idle", "one core busy"):
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if cond != "idle" else None
        try:
            if spin:
                time.sleep(1.0)
            peer = arm(0)
            auto = arm("auto")
        finally:
            if spin:
                spin.kill()
                spin.wait()
        ratio = peer["median_s"] / auto["median_s"]
        res["conditions"][cond] = {"torch_threads": peer, "auto": auto, "ratio_peer_over_auto": ratio}
        log(f"{cond}: torch's {torch.get_num_threads()} threads {peer['median_s']:.2f} s/step {peer['s']}, "
            f"auto {auto['median_s']:.2f} s/step {auto['s']} with threads {auto['threads']}: x{ratio:.2f}")
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"\n{'condition':<15}{'torch threads':>15}{'auto':>10}{'ratio':>8}  auto used")
    for cond, r in res["conditions"].items():
        print(f"{cond:<15}{r['torch_threads']['median_s']:>13.2f} s{r['auto']['median_s']:>8.2f} s"
              f"{r['ratio_peer_over_auto']:>7.2f}x  {r['auto']['threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
