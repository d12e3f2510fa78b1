"""flywheel.net.request_with_retries, the one retrying client of OpenAI-compatible endpoints (the policy's
HTTP backend and the llm_judge verifier), against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import http.server
import socket

import httpx
import pytest
from fixtures.http_json import send_json, serving

from flywheel.net import (
    CHAT_COMPLETIONS_PATH,
    HTTPRequestError,
    backoff_delay,
    openai_base_url,
    request_with_retries,
)


class _Scripted(http.server.BaseHTTPRequestHandler):
    script: list = []  # (status, headers) answered in turn; 200 once it is empty
    calls: list = []

    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).calls.append(self.path)
        status, headers = type(self).script.pop(0) if type(self).script else (200, {})
        body = {"choices": []} if status == 200 else {"error": {"message": f"busy ({status})"}}
        send_json(self, status, body, headers)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    handler = type("S", (_Scripted,), {"script": [], "calls": []})
    with serving(handler) as url:
        yield handler, url


def test_retries_429_and_5xx_honouring_retry_after(server):
    handler, url = server
    handler.script = [(503, {"Retry-After": "7"}), (429, {})]
    slept: list[float] = []
    with httpx.Client() as c:
        r = request_with_retries(c, "POST", url + CHAT_COMPLETIONS_PATH, json_body={}, sleep=slept.append)
    assert r.status_code == 200 and len(handler.calls) == 3 and len(slept) == 2
    assert slept[0] == 7.0  # Retry-After raises the jittered delay (base 0.5 s), up to the 30 s cap
    assert 0.0 <= slept[1] <= 1.0  # retry 1: uniform(0, 0.5 s * 2)


def test_other_4xx_fail_at_once_with_url_status_and_message(server):
    handler, url = server
    handler.script = [(413, {})]
    with httpx.Client() as c, pytest.raises(HTTPRequestError) as e:
        request_with_retries(c, "POST", url + CHAT_COMPLETIONS_PATH, json_body={}, sleep=lambda s: None)
    assert e.value.status == 413 and e.value.attempts == 1 and len(handler.calls) == 1
    assert str(e.value) == f"POST {url}/v1/chat/completions: HTTP 413: busy (413)"


def test_gives_up_after_max_retries(server):
    handler, url = server
    handler.script = [(502, {})] * 10
    with httpx.Client(base_url=url) as c, pytest.raises(HTTPRequestError, match="gave up after 3 attempts") as e:
        request_with_retries(c, "POST", CHAT_COMPLETIONS_PATH, json_body={}, max_retries=2, sleep=lambda s: None)
    assert e.value.status == 502 and e.value.attempts == 3 and len(handler.calls) == 3
    assert e.value.url == f"{url}/v1/chat/completions" and "HTTP 502" in str(e.value)


def test_connection_errors_are_retried_then_raised_without_a_status():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    slept: list[float] = []
    with httpx.Client() as c, pytest.raises(HTTPRequestError, match="ConnectError") as e:
        request_with_retries(c, "POST", f"http://127.0.0.1:{port}/v1/chat/completions", max_retries=1,
                             sleep=slept.append)
    assert e.value.status is None and e.value.attempts == 2 and len(slept) == 1
    assert f"127.0.0.1:{port}" in str(e.value) and "gave up after 2 attempts" in str(e.value)


def test_backoff_and_base_url_helpers():
    assert all(0.0 <= backoff_delay(3, base_s=0.5) <= 4.0 for _ in range(50))
    assert backoff_delay(10, "3600") == 30.0  # capped
    assert backoff_delay(0, "Wed, 21 Oct 2015 07:28:00 GMT", base_s=0.0) == 0.0  # HTTP-date: ignored
    for given in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert openai_base_url(given) == "http://h:8000"
