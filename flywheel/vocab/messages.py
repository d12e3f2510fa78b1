"""OpenAI chat messages: the text of a message's content, and where the answer is.

One reader of message content for the whole project (:func:`text_of`), with one default rule:
``None`` -> ``""``; a string -> itself; a list of content parts -> the ``text`` of every part whose
``text`` is a string, joined with ``sep`` (``""``); anything else -> ``str(content)``. Parts of any
``type`` count (``input_text`` as well as ``text``); image parts have no text and add nothing.

Two callers keep a different, *frozen* rule, because a recorded identity was computed with it; each
passes it explicitly:

- the train / held-out split (:mod:`flywheel.split`) joins parts with ``" "`` and turns the ``text``
  of *every* object part into a string (``str(part.get("text", ""))``: a part without text adds
  ``""``, a number adds ``"5"``): ``text_of(c, sep=" ", nonstring_text="stringify")``. The request
  hashes and cluster names in ``eval.created`` events hash that text.
- the OTLP input adapter (:mod:`flywheel.ingest.otlp`) reads parts written under ``content`` as well
  as ``text`` and writes any other value as JSON: the stored trace (and so its failure id) is built
  from that text.

:func:`require_text` is the strict reader for what a model is shown (:mod:`flywheel.policy.format`):
only ``text`` parts, anything else is a ``ValueError`` naming the message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

__all__ = ["text_of", "request_content_text", "require_text", "last_index", "answer_message", "message_text",
           "json_text"]

NonStringText = Literal["skip", "stringify"]


def json_text(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``: how the OTLP adapter writes a non-text value."""
    return json.dumps(value, ensure_ascii=False)


def text_of(
    content: Any,
    *,
    sep: str = "",
    nonstring_text: NonStringText = "skip",
    keys: Sequence[str] = ("text",),
    other: Callable[[Any], str] = str,
) -> str:
    """The text of a message's ``content`` (see the module docstring for the rule).

    ``nonstring_text``: ``"skip"`` keeps only parts whose text is a string; ``"stringify"`` keeps
    every object part as ``str(<its text>)`` (``""`` when it has none). ``keys``: where a part holds
    its text, first present key wins. ``other``: how a value that is neither None, a string nor a
    list becomes text. Never raises for JSON values.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if not isinstance(p, dict):
                continue
            key = next((k for k in keys if k in p), None)
            if key is None:  # a part without text (an image)
                if nonstring_text == "stringify":
                    out.append("")
                continue
            value = p[key]
            if isinstance(value, str):
                out.append(value)
            elif nonstring_text == "stringify":
                out.append(str(value))
        return sep.join(out)
    return other(content)


def request_content_text(content: Any) -> str:
    """The split's frozen reading of content (see the module docstring): parts joined with ``" "``,
    the text of every object part as a string. Request hashes and cluster names hash it, and synth
    rewrites user text in this form (synthetic task ids hash the rewritten prompt)."""
    return text_of(content, sep=" ", nonstring_text="stringify")


def require_text(content: Any, where: str) -> str:
    """The text of ``content`` when it is a string, ``None`` or a list of ``text`` parts; anything else
    (an image, an audio part, a number) is a ``ValueError`` naming ``where``: a prompt that loses a
    part silently is a different prompt."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            else:
                raise ValueError(f"{where}: only text content parts are supported (got {str(p)[:80]})")
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, a list of text parts or null")


def message_text(message: Any) -> str:
    """:func:`text_of` the ``content`` of a message dict (``""`` for anything that is not a dict)."""
    return text_of(message.get("content")) if isinstance(message, dict) else ""


def last_index(messages: Sequence[Any], role: str) -> int | None:
    """Index of the last message with ``role`` (non-dict entries are skipped), or None."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == role:
            return i
    return None


def answer_message(trajectory: Sequence[Any]) -> dict | None:
    """The answer of a trajectory: its last assistant message, or None."""
    i = last_index(trajectory, "assistant")
    return trajectory[i] if i is not None else None
