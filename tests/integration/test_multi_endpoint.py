"""Rollouts and gate evaluation over two OpenAI-compatible endpoints, both real HTTP server processes on
127.0.0.1: a real ``flywheel serve`` with the tiny model, and a second server process
(``tests/fixtures/openai_stub.py``) that answers ``stub answer <port>`` and can be told to hang after N
requests, or to refuse every request with an HTTP status.

- One endpoint SIGKILLed mid-rollout (after it answered some groups, while it holds another): every
  group completes, none twice (the published Parquet holds each task's group exactly once, K samples),
  and the event says which server answered each group (checked against the completions' text).
- Both alive: a gate evaluation's groups spread over both.
- All dead: the infra error names every endpoint, and nothing is published.
- A 4xx is not retried on the other endpoint.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from flywheel.artifacts import open_artifacts
from flywheel.cycle import is_infra_error
from flywheel.envs import build_envs
from flywheel.envs.testing import append_failures, failure_payload, tool_spec
from flywheel.evals import build_evals
from flywheel.evaluate import ModelRef, evaluate_model
from flywheel.policy import openai_http
from flywheel.policy.base import PolicyRequestError
from flywheel.policy.endpoints import AllEndpointsFailedError
from flywheel.policy.openai_http import OpenAIPolicy
from flywheel.policy.registry import ResolvedPolicy
from flywheel.policy.testing import session_tiny_home
from flywheel.rollouts import run_rollouts
from flywheel.tracking import Tracker

pytestmark = pytest.mark.slow

STUB = Path(__file__).resolve().parents[1] / "fixtures" / "openai_stub.py"
WEATHER = tool_spec("get_weather", {"city": {"type": "string"}}, ["city"])
K = 2


@pytest.fixture(scope="module")
def serve(tmp_path_factory, it):
    """One real ``flywheel serve --model tiny`` process for the module."""
    home = session_tiny_home(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("serve")
    port = it.free_port()
    env = it.clean_env(FLYWHEEL_HOME=str(home), FLYWHEEL_POLICY__DEVICE="cpu", FLYWHEEL_POLICY__DTYPE="float32",
                       OMP_NUM_THREADS="1")
    srv = it.ServerProcess("flywheel serve", [str(it.VENV_BIN / "flywheel"), "serve", "--model", "tiny",
                                              "--port", str(port)],
                           port=port, health_path="/health", env=env, log=tmp / "serve.log", cwd=tmp)
    try:
        srv.wait_healthy(240)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def stubs(tmp_path, it):
    """Start stub server processes (``start(*args)``); every one is stopped at teardown."""
    started = []

    def start(*args: str):
        port = it.free_port()
        srv = it.ServerProcess(f"stub:{port}", [sys.executable, str(STUB), "--port", str(port), *args], port=port,
                               health_path="/health", env=it.clean_env(), log=tmp_path / f"stub-{port}.log",
                               cwd=tmp_path)
        started.append(srv)
        srv.wait_healthy(60)
        return srv

    yield start
    for srv in started:
        srv.stop()


def log_lines(srv, word: str) -> list[int]:
    return [int(m) for m in re.findall(rf"^{word} (\d+)$", srv.tail(10**6), flags=re.M)]


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(openai_http, "_BACKOFF_BASE_S", 0.01)


@pytest.fixture
def envs(cfg, store):
    """Evals and envs from distinct weather failures (the shape of tests/integration/test_rollouts.py)."""
    openers = ["Quick question about", "Planning a picnic, need", "My grandmother asks for", "Before my flight check",
               "Hiking tomorrow so tell me", "Urgent: deliver", "For the newsletter give", "Curious about",
               "The kids want to know", "Reporting needs", "Dispatch requires", "Festival organisers want"]
    failures = []
    for i in range(12):
        city = f"City{i}x{i * 7}"
        msgs = [{"role": "user", "content": f"{openers[i]} the weather in {city} today"}]
        corr = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}
        failures.append(failure_payload(msgs, [WEATHER], {"role": "assistant", "content": "It is sunny."},
                                        ["no_tool_call"], correction=corr, trace_id=f"trace:m{i}"))
    artifacts = open_artifacts(cfg)
    append_failures(store, failures)
    build_evals(cfg, store, artifacts)
    build_envs(cfg, store, artifacts)
    return artifacts


def test_an_endpoint_killed_mid_rollout_every_group_completes_none_twice(cfg, store, envs, serve, stubs):
    artifacts = envs
    stub = stubs("--hold-after", "2")  # answers two groups, then hangs on the next until killed
    killed = threading.Event()

    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not log_lines(stub, "holding"):
            time.sleep(0.05)
        os.killpg(stub.proc.pid, signal.SIGKILL)  # dies mid-group, its request unanswered
        killed.set()

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    pol = OpenAIPolicy([stub.url, serve.url], "tiny", max_concurrency=1, timeout_s=120)
    s = run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=ResolvedPolicy(pol, "served:tiny", None),
                     group_size=K)
    th.join(10)
    assert killed.is_set() and stub.proc.wait(10) == -signal.SIGKILL
    answered_by_stub = log_lines(stub, "answered")
    assert answered_by_stub == [1, 2] and log_lines(stub, "holding")  # it answered two, died holding more

    assert s.published and s.tasks >= 4
    rows = artifacts.read_table(s.artifact["sha256"]).to_pylist()
    # every group completes, none twice: each task once, with sample indices 0..K-1 exactly once each
    per_task = Counter(r["task_id"] for r in rows)
    assert len(per_task) == s.tasks and set(per_task.values()) == {K}
    assert Counter((r["task_id"], r["sample_idx"]) for r in rows).most_common(1)[0][1] == 1
    assert all(len({r["group_id"] for r in rows if r["task_id"] == t}) == 1 for t in per_task)
    (ev,) = store.read(types=["rollouts.published"])
    served_by = ev.payload["served_by"]
    assert set(served_by) == set(per_task)  # the record names the server of every published group
    assert Counter(served_by.values()) == {stub.url: 2, serve.url: s.tasks - 2}
    assert ev.payload["stats"]["endpoints"] == {stub.url: 2, serve.url: s.tasks - 2}
    for r in rows:  # ... and it is the server whose answer is in the dataset
        from_stub = r["completion"] == f"stub answer {stub.port}"
        assert from_stub == (served_by[r["task_id"]] == stub.url), r["task_id"]
    assert pol.endpoint_pool.failures[stub.url] >= 1


def test_both_alive_gate_evaluation_spreads_its_groups(cfg, store, envs, serve, stubs):
    artifacts = envs
    stub = stubs()
    pol = OpenAIPolicy([serve.url, stub.url], "tiny", max_concurrency=1, timeout_s=120)
    res = evaluate_model(cfg, store, artifacts, Tracker(cfg), ModelRef.base("tiny"), "heldout", policy=pol)
    (ev,) = store.read(types=["eval.completed"])
    served_by = ev.payload["served_by"]
    assert len(served_by) == res.items.num_rows >= 2
    assert set(served_by.values()) == {serve.url, stub.url}  # both servers got groups
    assert len(log_lines(stub, "answered")) == Counter(served_by.values())[stub.url]
    assert pol.endpoint_pool.failures == {}
    items = {r["task_id"]: r["completion"] for r in res.rows()}
    for tid, url in served_by.items():
        assert (items[tid] == f"stub answer {stub.port}") == (url == stub.url)


def test_all_endpoints_dead_raises_an_infra_error_naming_each(cfg, store, envs, stubs, it, fast_backoff):
    artifacts = envs
    dead = stubs()
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(10)
    never = f"http://127.0.0.1:{it.free_port()}"  # nothing ever listened there
    pol = OpenAIPolicy([dead.url, never], "tiny", max_retries=1, timeout_s=10)
    with pytest.raises(AllEndpointsFailedError) as e:
        run_rollouts(cfg, store, artifacts, Tracker(cfg), policy=ResolvedPolicy(pol, "served:dead", None), group_size=K)
    assert dead.url in str(e.value) and never in str(e.value) and "ConnectError" in str(e.value)
    assert sorted(e.value.endpoints) == sorted([dead.url, never])
    assert is_infra_error(e.value)  # the cycle's classification: Prefect retries the stage
    assert store.read(types=["rollouts.published"]) == []


def test_a_bad_request_is_not_retried_on_the_other_endpoint(stubs, fast_backoff):
    refuses, healthy = stubs("--status", "400"), stubs()
    pol = OpenAIPolicy([refuses.url, healthy.url], "tiny", max_retries=3)
    with pytest.raises(PolicyRequestError) as e:
        pol.generate([[{"role": "user", "content": "hi"}]], 1)
    assert e.value.status == 400 and not isinstance(e.value, AllEndpointsFailedError)
    assert not is_infra_error(e.value)
    assert log_lines(refuses, "request") == [1] and log_lines(healthy, "request") == []
    assert pol.endpoint_pool.is_up(refuses.url)  # a bad request says nothing about the server
