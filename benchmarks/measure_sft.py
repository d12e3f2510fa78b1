"""Issue 12 measurement: does the SFT warm start teach SmolLM2-135M the call format?

SFT on demonstrations from BFCL ``simple_python`` (the first ``--train`` questions, their reference
answers rendered through the shared prompt/answer format), for a fixed budget of optimizer steps,
then greedy decoding on held-out ``simple_python`` questions (a disjoint slice) before and after:
share of parseable calls and pass rate under the project's ``tool_call`` verifier, with wall times.

    .venv/bin/python benchmarks/measure_sft.py [--quick] [--steps 16] [--lora-r 16] [--lr 1e-3]

The peer is the model itself before training (same prompts, same decoding, same verifier).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def score(policy, items, max_new_tokens: int) -> dict:
    from flywheel.policy.base import SamplingParams
    from flywheel.verifiers import verify
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected

    t0 = time.perf_counter()
    outs = policy.generate([i.question_messages for i in items],
                           SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
                           tools=[i.tools for i in items])
    n_pass = n_parse = 0
    for item, o in zip(items, outs, strict=True):
        v = verify({"kind": "tool_call", "tools": item.tools, "expected": bfcl_answer_to_expected(item.possible_answer)},
                   [{"role": "assistant", "content": o[0].text}])
        n_pass += bool(v.passed)
        n_parse += v.components.get("parseable", 0.0) > 0
    return {"items": len(items), "passed": n_pass, "parseable": n_parse, "pass_rate": n_pass / len(items),
            "parseable_rate": n_parse / len(items), "wall_s": round(time.perf_counter() - t0, 1),
            "example": outs[0][0].text[:200]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4 steps, 10 held-out questions")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--train", type=int, default=160, help="training questions (from the start of simple_python)")
    ap.add_argument("--heldout", type=int, default=40, help="held-out questions (from index 300)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=16, help="0 = full fine-tuning")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.heldout = 4, 10
    home = args.home or tempfile.mkdtemp(prefix="flywheel-sft-")
    os.environ["FLYWHEEL_HOME"] = home
    import torch

    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.policy.hf import HFPolicy
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.store import open_store
    from flywheel.tracking import Tracker
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft
    from flywheel.verifiers.bfcl import load_bfcl, reference_calls

    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}", flush=True)
    cfg = load_config(overrides={"train": {"lora_r": args.lora_r, "batch_size": args.batch_size,
                                           "micro_batch_tokens": 8192}}, environ={"FLYWHEEL_HOME": home})
    items = load_bfcl("simple_python")
    train, held = items[: args.train], items[300 : 300 + args.heldout]
    base = HFPolicy.from_spec("smollm2-135m", home=cfg.home, device="cpu", dtype="float32")
    before = score(base, held, args.max_new_tokens)
    print("before:", json.dumps(before), flush=True)
    del base
    demos = [Demonstration(messages=i.question_messages, tools=i.tools, answer_calls=reference_calls(i.possible_answer),
                           source_entity_id=f"eval:bfcl-{i.id}", split="train") for i in train]
    store, artifacts, tracker = open_store(cfg), open_artifacts(cfg), Tracker(cfg)
    t0 = time.perf_counter()
    res = train_sft(cfg, store, artifacts, tracker, demos, base="smollm2-135m", steps=args.steps, lr=args.lr,
                    on_step=lambda s, m: print(f"  step {s}: loss {m.get('loss', float('nan')):.4f} "
                                               f"({time.perf_counter() - t0:.0f} s)", flush=True))
    train_s = time.perf_counter() - t0
    after = score(load_policy_for_version(cfg, tracker, cfg.cycle.model_name, res.model_version), held,
                  args.max_new_tokens)
    print("after:", json.dumps(after), flush=True)
    print("\n| | parseable calls | pass rate | wall |")
    print("|---|---|---|---|")
    print(f"| before (base SmolLM2-135M) | {before['parseable']}/{before['items']} | {before['pass_rate']:.1%} | {before['wall_s']} s |")
    print(f"| after SFT ({args.steps} steps x {args.batch_size}, {'LoRA r=' + str(args.lora_r) if args.lora_r else 'full'}, "
          f"lr {args.lr}) | {after['parseable']}/{after['items']} | {after['pass_rate']:.1%} | train {train_s:.0f} s |")
    print(f"ratio (after/before pass rate): {'inf' if before['passed'] == 0 and after['passed'] else (after['pass_rate'] / before['pass_rate'] if before['passed'] else 0):}")


if __name__ == "__main__":
    main()
