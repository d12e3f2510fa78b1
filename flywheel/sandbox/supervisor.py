"""The supervisor of sandbox runs: :func:`run_python_tests` and :func:`run_shell`, in the verifier's
process (the overview, what is covered and what is not: :mod:`flywheel.sandbox`).

One call is one run: :func:`_run` refuses a weak sandbox unless allowed, attaches the run's cgroup
(:mod:`flywheel.sandbox.cgroups`), picks throwaway uids, builds the harness's setup, starts the
trusted harness (``_sandbox_harness.py`` in this directory) under ``unshare`` with the setup on its
stdin and two unlinked files as its init and result channels, waits for it within the wall clock,
kills what is left, and reads the records back (:mod:`flywheel.sandbox.judging`).

``PYTHON`` is the sandbox's interpreter (harness and candidate) when a call passes none; a module
attribute so a deployment can point it at a dedicated interpreter.
"""

from __future__ import annotations

import ast
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
from flywheel.io_grading import IOPlan, NotIO, compile_io
from flywheel.sandbox import isolation
from flywheel.sandbox.cgroups import _Cgroup, _cgroup_support, _CgroupSupport, _cpu_support
from flywheel.sandbox.judging import (
    _RECORD_LIMIT,
    _grade_shell,
    _judge_inproc,
    _judge_io,
    _killed_reason,
    _records,
    _seccomp_note,
    _stage_timings,
    _start_failure,
    _statuses,
)

# Interpreter of the sandbox (harness and candidate) when a call passes none; a module attribute so a
# deployment can point it at a dedicated interpreter.
PYTHON = sys.executable
_HARNESS = Path(__file__).resolve().parent / "_sandbox_harness.py"
# The harness is imported as a module, not run as a script: a script is compiled on every run (~4 ms
# for its ~800 lines), a module is loaded from its cached bytecode. Its directory is on sys.path only
# while it and its sibling modules (_harness_*.py) are imported: before any mount, so a checkout under
# /tmp works too.
_BOOT = (
    "import sys; sys.path.insert(0, {d!r}); import {m} as h; sys.path.remove({d!r}); h.main()"
    .format(d=str(_HARNESS.parent), m=_HARNESS.stem)
)
_OUTPUT_LIMIT = 8192  # bytes of stdout/stderr kept in the result (the rest is discarded)
# Throwaway uids: random per run so concurrent sandboxes do not share an RLIMIT_NPROC budget.
_UID_BASE, _UID_SPAN = 200_000, 100_000
# Headroom between the harness's own per-phase deadline and the supervisor's hard kill.
_GRACE_S = 1.0
# pids.max headroom over sandbox.max_processes: init, and bash/the grader between phases.
_PIDS_HEADROOM = 4
#: Grading paths of ``run_python_tests``: ``auto`` = ``io`` when the tests allow it, else ``proxy``.
#: ``proxy``: the tests in a process of their own, the candidate behind a proxy (issue 31, finding 2);
#: ``in_process`` is its former name, still accepted in specs (the tests no longer run in the
#: candidate's interpreter under either name).
GRADINGS = ("auto", "io", "proxy", "in_process")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    ``passed`` is True only on positive evidence for every test (see :mod:`flywheel.sandbox`).
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


@dataclass
class _Run:
    """One run as the supervisor steps through it: what it decided before the start, what it saw."""

    mode: str
    names: list[str]
    cfg: SandboxConfig
    python: str | None
    t0: int
    iso: str
    report: dict
    cgroup: _Cgroup | None = None
    uid: int | None = None
    grader_uid: int | None = None
    fallback: Path | None = None  # weak mode: the work dirs, on the host's disk
    setup: dict = field(default_factory=dict)
    secret: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    killed_reason: str | None = None

    @property
    def strong(self) -> bool:
        return self.iso == "netns"

    @property
    def phases(self) -> int:
        return 2 if self.mode == "shell" else 1  # shell: the candidate, then the grader

    def infra(self, msg: str, *, stdout: str = "", stderr: str = "") -> SandboxResult:
        return _infra(msg, self.iso, self.t0, self.report, stdout=stdout, stderr=stderr)


