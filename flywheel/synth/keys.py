"""What identifies a synthetic task and which tasks may seed one, shared by the generators, the
funnel and the stage: the content-hash task id, the canonical tool menu and expected answer the
dedup compares, the seed selection, and the bounds every generated task must respect."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flywheel.dedup import normalize_text
from flywheel.verifiers.matching import standardize_string
from flywheel.vocab.ids import canonical_json, json_id
from flywheel.vocab.tools import tool_name

#: Recorded on every synthetic task and hashed into every batch id: bump it when a generator's
#: output changes for the same inputs.
SYNTH_VERSION = 1

#: Bounds of the GX suite and the per-task checks.
LIMITS = {"max_messages": 64, "max_request_chars": 8000, "max_tools": 32, "max_calls": 8}


def tool_key(task: dict) -> str:
    """Sorted names of the offered tools: a different tool menu is a different task."""
    return ",".join(sorted(tool_name(t) for t in (task.get("prompt") or {}).get("tools") or []))


def _canon_value(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int | float):
        return float(v) if not float(v).is_integer() else int(v)
    if isinstance(v, str):
        return standardize_string(v)
    if isinstance(v, list):
        return [_canon_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _canon_value(x) for k, x in sorted(v.items())}
    return v


def answer_key(task: dict) -> str | None:
    """Canonical expected answer: the reference calls with strings standardised as the verifier
    compares them (BFCL's ``standardize_string``), numbers as values, calls in sorted order; or the
    normalised content. ``None`` without a reference."""
    ref = task.get("reference")
    if not isinstance(ref, dict):
        return None
    if isinstance(ref.get("tool_calls"), list):
        calls = sorted(canonical_json({"n": c.get("name"), "a": _canon_value(c.get("arguments") or {})})
                       for c in ref["tool_calls"])
        return canonical_json(calls)
    if ref.get("content") is not None:
        return normalize_text(str(ref["content"]))
    return None


def synth_task_id(task: dict) -> str:
    """``synth:<16 hex>``: a hash of what the model sees and how it is graded (not the metadata)."""
    return "synth:" + json_id({k: task.get(k) for k in ("prompt", "verifier", "harness", "tool_env", "reference")})


def seed_tasks(tasks: Sequence[dict]) -> list[dict]:
    """Eval tasks of a training environment that generators may widen: ``eval:`` ids, the train
    split, single-turn, deterministic, with a reference answer. Sorted by task id."""
    out = []
    for t in tasks:
        meta = t.get("metadata") or {}
        if not str(t.get("task_id", "")).startswith("eval:"):
            continue
        if meta.get("split") not in (None, "train") or t.get("harness") != "single_turn":
            continue
        if meta.get("deterministic") is False or not isinstance(t.get("reference"), dict):
            continue
        out.append(t)
    return sorted(out, key=lambda t: t["task_id"])
