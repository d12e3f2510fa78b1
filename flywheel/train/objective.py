"""Hyper-parameters of the GRPO loss family (torch-free, so ``flywheel.config`` can embed it).

The variant itself is ``TrainConfig.loss``; this model holds the knobs every variant shares. It is
``TrainConfig.objective`` in the flywheel configuration (``[train.objective]`` in ``flywheel.toml``).

Papers the knobs come from
- **GRPO** (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300): group-relative advantages, per-sequence
  mean then batch mean, KL to a reference with the k3 estimator.
- **DAPO** (Yu et al. 2025, arXiv 2503.14476): clip-higher (``eps_high`` > ``eps_low``), token-level
  normalisation over the whole batch, overlong filtering and the soft overlong punishment.
- **Dr. GRPO** (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): no std
  scaling of advantages, token sum divided by a constant (batch size x generation budget).
- **GSPO** (Zheng et al. 2025, Qwen team, arXiv 2507.18071): sequence-level importance ratio
  (geometric mean of token ratios) and sequence-level clipping with a much smaller range.
- **CISPO** (MiniMax-M1, 2025, arXiv 2506.13585): clip the (detached) importance weight instead of
  the update, so every token keeps a gradient.
- **Truncated importance sampling** (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): correct the sampler/trainer mismatch (vLLM vs. training kernels) with
  ``min(pi_old / pi_sampler, C)``.
- **KL estimators** k1/k2/k3 (Schulman 2020, "Approximating KL Divergence").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossVariant = Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"]
LOSS_VARIANTS: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo")


class ObjectiveConfig(BaseModel):
    """Knobs of the policy-gradient objective.

    Clipping
        ``eps_low`` / ``eps_high``: PPO ratio clip range ``[1 - eps_low, 1 + eps_high]`` for ``grpo``,
        ``bnpo``, ``dr_grpo`` and ``dapo``; DAPO's clip-higher defaults 0.2 / 0.28.
        ``gspo_eps_low`` / ``gspo_eps_high``: GSPO clips the *sequence* ratio, whose spread is far
        smaller; the paper uses 3e-4 / 4e-4.
        ``cispo_max_ratio``: CISPO's upper bound on the detached importance weight.
    Regularisation
        ``beta`` and ``kl_estimator``: KL penalty to a frozen reference (k1, k2 or k3). ``beta = 0``
        (default, as in DAPO and Dr. GRPO) keeps no reference model at all.
    Off-policy correction
        ``tis_cap``: truncated importance sampling with the sampler's logprobs, weight
        ``clamp(exp(logp_old - logp_sampler), 0, C)``; ``None`` disables it.
    Length handling
        ``overlong_filter``: truncated samples contribute no loss (DAPO).
        ``overlong_cache``: DAPO's soft overlong punishment window ``L_cache`` (0 disables);
        ``max_completion_len`` is ``L_max`` for it and the constant of ``dr_grpo`` (defaults to the
        rollout's ``max_new_tokens`` when left ``None``).
    Sampling
        ``temperature``: logits are divided by it before log-probs, matching the sampler's temperature
        so the ratio compares like with like.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

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
    temperature: float = Field(1.0, gt=0.0, description="Logits / temperature before log-probs (match the sampler).")

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.max_completion_len is not None and self.overlong_cache > self.max_completion_len:
            raise ValueError(
                f"overlong_cache ({self.overlong_cache}) must not exceed max_completion_len "
                f"({self.max_completion_len}): the penalty window lies inside the length budget"
            )
        return self
