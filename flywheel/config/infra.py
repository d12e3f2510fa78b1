"""The sections of where the flywheel runs and keeps things: the OpenAI-compatible server
(``[serve]``), the event store (``[store]``), the artifact store (``[artifacts]``) and the cycle's
names and work pools (``[cycle]``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from flywheel.config.base import _Section


class ServeConfig(_Section):
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback requires an API key.")
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one.")
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
    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(16, ge=1, description="Largest n (completions per request).")
    max_stop: int = Field(4, ge=0, le=16, description="Most stop strings per request (OpenAI allows 4).")
    max_stop_chars: int = Field(128, ge=1, le=1024, description="Longest stop string, in characters.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body; larger ones get 413.")
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


class ArtifactsConfig(_Section):
    """Where content-addressed artifacts (Parquet, suites, adapters, reports) live."""

    url: str | None = Field(
        None,
        description="Unset: <home>/artifacts only (the embedded default). For a team: a store every worker reaches, "
        "s3://bucket/prefix (also gs://, az://, file:///shared/dir) or mlflow-artifacts:/prefix (the MLflow "
        "server's artifact proxy, at mlflow_tracking_uri); <home>/artifacts is then a hash-verified local cache.",
    )

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if not v:
            return None
        if not v.startswith(ARTIFACT_URL_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(ARTIFACT_URL_SCHEMES)}; got {v!r}")
        return v.rstrip("/")


ARTIFACT_URL_SCHEMES = ("s3://", "gs://", "az://", "file://", "memory://", "mlflow-artifacts:")

# Cycle stages that may run on a Prefect work pool of their own (``cycle.pools``).
POOLED_STAGES = ("ingest", "evals", "envs", "synth", "rollouts", "learn", "train-sft", "train-grpo", "gate", "deploy")


class CycleConfig(_Section):
    model_name: str = Field("policy", description="Registered model name in MLflow.")
    train_env: str = Field("train", description="Name of the training environment.")
    heldout_suite: str = Field("heldout", description="Name of the suite the gate decides on.")
    regression_suite: str = Field(
        "regression", description="Name of the suite of successful traces (gate regressions, SFT demonstrations)."
    )

    pools: dict[str, str] = Field(
        default_factory=dict,
        description="Stage -> Prefect work pool (e.g. {learn = 'gpu', gate = 'gpu', ingest = 'cpu'}): that stage runs as "
        "the `flywheel-stage/<pool>` deployment on a worker of the pool instead of in the cycle's own process. "
        f"Stages: {', '.join(POOLED_STAGES)}. Empty (the embedded default): every stage runs in-process.",
    )

    @field_validator("pools")
    @classmethod
    def _known_stages(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(POOLED_STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(POOLED_STAGES)}")
        empty = sorted(k for k, p in v.items() if not p.strip())
        if empty:
            raise ValueError(f"stage(s) {', '.join(empty)} map to an empty pool name")
        return v

    @field_validator("model_name", "train_env", "heldout_suite", "regression_suite")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # References read "suite:<name>@<N>" and "model:<name>/<N>": these characters would make them ambiguous.
        bad = sorted({c for c in v if c in "@:/"})
        if not v or bad:
            raise ValueError(f"must be a non-empty name without {' '.join(bad) or '@ : /'}")
        return v