@dataclass
class _Output:
    """What came back from the sandbox once its process was gone."""

    init_recs: list[list[str]]
    result_raw: str
    stdout: str
    stderr: str
    t_spawn: int
    t_exit: int


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
    """One sandboxed run, step by step: refuse a weak sandbox unless allowed, attach the cgroup,
    choose the throwaway uids, build the setup, run the harness, then read what it left."""
    run = _begin(mode, names, cfg, python, grading)
    refused = _refuse_weak(run) or _refuse_unrunnable_python(run) or _attach_cgroup(run)
    if refused is not None:
        return refused
    _choose_uids(run)
    _build_setup(run, candidate, extra)
    refused = _prepare_fallback(run)
    if refused is not None:
        return refused
    out = _execute(run, site_packages)
    if isinstance(out, SandboxResult):
        return out
    why = _start_failure(out.init_recs, out.stderr)
    if why is not None:
        return run.infra(why, stdout=out.stdout, stderr=out.stderr)
    note = _seccomp_note(out.init_recs)
    if note is not None:
        run.report["seccomp"] = note
    timings = _stage_timings(out.init_recs, run.t0, out.t_spawn, out.t_exit)
    statuses = _observe_statuses(run, out)
    per_test, integrity = _grade(run, plan, out, statuses)
    return _result(run, per_test, integrity, timings, out)


def _begin(mode: str, names: list[str], cfg: SandboxConfig, python: str | None, grading: str) -> _Run:
    """Start the clock; what this run gets (``report``): isolation mode, namespaces, uid, grading."""
    t0 = time.monotonic_ns()
    iso = isolation.isolation_mode()
    strong = iso == "netns"
    root_user = os.geteuid() == 0
    report: dict = {
        "mode": "netns" if strong else "weak",
        "namespaces": ("pid, mount, ipc" + (", network" if cfg.network == "none" else "")) if strong else iso,
        "uid": "throwaway" if root_user else "the verifier's own uid",
        "grading": grading,
    }
    return _Run(mode=mode, names=names, cfg=cfg, python=python, t0=t0, iso=iso, report=report)


def _refuse_weak(run: _Run) -> SandboxResult | None:
    """Without namespaces a verdict is forgeable: an infrastructure error unless ``sandbox.allow_weak``."""
    if run.strong or run.cfg.allow_weak:
        return None
    return run.infra(
        f"no sandbox isolation on this machine ({run.iso}); a weak sandbox lets the candidate forge its "
        "verdict, so this is an infrastructure error. Set sandbox.allow_weak = true to accept weak "
        "verdicts (kept out of training unless sandbox.train_on_weak = true)"
    )


def _refuse_unrunnable_python(run: _Run) -> SandboxResult | None:
    """Shell mode puts ``python``/``python3`` on the grader's PATH; where the throwaway uids cannot
    execute the interpreter, every ``python`` a grader ran exited 126 and an honest candidate *failed*.
    That is this machine's fault, not the candidate's: an infrastructure error that says how to fix it."""
    if run.mode != "shell":
        return None
    why = interpreter_blocked(run.python)
    return None if why is None else run.infra(why)


def _attach_cgroup(run: _Run) -> SandboxResult | None:
    """Create the run's cgroup where one is writable and say so in ``report["cgroup"]``; without one
    the run goes on with rlimits only, unless ``sandbox.cgroup = require``."""
    cfg = run.cfg
    support = _cgroup_support() if cfg.cgroup != "off" else _CgroupSupport(0, {}, "none: disabled (sandbox.cgroup = off)")
    if support.version:
        try:
            cpu = _cpu_support() if cfg.cpus > 0 else None
            run.cgroup = _Cgroup(support, int(cfg.memory_mb) << 20, int(cfg.max_processes) + _PIDS_HEADROOM,
                                 cpu if cpu is not None and cpu.version else None, float(cfg.cpus))
        except OSError as e:
            support = _CgroupSupport(0, {}, f"none: creating the run's cgroup failed ({e.strerror})")
    run.report["cgroup"] = support.describe if run.cgroup is None else support.describe.split(" under ")[0]
    if run.cgroup is not None and cfg.cpus > 0:
        cpu_desc = _cpu_support().describe
        run.report["cgroup"] += (f" + {cpu_desc} ({cfg.cpus:g} CPUs)" if not cpu_desc.startswith("none")
                                 else f"; cpu not limited ({cpu_desc[6:]})")
    if run.cgroup is None and cfg.cgroup == "require":
        return run.infra(f"sandbox.cgroup = require and {support.describe}")
    return None


