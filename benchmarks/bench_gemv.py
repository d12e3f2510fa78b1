"""Batch-1 decoding's matrix-vector products against the memory-bandwidth bound (issue 32).

    .venv/bin/python benchmarks/bench_gemv.py [--quick] [--json]

One decode step of SmolLM2-135M at batch 1 multiplies one row by every weight matrix: 30 blocks x 7
projections (576x576 q/o, 192x576 k/v, 1536x576 gate/up, 576x1536 down) and the 49,152x576 output layer,
about 135M weights read once each. This times exactly those products (random weights of the model's
shapes, no model load) and reports the weight bytes streamed per second against the copy bandwidth
measured in the same run, for:

- ``torch fp32`` (the named peer: ``F.linear``, what the decode loop runs; MKL's GEMV on x86),
- ``torch bf16`` (the same with bf16 weights: half the bytes; native only with AVX512-BF16/AMX),
- ``numpy fp32`` (numpy's own BLAS, OpenBLAS in its wheels) -- in isolation only: inside torch's decode
  loop its thread pool and torch's OpenMP pool contend (measured 2026-12-05: 355 ms per token at 2
  threads against 62 at 1; not adopted),

at 1 thread and at torch's thread count. Printed: ms per token-equivalent (all 211 products once),
GB/s of weights, the fraction of the copy bandwidth (the bound a GEMV can reach), and each arm's ratio to
the peer at the same thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS = 30
HEAD = (49152, 576)


def copy_gbps(threads: int, reps: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.empty(50_000_000)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    return 2 * a.numel() * 4 * reps / (time.perf_counter() - t) / 1e9


def _step(weights: list, fn: object, xs: dict) -> None:
    """One token's products: every weight times the input row of its width."""
    for w in weights:
        fn(xs[w.shape[1]], w)  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 timed passes instead of 20")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F
    from threadpoolctl import threadpool_limits

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    reps = 5 if a.quick else 20
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(o, i, generator=gen) for _ in range(LAYERS) for (o, i) in SHAPES] + [torch.randn(*HEAD, generator=gen)]
    n_weights = sum(w.numel() for w in fp32)
    arms = {
        "torch fp32": ([w for w in fp32], lambda x, w: F.linear(x, w), torch.float32),
        "torch bf16": ([w.bfloat16() for w in fp32], lambda x, w: F.linear(x, w), torch.bfloat16),
        "numpy fp32": ([w.numpy() for w in fp32], lambda x, w: x @ w.T, None),
    }
    torch_threads = torch.get_num_threads()
    counts = sorted({1, torch_threads})
    res: dict = {"weights": n_weights, "torch_threads": torch_threads, "reps": reps, "rows": []}
    log(f"torch {torch.__version__}, {torch_threads} threads, {os.cpu_count()} CPUs, {n_weights / 1e6:.1f}M weights "
        f"in {len(fp32)} products per token; load {os.getloadavg()[0]:.2f}")
    for th in counts:
        bw = copy_gbps(th)
        res.setdefault("copy_gbps", {})[th] = bw
        peer_ms = None
        for name, (ws, fn, dt) in arms.items():
            torch.set_num_threads(th)
            with threadpool_limits(limits=th, user_api="blas"):
                xs = {}
                for w in ws:
                    k = w.shape[1]
                    if k not in xs:
                        xs[k] = np.random.default_rng(0).standard_normal((1, k), dtype=np.float32) if dt is None \
                            else torch.randn(1, k, generator=gen).to(dt)

                for _ in range(2):
                    _step(ws, fn, xs)
                t = time.perf_counter()
                for _ in range(reps):
                    _step(ws, fn, xs)
                ms = (time.perf_counter() - t) / reps * 1000
            nbytes = n_weights * (2 if dt is torch.bfloat16 else 4)
            gbps = nbytes / (ms / 1000) / 1e9
            if name == "torch fp32":
                peer_ms = ms
            row = {"arm": name, "threads": th, "ms_per_token": round(ms, 2), "weight_gbps": round(gbps, 1),
                   "of_copy_bandwidth": round(gbps / bw, 3), "x_vs_torch_fp32": round(peer_ms / ms, 2) if peer_ms else None}
            res["rows"].append(row)
            log(f"  {th} thread(s) {name:11s}: {ms:6.1f} ms per token, weights at {gbps:5.1f} GB/s = {gbps / bw:4.0%} of "
                f"copy ({bw:.1f} GB/s); x{row['x_vs_torch_fp32']:.2f} vs torch fp32")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
