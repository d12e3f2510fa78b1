"""The task record: the contract between the stages that make tasks (evals, synth) and the ones that
consume them (environments, rollouts, SFT, the gate). Pure: no store, no model.

The task record (the contract rollouts, synth, SFT and the gate consume)
------------------------------------------------------------------------
A JSON-serialisable dict, typed :class:`flywheel.vocab.records.EvalTask` (whose module also maps
every other record that crosses a stage boundary)::

    {"task_id": "eval:<16 hex>",
     "prompt": {"messages": [...OpenAI messages...], "tools": [...OpenAI function specs...]},
     "verifier": <verifier spec, see flywheel.verifiers>,
     "harness": "single_turn" | "tool_loop",
     "tool_env": null | {"recorded": [{"name", "arguments", "content"}], "python": <source> | null,
                         "replay": bool},
     "reference": {"tool_calls": [{"name", "arguments"}]} | {"content": str} | null,
     "metadata": {"failure_kinds", "tools": [names], "source", "split", "cluster", "origin_failure",
                  "origin_trace", "weak", "deterministic", "verifier_kind", "request_hash",
                  "tool_schema_sources": {name: "trace" | "registry" | "none"}}}

- ``reference`` is one concrete correct answer when one is known (from a correction: each argument's
  literal, or the first allowed value of a ``one_of``; optional arguments are omitted unless the tool
  schema requires them). SFT renders it with
  :func:`flywheel.policy.format.render_answer`; synth uses it to prove a variant solvable.
- ``tool_env`` is for :mod:`flywheel.envs.harness`: recorded tool outputs matched by tool name and
  arguments, or Python source defining one function per tool, run in the sandbox. ``replay``: the
  harness executes the answer's calls against ``python`` and fails the episode if one raises
  (``runtime_exception`` evals). Regression evals from multi-turn traces use a ``tool_call`` spec
  with ``scope: "all"``: every call the model makes during the episode is matched as one answer.
- ``metadata.split``: ``train`` | ``heldout`` | ``excluded`` (bridges both sides, see
  :mod:`flywheel.split`) | ``regression``. ``weak``: the verifier checks validity only (no
  correction was known, or a tool it calls has no schema). ``deterministic``: false for ``llm_judge``.
- ``metadata.tool_schema_sources``: where each tool's schema came from: the trace itself, the
  ``[ingest] tool_registry``, or nowhere (the telemetry recorded the call but not the definition:
  :mod:`flywheel.tool_registry`). A tool with no schema is offered to the model under its name with
  an open ``{"type": "object"}`` parameters schema, so the verifier checks only what it can (the
  name, that the arguments are an object, the values a correction or the recorded call gives) and
  the eval is marked weak.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flywheel.vocab.ids import canonical_json

__all__ = ["HARNESSES", "TASK_KEYS", "TaskError", "task_from_state", "validate_task"]

TASK_KEYS = ("task_id", "prompt", "verifier", "harness", "tool_env", "reference", "metadata")
HARNESSES = ("single_turn", "tool_loop")


class TaskError(ValueError):
    """A task record breaks the contract; the message names the task and the field."""


def validate_task(task: object) -> dict[str, Any]:
    """Check a task record against the contract; raise :class:`TaskError` naming what is wrong.

    Takes anything (a non-dict is refused); returns a new record shaped as
    :class:`~flywheel.vocab.records.EvalTask`, with all seven keys of :data:`TASK_KEYS` (absent
    optional ones as ``None``) and its own copy of ``metadata``. Typed ``dict[str, Any]``, not
    ``EvalTask``: its callers keep the records in ``dict`` s (``Env.tasks``), and mypy refuses a
    TypedDict where a ``dict`` is declared."""
    if not isinstance(task, dict):
        raise TaskError(f"a task must be a dict, got {type(task).__name__}")
    tid = task.get("task_id", "<no task_id>")
    missing = [k for k in ("task_id", "prompt", "verifier", "harness") if k not in task]
    if missing:
        raise TaskError(f"task {tid}: missing {', '.join(missing)}")
    if not isinstance(task["task_id"], str) or ":" not in task["task_id"]:
        raise TaskError(f"task {tid}: task_id must be a typed id like 'eval:<id>' or 'synth:<id>'")
    p = task["prompt"]
    if not isinstance(p, dict) or not isinstance(p.get("messages"), list) or not p["messages"]:
        raise TaskError(f"task {tid}: prompt.messages must be a non-empty list")
    if not isinstance(p.get("tools", []), list):
        raise TaskError(f"task {tid}: prompt.tools must be a list")
    if not isinstance(task["verifier"], dict) or not task["verifier"].get("kind"):
        raise TaskError(f"task {tid}: verifier must be a spec dict with a 'kind'")
    if task["harness"] not in HARNESSES:
        raise TaskError(f"task {tid}: harness must be one of {HARNESSES}, got {task['harness']!r}")
    if task["harness"] == "tool_loop":
        env = task.get("tool_env")
        if not isinstance(env, dict) or not (env.get("recorded") or env.get("python")):
            raise TaskError(f"task {tid}: a tool_loop task needs tool_env.recorded or tool_env.python")
    try:
        canonical_json(task)
    except (TypeError, ValueError) as e:
        raise TaskError(f"task {tid}: not JSON-serialisable: {e}") from None
    out = {k: task.get(k) for k in TASK_KEYS}
    out["metadata"] = dict(task.get("metadata") or {})
    return out


def task_from_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The task record inside an ``eval.created`` payload (the payload minus event-only keys), shaped as
    :class:`~flywheel.vocab.records.EvalTask` (a ``dict`` for the reason :func:`validate_task` gives)."""
    return {k: state.get(k) for k in TASK_KEYS}
