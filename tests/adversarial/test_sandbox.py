"""Adversarial sandbox suite: one test per attack. Each must score not-passed and leave the host unharmed.

The tests use the default isolation of this machine (root + unshare: pid/mount/net namespaces) and
tight limits so the whole file stays fast; ``isolation`` is asserted so a silent fallback to the weak
mode fails loudly instead of weakening every test. The python attacks run on both grading paths
(``io``: the supervisor judges the candidate's outputs; ``in_process``, now the ``proxy`` path: the
tests run in a process of their own against a proxy of the candidate).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from flywheel.config import SandboxConfig
from flywheel.sandbox import isolation_mode, run_python_tests, run_shell

TESTS = textwrap.dedent(
    """
    from solution import add

    def test_small():
        assert add(2, 3) == 5

    def test_negative():
        assert add(-4, 1) == -3

    class TestMore:
        def test_zero(self):
            assert add(0, 0) == 0
    """
)
GOOD = "def add(a, b):\n    return a + b\n"
CFG = SandboxConfig(cpu_seconds=2, memory_mb=256, max_processes=16, max_file_mb=2, max_open_files=32, wall_seconds=4)

pytestmark = pytest.mark.skipif(isolation_mode() != "netns", reason=f"needs namespaces: {isolation_mode()}")
GRADING = "auto"


@pytest.fixture(params=["io", "in_process"], autouse=True)
def grading(request, monkeypatch):
    monkeypatch.setitem(globals(), "GRADING", request.param)
    return request.param


def run(candidate: str, tests: str = TESTS, cfg: SandboxConfig = CFG):
    r = run_python_tests(candidate, tests, cfg, grading=GRADING)
    assert r.infra_error is None, r.infra_error
    assert r.isolation == "netns"
    # "in_process" is the former name of the proxy path (the tests no longer run in the candidate's process).
    assert r.report["grading"].startswith("proxy" if GRADING == "in_process" else GRADING)
    return r


def test_honest_solution_passes_and_wrong_one_fails():
    ok = run(GOOD)
    assert ok.passed and ok.tests_passed == ok.tests_total == 3
    bad = run("def add(a, b):\n    return a - b\n")
    assert not bad.passed and bad.tests_passed == 1  # only add(0, 0) agrees
    assert bad.per_test["test_small"].startswith("failed: AssertionError")


def test_sys_exit_zero_before_tests():
    r = run("import sys\nsys.exit(0)\n" + GOOD)
    assert not r.passed and r.tests_passed == 0


def test_sys_exit_inside_the_tested_function():
    r = run("import sys\ndef add(a, b):\n    sys.exit(0)\n")
    assert not r.passed and r.tests_passed == 0


def test_os_exit_zero():
    r = run("import os\nos._exit(0)\n")
    assert not r.passed and r.tests_passed == 0
    r = run("import os\ndef add(a, b):\n    os._exit(0)\n")
    assert not r.passed


def test_print_fake_results_and_forge_records_without_nonce():
    forge = textwrap.dedent(
        """
        import os, sys
        print("3 passed"); print("PASS 0"); print("OK")
        for fd in range(3, 64):
            try:
                for i in range(3):
                    os.write(fd, f"deadbeef PASS {i} \\n".encode())
                os.write(fd, b"deadbeef DONE -1 \\n")
            except OSError:
                pass
        os._exit(0)
        """
    )
    r = run(forge)
    assert not r.passed and r.tests_passed == 0


def test_monkeypatching_the_runner():
    attack = textwrap.dedent(
        """
        import builtins, os, sys, unittest
        os.write = lambda fd, data: len(data)            # swallow failure reports
        builtins.AssertionError = type("Nope", (Exception,), {})
        unittest.TestCase.run = lambda self, result=None: None
        for modname in ("__main__", "_sandbox_harness"):   # the harness module, however it was loaded
            main = sys.modules.get(modname)
            for name in dir(main) if main is not None else []:
                if callable(getattr(main, name, None)):
                    setattr(main, name, lambda *a, **k: None)
        def add(a, b):
            return 0
        """
    )
    r = run(attack)
    assert not r.passed
    assert r.per_test["test_small"].startswith("failed")


def test_introspection_to_steal_the_nonce_is_refused(grading):
    if grading == "io":
        pytest.skip("io: the candidate's process holds no secret; introspection finds nothing to steal")
    attack = textwrap.dedent(
        """
        import sys, gc
        stolen = []
        try:
            f = sys._getframe(1)
            while f is not None:
                stolen.append(dict(f.f_locals)); f = f.f_back
        except Exception as e:
            stolen.append(e)
        try:
            gc.get_objects()
        except Exception as e:
            stolen.append(e)
        try:
            raise KeyError
        except KeyError as e:
            try:
                e.__traceback__.tb_frame
            except Exception as e2:
                stolen.append(e2)
        try:
            open("/proc/self/mem", "rb")
        except Exception as e:
            stolen.append(e)
        try:
            import ctypes; ctypes.string_at(id(stolen), 64)
        except Exception as e:
            stolen.append(e)
        try:
            stolen += [o for o in gc.get_objects() if type(o) is dict]
        except Exception as e:
            stolen.append(e)
        # The proxy path leaves introspection to the candidate (its process holds nothing that
        # decides a verdict); what it finds must hold no token, test or test name.
        def secret(d):
            return type(d) is dict and any(k in d for k in ("tokens", "done_token", "test_source", "tests"))
        assert not any(secret(d) or (type(d) is dict and any(secret(v) for v in d.values())) for d in stolen), \
            "introspection succeeded"
        def add(a, b):
            return -1
        """
    )
    r = run(attack)
    assert not r.passed and r.tests_passed == 0
    assert "introspection succeeded" not in r.per_test["test_small"]


def test_fork_to_report_twice_is_not_a_pass():
    attack = textwrap.dedent(
        """
        import os
        _pid = os.fork()
        _guess = 5 if _pid == 0 else -3
        def add(a, b):
            return _guess
        """
    )
    r = run(attack)
    assert not r.passed


def test_deleting_and_rewriting_test_files():
    attack = textwrap.dedent(
        """
        import glob, os
        for pattern in ("/tmp/**", "/tmp/flywheel-sbx-*/**", "**/test*"):
            for p in glob.glob(pattern, recursive=True):
                try:
                    if os.path.isfile(p):
                        open(p, "w").write("def test_small():\\n    pass\\n")
                except OSError:
                    pass
        def add(a, b):
            return 0
        """
    )
    r = run(attack)
    assert not r.passed and r.per_test["test_small"].startswith("failed")
    assert r.tests_total == 3  # the test list came from the supervisor, not from files in the sandbox


def test_reading_the_expected_answers():
    attack = textwrap.dedent(
        """
        import glob, os
        found = []
        for p in glob.glob("/tmp/**", recursive=True) + glob.glob("/tmp/flywheel-sbx-*/*"):
            try:
                found.append(open(p).read())
            except OSError:
                pass
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                for f in ("cmdline", "environ"):
                    try:
                        found.append(open(f"/proc/{pid}/{f}", "rb").read().decode(errors="replace"))
                    except OSError:
                        pass
        blob = "\\n".join(found)
        def add(a, b):
            # pass only if the tests or the setup (with the nonce) leaked; the needles are split so
            # that the candidate's own source (readable in its work dir) does not contain them
            assert ("add(2, " + "3) == 5") in blob or ('"non' + 'ce"') in blob, "nothing leaked"
            return a + b
        """
    )
    r = run(attack)
    assert not r.passed and r.tests_passed == 0
    assert "nothing leaked" in r.per_test["test_small"]


def test_fork_bomb():
    attack = textwrap.dedent(
        """
        import os
        n = 0
        while n < 10000:
            try:
                if os.fork() == 0:
                    while True:
                        try: os.fork()
                        except OSError: pass
                n += 1
            except OSError:
                break
        def add(a, b):
            # correct only if the bomb was NOT contained: a contained bomb must score not-passed
            return a + b if n >= 1000 else -1
        """
    )
    r = run(attack)
    assert not r.passed and r.tests_passed == 0
    # The bomb was contained by RLIMIT_NPROC: the harness still ran every test to completion, and the
    # run ended by itself, not at the wall limit (the sandbox's own report, not this machine's clock).
    assert all(v.startswith("failed: AssertionError") for v in r.per_test.values()), r.per_test
    assert r.killed_reason != "wall_timeout", r.killed_reason
    assert _leftover_sandbox_processes() == []


def test_memory_bomb():
    r = run("blob = bytearray(2 * 1024**3)\n" + GOOD)
    assert not r.passed
    assert "MemoryError" in r.per_test["test_small"]


def test_infinite_loop():
    cfg = CFG.model_copy(update={"cpu_seconds": 1, "wall_seconds": 2.0})
    r = run("while True:\n    pass\n", cfg=cfg)
    assert not r.passed and r.tests_passed == 0
    # Stopped by a limit, as the sandbox reports it. (An elapsed-time bound measured here, "< wall + 3 s",
    # measured this machine's load as much as the sandbox.)
    assert r.killed_reason in ("cpu_time_limit", "wall_timeout") or "killed" in (r.killed_reason or "")


def test_huge_file():
    attack = textwrap.dedent(
        """
        import os
        written = 0
        try:
            with open("big.bin", "wb") as f:
                for _ in range(1024):
                    f.write(b"x" * (1 << 20)); written += 1
        except OSError:
            pass
        for i in range(100):   # many medium files: bounded by the tmpfs size, not just RLIMIT_FSIZE
            try:
                with open(f"f{i}.bin", "wb") as f:
                    f.write(b"y" * (1 << 20))
            except OSError:
                break
        def add(a, b):
            return -1
        """
    )
    before = _disk_free()
    r = run(attack)
    assert not r.passed
    assert before - _disk_free() < 64 * 1024 * 1024  # nothing landed on the host disk


def test_network_connection():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # connections would queue in the backlog even without accept()
    port = server.getsockname()[1]
    attack = textwrap.dedent(
        f"""
        import socket
        def add(a, b):
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            s.sendall(b"exfiltrate")
            return a + b
        """
    )
    try:
        r = run(attack)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert not r.passed and r.tests_passed == 0
    assert "OSError" in r.per_test["test_small"] or "unreachable" in r.per_test["test_small"].lower()


def test_background_process_outliving_the_run(tmp_path):
    marker = f"flywheel-orphan-{os.getpid()}-{time.monotonic_ns()}"
    attack = textwrap.dedent(
        f"""
        import os, subprocess
        subprocess.Popen(["/bin/sh", "-c", "exec -a {marker} sleep 900"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sleep", ["{marker}", "900"])
        def add(a, b):
            return a - b
        """
    )
    r = run(attack)
    assert not r.passed
    # Poll until they are gone rather than sleep then look once: a loaded machine may take a moment
    # to reap them. They sleep 900 s, so a survivor cannot pass by ending on its own within 60 s.
    deadline = time.monotonic() + 60
    while (out := subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()):
        if time.monotonic() > deadline:
            for pid in out:  # do not leave them behind
                os.kill(int(pid), signal.SIGKILL)
            break
        time.sleep(0.1)
    assert out == [], f"background processes survived: {out}"


def test_shell_candidate_cannot_tamper_with_the_grader():
    grader = 'test "$(cat "$WORK/answer.txt")" = 42'
    assert run_shell("echo 42 > answer.txt", grader, CFG).passed
    attack = textwrap.dedent(
        """
        echo 41 > answer.txt
        # try to make the grader pass anyway: fake binaries on PATH, rc files, a late rewrite
        mkdir -p bin; printf '#!/bin/sh\\nexit 0\\n' > bin/test; chmod +x bin/test
        printf 'exit 0\\n' > .bashrc
        ( sleep 1; echo 42 > answer.txt ) &
        exit 0
        """
    )
    r = run_shell(attack, grader, CFG)
    assert r.infra_error is None and not r.passed
    assert r.per_test["grader"].startswith("failed")


def test_host_unharmed_after_the_suite():
    # Nothing left behind in the host temp dir and no sandbox processes alive.
    import tempfile

    left = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("flywheel-sbx-")]
    assert left == [] or all(_is_recent_other_run(p) for p in left)
    assert _leftover_sandbox_processes() == []


def _is_recent_other_run(name: str) -> bool:
    # Other engineers' concurrent sandboxes may exist right now; ours are all removed synchronously.
    import tempfile

    return time.time() - os.stat(os.path.join(tempfile.gettempdir(), name)).st_mtime < 30


def _leftover_sandbox_processes() -> list[str]:
    """Sandbox processes (uids 200000-299999) alive now, except those of another pytest-xdist worker of
    this run (`make test` runs files in parallel: a sibling worker's sandbox is running, not left over).
    A process this worker leaked is ours or an orphan, never below a sibling."""
    me = os.getpid()
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,uid=,args="], capture_output=True, text=True).stdout
    procs: dict[int, tuple[int, int, str]] = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            procs[int(parts[0])] = (int(parts[1]), int(parts[2]), line)
    parent = procs.get(me, (0, 0, ""))[0]
    siblings = {pid for pid, (ppid, _, _) in procs.items()
                if os.environ.get("PYTEST_XDIST_WORKER") and ppid == parent and pid != me and parent > 1}

    def below_a_sibling(pid: int) -> bool:
        seen = set()
        while pid in procs and pid not in seen and pid > 1:
            seen.add(pid)
            if pid in siblings:
                return True
            pid = procs[pid][0]
        return False

    return [line for pid, (_, uid, line) in procs.items()
            if 200_000 <= uid < 300_000 and pid != me and not below_a_sibling(pid)]


def _disk_free() -> int:
    import tempfile

    st = os.statvfs(tempfile.gettempdir())
    return st.f_bavail * st.f_frsize


def test_weak_mode_is_refused_unless_allowed_and_then_still_needs_positive_evidence(monkeypatch):
    import flywheel.sandbox as sb

    monkeypatch.setattr(sb.isolation, "isolation_mode", lambda: "weak: simulated (no unshare)")
    refused = run_python_tests(GOOD, TESTS, CFG, grading=GRADING)
    assert refused.infra_error and "sandbox.allow_weak" in refused.infra_error and not refused.passed
    weak = CFG.model_copy(update={"allow_weak": True})
    if os.path.exists("/usr/bin/python3"):
        monkeypatch.setattr(sb.supervisor, "PYTHON", "/usr/bin/python3")  # world-readable: the uid drop still works
    r = run_python_tests(GOOD, TESTS, weak, grading=GRADING)
    if r.infra_error:  # this interpreter sits under a private dir (pyenv in /root): refusing is honest
        assert "not readable by an unprivileged uid" in r.infra_error
        return
    assert r.passed and r.isolation.startswith("weak:") and r.report["mode"] == "weak"
    bad = run_python_tests("import os\nos._exit(0)\n", TESTS, weak, grading=GRADING)
    assert not bad.passed and bad.infra_error is None
    shell = run_shell("echo 42 > answer.txt", 'test "$(cat "$WORK/answer.txt")" = 42', weak)
    assert shell.passed and shell.infra_error is None and shell.weak
