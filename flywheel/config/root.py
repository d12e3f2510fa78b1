"""The whole configuration, :class:`FlywheelConfig` (one field per section, paths resolved against
``home``), and :func:`objective_temperature`, the one rule that ties two sections together."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, model_validator

from flywheel.config.base import _Section
from flywheel.config.data import EvalsConfig, IngestConfig, JudgeConfig, SandboxConfig, SynthConfig
from flywheel.config.infra import ArtifactsConfig, CycleConfig, ServeConfig, StoreConfig
from flywheel.config.learning import GateConfig, PolicyConfig, RolloutConfig, TrainConfig


class FlywheelConfig(_Section):
    """The whole configuration. Paths are resolved relative to ``home`` unless absolute."""

    home: Path = Field(Path(".flywheel"), description="Everything local lives here.")
    warehouse: Path | None = Field(None, description="DuckDB file; default <home>/warehouse.duckdb.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<home>/mlflow.db."
    )
    mlflow_artifact_root: Path | None = Field(
        None, description="Where MLflow keeps run artifacts and registered models; default <home>/mlartifacts."
    )
    store: StoreConfig = Field(
        default_factory=StoreConfig, description="Where the event store lives: the embedded DuckDB file or PostgreSQL."
    )
    ingest: IngestConfig = Field(
        default_factory=IngestConfig, description="Ingest: batching, bounds on a trace, redaction, the tool registry."
    )
    evals: EvalsConfig = Field(
        default_factory=EvalsConfig, description="Failures -> evals: the train / held-out split by request cluster."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="Limits and isolation of the python_tests and shell verifiers."
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig, description="The OpenAI-compatible endpoint of llm_judge verifiers."
    )
    synth: SynthConfig = Field(
        default_factory=SynthConfig, description="Synthetic variants of train tasks: generators, dedup, decontamination."
    )
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="The policy being trained: base model and sampling backend."
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Rollouts: K samples per task, sampling, advantages."
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="SFT and GRPO training.")
    gate: GateConfig = Field(
        default_factory=GateConfig, description="When a challenger may replace the champion (docs/gate.md)."
    )
    serve: ServeConfig = Field(
        default_factory=ServeConfig, description="The OpenAI-compatible server: bind, keys, bounds, adapters."
    )
    artifacts: ArtifactsConfig = Field(
        default_factory=ArtifactsConfig, description="Where artifacts live: <home>/artifacts, or a team's object store."
    )
    cycle: CycleConfig = Field(
        default_factory=CycleConfig, description="Names the cycle works on: the registered model, the env, the suites."
    )

    @model_validator(mode="after")
    def _temperatures(self) -> FlywheelConfig:
        objective_temperature(self)  # raises when train.objective.temperature contradicts rollout.temperature
        return self

    @model_validator(mode="after")
    def _resolve(self) -> FlywheelConfig:
        home = Path(self.home).expanduser()
        object.__setattr__(self, "home", home.absolute())
        if self.warehouse is None:
            object.__setattr__(self, "warehouse", self.home / "warehouse.duckdb")
        if self.mlflow_artifact_root is None:
            object.__setattr__(self, "mlflow_artifact_root", self.home / "mlartifacts")
        if self.mlflow_tracking_uri is None:
            object.__setattr__(self, "mlflow_tracking_uri", f"sqlite:///{self.home / 'mlflow.db'}")
        return self

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    def ensure_home(self) -> Path:
        """Create the home directory (0700): traces are user data."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.home, 0o700)
        return self.home


def objective_temperature(cfg: FlywheelConfig) -> float:
    """The temperature of the GRPO-family log-probs: ``train.objective.temperature``, which defaults
    to ``rollout.temperature`` (the importance ratio compares the trainer's log-probs with the
    sampler's: both must be taken at one temperature). Raises ``ValueError`` naming both keys when
    they are set and differ."""
    rollout, own = cfg.rollout.temperature, cfg.train.objective.temperature
    if own is None:
        return rollout
    if own != rollout:
        raise ValueError(
            f"train.objective.temperature = {own} differs from rollout.temperature = {rollout}: the GRPO "
            "importance ratio compares the trainer's log-probs with the sampler's, so both must use one "
            "temperature (leave train.objective.temperature unset to follow rollout.temperature)"
        )
    return own
