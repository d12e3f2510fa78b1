"""``flywheel serve``: an OpenAI-compatible server over a flywheel policy (the HF backend by default).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (``n``,
``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``seed``, ``stop``,
``logprobs``, ``tools``; no streaming), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (vLLM's runtime LoRA endpoints: a loaded adapter is served under
its ``lora_name`` as an extra model id).

Responses follow the OpenAI chat completion format. ``message.content`` always holds the raw
completion text (lossless, so a client can train on it); when that text parses as tool calls with
the verifiers' shared parser, ``message.tool_calls`` carries them too (``function.arguments`` as
a JSON string) and ``finish_reason`` is ``"tool_calls"``. Extension fields follow vLLM's
``return_token_ids`` convention: with ``"return_token_ids": true`` the body has
``prompt_token_ids`` and every choice ``token_ids``.

Security and bounds (``flywheel.config.ServeConfig``):
- binding to anything but a loopback address requires an API key (:class:`ServeError` otherwise);
  when a key is set it is checked on *every* request, ``/health`` included, as
  ``Authorization: Bearer <key>`` with :func:`hmac.compare_digest` (constant time);
- request bodies over ``max_body_bytes`` get 413 (checked on ``Content-Length`` and while reading a
  chunked body), ``max_tokens`` over ``max_tokens`` or ``n`` over ``max_n`` get 400, and more than
  ``max_concurrency`` requests in flight get 429 at once rather than queueing without bound.
- errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 bad JSON,
  missing/invalid fields; 401 bad or missing key; 404 unknown model or route; 413; 429; 500.

Hot swap (``policy_provider``): every request calls the provider exactly once, when it starts, and
keeps the returned ``(name, policy)`` until it ends. A deployer that moves the ``champion`` alias
only has to make the provider return the new policy: requests already running finish on the policy
they started with (they hold a reference, so it is not freed under them) and new requests get the
new one; nothing is dropped. LoRA adapters are loaded onto the policy current at load time and are
forgotten when the provider returns a different base policy (reload them after a swap).

Not covered: streaming, ``logit_bias``, ``top_logprobs`` (returned empty), ``response_format``,
multiple workers (the model lives in one process; generation on it is serialised).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request  # module level: FastAPI resolves the string annotations of endpoints here

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flywheel.config import FlywheelConfig, ServeConfig
    from flywheel.policy.base import Policy

log = logging.getLogger("flywheel.serve")

PolicyProvider = Callable[[], "tuple[str, Policy]"]


class ServeError(RuntimeError):
    """The server cannot start as configured (e.g. a public bind address without an API key)."""


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-server bounds; defaults are ``ServeConfig``'s."""

    max_tokens: int = 1024
    max_n: int = 16
    max_body_bytes: int = 1_000_000
    max_concurrency: int = 4

    @classmethod
    def from_config(cls, sc: ServeConfig) -> ServeLimits:
        return cls(sc.max_tokens, sc.max_n, sc.max_body_bytes, sc.max_concurrency)


class _ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- request validation
def _as_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _ApiError(400, f"'{key}' must be a boolean", param=key)
    return v


