"""LoRA on the top N transformer blocks only (``train.lora_layers``) vs on every block: the cost of an SFT step.

With the base weights frozen and gradient checkpointing off, autograd records nothing below the lowest
adapted block, so its backward stops there (issue 32, build item 2). This measures what that saves at the
demo cpu profile's training shape: SmolLM2-135M in fp32 (30 blocks), LoRA r=16 (alpha 32) on all linear
layers, lr 1e-3, ``micro_batch_tokens`` 2048, batches of 8 BFCL demonstrations (4 simple_python, 2 multiple,
2 parallel, rendered by :func:`flywheel.train.sft.demonstration_samples`), the trainer's defaults otherwise.

Arms: every block (the named peer, ``lora_layers`` unset), the top 15 and the top 8. Each arm has its own
copy of the model and trainer; one untimed warm-up step each (on 2 demonstrations: lazy imports, optimizer
state, allocator; a whole batch would cost ~90 CPU-s per arm), then the timed steps alternate between the
arms (the order rotates each round), every arm getting the same batch in the same round. Printed per arm:
wall seconds and process CPU-seconds per step (all threads), the ratio per CPU-second against every block
(the host may be shared: the per-CPU-second ratio is the one that holds), trainable parameters, and the
loss of each step (each computed on its round's batch before that step's update).

The losses say nothing about learning quality: a few steps on a few batches do not establish whether
adapting fewer blocks learns as well (compare pass rates on held-out questions for that).

    .venv/bin/python benchmarks/bench_lora_layers.py            # 3 timed steps per arm
    .venv/bin/python benchmarks/bench_lora_layers.py --quick    # 1 timed step per arm
    .venv/bin/python benchmarks/bench_lora_layers.py --json
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

BATCH = {"simple_python": 4, "multiple": 2, "parallel": 2}


def demo_batches(tok, n: int) -> list:
    """``n`` batches of 8 demonstrations with the demo's category mix, disjoint items."""
    from flywheel.train.demos import Demonstration
    from flywheel.train.sft import demonstration_samples
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl
    from flywheel.vocab import ToolCall

    pools = {cat: load_bfcl(cat) for cat in BATCH}
    out = []
    for b in range(n):
        demos = []
        for cat, k in BATCH.items():
            for it in pools[cat][b * k : (b + 1) * k]:
                calls = [ToolCall(c["name"], {a: (v["one_of"][0] if isinstance(v, dict) and "one_of" in v else v)
                                              for a, v in c["arguments"].items()})
                         for c in bfcl_answer_to_expected(it.possible_answer)]
                demos.append(Demonstration(messages=it.question_messages, tools=it.tools,
                                           source_entity_id=f"eval:{it.id}", answer_calls=calls))
        out.append(demonstration_samples(tok, demos))
    return out


def step_bench_args(ap, *, home_help: str, steps_help: str = "timed steps per arm (after one warm-up step)"):
    """The arguments every SFT-step benchmark takes (--quick, --steps, --json, --home), parsed; --quick
    means one timed step per arm."""
    ap.add_argument("--quick", action="store_true", help="1 timed step per arm instead of 3")
    ap.add_argument("--steps", type=int, default=3, help=steps_help)
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"), help=home_help)
    a = ap.parse_args()
    if a.quick:
        a.steps = 1
    return a


def start_log(as_json: bool):
    """``(log, load average at start)``: log to stderr under ``--json`` (stdout carries the document), and
    print torch's version, its thread count and the load average first."""
    import torch

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if as_json else (lambda *x: print(*x, flush=True))
    load0 = os.getloadavg()
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f}")
    return log, load0


