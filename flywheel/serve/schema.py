"""The OpenAI request schema ``flywheel serve`` validates (pydantic models parsed strictly from the raw body),
the server's bounds (:class:`ServeLimits`), its errors, and the switch that enables runtime adapter loading.

The behaviour is described in :mod:`flywheel.serve`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, from_json

from flywheel.config import ServeConfig
from flywheel.policy.base import Policy, SamplingParams

PolicyProvider = Callable[[], "tuple[str, Policy]"]
#: ``record(event type, stream, payload)`` appends one event or raises.
Recorder = Callable[[str, str, dict[str, Any]], None]



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


def error_body(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict:
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
