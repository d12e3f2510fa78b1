"""Sandbox cost: runs/s of a trivial passing task through the redesigned sandbox, side by side with the
pre-redesign sandbox and with bare ``subprocess.run``, measured in the same run, round-robin.

Peers (all in this run, interleaved so that load on a shared machine hits every row alike):

  bare python -c              ``subprocess.run([python, "-c", ...])``: the floor, the cheapest way to
                              run untrusted Python at all (with site-packages)
  bare python -I -S -c        interpreter start without site-packages (what the sandbox starts)
  + unshare pid/mount/net     namespaces around that interpreter
  pre-redesign  python_tests  the sandbox as of commit PRE_REDESIGN (its sandbox.py and harness, taken
                              from git into a temp dir; a nonce in the worker, no cgroup)
  redesign io                 ``run_python_tests`` on input -> expected-output tests: judged here
  redesign in_process         the same tests forced beside the candidate (hardened worker)
  pre-redesign / redesign shell  ``run_shell`` (the redesign adds the grader's clean environment)

Per-stage cost of the redesign comes from each run's own ``details["timings_ms"]`` (monotonic clock
stamps written by the supervisor and by init inside the namespaces): prepare (setup, cgroup),
interpreter + namespaces (spawn -> harness main), setup in the sandbox (cgroup join, mounts, work
dir), run (worker/grader), teardown (END -> supervisor sees the exit: namespace teardown). The
pre-redesign stages are derived by layering: interpreter, namespaces, everything else.

Target of the redesign: at most 1.5x the pre-redesign per-run time.

Measured on the development machine (2 cores shared with other jobs, load average ~10, 60 runs per
row): pre-redesign 230 ms per python_tests run, redesign io 151 ms (0.66x), in_process 137 ms
(0.60x), shell 234 vs 246 ms (0.95x); bare ``python -c`` 142 ms. The redesign is cheaper mostly
because the supervisor waits on a pidfd (``Popen.wait(timeout)`` polls with sleeps of up to 50 ms)
and the harness no longer imports ``json`` (6 ms of ``re``) or compiles itself as a script.

Usage: .venv/bin/python benchmarks/bench_sandbox.py [--quick] [--n N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.config import SandboxConfig  # noqa: E402
from flywheel.sandbox import cgroup_support, isolation_mode, run_python_tests, run_shell  # noqa: E402

# The last commit before the redesign (its sandbox.py + _sandbox_harness.py are the named peer).
PRE_REDESIGN = "63024454fe6a56d8866cef49cedb2fdac11d4614"

CANDIDATE = "def add(a, b):\n    return a + b\n"
TESTS = "from solution import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
SNIPPET = "def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n"
SHELL, GRADER_OLD, GRADER_NEW = "echo 42 > answer.txt", 'test "$(cat answer.txt)" = 42', 'test "$(cat "$WORK/answer.txt")" = 42'


def load_pre_redesign(tmp: Path):
    """The pre-redesign sandbox module, its harness written next to it; None when git lacks the commit."""
    files = {}
    for path in ("flywheel/sandbox.py", "flywheel/verifiers/_sandbox_harness.py"):
        r = subprocess.run(["git", "-C", str(ROOT), "show", f"{PRE_REDESIGN}:{path}"], capture_output=True, text=True)
        if r.returncode != 0:
            return None
        files[path] = r.stdout
    (tmp / "old_sandbox.py").write_text(files["flywheel/sandbox.py"])
    harness = tmp / "old_harness.py"
    harness.write_text(files["flywheel/verifiers/_sandbox_harness.py"])
    os.chmod(tmp, 0o755)  # the old weak path reads the harness as its throwaway uid
    spec = importlib.util.spec_from_file_location("flywheel_sandbox_pre_redesign", tmp / "old_sandbox.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod._HARNESS = harness
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="15 runs per row instead of 60")
    ap.add_argument("--n", type=int, default=None)
    args = ap.parse_args()
    n = args.n or (15 if args.quick else 60)
    py = sys.executable
    cfg = SandboxConfig()
    iso = isolation_mode()
    load0 = os.getloadavg()
    unshare = shutil.which("unshare")
    tmp = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    old = load_pre_redesign(tmp)
    stages: dict[str, dict[str, list[float]]] = {}

    def bare():
        subprocess.run([py, "-c", SNIPPET], check=True, stdin=subprocess.DEVNULL)

    def bare_is():
        subprocess.run([py, "-I", "-S", "-c", SNIPPET], check=True, stdin=subprocess.DEVNULL)

    def ns():
        subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "--net", py, "-I", "-S", "-c", SNIPPET],
                       check=True, stdin=subprocess.DEVNULL)

    def checked(name, fn):
        def run():
            r = fn()
            if not r.passed:
                raise SystemExit(f"{name}: the run did not pass: {r}")
            for k, v in (getattr(r, "details", {}).get("timings_ms") or {}).items():
                stages.setdefault(name, {}).setdefault(k, []).append(v)
        return run

    rows = [("bare python -c (floor)", bare), ("bare python -I -S -c", bare_is)]
    if iso == "netns" and unshare:
        rows.append(("+ unshare pid/mount/net", ns))
    if old is not None:
        rows.append(("pre-redesign python_tests", checked("pre", lambda: old.run_python_tests(CANDIDATE, TESTS, cfg))))
    rows += [
        ("redesign io", checked("io", lambda: run_python_tests(CANDIDATE, TESTS, cfg))),
        ("redesign in_process", checked("in_process", lambda: run_python_tests(CANDIDATE, TESTS, cfg, grading="in_process"))),
    ]
    if old is not None:
        rows.append(("pre-redesign shell", checked("pre_shell", lambda: old.run_shell(SHELL, GRADER_OLD, cfg))))
    rows.append(("redesign shell", checked("shell", lambda: run_shell(SHELL, GRADER_NEW, cfg))))

    print(f"isolation: {iso}; cgroup: {cgroup_support()}")
    print(f"{n} runs per row, round-robin; python {sys.version.split()[0]}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    if old is None:
        print(f"pre-redesign peer unavailable: git has no commit {PRE_REDESIGN[:12]} here")
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _, fn in rows:
        fn()  # warm the page cache and the harness's bytecode cache
    stages.clear()
    for _ in range(n):
        for name, fn in rows:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'row':30s} {'median ms':>10s} {'p90 ms':>8s} {'runs/s':>8s} {'x floor':>8s}")
    floor = med["bare python -c (floor)"]
    for name, v in times.items():
        s = sorted(v)
        print(f"{name:30s} {med[name] * 1e3:10.1f} {s[int(0.9 * (len(s) - 1))] * 1e3:8.1f} {1 / med[name]:8.1f} "
              f"{med[name] / floor:8.2f}")

    if "pre-redesign python_tests" in med:
        pre = med["pre-redesign python_tests"]
        print("\nredesign / pre-redesign per-run time (target <= 1.50x):")
        for name in ("redesign io", "redesign in_process"):
            print(f"  {name:28s} {med[name] / pre:5.2f}x")
        if "pre-redesign shell" in med:
            print(f"  {'redesign shell':28s} {med['redesign shell'] / med['pre-redesign shell']:5.2f}x (vs pre-redesign shell)")

    base = med["bare python -I -S -c"]
    ns_cost = med.get("+ unshare pid/mount/net", base) - base
    print("\nwhere the time goes (medians, ms)")
    if "pre-redesign python_tests" in med:
        pre = med["pre-redesign python_tests"]
        print(f"  pre-redesign: interpreter {base * 1e3:.1f}, namespaces {ns_cost * 1e3:.1f}, "
              f"harness + supervisor + tests {(pre - base - ns_cost) * 1e3:.1f}")
    order = ["prepare", "interpreter_and_namespaces", "setup_in_sandbox", "run", "teardown", "total"]
    print(f"  {'redesign stage':28s}" + "".join(f"{k:>14s}" for k in ("io", "in_process", "shell")))
    for st in order:
        vals = [statistics.median(stages[k][st]) if st in stages.get(k, {}) else float("nan")
                for k in ("io", "in_process", "shell")]
        print(f"  {st:28s}" + "".join(f"{v:14.1f}" for v in vals))
    load1 = os.getloadavg()
    print(f"\nload average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (2 cores: above ~2 the figures are stretched)")


if __name__ == "__main__":
    main()
