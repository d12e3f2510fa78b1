"""``flywheel serve``: an OpenAI-compatible server over a flywheel policy (the HF backend by default).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (``n``,
``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``seed``, ``stop``,
``logprobs``, ``tools``; no streaming), and, only when adapter loading is enabled,
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's runtime LoRA endpoints:
a loaded adapter is served under its ``lora_name`` as an extra model id).

Responses follow the OpenAI chat completion format. ``message.content`` always holds the raw
completion text (lossless, so a client can train on it); when that text parses as tool calls with
the verifiers' shared parser, ``message.tool_calls`` carries them too (``function.arguments`` as
a JSON string) and ``finish_reason`` is ``"tool_calls"``. Extension fields follow vLLM's
``return_token_ids`` convention: with ``"return_token_ids": true`` the body has
``prompt_token_ids`` and every choice ``token_ids``.

Requests are validated by pydantic models of the OpenAI request (:class:`ChatCompletionRequest`,
:class:`LoadLoraRequest`, :class:`UnloadLoraRequest`): unknown fields are ignored, known ones must
have their JSON type (``"n": 2.0`` and ``"logprobs": "yes"`` are refused, not coerced). The body is
parsed with pydantic-core's JSON parser, which refuses ``NaN``/``Infinity`` and nesting deeper than
200 levels; a number that overflows to infinity (``1e999``) is refused anywhere in the body.

Security and bounds (``flywheel.config.ServeConfig``)
- Loopback is not a trust boundary: every local user, and every web page a local browser opens, can
  reach it. So a POST must say ``Content-Type: application/json`` (415 otherwise; a page can send
  ``text/plain`` or a form without a CORS preflight, never JSON), and the ``Host`` header must name
  the bound address (or ``serve.allowed_hosts``): a DNS-rebound name is refused with 400, so a page
  cannot read replies either. On a machine other people use, set an API key anyway.
- Binding to anything but a loopback address requires an API key (:class:`ServeError` otherwise).
  The key comes from the environment (``serve.api_key_env``) or a file (``--api-key-file``,
  ``serve.api_key_file``), never from the command line, where ``ps`` shows it to every user. When a
  key is set it is checked on *every* request, ``/health`` included, as ``Authorization: Bearer
  <key>`` with :func:`hmac.compare_digest` (constant time).
- Request bodies over ``max_body_bytes`` get 413 (checked on ``Content-Length`` and while reading a
  chunked body); a body not received within ``body_timeout_s`` gets 408; a connection that has not
  delivered a complete request head within ``header_timeout_s`` is closed (uvicorn itself has no
  such timeout: a client trickling header bytes held a connection forever). uvicorn's
  ``limit_concurrency`` bounds open connections plus running tasks (503 beyond it).
- ``max_tokens`` over ``max_tokens``, ``n`` over ``max_n``, more than ``max_stop`` stop strings or one
  longer than ``max_stop_chars`` get 400; more than ``max_concurrency`` requests generating at once
  get 429 at once rather than queueing without bound.
- Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` and close their
  connection (an unread body must not keep it): 400 bad JSON or fields; 401 bad or missing key; 403
  refused (adapter loading off, path not allowed); 404 unknown model or route; 408; 409 adapter name
  taken; 413; 415; 429; 500; 503. Error bodies never carry internal text: an unexpected exception
  answers "internal error" with a reference that the server log shows next to the traceback;
  adapter errors never echo server paths.

Adapters (off unless ``serve.allow_adapter_loading``; :class:`AdapterLoading`)
- ``lora_path`` must be an absolute path whose real location (symlinks followed) lies in one of
  ``serve.adapter_dirs`` and holds ``adapter_config.json`` and ``adapter_model.safetensors`` (no
  pickled ``.bin`` weights), all inside the allowed directory too.
- Both endpoints need an API key, on loopback too (``AdapterLoading.api_key``, default the server's;
  loading is refused at start without one): loading an adapter changes what a model name answers for
  every client, which is an operator's act, not any local user's (401 otherwise).
- Names match ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}`` and are refused (409) when reserved (the served
  model's name, ``default``: the champion's own adapter, the aliases ``champion`` and ``challenger``,
  every registered model name and alias the registry lists at load time (503 when it cannot be read),
  any adapter the base policy already carries) or already loaded: a served adapter is never replaced
  in place; unload it first.
- An adapter is loaded under a fresh internal name and becomes visible under ``lora_name`` only
  after the load succeeded *and* its ``adapter.loaded`` event was appended to the event store; a
  failed load leaves the served model exactly as it was (:func:`flywheel.policy.models.attach_adapter`)
  and a load that cannot be recorded is undone (503). An unload is recorded before the weights are
  dropped; adapters forgotten because the base policy changed are recorded as unloaded too.
- Not covered: a process that can write inside an allowed directory can change files between the
  check and the load (the recorded sha256 is of the files as checked).

Hot swap (``policy_provider``): every request calls the provider when it starts and keeps the
returned ``(name, policy)`` until it ends. A deployer that moves the ``champion`` alias only has to
make the provider return the new policy: requests already running finish on the policy they started
with (they hold a reference, so it is not freed under them) and new requests get the new one;
nothing is dropped. Nothing in the server keeps a replaced policy alive: batchers hold their policy
weakly and the adapter table forgets adapters (and their views of the old model) on a swap.

Not covered: streaming, ``logit_bias``, ``top_logprobs`` (returned empty), ``response_format``,
multiple workers (the model lives in one process; generation on it is serialised).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import hmac
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

# Request at module level: FastAPI resolves the string annotations of endpoints here
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, from_json
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flywheel.config import FlywheelConfig, ServeConfig
from flywheel.net import (
    LOOPBACK_HOSTS,
    allowed_hosts_for,
    bind,
    head_timeout_protocol,
    host_name,
    is_loopback,
)
from flywheel.policy.base import Policy, PromptTooLongError, SamplingParams
from flywheel.policy.batching import BatchingPolicy
from flywheel.policy.hf import HFPolicy
from flywheel.policy.models import ModelLoadError
from flywheel.policy.registry import ModelRefError, load_policy_for_version, resolve_model
from flywheel.store import NewEvent, StoreLockedError, open_store
from flywheel.tracking import Tracker
from flywheel.vocab.toolcalls import parse_tool_calls

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("flywheel.serve")

PolicyProvider = Callable[[], "tuple[str, Policy]"]
#: ``record(event type, stream, payload)`` appends one event or raises.
Recorder = Callable[[str, str, dict[str, Any]], None]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ServeError(RuntimeError):
    """The server cannot start as configured (e.g. a public bind address without an API key)."""


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-server bounds; defaults and meanings are ``ServeConfig``'s."""

    max_tokens: int = 1024
    max_n: int = 16
    max_body_bytes: int = 1_000_000
    max_concurrency: int = 4
    max_stop: int = 4
    max_stop_chars: int = 128
    limit_concurrency: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, sc: ServeConfig) -> ServeLimits:
        return cls(**{f.name: getattr(sc, f.name) for f in fields(cls)})


