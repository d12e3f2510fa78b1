"""Requests that repeat a long prompt prefix, one at a time: ``policy.prefix_cache_mb`` on vs off.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--quick] [--json] [--rounds 3] [--dtype float32|bfloat16]

Real agents send the same long system prompt and tool list with every request, and each turn of a
conversation repeats every turn before it; a server gets them one at a time. Workloads (SmolLM2-135M
through the project's own decode loop, ``HFPolicy``, greedy, each request its own generate call, as
``flywheel serve`` runs a request that arrives alone):
- ``agent``: the travel agent of ``tests/fixtures/agent_traffic.py`` (a ~1,400-character system prompt and
  four tools) answering different questions;
- ``conversation``: one conversation with that agent, each turn's prompt the previous one plus the
  model's answer and the next question;
- ``bfcl``: BFCL questions of the demo's categories, each with its own functions (the demo's production
  traffic): only the tool-prompt template is shared.
Arms, alternating (order swapped each round), one model each: ``off`` (the named peer:
``prefix_cache_mb = 0``, what the product did before the cache -- the shared part is encoded once per
call, so a lone request encodes its whole prompt) and ``on`` (the default 256 MB). The cache is emptied
at the start of every round, so each round pays its own first request. Printed per workload: seconds
and process CPU-seconds per request, prompt tokens encoded per request, and the ratio off / on. Greedy
answers must be identical across arms (checked and printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures: the agent traffic


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bfcl_requests(k: int, offset: int = 100) -> list[tuple[list[dict], list[dict]]]:
    """``k`` BFCL questions with their functions, spread over the demo's four categories from ``offset`` on."""
    from flywheel.verifiers.bfcl import load_bfcl

    cats = ("simple_python", "multiple", "parallel", "parallel_multiple")
    per = (k + len(cats) - 1) // len(cats)
    items = [it for c in cats for it in load_bfcl(c)[offset : offset + per]]  # parallel*: 200 questions each
    return [(it.question_messages, it.tools) for it in items[:k]]


