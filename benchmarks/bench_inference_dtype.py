"""Which dtype should a CPU decode in? bf16 vs fp32 weights on the serving and gate workloads.

    .venv/bin/python benchmarks/bench_inference_dtype.py [--quick] [--json] [--widths 1 8 32] [--home DIR]

``policy.dtype = "fast"`` picks bf16 on a CPU that computes it natively (AVX512-BF16 or AMX), from
training and prefill timings. Decoding is a different workload: batch-1 decoding is a chain of
matrix-vector products bounded by memory bandwidth, and on an Intel Xeon with AMX
(``bench_cpu_limits.py --quick``) bf16 decoded 12.4 tokens/s against fp32's 16.7. This benchmark times
the inference workloads the product runs, in both dtypes, so the choice is made on evidence:

- ``width 1``: one BFCL prompt with its function specs, 48 new tokens (``flywheel serve`` with one client);
- ``width 8``: 8 prompts in one batch (``serve`` at the demo's traffic concurrency, rollouts);
- ``width 32``: 32 prompts in one batch (the gate, which decodes its held-out suite in one batch).

Arms: ``float32`` (the named peer: what ``fast`` resolves to on a CPU without native bf16) and
``bfloat16``, one model each (SmolLM2-135M through the product's decode loop, ``HFPolicy``, greedy,
``policy.decode_threads`` at its default), alternating within each repeat. Printed per width: wall seconds
of the whole call (prefill + decode, what a request costs), process CPU-seconds, new tokens per second, the
ratio fp32 / bf16 of wall time (> 1: bf16 is faster), and how many greedy answers are identical across the
two dtypes (they need not be: bf16 rounds differently; this says how far apart the two models are).
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

from bench_decode_threads import _cpu  # noqa: E402  (process CPU-seconds, user + system)


def bfcl_prompts(k: int) -> list[tuple[list[dict], list[dict]]]:
    """``k`` BFCL questions (messages, tools), taken in turn from the demo's four categories."""
    from flywheel.verifiers.bfcl import load_bfcl

    per_cat = [load_bfcl(cat, limit=k) for cat in ("simple_python", "multiple", "parallel", "parallel_multiple")]
    out = [(items[i].question_messages, items[i].tools) for i in range(k) for items in per_cat if i < len(items)]
    return out[:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="widths 1 and 8, one repeat")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--widths", type=int, nargs="+", default=None, help="batch widths (default 1 8 32)")
    ap.add_argument("--new-tokens", type=int, default=48, help="new tokens per answer (the demo's 48)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per arm (default 2; --quick 1)")
    ap.add_argument("--model", default="smollm2-135m", help="a base model spec (tiny: a smoke run)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()

    import torch
    from bench_cpu_limits import cpu_flags

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.format import render_prompt
    from flywheel.policy.hf import HFPolicy

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    widths = a.widths or ([1, 8] if a.quick else [1, 8, 32])
    reps = a.repeats or (1 if a.quick else 2)
    cpu = cpu_flags()
    arms = ("float32", "bfloat16")
    policies = {dt: HFPolicy.from_spec(a.model, Path(a.home), device="cpu", dtype=dt) for dt in arms}
    tok = policies["float32"].tokenizer
    prompts = [tok(render_prompt(tok, q, t), add_special_tokens=False)["input_ids"] for q, t in bfcl_prompts(max(widths))]
    log(f"cpu: {cpu['model']}, avx512_bf16={cpu['avx512_bf16']} amx_bf16={cpu['amx_bf16']}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens; load {os.getloadavg()[0]:.2f}")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=a.new_tokens)
    res: dict = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "new_tokens": a.new_tokens,
                 "repeats": reps, "load_before": os.getloadavg(), "rows": []}
    for pol in policies.values():  # warm-up: first-call allocations and oneDNN kernel selection
        pol.generate_from_ids(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2))
    for width in widths:
        ids = prompts[:width]
        per: dict[str, list[tuple[float, float, int]]] = {dt: [] for dt in arms}
        answers: dict[str, list] = {}
        for rep in range(reps):
            for dt in (arms if rep % 2 == 0 else tuple(reversed(arms))):
                t, c = time.perf_counter(), _cpu()
                out = policies[dt].generate_from_ids(ids, params)
                per[dt].append((time.perf_counter() - t, _cpu() - c, sum(len(g[0].completion_token_ids) for g in out)))
                answers[dt] = [g[0].completion_token_ids for g in out]
        row: dict = {"width": width, "identical": sum(x == y for x, y in zip(answers["float32"], answers["bfloat16"], strict=True))}
        for dt in arms:
            wall = statistics.median(w for w, _, _ in per[dt])
            cpu_s = statistics.median(c for _, c, _ in per[dt])
            new = per[dt][-1][2]
            row[dt] = {"wall_s": wall, "cpu_s": cpu_s, "new_tokens": new, "tokens_per_s": new / wall}
        row["fp32_over_bf16"] = row["float32"]["wall_s"] / row["bfloat16"]["wall_s"]
        res["rows"].append(row)
        log(f"width {width}: fp32 {row['float32']['wall_s']:.1f} s, bf16 {row['bfloat16']['wall_s']:.1f} s "
            f"(x{row['fp32_over_bf16']:.2f}); identical answers {row['identical']}/{width}")
    res["load_after"] = os.getloadavg()
    if a.json:
        print(json.dumps(res, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="inference dtype: bf16 vs fp32 (peer) -- wall time of the whole call, prefill + decode")
    for col in ("width", "fp32 s", "bf16 s", "fp32 tok/s", "bf16 tok/s", "fp32/bf16", "identical"):
        table.add_column(col, justify="right")
    for r in res["rows"]:
        f, b = r["float32"], r["bfloat16"]
        table.add_row(str(r["width"]), f"{f['wall_s']:.1f}", f"{b['wall_s']:.1f}", f"{f['tokens_per_s']:.1f}",
                      f"{b['tokens_per_s']:.1f}", f"x{r['fp32_over_bf16']:.2f}", f"{r['identical']}/{r['width']}")
    Console(width=80).print(table)
    print(f"load {res['load_before'][0]:.2f} -> {res['load_after'][0]:.2f}; > x1 means bf16 is faster")


if __name__ == "__main__":
    main()
