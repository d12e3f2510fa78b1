"""Sandbox and grading findings of the second integrity review (issue 31): one test per property.

Each test reproduced its finding on the code before the fix (the docstring names the finding) and
checks the property the fix gives, not the mechanism. Tests that need namespaces are skipped, with
the reason, on a machine that has none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import flywheel
import flywheel.sandbox as sb
from flywheel.config import SandboxConfig
from flywheel.io_grading import compile_io, decode_value
from flywheel.sandbox import isolation_mode, run_python_tests

CFG = SandboxConfig(cpu_seconds=2, memory_mb=256, max_processes=16, max_file_mb=2, max_open_files=32, wall_seconds=6)
STRONG = isolation_mode() == "netns"
needs_ns = pytest.mark.skipif(not STRONG, reason=f"needs namespaces: {isolation_mode()}")

# Free-form tests (the loop keeps them off the input -> expected-output path).
LOOP_TESTS = textwrap.dedent(
    """
    from solution import add

    def test_table():
        for a, b, s in [(2, 3, 5), (-4, 1, -3)]:
            assert add(a, b) == s

    class TestAdd:
        def test_typed(self):
            for a, b, s in [(10, 20, 30)]:
                r = add(a, b)
                assert type(r) is int and isinstance(r, int) and r == s
    """
)
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
# 2**61 - 1: CPython hashes an int modulo this prime, so all its multiples share one hash.
_HASH_PRIME = (1 << 61) - 1


# ------------------------------------------------------------------------ finding 10: line separators


@needs_ns
def test_failure_message_with_unicode_line_separators_is_not_read_as_tampering():
    """Finding 10: the harness escaped only \\n and \\r while the supervisor split records with
    ``splitlines()``, which also breaks at \\x0c, \\x1c-\\x1e, \\x85, \\u2028, \\u2029: an honest
    failure message holding one of them was read as a forged record and failed every test."""
    tests = textwrap.dedent(
        """
        from solution import add

        def test_ok():
            for a in [1]:
                assert add(a, 1) == 2

        def test_message():
            for a in [1]:
                assert add(a, 1) == 3, "form\\x0cfeed, group\\x1dsep, next\\x85line, line\\u2028para\\u2029end"
        """
    )
    r = run_python_tests(GOOD, tests, CFG, grading="in_process")
    assert r.infra_error is None, r.infra_error
    assert "integrity" not in r.details, r.details.get("integrity")
    assert r.per_test["test_ok"] == "passed"
    msg = r.per_test["test_message"]
    assert msg.startswith("failed: ") and "AssertionError" in msg
    # The separators arrive escaped, on one record: nothing of the message became a record of its own.
    assert "\\x0c" in msg and "\\u2028" in msg and "para" in msg and "end" in msg
    assert r.tests_passed == 1


def test_supervisor_reads_records_split_on_newline_only():
    """Finding 10, supervisor side: a record is one ``\\n``-terminated line whatever else it holds."""
    tokens, done = ["t0", "t1"], "d0"
    raw = "FAIL 0 boom\u2028still the message\x0c\nPASS 1 t1\nDONE d0\n"
    per_test, integrity = sb._judge_inproc(["a", "b"], tokens, done, raw, {"a": "missing", "b": "missing"})
    assert integrity == []
    assert per_test["b"] == "passed"
    assert per_test["a"].startswith("failed: boom") and "still the message" in per_test["a"]


# --------------------------------------------------------------------- finding 7: hash-colliding data


def _colliding_set_payload(n: int) -> str:
    return '{"s":[' + ",".join(str(_HASH_PRIME * (i + 1)) for i in range(n)) + "]}"


def test_decoding_a_hash_colliding_set_is_refused_quickly():
    """Finding 7: the supervisor built sets/dicts from the candidate's result with no bound on hash
    collisions; integers that are multiples of 2**61 - 1 all hash alike, so decoding 20,000 of them
    took seconds of the verifier's CPU (quadratic), per call, outside every sandbox limit."""
    for payload in (_colliding_set_payload(20_000),
                    '{"d":[' + ",".join(f"[{_HASH_PRIME * (i + 1)},0]" for i in range(20_000)) + "]}"):
        t = time.process_time()
        with pytest.raises(ValueError, match="collid"):
            decode_value(payload)
        assert time.process_time() - t < 0.5
    # Honest sets and dicts still decode, equal keys (1, 1.0, True) included.
    assert decode_value('{"s":[1,2,3,{"f":"1.0"},true]}') == {1, 2, 3}
    assert decode_value('{"d":[[1,"a"],[-1,"b"],[-2,"c"]]}') == {1: "a", -1: "b", -2: "c"}


