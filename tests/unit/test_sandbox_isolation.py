"""What a machine's sandbox isolation means for verdicts: weak mode, cgroup selection, training data,
the judge's failure/infra boundary, and how init/status/the cycle report it."""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest

import flywheel.sandbox as sb
from flywheel.config import JudgeConfig, SandboxConfig
from flywheel.verifiers import VerifyContext, verify

FAST = SandboxConfig(cpu_seconds=2, memory_mb=256, wall_seconds=6)
TESTS = "from solution import sq\n\ndef test_a():\n    assert sq(3) == 9\n"


def A(text: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


@pytest.fixture
def weak(monkeypatch):
    """This machine without namespaces; the uid drop still works when we are root, so point the
    sandbox at a world-readable interpreter where one exists."""
    monkeypatch.setattr(sb.isolation, "isolation_mode", lambda: "weak: simulated (no user namespaces)")
    if os.geteuid() == 0:
        if not os.path.exists("/usr/bin/python3"):
            pytest.skip("needs a world-readable /usr/bin/python3 for the weak-mode uid drop")
        monkeypatch.setattr(sb.supervisor, "PYTHON", "/usr/bin/python3")


def test_weak_sandbox_verdicts_are_infra_errors_by_default(weak):
    v = verify({"kind": "python_tests", "tests": TESTS}, A("def sq(x):\n    return x * x\n"),
               context=VerifyContext(sandbox=FAST))
    assert v.infra_error and "sandbox.allow_weak" in v.infra_error
    assert not v.ok_for_training and v.reward == 0.0


def test_allowed_weak_verdicts_count_but_are_not_training_data(weak):
    ctx = VerifyContext(sandbox=FAST.model_copy(update={"allow_weak": True}))
    v = verify({"kind": "python_tests", "tests": TESTS}, A("def sq(x):\n    return x * x\n"), context=ctx)
    assert v.infra_error is None and v.passed and v.reward == 1.0
    assert not v.ok_for_training and "weak sandbox" in v.not_for_training
    assert v.details["isolation"]["mode"] == "weak"
    comp = verify({"kind": "composite", "parts": [{"spec": {"kind": "exact", "expected": "x"}},
                                                  {"spec": {"kind": "python_tests", "tests": TESTS}}]},
                  A("def sq(x):\n    return x * x\n"), context=ctx)
    assert comp.infra_error is None and not comp.ok_for_training and "part 1" in comp.not_for_training
    trained = VerifyContext(sandbox=FAST.model_copy(update={"allow_weak": True, "train_on_weak": True}))
    v2 = verify({"kind": "python_tests", "tests": TESTS}, A("def sq(x):\n    return x * x\n"), context=trained)
    assert v2.passed and v2.ok_for_training


def test_isolation_report_says_what_verdicts_become(monkeypatch):
    # The mapping from (isolation, cgroup, config) to words; whether a run starts is probed apart.
    monkeypatch.setattr(sb.report, "_probe_sandbox", lambda python, cfg_json: None)
    monkeypatch.setattr(sb.isolation, "isolation_mode", lambda: "weak: not running as root")
    r = sb.isolation_report(SandboxConfig())
    assert r["mode"] == "weak" and not r["trusted"] and "infrastructure errors" in r["verdicts"] and r["warning"]
    r = sb.isolation_report(SandboxConfig(allow_weak=True))
    assert r["verdicts"].startswith("WEAK") and "never training data" in r["verdicts"] and r["warning"]
    monkeypatch.setattr(sb.isolation, "isolation_mode", lambda: "netns")
    monkeypatch.setattr(sb.cgroups, "cgroup_support", lambda: "none: not writable")
    r = sb.isolation_report(SandboxConfig(cgroup="require"))
    assert not r["trusted"] and "infrastructure errors" in r["verdicts"]
    r = sb.isolation_report(SandboxConfig())
    assert r["trusted"] and "no per-sandbox cgroup" in r["warning"]
    monkeypatch.setattr(sb.cgroups, "cgroup_support", lambda: "v2: memory.max + pids.max under /x")
    assert sb.isolation_report(SandboxConfig())["warning"] == ""


def _fake_cgroup_fs(tmp_path: Path, monkeypatch, *, v2_controllers: str, v1: bool):
    v2 = tmp_path / "unified"
    (v2 / "svc").mkdir(parents=True)
    (v2 / "svc" / "cgroup.controllers").write_text(v2_controllers)
    (v2 / "svc" / "cgroup.subtree_control").write_text(v2_controllers)
    mounts = [(str(v2), "cgroup2", "rw")]
    own = {"0": "/svc"}
    if v1:
        for ctl in ("memory", "pids"):
            (tmp_path / ctl / "svc").mkdir(parents=True)
            mounts.append((str(tmp_path / ctl), "cgroup", f"rw,{ctl}"))
            own[ctl] = "/svc"
    monkeypatch.setattr(sb.cgroups, "_mounts", lambda: mounts)
    monkeypatch.setattr(sb.cgroups, "_own_cgroups", lambda: own)
    sb._cgroup_support.cache_clear()


def test_cgroup_v2_is_preferred_when_it_has_memory_and_pids(tmp_path, monkeypatch):
    _fake_cgroup_fs(tmp_path, monkeypatch, v2_controllers="cpu memory pids", v1=True)
    try:
        s = sb._cgroup_support()
        assert s.version == 2 and s.describe.startswith("v2: memory.max + pids.max")
    finally:
        sb._cgroup_support.cache_clear()


def test_hybrid_layout_falls_back_to_v1_and_says_why_v2_did_not_do(tmp_path, monkeypatch):
    # The layout of a hybrid host: cgroup2 mounted with no memory/pids (bound to v1).
    _fake_cgroup_fs(tmp_path, monkeypatch, v2_controllers="hugetlb", v1=True)
    try:
        s = sb._cgroup_support()
        assert s.version == 1 and set(s.parents) == {"memory", "pids"}
        assert s.describe.startswith("v1: memory.limit_in_bytes + pids.max")
    finally:
        sb._cgroup_support.cache_clear()
    _fake_cgroup_fs(tmp_path / "b", monkeypatch, v2_controllers="hugetlb", v1=False)
    try:
        s = sb._cgroup_support()
        assert s.version == 0 and "no memory/pids controller" in s.describe and "no cgroup v1 memory" in s.describe
    finally:
        sb._cgroup_support.cache_clear()


def test_read_only_cgroup_fs_is_reported(tmp_path, monkeypatch):
    _fake_cgroup_fs(tmp_path, monkeypatch, v2_controllers="memory pids", v1=False)
    real_mkdir = Path.mkdir

    def refuse(self, *a, **k):
        if "flywheel-sbx-" in self.name:
            raise OSError(30, "Read-only file system")
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    try:
        s = sb._cgroup_support()
        assert s.version == 0 and "cannot create a cgroup" in s.describe and "Read-only file system" in s.describe
    finally:
        sb._cgroup_support.cache_clear()


def test_cgroup_stats_read_oom_kills_and_pids_events(tmp_path):
    d = tmp_path / "cg"
    d.mkdir()
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (d / "pids.events").write_text("max 5\n")
    (d / "memory.peak").write_text(str(123 << 20))
    cg = sb._Cgroup.__new__(sb._Cgroup)
    cg.version, cg.dirs = 2, [d]
    assert cg.stats() == {"oom_kills": 2, "pids_max_hits": 5, "memory_peak_bytes": 123 << 20}


class _Judge(http.server.BaseHTTPRequestHandler):
    status = 200
    body: bytes = b""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *a):
        pass


