"""An SFT step with the shared prompt prefix encoded once (``train.share_prompt_prefix``) vs once per sequence.

Every sequence of a training batch repeats what its request repeated: an agent's system prompt and tool
list, and at least the chat template's tool preamble (BFCL's questions, the demo's traffic, share about
150 tokens of it). Before ``share_prompt_prefix`` the trainer ran that prefix, forward and backward, once
per sequence. Now a padded micro-batch's common prefix is one ``[1, L]`` forward whose keys and values the
rows attend to (``flywheel.train.data``, "Shared prefixes"): the same log-probs and gradients to float
rounding.

Workloads (the demo cpu profile's training shape: SmolLM2-135M, LoRA r=16 all-linear, lr 1e-3, batches of
8 demonstrations, ``micro_batch_tokens`` 2048):
- ``bfcl``: the demo's demonstrations, 8 BFCL questions per batch (4 simple_python, 2 multiple, 2
  parallel), each with its own functions -- only the template is shared;
- ``agent``: the travel agent of ``tests/fixtures/agent_traffic.py`` (a ~1,400-character system prompt,
  four tools), 8 different questions per batch, each answered with one call of a tool it offers (the
  answers are made up for the benchmark: only their length matters to a step's cost).
Arms, alternating (the order rotates each round, both arms get the same batch in a round), each with its
own model and the same adapter initialisation: ``per_sequence`` (the named peer: ``share_prompt_prefix =
false``, what the trainer did before) and ``shared``. One untimed warm-up step each. Printed per
workload: seconds and process CPU-seconds per step, tokens the model ran over per step, the ratio per
CPU-second (the one that holds on a shared host) and per wall second, and each step's loss: the two arms
train the same adapter on the same batches, so the losses must agree to float32 rounding (the run fails
above 1e-3 relative).

    .venv/bin/python benchmarks/bench_shared_prefix.py [--quick] [--json] [--steps 3] [--dtype float32|bfloat16]
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

from bench_lora_layers import demo_batches, start_log, step_bench_args, time_rounds  # noqa: E402  (the demo's batches, the same timing)


def agent_batches(tok, n: int) -> list:
    """``n`` batches of 8 travel-agent demonstrations: different questions, the same system prompt and tools."""
    from flywheel.train.demos import Demonstration
    from flywheel.train.sft import demonstration_samples
    from flywheel.vocab import ToolCall
    from tests.fixtures.agent_traffic import CITIES, TRAVEL_SYSTEM, TRAVEL_TOOLS, travel_questions

    qs = travel_questions()
    # convert_currency's `from` is not a Python identifier, so the demo's call format cannot write it
    callable_ = [t["function"] for t in TRAVEL_TOOLS if all(p.isidentifier() and p != "from"
                                                             for p in t["function"]["parameters"]["properties"])]
    value = {"string": lambda k: CITIES[k % len(CITIES)], "integer": lambda k: 2 + k % 5, "number": lambda k: 80.0 + k}
    out = []
    for b in range(n):
        demos = []
        for i in range(8):
            k = (b * 8 + i) % len(qs)
            fn = callable_[k % len(callable_)]
            props = fn["parameters"]["properties"]
            args = {p: value[props[p]["type"]](k) for p in fn["parameters"].get("required", [])}
            demos.append(Demonstration(
                messages=[{"role": "system", "content": TRAVEL_SYSTEM}, {"role": "user", "content": qs[k]}],
                tools=TRAVEL_TOOLS, source_entity_id=f"eval:agent-{k}", answer_calls=[ToolCall(fn["name"], args)]))
        out.append(demonstration_samples(tok, demos))
    return out


def run_workload(name: str, batches: list, a, tok, log) -> dict:
    import torch

    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.trainer import Trainer, TrainerOptions

    trainers, res = {}, {}
    for arm, share in (("per_sequence", False), ("shared", True)):
        model, _ = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype=a.dtype)
        tc = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=2048, batch_size=8, share_prompt_prefix=share)
        torch.manual_seed(0)  # the same adapter initialisation in both arms
        tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-3, total_steps=a.steps + 1, temperature=1.0,
                                           max_completion_len=96, pad_id=int(tok.pad_token_id), train=tc), device="cpu")
        mbs = tr.micro_batches(batches[1])
        c0, t0 = time.process_time(), time.perf_counter()
        m = tr.step(batches[0][:2])  # warm-up: lazy imports, optimizer state, allocator, the lean layers' compile
        trainers[arm] = tr
        res[arm] = {"share_prompt_prefix": share, "warmup_s": time.perf_counter() - t0,
                    "warmup_cpu_s": time.process_time() - c0, "warmup_loss": m.loss,
                    "micro_batches": len(mbs), "tokens_encoded": sum(mb.n_encoded for mb in mbs),
                    "trunk_tokens": [0 if mb.trunk_ids is None else int(mb.trunk_ids.shape[1]) for mb in mbs],
                    "loss": [], "wall_s": [], "cpu_s": [], "tokens": []}
        log(f"{name} {arm}: {len(mbs)} micro-batches, {res[arm]['tokens_encoded']} positions encoded "
            f"(trunks {res[arm]['trunk_tokens']}), warm-up {res[arm]['warmup_s']:.1f} s, loss {m.loss:.4f}")
    time_rounds(trainers, res, batches, a.steps, log, peer="per_sequence")
    peer = res["per_sequence"]
    pairs = zip([peer["warmup_loss"], *peer["loss"]], [res["shared"]["warmup_loss"], *res["shared"]["loss"]],
                strict=True)
    res["loss_max_rel_diff"] = max(abs(s - p) / max(abs(p), 1e-12) for p, s in pairs)
    res["tokens_per_step"] = peer["tokens"][0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["bfcl", "agent"], choices=["bfcl", "agent"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = step_bench_args(ap, home_help="a flywheel home (the converted SmolLM2-135M is made there if missing)",
                        steps_help="timed steps per arm and workload (after one warm-up step)")

    import torch

    from flywheel.policy.models import load_model

    log, load0 = start_log(a.json)
    _, tok = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype=a.dtype)
    makers = {"bfcl": demo_batches, "agent": agent_batches}
    results = {w: run_workload(w, makers[w](tok, a.steps + 1), a, tok, log) for w in a.workloads}
    out = {"model": "smollm2-135m", "dtype": a.dtype, "lora_r": 16, "micro_batch_tokens": 2048, "batch": 8,
           "steps": a.steps, "threads": torch.get_num_threads(), "load_at_start": load0,
           "load_at_end": os.getloadavg(), "workloads": results}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"\nload average {load0[0]:.2f} -> {out['load_at_end'][0]:.2f}; SmolLM2-135M {a.dtype}, LoRA r=16 "
              f"all-linear, batches of 8, micro_batch_tokens 2048, {a.steps} timed steps per arm (alternating)")
        print("| workload | arm | tokens / step | positions encoded | s/step | CPU-s/step | x per CPU-s | x wall | losses |")
        print("|---|---|---|---|---|---|---|---|---|")
        for w, res in results.items():
            for arm in ("per_sequence", "shared"):
                r = res[arm]
                print(f"| {w} | {arm} | {res['tokens_per_step']} | {r['tokens_encoded']} | {r['wall_per_step']:.2f} | "
                      f"{r['cpu_per_step']:.2f} | x{r['speedup_per_cpu_s']:.2f} | x{r['speedup_wall']:.2f} | "
                      f"{', '.join(f'{x:.5f}' for x in r['loss'])} |")
        for w, res in results.items():
            print(f"{w}: losses agree to {res['loss_max_rel_diff']:.1e} relative")
    bad = {w: r["loss_max_rel_diff"] for w, r in results.items() if r["loss_max_rel_diff"] > 1e-3}
    if bad:
        raise SystemExit(f"the shared arm's losses differ from the per-sequence arm's by more than 1e-3: {bad}")


if __name__ == "__main__":
    main()