# The adapter endpoints (vLLM's runtime LoRA API): guarded by the adapter key, always.
ADAPTER_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Names no adapter may take, whatever the registry says: the champion's own adapter (HFPolicy.from_spec)
# and the registry aliases flywheel moves (a client asking for "champion" must get the champion).
RESERVED_ADAPTER_NAMES = frozenset({"default", "champion", "challenger"})


@dataclass(frozen=True)
class AdapterLoading:
    """Runtime LoRA loading, enabled by passing this to :func:`create_app`.

    ``dirs``: real (symlink-free) directories adapters may be loaded from. ``record``: appends the
    ``adapter.loaded``/``adapter.unloaded`` events; a load whose event cannot be appended is undone.
    ``api_key``: the key the adapter endpoints require (default: the server's key); one of the two
    must be set, on loopback too (a local user is not an operator). ``reserved()``: names an adapter
    may not take beyond :data:`RESERVED_ADAPTER_NAMES` and the served name (every registered model name
    and alias: :func:`registry_names`), read at each load; when it raises, the load is refused (503).
    """

    dirs: tuple[Path, ...]
    record: Recorder
    api_key: str | None = None
    reserved: Callable[[], Iterable[str]] | None = None

    def __post_init__(self) -> None:
        if not self.dirs:
            raise ServeError("adapter loading needs at least one allowed directory (serve.adapter_dirs)")
        object.__setattr__(self, "dirs", tuple(Path(os.path.realpath(d)) for d in self.dirs))


