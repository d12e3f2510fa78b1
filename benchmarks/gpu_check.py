"""One-shot check of the fused log-prob kernel on a lent CUDA GPU (e.g. an H200). Prints every figure.

Steps (each a subprocess with its own time limit; a failing step is reported and the next one runs):
  1. environment: torch / triton / GPU names, free memory;
  2. the kernel tests with real Triton (``tests/unit/test_fused_logprob.py``, gpu-marked test included;
     tests/conftest.py leaves TRITON_INTERPRET unset when CUDA is present);
  3. benchmark at SmolLM2-135M's head, 8,192 tokens x 49,152 x 576, bf16: naive vs fused (triton, torch);
  4. benchmark at the issue's GPU shape, 32,768 tokens x 151,936 x 2,048, bf16, with a chunk-size sweep
     (peak via torch.cuda.max_memory_allocated, time, TFLOP/s). Targets: >= 20x less head memory than
     naive, time <= naive.

Run from the repository root:  python benchmarks/gpu_check.py [--out DIR] [--skip-tests]
Results also land as JSON under --out (default: $OUT if set, else ./gpu_check_out). Budget: ~4-6 min
of GPU time (most of it process start-up and Triton compilation; the timed steps are ~0.1-0.5 s each).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step(title: str, cmd: list[str], timeout: int, env: dict | None = None) -> bool:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, env=env)
        ok = proc.returncode == 0
        print(f"=== {title}: {'OK' if ok else f'FAILED (rc={proc.returncode})'} in {time.time() - t0:.0f} s")
    except subprocess.TimeoutExpired:
        ok = False
        print(f"=== {title}: TIMED OUT after {timeout} s")
    sys.stdout.flush()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="skip the chunk-size sweep at the GPU shape")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter
    env["PYTHONUNBUFFERED"] = "1"

    env_probe = (
        "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, "
        "'triton', triton.__version__); assert torch.cuda.is_available(), 'no CUDA device'; "
        "free, total = torch.cuda.mem_get_info(); "
        "print(torch.cuda.get_device_name(), f'{free / 2**30:.1f} / {total / 2**30:.1f} GiB free')"
    )
    results = {"env": _step("environment", [py, "-c", env_probe], 120, env)}
    if not results["env"]:
        print("no usable CUDA device: nothing else to check")
        return 1
    if not args.skip_tests:
        results["tests"] = _step(
            "kernel tests (real Triton)",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_fused_logprob.py"],
            300,
            env,
        )
    bench = os.path.join(ROOT, "benchmarks", "bench_fused_logprob.py")
    results["bench_smollm2"] = _step(
        "benchmark 8,192 x 49,152 x 576 bf16",
        [py, bench, "--device", "cuda", "--tokens", "8192", "--vocab", "49152", "--hidden", "576",
         "--json", os.path.join(args.out, "bench_smollm2.json")],
        300,
        env,
    )  # fmt: skip
    gpu_cmd = [py, bench, "--device", "cuda", "--tokens", "32768", "--vocab", "151936", "--hidden", "2048",
               "--json", os.path.join(args.out, "bench_gpu_shape.json")]  # fmt: skip
    if not args.no_sweep:
        gpu_cmd.append("--sweep")
    results["bench_gpu_shape"] = _step("benchmark 32,768 x 151,936 x 2,048 bf16", gpu_cmd, 420, env)
    print("\n=== summary: " + ", ".join(f"{k} {'OK' if v else 'FAILED'}" for k, v in results.items()))
    print(f"JSON figures under {args.out}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
