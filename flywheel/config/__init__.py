"""One typed configuration for the whole flywheel.

Precedence (lowest to highest): defaults < ``flywheel.toml`` < environment < CLI flags.

- ``flywheel.toml`` is looked up in the working directory (or ``$FLYWHEEL_CONFIG``); its tables
  match the sections below (``[ingest]``, ``[gate]``, ``[train.objective]``, ...).
- Environment variables (read by pydantic-settings): ``FLYWHEEL_<FIELD>`` for top-level fields
  (``FLYWHEEL_HOME``) and ``FLYWHEEL_<SECTION>__<FIELD>`` at any depth (double underscore), e.g.
  ``FLYWHEEL_GATE__MIN_PASS_RATE=0.5``, ``FLYWHEEL_TRAIN__OBJECTIVE__EPS_HIGH=0.3``; a value that is
  ``null`` is None, lists are JSON; ``MLFLOW_TRACKING_URI`` is honoured too.
- CLI flags are passed to :func:`load_config` as ``overrides`` (a nested dict; None = not given).

Unknown keys and bad values are rejected with a :class:`ConfigError` that names the key and says
why; nothing is silently ignored.

This package imports nothing else from the project (every stage imports it): what a stage needs to
know about its knobs is here, what it does with them is in the stage.

Where it lives: :mod:`~flywheel.config.base` (the strict base model, :class:`ConfigError`), the
sections in :mod:`~flywheel.config.data` (ingest, evals, sandbox, judge, synth),
:mod:`~flywheel.config.learning` (policy, rollout, train and its objective, gate) and
:mod:`~flywheel.config.infra` (serve, store, artifacts, cycle), the whole in
:mod:`~flywheel.config.root`, loading in :mod:`~flywheel.config.loading` and the generated
reference in :mod:`~flywheel.config.reference`. Every name is importable from ``flywheel.config``.
"""

from __future__ import annotations

from flywheel.config.base import ConfigError
from flywheel.config.data import (
    EvalsConfig,
    IngestConfig,
    JudgeConfig,
    RedactionRule,
    SandboxConfig,
    SynthConfig,
)
from flywheel.config.infra import (
    ARTIFACT_URL_SCHEMES,
    POOLED_STAGES,
    ArtifactsConfig,
    CycleConfig,
    ServeConfig,
    StoreConfig,
)
from flywheel.config.learning import (
    LOSS_NAMES,
    GateConfig,
    LossName,
    ObjectiveConfig,
    PolicyConfig,
    RolloutConfig,
    TrainConfig,
)
from flywheel.config.loading import load_config
from flywheel.config.reference import config_sections, reference_markdown
from flywheel.config.root import FlywheelConfig, objective_temperature

__all__ = [
    "ARTIFACT_URL_SCHEMES", "LOSS_NAMES", "POOLED_STAGES",
    "ArtifactsConfig", "ConfigError", "CycleConfig", "EvalsConfig", "FlywheelConfig", "GateConfig",
    "IngestConfig", "JudgeConfig", "LossName", "ObjectiveConfig", "PolicyConfig", "RedactionRule",
    "RolloutConfig", "SandboxConfig", "ServeConfig", "StoreConfig", "SynthConfig", "TrainConfig",
    "config_sections", "load_config", "objective_temperature", "reference_markdown",
]