class ApiError(Exception):
    """An error answered to the client as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --------------------------------------------------------------------------- the OpenAI request
class _Model(BaseModel):
    # strict: JSON types as sent (no "2" -> 2, no 1 -> True); unknown fields are ignored as OpenAI's
    # own server ignores fields it does not use (user, metadata, presence_penalty ...)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description="A JSON string, as OpenAI sends it.")


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Model):
    type: Literal["function"]
    function: FunctionSpec


def _limits(info: ValidationInfo) -> ServeLimits | None:
    return (info.context or {}).get("limits")


class ChatCompletionRequest(_Model):
    """The fields of OpenAI's chat completion request that flywheel serve uses (plus vLLM's
    ``return_token_ids``). Server bounds come from ``context={"limits": ServeLimits}``."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool | None = None

    @field_validator("n")
    @classmethod
    def _n_bound(cls, v: int | None, info: ValidationInfo) -> int | None:
        lim = _limits(info)
        if v is not None and lim is not None and v > lim.max_n:
            raise PydanticCustomError("server_limit", "must be <= {limit} on this server", {"limit": lim.max_n})
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _tokens_bound(cls, v: int | None, info: ValidationInfo) -> int | None:
        lim = _limits(info)
        if v is not None and lim is not None and v > lim.max_tokens:
            raise PydanticCustomError("server_limit", "must be <= {limit} on this server", {"limit": lim.max_tokens})
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, v: Any, info: ValidationInfo) -> Any:
        # before validation: 140k stop strings are refused without validating each of them
        lim = _limits(info)
        if isinstance(v, list) and lim is not None and len(v) > lim.max_stop:
            raise PydanticCustomError(
                "server_limit", "at most {limit} stop strings on this server (got {n})",
                {"limit": lim.max_stop, "n": len(v)},
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        lim = _limits(info)
        for s in stops:
            if not s:
                raise PydanticCustomError("empty_stop", "stop strings must not be empty")
            if lim is not None and len(s) > lim.max_stop_chars:
                raise PydanticCustomError(
                    "server_limit", "stop strings are limited to {limit} characters on this server",
                    {"limit": lim.max_stop_chars},
                )
        return stops or None

    def sampling_params(self, lim: ServeLimits) -> SamplingParams:
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            n=self.n or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_new_tokens=max_new or min(256, lim.max_tokens),
            seed=self.seed,
            stop=self.stop or None,  # type: ignore[arg-type]  # the validator made it a list
        )


_LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class LoadLoraRequest(_Model):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str = Field(pattern=_LORA_NAME)
    lora_path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")  # NUL: no such path


class UnloadLoraRequest(_Model):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    lora_name: str = Field(pattern=_LORA_NAME)


def _non_finite_at(obj: Any) -> list[str | int] | None:
    """The path to the first float that is not finite (``1e999`` parses as inf), or None."""
    stack: list[Any] = [obj]
    while stack:  # the common case, nothing found, builds no paths (140k stop strings: ~20 ms, not 0.5 s)
        value = stack.pop()
        kind = type(value)
        if kind is float and not math.isfinite(value):
            break
        if kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
    else:
        return None
    paths: list[tuple[Any, list[str | int]]] = [(obj, [])]
    while paths:
        value, path = paths.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path
        if isinstance(value, dict):
            paths.extend((v, [*path, k]) for k, v in value.items())
        elif isinstance(value, list):
            paths.extend((v, [*path, i]) for i, v in enumerate(value))
    return None  # pragma: no cover - the first walk found one


