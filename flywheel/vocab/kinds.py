"""Names shared by stages: failure kinds and split names."""

from __future__ import annotations

__all__ = ["FAILURE_KINDS", "TOOL_CALL_KINDS", "SPLITS", "SUITES"]

#: Failure kinds, in the order a classification lists them (``flywheel.classify`` says what each means).
FAILURE_KINDS = (
    "invalid_json",
    "unknown_tool",
    "missing_required_arg",
    "wrong_arg_type",
    "wrong_arg_value",
    "no_tool_call",
    "extra_tool_call",
    "test_failure",
    "runtime_exception",
    "negative_feedback",
    "other",
)

#: The kinds about a tool call's name, arguments or count: an eval of one checks the calls.
TOOL_CALL_KINDS = FAILURE_KINDS[1:7]

#: Where the split places a request (``flywheel.split``).
SPLITS = ("train", "heldout", "excluded")

#: The suites ``flywheel evals build`` versions.
SUITES = ("train", "heldout", "regression")
