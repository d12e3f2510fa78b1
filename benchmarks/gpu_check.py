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
Results also land as JSON under --out (default: $OUT if set, else ./gpu_check_out). Budget: the step
limits add up to 570 s so the whole script fits one 600 s device command; expected ~6 min (mostly
process start-up, input generation and Triton compilation; each timed step is ~0.1-0.5 s). On a rerun
pass --skip-tests --no-sweep to cut it to ~2 min.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# `kernels/` is installed as `flywheel.kernels` by pyproject's package-dir mapping. A bare checkout on a
# lent machine may not be pip-installed (and has no network to install into), so when the import fails
# the subprocesses get a sitecustomize that maps the name onto ROOT/kernels, the same mapping.
_SHIM = """
import importlib.abc, importlib.util, os, sys
_ROOT = {root!r}


class _FlywheelKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "flywheel.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(_ROOT, "kernels", "__init__.py"),
            submodule_search_locations=[os.path.join(_ROOT, "kernels")],
        )


sys.meta_path.insert(0, _FlywheelKernelsFinder())
"""


def _import_env(py: str, env: dict, shim_dir: str) -> dict:
    probe = "import flywheel.kernels.fused_logprob"
    if subprocess.run([py, "-c", probe], cwd=ROOT, env=env, capture_output=True).returncode == 0:
        return env
    os.makedirs(shim_dir, exist_ok=True)
    with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as f:
        f.write(_SHIM.format(root=ROOT))
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([shim_dir, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    ok = subprocess.run([py, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    print(f"flywheel.kernels not installed: mapped onto {ROOT}/kernels via {shim_dir}/sitecustomize.py "
          f"({'OK' if ok.returncode == 0 else 'STILL FAILING: ' + ok.stderr[-500:]})")  # fmt: skip
    return env


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
    results = {"env": _step("environment", [py, "-c", env_probe], 60, env)}
    env = _import_env(py, env, os.path.join(args.out, "_shim"))
    if not results["env"]:
        print("no usable CUDA device: nothing else to check")
        return 1
    if not args.skip_tests:
        results["tests"] = _step(
            "kernel tests (real Triton)",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_fused_logprob.py"],
            150,
            env,
        )
    bench = os.path.join(ROOT, "benchmarks", "bench_fused_logprob.py")
    results["bench_smollm2"] = _step(
        "benchmark 8,192 x 49,152 x 576 bf16",
        [py, bench, "--device", "cuda", "--tokens", "8192", "--vocab", "49152", "--hidden", "576",
         "--json", os.path.join(args.out, "bench_smollm2.json")],
        120,
        env,
    )  # fmt: skip
    gpu_cmd = [py, bench, "--device", "cuda", "--tokens", "32768", "--vocab", "151936", "--hidden", "2048",
               "--json", os.path.join(args.out, "bench_gpu_shape.json")]  # fmt: skip
    if not args.no_sweep:
        gpu_cmd.append("--sweep")
    results["bench_gpu_shape"] = _step("benchmark 32,768 x 151,936 x 2,048 bf16", gpu_cmd, 240, env)
    print("\n=== summary: " + ", ".join(f"{k} {'OK' if v else 'FAILED'}" for k, v in results.items()))
    print(f"JSON figures under {args.out}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