def _where(loc: Sequence[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


def parse_request(model: type[_Model], raw: bytes, limits: ServeLimits | None = None) -> Any:
    """Parse and validate one request body; raises the 400 :class:`ApiError` a client should see."""
    try:
        obj = from_json(raw, allow_inf_nan=False)  # jiter: no NaN/Infinity, nesting limited to 200
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object")
    bad = _non_finite_at(obj)
    if bad is not None:
        raise ApiError(400, f"{_where(bad)}: numbers must be finite", param=str(bad[0]))
    try:
        return model.model_validate(obj, context={"limits": limits})
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False, include_context=False)[0]
        loc = first.get("loc") or ()
        message = f"{_where(loc)}: {first['msg']}" if loc else first["msg"]
        raise ApiError(400, message, param=str(loc[0]) if loc else None) from None


# --------------------------------------------------------------------------- Host header
# --------------------------------------------------------------------------- adapters
@dataclass
class _Adapter:
    name: str  # the public lora_name
    internal: str  # the peft adapter name on the base model (never chosen by a client)
    view: Any
    load_id: str
    sha256: str


def _weak(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weak-referenceable: held until the provider returns another policy
        return lambda: obj


class _Adapters:
    """LoRA adapters loaded through the API, tied to the base policy they were loaded onto."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the table
        self.admin = threading.Lock()  # one load or unload at a time
        self._base: Callable[[], Any] | None = None
        self.table: dict[str, _Adapter] = {}

    def current(self, base: Any) -> tuple[dict[str, _Adapter], list[_Adapter], Any]:
        """``(table, dropped, old base)``: a new base forgets every adapter of the old one."""
        with self.lock:
            if self._base is not None and self._base() is base:
                return dict(self.table), [], None
            dropped, old = list(self.table.values()), self._base() if self._base is not None else None
            self._base, self.table = _weak(base), {}
            return {}, dropped, old

    def publish(self, base: Any, entry: _Adapter) -> bool:
        with self.lock:
            if self._base is None or self._base() is not base:
                return False
            self.table[entry.name] = entry
            return True

    def withdraw(self, base: Any, name: str) -> _Adapter | None:
        with self.lock:
            if self._base is None or self._base() is not base:
                return None
            return self.table.pop(name, None)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat()


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for fname in ADAPTER_FILES:
        h.update(fname.encode() + b"\0")
        with open(directory / fname, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _allowed_adapter_dir(lora_path: str, dirs: Sequence[Path]) -> Path:
    """The real directory of ``lora_path``; 400/403 (never echoing a path) unless it is allowed."""
    if not Path(lora_path).is_absolute():
        raise ApiError(400, "'lora_path' must be an absolute path on the server", param="lora_path")

    def inside(p: Path) -> bool:
        return any(p == d or p.is_relative_to(d) for d in dirs)

    refused = ApiError(403, "'lora_path' is outside the directories this server loads adapters from "
                       "(serve.adapter_dirs)", type_="permission_error", param="lora_path",
                       code="adapter_path_not_allowed")
    real = Path(os.path.realpath(lora_path))
    if not inside(real):
        raise refused
    for fname in ADAPTER_FILES:
        f = Path(os.path.realpath(real / fname))
        if not inside(f):
            raise refused
        if not f.is_file():
            raise ApiError(400, "'lora_path' holds no LoRA adapter in safetensors form "
                           f"({' and '.join(ADAPTER_FILES)})", param="lora_path", code="adapter_not_found")
    return real


# --------------------------------------------------------------------------- the app
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
    return JSONResponse(_error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status,
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
        self.adapters = _Adapters()
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

    def forget(self, dropped: list[_Adapter], old_base: Any, served: str, reason: str) -> None:
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

    def table_for(self, name: str, base: Any) -> dict[str, _Adapter]:
        table, dropped, old = self.adapters.current(base)
        if dropped:
            self.forget(dropped, old, name, "base_model_changed")
        return table

    async def current_table(self, name: str, base: Any) -> dict[str, _Adapter]:
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
            directory = _allowed_adapter_dir(req.lora_path, loading.dirs)
            sha = _digest(directory)
            internal = f"lora-{uuid.uuid4().hex[:16]}"
            try:
                base.load_adapter(directory, internal, activate=False)
            except ModelLoadError as e:
                log.warning("loading adapter %r failed: %s", req.lora_name, e)
                raise ApiError(400, "the adapter could not be loaded (the server log says why)", param="lora_path",
                               code="adapter_load_failed") from None
            entry = _Adapter(req.lora_name, internal, base.adapter_view(internal, version=f"adapter:{req.lora_name}"),
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


# --------------------------------------------------------------------------- running
def read_key_file(path: Path) -> str:
    """The first line of ``path``, stripped. A file other users can read is used, with a warning
    (container secrets are often mounted 0444)."""
    try:
        st = path.stat()
        with open(path, encoding="utf-8") as f:
            key = f.read(4096).splitlines()[0].strip() if st.st_size else ""
    except (OSError, UnicodeDecodeError, IndexError) as e:
        raise ServeError(f"cannot read the API key file {path}: {e}") from None
    if not key:
        raise ServeError(f"the API key file {path} is empty")
    if st.st_mode & 0o077:
        log.warning("API key file %s is readable by other users (mode %o); chmod 600 it", path, st.st_mode & 0o777)
    return key


def resolve_api_key(cfg: FlywheelConfig, api_key: str | None, host: str, *, key_file: Path | None = None) -> str | None:
    """The server's key, first found of: ``api_key`` (library callers), ``key_file`` (the CLI's
    ``--api-key-file``), the env var named by ``serve.api_key_env``, ``serve.api_key_file``
    (relative to home). Required off loopback."""
    key = api_key or None
    if key is None and key_file is not None:
        key = read_key_file(Path(key_file).expanduser())
    if key is None:
        key = os.environ.get(cfg.serve.api_key_env) or None
    if key is None and cfg.serve.api_key_file is not None:
        p = Path(cfg.serve.api_key_file).expanduser()
        key = read_key_file(p if p.is_absolute() else cfg.home / p)
    if not is_loopback(host) and not key:
        raise ServeError(
            f"binding to {host} (not loopback) requires an API key: set {cfg.serve.api_key_env}, pass "
            "--api-key-file, or set serve.api_key_file"
        )
    return key


def registry_names(cfg: FlywheelConfig) -> Callable[[], set[str]]:
    """``reserved()`` for :class:`AdapterLoading`: every registered model name and every alias of one in
    the MLflow registry (an adapter named like them would shadow them for a client)."""
    from flywheel.tracking import Tracker

    tracker = Tracker(cfg)

    def names() -> set[str]:
        out: set[str] = set()
        for rm in tracker.client.search_registered_models():
            out.add(rm.name)
            aliases = getattr(rm, "aliases", None) or {}
            out.update(aliases.keys() if isinstance(aliases, dict) else (getattr(a, "alias", a) for a in aliases))
        return out

    return names


def adapter_dirs(cfg: FlywheelConfig) -> tuple[Path, ...]:
    """``serve.adapter_dirs`` (relative entries under home), default ``<home>/models`` and the MLflow
    artifact root: where flywheel's own trained and registered adapters live."""
    dirs = [Path(d).expanduser() for d in cfg.serve.adapter_dirs] or [cfg.models_dir, Path(cfg.mlflow_artifact_root)]
    return tuple(d if d.is_absolute() else cfg.home / d for d in dirs)


def store_recorder(cfg: FlywheelConfig, *, wait_s: float = 30.0) -> Recorder:
    """A :data:`Recorder` that opens the event store for each append and closes it again (so a
    long-running server is not the embedded warehouse's owner for days; while a cycle owns it, the
    append goes through the cycle's process). A warehouse held by a process that does not share it is
    waited for ``wait_s``; then the error propagates (the server answers 503 and changes nothing)."""

    def record(type_: str, stream: str, payload: dict[str, Any]) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open_store(cfg, open_timeout_s=wait_s) as store:
                    store.append(stream, NewEvent(type_, payload))
                return
            except StoreLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)

    return record


