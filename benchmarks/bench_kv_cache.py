"""The decode loop's keys and values written in place vs transformers' ``DynamicCache`` (issue 32).

    .venv/bin/python benchmarks/bench_kv_cache.py [--quick] [--json] [--widths 8 32 64] [--dtype float32|bfloat16]

Workload: the gate's and ``flywheel serve``'s shape -- N BFCL questions of the demo's four categories with
their functions, in one generate call (SmolLM2-135M through the project's own decode loop, ``HFPolicy``,
greedy, ``max_new_tokens`` 96 as the cpu profile's gate), for N in ``--widths`` (8: a serve batch at the
demo's traffic concurrency; 64: a chunk of the gate's suite, ``max_batch_rows``).
Arms, alternating (order swapped each round), one model: ``dynamic`` (the named peer: transformers'
``DynamicLayer``, which appends a step by ``torch.cat`` of the whole cache) and ``inplace``
(``flywheel.policy.kv_cache.PreallocatedLayer``, the product's default). Printed per width: seconds and
process CPU-seconds per call, new tokens per second, and the ratio dynamic / inplace; answers and
log-probabilities must be identical (checked and printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefix_cache import _cpu, bfcl_requests  # noqa: E402  (the same BFCL sampling and CPU clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="widths 8 and 32, 1 round, 48 new tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--widths", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per arm (default 2; --quick 1)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 96 (the cpu profile's gate); --quick 48")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--model", default="smollm2-135m", help="a base model spec (tiny: a smoke run)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.hf import HFPolicy

    widths = a.widths or ([8, 32] if a.quick else [8, 32, 64])
    rounds = a.rounds or (1 if a.quick else 2)
    max_new = a.max_new_tokens or (48 if a.quick else 96)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new)
    # decode_threads fixed at torch's count: "auto" may switch counts between calls, and another count rounds
    # the GEMMs differently, which would blur the identity check between the arms
    pol = HFPolicy.from_spec(a.model, Path(a.home), device="cpu", dtype=a.dtype, prefix_cache_mb=0, decode_threads=0)
    reqs = bfcl_requests(max(widths), offset=150)
    pol.generate([reqs[0][0]], SamplingParams(n=1, temperature=0.0, max_new_tokens=4), tools=[reqs[0][1]])  # warm-up
    arms = {"dynamic": False, "inplace": True}
    console = Console(stderr=True)
    rows = []
    for w in widths:
        batch = reqs[:w]
        res: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(rounds):
            for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                pol.preallocate_kv = arms[arm]
                c0, t0 = _cpu(), time.perf_counter()
                out = pol.generate([m for m, _ in batch], params, tools=[t for _, t in batch])
                wall, cpu = time.perf_counter() - t0, _cpu() - c0
                toks = sum(len(g[0].completion_token_ids) for g in out)
                res[arm].append({"s": wall, "cpu_s": cpu, "tokens": toks,
                                 "answers": [g[0].completion_token_ids for g in out],
                                 "logprobs": [g[0].logprobs for g in out]})
                if not a.json:
                    console.print(f"width {w:>3} round {r + 1}/{rounds} {arm:<8} {wall:7.1f} s, {cpu:7.1f} CPU-s, "
                                  f"{toks} new tokens")
        row: dict = {"width": w, "prompt_tokens": sum(len(pol.tokenizer(pol_text)["input_ids"])
                                                       for pol_text in _texts(pol, batch)) // w}
        for arm in arms:
            row[arm] = {"s": statistics.median(x["s"] for x in res[arm]),
                        "cpu_s": statistics.median(x["cpu_s"] for x in res[arm]), "tokens": res[arm][0]["tokens"]}
            row[arm]["tokens_per_s"] = row[arm]["tokens"] / row[arm]["s"]
        row["ratio_wall"] = row["dynamic"]["s"] / row["inplace"]["s"]
        row["ratio_cpu"] = row["dynamic"]["cpu_s"] / row["inplace"]["cpu_s"]
        ref = res["dynamic"][0]
        row["identical"] = all(x["answers"] == ref["answers"] and x["logprobs"] == ref["logprobs"]
                               for arm in arms for x in res[arm])
        rows.append(row)
    meta = {"model": a.model, "dtype": a.dtype, "rounds": rounds, "max_new_tokens": max_new,
            "threads": torch.get_num_threads(), "load_after": os.getloadavg()[0],
            "peer": "dynamic (transformers' DynamicLayer: torch.cat per step)"}
    if a.json:
        print(json.dumps({"meta": meta, "widths": rows}, indent=2))
        return
    t = Table(title=f"decode KV cache ({a.model}, {a.dtype}, greedy, {max_new} new tokens)")
    for col in ("rows", "prompt", "s dyn", "s inpl", "tok/s dyn", "tok/s inpl", "x wall", "x CPU"):
        t.add_column(col, justify="right", no_wrap=True)
    for row in rows:
        d, i = row["dynamic"], row["inplace"]
        t.add_row(str(row["width"]), str(row["prompt_tokens"]), f"{d['s']:.1f}", f"{i['s']:.1f}",
                  f"{d['tokens_per_s']:.1f}", f"{i['tokens_per_s']:.1f}", f"x{row['ratio_wall']:.2f}",
                  f"x{row['ratio_cpu']:.2f}")
    Console().print(t)
    same = ", ".join(f"{row['width']} {'yes' if row['identical'] else 'NO'}" for row in rows)
    print(f"answers and log-probs identical across arms (by width): {same}")
    print(f"peer: {meta['peer']}; {meta['threads']} threads; load after {meta['load_after']:.1f}")


def _texts(pol, batch) -> list[str]:
    from flywheel.policy.format import render_prompt

    return [render_prompt(pol.tokenizer, m, t) for m, t in batch]


if __name__ == "__main__":
    main()
