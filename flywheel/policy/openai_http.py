"""OpenAI-compatible HTTP backend: vLLM, SGLang, ``flywheel serve`` or any ``/v1/chat/completions``.

One request per prompt (with ``n`` samples), at most ``max_concurrency`` in flight (a thread pool
over one ``httpx.Client``: connection pooling, no event loop to own).

Retries (:func:`flywheel.net.request_with_retries`, shared with the ``llm_judge`` verifier): only on
HTTP 429, HTTP 5xx and transport errors (connection refused/reset, timeouts), up to ``max_retries``
times, with exponential backoff and full jitter (0.5 s * 2^attempt, capped at 30 s; a ``Retry-After``
header is honoured up to the cap). Everything else (400, 401, 404, 413, ...) raises
:class:`PolicyRequestError` at once with the status and the server's body: retrying a bad request
only hides it.

Prompt formatting (``prompt_format``):
- ``"flywheel"`` (default): the client applies :func:`flywheel.policy.format.build_prompt_messages`
  (tool prompt in the system message, calls rendered as text) and turns tool turns into tagged
  user turns, and sends no ``tools``. The server only applies its chat template, so a model trained
  by flywheel sees exactly its training text on vLLM too (vLLM would otherwise ignore tools for a
  template without tool support, or refuse them without ``--enable-auto-tool-choice``).
  Identical to the HF backend for templates without a tool role (SmolLM2); for templates with one,
  tool turns arrive as user turns instead.
- ``"server"``: messages and ``tools`` are passed through untouched (native tool calling).

Token ids (extension fields, vLLM's convention): the request sets ``return_token_ids: true`` and
``logprobs: true``; the response's top-level ``prompt_token_ids`` and each choice's ``token_ids``
fill the :class:`Sample`. If a server omits ``token_ids`` but returns tokens as ``"token_id:<n>"``
(vLLM's ``--return-tokens-as-token-ids``), those are parsed. A server that returns neither leaves
the id lists empty: such samples can be scored but not trained on, and ``Sample.extra
["token_ids_missing"]`` says so.

Sampler log-probabilities are whatever the server reports (vLLM: the raw model distribution by
default, not the temperature-scaled one; ``flywheel serve``: the HF backend's definition).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from flywheel.net import (
    BACKOFF_BASE_S,
    CHAT_COMPLETIONS_PATH,
    HTTPRequestError,
    openai_base_url,
    request_with_retries,
)
from flywheel.policy.base import (
    PolicyRequestError,
    Sample,
    SamplingParams,
    coerce_params,
    per_prompt_tools,
)
from flywheel.policy.format import build_prompt_messages, tool_turns_as_user

if TYPE_CHECKING:
    import httpx

# This client's backoff base, read at each request (a test shortens it for this client alone).
_BACKOFF_BASE_S = BACKOFF_BASE_S


class OpenAIPolicy:
    """A policy behind an OpenAI-compatible server. ``model`` is the served model (or LoRA) name."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 4,
        *,
        prompt_format: Literal["flywheel", "server"] = "flywheel",
        version: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        import httpx  # ~100 ms at import: paid by whoever makes a client, not by every importer

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (got {max_concurrency})")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (got {max_retries})")
        if prompt_format not in ("flywheel", "server"):
            raise ValueError(f"prompt_format must be 'flywheel' or 'server' (got {prompt_format!r})")
        self.base_url = openai_base_url(base_url)
        self.model = model
        self.name = model
        self.version = version or model
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.prompt_format = prompt_format
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own_client = client is None
        self._client = client or httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._own_client:
            self._client.close()

    def __enter__(self) -> OpenAIPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def for_model(self, model: str) -> OpenAIPolicy:
        """The same server and connection pool, sampling from ``model`` (e.g. a LoRA name)."""
        other = OpenAIPolicy.__new__(OpenAIPolicy)
        other.__dict__.update(self.__dict__)
        other.model = other.name = other.version = model
        other._own_client = False
        return other

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, json_body: dict | None = None) -> Any:
        """Send one request with the retry policy; returns the decoded JSON (or text) body. Raises
        :class:`PolicyRequestError` (status None: no response) when the request failed for good."""
        try:
            resp = request_with_retries(self._client, method, path, json_body=json_body,
                                        max_retries=self.max_retries, backoff_base_s=_BACKOFF_BASE_S)
        except HTTPRequestError as e:
            raise PolicyRequestError(str(e), status=e.status, body=e.body) from None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # ------------------------------------------------------------------ policy
    def _messages(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        if self.prompt_format == "server":
            return messages
        return tool_turns_as_user(build_prompt_messages(messages, tools))

    def _body(self, messages: list[dict], tools: list[dict], p: SamplingParams) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(messages, tools),
            "n": p.n,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "max_tokens": p.max_new_tokens,
            "logprobs": True,
            "return_token_ids": True,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if self.prompt_format == "server" and tools:
            body["tools"] = tools
        return body

    def generate(
        self,
        prompts: list[list[dict]],
        params: SamplingParams | int | None = None,
        *,
        tools: list[list[dict]] | list[dict] | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples per prompt, prompts sent concurrently; results in prompt order."""
        p = coerce_params(params)
        per_tools = per_prompt_tools(tools, len(prompts))
        bodies = [self._body(m, t, p) for m, t in zip(prompts, per_tools, strict=True)]

        def one(body: dict) -> list[Sample]:
            t0 = time.perf_counter()
            data = self.request("POST", CHAT_COMPLETIONS_PATH, body)
            return parse_chat_response(data, expected_n=p.n, gen_ms=(time.perf_counter() - t0) * 1000.0)

        if len(bodies) == 1:
            return [one(bodies[0])]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies))) as pool:
            return list(pool.map(one, bodies))

    def load_lora_adapter(self, name: str, path: str) -> Any:
        """vLLM's runtime endpoint (needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on vLLM).
        ``path`` is read by the *server*, so it must be a path on the server's file system."""
        return self.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def unload_lora_adapter(self, name: str) -> Any:
        return self.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def models(self) -> list[str]:
        data = self.request("GET", "/v1/models")
        return [m["id"] for m in data.get("data", [])]


def _token_ids_from_logprobs(entries: list[dict]) -> list[int] | None:
    out = []
    for e in entries:
        tok = str(e.get("token", ""))
        if not tok.startswith("token_id:"):
            return None
        try:
            out.append(int(tok[len("token_id:") :]))
        except ValueError:
            return None
    return out


def parse_chat_response(data: Any, *, expected_n: int, gen_ms: float = 0.0) -> list[Sample]:
    """An OpenAI chat completion body -> samples (ordered by choice index)."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise PolicyRequestError(f"response is not a chat completion: {str(data)[:300]}", status=200, body=str(data))
    choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != expected_n:
        raise PolicyRequestError(
            f"asked for n={expected_n} samples, server returned {len(choices)}", status=200, body=str(data)[:2000]
        )
    prompt_ids = [int(x) for x in (data.get("prompt_token_ids") or [])]
    samples = []
    for c in choices:
        msg = c.get("message") or {}
        text = msg.get("content")
        if text is None and msg.get("tool_calls"):
            # servers with a tool parser drop the raw text; rebuild it in the shared format
            text = build_prompt_messages([{"role": "assistant", **msg}], None)[0]["content"]
        entries = ((c.get("logprobs") or {}).get("content")) or []
        logprobs = [float(e.get("logprob", 0.0)) for e in entries]
        ids = c.get("token_ids")
        if ids is None:
            ids = _token_ids_from_logprobs(entries) if entries else None
        finish = c.get("finish_reason") or "stop"
        finish_reason = "length" if finish == "length" else "stop"  # stop, tool_calls, eos, ...
        extra: dict[str, Any] = {"server_finish_reason": finish}
        if ids is None:
            extra["token_ids_missing"] = True
        if msg.get("tool_calls"):
            extra["tool_calls"] = msg["tool_calls"]
        samples.append(
            Sample(
                text=text or "",
                prompt_token_ids=prompt_ids,
                completion_token_ids=[int(x) for x in (ids or [])],
                logprobs=logprobs,
                finish_reason=finish_reason,
                truncated=finish_reason == "length",
                gen_ms=gen_ms,
                extra=extra,
            )
        )
    return samples
