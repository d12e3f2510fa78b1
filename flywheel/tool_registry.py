"""Tool definitions that the trace lacks: the ``[ingest] tool_registry`` and undeclared tools.

Telemetry often records the calls a model made but not the tool definitions it was offered
(``opentelemetry-instrumentation-openai-v2`` 2.4 never writes ``gen_ai.tool.definitions``; a gateway
log may keep only the messages). Such a trace is a normal production trace, not a malformed one.

:func:`resolve_undeclared` runs on every record before validation. When a record declares **no**
tools at all and its messages call some, each called name is looked up in the registry:

- found: the registry's spec is appended to ``tools`` and the name is recorded as ``"registry"``;
- not found: the name is recorded as ``"none"`` (undeclared): the trace is ingested, validation
  accepts calls to it, classification does not call it an unknown tool, and evals compiled from it
  check what they can without a schema and are marked weak.

The record's ``metadata.tool_schema_sources`` maps each such name to its source; a name absent from
the map had its schema in the trace itself. A record that declares a tool list but calls a name
outside it is left as it is: the record contradicts itself (validation quarantines a successful one
as ``tool_not_declared``; a failed one is an ``unknown_tool`` failure).

Registry file format: a JSON file holding one OpenAI function spec (``{"type": "function",
"function": {name, description, parameters}}`` or the bare ``{name, description, parameters}``), a
list of them, or ``{"tools": [...]}``; or a directory whose ``*.json`` files (recursively, in name
order) each hold one of those. A name defined twice is an error naming both places.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flywheel.vocab.tools import called_names, normalise_tool

__all__ = ["SOURCES_KEY", "ToolRegistry", "ToolRegistryError", "called_names", "load_registry", "normalise_tool",
           "resolve_undeclared", "undeclared_names"]

SOURCES_KEY = "tool_schema_sources"


class ToolRegistryError(ValueError):
    """The registry cannot be used; the message names the file and the reason."""


class ToolRegistry:
    """Tool specs by name (see the module docstring for the file format)."""

    def __init__(self, specs: dict[str, dict[str, Any]] | None = None, origin: str = "") -> None:
        self.specs = dict(specs or {})
        self.origin = origin

    def __len__(self) -> int:
        return len(self.specs)

    def get(self, name: str) -> dict[str, Any] | None:
        return self.specs.get(name)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ToolRegistry:
        p = Path(path).expanduser()
        if not p.exists():
            raise ToolRegistryError(f"ingest.tool_registry {p}: no such file or directory")
        files = sorted(q for q in p.rglob("*.json") if q.is_file()) if p.is_dir() else [p]
        if p.is_dir() and not files:
            raise ToolRegistryError(f"ingest.tool_registry {p}: the directory holds no *.json files")
        specs: dict[str, dict[str, Any]] = {}
        where: dict[str, str] = {}
        for f in files:
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ToolRegistryError(f"ingest.tool_registry {f}: not a readable JSON file ({e})") from None
            items = data.get("tools") if isinstance(data, dict) and isinstance(data.get("tools"), list) else data
            items = items if isinstance(items, list) else [items]
            for i, item in enumerate(items):
                spec = normalise_tool(item)
                if spec is None:
                    raise ToolRegistryError(
                        f"ingest.tool_registry {f}: entry {i} is not an OpenAI function spec with a 'name'")
                name = spec["function"]["name"]
                if name in specs:
                    raise ToolRegistryError(
                        f"ingest.tool_registry: tool {name!r} is defined twice ({where[name]} and {f} entry {i})")
                specs[name] = spec
                where[name] = f"{f} entry {i}"
        return cls(specs, str(p))


_CACHE: dict[tuple[str, int, int], ToolRegistry] = {}


def load_registry(path: str | os.PathLike[str] | None) -> ToolRegistry:
    """The registry at ``path`` (an empty one for None), cached per process by path and mtime."""
    if path is None:
        return ToolRegistry()
    p = Path(path).expanduser()
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    reg = ToolRegistry.load(p)
    if key is not None:
        _CACHE.clear()
        _CACHE[key] = reg
    return reg


def resolve_undeclared(rec: Any, registry: ToolRegistry) -> Any:
    """Fill the tools of a record that declares none from ``registry``; mark the rest undeclared.

    Returns ``rec`` itself when nothing applies (the common case costs one pass over the messages),
    else a shallow copy with ``tools`` and ``metadata.tool_schema_sources`` set. Never raises: a
    malformed record is returned unchanged for validation to report.
    """
    if type(rec) is not dict:
        return rec
    tools = rec.get("tools")
    if tools:  # a declared tool list is the trace's own word (see the module docstring)
        return rec
    names = called_names(rec.get("messages"))
    if not names or (tools is not None and type(tools) is not list):
        return rec
    meta = rec.get("metadata")
    if meta is not None and type(meta) is not dict:
        return rec
    new_tools: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    for n in names:
        spec = registry.get(n)
        if spec is not None:
            new_tools.append(spec)
            sources[n] = "registry"
        else:
            sources[n] = "none"
    out = dict(rec)
    out["tools"] = new_tools
    out["metadata"] = {**(meta or {}), SOURCES_KEY: sources}
    return out


def undeclared_names(rec: dict[str, Any]) -> set[str]:
    """Names a record calls without any schema (``metadata.tool_schema_sources`` == ``"none"``)."""
    meta = rec.get("metadata")
    src = meta.get(SOURCES_KEY) if type(meta) is dict else None
    if type(src) is not dict:
        return set()
    return {k for k, v in src.items() if v == "none"}
