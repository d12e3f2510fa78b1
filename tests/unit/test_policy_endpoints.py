"""Several OpenAI-compatible endpoints behind one policy: the choice, cool-down and failover rules of
:mod:`flywheel.policy.endpoints`, and how :class:`OpenAIPolicy` and the harness apply them (HTTP
through ``httpx.MockTransport``; the real servers are in tests/integration/test_multi_endpoint.py)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from flywheel.cycle import is_infra_error
from flywheel.envs.harness import run_episodes
from flywheel.policy import openai_http
from flywheel.policy.base import PolicyRequestError, SamplingParams
from flywheel.policy.endpoints import (
    AllEndpointsFailedError,
    EndpointPool,
    is_server_failure,
    run_on_endpoints,
)
from flywheel.policy.openai_http import OpenAIPolicy

A, B, C = "http://a.test:1", "http://b.test:2", "http://c.test:3"
CHAT = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fail(status: int | None) -> PolicyRequestError:
    return PolicyRequestError(f"HTTP {status}" if status else "ConnectError: refused", status=status)


# ------------------------------------------------------------------ the pool
def test_ties_go_round_robin_and_the_least_loaded_endpoint_wins():
    pool = EndpointPool([A, B, C], clock=Clock())
    picks = []
    for _ in range(6):  # one at a time: every endpoint idle each time -> a, b, c, a, b, c
        u = pool.acquire()
        picks.append(u)
        pool.release(u, ok=True)
    assert picks == [A, B, C, A, B, C]
    assert pool.answered == {A: 2, B: 2, C: 2}

    pool = EndpointPool([A, B, C], clock=Clock())
    assert [pool.acquire() for _ in range(3)] == [A, B, C]  # in flight: 1, 1, 1
    pool.release(B, ok=True)  # B: 0 in flight
    assert pool.acquire() == B  # the least loaded, although A is next in round-robin order
    assert pool.acquire() == C  # all at 1 again: round-robin resumes after B
    assert pool.outstanding(A) == 1 and pool.outstanding(B) == 1 and pool.outstanding(C) == 2


def test_a_failed_endpoint_cools_down_then_comes_back():
    clock = Clock()
    pool = EndpointPool([A, B], cooldown_s=30.0, clock=clock)
    u = pool.acquire()
    assert u == A
    pool.release(A, ok=False)  # down until t = 130
    assert not pool.is_up(A) and pool.failures[A] == 1
    assert [pool.acquire() for _ in range(3)] == [B, B, B]  # A is skipped while B is up
    clock.t = 130.0
    assert pool.is_up(A)
    assert pool.acquire() == A  # back, and the least loaded (B has 3 in flight)


def test_when_every_endpoint_is_down_the_first_to_recover_is_tried():
    clock = Clock()
    pool = EndpointPool([A, B, C], cooldown_s=30.0, clock=clock)
    pool.mark_down(B)  # until 130
    clock.t = 105.0
    pool.mark_down(A)  # until 135
    pool.mark_down(C)  # until 135
    assert pool.acquire() == B
    assert pool.acquire(exclude=[B]) == C  # A and C end together: the next in round-robin order (after B)
    assert pool.acquire(exclude=[A, B, C]) is None


def test_server_failures_are_told_from_bad_requests():
    assert is_server_failure(fail(None)) and is_server_failure(fail(503)) and is_server_failure(fail(429))
    assert not is_server_failure(fail(400)) and not is_server_failure(fail(404))
    assert not is_server_failure(PolicyRequestError("malformed", status=200))
    assert not is_server_failure(ValueError("a bug"))


# ------------------------------------------------------------------ failover
def test_work_moves_to_the_next_endpoint_on_a_server_failure():
    pool = EndpointPool([A, B, C], clock=Clock())
    calls = []

    def fn(u):
        calls.append(u)
        if u == A:
            raise fail(None)
        return f"done on {u}"

    assert run_on_endpoints(pool, fn, what="x") == ("done on http://b.test:2", B)
    assert calls == [A, B]
    assert not pool.is_up(A) and pool.failures == {A: 1} and pool.answered == {B: 1}
    assert pool.outstanding(A) == pool.outstanding(B) == 0


def test_a_bad_request_is_raised_at_once_and_not_retried_elsewhere():
    pool = EndpointPool([A, B], clock=Clock())
    calls = []

    def fn(u):
        calls.append(u)
        raise fail(400)

    with pytest.raises(PolicyRequestError) as e:
        run_on_endpoints(pool, fn, what="x", rounds=3)
    assert e.value.status == 400 and not isinstance(e.value, AllEndpointsFailedError)
    assert calls == [A]
    assert pool.is_up(A) and pool.failures == {} and pool.outstanding(A) == 0  # not the server's fault


def test_every_endpoint_failing_every_round_is_an_infra_error_naming_them_all():
    pool = EndpointPool([A, B, C], clock=Clock())
    calls, sleeps = [], []

    def fn(u):
        calls.append(u)
        raise fail(503 if u != C else None)

    with pytest.raises(AllEndpointsFailedError) as e:
        run_on_endpoints(pool, fn, what="POST /v1/chat/completions", rounds=2, sleep=sleeps.append)
    assert calls == [A, B, C, A, B, C]  # two rounds, each endpoint once per round
    assert len(sleeps) == 1  # backoff between the rounds only
    msg = str(e.value)
    assert all(u in msg for u in (A, B, C)) and "2 rounds" in msg and "POST /v1/chat/completions" in msg
    assert e.value.endpoints == [A, B, C]
    assert e.value.status is None  # 503, 503 and no response: no one shared status
    assert is_infra_error(e.value)

    pool = EndpointPool([A, B], clock=Clock())
    with pytest.raises(AllEndpointsFailedError) as e:
        run_on_endpoints(pool, lambda u: (_ for _ in ()).throw(fail(503)), what="x", sleep=lambda s: None)
    assert e.value.status == 503 and is_infra_error(e.value)


# ------------------------------------------------------------------ OpenAIPolicy over HTTP (mocked)
def _completion(n: int, text: str) -> dict:
    return {"object": "chat.completion", "prompt_token_ids": [1, 2],
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "token_ids": [7], "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}
                        for i in range(n)]}


class Fleet:
    """A MockTransport answering per host: ``mode[host]`` is "ok", an HTTP status, or "down"."""

    def __init__(self, **mode):
        self.mode = mode
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        with self.lock:
            self.calls.append(host)
        m = self.mode.get(host, "ok")
        if m == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if m != "ok":
            return httpx.Response(int(m), json={"error": {"message": f"status {m}"}})
        body = json.loads(request.content)
        if "lora_name" in body:
            return httpx.Response(200, text=f"loaded {body['lora_name']}")
        return httpx.Response(200, json=_completion(body["n"], f"from {host}"))

    def policy(self, urls=(A, B), **kw):
        kw.setdefault("max_retries", 1)
        return OpenAIPolicy(list(urls), "m", client=httpx.Client(transport=httpx.MockTransport(self)), **kw)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(openai_http, "_BACKOFF_BASE_S", 0.001)


def test_requests_spread_over_the_endpoints_and_samples_name_their_server():
    fleet = Fleet()
    pol = fleet.policy(max_concurrency=1)
    groups = pol.generate([CHAT] * 6, SamplingParams(n=2, max_new_tokens=4))
    # One request per prompt, over both servers. How evenly depends on which answers first (the least
    # busy server gets the next request), so only what holds on a loaded machine is asserted: the second
    # request goes to the other server whatever the timing (least in flight, ties round-robin).
    assert len(fleet.calls) == 6 and set(fleet.calls) == {"a", "b"}
    for g in groups:
        assert len(g) == 2 and g[0].extra["endpoint"] == g[1].extra["endpoint"]  # a group: one request
        assert g[0].text == "from " + g[0].extra["endpoint"].split("//")[1].split(".")[0]
    assert pol.endpoint_pool.answered == {A: fleet.calls.count("a"), B: fleet.calls.count("b")}


def test_a_dead_server_is_skipped_and_a_4xx_is_not_retried():
    fleet = Fleet(a="down")
    pol = fleet.policy()
    groups = pol.generate([CHAT] * 4, 1)
    assert all(g[0].extra["endpoint"] == B for g in groups)
    assert fleet.calls.count("a") == 1  # tried once, then cooling down: every later request went to b
    assert not pol.endpoint_pool.is_up(A)

    fleet = Fleet(a=400, b=400)
    with pytest.raises(PolicyRequestError) as e:
        fleet.policy(max_retries=4).generate([CHAT], 1)
    assert e.value.status == 400 and fleet.calls == ["a"]

    fleet = Fleet(a="down", b=502)
    with pytest.raises(AllEndpointsFailedError) as e:
        fleet.policy(max_retries=1).generate([CHAT], 1)
    assert fleet.calls == ["a", "b", "a", "b"] and A in str(e.value) and B in str(e.value)
    assert is_infra_error(e.value)


def test_one_endpoint_keeps_its_retries_on_that_server():
    fleet = Fleet(a=503)
    pol = OpenAIPolicy(A, "m", max_retries=2, client=httpx.Client(base_url=A, transport=httpx.MockTransport(fleet)))
    with pytest.raises(PolicyRequestError, match="gave up after 3 attempts") as e:
        pol.generate([CHAT], 1)
    assert fleet.calls == ["a", "a", "a"] and not isinstance(e.value, AllEndpointsFailedError)
    assert pol.endpoints == [A] and pol.base_url == A


def test_spread_retries_an_item_whole_on_another_endpoint():
    fleet = Fleet()
    pol = fleet.policy(max_concurrency=2)
    attempts: list[tuple[int, str]] = []
    died: list[int] = []
    lock = threading.Lock()

    def group(i, p):
        (u,) = p.endpoints  # each attempt sees one endpoint only
        p.generate([CHAT], 2)  # the group's first request is answered
        with lock:
            attempts.append((i, u))
            dies = u == A and not died
            if dies:
                died.append(i)
        if dies:
            raise fail(None)  # ... and then the server dies mid-group
        return (i, u)

    out = pol.spread(list(range(6)), group)
    assert [i for i, _ in out] == list(range(6))  # in item order, each exactly once
    (victim,) = died
    assert dict(out)[victim] == B  # resampled whole on the other server
    assert sorted(attempts) == sorted([(i, u) for i, u in out] + [(victim, A)])  # 6 answers + 1 lost attempt
    assert sum(u == A for _, u in out) == 0  # A is cooling down after its failure: nothing else went there
    assert pol.endpoint_pool.failures == {A: 1}


def test_the_harness_samples_each_group_on_one_server_and_only_once():
    class DiesAfter(Fleet):
        """Server a answers its first two requests, then refuses connections."""

        def __call__(self, request):
            if request.url.host.startswith("a") and self.calls.count("a") >= 2:
                self.mode["a"] = "down"
            return super().__call__(request)

    fleet = DiesAfter()
    pol = fleet.policy(max_concurrency=1)
    tasks = [{"task_id": f"t{i}", "harness": "single_turn", "prompt": {"messages": CHAT},
              "verifier": {"kind": "exact", "expected": "from b"}} for i in range(6)]
    groups = run_episodes(tasks, pol, SamplingParams(n=3, max_new_tokens=4))
    assert [g[0].task_id for g in groups] == [t["task_id"] for t in tasks]
    for g in groups:
        assert [e.sample_idx for e in g] == [0, 1, 2]
        assert len({e.endpoint for e in g}) == 1  # the whole group from one server
        assert g[0].completion_text == "from " + g[0].endpoint.split("//")[1].split(".")[0]
    served = [g[0].endpoint for g in groups]
    assert served.count(A) == 2 and served.count(B) == 4
    assert fleet.calls.count("a") == 3  # two answers, then one refused request, moved to b


def test_an_adapter_is_loaded_on_every_endpoint_and_a_server_that_missed_it_is_dropped():
    fleet = Fleet(b="down")
    pol = fleet.policy(urls=(A, B, C), max_retries=0)
    out = pol.load_lora_adapter("policy-3", "/shared/adapters/3")
    assert set(out) == {A, C} and fleet.calls == ["a", "b", "c"]
    assert pol.endpoints == [A, C]  # b would answer 404 for the adapter: not asked to sample it
    fleet.calls.clear()
    groups = pol.for_model("policy-3").generate([CHAT] * 4, 1)
    assert {g[0].extra["endpoint"] for g in groups} == {A, C} and "b" not in fleet.calls

    fleet = Fleet(a=400)
    with pytest.raises(PolicyRequestError) as e:
        fleet.policy().load_lora_adapter("x", "/nowhere")
    assert e.value.status == 400


def test_the_configured_endpoints_reach_the_backend(monkeypatch, tmp_path):
    from flywheel.config import load_config
    from flywheel.policy.registry import _openai

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLYWHEEL_POLICY__BASE_URL", f"{A}/v1, {B}/v1/")
    cfg = load_config()
    pol = _openai(cfg, cfg.policy.endpoints, "m")
    try:
        assert pol.endpoints == [A, B] and pol.base_url == A
    finally:
        pol.close()