def test_a_check_that_makes_a_set_of_a_colliding_result_is_bounded():
    """Finding 7, checks: ``set(f())`` in a trusted check hashes the candidate's list the same way."""
    plan = compile_io("from solution import f\n\ndef test_a():\n    assert set(f()) == {1}\n")
    payload = "[" + ",".join(str(_HASH_PRIME * (i + 1)) for i in range(20_000)) + "]"
    t = time.process_time()
    out = plan.judge(None, {0: ("ok", decode_value(payload))})
    assert time.process_time() - t < 0.5
    assert out["test_a"].startswith("failed:") and "collid" in out["test_a"]
    assert compile_io("from solution import f\n\ndef test_a():\n    assert set(f()) == {1, 2}\n").judge(
        None, {0: ("ok", [2, 1, 1])})["test_a"] == "passed"


# ----------------------------------------------------------------- finding 1: a checkout under /tmp


def _venv_under(tmp: Path, umask: int = 0o022) -> Path:
    """A virtualenv and a copy of the project, both under ``tmp`` (a /tmp path when pytest's base temp
    is there, as a checkout under /tmp is): the layout in which every sandboxed verdict was an
    infrastructure error. Created under ``umask``, whatever this process's is: an in-process CLI call
    (``flywheel.cli.common.load``) sets 077, and a venv made after one in the same pytest worker was
    closed to the sandbox's uids -- ``grader exit 126`` when files ran in parallel, never serially."""
    venv = tmp / "venv"
    old = os.umask(umask)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--copies", str(venv)], check=True, timeout=120)
        proj = tmp / "checkout"
        shutil.copytree(Path(flywheel.__file__).parent, proj / "flywheel",
                        ignore=shutil.ignore_patterns("__pycache__"))
    finally:
        os.umask(old)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The project first (it must be the copy under tmp), then the dependencies of the main venv.
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    Path(site, "00_checkout.pth").write_text(f"{proj}\n")
    Path(site, "01_deps.pth").write_text(f"{deps}\n")
    return py


@needs_ns
def test_sandbox_works_when_the_project_and_its_venv_live_under_tmp():
    """Finding 1: the sandbox mounts a private /tmp, which hid an interpreter prefix, a venv or the
    project living under /tmp ("sandbox did not start: ... No such file or directory"): an honest
    solution scored as an infrastructure error. Now it passes, on every path."""
    tmp = Path(tempfile.mkdtemp(prefix="fw-sbx-tmp-", dir="/tmp"))  # /tmp itself, wherever pytest's base is
    try:
        py = _venv_under(tmp)
        script = textwrap.dedent(
            """
            import json, flywheel, flywheel.sandbox as sb
            from flywheel.config import SandboxConfig
            cfg = SandboxConfig(cpu_seconds=5, memory_mb=256, wall_seconds=30)  # a loaded 2-core machine
            good = "def add(a, b):\\n    return a + b\\n"
            io = "from solution import add\\n\\ndef test_a():\\n    assert add(2, 3) == 5\\n"
            loop = "from solution import add\\n\\ndef test_a():\\n    for x in [2]:\\n        assert add(x, 3) == 5\\n"
            out = {"file": flywheel.__file__, "report": sb.isolation_report()["warning"]}
            for name, r in (("io", sb.run_python_tests(good, io, cfg)),
                            ("free", sb.run_python_tests(good, loop, cfg)),
                            ("site", sb.run_python_tests(good, io, cfg, site_packages=True)),
                            ("shell", sb.run_shell("echo hi > out", "python -c 'print(1)' && grep -q hi $WORK/out", cfg))):
                out[name] = [r.passed, r.infra_error]
                out[name + " why"] = {"per_test": r.per_test, "killed": r.killed_reason, "s": r.duration_s,
                                      "stdout": r.stdout[-400:], "stderr": r.stderr[-400:]}
            print(json.dumps(out))
            """
        )
        p = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=180, cwd="/")
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["file"].startswith(str(tmp)), out["file"]
        for name in ("io", "free", "site", "shell"):
            assert out[name] == [True, None], (name, out[name], out[name + " why"])
        assert out["report"] == ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@needs_ns
