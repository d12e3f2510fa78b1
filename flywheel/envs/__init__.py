"""RL environments: building versioned task sets (:mod:`flywheel.envs.build`; loading and versioning
them is :mod:`flywheel.versioning`), the episode harnesses (:mod:`flywheel.envs.harness`) and the
tool environment (:mod:`flywheel.envs.tools`).

The public API is re-exported here lazily so importing :mod:`flywheel.envs` stays cheap."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "EnvsSummary": "flywheel.envs.build",
    "build_envs": "flywheel.envs.build",
    "list_envs": "flywheel.envs.build",
    "Episode": "flywheel.envs.harness",
    "run_episodes": "flywheel.envs.harness",
    "verify_task": "flywheel.envs.harness",
    "ToolEnv": "flywheel.envs.tools",
    "Observation": "flywheel.envs.tools",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flywheel.envs' has no attribute {name!r}")