def agent_requests(k: int) -> list[tuple[list[dict], list[dict]]]:
    from tests.fixtures.agent_traffic import TRAVEL_SYSTEM, TRAVEL_TOOLS, travel_questions

    qs = travel_questions()
    step = max(1, len(qs) // k)
    return [([{"role": "system", "content": TRAVEL_SYSTEM}, {"role": "user", "content": q}], TRAVEL_TOOLS)
            for q in qs[::step][:k]]


FOLLOW_UPS = ["And the day after?", "What about Oslo instead?", "Then find me a hotel there for two nights.",
              "Under 120 euros, please.", "And a flight from Lisbon on the 12th?", "Convert 300 euros to NOK."]


def run_workload(pol, name: str, requests, turns: int, params) -> dict:
    """One pass: each request (or each turn) its own generate call. Returns time, CPU and tokens."""
    pc = pol._shared.prefix_cache
    pc.clear()
    saved0, reused0 = pol.prefix_tokens_saved, pc.tokens_reused
    answers: list[list[int]] = []
    prompt_tokens = 0
    c0, t0 = _cpu(), time.perf_counter()
    if name == "conversation":
        from tests.fixtures.agent_traffic import TRAVEL_SYSTEM, TRAVEL_TOOLS

        msgs = [{"role": "system", "content": TRAVEL_SYSTEM}, {"role": "user", "content": "Weather in Lisbon tomorrow?"}]
        for t in range(turns):
            s = pol.generate([msgs], params, tools=TRAVEL_TOOLS)[0][0]
            answers.append(s.completion_token_ids)
            prompt_tokens += len(s.prompt_token_ids)
            msgs = [*msgs, {"role": "assistant", "content": s.text.strip() or "OK."},
                    {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    else:
        for messages, tools in requests:
            s = pol.generate([messages], params, tools=tools)[0][0]
            answers.append(s.completion_token_ids)
            prompt_tokens += len(s.prompt_token_ids)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    n = len(answers)
    skipped = pol.prefix_tokens_saved - saved0
    return {"requests": n, "s_per_request": wall / n, "cpu_s_per_request": cpu / n,
            "prompt_tokens_per_request": prompt_tokens / n, "encoded_per_request": (prompt_tokens - skipped) / n,
            "reused_per_request": (pc.tokens_reused - reused0) / n, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and turns, 2 rounds")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per arm (default 3; --quick 2)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--model", default="smollm2-135m", help="a base model spec (tiny: a smoke run)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from flywheel.policy.base import SamplingParams
    from flywheel.policy.hf import PREFIX_CACHE_MB, HFPolicy

    rounds = a.rounds or (2 if a.quick else 3)
    k, turns = (6, 4) if a.quick else (12, 6)
    work = {"agent": agent_requests(k), "conversation": None, "bfcl": bfcl_requests(k)}
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=a.max_new_tokens)
    home = Path(a.home)
    arms = {"off": 0, "on": PREFIX_CACHE_MB}
    # decode_threads fixed at torch's count: "auto" may switch counts between calls, and another count rounds
    # the GEMMs differently, which would blur the identity check between the arms
    pols = {arm: HFPolicy.from_spec(a.model, home, device="cpu", dtype=a.dtype, prefix_cache_mb=mb, decode_threads=0)
            for arm, mb in arms.items()}
    for pol in pols.values():  # warm-up: allocator, thread pools, the decode thread chooser
        run_workload(pol, "agent", work["agent"][:2], 0, params)
    runs: dict[str, dict[str, list[dict]]] = {w: {arm: [] for arm in arms} for w in work}
    console = Console(stderr=True)
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for w, reqs in work.items():
            for arm in order:
                res = run_workload(pols[arm], w, reqs, turns, params)
                runs[w][arm].append(res)
                if not a.json:
                    console.print(f"round {r + 1}/{rounds} {w:<12} {arm:<3} {res['s_per_request']:.2f} s/request, "
                                  f"{res['encoded_per_request']:.0f} of {res['prompt_tokens_per_request']:.0f} "
                                  "prompt tokens encoded")
    rows = []
    for w in work:
        row: dict = {"workload": w}
        for arm in arms:
            rs = runs[w][arm]
            row[arm] = {key: statistics.median(x[key] for x in rs)
                        for key in ("s_per_request", "cpu_s_per_request", "prompt_tokens_per_request",
                                    "encoded_per_request", "reused_per_request")}
            row[arm]["requests"] = rs[0]["requests"]
        row["ratio_wall"] = row["off"]["s_per_request"] / row["on"]["s_per_request"]
        row["ratio_cpu"] = row["off"]["cpu_s_per_request"] / row["on"]["cpu_s_per_request"]
        row["answers_identical"] = all(x["answers"] == runs[w]["off"][0]["answers"]
                                       for arm in arms for x in runs[w][arm])
        rows.append(row)
    meta = {"model": a.model, "dtype": a.dtype, "rounds": rounds, "max_new_tokens": a.max_new_tokens,
            "threads": torch.get_num_threads(), "cpu": _cpu_name(), "load_after": os.getloadavg()[0],
            "peer": "off (policy.prefix_cache_mb = 0)"}
    if a.json:
        print(json.dumps({"meta": meta, "workloads": rows}, indent=2))
        return
    t = Table(title=f"prefix cache across requests ({a.model}, {a.dtype}, greedy, {a.max_new_tokens} new tokens)")
    for col in ("workload", "n", "prompt", "encoded", "s off", "s on", "x wall", "x CPU"):
        t.add_column(col, justify="left" if col == "workload" else "right", no_wrap=True)
    for row in rows:
        off, on = row["off"], row["on"]
        t.add_row(row["workload"], str(on["requests"]), f"{on['prompt_tokens_per_request']:.0f}",
                  f"{off['encoded_per_request']:.0f}/{on['encoded_per_request']:.0f}", f"{off['s_per_request']:.2f}",
                  f"{on['s_per_request']:.2f}", f"x{row['ratio_wall']:.2f}", f"x{row['ratio_cpu']:.2f}")
    Console().print(t)
    same = ", ".join(f"{row['workload']} {'yes' if row['answers_identical'] else 'NO'}" for row in rows)
    print("prompt: tokens per request; encoded: of them, encoded off/on; s: seconds per request")
    print(f"greedy answers identical across arms: {same}")
    print(f"peer: {meta['peer']}; {meta['threads']} threads; {meta['cpu']}; load after {meta['load_after']:.1f}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
