"""peft's LoRA linear layer vs the fused one (``train.fused_lora``): the cost of an SFT step on a CPU in fp32.

peft adds the adapter's output to the base layer's as ``base(x) + lora_B(lora_A(x)) * scaling``: a
multiplication and an addition over every adapted layer's ``[tokens, out]`` output, the multiplication's
backward, and the sum of two ``[tokens, in]`` input gradients -- about 840 elementwise passes per SFT step
of SmolLM2-135M, on top of its GEMMs. ``flywheel.kernels.fused_lora`` folds them into the GEMMs'
accumulation (issue 32: the SFT step against the machine's limit). It engages where input, base and
adapter share a dtype without autocast: fp32 training, i.e. ``policy.dtype = "fast"`` on a CPU without
native bf16.

Shape: the demo cpu profile's training step -- SmolLM2-135M in fp32, LoRA r=16 (alpha 32) on all linear
layers, lr 1e-3, ``micro_batch_tokens`` 2048, batches of 8 BFCL demonstrations (4 simple_python, 2
multiple, 2 parallel). Arms: peft's forward (the named peer, ``train.fused_lora = false``) and the fused
one, each with its own model and trainer and the same adapter initialisation; one untimed warm-up step
each on 2 demonstrations, then timed steps alternating (the order rotates each round), both arms getting
the same batch in the same round. Printed per arm: wall seconds and process CPU-seconds per step, the
ratio per CPU-second against peft (the host may be shared: that ratio is the one that holds), and each
step's loss: the two arms train the same adapter on the same batches, so their losses must agree to
float32 rounding (the largest relative difference is printed; the run fails above 1e-3).

    .venv/bin/python benchmarks/bench_fused_lora.py            # 3 timed steps per arm
    .venv/bin/python benchmarks/bench_fused_lora.py --quick    # 1 timed step per arm
    .venv/bin/python benchmarks/bench_fused_lora.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora_layers import demo_batches, start_log, step_bench_args, time_rounds  # noqa: E402  (the same batches, the same timing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = step_bench_args(ap, home_help="a flywheel home holding the converted SmolLM2-135M (after `make demo`'s "
                        "first stage)")

    import torch

    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.trainer import Trainer, TrainerOptions

    log, load0 = start_log(a.json)
    _, tok = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype="float32")
    batches = demo_batches(tok, a.steps + 1)
    arms = {"peft": False, "fused": True}
    trainers, res = {}, {}
    for name, fused in arms.items():
        model, _ = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype="float32")
        tc = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=2048, batch_size=8, fused_lora=fused)
        torch.manual_seed(0)  # the same adapter initialisation in both arms
        tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-3, total_steps=a.steps + 1, temperature=1.0,
                                           max_completion_len=96, pad_id=int(tok.pad_token_id), train=tc), device="cpu")
        c0, t0 = time.process_time(), time.perf_counter()
        m = tr.step(batches[0][:2])  # warm-up: lazy imports, optimizer state, allocator, the lean layers' compile
        trainers[name] = tr
        res[name] = {"fused_lora": fused, "fused_layers": tr.fused_lora_layers, "trainable": tr.n_trainable,
                     "warmup_s": time.perf_counter() - t0, "warmup_cpu_s": time.process_time() - c0,
                     "warmup_loss": m.loss, "loss": [], "wall_s": [], "cpu_s": [], "tokens": []}
        log(f"{name}: {tr.fused_lora_layers} fused layers, warm-up {res[name]['warmup_s']:.1f} s "
            f"({res[name]['warmup_cpu_s']:.1f} CPU-s), loss {m.loss:.4f}")
    time_rounds(trainers, res, batches, a.steps, log, peer="peft")
    peer = res["peft"]
    pairs = zip([peer["warmup_loss"], *peer["loss"]], [res["fused"]["warmup_loss"], *res["fused"]["loss"]], strict=True)
    max_rel = max(abs(f - p) / max(abs(p), 1e-12) for p, f in pairs)
    out = {"model": "smollm2-135m", "dtype": "float32", "lora_r": 16, "micro_batch_tokens": 2048, "batch": 8,
           "steps": a.steps, "threads": torch.get_num_threads(), "load_at_start": load0,
           "load_at_end": os.getloadavg(), "arms": res, "loss_max_rel_diff": max_rel,
           "ratio_per_cpu_s": res["fused"]["speedup_per_cpu_s"], "ratio_wall": res["fused"]["speedup_wall"]}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"\nload average {load0[0]:.2f} -> {out['load_at_end'][0]:.2f}; SmolLM2-135M fp32, LoRA r=16 all-linear, "
              f"batches of 8 BFCL demonstrations, micro_batch_tokens 2048, {a.steps} timed steps per arm (alternating)")
        print("| arm | fused layers | s/step | CPU-s/step | cores | x per CPU-s vs peft | x wall vs peft | loss per step |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in res.items():
            print(f"| {name} | {r['fused_layers']} | {r['wall_per_step']:.2f} | {r['cpu_per_step']:.2f} | "
                  f"{r['cores_busy']:.2f} | x{r['speedup_per_cpu_s']:.3f} | x{r['speedup_wall']:.3f} | "
                  f"{', '.join(f'{x:.5f}' for x in r['loss'])} |")
        print(f"Losses agree to {max_rel:.1e} relative (warm-up and timed steps): the same adapter trained on the same "
              "batches by both layers.")
    if max_rel > 1e-3:
        raise SystemExit(f"the fused arm's losses differ from peft's by {max_rel:.1e} relative (> 1e-3)")


if __name__ == "__main__":
    main()
