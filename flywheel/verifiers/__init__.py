"""Verifiers: ``verify(spec, trajectory) -> Verdict``, the reward of every eval, environment and rollout.

The contract (kinds, parameters, infrastructure errors, verdicts unfit for training) is documented in
:mod:`flywheel.verifiers.registry`, which holds :func:`verify`, :func:`validate_spec` and
:func:`register_verifier`. The kinds live one family per module and register themselves on import:

- :mod:`~flywheel.verifiers.answers`: ``tool_call``, ``json_schema``, ``exact``, ``numeric``, ``regex``
  (tool-call matching rules: :mod:`~flywheel.verifiers.matching`);
- :mod:`~flywheel.verifiers.execution`: ``python_tests``, ``shell`` (sandboxed);
- :mod:`~flywheel.verifiers.judge`: ``llm_judge``;
- :mod:`~flywheel.verifiers.composite`: ``composite``.

Importing this package registers every kind.
"""

from __future__ import annotations

# Imported for their side effect: each module registers its kinds with the registry.
from flywheel.verifiers import answers, composite, execution, judge  # noqa: F401
from flywheel.verifiers.registry import (
    KINDS,
    SpecError,
    Verdict,
    VerifyContext,
    register_verifier,
    validate_spec,
    verify,
)
from flywheel.vocab.errors import InfraError
from flywheel.vocab.messages import answer_message
from flywheel.vocab.toolcalls import ParseResult, ToolCall, format_tool_calls, parse_tool_calls

__all__ = [
    "Verdict",
    "VerifyContext",
    "verify",
    "validate_spec",
    "register_verifier",
    "InfraError",
    "SpecError",
    "ToolCall",
    "ParseResult",
    "parse_tool_calls",
    "format_tool_calls",
    "answer_message",
    "KINDS",
]