@pytest.fixture
def judge():
    handler = type("J", (_Judge,), {})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield handler, VerifyContext(judge=JudgeConfig(base_url=f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=10))
    srv.shutdown()
    srv.server_close()


def _chat(content, finish="stop") -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": finish}]}).encode()


@pytest.mark.parametrize("status, body, infra", [
    (200, _chat(None, "content_filter"), False),  # the answer tripped a content filter
    (200, _chat("Sure! Here is my analysis."), False),  # talked out of scoring
    (400, b'{"error": {"message": "content policy"}}', False),
    (413, b"too large", False),
    (422, b"unprocessable", False),
    (200, b'{"not": "a completion"}', True),
    (200, b"<html>proxy error</html>", True),
    (401, b"bad key", True),
    (404, b"no such model", True),
    (429, b"slow down", True),
    (500, b"boom", True),
    (503, b"overloaded", True),
])
def test_judge_failure_versus_infrastructure(judge, status, body, infra):
    handler, ctx = judge
    handler.status, handler.body = status, body
    v = verify({"kind": "llm_judge", "rubric": "r"}, A("answer"), context=ctx)
    assert v.deterministic is False and v.reward == 0.0 and not v.passed
    if infra:
        assert v.infra_error and not v.ok_for_training
    else:
        assert v.infra_error is None and v.ok_for_training and v.details["judge_error"]


