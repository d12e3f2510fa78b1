"""The environment side of a tool loop: answer a model's tool calls.

Two sources, tried in this order (``task["tool_env"]``):

- ``recorded``: ``[{"name", "arguments", "content"}]`` taken from the production trace. A call is
  answered by the recorded output whose name and arguments are equal to it: first exactly
  (canonical JSON), then after BFCL's string standardisation and int/float unification (so
  ``city="lima"`` finds the output recorded for ``city="Lima"``). Only equal calls match: answering
  a call with another call's output would teach the model that arguments do not matter.
- ``python``: Python source defining one function per tool. The call runs *in the sandbox*
  (:func:`flywheel.sandbox.run_python_tests`, the same isolation as the ``python_tests`` verifier:
  the implementation comes from a trace and the arguments from the model, neither is trusted); the
  return value comes back as JSON, an exception as ``Error: <Type>: <message>``.

An unknown tool, or a call nothing can answer, gets an error observation (``{"error": ...}``), never
an invented result. Every observation records where it came from (``source``) and whether the call
raised, so the harness can fail ``replay`` episodes and tests can check provenance.

Not covered: stateful tools (each python call runs in a fresh sandbox, so a call cannot see the
effects of an earlier one); recorded outputs that depended on hidden state are replayed as recorded.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from flywheel import sandbox
from flywheel.config import SandboxConfig
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.tools import tool_names

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STD = re.compile(r"[ \,\.\/\-\_\*\^]")
#: Bytes of a python tool's return value kept as the observation (the sandbox keeps 8 KiB of stdout).
MAX_OBSERVATION_CHARS = 4000


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one call."""

    name: str
    content: str
    source: str  # "recorded" | "python" | "error"
    raised: bool = False
    infra_error: str | None = None


def _loose(v: Any) -> Any:
    """BFCL-style normalisation for matching recorded calls: strings standardised, ints as floats."""
    if isinstance(v, str):
        return _STD.sub("", v).lower().replace("'", '"')
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, list | tuple):
        return [_loose(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _loose(x) for k, x in v.items()}
    return v


class ToolEnv:
    """Answers calls for one task. Build one per task; it keeps no state between calls."""

    def __init__(self, tool_env: dict | None, tools: list[dict] | None, sandbox_cfg: SandboxConfig | None = None):
        env = tool_env or {}
        self.recorded: list[dict] = list(env.get("recorded") or [])
        self.python: str | None = env.get("python") or None
        self.sandbox_cfg = sandbox_cfg
        self.tool_names = set(tool_names(tools))
        self._exact = {}
        self._fuzzy = {}
        for r in self.recorded:
            self._exact.setdefault(canonical_json([r["name"], r.get("arguments") or {}], allow_nan=True), r)
            self._fuzzy.setdefault(canonical_json([r["name"], _loose(r.get("arguments") or {})], allow_nan=True), r)

    def answer(self, name: str, arguments: dict) -> Observation:
        if self.tool_names and name not in self.tool_names:
            return Observation(name, canonical_json({"error": f"unknown tool {name!r}"}), "error", raised=True)
        hit = (self._exact.get(canonical_json([name, arguments], allow_nan=True))
               or self._fuzzy.get(canonical_json([name, _loose(arguments)], allow_nan=True)))
        if hit is not None:
            return Observation(name, str(hit.get("content", "")), "recorded")
        if self.python:
            return run_python_tool(self.python, name, arguments, self.sandbox_cfg)
        return Observation(
            name, canonical_json({"error": f"no recorded result for {name} with these arguments"}), "error", raised=True
        )


def run_python_tool(code: str, name: str, arguments: dict, sandbox_cfg: SandboxConfig | None = None) -> Observation:
    """Call ``name(**arguments)`` from ``code`` in a fresh sandbox; see the module docstring.

    The call is written as a one-test ``python_tests`` run: the implementation is the candidate
    module and the test prints the return value after a random marker (so output the implementation
    prints itself cannot be mistaken for the result).
    """
    if not _IDENT.match(name):
        return Observation(name, canonical_json({"error": f"invalid tool name {name!r}"}), "error", raised=True)
    marker = "@@flywheel-result-" + secrets.token_hex(8) + "@@"
    args_json = json.dumps(arguments, ensure_ascii=False)
    test = (
        "import json\n"
        "import solution\n\n"
        "def test_call():\n"
        f"    fn = getattr(solution, {name!r}, None)\n"
        f"    assert callable(fn), 'the implementation defines no function ' + {name!r}\n"
        f"    result = fn(**json.loads({args_json!r}))\n"
        "    try:\n"
        "        text = json.dumps(result, ensure_ascii=False)\n"
        "    except (TypeError, ValueError):\n"
        "        text = json.dumps(repr(result))\n"
        f"    print({marker!r} + text + {marker!r}, flush=True)\n"
    )
    res = sandbox.run_python_tests(code, test, sandbox_cfg)  # looked up per call: tests replace it
    if res.infra_error:
        return Observation(name, canonical_json({"error": "tool sandbox unavailable"}), "error", infra_error=res.infra_error)
    if res.passed:
        parts = res.stdout.split(marker)
        content = parts[1] if len(parts) >= 3 else ""
        return Observation(name, content[:MAX_OBSERVATION_CHARS], "python")
    detail = res.per_test.get("test_call", "") or res.killed_reason or "failed"
    detail = detail.removeprefix("failed: ")
    return Observation(name, f"Error: {detail}"[:MAX_OBSERVATION_CHARS], "python", raised=True)
