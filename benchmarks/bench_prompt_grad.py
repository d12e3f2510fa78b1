"""SFT with the prompt encoded without a graph (``train.prompt_grad = answer_only``) vs the full pass: time
and learning, on the demo's shape.

Both arms train SmolLM2-135M (LoRA r=16, the cpu profile's lr 1e-3, batch 8, the same seed and batch order)
on the same BFCL demonstrations of the demo's four categories, rendered through the shared format
(prompts ~300-800 tokens, answers ~10-70), for the same number of optimizer steps; then both answer the
same unseen questions greedily (merged fp32 adapters, the gate's decoding). Printed: seconds and process
CPU-seconds per step, the ratio (the named peer is the full pass, ``prompt_grad = full``), and pass rates
with 95% Wilson intervals plus the exact sign test on the paired items.

    .venv/bin/python benchmarks/bench_prompt_grad.py            # ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_prompt_grad.py --quick    # 3 steps, 12 questions
    .venv/bin/python benchmarks/bench_prompt_grad.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRAIN = {"simple_python": 40, "multiple": 20, "parallel": 18, "parallel_multiple": 18}
HELD = {"simple_python": 20, "multiple": 10, "parallel": 10, "parallel_multiple": 10}
HELD_OFFSET = 150  # past the demo's two waves in every category that has that many


def _items(counts: dict[str, int], offset: int) -> list:
    from flywheel.verifiers.bfcl import load_bfcl

    out = []
    for cat, n in counts.items():
        items = load_bfcl(cat)
        start = min(offset, max(len(items) - n, 0)) if offset else 0
        out.extend(items[start : start + n])
    return out


def score(policy, items, max_new_tokens: int) -> dict[str, bool]:
    from flywheel.policy.base import SamplingParams
    from flywheel.verifiers import verify
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected

    outs = policy.generate([i.question_messages for i in items],
                           SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
                           tools=[i.tools for i in items])
    res = {}
    for item, o in zip(items, outs, strict=True):
        v = verify({"kind": "tool_call", "tools": item.tools, "expected": bfcl_answer_to_expected(item.possible_answer)},
                   [{"role": "assistant", "content": o[0].text}])
        res[item.id] = bool(v.passed)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    held_counts = HELD
    if args.quick:
        args.steps, held_counts = 3, {k: 3 for k in HELD}
    home = args.home or tempfile.mkdtemp(prefix="flywheel-pgrad-")
    import torch

    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.stats import sign_test, wilson
    from flywheel.store import open_store
    from flywheel.tracking import Tracker
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft
    from flywheel.verifiers.bfcl import reference_calls

    load0 = os.getloadavg()
    train, held = _items(TRAIN, 0), _items(held_counts, HELD_OFFSET)
    demos = [Demonstration(messages=i.question_messages, tools=i.tools, answer_calls=reference_calls(i.possible_answer),
                           source_entity_id=f"eval:bfcl-{i.id}", split="train") for i in train]
    out: dict = {"steps": args.steps, "train": len(demos), "heldout": len(held), "load_at_start": load0,
                 "threads": torch.get_num_threads(), "arms": {}}
    for arm in ("full", "answer_only"):
        cfg = load_config(overrides={"home": home, "policy": {"dtype": "float32", "device": "cpu"},
                                     "train": {"lora_r": 16, "lora_alpha": 32, "batch_size": 8, "sft_lr": 1e-3,
                                               "micro_batch_tokens": 2048, "prompt_grad": arm}})
        store, artifacts, tracker = open_store(cfg), open_artifacts(cfg), Tracker(cfg)
        steps: list[dict] = []
        t0, c0 = time.perf_counter(), time.process_time()
        res = train_sft(cfg, store, artifacts, tracker, demos, base="smollm2-135m", steps=args.steps,
                        on_step=lambda s, m, acc=steps: acc.append(m))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        store.close()
        step_s = [m["seconds"] for m in steps]
        t1 = time.perf_counter()
        passed = score(load_policy_for_version(cfg, tracker, cfg.cycle.model_name, res.model_version), held, 48)
        out["arms"][arm] = {"train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1),
                            "step_s_median": round(sorted(step_s)[len(step_s) // 2], 2),
                            "tokens": int(sum(m["tokens"] for m in steps)), "final_loss": steps[-1]["loss"],
                            "passed": sum(passed.values()), "items": len(passed), "eval_s": round(time.perf_counter() - t1, 1),
                            "per_item": passed}
        if not args.json:
            a = out["arms"][arm]
            print(f"{arm}: {args.steps} steps, median {a['step_s_median']} s/step, train {a['train_cpu_s']} CPU-s, "
                  f"loss {a['final_loss']:.3f}, held-out {a['passed']}/{a['items']}", flush=True)
    f, a = out["arms"]["full"], out["arms"]["answer_only"]
    wins = sum(a["per_item"][k] and not f["per_item"][k] for k in f["per_item"])
    losses = sum(f["per_item"][k] and not a["per_item"][k] for k in f["per_item"])
    out["ratio_step_time"] = round(f["step_s_median"] / max(a["step_s_median"], 1e-9), 2)
    out["ratio_train_cpu"] = round(f["train_cpu_s"] / max(a["train_cpu_s"], 1e-9), 2)
    out["answer_only_wins"], out["answer_only_losses"] = wins, losses
    out["p_answer_only_worse"] = sign_test(losses, wins)
    out["load_at_end"] = os.getloadavg()
    for arm in ("full", "answer_only"):
        lo, hi = wilson(out["arms"][arm]["passed"], out["arms"][arm]["items"])
        out["arms"][arm]["wilson"] = [round(lo, 3), round(hi, 3)]
        del out["arms"][arm]["per_item"]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"\nload average {load0} -> {out['load_at_end']}; {out['train']} demonstrations, {args.steps} steps, "
          f"{out['heldout']} unseen questions")
    print("| prompt_grad | median s/step | train CPU-s | held-out pass | 95% Wilson |")
    print("|---|---|---|---|---|")
    for arm in ("full", "answer_only"):
        x = out["arms"][arm]
        print(f"| {arm} | {x['step_s_median']} | {x['train_cpu_s']} | {x['passed']}/{x['items']} | "
              f"[{x['wilson'][0]:.0%}, {x['wilson'][1]:.0%}] |")
    print(f"step time ratio (full / answer_only): x{out['ratio_step_time']}; train CPU ratio x{out['ratio_train_cpu']}")
    print(f"paired: answer_only wins {wins}, loses {losses}; p(answer_only worse) = {out['p_answer_only_worse']:.3g}")


if __name__ == "__main__":
    main()