def _choose_uids(run: _Run) -> None:
    """Throwaway uids (root only): the candidate's, and a second one for the grader / test runner."""
    run.uid = (_UID_BASE + secrets.randbelow(_UID_SPAN)) if os.geteuid() == 0 else None
    if run.mode in ("shell", "proxy"):
        run.grader_uid = run.uid
        while run.strong and run.grader_uid == run.uid:
            run.grader_uid = _UID_BASE + secrets.randbelow(_UID_SPAN)


def _build_setup(run: _Run, candidate: str, extra: dict) -> None:
    """The harness's setup (plain data, sent on its stdin) and, for the proxy path, the part only the
    trusted side may hold: the harness reads it after it started the candidate's process (the tests,
    their names and tokens never enter that process)."""
    fallback = None if run.strong else Path(tempfile.mkdtemp(prefix="flywheel-sbx-"))
    run.fallback = fallback
    setup: dict = {
        "init_nonce": secrets.token_hex(16),
        "mode": run.mode,
        "tests": list(run.names),
        "candidate": candidate,
        "limits": _limits(run.cfg),
        "strong": run.strong,
        # Scratch space per tmpfs (/tmp and the work dir): four maximal files' worth, at least 64 MiB.
        "tmpfs_mb": max(64, 4 * int(run.cfg.max_file_mb)),
        "uid": run.uid,
        "grader_uid": run.grader_uid,
        "expose": _interpreter_dirs(run.python),
        "phase_seconds": float(run.cfg.wall_seconds) / run.phases,
        "cgroup_procs": run.cgroup.procs if run.cgroup else [],
        "python": os.path.realpath(run.python or PYTHON),
        "fallback_workdir": str(fallback / "work") if fallback else "",
        "fallback_grader_base": str(fallback / "grader") if fallback else "",
    }
    setup.update(extra)
    if run.mode == "proxy":
        setup["runner_uid"] = run.grader_uid
        run.secret = {"tokens": [secrets.token_hex(16) for _ in run.names], "done_token": secrets.token_hex(16),
                      "tests": setup.pop("tests"), "test_source": setup.pop("test_source")}
    run.setup = setup


def _prepare_fallback(run: _Run) -> SandboxResult | None:
    """Weak mode: the work and grader dirs on the host's disk, and a refusal when the interpreter sits
    under a private parent that the throwaway uid cannot traverse."""
    fallback = run.fallback
    if fallback is None:
        return None
    (fallback / "work").mkdir()
    (fallback / "grader").mkdir()
    if run.uid is not None:
        os.chmod(fallback, 0o711)
        hidden = [d for d in run.setup["expose"] if not _world_traversable(d)]
        if hidden and run.mode != "shell":
            # Without a mount namespace a private parent cannot be covered: the sandbox uid could
            # not import the stdlib, and every candidate would fail for our reasons.
            _cleanup(fallback, run.cgroup)
            return run.infra(
                f"weak sandbox mode: interpreter dir {hidden[0]} is not readable by an unprivileged uid; "
                "point flywheel.sandbox.PYTHON at a world-readable interpreter"
            )
    return None


