"""The FastAPI app of ``flywheel serve``: the route handlers and the guards around them (:class:`ServeState`),
error bodies, bounded body reading and the completion body. The behaviour is described in :mod:`flywheel.serve`.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hmac
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Request at module level: FastAPI resolves the string annotations of endpoints here
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flywheel.net import (
    LOOPBACK_HOSTS,
    host_name,
)
from flywheel.policy.base import PromptTooLongError
from flywheel.policy.batching import BatchingPolicy
from flywheel.policy.models import ModelLoadError
from flywheel.serve.adapters import Adapter, AdapterTable, adapter_digest, allowed_adapter_dir
from flywheel.serve.schema import (
    ADAPTER_ROUTES,
    RESERVED_ADAPTER_NAMES,
    AdapterLoading,
    ApiError,
    ChatCompletionRequest,
    LoadLoraRequest,
    PolicyProvider,
    ServeError,
    ServeLimits,
    UnloadLoraRequest,
    error_body,
    parse_request,
)
from flywheel.vocab.toolcalls import parse_tool_calls

log = logging.getLogger("flywheel.serve")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat()


def _token_str(tokenizer: Any, tid: int) -> str:
    if tokenizer is None:
        return f"token_id:{tid}"
    return tokenizer.decode([tid])


def error_response(e: ApiError) -> JSONResponse:
    """``e`` as OpenAI's error body. Every error closes its connection: it may leave a request body
    unread (413, 415, 408, a refused Host or key) that the client could go on trickling (uvicorn
    honours the header)."""
    headers = {"Connection": "close"}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status,
                        headers=headers)


async def _api_error(_: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if e.status_code == 404 else None
    return error_response(ApiError(e.status_code, str(e.detail), param=None, code=code))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    ref = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s %s", ref, request.method, request.url.path, exc_info=e)
    return error_response(ApiError(500, f"internal error (reference {ref} in the server log)", type_="server_error"))


async def read_body(request: Request, lim: ServeLimits) -> bytes:
    """The JSON body of ``request`` within ``lim``: 415 unless it is sent as JSON, 413 over
    ``max_body_bytes`` (declared or streamed), 408 past ``body_timeout_s``."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "requests must be sent as 'Content-Type: application/json'",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > lim.max_body_bytes
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if too_big:
            raise ApiError(413, f"request body of {declared} bytes exceeds the {lim.max_body_bytes} byte limit",
                           code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(lim.body_timeout_s):
            async for chunk in request.stream():  # also bounds chunked bodies without a length
                size += len(chunk)
                if size > lim.max_body_bytes:
                    raise ApiError(413, f"request body exceeds the {lim.max_body_bytes} byte limit",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {lim.body_timeout_s:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "client disconnected while sending the body") from None
    return b"".join(chunks)


def completion_body(req: ChatCompletionRequest, model_id: str, policy: Any, samples: Sequence[Any]) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` body for the ``samples`` one request generated (module
    docstring: raw text in ``content``, parsed ``tool_calls`` unless ``tool_choice`` is ``"none"``,
    vLLM's ``token_ids`` extension)."""
    tokenizer = getattr(policy, "tokenizer", None)
    parse_calls = req.tool_choice != "none"
    choices = []
    for i, s in enumerate(samples):
        message: dict[str, Any] = {"role": "assistant", "content": s.text}
        finish = s.finish_reason
        if parse_calls:
            parsed = parse_tool_calls(s.text)
            if parsed.calls and not parsed.error:
                message["tool_calls"] = [
                    c.to_openai(f"call_{uuid.uuid4().hex[:24]}") for c in parsed.calls
                ]
                if finish == "stop":
                    finish = "tool_calls"
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            content = []
            for tid, lp in zip(s.completion_token_ids, s.logprobs, strict=False):
                tok = _token_str(tokenizer, tid)
                content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
            choice["logprobs"] = {"content": content}
        if req.return_token_ids:
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
    cached = samples[0].extra.get("cached_prompt_tokens") if samples else None
    if isinstance(cached, int):  # the prompt tokens the backend reused instead of encoding (prefix caching)
        out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    if req.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


class ServeState:
    """What one app serves and guards: the policy provider, the bounds, the Host and key checks, the
    adapter table, the in-flight count and the batchers. The route handlers are its methods;
    :func:`create_app` wires them to a FastAPI app (see the module docstring for the behaviour)."""

    def __init__(self, policy_provider: PolicyProvider, *, api_key: str | None = None,
                 limits: ServeLimits | None = None, allowed_hosts: Sequence[str] | None = None,
                 adapter_loading: AdapterLoading | None = None) -> None:
        self.policy_provider = policy_provider
        self.limits = limits or ServeLimits()
        self.key_bytes = api_key.encode() if api_key else None
        self.hosts = frozenset(allowed_hosts if allowed_hosts is not None else LOOPBACK_HOSTS)
        self.adapter_loading = adapter_loading
        # The adapter endpoints need a key even where chat does not (loopback): loading an adapter
        # changes what a model name answers for every client (issue 31, finding 12).
        self.adapter_key_bytes: bytes | None = None
        if adapter_loading is not None:
            key = adapter_loading.api_key or api_key
            if not key:
                raise ServeError("adapter loading needs an API key, on loopback too (any local user could "
                                 "otherwise load weights under a served name): set the server's key "
                                 "(serve.api_key_env, --api-key-file) or AdapterLoading.api_key")
            self.adapter_key_bytes = key.encode()
        self.adapters = AdapterTable()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        # Concurrent requests to the same policy are merged into one batched generate call (see
        # flywheel.policy.batching); keyed by the policy object so a hot swap gets a fresh batcher. The
        # batcher holds its policy weakly: a value that referenced its key strongly kept every replaced
        # model alive in this WeakKeyDictionary (one model per promotion).
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._batchers_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def batcher(self, policy: Any) -> BatchingPolicy:
        with self._batchers_lock:
            b = self._batchers.get(policy)
            if b is None:
                b = self._batchers[policy] = BatchingPolicy(policy, max_prompts=max(self.limits.max_concurrency, 1),
                                                            weak=True)
            return b

    async def guard(self, request: Request, call_next: Any) -> Any:
        """HTTP middleware: the Host header (400) and, when a key is set, the bearer key (401)."""
        if "*" not in self.hosts and host_name(request.headers.get("host")) not in self.hosts:
            return error_response(ApiError(400, "this server does not answer to that Host header "
                                           "(serve.allowed_hosts)", code="invalid_host"))
        key = self.key_bytes
        if request.url.path in ADAPTER_ROUTES and self.adapter_loading is not None:
            key = self.adapter_key_bytes  # always set with loading on; off, the route answers 403
        if key is not None:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
            if not ok:
                return error_response(ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                               type_="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """One of ``max_concurrency`` generation slots; 429 at once when all are taken."""
        lim = self.limits
        with self._inflight_lock:
            if self._inflight >= lim.max_concurrency:
                raise ApiError(429, f"server busy: {lim.max_concurrency} requests in flight, retry later",
                               type_="rate_limit_error", code="too_many_requests")
            self._inflight += 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight -= 1

    def forget(self, dropped: list[Adapter], old_base: Any, served: str, reason: str) -> None:
        """Adapters of a replaced base: drop their weights if that base lives on, and record it."""
        for a in dropped:
            if old_base is not None and hasattr(old_base, "unload_adapter"):
                try:
                    old_base.unload_adapter(a.internal)
                except Exception:
                    log.exception("unloading adapter %s from the replaced base failed", a.name)
            if self.adapter_loading is not None:
                try:
                    self.adapter_loading.record("adapter.unloaded", f"serve:{served}", {
                        "action": "unload", "lora_name": a.name, "load_id": a.load_id, "adapter_sha256": a.sha256,
                        "reason": reason, "at": _now(), "host": socket.gethostname(), "pid": os.getpid(),
                    })
                except Exception:
                    log.exception("recording that adapter %s was forgotten failed", a.name)

    def table_for(self, name: str, base: Any) -> dict[str, Adapter]:
        table, dropped, old = self.adapters.current(base)
        if dropped:
            self.forget(dropped, old, name, "base_model_changed")
        return table

    async def current_table(self, name: str, base: Any) -> dict[str, Adapter]:
        table, dropped, old = self.adapters.current(base)
        if dropped:  # once per swap: unloading and recording block, so not on the event loop
            await run_in_threadpool(self.forget, dropped, old, name, "base_model_changed")
        return table

    async def resolve(self, model: str | None) -> tuple[str, Any]:
        """(served model id, policy) for a request, from the provider."""
        name, base = self.policy_provider()
        table = await self.current_table(name, base)
        if model is None or model == name:
            return name, base
        if model in table:
            return model, table[model].view
        raise ApiError(404, f"model {model!r} does not exist (served: {[name, *sorted(table)]})",
                       param="model", code="model_not_found")

    def loading_on(self) -> AdapterLoading:
        if self.adapter_loading is None:
            raise ApiError(403, "adapter loading is disabled on this server (serve.allow_adapter_loading)",
                           type_="permission_error", code="adapter_loading_disabled")
        return self.adapter_loading

    # ------------------------------------------------------------------ routes
    async def health(self) -> dict:
        name, policy = self.policy_provider()
        return {"status": "ok", "model": name, "version": getattr(policy, "version", None)}

    async def models(self) -> dict:
        name, base = self.policy_provider()
        table = await self.current_table(name, base)
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "flywheel", "root": name, "parent": None}]
        for lora in sorted(table):
            data.append({"id": lora, "object": "model", "created": now, "owned_by": "flywheel", "root": lora,
                         "parent": name})
        return {"object": "list", "data": data}

    async def chat(self, request: Request) -> JSONResponse:
        lim = self.limits
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_body(request, lim), lim)
        if req.stream:
            raise ApiError(400, "streaming is not supported by flywheel serve", param="stream")
        params = req.sampling_params(lim)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        model_id, policy = await self.resolve(req.model)  # held until the response is built (hot swap)
        with self.slot():
            try:
                groups = await run_in_threadpool(self.batcher(policy).generate, [messages], params, tools=[tools])
            except PromptTooLongError as e:
                raise ApiError(400, f"the prompt has {e.tokens} tokens; the model's context is {e.limit} tokens",
                               param="messages", code="context_length_exceeded") from None
            except ModelLoadError:  # the adapter was unloaded while this request waited for the model
                raise ApiError(404, f"model {model_id!r} was unloaded", param="model",
                               code="model_not_found") from None
            except ValueError as e:  # the prompt format refused the conversation
                log.warning("request refused by the prompt format: %s", e)
                raise ApiError(400, "the messages and tools could not be rendered into a prompt",
                               param="messages") from None
        return JSONResponse(completion_body(req, model_id, policy, groups[0]))

    async def load_lora(self, request: Request) -> JSONResponse:
        loading = self.loading_on()
        req: LoadLoraRequest = parse_request(LoadLoraRequest, await read_body(request, self.limits), self.limits)
        with self.slot():
            await run_in_threadpool(self.load, req, loading)
        return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{req.lora_name}' added successfully."})

    async def unload_lora(self, request: Request) -> JSONResponse:
        loading = self.loading_on()
        req: UnloadLoraRequest = parse_request(UnloadLoraRequest, await read_body(request, self.limits), self.limits)
        with self.slot():
            await run_in_threadpool(self.unload, req, loading)
        return JSONResponse({"status": "ok",
                             "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully."})

    # ------------------------------------------------------------------ adapter admin (worker threads)
    def load(self, req: LoadLoraRequest, loading: AdapterLoading) -> None:
        adapters = self.adapters
        with adapters.admin:  # a second load of the same name waits here, then finds it taken
            name, base = self.policy_provider()
            table = self.table_for(name, base)
            reserved = {name, *RESERVED_ADAPTER_NAMES}
            if hasattr(base, "adapter_names"):
                reserved |= set(base.adapter_names())
            if loading.reserved is not None:
                try:
                    reserved |= set(loading.reserved())
                except Exception as e:  # unknown registry names: refuse rather than shadow one
                    log.error("reading the registered model names failed: %s", e)
                    raise ApiError(503, "the model registry could not be read to check the adapter name; retry later",
                                   type_="server_error", code="registry_unavailable") from None
            if req.lora_name in reserved:
                raise ApiError(409, f"'lora_name' {req.lora_name!r} is reserved on this server", param="lora_name",
                               code="adapter_name_reserved")
            if req.lora_name in table:
                raise ApiError(409, f"LoRA adapter {req.lora_name!r} is already loaded; unload it first",
                               param="lora_name", code="adapter_already_loaded")
            if not hasattr(base, "load_adapter"):
                raise ApiError(400, f"the served policy {name!r} cannot load LoRA adapters", param="lora_name")
            directory = allowed_adapter_dir(req.lora_path, loading.dirs)
            sha = adapter_digest(directory)
            internal = f"lora-{uuid.uuid4().hex[:16]}"
            try:
                base.load_adapter(directory, internal, activate=False)
            except ModelLoadError as e:
                log.warning("loading adapter %r failed: %s", req.lora_name, e)
                raise ApiError(400, "the adapter could not be loaded (the server log says why)", param="lora_path",
                               code="adapter_load_failed") from None
            entry = Adapter(req.lora_name, internal, base.adapter_view(internal, version=f"adapter:{req.lora_name}"),
                             uuid.uuid4().hex, sha)
            try:
                loading.record("adapter.loaded", f"serve:{name}", {
                    "action": "load", "lora_name": req.lora_name, "load_id": entry.load_id, "adapter_sha256": sha,
                    "adapter_path": str(directory), "base_model": name,
                    "base_version": str(getattr(base, "version", "")), "at": _now(),
                    "host": socket.gethostname(), "pid": os.getpid(),
                })
            except Exception:
                log.exception("recording the load of adapter %r failed; unloading it", req.lora_name)
                base.unload_adapter(internal)
                raise ApiError(503, "the load could not be recorded in the event store, so nothing was loaded; "
                               "retry later", type_="server_error", code="event_store_unavailable") from None
            if not adapters.publish(base, entry):  # the base was replaced meanwhile: this adapter is moot
                self.forget([entry], base, name, "base_model_changed")
                raise ApiError(503, "the served model changed during the load; retry", type_="server_error",
                               code="model_changed")

    def unload(self, req: UnloadLoraRequest, loading: AdapterLoading) -> None:
        adapters = self.adapters
        with adapters.admin:
            name, base = self.policy_provider()
            self.table_for(name, base)
            entry = adapters.withdraw(base, req.lora_name)  # no new request gets it from now on
            if entry is None:
                raise ApiError(404, f"LoRA adapter {req.lora_name!r} is not loaded", param="lora_name",
                               code="model_not_found")
            try:
                loading.record("adapter.unloaded", f"serve:{name}", {
                    "action": "unload", "lora_name": entry.name, "load_id": entry.load_id,
                    "adapter_sha256": entry.sha256, "reason": "api", "at": _now(),
                    "host": socket.gethostname(), "pid": os.getpid(),
                })
            except Exception:
                log.exception("recording the unload of adapter %r failed; it stays loaded", req.lora_name)
                adapters.publish(base, entry)
                raise ApiError(503, "the unload could not be recorded in the event store, so the adapter stays "
                               "loaded; retry later", type_="server_error", code="event_store_unavailable") from None
            try:
                base.unload_adapter(entry.internal)
            except Exception:  # no longer served; its weights stay in memory until the base is replaced
                log.exception("dropping the weights of adapter %r failed", req.lora_name)


def create_app(policy_provider: PolicyProvider, *, api_key: str | None = None, limits: ServeLimits | None = None,
               allowed_hosts: Sequence[str] | None = None, adapter_loading: AdapterLoading | None = None,
               ) -> FastAPI:
    """The FastAPI app (see module docstring). ``policy_provider()`` returns ``(model name, policy)``.

    ``allowed_hosts``: Host header names answered (default: the loopback names; see
    :func:`flywheel.net.allowed_hosts_for`). ``adapter_loading``: None keeps the LoRA endpoints off (403).
    ``app.state.serve`` is the app's :class:`ServeState`.
    """
    state = ServeState(policy_provider, api_key=api_key, limits=limits, allowed_hosts=allowed_hosts,
                       adapter_loading=adapter_loading)
    app = FastAPI(title="flywheel serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.state.adapters = state.adapters
    app.state.limits = state.limits  # run_in_thread / serve configure uvicorn from it
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.middleware("http")(state.guard)
    app.get("/health")(state.health)
    app.get("/v1/models")(state.models)
    app.post("/v1/chat/completions")(state.chat)
    app.post("/v1/load_lora_adapter")(state.load_lora)
    app.post("/v1/unload_lora_adapter")(state.unload_lora)
    return app
