"""Run untrusted model output (Python solutions, shell scripts) and grade it without trusting it.

Used by the ``python_tests`` and ``shell`` verifiers. One call = one sandbox = one fresh set of
namespaces (and cgroup); nothing is shared between runs.

How a run works
---------------
The supervisor (:mod:`flywheel.sandbox.supervisor`, in the verifier's process) starts the trusted
harness ``flywheel/sandbox/_sandbox_harness.py`` as pid 1 of new pid, mount and network namespaces
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

Rooms
-----
- :mod:`~flywheel.sandbox.supervisor` -- ``run_python_tests``, ``run_shell``, ``discover_tests``,
  ``SandboxResult``; one run as a list of steps (``_run``); ``PYTHON``, the sandbox's interpreter
  (a deployment sets ``flywheel.sandbox.PYTHON``, as before the split: the package forwards reads and
  assignments of that name to the supervisor, which reads it at each run).
- :mod:`~flywheel.sandbox.isolation` -- ``isolation_mode`` (namespaces or weak, probed once).
- :mod:`~flywheel.sandbox.cgroups` -- ``cgroup_support`` and one run's cgroup (memory, pids, cpu).
- :mod:`~flywheel.sandbox.judging` -- what init's records and the result channel say: start failures,
  stage timings, why a run was killed, the io and proxy verdicts (``_judge_io``, ``_judge_inproc``).
- :mod:`~flywheel.sandbox.report` -- ``isolation_report`` for ``flywheel init``/``status`` and the cycle.
- In the sandbox, never imported by the library (top-level modules under ``python -I -S``, standard
  library only): ``_sandbox_harness.py`` (init's steps and phases, the candidate's processes: io
  driver, proxy server), ``_harness_runner.py`` (the proxy path's test runner), ``_harness_confine.py``
  (mounts, seccomp, rlimits, the grader's environment), ``_harness_codec.py`` (records, framed
  messages, tagged JSON).

Tests that replace an internal patch the module that uses it: ``isolation.isolation_mode``,
``supervisor.PYTHON``, ``supervisor._limits``, ``cgroups.cgroup_support``, ``cgroups._mounts``,
``report._probe_sandbox``.
"""

import sys
import types

# The rooms as attributes (a test replaces an internal in the module that uses it: sb.supervisor.PYTHON),
# and the internals that tests read (F401): the probes' caches, the judges of raw records, a run's cgroup.
from flywheel.sandbox import cgroups, isolation, judging, report, supervisor  # noqa: F401
from flywheel.sandbox.cgroups import _Cgroup, _cgroup_support, _cpu_support, cgroup_support  # noqa: F401
from flywheel.sandbox.isolation import isolation_mode
from flywheel.sandbox.judging import _judge_inproc, _judge_io  # noqa: F401
from flywheel.sandbox.report import _probe_sandbox, isolation_report  # noqa: F401
from flywheel.sandbox.supervisor import GRADINGS, SandboxResult, discover_tests, run_python_tests, run_shell

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


class _SandboxPackage(types.ModuleType):
    """``flywheel.sandbox.PYTHON`` is the supervisor's: reading it reads ``supervisor.PYTHON`` and setting it
    sets that, so the knob a deployment set before the package was split still reaches the code that runs
    the sandbox (a plain re-export would be a copy, and assigning it would change nothing). A property, so
    ``monkeypatch.setattr`` restores it through the same path."""

    @property
    def PYTHON(self) -> str:  # noqa: N802 (the module attribute's name)
        return supervisor.PYTHON

    @PYTHON.setter
    def PYTHON(self, value: str) -> None:  # noqa: N802
        supervisor.PYTHON = value


sys.modules[__name__].__class__ = _SandboxPackage
