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

The package's rooms: :mod:`~flywheel.serve.schema` (the request models, bounds and errors),
:mod:`~flywheel.serve.adapters` (runtime LoRA adapters), :mod:`~flywheel.serve.app` (the FastAPI app and its
guards), :mod:`~flywheel.serve.runner` (keys, the policy, uvicorn; :func:`serve`).
"""

from flywheel.net import allowed_hosts_for, host_name
from flywheel.serve.adapters import ADAPTER_FILES
from flywheel.serve.app import ServeState, completion_body, create_app, error_response, read_body
from flywheel.serve.runner import (
    adapter_dirs,
    build_policy,
    read_key_file,
    registry_names,
    resolve_api_key,
    run_in_thread,
    serve,
    static_provider,
    store_recorder,
    uvicorn_config,
)
from flywheel.serve.schema import (
    ADAPTER_ROUTES,
    RESERVED_ADAPTER_NAMES,
    AdapterLoading,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionSpec,
    LoadLoraRequest,
    PolicyProvider,
    Recorder,
    ServeError,
    ServeLimits,
    TextPart,
    ToolCall,
    ToolSpec,
    UnloadLoraRequest,
    parse_request,
)

__all__ = [
    "ADAPTER_FILES", "ADAPTER_ROUTES", "RESERVED_ADAPTER_NAMES", "AdapterLoading", "ApiError", "ChatCompletionRequest",
    "ChatMessage", "FunctionCall", "FunctionSpec", "LoadLoraRequest", "PolicyProvider", "Recorder", "ServeError",
    "ServeLimits", "ServeState", "TextPart", "ToolCall", "ToolSpec", "UnloadLoraRequest", "adapter_dirs",
    "allowed_hosts_for", "build_policy", "completion_body", "create_app", "error_response", "host_name",
    "parse_request", "read_body", "read_key_file", "registry_names", "resolve_api_key", "run_in_thread", "serve",
    "static_provider", "store_recorder", "uvicorn_config",
]
