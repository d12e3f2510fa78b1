"""OpenAI-compatible HTTP backend: vLLM, SGLang, ``flywheel serve`` or any ``/v1/chat/completions``.

One request per prompt (with ``n`` samples), at most ``max_concurrency`` in flight (a thread pool
over one ``httpx.Client``: connection pooling, no event loop to own).

Retries (:func:`flywheel.net.request_with_retries`, shared with the ``llm_judge`` verifier): only on
HTTP 429, HTTP 5xx and transport errors (connection refused/reset, timeouts), up to ``max_retries``
times, with exponential backoff and full jitter (0.5 s * 2^attempt, capped at 30 s; a ``Retry-After``
header is honoured up to the cap). Everything else (400, 401, 404, 413, ...) raises
:class:`PolicyRequestError` at once with the status and the server's body: retrying a bad request
only hides it.

Several endpoints (vLLM replicas; ``base_url`` a list): the rules are in
:mod:`flywheel.policy.endpoints`. Each request goes to the endpoint with the fewest requests in flight
(ties round-robin), at most ``max_concurrency`` in flight *per endpoint*. A server failure
(connection refused/reset, timeout, HTTP 429/5xx) marks that server down for ``cooldown_s`` and sends
the request to another one at once; a round tries every endpoint once, and ``max_retries`` further
rounds follow with the same backoff as above. Only when every endpoint failed does it raise
:class:`~flywheel.policy.endpoints.AllEndpointsFailedError` (a :class:`PolicyRequestError`, an infra
error) naming each endpoint and its error. A 4xx about the request is raised at once, never retried
elsewhere. :meth:`OpenAIPolicy.spread` runs whole *groups* the same way (the harness uses it, so a
group of K samples is sampled on one server, and moves whole to another if that server fails).
Every :class:`Sample` carries the endpoint that answered it in ``extra["endpoint"]``. With one
endpoint everything is as it was: one server, ``max_retries`` retries on it.

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

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, TypeVar

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
from flywheel.policy.endpoints import (
    DEFAULT_COOLDOWN_S,
    AllEndpointsFailedError,
    EndpointPool,
    is_server_failure,
    run_on_endpoints,
)
from flywheel.policy.format import build_prompt_messages, tool_turns_as_user

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

# This client's backoff base, read at each request (a test shortens it for this client alone).
_BACKOFF_BASE_S = BACKOFF_BASE_S


class OpenAIPolicy:
    """A policy behind one or several OpenAI-compatible servers (``base_url``: one URL or a list of
    them, each with or without ``/v1``). ``model`` is the served model (or LoRA) name."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 4,
        *,
        prompt_format: Literal["flywheel", "server"] = "flywheel",
        version: str | None = None,
        client: httpx.Client | None = None,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
    ) -> None:
        import httpx  # ~100 ms at import: paid by whoever makes a client, not by every importer

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (got {max_concurrency})")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (got {max_retries})")
        if prompt_format not in ("flywheel", "server"):
            raise ValueError(f"prompt_format must be 'flywheel' or 'server' (got {prompt_format!r})")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one endpoint")
        self.endpoints = list(dict.fromkeys(openai_base_url(u) for u in urls))
        self.base_url = self.endpoints[0]
        self.model = model
        self.name = model
        self.version = version or model
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.prompt_format = prompt_format
        self._pool = EndpointPool(self.endpoints, cooldown_s=cooldown_s)
        # One endpoint: the client's base_url is it and requests use paths (as always). Several: one
        # client (pooling per origin), absolute URLs.
        self._absolute = len(self.endpoints) > 1
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own_client = client is None
        if client is not None:
            self._client = client
        elif not self._absolute:
            self._client = httpx.Client(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
                limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
            )
        else:
            conns = max_concurrency * len(self.endpoints)
            self._client = httpx.Client(
                headers=headers,
                # waiting for a pooled connection is not a server failure: no pool timeout
                timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s), pool=None),
                limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns),
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._own_client:
            self._client.close()

    def __enter__(self) -> OpenAIPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _view(self) -> OpenAIPolicy:
        other = OpenAIPolicy.__new__(OpenAIPolicy)
        other.__dict__.update(self.__dict__)
        other.endpoints = list(self.endpoints)
        other._own_client = False
        return other

    def for_model(self, model: str) -> OpenAIPolicy:
        """The same servers and connection pool, sampling from ``model`` (e.g. a LoRA name)."""
        other = self._view()
        other.model = other.name = other.version = model
        return other

    def on_endpoint(self, url: str) -> OpenAIPolicy:
        """This policy on one of its endpoints alone, one attempt per request (no retry, no failover:
        that is the caller's, e.g. :meth:`spread`). Same client, model and prompt format."""
        if url not in self.endpoints:
            raise ValueError(f"{url} is not one of this policy's endpoints {self.endpoints}")
        other = self._view()
        other.endpoints, other.base_url, other._absolute, other.max_retries = [url], url, True, 0
        return other

    @property
    def endpoint_pool(self) -> EndpointPool:
        """In-flight counts, cool-downs and per-endpoint answer/failure counters."""
        return self._pool

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, json_body: dict | None = None) -> Any:
        """Send one request with the retry policy; returns the decoded JSON (or text) body. Raises
        :class:`PolicyRequestError` (status None: no response) when the request failed for good (with
        several endpoints: :class:`~flywheel.policy.endpoints.AllEndpointsFailedError`, every one failed)."""
        return self.request_on_any(method, path, json_body)[0]

    def request_on_any(self, method: str, path: str, json_body: dict | None = None) -> tuple[Any, str]:
        """:meth:`request`, and the endpoint that answered."""
        if len(self.endpoints) == 1:
            url = self.endpoints[0] + path if self._absolute else path
            return self._send(method, url, json_body, self.max_retries), self.endpoints[0]
        return run_on_endpoints(self._pool, lambda u: self._send(method, u + path, json_body, 0),
                                what=f"{method} {path}", rounds=self.max_retries + 1, backoff_base_s=_BACKOFF_BASE_S)

    def _send(self, method: str, url: str, json_body: dict | None, max_retries: int) -> Any:
        try:
            resp = request_with_retries(self._client, method, url, json_body=json_body,
                                        max_retries=max_retries, backoff_base_s=_BACKOFF_BASE_S)
        except HTTPRequestError as e:
            raise PolicyRequestError(str(e), status=e.status, body=e.body) from None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def spread(self, items: Sequence[T], fn: Callable[[T, OpenAIPolicy], R], *,
               describe: Callable[[T], str] | None = None) -> list[R]:
        """``fn(item, policy)`` for every item, concurrently, each on **one** endpoint (``policy`` is
        :meth:`on_endpoint` of it); results in item order. A server failure inside ``fn`` retries the
        item whole on another endpoint (the rules of :func:`~flywheel.policy.endpoints.run_on_endpoints`,
        ``max_retries + 1`` rounds), so each item's result comes from exactly one endpoint. At most
        ``max_concurrency`` items per endpoint run at once. The first item that fails for good (or
        fails otherwise) is raised, and items not yet started are cancelled."""
        items = list(items)

        def run(i: int) -> R:
            what = describe(items[i]) if describe else f"item {i + 1} of {len(items)}"
            res, _ = run_on_endpoints(self._pool, lambda u: fn(items[i], self.on_endpoint(u)), what=what,
                                      rounds=self.max_retries + 1, backoff_base_s=_BACKOFF_BASE_S)
            return res

        if len(items) <= 1:
            return [run(i) for i in range(len(items))]
        ex = ThreadPoolExecutor(max_workers=min(len(items), self.max_concurrency * len(self.endpoints)))
        try:
            futures = [ex.submit(run, i) for i in range(len(items))]
            return [f.result() for f in futures]
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    def _broadcast(self, method: str, path: str, json_body: dict | None = None) -> dict[str, Any]:
        """The same request to every endpoint (each with ``max_retries`` retries); answers by endpoint.
        Endpoints that failed (server failures) are dropped from this policy, since they lack what the
        others now have; a 4xx is raised at once; :class:`AllEndpointsFailedError` if none answered."""
        if len(self.endpoints) == 1:
            return {self.endpoints[0]: self.request(method, path, json_body)}
        out: dict[str, Any] = {}
        errors: dict[str, str] = {}
        statuses: dict[str, int | None] = {}
        for u in self.endpoints:
            try:
                out[u] = self._send(method, u + path, json_body, self.max_retries)
            except PolicyRequestError as e:
                if not is_server_failure(e):
                    raise
                errors[u], statuses[u] = str(e), e.status
                self._pool.mark_down(u)
        if not out:
            raise AllEndpointsFailedError(f"{method} {path}", errors, statuses, self.max_retries + 1)
        if errors:
            log.warning("%s %s failed on %s: sampling from %s only", method, path, ", ".join(errors), ", ".join(out))
            self.endpoints = [u for u in self.endpoints if u in out]
            self.base_url = self.endpoints[0]
            self._pool = EndpointPool(self.endpoints, cooldown_s=self._pool.cooldown_s)
        return out

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
            data, endpoint = self.request_on_any("POST", CHAT_COMPLETIONS_PATH, body)
            samples = parse_chat_response(data, expected_n=p.n, gen_ms=(time.perf_counter() - t0) * 1000.0)
            for s in samples:
                s.extra["endpoint"] = endpoint
            return samples

        if len(bodies) == 1:
            return [one(bodies[0])]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency * len(self.endpoints), len(bodies))) as pool:
            return list(pool.map(one, bodies))

    def load_lora_adapter(self, name: str, path: str) -> Any:
        """vLLM's runtime endpoint (needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on vLLM).
        ``path`` is read by the *server*, so it must be a path on the server's file system. With several
        endpoints it is loaded on each (``path`` on storage they share) and the answers come back by
        endpoint; one that could not load it is dropped from this policy (see :meth:`_broadcast`)."""
        out = self._broadcast("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        return next(iter(out.values())) if len(out) == 1 else out

    def unload_lora_adapter(self, name: str) -> Any:
        out = self._broadcast("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        return next(iter(out.values())) if len(out) == 1 else out

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
