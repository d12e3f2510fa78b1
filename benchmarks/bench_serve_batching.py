"""Concurrent clients through ``flywheel serve``: the batcher that gathers the traffic's width vs the one before.

    .venv/bin/python benchmarks/bench_serve_batching.py [--quick] [--json] [--questions 32] [--clients 8]

Workload: the demo's wave -- BFCL questions of its four categories sent through the OpenAI-compatible
server by ``--clients`` threads, each sending its next question as soon as its reply is in (the demo's
gateway: 8 in flight), SmolLM2-135M fp32 (the HF backend, greedy, 96 tokens as the cpu profile's
``max_tokens``), the server in this process on 127.0.0.1 (``create_app`` + ``run_in_thread``).
Arms, one model, order alternating per round: ``before`` (the named peer: ``BatchingPolicy`` as of commit
2573bf0, read from git: a new batch waits at most 20 ms for company) and ``gather`` (the product's:
each merged call first waits, at most ``gather_s``, for as many prompts as were in flight during the
previous call). Printed per arm: wall seconds for all questions, requests/s, the number of merged calls
and their sizes, and how many greedy answers every run gave alike (other batch compositions pad
differently, which may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefix_cache import bfcl_requests  # noqa: E402  (the same BFCL sampling)

PEER_COMMIT = "2573bf0"


def old_batching() -> types.ModuleType:
    """``flywheel/policy/batching.py`` as of :data:`PEER_COMMIT`, loaded as a module of its own."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{PEER_COMMIT}:flywheel/policy/batching.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("batching_before")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up by name
    exec(compile(src, f"{PEER_COMMIT}:flywheel/policy/batching.py", "exec"), mod.__dict__)
    return mod


def replay(url: str, questions, clients: int, max_tokens: int) -> tuple[float, list[str]]:
    import httpx

    answers: list[str] = [""] * len(questions)

    def ask(i: int) -> None:
        messages, tools = questions[i]
        body = {"model": "base", "messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        answers[i] = r.json()["choices"][0]["message"]["content"] or ""

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(ask, range(len(questions))))
    return time.perf_counter() - t0, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 questions, 48 tokens")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--questions", type=int, default=None, help="default 32 (--quick 16)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 96 (--quick 48)")
    ap.add_argument("--model", default="smollm2-135m", help="a base model spec (tiny: a smoke run)")
    ap.add_argument("--home", default=os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    a = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    import flywheel.serve.app as serve_app
    from flywheel.policy.batching import BatchingPolicy
    from flywheel.policy.hf import HFPolicy
    from flywheel.serve import ServeLimits, create_app, run_in_thread, static_provider

    n_q = a.questions or (16 if a.quick else 32)
    max_tokens = a.max_tokens or (48 if a.quick else 96)
    questions = bfcl_requests(n_q, offset=120)
    if len(questions) != n_q:
        sys.exit(f"bench_serve_batching: only {len(questions)} BFCL questions from offset 120 (asked {n_q})")
    pol = HFPolicy.from_spec(a.model, Path(a.home), device="cpu", dtype="float32", prefix_cache_mb=0)
    arms = {"before": old_batching().BatchingPolicy, "gather": BatchingPolicy}
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    console = Console(stderr=True)
    for r in range(a.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            made: list = []

            def batcher_class(*args, _cls=arms[arm], _made=made, **kw):
                b = _cls(*args, **kw)
                _made.append(b)
                return b

            serve_app.BatchingPolicy = batcher_class  # what ServeState.batcher constructs
            app = create_app(static_provider("base", pol), limits=ServeLimits(max_concurrency=a.clients,
                                                                              max_tokens=max_tokens))
            with run_in_thread(app) as url:
                wall, answers = replay(url, questions, a.clients, max_tokens)
            sizes = list(getattr(made[0], "batch_sizes", []))  # the peer's class does not record them
            calls = made[0].calls
            results[arm].append({"s": wall, "calls": calls, "sizes": sizes, "answers": answers})
            if not a.json:
                console.print(f"round {r + 1}/{a.rounds} {arm:<6} {wall:6.1f} s, {calls} merged calls {sizes or ''}")
    serve_app.BatchingPolicy = BatchingPolicy
    ref = results["before"][0]["answers"]
    row = {arm: {"s": min(x["s"] for x in rs), "calls": rs[0]["calls"], "sizes": rs[-1]["sizes"],
                 "requests_per_s": n_q / min(x["s"] for x in rs)} for arm, rs in results.items()}
    out = {"meta": {"model": a.model, "questions": n_q, "clients": a.clients, "max_tokens": max_tokens,
                    "rounds": a.rounds, "threads": torch.get_num_threads(), "load_after": os.getloadavg()[0],
                    "peer": f"before (BatchingPolicy of {PEER_COMMIT})"},
           "arms": row, "ratio_wall": row["before"]["s"] / row["gather"]["s"],
           # greedy answers of other batch compositions may differ by a near-tie (padding changes the
           # summation order): counted, not required
           "same_answers": min(sum(x == y for x, y in zip(r["answers"], ref, strict=True))
                               for rs in results.values() for r in rs)}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    t = Table(title=f"{n_q} questions, {a.clients} clients, {max_tokens} tokens ({a.model}, fp32)")
    for col in ("arm", "s", "req/s", "merged calls"):
        t.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for arm, v in row.items():
        t.add_row(arm, f"{v['s']:.1f}", f"{v['requests_per_s']:.2f}", str(v["calls"]))
    Console().print(t)
    print(f"x{out['ratio_wall']:.2f} wall (before / gather); the same greedy answer in every run: "
          f"{out['same_answers']} of {n_q}")
    print(f"peer: {out['meta']['peer']}; gather's call sizes: {row['gather']['sizes']}")


if __name__ == "__main__":
    main()
