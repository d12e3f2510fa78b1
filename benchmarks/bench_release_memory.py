"""``train.release_memory``: glibc malloc_trim after every CPU training step vs keeping the heap, with LoRA.

The trainer used to trim after every optimizer step (``release_memory = true``, the named peer): it hands
every free page of glibc's arenas back to the OS, and the next step takes a page fault and a freshly zeroed
page for each of them again. ``auto`` (the default since) trims for full fine-tuning only. This measures the
LoRA case at the demo cpu profile's training shape: SmolLM2-135M in fp32, LoRA r=16 (alpha 32) on all
linear layers, ``micro_batch_tokens`` 2048, batches of 8 BFCL demonstrations (the batches of
``bench_lora_layers.py``), the trainer's defaults otherwise.

The heap belongs to the process, so each arm runs in its own process (the arms alternate over
``--rounds``): one untimed warm-up step, then the timed steps. Printed per arm: wall seconds, user and
system CPU-seconds and minor page faults per step (``getrusage``), the process's peak RSS, each step's loss
(the same batches and adapter initialisation in both arms: they must agree), and the ratio of wall and
CPU-seconds against the peer.

    .venv/bin/python benchmarks/bench_release_memory.py --home <a flywheel home holding the model>
    .venv/bin/python benchmarks/bench_release_memory.py --steps 3 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = {"trim": True, "auto": "auto"}  # the peer first


def run_arm(setting: bool | str, steps: int, home: str) -> dict:
    """One arm in this process: warm-up, then ``steps`` timed steps."""
    import torch
    from bench_lora_layers import demo_batches

    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.trainer import Trainer, TrainerOptions

    model, tok = load_model("smollm2-135m", home=Path(home), device="cpu", dtype="float32")
    batches = demo_batches(tok, steps + 1)
    tc = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=2048, batch_size=8, release_memory=setting)
    torch.manual_seed(0)
    tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-3, total_steps=steps + 1, temperature=1.0,
                                       max_completion_len=96, pad_id=int(tok.pad_token_id), train=tc), device="cpu")
    tr.step(batches[0][:2])  # warm-up: lazy imports, optimizer state, the lean layers' compile
    rows = []
    for k in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        m = tr.step(batches[k + 1])
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        rows.append({"wall_s": wall, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
                     "minor_faults": r1.ru_minflt - r0.ru_minflt, "loss": m.loss})
    return {"release_memory": setting, "trims_each_step": tr.trim_each_step, "steps": rows,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm and round (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=1, help="processes per arm, alternating")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"),
                    help="a flywheel home holding the converted SmolLM2-135M (after `make demo`'s first stage)")
    ap.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(run_arm(ARMS[a.arm], a.steps, a.home)))
        return
    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    load0 = os.getloadavg()
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    res: dict[str, list[dict]] = {name: [] for name in ARMS}
    for r in range(a.rounds):
        for name in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):
            out = subprocess.run([sys.executable, __file__, "--arm", name, "--steps", str(a.steps), "--home", a.home],
                                 capture_output=True, text=True, check=True)
            arm = json.loads(out.stdout.strip().splitlines()[-1])
            res[name].append(arm)
            for k, s in enumerate(arm["steps"]):
                log(f"round {r + 1} {name} step {k + 1}: {s['wall_s']:.1f} s, user {s['user_s']:.1f} + sys "
                    f"{s['sys_s']:.1f} CPU-s, {s['minor_faults']:,} minor faults, loss {s['loss']:.5f}")
            log(f"round {r + 1} {name}: peak RSS {arm['peak_rss_gb']:.2f} GB (load {os.getloadavg()[0]:.2f})")
    summary = {}
    for name, arms in res.items():
        steps = [s for arm in arms for s in arm["steps"]]
        n = len(steps)
        summary[name] = {"trims_each_step": arms[0]["trims_each_step"],
                         "wall_per_step": sum(s["wall_s"] for s in steps) / n,
                         "user_per_step": sum(s["user_s"] for s in steps) / n,
                         "sys_per_step": sum(s["sys_s"] for s in steps) / n,
                         "faults_per_step": sum(s["minor_faults"] for s in steps) / n,
                         "peak_rss_gb": max(arm["peak_rss_gb"] for arm in arms),
                         "losses": [s["loss"] for s in steps]}
        # steady state: the first timed step of a process also grows the heap from the small warm-up's size
        later = [s for arm in arms for s in arm["steps"][1:]]
        if later:
            summary[name]["steady_wall_per_step"] = sum(s["wall_s"] for s in later) / len(later)
            summary[name]["steady_cpu_per_step"] = sum(s["user_s"] + s["sys_s"] for s in later) / len(later)
    peer = summary["trim"]
    for s in summary.values():
        s["x_wall_vs_trim"] = peer["wall_per_step"] / s["wall_per_step"]
        s["x_cpu_vs_trim"] = (peer["user_per_step"] + peer["sys_per_step"]) / (s["user_per_step"] + s["sys_per_step"])
    max_rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(summary["auto"]["losses"], peer["losses"], strict=True))
    out = {"model": "smollm2-135m", "dtype": "float32", "lora_r": 16, "steps": a.steps, "rounds": a.rounds,
           "load_at_start": load0, "load_at_end": os.getloadavg(), "arms": summary, "raw": res,
           "loss_max_rel_diff": max_rel}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"\nload average {load0[0]:.2f} -> {out['load_at_end'][0]:.2f}; SmolLM2-135M fp32, LoRA r=16 all-linear, "
          f"batches of 8, {a.steps} timed steps x {a.rounds} process(es) per arm")
    print("| arm | trims each step | s/step | user CPU-s | sys CPU-s | minor faults/step | peak RSS GB | x wall vs trim | "
          "x CPU-s vs trim |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['trims_each_step']} | {s['wall_per_step']:.2f} | {s['user_per_step']:.2f} | "
              f"{s['sys_per_step']:.2f} | {s['faults_per_step']:,.0f} | {s['peak_rss_gb']:.2f} | x{s['x_wall_vs_trim']:.3f} | "
              f"x{s['x_cpu_vs_trim']:.3f} |")
    if "steady_wall_per_step" in peer:
        a_, p_ = summary["auto"], peer
        print(f"Steady state (each process's timed steps after its first): trim {p_['steady_wall_per_step']:.2f} s, "
              f"{p_['steady_cpu_per_step']:.2f} CPU-s per step; auto {a_['steady_wall_per_step']:.2f} s, "
              f"{a_['steady_cpu_per_step']:.2f} CPU-s (x{p_['steady_wall_per_step'] / a_['steady_wall_per_step']:.3f} wall, "
              f"x{p_['steady_cpu_per_step'] / a_['steady_cpu_per_step']:.3f} CPU-s)")
    print(f"Losses agree to {max_rel:.1e} relative (the same batches and adapter initialisation).")


if __name__ == "__main__":
    main()
