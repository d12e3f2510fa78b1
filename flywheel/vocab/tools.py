"""OpenAI tool specs and tool-call entries: one way to find the function inside them.

A tool spec comes in two shapes: nested (``{"type": "function", "function": {"name", "description",
"parameters"}}``, what OpenAI sends and what ingest stores) and flat (``{"type": "function", "name",
...}`` as some SDKs write it, or a bare BFCL function doc ``{"name", ...}``). :func:`function_of`
returns the function part of either; everything else here builds on it.

A tool-call entry (an item of an assistant message's ``tool_calls``) is nested
(``{"id", "type": "function", "function": {"name", "arguments"}}``); :func:`call_function` returns
its function part. Failure ids hash what the nested shape holds and nothing else
(``flat=False``); readers that accept flat entries (``{"name", "arguments"}``) say so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = [
    "OPEN_PARAMETERS",
    "function_of",
    "function_doc",
    "tool_name",
    "tool_names",
    "tool_parameters",
    "normalise_tool",
    "call_function",
    "called_names",
]

#: The parameters schema of a function that declares none: an object with no declared properties.
OPEN_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def function_of(tool: Any) -> dict[str, Any] | None:
    """The function part of a tool spec: ``tool["function"]`` when it is an object (nested shape),
    else the spec itself (flat shape, bare function doc); None when ``tool`` is not an object."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


def function_doc(tool: Any) -> dict[str, Any]:
    """:func:`function_of`, strict: a ``ValueError`` for a spec that is not an object or has no
    function name (what a model is shown, and what a verifier checks calls against)."""
    if not isinstance(tool, dict):
        raise ValueError(f"a tool spec must be a JSON object (got {type(tool).__name__})")
    fn = function_of(tool)
    if fn is None or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool spec has no function name: {json.dumps(tool, default=str)[:200]}")
    return fn


def tool_name(tool: Any) -> str:
    """``str`` of the function's ``name`` (``""`` when there is none)."""
    fn = function_of(tool)
    return "" if fn is None else str(fn.get("name", ""))


def tool_names(tools: Iterable[Any] | None) -> list[str]:
    """Names of ``tools`` in order, nameless specs left out."""
    return [n for n in (tool_name(t) for t in tools or ()) if n]


def tool_parameters(tool: Any) -> dict[str, Any]:
    """The function's ``parameters`` schema; :data:`OPEN_PARAMETERS` when it declares none."""
    fn = function_of(tool) or {}
    params = fn.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def normalise_tool(t: Any) -> dict[str, Any] | None:
    """A nested OpenAI tool spec (``name``, ``description`` when a string, ``parameters`` when an
    object, or a JSON string holding one) from either shape; None when it has no name."""
    fn = function_of(t)
    if fn is None:
        return None
    if fn is t:
        fn = {k: v for k, v in t.items() if k != "type"}
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    out: dict[str, Any] = {"name": fn["name"]}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if isinstance(params, str):  # some instrumentations write the schema as a JSON string
        try:
            params = json.loads(params)
        except ValueError:
            params = None
    if isinstance(params, dict):
        out["parameters"] = params
    return {"type": "function", "function": out}


def call_function(entry: Any, *, flat: bool = True) -> dict[str, Any]:
    """The ``{name, arguments}`` part of a ``tool_calls`` entry: ``entry["function"]`` when it is an
    object; else, with ``flat``, the entry itself when it is an object (``{"name", "arguments"}``);
    else ``{}``."""
    if not isinstance(entry, dict):
        return {}
    fn = entry.get("function")
    if isinstance(fn, dict):
        return fn
    return entry if flat else {}


def called_names(messages: Any) -> list[str]:
    """Tool names called in ``messages`` (nested OpenAI entries), in first-call order, no repeats."""
    names: dict[str, None] = {}
    if type(messages) is not list:
        return []
    for m in messages:
        if type(m) is not dict:
            continue
        tcs = m.get("tool_calls")
        if type(tcs) is not list:
            continue
        for tc in tcs:
            fn = tc.get("function") if type(tc) is dict else None
            if type(fn) is dict and type(fn.get("name")) is str:
                names[fn["name"]] = None
    return list(names)
