"""The shared vocabulary: what every stage means by a message's text, a tool, a tool call, a content
id, an entity reference, a failure kind. A leaf: it imports nothing from the rest of the project, so
any module may use it.

- :mod:`~flywheel.vocab.messages`: :func:`text_of` (the one content reader, with the split's frozen
  variant as parameters), :func:`require_text`, :func:`answer_message`, :func:`last_index`.
- :mod:`~flywheel.vocab.tools`: :func:`function_of` and everything built on it (names, parameters,
  the nested/flat shapes, tool-call entries).
- :mod:`~flywheel.vocab.toolcalls`: :class:`ToolCall`, the tolerant parser of model output, the
  canonical renderer, and the one rule for tool-call arguments (:func:`decode_arguments`).
- :mod:`~flywheel.vocab.ids`: :func:`canonical_json`, digests, content ids by named width.
- :mod:`~flywheel.vocab.refs`: entity kinds, model and suite/env references.
- :mod:`~flywheel.vocab.kinds`: failure kinds, split and suite names.
- :mod:`~flywheel.vocab.text`: the normalisers that define failure ids, request hashes and
  ``exact`` verdicts.
- :mod:`~flywheel.vocab.errors`: :class:`InfraError`.
- :mod:`~flywheel.vocab.records`: the typed records that cross stage boundaries (:class:`EvalTask`,
  the Parquet rows) and the map of every stage-to-stage contract.
"""

from __future__ import annotations

from flywheel.vocab.errors import InfraError
from flywheel.vocab.ids import canonical_json, content_id, digest, json_id, sha256_file, short_id
from flywheel.vocab.kinds import FAILURE_KINDS, SPLITS, SUITES, TOOL_CALL_KINDS
from flywheel.vocab.messages import answer_message, last_index, message_text, require_text, text_of
from flywheel.vocab.records import EvalItemRow, EvalTask, PreferenceRow, RolloutRow, TaskMetadata, TaskRecord
from flywheel.vocab.refs import (
    ENTITY_KINDS,
    ModelRefSpec,
    entity_kind,
    model_entity,
    parse_model_entity,
    parse_model_ref,
    parse_versioned_ref,
    with_prefix,
)
from flywheel.vocab.text import answer_text, failure_text, request_words
from flywheel.vocab.toolcalls import (
    ArgumentsError,
    DecodedCall,
    ParseResult,
    ToolCall,
    decode_arguments,
    decode_tool_calls,
    format_tool_calls,
    loads_strict,
    parse_tool_calls,
)
from flywheel.vocab.tools import (
    call_function,
    called_names,
    function_doc,
    function_of,
    normalise_tool,
    tool_name,
    tool_names,
    tool_parameters,
)

__all__ = [
    "ENTITY_KINDS", "FAILURE_KINDS", "SPLITS", "SUITES", "TOOL_CALL_KINDS",
    "ArgumentsError", "DecodedCall", "EvalItemRow", "EvalTask", "InfraError", "ModelRefSpec", "ParseResult",
    "PreferenceRow", "RolloutRow", "TaskMetadata", "TaskRecord", "ToolCall",
    "answer_message", "answer_text", "call_function", "called_names", "canonical_json", "content_id",
    "decode_arguments", "decode_tool_calls", "digest", "entity_kind", "failure_text", "format_tool_calls",
    "function_doc", "function_of", "json_id", "last_index", "loads_strict", "message_text", "model_entity",
    "normalise_tool", "parse_model_entity", "parse_model_ref", "parse_tool_calls", "parse_versioned_ref",
    "request_words", "require_text", "sha256_file", "short_id", "text_of", "tool_name", "tool_names",
    "tool_parameters", "with_prefix",
]
