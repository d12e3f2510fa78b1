"""``flywheel ingest --dry-run``: what an ingest would capture from each trace, without storing anything.

The files go through exactly the preparation an ingest runs (format detection, the OTLP join, the
tool registry, validation, redaction, classification: :class:`flywheel.ingest.prepare.Preparer`),
then the result is reported instead of committed: per trace its messages (by role), the tools it
declares and where their schemas come from, the tool calls it makes, its outcome and error; per
quarantined record its file, line, reason and detail. Nothing is written: no store is opened (its
deduplication against earlier ingests is therefore not shown).

Meant as the check after connecting an agent (``docs/connect-your-agent.md``): a trace without
messages, tools that should be there, or a reason such as ``otel_content_not_captured`` says what
to change before production traffic flows.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from flywheel.config import FlywheelConfig
from flywheel.ingest.pipeline import (
    _expand_paths,
    _whole_document,
    detect_file_format,
    document_lines,
    plan_otlp,
)
from flywheel.ingest.prepare import Preparer
from flywheel.ingest.reader import iter_lines, open_source, position
from flywheel.tool_registry import SOURCES_KEY
from flywheel.vocab.toolcalls import decode_tool_calls
from flywheel.vocab.tools import tool_name


def _calls(messages: list[dict[str, Any]]) -> list[str]:
    return [dc.name for m in messages for dc in decode_tool_calls(m.get("tool_calls"))]


def describe_trace(rec: dict[str, Any], kinds: list[str], file: str, line: int) -> dict[str, Any]:
    """The dry-run row of one prepared trace."""
    msgs = rec.get("messages") or []
    roles = Counter(m.get("role") for m in msgs)
    tools = [tool_name(t) for t in rec.get("tools") or ()]
    meta = rec.get("metadata") or {}
    sources = {n: "trace" for n in tools} | dict(meta.get(SOURCES_KEY) or {})
    outcome = rec.get("outcome") or {}
    return {
        "trace_id": rec["trace_id"], "file": file, "line": line, "source": rec.get("source") or "openai",
        "convention": (meta.get("otel") or {}).get("convention"), "model": rec.get("model"),
        "messages": len(msgs), "roles": dict(sorted(roles.items())), "tools": tools, "tool_schema_sources": sources,
        "tool_calls": _calls(msgs), "status": outcome.get("status"), "kinds": kinds, "error": outcome.get("error"),
        "usage": meta.get("usage"),
    }


def dry_run(cfg: FlywheelConfig, paths: list[Path], *, fmt: str = "auto") -> dict[str, Any]:
    """Prepare ``paths`` as :func:`flywheel.ingest.ingest_paths` would and report, storing nothing.

    Raises :class:`flywheel.ingest.IngestError` where an ingest would (unusable path, bad registry,
    a log-only OTLP file without its spans).
    """
    files = _expand_paths(list(paths))
    companions = plan_otlp(cfg, files, fmt)
    max_line = cfg.ingest.max_line_bytes
    traces: list[dict[str, Any]] = []
    quarantined: list[dict[str, Any]] = []
    per_file = []
    for path in files:
        size = path.stat().st_size
        doc = _whole_document(path, max_line) if size else None
        ffmt = detect_file_format(path, fmt, doc, max_line, size)
        prep = Preparer(cfg.ingest, ffmt, path.name, "", path=None if doc is not None else path,
                        otel_companions=companions.get(path, []))
        stream, raw = open_source(path)
        try:
            lines = document_lines(doc) if doc is not None else iter_lines(stream, max_line)
            n_tr = n_q = 0
            for b in prep.batches(lines, position(raw, size)):
                for row in b.table.select(["trace", "kinds", "line"]).to_pylist():
                    traces.append(describe_trace(orjson.loads(row["trace"]), row["kinds"], path.name, row["line"]))
                    n_tr += 1
                for q in b.quarantine:
                    quarantined.append({k: q[k] for k in ("file", "line", "reason", "detail")})
                    n_q += 1
        finally:
            stream.close()
            raw.close()
        per_file.append({"path": str(path), "format": ffmt, "traces": n_tr, "quarantined": n_q})
    return {
        "files": per_file,
        "traces": traces,
        "quarantined": quarantined,
        "summary": {
            "traces": len(traces),
            "quarantined": len(quarantined),
            "quarantined_by_reason": dict(sorted(Counter(q["reason"] for q in quarantined).items())),
            "with_tool_calls": sum(1 for t in traces if t["tool_calls"]),
            "with_tools_without_schema": sum(1 for t in traces if "none" in t["tool_schema_sources"].values()),
            "failures": sum(1 for t in traces if t["status"] == "failure"),
        },
    }
