"""Sandbox overhead: runs/s of a trivial passing ``python_tests`` task vs a bare ``subprocess.run``.

Peer (measured in the same run): ``subprocess.run([python, "-c", ...])``, the cheapest way to run
untrusted Python at all. Where the time goes is measured by layering the steps one at a time:

  bare python -c            interpreter start with site-packages (the named peer)
  bare python -I -S -c      interpreter start without site-packages (what the sandbox starts)
  + unshare namespaces      pid/mount/net namespaces around that interpreter
  run_python_tests          everything: supervisor files, harness (ctypes, mounts, fork, uid drop,
                            rlimits, audit hook), the candidate import and the tests, result parsing

Usage: .venv/bin/python benchmarks/bench_sandbox.py [--quick] [--n N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flywheel.config import SandboxConfig  # noqa: E402
from flywheel.sandbox import isolation_mode, run_python_tests  # noqa: E402

CANDIDATE = "def add(a, b):\n    return a + b\n"
TESTS = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
SNIPPET = "def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n"


def timed(fn, n: int) -> list[float]:
    fn()  # warm the page cache
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 runs per row instead of 100")
    ap.add_argument("--n", type=int, default=None)
    args = ap.parse_args()
    n = args.n or (20 if args.quick else 100)
    py = sys.executable
    cfg = SandboxConfig()
    iso = isolation_mode()

    def bare():
        subprocess.run([py, "-c", SNIPPET], check=True, stdin=subprocess.DEVNULL)

    def bare_is():
        subprocess.run([py, "-I", "-S", "-c", SNIPPET], check=True, stdin=subprocess.DEVNULL)

    unshare = shutil.which("unshare")

    def ns():
        subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "--net", py, "-I", "-S", "-c", SNIPPET],
                       check=True, stdin=subprocess.DEVNULL)

    def sandbox():
        r = run_python_tests(CANDIDATE, TESTS, cfg)
        if not r.passed:
            raise SystemExit(f"sandbox run did not pass: {r}")

    rows = [("bare python -c (peer)", bare), ("bare python -I -S -c", bare_is)]
    if iso == "netns" and unshare:
        rows.append(("+ unshare pid/mount/net", ns))
    rows.append(("run_python_tests (full sandbox)", sandbox))
    print(f"isolation: {iso}; {n} runs per row; python {sys.version.split()[0]}")
    print(f"{'step':34s} {'median ms':>10s} {'p90 ms':>8s} {'runs/s':>8s}")
    med = {}
    for name, fn in rows:
        ts = sorted(timed(fn, n))
        m = statistics.median(ts)
        med[name] = m
        print(f"{name:34s} {m * 1e3:10.1f} {ts[int(0.9 * (len(ts) - 1))] * 1e3:8.1f} {1 / m:8.1f}")
    full, peer = med["run_python_tests (full sandbox)"], med["bare python -c (peer)"]
    print(f"\nratio full sandbox / bare subprocess.run: {full / peer:.2f}x "
          f"({1 / full:.1f} vs {1 / peer:.1f} runs/s on one core)")
    base = med["bare python -I -S -c"]
    ns_cost = med.get("+ unshare pid/mount/net", base) - base
    print("where the time goes (medians):")
    print(f"  interpreter start (-I -S)        {base * 1e3:7.1f} ms")
    print(f"  namespaces (unshare)             {ns_cost * 1e3:7.1f} ms")
    print(f"  harness + supervisor + tests     {(full - base - ns_cost) * 1e3:7.1f} ms")
    print(f"  site-packages would add          {(peer - base) * 1e3:7.1f} ms (bare -c minus -I -S)")


if __name__ == "__main__":
    main()