def static_provider(name: str, policy: Any) -> PolicyProvider:
    """A provider that always serves ``policy`` under ``name``."""
    return lambda: (name, policy)


def build_policy(cfg: FlywheelConfig, model: str | None = None, tracker: Tracker | None = None) -> tuple[str, Any]:
    """Load ``model`` (default ``cfg.policy.base_model``) with the HF backend, taking the references
    of ``flywheel rollout --policy`` (:func:`flywheel.policy.registry.resolve_model`): a registered
    version (``champion``, ``challenger``, ``model:<name>/<N>``, ``<name>/<N>``) is loaded as it is
    now (pinned: ``--champion`` follows the alias) and served as ``<name>-<N>``; a spec or directory
    is served under the spec or the directory's name. ``champion`` before the first promotion is
    the base model. A server URL is refused (:class:`ServeError`)."""
    try:
        m = resolve_model(cfg, tracker or Tracker(cfg), model or cfg.policy.base_model)
    except ModelRefError as e:
        raise ServeError(f"cannot serve {model!r}: {e}") from None
    if m.url is not None:
        raise ServeError(f"cannot serve {m.url}: it is a server already (serve a model spec, a directory "
                         "or a registered version)")
    if m.version is not None:
        return f"{m.name}-{m.version}", load_policy_for_version(cfg, tracker or Tracker(cfg), m.name, m.version)  # type: ignore[arg-type]
    spec = m.spec
    name = spec if spec in ("smollm2-135m", "tiny") else Path(spec).expanduser().resolve().name  # type: ignore[arg-type]
    policy = HFPolicy.from_spec(spec, cfg.home, device=cfg.policy.device, dtype=cfg.policy.dtype, name=name)
    return name, policy


