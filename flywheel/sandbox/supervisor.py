"""Run untrusted model output (Python solutions, shell scripts) and grade it without trusting it.

Used by the ``python_tests`` and ``shell`` verifiers. One call = one sandbox = one fresh set of
namespaces (and cgroup); nothing is shared between runs.

How a run works
---------------
The supervisor (this module, in the verifier's process) starts the trusted harness
``flywheel/verifiers/_sandbox_harness.py`` as pid 1 of new pid, mount and network namespaces
(``unshare --pid --fork --mount-proc --ipc --net``) and sends it the setup -- candidate, tests or grader,
per-run secrets -- on its stdin: nothing is written to a file or put on a command line. Results come
back on two unlinked temporary files (the init channel and the result channel) whose descriptors
the harness inherits. The harness, still root:

1. joins the run's cgroup (``memory.max`` = ``sandbox.memory_mb`` for all its processes together,
   ``pids.max``), mounts size-limited tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``
   and a tmpfs of its own at ``/tmp/work``, where it writes the candidate;
2. forks a worker that drops to a random unprivileged uid, sets ``no_new_privs``, becomes
   non-dumpable (its ``/proc/self/mem`` and ``/proc/self/fd`` are root's), sets rlimits (CPU, address
   space, processes, file size, open files, no core files), scrubs the environment, closes stdin;
3. grades the candidate along one of three paths, named in ``SandboxResult.report["grading"]``:

   - ``io`` -- python tests that are input -> expected-output checks (:mod:`flywheel.io_grading`; the
     common shape of compiled evals). The worker imports ``solution`` and makes each call once; its
     serialised results come back and **this process** decodes them and applies the checks. The
     candidate's process never holds an expected value, a test name, a nonce or anything else that
     decides the verdict, so the worst it can do is answer.
   - ``proxy`` -- any other python tests (loops, helpers, classes). Two workers, two throwaway
     uids: the candidate's process imports ``solution`` and answers requests over a pipe pair; the
     test runner, a process of its own that never runs candidate code, executes the tests against a
     proxy module ``solution``. What crosses is plain data of exact built-in types or an opaque
     handle (attributes, calls, indexing, ``len``, iteration and ``repr`` forwarded; ``==``,
     ``hash``, ``type`` the runner's own), so an object whose ``__eq__`` is always True or a walk of
     ``object.__subclasses__()`` in the candidate's process cannot reach a test (issue 31, finding
     2; this path was ``in_process``, a name still accepted). The tests, their names and tokens
     reach init only after the candidate's process was forked, so they were never in its memory;
     only the runner holds the result channel, and a ``PASS`` carries that test's token.
   - ``grader`` -- shell: the candidate script runs; when it ends every candidate process is killed;
     then the grader (kept in init's memory, never in the writable tree) runs as a *second*
     throwaway uid, from an empty cwd, with a fresh ``/tmp``, the work dir read-only at ``$WORK``
     (no exec, no set-uid, symlinks not followed), a fixed ``PATH`` whose ``python``/``python3`` run
     ``-I``. Its exit status, observed by init, is the single test.
4. init reports START / READY / the worker's exit status / END on the init channel (closed in the
   worker before any candidate code runs). Init exiting tears the pid namespace down: the kernel
   SIGKILLs every process still in it. The supervisor then kills and removes the cgroup.

A run **passes only on positive evidence**: every expected test passed (io: the supervisor's own
checks; proxy: one ``PASS`` per test with its token and a ``DONE`` with the run's token;
grader: init saw exit 0), and nothing on the result channel was malformed, duplicated or forged (one
such record fails every test). Exit status 0, output on stdout, files in the work dir mean nothing.
A run whose init never reached READY (unshare missing, python missing, mount refused, cgroup join
refused) is an **infrastructure error** (``infra_error`` set), never a candidate failure.

Isolation, and what happens without it
--------------------------------------
``isolation_mode()`` is ``"netns"`` when this process is root and ``unshare`` works, else ``"weak:
<why>"``. Weak mode (no namespaces, no tmpfs; no uid drop unless root) lets the candidate read the
verifier's files, reach the network and, running as the verifier's own user, tamper with the verifier
process itself: its verdicts are forgeable. Therefore, without namespaces a ``python_tests``/``shell``
run is an ``infra_error`` -- never reward 0, never training data -- unless ``sandbox.allow_weak``;
even then the verdict's ``ok_for_training`` is false unless ``sandbox.train_on_weak``.
``flywheel init``/``flywheel status`` print :func:`isolation_report`, and the cycle warns.

Cgroups (``sandbox.cgroup``): the supervisor creates ``flywheel-sbx-*`` under its own cgroup, with
cgroup v2 (``memory.max``, ``memory.swap.max = 0``, ``pids.max``) where the unified hierarchy has the
memory and pids controllers, else with the v1 memory and pids hierarchies. Where neither is writable
the run goes on with rlimits only and ``report["cgroup"]`` says why (``"require"`` makes that an
infrastructure error instead). ``sandbox.cpus`` caps the CPU bandwidth of all the run's processes
together (v2 ``cpu.max``, else a v1 ``cpu`` hierarchy's ``cpu.cfs_quota_us``), so a run uses at most
``cpus x wall_seconds`` of CPU; ``report["cgroup"]`` says when no cpu controller is writable.

Seccomp: candidate processes (the io driver, the proxy's candidate process, the shell candidate;
not the test runner or the grader) run under a filter built from the system's ``libseccomp.so.2``
that refuses ``socket(AF_UNIX)`` -- the network namespace hides host networks but not the host's
Unix sockets whose files are visible -- and ptrace, process_vm_*, mount/namespace calls, keyrings,
BPF, perf, userfaultfd, io_uring, modules, kexec. Without libseccomp the run goes on without it
and ``report["seccomp"]`` says so (issue 31, finding 13).

Covered (one adversarial test each in ``tests/adversarial/``)
-------------------------------------------------------------
All paths:

- ``sys.exit(0)`` / ``os._exit(0)`` / ``raise SystemExit`` at import or inside a test;
- printing fake results (stdout means nothing), writing forged/duplicate records to any descriptor,
  forking so that two processes answer, dup2-ing a pipe over the result channel to read what the
  harness writes (a read-back ``PASS`` reveals only that test's token), ``atexit`` handlers and
  threads that write after the tests (the worker ends with ``os._exit``; a run without ``DONE`` fails);
- reading the tests or expected values: never in the sandbox for ``io``; for ``proxy`` only in the runner and for ``grader``
  only in root-owned memory and channels the worker cannot open (``/proc/*/mem``, ``/proc/self/fd``
  are root's once non-dumpable; the host ``/tmp`` is hidden under a tmpfs);
- fork bombs (``RLIMIT_NPROC`` per throwaway uid and ``pids.max``), memory bombs (``RLIMIT_AS`` per
  process and ``memory.max`` across all the sandbox's processes), infinite loops (``RLIMIT_CPU`` +
  wall clock, whole namespace killed), huge files (``RLIMIT_FSIZE`` per file, tmpfs size and inode
  count in total), network (empty network namespace: not even loopback is up; host Unix sockets:
  seccomp), the CPU of many processes (``cpu.max`` of the run's cgroup), background processes
  (pid namespace and cgroup), SysV/POSIX IPC objects outliving the run (ipc namespace).

``io`` only: an object whose ``__eq__`` always returns True, an ``int`` subclass, anything but plain
data (results are decoded into exact built-in types before any comparison); patching builtins or
modules (the checks run in this process); answering a call twice; results that would make the checks
expensive (no ``%`` formatting of a result string, no arithmetic on integers over 100,000 bits).

``proxy``: everything the candidate's process can do to itself (patch builtins or modules, walk
frames, ``gc`` or ``object.__subclasses__()``, signal handlers, ``ctypes``, threads, ``sys.exit``):
the tests, their builtins and classes live in the runner's process, another uid, non-dumpable;
a result that is not plain data is a handle the tests can only forward operations to; a candidate
that dies or hangs fails the tests still waiting for it.

``grader`` (shell): files planted for the grader (``json.py``/``sitecustomize.py`` for its python, an
rc file, ``bin/test``), symlinks into the grader's own files (``/proc/self/cwd/...``), files planted
in ``/tmp``, ``/dev/shm``, ``/var/tmp`` (fresh for the grader), modes that lock the grader out (the
files are made readable to everyone; their owner stays the candidate's uid, so git refuses to run
hooks from its ``.git/config``), background processes that rewrite the answer late.

Not covered (know these before trusting a reward)
-------------------------------------------------
- ``io``: a reward is as strong as the checks: ``len(f(x)) == 3`` passes for any three items, and
  the candidate sees every input it is called with, so a solution that already knows the expected
  outputs (say, from its prompt) can special-case those inputs.
- ``proxy``: a handle's forwarded operations run candidate code (``len(obj)``, ``obj.attr``), so
  checks should compare plain values (``obj.items == [1, 2]``), not trust what an object says
  about itself; ``bool(handle)`` is True. Tests can pass only plain data and handles to the
  solution (a callback or an instance of a test-defined class raises ``TypeError``), a class from
  ``solution`` is a handle (``isinstance(x, solution.C)`` raises), and a candidate exception arrives
  as the built-in class first in its MRO (a subclass of that name when it is the candidate's own).
- ``grader``: a grader that executes the candidate's files (``bash $WORK/x.sh``) runs candidate code
  as the grader's uid; the grader should read outputs, not run them.
- Kernel exploits; side channels; reading world-readable host files (the host filesystem is visible
  read-only to the sandbox uids: the source tree, ``/etc``). Do not keep secrets world-readable.
- Weak mode (see above): no namespaces, no tmpfs; not root, the candidate runs as the verifier's own
  user (it can read its files, reach the network, and tamper with the verifier's process); the grader
  runs as the candidate's uid in a writable tree; processes that ``setsid()`` escape the
  process-group kill unless a cgroup exists.
- Without a writable cpu controller, CPU time is limited per process only; the wall clock bounds the
  total. Without libseccomp, host Unix sockets whose files are visible can be reached.

Throughput: the Python path starts ``python -I -S`` (no site-packages: ~10 ms instead of ~30 ms on the
development machine); pass ``site_packages=True`` when solutions may import installed packages.
Namespace creation costs ~1 ms, the cgroup ~0.5 ms. ``SandboxResult.details["timings_ms"]`` splits each
run into stages and ``benchmarks/bench_sandbox.py`` compares them with the pre-redesign sandbox.
"""

