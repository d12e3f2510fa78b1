"""The HTTP backend against ``flywheel serve`` on a free loopback port, with the tiny model."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fixtures.http_json import send_json

from flywheel.policy import openai_http
from flywheel.policy.base import PolicyRequestError, Sample, SamplingParams
from flywheel.policy.openai_http import OpenAIPolicy
from flywheel.policy.testing import make_lora_adapter, tiny_policy
from flywheel.serve import AdapterLoading, ServeLimits, create_app, run_in_thread, static_provider

CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, with tiny_home


@pytest.fixture(scope="module")
def policy(tiny_home):
    return tiny_policy(tiny_home, name="tiny")


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def recorded():
    return []


@pytest.fixture(scope="module")
def server(policy, adapter_root, recorded):
    loading = AdapterLoading((adapter_root,), lambda type_, stream, payload: recorded.append((type_, stream, payload)),
                             api_key="adapter-admin-key")  # the adapter endpoints always need one (finding 12)
    app = create_app(static_provider("tiny", policy), limits=ServeLimits(max_tokens=64, max_n=8, max_body_bytes=4096),
                     adapter_loading=loading)
    with run_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with OpenAIPolicy(server, "tiny", max_concurrency=4, timeout_s=60, api_key="adapter-admin-key") as c:
        yield c


class StubPolicy:
    """Answers every prompt with fixed text; optionally blocks until released (for in-flight tests)."""

    def __init__(self, text: str, name: str = "stub", gate: threading.Event | None = None) -> None:
        self.text, self.name, self.version, self.gate = text, name, name, gate
        self.started = threading.Event()

    def generate(self, prompts, params=None, *, tools=None):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        n = params.n if isinstance(params, SamplingParams) else (params or 1)
        return [[Sample(self.text, [1, 2], [3, 4], [-0.5, -0.25], "stop", False, 1.0) for _ in range(n)]
                for _ in prompts]


def test_chat_n_logprobs_and_token_ids_match_the_in_process_backend(client, policy):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    other = [{"role": "user", "content": "Name three rivers."}]
    remote = client.generate([CHAT, other], params)
    # one HTTP request per prompt, each seeded alike: compare with one local call per prompt
    local = [policy.generate([CHAT], params)[0], policy.generate([other], params)[0]]
    assert len(remote) == 2 and all(len(g) == 3 for g in remote)
    for rg, lg in zip(remote, local, strict=True):
        for r, s in zip(rg, lg, strict=True):
            assert r.prompt_token_ids == s.prompt_token_ids and r.prompt_token_ids
            assert r.completion_token_ids == s.completion_token_ids
            assert r.logprobs == pytest.approx(s.logprobs, abs=1e-5)
            assert r.text == s.text
            assert r.finish_reason == "length" and r.truncated


def test_raw_response_follows_the_openai_format(server):
    body = {"model": "tiny", "messages": CHAT, "n": 2, "max_tokens": 4, "logprobs": True, "seed": 1,
            "return_token_ids": True}
    data = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    assert data["object"] == "chat.completion" and data["model"] == "tiny"
    assert [c["index"] for c in data["choices"]] == [0, 1]
    c = data["choices"][0]
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 4
    assert all(isinstance(e["token"], str) and e["logprob"] <= 0 for e in c["logprobs"]["content"])
    assert data["usage"]["completion_tokens"] == 8
    assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache_and_reported(server, tiny_home):
    """Agents send the same long system prompt with every request, one at a time: the second request
    encodes only its own part, reports the rest as OpenAI's ``usage.prompt_tokens_details.cached_tokens``,
    and answers as a server without the cache would."""
    system = {"role": "system", "content": "You are the support agent of Acme. Be brief, polite and exact. " * 12}

    def ask(q: str) -> dict:
        body = {"model": "tiny", "messages": [system, {"role": "user", "content": q}], "max_tokens": 6,
                "temperature": 0, "logprobs": True, "return_token_ids": True}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first, second = ask("Where is my parcel?"), ask("Cancel my order, please.")
    common = next(i for i, (a, b) in enumerate(zip(first["prompt_token_ids"], second["prompt_token_ids"],
                                                    strict=False)) if a != b)
    assert common > 100
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert common <= cached < second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < common
    off = tiny_policy(tiny_home, prefix_cache_mb=0)
    want = off.generate([[system, {"role": "user", "content": "Cancel my order, please."}]],
                        SamplingParams(n=1, temperature=0.0, max_new_tokens=6))[0][0]
    assert second["choices"][0]["token_ids"] == want.completion_token_ids
    got_lp = [e["logprob"] for e in second["choices"][0]["logprobs"]["content"]]
    assert got_lp == pytest.approx(want.logprobs, abs=1e-4)


def test_tools_reach_the_prompt(client, policy):
    (group,) = client.for_model("tiny").generate([CHAT], SamplingParams(n=1, max_new_tokens=2, seed=0), tools=[[WEATHER]])
    prompt = policy.tokenizer.decode(group[0].prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "[func_name1(" in prompt
    # "server" mode sends tools through; our server formats them identically
    server_mode = OpenAIPolicy(client.base_url, "tiny", prompt_format="server")
    (g2,) = server_mode.generate([CHAT], SamplingParams(n=1, max_new_tokens=2, seed=0), tools=[WEATHER])
    assert g2[0].prompt_token_ids == group[0].prompt_token_ids


def test_tool_calls_are_parsed_into_openai_tool_calls():
    stub = StubPolicy("[get_weather(city='Paris'), get_weather(city='Rome')]")
    with run_in_thread(create_app(static_provider("stub", stub))) as url:
        data = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]}).json()
        (choice,) = data["choices"]
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == stub.text  # raw text kept for training
        (samples,) = OpenAIPolicy(url, "stub").generate([CHAT], 1)
        assert samples[0].text == stub.text and samples[0].finish_reason == "stop"
        assert samples[0].extra["tool_calls"][0]["function"]["name"] == "get_weather"
        prose = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "tool_choice": "none"}).json()
        assert "tool_calls" not in prose["choices"][0]["message"]


def test_lora_load_generate_unload(client, tiny_home, adapter_root, server, recorded):
    adapter = make_lora_adapter(tiny_home, adapter_root / "lora", seed=3)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    (base,) = client.generate([CHAT], greedy)
    client.load_lora_adapter("ft1", str(adapter))
    assert client.models() == ["tiny", "ft1"]
    (tuned,) = client.for_model("ft1").generate([CHAT], greedy)
    assert tuned[0].completion_token_ids != base[0].completion_token_ids
    (base_again,) = client.generate([CHAT], greedy)  # the base name still serves base weights
    assert base_again[0].completion_token_ids == base[0].completion_token_ids
    client.unload_lora_adapter("ft1")
    with pytest.raises(PolicyRequestError) as e:
        client.for_model("ft1").generate([CHAT], greedy)
    assert e.value.status == 404 and "model_not_found" in e.value.body
    with pytest.raises(PolicyRequestError) as e:
        client.unload_lora_adapter("ft1")
    assert e.value.status == 404
    with pytest.raises(PolicyRequestError) as e:
        client.load_lora_adapter("ft2", str(adapter_root / "missing"))
    assert e.value.status == 400 and "adapter_config.json" in e.value.body
    assert [(t, stream, p["lora_name"]) for t, stream, p in recorded] == [
        ("adapter.loaded", "serve:tiny", "ft1"), ("adapter.unloaded", "serve:tiny", "ft1")]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny"}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": CHAT, "max_tokens": 65}, 400, "max_tokens"),
        ({"messages": CHAT, "n": 9}, 400, "n"),
        ({"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
        ({"messages": CHAT, "top_p": 0}, 400, "top_p"),
        ({"messages": CHAT, "stream": True}, 400, "stream"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ({"messages": CHAT, "model": "gpt-17"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_error_bodies(server, body, status, param):
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    if status == 404:
        assert err["code"] == "model_not_found"


def test_bad_json_oversized_body_and_unknown_route(server):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(f"{server}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_api_key_is_required_on_every_request_when_set(policy):
    app = create_app(static_provider("tiny", policy), api_key="s3cret")
    with run_in_thread(app) as url:
        for method, path in [("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/chat/completions")]:
            r = httpx.request(method, f"{url}{path}", json={"messages": CHAT, "max_tokens": 1})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        with pytest.raises(PolicyRequestError) as e:
            OpenAIPolicy(url, "tiny", api_key="wrong", max_retries=3).generate([CHAT], 1)
        assert e.value.status == 401  # not retried: a 4xx fails at once
        good = OpenAIPolicy(url, "tiny", api_key="s3cret")
        assert len(good.generate([CHAT], SamplingParams(n=1, max_new_tokens=2))[0]) == 1


def test_public_bind_requires_a_key(cfg, monkeypatch):
    from flywheel.net import is_loopback
    from flywheel.serve import ServeError, resolve_api_key

    monkeypatch.delenv(cfg.serve.api_key_env, raising=False)
    assert resolve_api_key(cfg, None, "127.0.0.1") is None and is_loopback("::1") and is_loopback("localhost")
    with pytest.raises(ServeError, match="requires an API key"):
        resolve_api_key(cfg, None, "0.0.0.0")
    monkeypatch.setenv(cfg.serve.api_key_env, "k")
    assert resolve_api_key(cfg, None, "0.0.0.0") == "k"


def test_concurrency_limit_answers_429_and_hot_swap_keeps_in_flight_requests():
    gate = threading.Event()
    old, new = StubPolicy("old", "v1", gate), StubPolicy("new", "v2")
    current = {"p": ("policy", old)}
    app = create_app(lambda: current["p"], limits=ServeLimits(max_concurrency=1))
    with run_in_thread(app) as url:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(
            r=httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT}, timeout=30)))
        t.start()
        assert old.started.wait(10)
        busy = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        current["p"] = ("policy", new)  # the deployer swaps the champion mid-request
        gate.set()
        t.join(30)
        assert result["r"].json()["choices"][0]["message"]["content"] == "old"
        after = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT}).json()
        assert after["choices"][0]["message"]["content"] == "new"


class _Flaky(BaseHTTPRequestHandler):
    """Answers with the statuses in ``script`` (then 200) and counts requests."""

    script: list[int] = []
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).calls.append(self.path)
        status = type(self).script.pop(0) if type(self).script else 200
        body = {"error": {"message": f"status {status}", "type": "x", "param": None, "code": None}}
        if status == 200:
            body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop", "logprobs": None}]}
        send_json(self, status, body)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky(monkeypatch):
    monkeypatch.setattr(openai_http, "_BACKOFF_BASE_S", 0.01)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    _Flaky.calls = []
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Flaky
    srv.shutdown()
    srv.server_close()


def test_retries_on_503_and_429_but_not_on_400(flaky):
    url, handler = flaky
    handler.script = [503, 429, 503]
    (samples,) = OpenAIPolicy(url + "/v1", "m", max_retries=4).generate([CHAT], 1)
    assert samples[0].text == "ok" and len(handler.calls) == 4
    assert samples[0].extra["token_ids_missing"] is True  # this server returns no token ids
    handler.calls.clear()
    handler.script = [400]
    with pytest.raises(PolicyRequestError) as e:
        OpenAIPolicy(url, "m", max_retries=4).generate([CHAT], 1)
    assert e.value.status == 400 and len(handler.calls) == 1
    handler.calls.clear()
    handler.script = [503] * 10
    t0 = time.perf_counter()
    with pytest.raises(PolicyRequestError, match="gave up after 3 attempts") as e:
        OpenAIPolicy(url, "m", max_retries=2).generate([CHAT], 1)
    assert e.value.status == 503 and len(handler.calls) == 3 and time.perf_counter() - t0 < 5


def test_connection_errors_are_retried_then_typed():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    openai_http_base = openai_http._BACKOFF_BASE_S
    openai_http._BACKOFF_BASE_S = 0.001
    try:
        with pytest.raises(PolicyRequestError, match="ConnectError") as e:
            OpenAIPolicy(f"http://127.0.0.1:{port}", "m", max_retries=2, timeout_s=2).generate([CHAT], 1)
    finally:
        openai_http._BACKOFF_BASE_S = openai_http_base
    assert e.value.status is None


def test_cli_refuses_a_public_bind_without_a_key(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from flywheel.cli import serve as serve_cli

    monkeypatch.delenv("FLYWHEEL_API_KEY", raising=False)
    app = typer.Typer()
    serve_cli.register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in multi-command mode
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--model", "tiny", "--home", str(tmp_path / "h")])
    assert result.exit_code == 2
    assert "requires an API key" in result.output