@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the sandbox as other uids")
def test_an_interpreter_closed_to_the_sandbox_uids_is_an_infrastructure_error_not_a_failed_candidate():
    """A venv created under umask 077 (0700 directories): the grader's ``python`` could not be executed
    by its uid, ``grader exit 126``, and an honest shell candidate was scored *failed*. Now the run is
    an infrastructure error naming the closed directory and the fix, and the report warns."""
    tmp = Path(tempfile.mkdtemp(prefix="fw-sbx-077-", dir="/tmp"))
    try:
        py = _venv_under(tmp, umask=0o077)
        script = textwrap.dedent(
            """
            import json, flywheel.sandbox as sb
            from flywheel.config import SandboxConfig
            from flywheel.sandbox import report, supervisor
            cfg = SandboxConfig(cpu_seconds=5, memory_mb=256, wall_seconds=30)
            r = sb.run_shell("echo hi > out", "python -c 'print(1)' && grep -q hi $WORK/out", cfg)
            io = sb.run_python_tests("def add(a, b):\\n    return a + b\\n",
                                     "from solution import add\\n\\ndef test_a():\\n    assert add(2, 3) == 5\\n", cfg)
            print(json.dumps({"shell": [r.passed, r.infra_error, r.per_test], "io": [io.passed, io.infra_error],
                              "warning": report.isolation_report(cfg)["warning"]}))
            """
        )
        p = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=180, cwd="/")
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        passed, infra, per_test = out["shell"]
        assert passed is False and infra is not None, out  # before: infra None, per_test "grader exit 126"
        venv = str(tmp / "venv")
        assert f"{venv} is mode 0700" in infra and "umask 077" in infra and f"chmod -R go+rX {venv}" in infra
        assert out["io"] == [True, None]  # python_tests fork the interpreter: unaffected, still graded
        assert "shell verdicts are infrastructure errors" in out["warning"] and venv in out["warning"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@needs_ns
def test_isolation_report_says_when_the_sandbox_cannot_start(monkeypatch):
    """Finding 1, reporting: ``flywheel init``/``status`` printed "netns" and no warning on a machine
    where every sandbox run failed to start; the report now comes from a real probe run."""
    sb._probe_sandbox.cache_clear()
    monkeypatch.setattr(sb.supervisor, "PYTHON", "/nonexistent/bin/python3")
    try:
        rep = sb.isolation_report(SandboxConfig())
        assert rep["trusted"] is False
        assert "cannot start" in rep["warning"] and "/nonexistent" in rep["warning"]
        assert "infrastructure error" in rep["verdicts"]
    finally:
        sb._probe_sandbox.cache_clear()
    monkeypatch.undo()
    rep = sb.isolation_report(SandboxConfig())
    assert rep["trusted"] is True and "cannot start" not in rep["warning"]


# ------------------------------------------------------ finding 2: free-form tests and the candidate

# The reproduction: a pytest-style class asserting the type and the value.
TYPED_TESTS = textwrap.dedent(
    """
    from solution import add

    class TestTyped:
        def test_one(self):
            for a, b, s in [(2, 3, 5)]:
                r = add(a, b)
                assert type(r) is int and isinstance(r, int) and r == s

        def test_two(self):
            for a, b, s in [(10, 20, 30)]:
                r = add(a, b)
                assert type(r) is int and isinstance(r, int) and r == s
    """
)
ALWAYS_EQUAL = textwrap.dedent(
    """
    class _Any:
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        __hash__ = object.__hash__

    def add(a, b):
        return _Any()
    """
)
# 12 lines, as in the issue: find the test classes by their module, reach the tests' builtins
# through a test method's globals, replace type/isinstance, and replace the remaining test methods.
SUBCLASS_WALK = ALWAYS_EQUAL.split("def add")[0] + textwrap.dedent(
    """
    def add(a, b):
        for cls in object.__subclasses__():
            if getattr(cls, "__module__", None) == "tests":
                for name, fn in list(vars(cls).items()):
                    if name.startswith("test") and hasattr(fn, "__globals__"):
                        g = fn.__globals__["__builtins__"]
                        g = g if type(g) is dict else vars(g)
                        g["type"] = lambda *a: int
                        g["isinstance"] = lambda *a: True
                        setattr(cls, name, lambda self: None)
        return _Any()
    """
)


@needs_ns
@pytest.mark.parametrize("grading", ["auto", "in_process"])
def test_in_process_eq_override_cannot_pass(grading):
    """Finding 2a: free-form tests ran in the candidate's interpreter, so an object whose ``__eq__``
    always returns True passed ``assert add(a, b) == s``. The tests now run in a process of their
    own; a candidate object reaches them only as an opaque handle whose ``==`` is identity."""
    forged = run_python_tests(ALWAYS_EQUAL, LOOP_TESTS, CFG, grading=grading)
    assert forged.infra_error is None
    assert not forged.passed and forged.tests_passed == 0, forged.per_test
    honest = run_python_tests(GOOD, LOOP_TESTS, CFG, grading=grading)
    assert honest.infra_error is None and honest.passed, honest.per_test
    assert honest.report["grading"].startswith("proxy")


@needs_ns
def test_in_process_subclass_walk_cannot_rewrite_the_tests_or_their_builtins():
    """Finding 2b: walking ``object.__subclasses__()`` found the test classes; through a test
    method's ``__globals__["__builtins__"]`` the candidate replaced ``type``/``isinstance`` in the
    tests' builtins and replaced the remaining ``test*`` methods: 2 of 2 passed where an honest wrong
    answer got 0 of 2. Now the test classes are not in the candidate's process at all."""
    assert run_python_tests(GOOD, TYPED_TESTS, CFG).passed
    wrong = run_python_tests(WRONG, TYPED_TESTS, CFG)
    assert wrong.tests_passed == 0
    forged = run_python_tests(SUBCLASS_WALK, TYPED_TESTS, CFG)
    assert forged.infra_error is None
    assert not forged.passed and forged.tests_passed == 0, forged.per_test


@needs_ns
def test_proxy_path_keeps_free_form_tests_working():
    """Finding 2, what still works across the process boundary: objects the solution returns
    (attributes, methods, indexing, len, iteration), unittest classes, exceptions by built-in class,
    module constants; a solution that exits fails every test instead of hanging."""
    tests = textwrap.dedent(
        """
        import unittest
        import solution
        from solution import Stack, LIMIT

        def test_stack():
            s = Stack()
            for x in [1, 2, 3]:
                s.push(x)
            assert len(s) == 3 and s.items[-1] == 3 and list(s) == [1, 2, 3] and s.pop() == 3
            assert LIMIT == 10 and solution.LIMIT == 10

        class TestErrors(unittest.TestCase):
            def test_empty(self):
                with self.assertRaises(IndexError):
                    Stack().pop()
                try:
                    Stack().boom()
                except ValueError as e:
                    assert type(e).__name__ == "StackError" and "boom" in str(e)
                else:
                    raise AssertionError("no exception")
        """
    )
    sol = textwrap.dedent(
        """
        LIMIT = 10

        class StackError(ValueError):
            pass

        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
            def __len__(self):
                return len(self.items)
            def __iter__(self):
                return iter(self.items)
            def boom(self):
                raise StackError("boom")
        """
    )
    r = run_python_tests(sol, tests, CFG)
    assert r.passed, r.per_test
    gone = run_python_tests(sol + "import os\nos._exit(0)\n", tests, CFG)
    assert not gone.passed and gone.infra_error is None
    assert all(v.startswith("failed: importing solution failed") for v in gone.per_test.values()), gone.per_test


# --------------------------------------------------- finding 13: host unix sockets, CPU of a whole run


@needs_ns
@pytest.mark.parametrize("grading", ["io", "proxy"])
def test_host_unix_socket_is_unreachable_from_the_sandbox(grading):
    """Finding 13: the network namespace hides every host network but not the host's Unix sockets
    whose files the sandbox can see (a database, a container runtime, flywheel's own store share).
    A candidate connected to one here before; now ``socket(AF_UNIX)`` is refused by seccomp."""
    import socket
    import threading

    path = f"/run/fw-sbx-test-{os.getpid()}.sock"
    got: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)  # any uid may connect: only the sandbox stands in the way
    srv.listen(1)
    srv.settimeout(8)

    def accept():
        try:
            conn, _ = srv.accept()
            got.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    attack = textwrap.dedent(
        f"""
        import socket

        def add(a, b):
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect({path!r})
                s.sendall(b"escaped")
                return a + b
            except OSError as e:
                raise RuntimeError(f"refused: {{e}}")
        """
    )
    tests = "from solution import add\n\ndef test_a():\n    assert add(2, 3) == 5\n"
    if grading == "proxy":
        tests = tests.replace("    assert add(2, 3) == 5", "    for x in [2]:\n        assert add(x, 3) == 5")
    try:
        r = run_python_tests(attack, tests, CFG, grading=grading)
        srv.shutdown(socket.SHUT_RDWR)  # ends accept() at once when nothing connected
        t.join(10)
    finally:
        srv.close()
        os.unlink(path)
    assert got == [], "the candidate reached a host unix socket"
    assert r.infra_error is None and not r.passed
    assert "refused" in r.per_test["test_a"] and "Operation not permitted" in r.per_test["test_a"]
    assert r.report["seccomp"].startswith("socket(AF_UNIX)")


