"""Sandbox and grading findings of the second integrity review (issue 31): one test per property.

Each test reproduced its finding on the code before the fix (the docstring names the finding) and
checks the property the fix gives, not the mechanism. Tests that need namespaces are skipped, with
the reason, on a machine that has none.
"""

from __future__ import annotations

import json
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
from flywheel.io_tests import compile_io, decode_value
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


def _venv_under(tmp: Path) -> Path:
    """A virtualenv and a copy of the project, both under ``tmp`` (a /tmp path when pytest's base temp
    is there, as a checkout under /tmp is): the layout in which every sandboxed verdict was an
    infrastructure error."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--copies", str(venv)], check=True, timeout=120)
    proj = tmp / "checkout"
    shutil.copytree(Path(flywheel.__file__).parent, proj / "flywheel",
                    ignore=shutil.ignore_patterns("__pycache__"))
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
            cfg = SandboxConfig(cpu_seconds=2, memory_mb=256, wall_seconds=8)
            good = "def add(a, b):\\n    return a + b\\n"
            io = "from solution import add\\n\\ndef test_a():\\n    assert add(2, 3) == 5\\n"
            loop = "from solution import add\\n\\ndef test_a():\\n    for x in [2]:\\n        assert add(x, 3) == 5\\n"
            out = {"file": flywheel.__file__, "report": sb.isolation_report()["warning"]}
            for name, r in (("io", sb.run_python_tests(good, io, cfg)),
                            ("free", sb.run_python_tests(good, loop, cfg)),
                            ("site", sb.run_python_tests(good, io, cfg, site_packages=True)),
                            ("shell", sb.run_shell("echo hi > out", "python -c 'print(1)' && grep -q hi $WORK/out", cfg))):
                out[name] = [r.passed, r.infra_error]
            print(json.dumps(out))
            """
        )
        p = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=180, cwd="/")
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["file"].startswith(str(tmp)), out["file"]
        for name in ("io", "free", "site", "shell"):
            assert out[name] == [True, None], (name, out[name])
        assert out["report"] == ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@needs_ns
def test_isolation_report_says_when_the_sandbox_cannot_start(monkeypatch):
    """Finding 1, reporting: ``flywheel init``/``status`` printed "netns" and no warning on a machine
    where every sandbox run failed to start; the report now comes from a real probe run."""
    sb._probe_sandbox.cache_clear()
    monkeypatch.setattr(sb, "PYTHON", "/nonexistent/bin/python3")
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