def _as_number(body: dict, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _ApiError(400, f"'{key}' must be a number", param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _ApiError(400, f"'{key}' must be in {bound} (got {v})", param=key)
    return float(v)


def _as_int(body: dict, key: str, default: int | None, lo: int, hi: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _ApiError(400, f"'{key}' must be an integer", param=key)
    if v < lo:
        raise _ApiError(400, f"'{key}' must be >= {lo} (got {v})", param=key)
    if hi is not None and v > hi:
        raise _ApiError(400, f"'{key}' must be <= {hi} on this server (got {v})", param=key)
    return v


def _parse_chat_request(body: Any, limits: ServeLimits) -> dict:
    from flywheel.policy.base import SamplingParams

    if not isinstance(body, dict):
        raise _ApiError(400, "request body must be a JSON object")
    messages = body.get("messages")
    if messages is None:
        raise _ApiError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise _ApiError(400, "'messages' must be a non-empty list of message objects", param="messages")
    if body.get("stream"):
        raise _ApiError(400, "streaming is not supported by flywheel serve", param="stream")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _ApiError(400, "'tools' must be a list of tool objects", param="tools")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _as_int(body, key, min(256, limits.max_tokens), 1, limits.max_tokens)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise _ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _ApiError(400, "'model' must be a string", param="model")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _ApiError(400, "'seed' must be an integer", param="seed")
    params = SamplingParams(
        n=_as_int(body, "n", 1, 1, limits.max_n) or 1,
        temperature=_as_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_as_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_new_tokens=max_tokens or 1,
        seed=seed,
        stop=stop or None,
    )
    return {
        "model": model,
        "messages": messages,
        "tools": tools or None,
        "params": params,
        "logprobs": _as_bool(body, "logprobs", False),
        "return_token_ids": _as_bool(body, "return_token_ids", False),
        "parse_calls": body.get("tool_choice") != "none",
    }


# --------------------------------------------------------------------------- the app
class _Adapters:
    """LoRA adapters loaded through the API, tied to the base policy they were loaded onto."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.base_id: int | None = None
        self.views: dict[str, Any] = {}

    def current(self, base: Any) -> dict[str, Any]:
        with self.lock:
            if self.base_id != id(base):
                self.base_id, self.views = id(base), {}
            return dict(self.views)


def _token_str(tokenizer: Any, tid: int) -> str:
    if tokenizer is None:
        return f"token_id:{tid}"
    return tokenizer.decode([tid])


def create_app(policy_provider: PolicyProvider, *, api_key: str | None = None, limits: ServeLimits | None = None
               ) -> FastAPI:
    """The FastAPI app (see module docstring). ``policy_provider()`` returns ``(model name, policy)``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    lim = limits or ServeLimits()
    key_bytes = api_key.encode() if api_key else None
    app = FastAPI(title="flywheel serve", docs_url=None, redoc_url=None, openapi_url=None)
    adapters = _Adapters()
    inflight = {"n": 0}
    inflight_lock = threading.Lock()
    app.state.adapters = adapters
    # Concurrent requests to the same policy are merged into one batched generate call (see
    # flywheel.policy.batching); keyed by the policy object so a hot swap gets a fresh batcher.
    import weakref

    from flywheel.policy.batching import BatchingPolicy

    batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    batchers_lock = threading.Lock()

    def batcher(policy: Any) -> Any:
        with batchers_lock:
            b = batchers.get(policy)
            if b is None:
                b = batchers[policy] = BatchingPolicy(policy, max_prompts=max(lim.max_concurrency, 1))
            return b

    def err(e: _ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(_error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=headers)

    @app.exception_handler(_ApiError)
    async def _api_error(_: Request, e: _ApiError) -> JSONResponse:
        return err(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return err(_ApiError(e.status_code, str(e.detail), param=None, code=code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return err(_ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if key_bytes is not None:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key_bytes)
            if not ok:
                return err(_ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                     type_="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > lim.max_body_bytes:
                    raise _ApiError(413, f"request body of {declared} bytes exceeds the {lim.max_body_bytes} byte limit",
                                    code="request_too_large")
            except ValueError:
                raise _ApiError(400, "invalid Content-Length header") from None
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds chunked bodies without a length
            size += len(chunk)
            if size > lim.max_body_bytes:
                raise _ApiError(413, f"request body exceeds the {lim.max_body_bytes} byte limit",
                                code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise _ApiError(400, f"request body is not valid JSON: {e}") from None

    def resolve(model: str | None) -> tuple[str, Any, Any]:
        """(served model id, policy, base policy) for a request, from the provider."""
        name, base = policy_provider()
        if model is None or model == name:
            return name, base, base
        views = adapters.current(base)
        if model in views:
            return model, views[model], base
        raise _ApiError(404, f"model {model!r} does not exist (served: {[name, *sorted(views)]})",
                        param="model", code="model_not_found")

    @contextmanager
    def slot() -> Iterator[None]:
        with inflight_lock:
            if inflight["n"] >= lim.max_concurrency:
                raise _ApiError(429, f"server busy: {lim.max_concurrency} requests in flight, retry later",
                                type_="rate_limit_error", code="too_many_requests")
            inflight["n"] += 1
        try:
            yield
        finally:
            with inflight_lock:
                inflight["n"] -= 1

    @app.get("/health")
    async def health() -> dict:
        name, policy = policy_provider()
        return {"status": "ok", "model": name, "version": getattr(policy, "version", None)}

    @app.get("/v1/models")
    async def models() -> dict:
        name, base = policy_provider()
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "flywheel", "root": name, "parent": None}]
        for lora in sorted(adapters.current(base)):
            data.append({"id": lora, "object": "model", "created": now, "owned_by": "flywheel", "root": lora,
                         "parent": name})
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await read_json(request)
        req = _parse_chat_request(body, lim)
        model_id, policy, _ = resolve(req["model"])  # held until the response is built (hot swap)
        with slot():
            try:
                groups = await run_in_threadpool(
                    batcher(policy).generate, [req["messages"]], req["params"], tools=[req["tools"] or []]
                )
            except ValueError as e:  # prompt too long, bad message shape
                raise _ApiError(400, str(e), param="messages") from None
        samples = groups[0]
        tokenizer = getattr(policy, "tokenizer", None)
        choices = []
        for i, s in enumerate(samples):
            message: dict[str, Any] = {"role": "assistant", "content": s.text}
            finish = s.finish_reason
            if req["parse_calls"]:
                from flywheel.verifiers.toolcalls import parse_tool_calls

                parsed = parse_tool_calls(s.text)
                if parsed.calls and not parsed.error:
                    message["tool_calls"] = [
                        c.to_openai(f"call_{uuid.uuid4().hex[:24]}") for c in parsed.calls
                    ]
                    if finish == "stop":
                        finish = "tool_calls"
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if req["logprobs"]:
                content = []
                for tid, lp in zip(s.completion_token_ids, s.logprobs, strict=False):
                    tok = _token_str(tokenizer, tid)
                    content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
                choice["logprobs"] = {"content": content}
            if req["return_token_ids"]:
                choice["token_ids"] = s.completion_token_ids
            choices.append(choice)
        prompt_ids = samples[0].prompt_token_ids if samples else []
        completion_tokens = sum(len(s.completion_token_ids) for s in samples)
        out: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_id,
            "system_fingerprint": f"flywheel-{getattr(policy, 'version', '')}",
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
        if req["return_token_ids"]:
            out["prompt_token_ids"] = prompt_ids
        return JSONResponse(out)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> JSONResponse:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise _ApiError(400, "request body must be a JSON object")
        lora_name, lora_path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(lora_name, str) or not lora_name:
            raise _ApiError(400, "'lora_name' is required", param="lora_name")
        if not isinstance(lora_path, str) or not lora_path:
            raise _ApiError(400, "'lora_path' is required", param="lora_path")
        name, base = policy_provider()
        if lora_name == name:
            raise _ApiError(400, f"'lora_name' {lora_name!r} is the base model's name", param="lora_name")
        if not hasattr(base, "load_adapter"):
            raise _ApiError(400, f"the served policy {name!r} cannot load LoRA adapters", param="lora_name")
        from flywheel.policy.models import ModelLoadError

        try:
            with slot():
                await run_in_threadpool(base.load_adapter, lora_path, lora_name, activate=False)
        except ModelLoadError as e:
            raise _ApiError(400, str(e), param="lora_path") from None
        view = base.adapter_view(lora_name)
        with adapters.lock:
            if adapters.base_id != id(base):
                adapters.base_id, adapters.views = id(base), {}
            adapters.views[lora_name] = view
        return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{lora_name}' added successfully."})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> JSONResponse:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise _ApiError(400, "request body must be a JSON object")
        lora_name = body.get("lora_name")
        if not isinstance(lora_name, str) or not lora_name:
            raise _ApiError(400, "'lora_name' is required", param="lora_name")
        _, base = policy_provider()
        if lora_name not in adapters.current(base):
            raise _ApiError(404, f"LoRA adapter {lora_name!r} is not loaded", param="lora_name",
                            code="model_not_found")
        with slot():
            await run_in_threadpool(base.unload_adapter, lora_name)
        with adapters.lock:
            adapters.views.pop(lora_name, None)
        return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{lora_name}' removed successfully."})

    return app


# --------------------------------------------------------------------------- running
def resolve_api_key(cfg: FlywheelConfig, api_key: str | None, host: str) -> str | None:
    """``api_key`` or the env var named by ``serve.api_key_env``; required off loopback."""
    key = api_key or os.environ.get(cfg.serve.api_key_env) or None
    if not is_loopback(host) and not key:
        raise ServeError(
            f"binding to {host} (not loopback) requires an API key: pass --api-key or set "
            f"{cfg.serve.api_key_env}"
        )
    return key


def static_provider(name: str, policy: Any) -> PolicyProvider:
    """A provider that always serves ``policy`` under ``name``."""
    return lambda: (name, policy)


def build_policy(cfg: FlywheelConfig, model: str | None = None) -> tuple[str, Any]:
    """Load ``model`` (default ``cfg.policy.base_model``) with the HF backend; name = spec or dir name."""
    from pathlib import Path

    from flywheel.policy.hf import HFPolicy

    spec = model or cfg.policy.base_model
    name = spec if spec in ("smollm2-135m", "tiny") else Path(spec).expanduser().resolve().name
    policy = HFPolicy.from_spec(spec, cfg.home, device=cfg.policy.device, dtype=cfg.policy.dtype, name=name)
    return name, policy


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(cfg: FlywheelConfig, model: str | None = None, host: str | None = None, port: int | None = None,
          *, api_key: str | None = None, provider: PolicyProvider | None = None,
          on_ready: Callable[[str, int], None] | None = None) -> None:
    """Load the policy and serve until interrupted. ``provider`` overrides ``model`` (hot swap)."""
    import uvicorn

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    key = resolve_api_key(cfg, api_key, host)
    if provider is None:
        provider = static_provider(*build_policy(cfg, model))
    app = create_app(provider, api_key=key, limits=ServeLimits.from_config(cfg.serve))
    sock = _bind(host, port)
    if on_ready is not None:
        on_ready(host, sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=30))
    server.run(sockets=[sock])


@contextmanager
def run_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a background thread (tests, embedding); yields the base URL.

    ``port=0`` picks a free port. The server is shut down and joined on exit.
    """
    import uvicorn

    sock = _bind(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="flywheel-serve")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServeError("server thread failed to start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