def uvicorn_config(app: FastAPI, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the bounds of its :class:`ServeLimits` (``app.state.limits``)."""
    import uvicorn

    lim: ServeLimits = getattr(app.state, "limits", None) or ServeLimits()
    return uvicorn.Config(app, http=head_timeout_protocol(lim.header_timeout_s),
                          limit_concurrency=lim.limit_concurrency, **kwargs)


def serve(cfg: FlywheelConfig, model: str | None = None, host: str | None = None, port: int | None = None,
          *, api_key: str | None = None, provider: PolicyProvider | None = None,
          on_ready: Callable[[str, int], None] | None = None) -> None:
    """Load the policy and serve until interrupted. ``provider`` overrides ``model`` (hot swap).
    ``api_key`` (a library caller's) wins over the configured sources (:func:`resolve_api_key`)."""
    import uvicorn

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    key = resolve_api_key(cfg, api_key, host)
    loading = None
    if cfg.serve.allow_adapter_loading:
        if not key:
            raise ServeError(f"serve.allow_adapter_loading needs an API key, on loopback too: set {cfg.serve.api_key_env}, "
                             "pass --api-key-file, or set serve.api_key_file")
        loading = AdapterLoading(adapter_dirs(cfg), store_recorder(cfg), api_key=key, reserved=registry_names(cfg))
    if provider is None:
        provider = static_provider(*build_policy(cfg, model))
    app = create_app(provider, api_key=key, limits=ServeLimits.from_config(cfg.serve),
                     allowed_hosts=allowed_hosts_for(host, cfg.serve.allowed_hosts), adapter_loading=loading)
    sock = bind(host, port)
    if on_ready is not None:
        on_ready(host, sock.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, log_level="info", timeout_graceful_shutdown=30))
    server.run(sockets=[sock])


@contextmanager
def run_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a background thread (tests, embedding); yields the base URL.

    ``port=0`` picks a free port. The server is shut down and joined on exit.
    """
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off"))
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