def _argv(run: _Run, site_packages: bool, init_fd: int, result_fd: int) -> list[str]:
    """The harness's command line: ``python -I [-S] -c <boot> init_fd result_fd``, under ``unshare``
    when namespaces are available."""
    flags = ["-I"] if site_packages else ["-I", "-S"]
    argv = [run.python or PYTHON, *flags, "-c", _BOOT, str(init_fd), str(result_fd)]
    if run.strong:
        # --ipc: SysV segments and POSIX queues the candidate creates die with the run.
        ns = ["--pid", "--fork", "--mount-proc", "--kill-child", "--ipc"] + (["--net"] if run.cfg.network == "none" else [])
        argv = [shutil.which("unshare") or "unshare", *ns, *argv]
    return argv


def _payload(run: _Run) -> bytes:
    """The harness's stdin: the framed public setup, then the secret part."""
    public = marshal.dumps(run.setup, 4)
    return b"%08x" % len(public) + public + marshal.dumps(run.secret, 4)


def _execute(run: _Run, site_packages: bool) -> _Output | SandboxResult:
    """Run the harness with its channels (unlinked temporary files) and read them back; whatever
    happened, the weak-mode work dir and the cgroup are removed."""
    try:
        with (
            tempfile.TemporaryFile() as init_f,
            tempfile.TemporaryFile() as result_f,
            tempfile.TemporaryFile() as out_f,
            tempfile.TemporaryFile() as err_f,
        ):
            argv = _argv(run, site_packages, init_f.fileno(), result_f.fileno())
            payload = _payload(run)
            deadline = time.monotonic() + float(run.cfg.wall_seconds) + _GRACE_S * run.phases
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
                return run.infra(f"sandbox could not start: {e}")
            t_exit = _supervise(run, proc, payload, deadline)
            return _read_back(run, init_f, result_f, out_f, err_f, t_spawn, t_exit)
    finally:
        if run.fallback is not None:
            _rmtree_any_owner(run.fallback)
        if run.cgroup is not None and "cgroup" not in run.details:
            run.cgroup.remove()


def _supervise(run: _Run, proc: subprocess.Popen, payload: bytes, deadline: float) -> int:
    """Feed the setup, wait until the harness exits or ``deadline`` (the wall clock plus grace) passes,
    kill its process group, then record and remove the cgroup. Returns the time the harness was gone."""
    try:
        stdin = proc.stdin
        assert stdin is not None  # stdin=PIPE
        try:
            _feed(stdin.fileno(), payload, deadline)
        except (BrokenPipeError, TimeoutError):
            pass  # the harness died or hung before reading: no READY, an infrastructure error
        finally:
            stdin.close()
        if not _wait(proc, max(0.0, deadline - time.monotonic())):
            run.killed_reason = "wall_timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        t_exit = time.monotonic_ns()
        if run.cgroup is not None:
            run.details["cgroup"] = run.cgroup.stats()
            leak = run.cgroup.remove()
            if leak:
                run.details["cgroup_cleanup"] = leak
    return t_exit


def _read_back(run: _Run, init_f, result_f, out_f, err_f, t_spawn: int, t_exit: int) -> _Output:
    result_f.seek(0)
    return _Output(
        init_recs=_records(init_f, run.setup["init_nonce"]),
        result_raw=result_f.read(_RECORD_LIMIT).decode("utf-8", errors="replace"),
        stdout=_read_head(out_f, _OUTPUT_LIMIT),
        stderr=_read_head(err_f, _OUTPUT_LIMIT),
        t_spawn=t_spawn,
        t_exit=t_exit,
    )


def _observe_statuses(run: _Run, out: _Output) -> dict[str, list[str]]:
    """Each worker's fate as trusted init observed it (exit status, signal, or init's own deadline),
    recorded in ``details``; ``killed_reason`` from it and the cgroup's OOM kills."""
    statuses = _statuses(out.init_recs)
    for tag, st in statuses.items():
        run.details[f"{tag.lower()}_status"] = " ".join(st)
    run.killed_reason = _killed_reason(statuses, run.details.get("cgroup") or {}, run.killed_reason)
    return statuses