def test_rollout_rows_keep_weak_verdicts_out_of_training():
    pytest.importorskip("torch")
    from flywheel.envs.harness import Episode
    from flywheel.rollouts import episodes_to_table
    from flywheel.verifiers import Verdict

    def ep(i, verdict):
        return Episode(task_id="eval:t", sample_idx=i, messages=[], completion_text="x", prompt_token_ids=[1],
                       completion_token_ids=[2], logprobs=[-0.1], loss_mask=[1], finish_reason="stop", truncated=False,
                       verdict=verdict, gen_ms=1.0, verify_ms=1.0, turns=1)

    group = [ep(0, Verdict(1.0, True, {}, not_for_training="weak sandbox (weak: x)")),
             ep(1, Verdict(0.0, False, {})), ep(2, Verdict(1.0, True, {}))]
    task = {"task_id": "eval:t", "prompt": {"messages": [{"role": "user", "content": "q"}], "tools": []}}
    table, stats = episodes_to_table("env:e@1", "base:x", [task], [group], advantage="group", dynamic_sampling="keep")
    rows = table.to_pylist()
    assert rows[0]["infra_error"].startswith("not for training: weak sandbox") and rows[0]["advantage"] == 0.0
    assert rows[1]["infra_error"] is None and rows[2]["infra_error"] is None and rows[2]["advantage"] > 0
    assert stats["untrainable"] == 1 and stats["infra_errors"] == 0 and stats["pass_at_1"] == 0.5


def test_cycle_summary_warns_about_weak_sandboxes_and_dropped_samples():
    from flywheel.cycle import sandbox_warning

    ok = {"stages": {"sandbox": {"warning": ""}, "rollouts": {"stats": {"untrainable": 0}}}}
    assert sandbox_warning(ok) is None
    weak = {"stages": {"sandbox": {"warning": "python_tests/shell verdicts come from a weak sandbox"},
                       "rollouts": {"stats": {"untrainable": 3, "infra_errors": 1}}}}
    w = sandbox_warning(weak)
    assert "weak sandbox" in w and "3 samples kept out of training" in w and "1 samples had verifier infrastructure" in w


def test_init_and_status_report_the_sandbox(home, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from flywheel.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    info = json.loads(runner.invoke(app, ["init", "--no-champion", "--json"]).stdout)
    assert set(info["sandbox"]) >= {"mode", "namespaces", "cgroup", "verdicts", "warning"}
    monkeypatch.setattr(sb.isolation, "isolation_mode", lambda: "weak: not running as root")
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 0 and "infrastructure errors" in r.stdout
    assert "WARNING (sandbox)" in r.stderr


@pytest.mark.skipif(sb.isolation_mode() != "netns", reason="needs namespaces")
def test_a_restrictive_umask_in_the_verifier_does_not_break_the_sandbox():
    # The CLI sets umask 0o077 (the home is private); the sandbox's interpreter dirs must stay
    # traversable for its throwaway uids, or every new import in the candidate fails.
    old = os.umask(0o077)
    try:
        r = sb.run_python_tests("import csv, heapq\ndef sq(x):\n    return x * x\n", TESTS, FAST, grading="in_process")
        io = sb.run_python_tests("import csv, heapq\ndef sq(x):\n    return x * x\n", TESTS, FAST)
    finally:
        os.umask(old)
    assert r.passed, (r.per_test, r.stderr)
    assert io.passed, (io.per_test, io.stderr)


@pytest.mark.skipif(sb.isolation_mode() != "netns", reason="needs namespaces")
def test_a_worker_that_fails_before_the_candidate_runs_is_an_infra_error(monkeypatch):
    # An rlimit the kernel refuses: the worker dies in its own setup, before any candidate code.
    # That says nothing about the candidate, so it must not become reward 0.
    monkeypatch.setattr(sb.supervisor, "_limits", lambda cfg: {"nofile": -5})
    for grading in ("io", "in_process"):
        r = sb.run_python_tests("def sq(x):\n    return x * x\n", TESTS, FAST, grading=grading)
        assert r.infra_error and "could not start its worker" in r.infra_error, (grading, r)
    r = sb.run_shell("echo 1 > a", 'test -f "$WORK/a"', FAST)
    assert r.infra_error and "could not start its worker" in r.infra_error


def test_train_on_weak_without_allow_weak_is_rejected_with_the_reason():
    from flywheel.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train_on_weak = true needs allow_weak = true"):
        load_config(None, {"sandbox": {"train_on_weak": True}})
    assert load_config(None, {"sandbox": {"train_on_weak": True, "allow_weak": True}}).sandbox.train_on_weak