def time_rounds(trainers: dict, res: dict, batches: list, steps: int, log, *, peer: str) -> None:
    """The timed steps, arms alternating (the order rotates each round, every arm gets round k's batch), into
    ``res[arm]``'s ``wall_s`` / ``cpu_s`` / ``loss`` / ``tokens`` lists; then per-step means, cores busy and
    the ratios against ``peer`` (per CPU-second and wall)."""

    names = list(trainers)
    for k in range(steps):
        order = names[k % len(names):] + names[: k % len(names)]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            m = trainers[name].step(batches[k + 1])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            r = res[name]
            r["wall_s"].append(wall)
            r["cpu_s"].append(cpu)
            r["loss"].append(m.loss)
            r["tokens"].append(m.tokens)
            log(f"round {k + 1} {name}: {wall:.1f} s, {cpu:.1f} CPU-s, loss {m.loss:.5f} ({m.tokens} tokens; "
                f"load {os.getloadavg()[0]:.2f})")
    base = res[peer]
    for r in res.values():
        r["wall_per_step"] = sum(r["wall_s"]) / len(r["wall_s"])
        r["cpu_per_step"] = sum(r["cpu_s"]) / len(r["cpu_s"])
        r["cores_busy"] = sum(r["cpu_s"]) / sum(r["wall_s"])
        r["speedup_per_cpu_s"] = sum(base["cpu_s"]) / sum(r["cpu_s"])
        r["speedup_wall"] = sum(base["wall_s"]) / sum(r["wall_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 timed step per arm instead of 3")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm (after one warm-up step)")
    ap.add_argument("--layers", type=int, nargs="+", default=[15, 8], help="top-N arms besides every block")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--home", default="/tmp/prof/home" if Path("/tmp/prof/home/models").exists()
                    else os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()
    if a.quick:
        a.steps = 1

    import torch

    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.trainer import Trainer, TrainerOptions

    log, load0 = start_log(a.json)
    _, tok = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype="float32")
    batches = demo_batches(tok, a.steps + 1)
    arms: dict[str, int | None] = {"all": None, **{f"top{n}": n for n in a.layers}}
    trainers, res = {}, {}
    for name, layers in arms.items():
        model, _ = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype="float32")
        tc = TrainConfig(lora_r=16, lora_alpha=32, lora_layers=layers, micro_batch_tokens=2048, batch_size=8)
        tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-3, total_steps=a.steps + 1, temperature=1.0,
                                           max_completion_len=96, pad_id=int(tok.pad_token_id), train=tc), device="cpu")
        c0, t0 = time.process_time(), time.perf_counter()
        m = tr.step(batches[0][:2])  # warm-up: lazy imports, optimizer state, allocator
        trainers[name] = tr
        res[name] = {"lora_layers": layers, "n_blocks": model.config.num_hidden_layers, "trainable": tr.n_trainable,
                     "warmup_s": time.perf_counter() - t0, "warmup_cpu_s": time.process_time() - c0,
                     "warmup_loss": m.loss, "loss": [], "wall_s": [], "cpu_s": [], "tokens": []}
        log(f"{name}: {tr.n_trainable / 1e6:.2f}M trainable, warm-up {res[name]['warmup_s']:.1f} s "
            f"({res[name]['warmup_cpu_s']:.1f} CPU-s), loss {m.loss:.4f}")
    time_rounds(trainers, res, batches, a.steps, log, peer="all")
    out = {"model": "smollm2-135m", "dtype": "float32", "lora_r": 16, "micro_batch_tokens": 2048, "batch": 8,
           "steps": a.steps, "threads": torch.get_num_threads(), "load_at_start": load0,
           "load_at_end": os.getloadavg(), "arms": res}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"\nload average {load0[0]:.2f} -> {out['load_at_end'][0]:.2f}; SmolLM2-135M fp32, LoRA r=16 all-linear, "
          f"batches of 8 BFCL demonstrations, micro_batch_tokens 2048, {a.steps} timed steps per arm (alternating)")
    print("| arm | blocks with LoRA | trainable | s/step | CPU-s/step | cores | x per CPU-s vs all | x wall vs all | "
          "loss per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        blocks = r["n_blocks"] if r["lora_layers"] is None else min(r["lora_layers"], r["n_blocks"])
        print(f"| {name} | {blocks}/{r['n_blocks']} | {r['trainable'] / 1e6:.2f}M | {r['wall_per_step']:.1f} | "
              f"{r['cpu_per_step']:.1f} | {r['cores_busy']:.2f} | x{r['speedup_per_cpu_s']:.2f} | "
              f"x{r['speedup_wall']:.2f} | {', '.join(f'{x:.3f}' for x in r['loss'])} |")
    print("Losses: each on its round's batch before that step's update (after the warm-up's and the earlier rounds' "
          "updates); a few steps say nothing about learning quality.")


if __name__ == "__main__":
    main()