def _grade(run: _Run, plan: IOPlan | None, out: _Output,
           statuses: dict[str, list[str]]) -> tuple[dict[str, str], list[str]]:
    """Per-test verdicts along the run's path, and what on the result channel was tampering."""
    worker = statuses.get("WORKER")
    missing = "missing: no result recorded" + (f" (worker {' '.join(worker).lower()})" if worker else "")
    per_test: dict[str, str] = {n: missing for n in run.names}
    integrity: list[str] = []
    if run.mode == "io":
        assert plan is not None
        per_test, integrity = _judge_io(plan, out.result_raw, worker)
    elif run.mode == "proxy":
        per_test, integrity = _judge_inproc(run.names, run.secret["tokens"], run.secret["done_token"],
                                            out.result_raw, per_test)
    else:
        per_test = _grade_shell(statuses.get("GRADER"), per_test)
        run.report["grader"] = _grader_note(run, out)
    return per_test, integrity


def _grader_note(run: _Run, out: _Output) -> str:
    """``report["grader"]``: what the shell grader ran under."""
    ready = next((r for r in out.init_recs if r[0] == "GRADER_READY"), None)
    return (
        f"uid {'separate' if run.grader_uid != run.uid else 'same as candidate'}, empty cwd, fresh /tmp, "
        + ("$WORK read-only, symlinks " + ("not followed" if ready and ready[1] == "nosymfollow" else "followed")
           if run.strong else "$WORK writable (weak)")
    )


def _result(run: _Run, per_test: dict[str, str], integrity: list[str], timings: dict[str, float],
            out: _Output) -> SandboxResult:
    """The verdict: passed only on positive evidence for every test, nothing tampered with, in time."""
    if integrity:
        run.details["integrity"] = integrity[:10]
        per_test = {n: "failed: result channel tampered with (" + integrity[0] + ")" for n in run.names}
    n_passed = sum(1 for v in per_test.values() if v == "passed")
    ok = not integrity and n_passed == len(run.names) and run.killed_reason != "wall_timeout"
    timings["total"] = (time.monotonic_ns() - run.t0) / 1e6
    run.details["timings_ms"] = {k: round(v, 2) for k, v in timings.items()}
    return SandboxResult(
        passed=ok,
        tests_total=len(run.names),
        tests_passed=n_passed,
        per_test=per_test,
        stdout=out.stdout,
        stderr=out.stderr,
        duration_s=(time.monotonic_ns() - run.t0) / 1e9,
        isolation=run.iso,
        infra_error=None,
        killed_reason=run.killed_reason,
        details=run.details,
        report=run.report,
    )


# ------------------------------------------------------------------------------------------ helpers


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


def interpreter_blocked(python: str | None = None) -> str | None:
    """Why the sandbox's throwaway uids could not execute the interpreter, or None. Only root runs
    sandboxes as other uids. The sandbox covers a private *ancestor* of the interpreter's directories
    (:func:`_interpreter_dirs`), but never changes a mode inside them: a virtualenv created under
    umask 077 has 0700 directories, so ``exec .../venv/bin/python`` is "Permission denied" to any
    other uid (a test that created its venv after an in-process CLI call had set umask 077 saw
    ``grader exit 126``)."""
    if os.geteuid() != 0:
        return None
    exe = os.path.realpath(python or PYTHON)
    top = next((d for d in _interpreter_dirs(python) if exe.startswith(d + "/")), os.path.dirname(exe))
    path, steps = top, [top]
    for part in Path(os.path.relpath(exe, top)).parts:
        path = os.path.join(path, part)
        steps.append(path)
    for p in steps:
        try:
            mode = os.stat(p).st_mode
        except OSError as e:
            return f"the sandbox's interpreter {exe} cannot be reached: {p}: {e.strerror}"
        if not mode & 0o001:
            return (
                f"the sandbox's uids cannot run the interpreter {exe}: {p} is mode {mode & 0o777:04o}, closed to "
                f"other users (a virtualenv created under umask 077?); make it readable (chmod -R go+rX {top}) "
                "or point flywheel.sandbox.PYTHON at a world-readable interpreter"
            )
    return None


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
