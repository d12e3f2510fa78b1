"""Decoding on an idle and on a busy CPU: ``policy.decode_threads = "auto"`` vs torch's own thread count.

    .venv/bin/python benchmarks/bench_decode_threads.py [--quick] [--json] [--dtype float32|bfloat16] [--hogs 1]

Workloads (SmolLM2-135M through the project's own decode loop, ``HFPolicy``, greedy):
- ``batch1``: one BFCL prompt with its function specs (what ``flywheel serve`` decodes for one client), 64 new tokens;
- ``batch16``: 16 BFCL prompts at once (what the gate and rollouts decode), 48 new tokens.
Each under two conditions: ``idle`` (nothing else started by the benchmark) and ``busy`` (``--hogs`` processes
spinning on a core each, started by the benchmark: a CI runner or a laptop doing other work).
Arms, alternating within each condition: ``torch`` (the named peer: a fixed count, torch's default -- what
every decode loop runs with unless told otherwise), ``one`` (a fixed single thread) and ``auto`` (the product's
default: the steps timed under each candidate count and the fastest kept; its model's chooser carries over
between calls, as in a server or a gate). One model per arm.
Printed per workload and condition: new tokens per second of the decode phase (the 1-token prefill-only call
subtracted), process CPU-seconds per token, and the ratio auto / torch. Answers must be identical across arms
(greedy; checked and printed). For batch 1 also the fraction of the memory-bandwidth bound (issue 32's
"decoding >= 50% of the bound"): every weight and the KV cache read once per token, at the copy bandwidth
measured idle in the same run (``copy_bandwidth`` of bench_cpu_limits.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _spin() -> None:  # a process that keeps one core busy
    while True:
        pass


def bfcl_prompts(k: int) -> list[tuple[list[dict], list[dict]]]:
    import importlib.util

    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench_decode_threads needs the bfcl-eval package (make setup installs it)")
    out = []
    for cat in ("multiple", "parallel_multiple", "simple_python"):
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"BFCL_v4_{cat}.json"
        with path.open() as f:
            for line in f:
                rec = json.loads(line)
                out.append((rec["question"][0], [{"type": "function", "function": fn} for fn in rec["function"]]))
                if len(out) % 8 == 0:
                    break
        if len(out) >= k:
            break
    return out[:k]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat instead of 3, batch16 with 8 prompts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--hogs", type=int, default=1, help="busy processes of the busy condition (default 1)")
    ap.add_argument("--model", default="smollm2-135m", help="a base model spec (tiny: a smoke run)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()

    import torch

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.format import render_prompt
    from flywheel.policy.hf import HFPolicy

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    reps = 1 if a.quick else 3
    width = 8 if a.quick else 16
    torch_threads = torch.get_num_threads()
    arms = {"torch": torch_threads, "one": 1, "auto": "auto"}
    # one model per arm, loaded alike: auto's chooser lives with its model across calls, as in a server or a gate
    policies = {arm: HFPolicy.from_spec(a.model, Path(a.home), device="cpu", dtype=a.dtype, decode_threads=setting)
                for arm, setting in arms.items()}
    base = policies["torch"]
    tok = base.tokenizer
    prompts = [tok(render_prompt(tok, [q] if isinstance(q, dict) else q, t), add_special_tokens=False)["input_ids"]
               for q, t in bfcl_prompts(width)]
    work = {"batch1": (prompts[:1], 64), f"batch{width}": (prompts, 48)}
    log(f"torch {torch.__version__}, {torch_threads} threads, dtype {a.dtype}, {os.cpu_count()} CPUs; "
        f"prompt tokens {[len(p) for p in prompts[:4]]}...; load {os.getloadavg()[0]:.2f}")

    def timed(pol, ids, n_new):
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=n_new)
        t, c = time.perf_counter(), _cpu()
        out = pol.generate_from_ids(ids, params)
        return time.perf_counter() - t, _cpu() - c, [g[0].completion_token_ids for g in out]

    res: dict = {"torch_threads": torch_threads, "dtype": a.dtype, "hogs": a.hogs, "reps": reps, "rows": []}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cpu_limits import copy_bandwidth, matmul_params

    mp_ = matmul_params(base.model)
    bpe = base.model.dtype.itemsize
    ctx = len(prompts[0]) + 32  # the mean KV length while batch1 decodes 64 tokens
    res["bytes_per_token_batch1"] = bpe * (mp_["total_params"] + 2 * mp_["layers"] * mp_["kv_dim"] * ctx)
    res["copy_gbps"] = copy_bandwidth(3)
    res["bound_tokens_per_s_batch1"] = res["copy_gbps"] * 1e9 / res["bytes_per_token_batch1"]
    log(f"copy bandwidth {res['copy_gbps']:.1f} GB/s; batch1 reads {res['bytes_per_token_batch1'] / 1e6:.0f} MB "
        f"per token: bound {res['bound_tokens_per_s_batch1']:.1f} tokens/s")
    for cond in ("idle", "busy"):
        hogs = [mp.Process(target=_spin, daemon=True) for _ in range(a.hogs if cond == "busy" else 0)]
        for h in hogs:
            h.start()
        try:
            time.sleep(0.5 if hogs else 0.0)
            for wname, (ids, n_new) in work.items():
                per: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
                answers: dict[str, list] = {}
                steps: dict[str, dict] = {}
                for rep in range(reps):
                    order = list(arms) if rep % 2 == 0 else list(reversed(arms))
                    for arm in order:
                        pol = policies[arm]
                        pol.decode_thread_steps = {}
                        w1, c1, _ = timed(pol, ids, 1)
                        wn, cn, out = timed(pol, ids, n_new)
                        new = sum(len(x) - 1 for x in out)  # tokens after the first (which the 1-token call costs)
                        per[arm].append(((wn - w1) / max(new, 1), (cn - c1) / max(new, 1)))
                        answers[arm] = out
                        steps[arm] = dict(pol.decode_thread_steps)
                same = all(answers[k] == answers["torch"] for k in arms)
                row = {"condition": cond, "workload": wname, "rows": len(ids), "new_tokens": n_new, "identical": same,
                       "auto_steps_at": steps["auto"]}
                for arm in arms:
                    s_tok = statistics.median(x[0] for x in per[arm])
                    row[arm] = {"tokens_per_s": 1.0 / s_tok, "s_per_token": s_tok,
                                "cpu_s_per_token": statistics.median(x[1] for x in per[arm])}
                row["auto_vs_torch"] = row["auto"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
                row["one_vs_torch"] = row["one"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
                if len(ids) == 1:
                    for arm in arms:
                        row[arm]["fraction_of_bound"] = row[arm]["tokens_per_s"] / res["bound_tokens_per_s_batch1"]
                res["rows"].append(row)
                bound = (f"; of the bound: torch {row['torch']['fraction_of_bound']:.0%}, auto "
                         f"{row['auto']['fraction_of_bound']:.0%}") if len(ids) == 1 else ""
                log(f"{cond:4} {wname:7}: torch({torch_threads}) {row['torch']['tokens_per_s']:7.1f} tok/s, "
                    f"one {row['one']['tokens_per_s']:7.1f}, auto {row['auto']['tokens_per_s']:7.1f} "
                    f"(x{row['auto_vs_torch']:.2f} of torch; auto's steps per count {steps['auto']}); "
                    f"answers identical: {same}{bound}; load {os.getloadavg()[0]:.2f}")
        finally:
            for h in hogs:
                h.terminate()
                h.join()
    res["load_after"] = os.getloadavg()
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"\n{'condition':9} {'workload':8} {'torch tok/s':>11} {'one':>7} {'auto':>7} {'auto/torch':>10} {'same':>5}")
    for r in res["rows"]:
        print(f"{r['condition']:9} {r['workload']:8} {r['torch']['tokens_per_s']:11.1f} {r['one']['tokens_per_s']:7.1f} "
              f"{r['auto']['tokens_per_s']:7.1f} {r['auto_vs_torch']:10.2f} {str(r['identical']):>5}")


if __name__ == "__main__":
    main()