from __future__ import annotations

import ast
import functools
import hmac
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.config import SandboxConfig
from flywheel.io_grading import IOPlan, NotIO, compile_io, decode_value

__all__ = [
    "SandboxResult",
    "run_python_tests",
    "run_shell",
    "discover_tests",
    "isolation_mode",
    "isolation_report",
    "cgroup_support",
    "GRADINGS",
]

# Interpreter of the sandbox (harness and candidate) when a call passes none; a module attribute so a
# deployment can point it at a dedicated interpreter.
PYTHON = sys.executable
_HARNESS = Path(__file__).resolve().parent / "verifiers" / "_sandbox_harness.py"
# The harness is imported as a module, not run as a script: a script is compiled on every run (~4 ms
# for its ~800 lines), a module is loaded from its cached bytecode.
_BOOT = (
    "import sys; sys.path.insert(0, {d!r}); import {m} as h; sys.path.remove({d!r}); h.main()"
    .format(d=str(_HARNESS.parent), m=_HARNESS.stem)
)
_OUTPUT_LIMIT = 8192  # bytes of stdout/stderr kept in the result (the rest is discarded)
_RECORD_LIMIT = 16 * 1024 * 1024  # bytes of result records read back (io results: up to 1 MiB each)
# Throwaway uids: random per run so concurrent sandboxes do not share an RLIMIT_NPROC budget.
_UID_BASE, _UID_SPAN = 200_000, 100_000
# Headroom between the harness's own per-phase deadline and the supervisor's hard kill.
_GRACE_S = 1.0
# pids.max headroom over sandbox.max_processes: init, and bash/the grader between phases.
_PIDS_HEADROOM = 4
_CG_PREFIX = "flywheel-sbx-"
#: Grading paths of ``run_python_tests``: ``auto`` = ``io`` when the tests allow it, else ``proxy``.
#: ``proxy``: the tests in a process of their own, the candidate behind a proxy (issue 31, finding 2);
#: ``in_process`` is its former name, still accepted in specs (the tests no longer run in the
#: candidate's interpreter under either name).
GRADINGS = ("auto", "io", "proxy", "in_process")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ``passed`` is True only on positive evidence for every test (see the module docstring).
    ``infra_error`` is set when the sandbox could not run or judge; then ``passed`` is False and the
    result says nothing about the candidate. ``isolation`` is ``"netns"`` or ``"weak: <why>"``;
    ``report`` says what this run got: ``mode``, ``namespaces``, ``uid``, ``cgroup``, ``grading`` (and
    why not ``io``), ``grader`` (shell).
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
    report: dict = field(default_factory=dict)

    @property
    def weak(self) -> bool:
        return self.isolation != "netns"


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
            [unshare, "--pid", "--fork", "--mount-proc", "--ipc", "--net", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"weak: unshare probe failed ({e})"
    if r.returncode != 0:
        return f"weak: unshare refused ({r.stderr.decode(errors='replace').strip()[:200]})"
    return "netns"


# ------------------------------------------------------------------------------------------ cgroups


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, options) of every mount, from /proc/self/mounts (octal escapes undone)."""
    out = []
    try:
        text = Path("/proc/self/mounts").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            point = parts[1].encode().decode("unicode_escape")
            out.append((point, parts[2], parts[3]))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (``"0"`` for the unified hierarchy) -> this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            out["0"] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _try_child(parent: Path, files: dict[str, str]) -> str | None:
    """Create a child cgroup, write ``files`` in it, remove it. None when that worked, else why not."""
    probe = parent / f"{_CG_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot create a cgroup under {parent} ({e.strerror})"
    try:
        for name, value in files.items():
            (probe / name).write_text(value)
    except OSError as e:
        return f"cannot set {name} under {parent} ({e.strerror})"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


def _sweep(parent: Path) -> None:
    """Remove empty sandbox cgroups whose supervisor died (a crash between create and remove)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        if not d.name.startswith(_CG_PREFIX):
            continue
        pid = d.name[len(_CG_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass


@dataclass(frozen=True)
class _CgroupSupport:
    version: int  # 2, 1 or 0 (none)
    parents: dict[str, Path]  # v2: {"unified": dir}; v1: {"memory": dir, "pids": dir}
    describe: str


@functools.lru_cache(maxsize=1)
def _cgroup_support() -> _CgroupSupport:
    if os.name != "posix":
        return _CgroupSupport(0, {}, "none: not a POSIX system")
    mounts = _mounts()
    own = _own_cgroups()
    why: list[str] = []
    v2 = next((Path(p) for p, fs, _ in mounts if fs == "cgroup2"), None)
    if v2 is not None and "0" in own:
        parent = v2 / own["0"].lstrip("/")
        try:
            controllers = (parent / "cgroup.controllers").read_text().split()
        except OSError as e:
            controllers = []
            why.append(f"cgroup2 at {v2}: {e.strerror}")
        missing = [c for c in ("memory", "pids") if c not in controllers]
        if missing:
            if controllers or not why:
                why.append(f"cgroup2 at {v2} has no {'/'.join(missing)} controller in {parent} "
                           "(bound to cgroup v1, or not delegated)")
        else:
            sub = (parent / "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(sub):
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory +pids")
                except OSError as e:
                    why.append(f"cgroup2 at {v2}: cannot enable memory/pids for children of {parent} "
                               f"({e.strerror}; a cgroup that holds processes cannot delegate them)")
            if not why:
                err = _try_child(parent, {"memory.max": str(64 << 20), "pids.max": "64"})
                if err is None:
                    _sweep(parent)
                    return _CgroupSupport(2, {"unified": parent}, f"v2: memory.max + pids.max under {parent}")
                why.append(f"cgroup2: {err}")
    elif v2 is None:
        why.append("no cgroup2 mount")
    v1: dict[str, Path] = {}
    for ctl, limit_file in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
        point = next((Path(p) for p, fs, opts in mounts if fs == "cgroup" and ctl in opts.split(",")), None)
        if point is None or ctl not in own:
            why.append(f"no cgroup v1 {ctl} hierarchy")
            continue
        parent = point / own[ctl].lstrip("/")
        err = _try_child(parent, {limit_file: str(64 << 20) if ctl == "memory" else "64"})
        if err is None:
            v1[ctl] = parent
            _sweep(parent)
        else:
            why.append(f"cgroup v1 {ctl}: {err}")
    if "memory" in v1:
        names = " + ".join(["memory.limit_in_bytes"] + (["pids.max"] if "pids" in v1 else []))
        return _CgroupSupport(1, v1, f"v1: {names} under {', '.join(str(p) for p in v1.values())}")
    return _CgroupSupport(0, {}, "none: " + "; ".join(why))


# CPU bandwidth period (microseconds): the kernel's default; quota = sandbox.cpus x this.
_CPU_PERIOD_US = 100_000


@functools.lru_cache(maxsize=1)
def _cpu_support() -> _CgroupSupport:
    """Where a run's CPU bandwidth can be capped: v2 ``cpu.max`` in the unified parent used for
    memory/pids, else a v1 ``cpu`` hierarchy (``cpu.cfs_quota_us``), else none (and why). Probed once
    by creating and removing a test cgroup."""
    mem = _cgroup_support()
    if mem.version == 2:
        parent = mem.parents["unified"]
        try:
            if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+cpu")
        except OSError as e:
            return _CgroupSupport(0, {}, f"none: cannot enable cpu for children of {parent} ({e.strerror})")
        return _CgroupSupport(2, {"unified": parent}, "cpu.max")
    own = _own_cgroups()
    point = next((Path(p) for p, fs, opts in _mounts() if fs == "cgroup" and "cpu" in opts.split(",")), None)
    if point is None or "cpu" not in own:
        return _CgroupSupport(0, {}, "none: no cgroup v1 cpu hierarchy and no cgroup v2 with memory/pids")
    parent = point / own["cpu"].lstrip("/")
    err = _try_child(parent, {"cpu.cfs_period_us": str(_CPU_PERIOD_US), "cpu.cfs_quota_us": str(_CPU_PERIOD_US)})
    if err is not None:
        return _CgroupSupport(0, {}, f"none: cgroup v1 cpu: {err}")
    _sweep(parent)
    return _CgroupSupport(1, {"cpu": parent}, "cpu.cfs_quota_us")


def cgroup_support() -> str:
    """How sandbox runs are bounded as a group on this machine: ``"v2: ..."``, ``"v1: ..."`` or
    ``"none: <why>"`` (probed once per process by creating and removing a test cgroup)."""
    return _cgroup_support().describe


class _Cgroup:
    """One run's cgroup (a directory per hierarchy)."""

    def __init__(self, support: _CgroupSupport, memory_bytes: int, pids: int,
                 cpu: _CgroupSupport | None = None, cpus: float = 0.0):
        self.version = support.version
        name = f"{_CG_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs: list[Path] = []
        try:
            # CPU bandwidth of the whole run (issue 31, finding 13): without it RLIMIT_CPU bounds each
            # process only, and max_processes of them share no budget.
            quota = f"{max(1000, int(cpus * _CPU_PERIOD_US))}"
            if cpu is not None and cpu.version == 1 and cpus > 0:
                d = cpu.parents["cpu"] / name
                d.mkdir()
                self.dirs.append(d)
                (d / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(quota)
            for parent in support.parents.values():
                d = parent / name
                d.mkdir()
                self.dirs.append(d)
            if self.version == 2:
                d = self.dirs[-1]
                if cpu is not None and cpu.version == 2 and cpus > 0:
                    (d / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
                (d / "memory.max").write_text(str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
            else:
                for d in self.dirs:
                    if (d / "memory.limit_in_bytes").exists():
                        (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                        if (d / "memory.memsw.limit_in_bytes").exists():
                            (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    if (d / "pids.max").exists():
                        (d / "pids.max").write_text(str(pids))
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def stats(self) -> dict[str, int]:
        out = {"oom_kills": 0, "pids_max_hits": 0, "memory_peak_bytes": 0}
        for d in self.dirs:
            for fname, key, out_key in (
                ("memory.events", "oom_kill", "oom_kills"),
                ("memory.oom_control", "oom_kill", "oom_kills"),
                ("pids.events", "max", "pids_max_hits"),
            ):
                try:
                    for line in (d / fname).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key and v.strip().isdigit():
                            out[out_key] += int(v)
                except OSError:
                    pass
            for fname in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    out["memory_peak_bytes"] = max(out["memory_peak_bytes"], int((d / fname).read_text()))
                except (OSError, ValueError):
                    pass
        return out

    def remove(self) -> str | None:
        """Kill whatever is left and remove the directories; a note when one could not be removed."""
        deadline = time.monotonic() + 2.0
        left = []
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(d))
                        break
                    self._kill(d)
                    time.sleep(0.001)
        return f"cgroup not removed: {', '.join(left)}" if left else None

    @staticmethod
    def _kill(d: Path) -> None:
        try:
            (d / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
        try:
            pids = (d / "cgroup.procs").read_text().split()
        except OSError:
            return
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (OSError, ValueError):
                pass


# ----------------------------------------------------------------------------------------- reports


def isolation_report(cfg: SandboxConfig | None = None) -> dict[str, str | bool]:
    """What a sandboxed verifier gets on this machine, for ``flywheel init``/``status`` and the cycle.

    Keys: ``mode`` (``netns``/``weak``), ``namespaces``, ``uid``, ``cgroup``, ``verdicts`` (what
    becomes of ``python_tests``/``shell`` verdicts under ``cfg``), ``trusted`` (True when verdicts
    are graded in full isolation), ``warning`` (empty when nothing is wrong).
    """
    cfg = cfg or SandboxConfig()
    iso = isolation_mode()
    strong = iso == "netns"
    cg = cgroup_support() if cfg.cgroup != "off" else "none: disabled (sandbox.cgroup = off)"
    cannot = _probe_sandbox(PYTHON, cfg.model_dump_json()) if (strong or cfg.allow_weak) else None
    if cannot is not None:
        verdicts = "infrastructure errors: the sandbox cannot start on this machine"
        warning = f"python_tests/shell verdicts are infrastructure errors: the sandbox cannot start ({cannot})"
    elif strong:
        verdicts = "graded in namespaces; io-checkable python tests judged outside the sandbox"
        warning = ""
        if cg.startswith("none") and cfg.cgroup == "require":
            verdicts = "infrastructure errors: sandbox.cgroup = require and no cgroup is writable"
            warning = "python_tests/shell verdicts are infrastructure errors: " + cg
        elif cg.startswith("none"):
            warning = "no per-sandbox cgroup: memory is bounded per process only (" + cg[6:] + ")"
    elif not cfg.allow_weak:
        verdicts = "infrastructure errors (no isolation; sandbox.allow_weak = false)"
        warning = f"python_tests/shell verdicts are infrastructure errors on this machine ({iso})"
    else:
        verdicts = "WEAK: forgeable by the candidate; " + (
            "used as training data (sandbox.train_on_weak = true)" if cfg.train_on_weak else "never training data"
        )
        warning = f"python_tests/shell verdicts come from a weak sandbox and can be forged ({iso})"
    return {
        "mode": "netns" if strong else "weak",
        "namespaces": "pid, mount, ipc, network (unshare)" if strong else iso,
        "uid": "throwaway uid per run (grader: a second one)" if os.geteuid() == 0 else "the verifier's own uid",
        "cgroup": cg,
        "verdicts": verdicts,
        "trusted": strong and cannot is None and not (cg.startswith("none") and cfg.cgroup == "require"),
        "warning": warning,
    }


@functools.lru_cache(maxsize=4)
def _probe_sandbox(python: str, cfg_json: str) -> str | None:
    """None when a real sandbox run of a two-line honest solution passes here (~0.1 s, once per
    process and configuration), else why not. ``isolation_mode()`` only proves that ``unshare``
    works; a checkout under /tmp once made every run fail to start after that (issue 31, finding 1),
    so ``flywheel init``/``status`` report what a run actually does."""
    cfg = SandboxConfig.model_validate_json(cfg_json)
    try:
        r = run_python_tests("def f():\n    return 1\n", "from solution import f\n\ndef test_f():\n    assert f() == 1\n",
                             cfg, python=python)
    except Exception as e:  # noqa: BLE001 - whatever broke, the report must say it instead of raising
        return f"{type(e).__name__}: {e}"[:300]
    if r.infra_error:
        return r.infra_error[:300]
    if not r.passed:
        return "an honest probe solution did not pass: " + "; ".join(r.per_test.values())[:300]
    return None


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
    grading: str = "auto",
) -> SandboxResult:
    """Run ``tests`` (Python source that imports the candidate as module ``solution``) against
    ``candidate_code`` in a fresh sandbox. ``python`` defaults to this interpreter.

    ``grading``: ``"auto"`` judges input -> expected-output tests outside the sandbox (``io``) and
    runs any other tests in a process of their own against a proxy of the candidate (``proxy``);
    ``"io"`` raises ``ValueError`` when the tests are not of that shape; ``"proxy"`` (or its former
    name ``"in_process"``) always takes the proxy path."""
    if grading not in GRADINGS:
        raise ValueError(f"grading must be one of {GRADINGS}, got {grading!r}")
    names = discover_tests(tests)
    plan: IOPlan | None = None
    why_not = f"grading = {grading}"
    if grading not in ("proxy", "in_process"):
        try:
            plan = compile_io(tests)
            if plan.names != names:  # defensive: both parse the same source in the same order
                raise NotIO("test names differ from discover_tests")
        except NotIO as e:
            if grading == "io":
                raise ValueError(f"tests are not input -> expected-output checks: {e}") from None
            plan, why_not = None, str(e)
    cfg = cfg or SandboxConfig()
    if plan is not None:
        return _run(mode="io", candidate=candidate_code, names=names, cfg=cfg, python=python,
                    site_packages=site_packages, extra=plan.driver_setup(), plan=plan, grading="io")
    return _run(mode="proxy", candidate=candidate_code, names=names, cfg=cfg, python=python,
                site_packages=site_packages, extra={"test_source": tests}, plan=None, grading=f"proxy ({why_not})")


def run_shell(
    candidate_script: str, grader: str, cfg: SandboxConfig | None = None, *, python: str | None = None
) -> SandboxResult:
    """Run ``candidate_script`` with bash in a fresh sandbox; once every candidate process is dead,
    run ``grader`` (a bash script, trusted) as another uid from an empty directory, with the
    candidate's work dir read-only at ``$WORK``. Passes when the grader exits 0."""
    if not grader.strip():
        raise ValueError("shell grader is empty")
    return _run(mode="shell", candidate=candidate_script, names=["grader"], cfg=cfg or SandboxConfig(),
                python=python, site_packages=False, extra={"grader": grader}, plan=None, grading="grader")


# --------------------------------------------------------------------------------------------- runs


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


def _read_head(f, limit: int) -> str:
    f.seek(0)
    data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += "\n[... truncated]"
    return text


def _feed(fd: int, data: bytes, deadline: float) -> None:
    """Write the setup to the harness's stdin without ever blocking past ``deadline``."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        _, ready, _ = select.select([], [fd], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError("the sandbox did not read its setup")
        view = view[os.write(fd, view[: 1 << 16]):]


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for ``proc`` (a pidfd: woken the moment it exits; ``Popen.wait(timeout)`` polls with up
    to 50 ms sleeps). True when it exited in time."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return bool(ready)


def _run(
    *,
    mode: str,
    candidate: str,
    names: list[str],
    cfg: SandboxConfig,
    python: str | None,
    site_packages: bool,
    extra: dict,
    plan: IOPlan | None,
    grading: str,
) -> SandboxResult:
    t0 = time.monotonic_ns()
    iso = isolation_mode()
    strong = iso == "netns"
    root_user = os.geteuid() == 0
    report: dict = {
        "mode": "netns" if strong else "weak",
        "namespaces": ("pid, mount, ipc" + (", network" if cfg.network == "none" else "")) if strong else iso,
        "uid": "throwaway" if root_user else "the verifier's own uid",
        "grading": grading,
    }
    if not strong and not cfg.allow_weak:
        return _infra(
            f"no sandbox isolation on this machine ({iso}); a weak sandbox lets the candidate forge its "
            "verdict, so this is an infrastructure error. Set sandbox.allow_weak = true to accept weak "
            "verdicts (kept out of training unless sandbox.train_on_weak = true)",
            iso, t0, report,
        )
    support = _cgroup_support() if cfg.cgroup != "off" else _CgroupSupport(0, {}, "none: disabled (sandbox.cgroup = off)")
    cgroup: _Cgroup | None = None
    if support.version:
        try:
            cpu = _cpu_support() if cfg.cpus > 0 else None
            cgroup = _Cgroup(support, int(cfg.memory_mb) << 20, int(cfg.max_processes) + _PIDS_HEADROOM,
                             cpu if cpu is not None and cpu.version else None, float(cfg.cpus))
        except OSError as e:
            support = _CgroupSupport(0, {}, f"none: creating the run's cgroup failed ({e.strerror})")
    report["cgroup"] = support.describe if cgroup is None else support.describe.split(" under ")[0]
    if cgroup is not None and cfg.cpus > 0:
        cpu_desc = _cpu_support().describe
        report["cgroup"] += (f" + {cpu_desc} ({cfg.cpus:g} CPUs)" if not cpu_desc.startswith("none")
                             else f"; cpu not limited ({cpu_desc[6:]})")
    if cgroup is None and cfg.cgroup == "require":
        return _infra(f"sandbox.cgroup = require and {support.describe}", iso, t0, report)

    uid = (_UID_BASE + secrets.randbelow(_UID_SPAN)) if root_user else None
    grader_uid = None
    if mode in ("shell", "proxy"):  # the grader / the test runner: a second throwaway uid
        grader_uid = uid
        while strong and grader_uid == uid:
            grader_uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    fallback = None if strong else Path(tempfile.mkdtemp(prefix="flywheel-sbx-"))
    phases = 2 if mode == "shell" else 1
    setup: dict = {
        "init_nonce": secrets.token_hex(16),
        "mode": mode,
        "tests": list(names),
        "candidate": candidate,
        "limits": _limits(cfg),
        "strong": strong,
        # Scratch space per tmpfs (/tmp and the work dir): four maximal files' worth, at least 64 MiB.
        "tmpfs_mb": max(64, 4 * int(cfg.max_file_mb)),
        "uid": uid,
        "grader_uid": grader_uid,
        "expose": _interpreter_dirs(python),
        "phase_seconds": float(cfg.wall_seconds) / phases,
        "cgroup_procs": cgroup.procs if cgroup else [],
        "python": os.path.realpath(python or PYTHON),
        "fallback_workdir": str(fallback / "work") if fallback else "",
        "fallback_grader_base": str(fallback / "grader") if fallback else "",
    }
    setup.update(extra)
    # What only the trusted side of the sandbox may hold: the harness reads it after it started the
    # candidate's process (proxy: the tests, their names and tokens never enter that process).
    secret: dict = {}
    if mode == "proxy":
        setup["runner_uid"] = grader_uid
        secret = {"tokens": [secrets.token_hex(16) for _ in names], "done_token": secrets.token_hex(16),
                  "tests": setup.pop("tests"), "test_source": setup.pop("test_source")}
    if fallback is not None:
        (fallback / "work").mkdir()
        (fallback / "grader").mkdir()
        if uid is not None:
            os.chmod(fallback, 0o711)
            hidden = [d for d in setup["expose"] if not _world_traversable(d)]
            if hidden and mode != "shell":
                # Without a mount namespace a private parent cannot be covered: the sandbox uid could
                # not import the stdlib, and every candidate would fail for our reasons.
                _cleanup(fallback, cgroup)
                return _infra(
                    f"weak sandbox mode: interpreter dir {hidden[0]} is not readable by an unprivileged uid; "
                    "point flywheel.sandbox.PYTHON at a world-readable interpreter", iso, t0, report,
                )
    details: dict = {}
    timings: dict[str, float] = {}
    killed_reason = None
    try:
        with (
            tempfile.TemporaryFile() as init_f,
            tempfile.TemporaryFile() as result_f,
            tempfile.TemporaryFile() as out_f,
            tempfile.TemporaryFile() as err_f,
        ):
            exe = python or PYTHON
            flags = ["-I"] if site_packages else ["-I", "-S"]
            argv = [exe, *flags, "-c", _BOOT, str(init_f.fileno()), str(result_f.fileno())]
            if strong:
                # --ipc: SysV segments and POSIX queues the candidate creates die with the run.
                ns = ["--pid", "--fork", "--mount-proc", "--kill-child", "--ipc"] + (["--net"] if cfg.network == "none" else [])
                argv = [shutil.which("unshare") or "unshare", *ns, *argv]
            public = marshal.dumps(setup, 4)
            payload = b"%08x" % len(public) + public + marshal.dumps(secret, 4)
            deadline = time.monotonic() + float(cfg.wall_seconds) + _GRACE_S * phases
            t_spawn = time.monotonic_ns()
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=out_f,
                    stderr=err_f,
                    pass_fds=(init_f.fileno(), result_f.fileno()),
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                    cwd="/",
                    start_new_session=True,  # its own process group, killed as a whole below
                    close_fds=True,
                )
            except OSError as e:
                return _infra(f"sandbox could not start: {e}", iso, t0, report)
            try:
                try:
                    _feed(proc.stdin.fileno(), payload, deadline)
                except (BrokenPipeError, TimeoutError):
                    pass  # the harness died or hung before reading: no READY, an infrastructure error
                finally:
                    proc.stdin.close()
                if not _wait(proc, max(0.0, deadline - time.monotonic())):
                    killed_reason = "wall_timeout"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                t_exit = time.monotonic_ns()
                if cgroup is not None:
                    details["cgroup"] = cgroup.stats()
                    leak = cgroup.remove()
                    if leak:
                        details["cgroup_cleanup"] = leak
            init_recs = _records(init_f, setup["init_nonce"])
            result_f.seek(0)
            result_raw = result_f.read(_RECORD_LIMIT).decode("utf-8", errors="replace")
            stdout = _read_head(out_f, _OUTPUT_LIMIT)
            stderr = _read_head(err_f, _OUTPUT_LIMIT)
    finally:
        if fallback is not None:
            _rmtree_any_owner(fallback)
        if cgroup is not None and "cgroup" not in details:
            cgroup.remove()

    if not any(r[0] == "READY" for r in init_recs):
        setup_err = next((" ".join(r[1:-1]) for r in init_recs if r[0] == "SETUP_ERROR"), None)
        why = setup_err or (stderr.strip().splitlines() or ["no output"])[-1]
        return _infra(f"sandbox did not start: {why}", iso, t0, report, stdout=stdout, stderr=stderr)
    for tag, what in (("WORKER_SETUP_ERROR", "start its worker"), ("GRADER_SETUP_ERROR", "prepare the grader")):
        err = next((" ".join(r[1:-1]) for r in init_recs if r[0] == tag), None)
        if err:
            return _infra(f"sandbox could not {what}: {err}", iso, t0, report, stdout=stdout, stderr=stderr)
    sc = next((r for r in init_recs if r[0] == "SECCOMP" and len(r) >= 3), None)
    if sc is not None:  # candidate processes: no socket(AF_UNIX), no ptrace/mount/bpf/io_uring/...
        report["seccomp"] = ("socket(AF_UNIX) and kernel-surface syscalls denied" if sc[1] == "on"
                             else "none: " + " ".join(sc[2:-1]).replace("_", " "))
    stamps = {r[0]: int(r[-1]) for r in init_recs if r[-1].isdigit()}
    start = next((int(r[1]) for r in init_recs if r[0] == "START" and r[1].isdigit()), None)
    timings["prepare"] = (t_spawn - t0) / 1e6
    if start is not None:
        timings["interpreter_and_namespaces"] = (start - t_spawn) / 1e6
        if "READY" in stamps:
            timings["setup_in_sandbox"] = (stamps["READY"] - start) / 1e6
    run_end = stamps.get("WORKER") or stamps.get("GRADER")
    if "READY" in stamps and run_end:
        timings["run"] = (run_end - stamps["READY"]) / 1e6
    if "END" in stamps:
        timings["teardown"] = (t_exit - stamps["END"]) / 1e6

    # The worker's fate as observed by trusted init: exit status, signal, or init's own deadline.
    statuses = {r[0]: r[1:-1] for r in init_recs if r[0] in ("WORKER", "CANDIDATE", "GRADER")}
    cg_stats = details.get("cgroup") or {}
    for tag, st in statuses.items():
        details[f"{tag.lower()}_status"] = " ".join(st)
        if st and st[0] == "TIMEOUT" and killed_reason is None:
            killed_reason = "wall_timeout"
        elif st and st[0] == "SIGNAL" and killed_reason is None:
            sig = int(st[1])
            if sig == signal.SIGKILL and cg_stats.get("oom_kills"):
                killed_reason = "memory_limit (cgroup)"
            else:
                killed_reason = _signal_reason(sig)
    if killed_reason is None and cg_stats.get("oom_kills"):
        killed_reason = "memory_limit (cgroup): a process of the sandbox was killed"

    worker = statuses.get("WORKER")
    missing = "missing: no result recorded" + (f" (worker {' '.join(worker).lower()})" if worker else "")
    per_test: dict[str, str] = {n: missing for n in names}
    integrity: list[str] = []
    if mode == "io":
        assert plan is not None
        per_test, integrity = _judge_io(plan, result_raw, worker)
    elif mode == "proxy":
        per_test, integrity = _judge_inproc(names, secret["tokens"], secret["done_token"], result_raw, per_test)
    else:
        grader = statuses.get("GRADER")
        if grader == ["EXIT", "0"]:
            per_test["grader"] = "passed"
        elif grader:
            per_test["grader"] = "failed: grader " + " ".join(grader).lower()
        ready = next((r for r in init_recs if r[0] == "GRADER_READY"), None)
        report["grader"] = (
            f"uid {'separate' if grader_uid != uid else 'same as candidate'}, empty cwd, fresh /tmp, "
            + ("$WORK read-only, symlinks " + ("not followed" if ready and ready[1] == "nosymfollow" else "followed")
               if strong else "$WORK writable (weak)")
        )
    if integrity:
        details["integrity"] = integrity[:10]
        per_test = {n: "failed: result channel tampered with (" + integrity[0] + ")" for n in names}
    n_passed = sum(1 for v in per_test.values() if v == "passed")
    ok = not integrity and n_passed == len(names) and killed_reason != "wall_timeout"
    timings["total"] = (time.monotonic_ns() - t0) / 1e6
    details["timings_ms"] = {k: round(v, 2) for k, v in timings.items()}
    return SandboxResult(
        passed=ok,
        tests_total=len(names),
        tests_passed=n_passed,
        per_test=per_test,
        stdout=stdout,
        stderr=stderr,
        duration_s=(time.monotonic_ns() - t0) / 1e9,
        isolation=iso,
        infra_error=None,
        killed_reason=killed_reason,
        details=details,
        report=report,
    )


def _judge_io(plan: IOPlan, raw: str, worker: list[str] | None) -> tuple[dict[str, str], list[str]]:
    """Decode the driver's lines and apply the plan's checks. The lines were written by the
    candidate's process: anything malformed, duplicated or out of range is tampering."""
    integrity: list[str] = []
    load_error: str | None = None
    loaded = False
    results: dict[int, tuple[str, object]] = {}
    n = len(plan.calls)
    # Records are "\n"-terminated; splitlines() would also break at \x0c, \u2028, ... inside a record
    # (issue 31, finding 10). The harness escapes all of those in what it writes.
    for line in raw.split("\n"):
        if not line:
            continue
        head, _, rest = line.partition(" ")
        try:
            if head == "L" and not loaded and not results:
                loaded = True
                status, _, payload = rest.partition(" ")
                if status == "raise":
                    mro, msg = _decode_raise(payload)
                    load_error = f"{mro[0] if mro else 'exception'}: {msg}"
                elif status != "ok" or payload:
                    raise ValueError("malformed load record")
            elif head == "R" and loaded and load_error is None:
                idx_s, _, rest2 = rest.partition(" ")
                status, _, payload = rest2.partition(" ")
                if not idx_s.isdigit() or int(idx_s) >= n:
                    raise ValueError(f"result for unknown call {idx_s[:20]!r}")
                idx = int(idx_s)
                if idx in results:
                    raise ValueError(f"second result for call {idx}")
                if status == "ok":
                    results[idx] = ("ok", decode_value(payload))
                elif status == "raise":
                    results[idx] = ("raise", _decode_raise(payload))
                elif status == "bad":
                    why = decode_value(payload)
                    if not isinstance(why, str):
                        raise ValueError("malformed bad record")
                    results[idx] = ("bad", why[:200])
                else:
                    raise ValueError(f"unknown result status {status[:20]!r}")
            else:
                raise ValueError(f"unexpected record {line[:40]!r}")
        except ValueError as e:
            integrity.append(str(e))
    if not loaded and not integrity:
        load_error = "the candidate's process ended before importing solution" + (
            f" (worker {' '.join(worker).lower()})" if worker else "")
    return plan.judge(load_error, results), integrity


def _decode_raise(payload: str) -> tuple[list[str], str]:
    v = decode_value(payload)
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], str)
            and all(isinstance(x, str) for x in v[0])):
        raise ValueError("malformed raise record")
    return [x[:100] for x in v[0][:16]], v[1][:1000]


def _judge_inproc(names: list[str], tokens: list[str], done_token: str, raw: str,
                  per_test: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    integrity: list[str] = []
    seen: set[int] = set()
    done = False
    for line in raw.split("\n"):  # one record per "\n" only, as in _judge_io
        if not line:
            continue
        parts = line.split(" ", 2)
        kind = parts[0]
        if kind == "DONE" and len(parts) == 2 and not done and hmac.compare_digest(parts[1], done_token):
            done = True
            continue
        if kind in ("PASS", "FAIL") and len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) < len(names) and not done:
            idx = int(parts[1])
            if idx in seen:
                integrity.append(f"second record for {names[idx]}")
                continue
            seen.add(idx)
            if kind == "PASS":
                if len(parts) == 3 and hmac.compare_digest(parts[2], tokens[idx]):
                    per_test[names[idx]] = "passed"
                else:
                    integrity.append(f"PASS record for {names[idx]} without its token")
            else:
                per_test[names[idx]] = "failed: " + (parts[2] if len(parts) > 2 else "")
            continue
        integrity.append(f"unexpected record {line[:40]!r}")
    if not done and not integrity:
        for n in names:
            if per_test[n] == "passed":
                per_test[n] = "failed: the harness did not finish (no DONE record)"
    return per_test, integrity


def _records(f, nonce: str) -> list[list[str]]:
    f.seek(0)
    out = []
    for line in f.read(_RECORD_LIMIT).decode("utf-8", errors="replace").split("\n"):
        parts = line.split(" ")
        if len(parts) >= 3 and parts[0] == nonce:
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


def _infra(msg: str, iso: str, t0: int, report: dict, *, stdout: str = "", stderr: str = "") -> SandboxResult:
    return SandboxResult(
        passed=False,
        tests_total=0,
        tests_passed=0,
        per_test={},
        stdout=stdout,
        stderr=stderr,
        duration_s=(time.monotonic_ns() - t0) / 1e9,
        isolation=iso,
        infra_error=msg,
        killed_reason=None,
        report=report,
    )


def _cleanup(fallback: Path | None, cgroup: _Cgroup | None) -> None:
    if fallback is not None:
        _rmtree_any_owner(fallback)
    if cgroup is not None:
        cgroup.remove()


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

