"""Policies: what rollouts, the gate and ``flywheel serve`` sample from.

- :mod:`flywheel.policy.base`: ``SamplingParams``, ``Sample``, the ``Policy`` protocol, ``PolicyRequestError``,
  ``PromptTooLongError``.
- :mod:`flywheel.policy.format`: the ONE prompt/answer format (BFCL prompting style) shared by all paths.
- :mod:`flywheel.policy.models`: offline base models (SmolLM2 GGUF -> safetensors, ``tiny``, local dirs).
- :mod:`flywheel.policy.hf`: ``HFPolicy``, in-process transformers sampling with exact logprobs.
- :mod:`flywheel.policy.openai_http`: ``OpenAIPolicy``, any OpenAI-compatible server (vLLM, flywheel serve),
  or several of them.
- :mod:`flywheel.policy.endpoints`: how work is spread over several endpoints and moved off a failed one.
- :mod:`flywheel.policy.testing`: tiny-model helpers for tests.

Only the light modules are imported here; torch/transformers load when a backend is used.
"""

from flywheel.policy.base import (
    FinishReason,
    Policy,
    PolicyRequestError,
    PromptTooLongError,
    Sample,
    SamplingParams,
)

__all__ = ["FinishReason", "Policy", "PolicyRequestError", "PromptTooLongError", "Sample", "SamplingParams"]
