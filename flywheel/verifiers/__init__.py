"""Verifiers: ``verify(spec, trajectory) -> Verdict`` (the contract and every kind: :mod:`flywheel.verifiers.registry`)."""

from __future__ import annotations

from flywheel.verifiers.registry import (
    KINDS,
    InfraError,
    ParseResult,
    SpecError,
    ToolCall,
    Verdict,
    VerifyContext,
    answer_message,
    format_tool_calls,
    parse_tool_calls,
    register_verifier,
    validate_spec,
    verify,
)

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
