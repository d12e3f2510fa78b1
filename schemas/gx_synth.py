"""The Great Expectations suite of a synth batch (``schemas/gx/synth_batch.json``).

:func:`candidate_features` turns each candidate task into one flat row (lengths, counts, whether
every tool's ``parameters`` is a valid JSON Schema, whether a reference answer is present);
:func:`validate_synth_batch` runs the suite over the rows of a batch with GX's ``COMPLETE`` result
format, so every failed expectation names the *rows* that broke it: those candidates are rejected
as invalid with the expectation in their reason. The suite runs in the ephemeral GX context of
:mod:`flywheel.schemas.gx_suites` (nothing is written to disk).

Cost: the first call imports great_expectations (~3.5 s cold); a validation of a few thousand rows
takes well under a second.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["candidate_features", "validate_synth_batch", "tools_schema_valid", "FEATURE_COLUMNS"]

FEATURE_COLUMNS = (
    "task_id", "seed_task", "generator", "harness", "split", "verifier_kind", "n_messages", "request_chars",
    "n_tools", "tools_valid_schema", "tool_names_unique", "has_reference", "n_reference_calls",
)


def _fn(tool: Any) -> dict:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        return tool["function"]
    return tool if isinstance(tool, dict) else {}


def tools_schema_valid(tools: list[Any]) -> tuple[bool, str | None]:
    """(ok, problem): every tool has a name and a ``parameters`` object that is a valid JSON Schema
    (checked with the metaschema of the draft it declares, Draft 2020-12 by default)."""
    import jsonschema

    for i, t in enumerate(tools or []):
        fn = _fn(t)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            return False, f"tools[{i}] has no function name"
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            return False, f"tool {name}: parameters is not an object"
        try:
            cls = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
            cls.check_schema(params)
        except jsonschema.SchemaError as e:
            return False, f"tool {name}: parameters is not a valid JSON Schema ({e.message})"
    return True, None


def candidate_features(task: dict) -> dict[str, Any]:
    """One flat row describing ``task`` for the suite (never raises on a malformed task: a missing
    piece becomes a value the suite rejects)."""
    prompt = task.get("prompt") if isinstance(task.get("prompt"), dict) else {}
    messages = prompt.get("messages") if isinstance(prompt.get("messages"), list) else []
    tools = prompt.get("tools") if isinstance(prompt.get("tools"), list) else []
    meta = task.get("metadata") if isinstance(task.get("metadata"), dict) else {}
    ref = task.get("reference") if isinstance(task.get("reference"), dict) else None
    request = "".join(
        str(m.get("content") or "") for m in messages if isinstance(m, dict) and m.get("role") in ("system", "user")
    )
    names = [_fn(t).get("name") for t in tools]
    ok, _ = tools_schema_valid(tools)
    calls = (ref or {}).get("tool_calls")
    has_ref = bool(ref) and (bool(calls) if "tool_calls" in ref else bool(str(ref.get("content") or "").strip()))
    verifier = task.get("verifier") if isinstance(task.get("verifier"), dict) else {}
    return {
        "task_id": task.get("task_id"),
        "seed_task": meta.get("seed_task"),
        "generator": meta.get("generator"),
        "harness": task.get("harness"),
        "split": meta.get("split"),
        "verifier_kind": verifier.get("kind"),
        "n_messages": len(messages),
        "request_chars": len(request),
        "n_tools": len(tools),
        "tools_valid_schema": ok,
        "tool_names_unique": len(set(map(str, names))) == len(names),
        "has_reference": has_ref,
        "n_reference_calls": len(calls) if isinstance(calls, list) else 0,
    }


def validate_synth_batch(rows: list[dict[str, Any]], values: dict[str, Any]) -> tuple[bool, dict[int, list[str]], list[dict]]:
    """Validate feature rows; returns (success, {row index: [failed expectation, ...]}, report).

    ``values`` fills the suite's placeholders (``generators``, ``max_messages``, ``max_request_chars``,
    ``max_tools``, ``max_calls``). The report lists each failed expectation with its column, the
    number of offending rows and up to five examples.
    """
    import pandas as pd
    from flywheel.schemas import gx_suites

    if not rows:
        return True, {}, []
    df = pd.DataFrame(rows, columns=list(FEATURE_COLUMNS))
    with gx_suites._lock:
        suite = gx_suites.build_suite("synth_batch", values)
        batch = gx_suites._state["batch_def"].get_batch(batch_parameters={"dataframe": df})
        res = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    per_row: dict[int, list[str]] = {}
    report = []
    for r in res.results:
        if r.success:
            continue
        cfg = r.expectation_config
        column = cfg.kwargs.get("column")
        result = r.result or {}
        label = f"{cfg.type}({column})"
        idx = result.get("unexpected_index_list") or []
        exc = (r.exception_info or {}).get("exception_message") if isinstance(r.exception_info, dict) else None
        if exc or not idx:
            # The expectation itself failed to run (or gave no rows): every row is suspect.
            idx = list(range(len(rows)))
        for i in idx:
            per_row.setdefault(int(i), []).append(label)
        report.append({
            "expectation": cfg.type,
            "column": column,
            "unexpected_count": result.get("unexpected_count", len(idx)),
            "examples": [json.dumps(x, default=str)[:80] for x in (result.get("partial_unexpected_list") or [])[:5]],
            "exception": exc,
        })
    return bool(res.success), per_row, report
