"""Run untrusted model output (Python solutions, shell scripts) and grade it without trusting it.

Used by the ``python_tests`` and ``shell`` verifiers. One call = one sandbox = one fresh set of
namespaces; nothing is shared between runs.

How a run works
---------------
The supervisor (this module, in the verifier's process) writes the candidate, the tests or grader and a
random nonce into a fresh root-only (0700) directory, opens two result files and starts the trusted
harness ``flywheel/verifiers/_sandbox_harness.py`` as pid 1 of new pid, mount and network namespaces
(``unshare --pid --fork --mount-proc --net``). The harness, still root:

1. reads the setup, then mounts size-limited tmpfs over ``/tmp`` (hiding the setup directory),
   ``/var/tmp``, ``/dev/shm`` and ``/run/lock``, and writes the candidate into ``/tmp/work``;
2. forks a worker that drops to a random unprivileged uid (so ``RLIMIT_NPROC`` really bounds it and the
   host filesystem is read-only to it), sets ``no_new_privs`` and rlimits (CPU, address space,
   processes, file size, open files, no core files), scrubs the environment, closes stdin;
3. python: the worker imports ``solution`` and runs every test the *supervisor* found in the test source
   (``test_*`` functions, ``Test*.test_*`` methods, parsed with ``ast`` here, outside the sandbox);
   each result is a line ``<nonce> PASS|FAIL <index>`` on the test channel.
   shell: the worker execs ``bash candidate.sh``; when it ends, init kills every process left in the
   namespace, then runs the grader (kept in init's memory, never in the writable tree) in a new worker;
   the grader's exit status, observed by init, is the single test.
4. init reports READY / the worker's exit status / END on the init channel, which the worker closes
   before any candidate code runs. Init exiting tears the pid namespace down: the kernel SIGKILLs every
   process still in it, including daemonised ones.

A run **passes only on positive evidence**: every expected test has exactly one PASS record carrying
the nonce, the worker wrote its DONE record, and no record carries a wrong nonce or a duplicate.
Exit status 0, output on stdout, files in the work dir mean nothing. A run whose init never reached
READY (unshare missing, python missing, mount refused) is an **infrastructure error**
(``infra_error`` set), never a candidate failure; anything after READY is the candidate's.

Covered (one adversarial test each in ``tests/adversarial/test_sandbox.py``)
---------------------------------------------------------------------------
- ``sys.exit(0)`` / ``os._exit(0)`` / ``raise SystemExit`` at import or inside a test;
- monkeypatching the runner (``os.write``, ``builtins``, the harness module), printing fake results,
  writing fake records without the nonce, forking to report twice;
- deleting/rewriting test files (they are not in the writable tree; the test code was read by root
  before the candidate started) and reading them (root-only directory, hidden under a tmpfs);
- fork bombs (``RLIMIT_NPROC`` per throwaway uid), memory bombs (``RLIMIT_AS``), infinite loops
  (``RLIMIT_CPU`` + wall clock, whole namespace killed), huge files (``RLIMIT_FSIZE`` per file, tmpfs
  size in total), network (empty network namespace: not even loopback is up), background processes
  (pid namespace);
- in-process introspection to read the nonce or rewrite harness frames: an audit hook refuses
  ``sys._getframe``, ``tb_frame``/``gi_frame`` access, ``gc`` object walks, ``sys.settrace``,
  ``ctypes`` and opening ``/proc/*/mem``.

Not covered (know these before trusting a reward)
-------------------------------------------------
- Semantic gaming of weak tests: an object whose ``__eq__`` always returns True passes
  ``assert f(x) == y``. Tests should check types (``assert type(r) is int and r == 3``).
- A determined in-process attacker that finds an introspection path the audit hook does not cover
  can forge PASS records: the tests run in the same interpreter as the candidate. Treat rewards as
  "hard to game by accident or by common RL hacks", not as a security boundary against a targeted exploit.
- Kernel exploits; side channels; reading world-readable host files (the host filesystem is visible
  read-only to the sandbox uid: the source tree, ``/etc``). Do not keep secrets world-readable.
- Weak mode (no root or no ``unshare``): no namespaces, no uid drop, no tmpfs. Processes that
  ``setsid()`` can escape the process-group kill, the network is reachable, the work dir is on disk.
  ``SandboxResult.isolation`` says ``"weak: <why>"`` so the verdict records it.
- CPU time is limited per process; the wall clock bounds the total.

Throughput: the Python path starts ``python -I -S`` (no site-packages: ~10 ms instead of ~30 ms on the
development machine); pass ``site_packages=True`` when solutions may import installed packages.
Namespace creation costs ~1 ms. See ``benchmarks/bench_sandbox.py`` for measured figures; a warm fork
server would save the interpreter start only, at the cost of shared state between runs.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.config import SandboxConfig

__all__ = ["SandboxResult", "run_python_tests", "run_shell", "discover_tests", "isolation_mode"]

# Interpreter of the sandbox (harness and candidate) when a call passes none; a module attribute so a
# deployment can point it at a dedicated interpreter.
PYTHON = sys.executable
_HARNESS = Path(__file__).resolve().parent / "verifiers" / "_sandbox_harness.py"
_OUTPUT_LIMIT = 8192  # bytes of stdout/stderr kept in the result (the rest is discarded)
_RECORD_LIMIT = 4 * 1024 * 1024  # bytes of result records read back (one line per test)
# Throwaway uids: a random one per run so concurrent sandboxes do not share an RLIMIT_NPROC budget.
_UID_BASE, _UID_SPAN = 200_000, 100_000
# Headroom between the harness's own per-phase deadline and the supervisor's hard kill.
_GRACE_S = 1.0


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ``passed`` is True only when every expected test produced a PASS record with the nonce (see the
    module docstring). ``infra_error`` is set when the sandbox itself could not start; then
    ``passed`` is False and the result says nothing about the candidate.
    """

    passed: bool
    tests_total: int
    tests_passed: int
    per_test: dict[str, str]
    stdout: str
    stderr: str
    duration_s: float
    isolation: str
    infra_error: str | None = None
    killed_reason: str | None = None
    details: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """``"netns"`` when pid/mount/network namespaces and a uid drop are available, else ``"weak: <why>"``.

    Probed once per process by running ``unshare`` on ``true``.
    """
    if os.name != "posix" or not hasattr(os, "fork"):
        return "weak: not a POSIX system"
    if os.geteuid() != 0:
        return "weak: not running as root (no namespaces, no uid drop)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "weak: unshare(1) not found"
    try:
        r = subprocess.run(
            [unshare, "--pid", "--fork", "--mount-proc", "--net", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"weak: unshare probe failed ({e})"
    if r.returncode != 0:
        return f"weak: unshare refused ({r.stderr.decode(errors='replace').strip()[:200]})"
    return "netns"


def discover_tests(tests: str) -> list[str]:
    """Names of the tests in ``tests`` (pytest-style): top-level ``test*`` functions and ``test*``
    methods of top-level ``Test*`` classes (``unittest.TestCase`` subclasses included), in source order.

    Raises ``ValueError`` when the source does not parse or holds no test: that is a broken task,
    not a candidate failure.
    """
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise ValueError(f"test source does not parse: {e}") from None
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            if isinstance(node, ast.AsyncFunctionDef):
                raise ValueError(f"async test {node.name!r} is not supported")
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    names.append(f"{node.name}.{item.name}")
    if not names:
        raise ValueError("test source defines no test (expected def test_*() or class Test*: def test_*)")
    if len(set(names)) != len(names):
        raise ValueError("test source defines the same test name twice")
    return names


def run_python_tests(
    candidate_code: str,
    tests: str,
    cfg: SandboxConfig | None = None,
    *,
    python: str | None = None,
    site_packages: bool = False,
) -> SandboxResult:
    """Run ``tests`` (Python source that imports the candidate as module ``solution``) against
    ``candidate_code`` in a fresh sandbox. ``python`` defaults to this interpreter."""
    names = discover_tests(tests)
    return _run(
        mode="python",
        candidate=candidate_code,
        trusted={"tests": tests},
        names=names,
        cfg=cfg or SandboxConfig(),
        python=python,
        site_packages=site_packages,
    )


def run_shell(
    candidate_script: str, grader: str, cfg: SandboxConfig | None = None, *, python: str | None = None
) -> SandboxResult:
    """Run ``candidate_script`` with bash in a fresh sandbox, then ``grader`` (a bash script, trusted)
    in the same work directory once every candidate process is dead. Passes when the grader exits 0."""
    if not grader.strip():
        raise ValueError("shell grader is empty")
    return _run(
        mode="shell",
        candidate=candidate_script,
        trusted={"grader": grader},
        names=["grader"],
        cfg=cfg or SandboxConfig(),
        python=python,
        site_packages=False,
    )


def _interpreter_dirs(python: str | None) -> list[str]:
    """Directories the sandboxed interpreter must be able to read (its prefix and, for a virtualenv,
    the venv), so they can be exposed to the throwaway uid even under a private parent like /root."""
    exe = os.path.realpath(python or PYTHON)
    dirs = {os.path.dirname(os.path.dirname(exe))}
    if exe == os.path.realpath(sys.executable):
        dirs |= {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    # Nested entries would be exposed twice; keep the outermost of each chain.
    out = sorted(d for d in dirs if d and d != "/")
    return [d for d in out if not any(d != o and d.startswith(o + "/") for o in out)]


def _world_traversable(path: str) -> bool:
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        try:
            if not os.stat(Path(*parts[:i])).st_mode & 0o005:
                return False
        except OSError:
            return False
    return True


def _limits(cfg: SandboxConfig) -> dict[str, int]:
    return {
        "cpu": int(cfg.cpu_seconds),
        "as": int(cfg.memory_mb) * 1024 * 1024,
        "nproc": int(cfg.max_processes),
        "fsize": int(cfg.max_file_mb) * 1024 * 1024,
        "nofile": int(cfg.max_open_files),
        "core": 0,
    }


def _read_head(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return ""
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += "\n[... truncated]"
    return text


def _run(
    *,
    mode: str,
    candidate: str,
    trusted: dict[str, str],
    names: list[str],
    cfg: SandboxConfig,
    python: str | None,
    site_packages: bool,
) -> SandboxResult:
    t0 = time.perf_counter()
    iso = isolation_mode()
    strong = iso == "netns"
    nonce = secrets.token_hex(16)
    root = Path(tempfile.mkdtemp(prefix="flywheel-sbx-"))  # 0700, owned by us
    fallback_work = None if strong else Path(tempfile.mkdtemp(prefix="flywheel-sbx-work-"))
    phases = 1 if mode == "python" else 2
    phase_seconds = float(cfg.wall_seconds) / phases
    setup = {
        "nonce": nonce,
        "mode": mode,
        "tests": names,
        "limits": _limits(cfg),
        "mount_tmpfs": strong,
        # Total scratch space: four maximal files' worth, at least 64 MiB.
        "tmpfs_mb": max(64, 4 * int(cfg.max_file_mb)),
        "drop_to_uid": (_UID_BASE + secrets.randbelow(_UID_SPAN)) if os.geteuid() == 0 else None,
        "pid_namespace": strong,
        "fallback_workdir": str(fallback_work) if fallback_work else "",
        "expose": _interpreter_dirs(python),
        "phase_seconds": phase_seconds,
    }
    details: dict = {"nonce_records": 0}
    if not strong and setup["drop_to_uid"] is not None and mode == "python":
        # Without a mount namespace the private parent cannot be covered (see _expose in the harness):
        # the sandbox uid could not import the stdlib, and every candidate would fail for our reasons.
        hidden = [d for d in setup["expose"] if not _world_traversable(d)]
        if hidden:
            shutil.rmtree(root, ignore_errors=True)
            if fallback_work is not None:
                _rmtree_any_owner(fallback_work)
            return _infra(
                f"weak sandbox mode: interpreter dir {hidden[0]} is not readable by an unprivileged uid; "
                "point flywheel.sandbox.PYTHON at a world-readable interpreter",
                iso,
                t0,
            )
    try:
        (root / "setup.json").write_text(json.dumps(setup))
        (root / "candidate").write_text(candidate)
        for name, text in trusted.items():
            (root / name).write_text(text)
        for p in root.iterdir():
            os.chmod(p, 0o600)
        init_path, tests_path = root / "init.rec", root / "tests.rec"
        out_path, err_path = root / "stdout", root / "stderr"
        with (
            open(init_path, "wb") as init_f,
            open(tests_path, "wb") as tests_f,
            open(out_path, "wb") as out_f,
            open(err_path, "wb") as err_f,
        ):
            exe = python or PYTHON
            flags = ["-I"] if site_packages else ["-I", "-S"]
            argv = [exe, *flags, str(_HARNESS), str(root), str(init_f.fileno()), str(tests_f.fileno())]
            if strong:
                argv = [shutil.which("unshare") or "unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
                if cfg.network == "none":
                    argv.append("--net")
                argv += [exe, *flags, str(_HARNESS), str(root), str(init_f.fileno()), str(tests_f.fileno())]
            killed_reason = None
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    pass_fds=(init_f.fileno(), tests_f.fileno()),
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                    cwd=str(root),
                    start_new_session=True,  # its own process group, killed as a whole below
                    close_fds=True,
                )
            except OSError as e:
                return _infra(f"sandbox could not start: {e}", iso, t0)
            try:
                proc.wait(timeout=float(cfg.wall_seconds) + _GRACE_S * phases)
            except subprocess.TimeoutExpired:
                killed_reason = "wall_timeout"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        init_recs = _records(init_path, nonce)
        test_recs_raw = tests_path.read_bytes()[:_RECORD_LIMIT].decode("utf-8", errors="replace")
        stdout = _read_head(out_path, _OUTPUT_LIMIT)
        stderr = _read_head(err_path, _OUTPUT_LIMIT)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if fallback_work is not None:
            _rmtree_any_owner(fallback_work)

    duration = time.perf_counter() - t0
    if not any(r[0] == "READY" for r in init_recs):
        setup_err = next((" ".join(r[1:]) for r in init_recs if r[0] == "SETUP_ERROR"), None)
        why = setup_err or (stderr.strip().splitlines() or ["no output"])[-1]
        return _infra(f"sandbox did not start: {why}", iso, t0, stdout=stdout, stderr=stderr)

    # The worker's fate as observed by trusted init: exit status, signal, or init's own deadline.
    statuses = {r[0]: r[1:] for r in init_recs if r[0] in ("WORKER", "CANDIDATE", "GRADER")}
    for tag, st in statuses.items():
        details[f"{tag.lower()}_status"] = " ".join(st)
        if st and st[0] == "TIMEOUT" and killed_reason is None:
            killed_reason = "wall_timeout"
        elif st and st[0] == "SIGNAL" and killed_reason is None:
            killed_reason = _signal_reason(int(st[1]))

    per_test: dict[str, str] = {n: "missing: no result recorded" for n in names}
    passed_names: set[str] = set()
    tampered: list[str] = []
    done = False
    if mode == "python":
        seen: set[int] = set()
        for line in test_recs_raw.splitlines():
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[0] != nonce:
                if line.strip():
                    tampered.append("record without the nonce")
                continue
            status, idx_s = parts[1], parts[2]
            if status == "DONE":
                done = True
                continue
            try:
                idx = int(idx_s)
                name = names[idx]
            except (ValueError, IndexError):
                tampered.append(f"record for unknown test index {idx_s!r}")
                continue
            if idx in seen:
                tampered.append(f"duplicate record for {name}")
                continue
            seen.add(idx)
            if status == "PASS":
                per_test[name] = "passed"
                passed_names.add(name)
            else:
                per_test[name] = "failed: " + (parts[3] if len(parts) > 3 else status)
        if not done:
            tampered.append("the harness did not finish (no DONE record)")
    else:
        grader = statuses.get("GRADER")
        if grader == ["EXIT", "0"]:
            per_test["grader"] = "passed"
            passed_names.add("grader")
            done = True
        elif grader:
            per_test["grader"] = "failed: grader " + " ".join(grader).lower()
        details["candidate_status"] = " ".join(statuses.get("CANDIDATE", ["unknown"]))

    details["nonce_records"] = len(init_recs)
    if tampered:
        details["integrity"] = tampered[:10]
    ok = not tampered and done and len(passed_names) == len(names) and killed_reason != "wall_timeout"
    return SandboxResult(
        passed=ok,
        tests_total=len(names),
        tests_passed=0 if tampered else len(passed_names),
        per_test=per_test,
        stdout=stdout,
        stderr=stderr,
        duration_s=duration,
        isolation=iso,
        infra_error=None,
        killed_reason=killed_reason,
        details=details,
    )


def _records(path: Path, nonce: str) -> list[list[str]]:
    out = []
    for line in path.read_bytes()[:_RECORD_LIMIT].decode("utf-8", errors="replace").splitlines():
        parts = line.split(" ")
        if len(parts) >= 2 and parts[0] == nonce:
            out.append(parts[1:])
    return out


def _signal_reason(sig: int) -> str:
    names = {
        int(signal.SIGXCPU): "cpu_time_limit",
        int(signal.SIGXFSZ): "file_size_limit",
        int(signal.SIGKILL): "killed (cpu hard limit, memory, or timeout)",
        int(signal.SIGSEGV): "segfault (often the address-space limit)",
    }
    try:
        default = f"signal {signal.Signals(sig).name}"
    except ValueError:
        default = f"signal {sig}"
    return names.get(sig, default)


def _infra(msg: str, iso: str, t0: float, *, stdout: str = "", stderr: str = "") -> SandboxResult:
    return SandboxResult(
        passed=False,
        tests_total=0,
        tests_passed=0,
        per_test={},
        stdout=stdout,
        stderr=stderr,
        duration_s=time.perf_counter() - t0,
        isolation=iso,
        infra_error=msg,
        killed_reason=None,
    )


def _rmtree_any_owner(path: Path) -> None:
    """Remove a weak-mode work dir even when the candidate made parts of it read-only."""

    def onerror(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