SPIN = textwrap.dedent(
    """
    import os

    def add(a, b):
        for _ in range(3):
            if os.fork() == 0:
                break
        while True:
            pass
    """
)


@needs_ns
def test_cpu_of_a_whole_run_is_bounded_by_its_cgroup():
    """Finding 13: CPU was limited per process only (RLIMIT_CPU), so 64 processes x 10 s of CPU fit in
    one run. ``sandbox.cpus`` now caps the CPU bandwidth of all the run's processes together
    (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), so a run uses at most cpus x wall seconds.
    Four spinning processes for a 4 s wall clock at 0.25 CPUs: about 1 s of CPU, not 4 x 4."""
    import resource

    support = sb._cpu_support()
    if support.version == 0:
        pytest.skip(f"no writable cpu cgroup on this machine: {support.describe}")
    cfg = SandboxConfig(cpu_seconds=30, memory_mb=256, max_processes=16, wall_seconds=4, cpus=0.25)
    tests = "from solution import add\n\ndef test_a():\n    assert add(2, 3) == 5\n"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run_python_tests(SPIN, tests, cfg)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.infra_error is None and not r.passed and r.killed_reason == "wall_timeout"
    assert "cpu" in r.report["cgroup"]
    # 0.25 CPUs x 4 s = 1 s, plus the interpreter's start and teardown outside the throttled phase.
    assert used < 0.25 * 4 + 0.6, f"{used:.2f} s of CPU in one run"


@needs_ns
def test_flywheel_status_says_when_the_sandbox_cannot_start(home, tmp_path, monkeypatch):
    """Finding 1, the command a user runs: ``flywheel status`` names the reason in its sandbox
    warning instead of reporting a working "netns" sandbox."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    monkeypatch.chdir(tmp_path)
    sb._probe_sandbox.cache_clear()
    monkeypatch.setattr(sb.supervisor, "PYTHON", "/nonexistent/bin/python3")
    try:
        r = CliRunner().invoke(app, ["status"])
    finally:
        sb._probe_sandbox.cache_clear()
    assert r.exit_code == 0, r.output
    assert "cannot start" in r.stderr and "/nonexistent/bin/python3" in r.stderr
