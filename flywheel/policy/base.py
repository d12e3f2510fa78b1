"""The policy contract: sampling parameters, one sample, and the ``Policy`` protocol.

Every backend (Hugging Face in-process, OpenAI-compatible HTTP) returns the same :class:`Sample`,
so the rollout stage, the gate and ``flywheel serve`` never care which one produced it.

Guarantees shared by all backends:
- ``generate`` returns one inner list per prompt, in prompt order, each with exactly ``n`` samples.
- ``completion_token_ids`` and ``logprobs`` have the same length; ``logprobs[i]`` is the sampler
  log-probability of ``completion_token_ids[i]`` (see each backend for what "sampler" means there).
- ``finish_reason`` is ``"stop"`` (end-of-turn token or a stop string) or ``"length"``
  (``max_new_tokens`` reached); ``truncated`` is true exactly when it is ``"length"``.

Not guaranteed: token ids from an HTTP server that does not return them (``prompt_token_ids`` and
``completion_token_ids`` are then empty and ``logprobs`` may be empty as well; the HTTP backend
says so in its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding (``top_p`` is then ignored).

    ``seed`` makes a call reproducible: the same prompts, parameters and weights on the same device
    and dtype give the same samples. ``None`` draws fresh randomness.
    ``stop`` strings end a sample when they appear in its decoded text; the text is cut before the
    stop string (as the OpenAI API does) while the token ids keep the token that completed it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: list[str] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1 (got {self.n})")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sample:
    """One completion of one prompt.

    ``text`` is the decoded completion without special tokens (the end-of-turn token is in
    ``completion_token_ids`` but not in ``text``). ``gen_ms`` is the wall time from the start of the
    call that produced it until this sample finished (batched samples share the prefill).
    """

    text: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    truncated: bool
    gen_ms: float
    extra: dict[str, Any] = field(default_factory=dict)


class PolicyRequestError(RuntimeError):
    """A backend rejected a request for a reason retrying cannot fix (HTTP 4xx other than 429),
    or kept failing after all retries. ``status`` is the HTTP status (``None`` for a connection
    failure) and ``body`` the server's response text."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class PromptTooLongError(ValueError):
    """A prompt does not fit the model's context. ``index`` is its position in the call that
    raised, ``tokens`` its length and ``limit`` the context size; the message names all three."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(f"prompt {index} has {tokens} tokens; the model's context is {limit}")
        self.index, self.tokens, self.limit = index, tokens, limit


@runtime_checkable
class Policy(Protocol):
    """What the rollout stage, the gate and the server sample from.

    ``prompts`` are chat conversations (OpenAI message dicts); ``tools`` holds, per prompt, the
    OpenAI function specs offered to the model (``None`` for none). Formatting goes through
    :mod:`flywheel.policy.format` in every backend so training and serving see the same text.
    """

    name: str
    version: str

    def generate(
        self,
        prompts: list[list[dict]],
        params: SamplingParams | int | None = None,
        *,
        tools: list[list[dict]] | list[dict] | None = None,
    ) -> list[list[Sample]]: ...


def coerce_params(params: SamplingParams | int | None) -> SamplingParams:
    """``None`` -> defaults, an ``int`` -> ``SamplingParams(n=that)``, else the params unchanged."""
    if params is None:
        return SamplingParams()
    if isinstance(params, bool):
        raise TypeError("params must be SamplingParams or an int n, not a bool")
    if isinstance(params, int):
        return SamplingParams(n=params)
    if isinstance(params, SamplingParams):
        return params
    raise TypeError(f"params must be SamplingParams or an int n (got {type(params).__name__})")


def per_prompt_tools(tools: list[list[dict]] | list[dict] | None, n_prompts: int) -> list[list[dict]]:
    """Normalise ``tools`` to one list per prompt.

    ``None`` -> no tools anywhere; a flat list of function specs (dicts) -> the same tools for every
    prompt; a list of lists -> as given, and it must have one entry per prompt.
    """
    if not tools:
        return [[] for _ in range(n_prompts)]
    if len(tools) > 0 and all(isinstance(t, dict) for t in tools):
        return [list(tools) for _ in range(n_prompts)]  # type: ignore[arg-type]
    if len(tools) != n_prompts:
        raise ValueError(f"tools has {len(tools)} entries for {n_prompts} prompts; give one list per prompt")
    return [list(t or []) for t in tools]  # type: ignore[arg-type]
