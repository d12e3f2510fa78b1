"""The GRPO loss family, each variant a function ``LossInputs -> LossOutputs``.

Notation: ``B`` sequences of ``T`` completion positions, mask ``m`` (1 only on policy-sampled
completion tokens), ``L_i = sum_t m_it``, ratio ``r = exp(logp - logp_old)``, advantage ``A_i`` per
sequence. Per-token clipped surrogate (PPO, with DAPO's asymmetric range)::

    l_it = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)  [* w_it TIS]  + beta * KL_it

Aggregation (how the micro-batch loss is normalised, so that summing micro-batch gradients gives the
gradient of the whole batch):

=========  ==========================================================  ============================
variant    loss of one micro-batch                                      split-invariant?
=========  ==========================================================  ============================
grpo       sum_i (sum_t m l / L_i) / N_seq                               yes (N_seq global)
bnpo       sum m l / (local token count) / n_micro                      no: depends on the split
dr_grpo    sum m l / (N_seq * L_max)                                     yes
dapo       sum m l / N_tok (global tokens, all micro-batches and ranks)  yes
gspo       sum_i -min(s_i A_i, clip(s_i) A_i) / N_seq,                   yes
           s_i = exp(sum_t m (logp - logp_old) / L_i)
cispo      sum m (-sg(min(r, r_max)) A logp) / N_tok                     yes
=========  ==========================================================  ============================

``N_seq``/``N_tok`` are passed in by the trainer (``LossInputs.num_sequences``/``num_tokens``),
counted over the whole optimizer step across micro-batches *and* data-parallel ranks; losses are
multiplied by ``dp_world_size`` because DDP/DeepSpeed average (not sum) gradients across ranks.
When they are ``None`` the micro-batch's own counts are used (one micro-batch, one rank).

Guarantees
- With ``logp_old = sg(logp)`` (one inner iteration) every clipped variant's gradient is
  ``-A * grad(logp) / normaliser`` (tested against hand-computed tensors).
- Positions with ``m = 0`` contribute neither loss nor gradient, whatever their log-prob values
  (they are zeroed before ``exp`` so padding cannot overflow).
- Returned statistics are detached Python floats.

Preference losses (:func:`dpo_loss`, :func:`rpo_loss`) work on pairs of whole-answer log-probs,
not per-token ratios; they are at the end of the module with their own inputs.

Not covered: value baselines, per-token rewards, dual-clip PPO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flywheel.config import LOSS_NAMES, ObjectiveConfig


@dataclass
class LossInputs:
    """Tensors of one micro-batch. Shapes in comments; all ``[B, T]`` tensors are aligned."""

    logp: torch.Tensor  # [B, T] log pi_theta(y_t | y_<t), with grad
    mask: torch.Tensor  # [B, T] 1.0 on policy-sampled completion tokens, else 0.0
    advantages: torch.Tensor  # [B] one advantage per sequence
    old_logp: torch.Tensor | None = None  # [B, T] log pi_old; None = sg(logp) (one inner iteration)
    ref_logp: torch.Tensor | None = None  # [B, T] log pi_ref; required when beta > 0
    sampler_logp: torch.Tensor | None = None  # [B, T] sampler's logprobs (TIS); None = no correction
    entropy: torch.Tensor | None = None  # [B, T] for statistics only
    num_tokens: float | None = None  # global masked-token count of the step (dapo, cispo)
    num_sequences: int | None = None  # global sequence count of the step (grpo, gspo, dr_grpo)
    num_micro_batches: int = 1  # bnpo divides its local mean by this (plain gradient accumulation)
    max_completion_len: int | None = None  # dr_grpo's L_max; None = T
    dp_world_size: int = 1  # ranks whose gradients are averaged by DDP/DeepSpeed


@dataclass
class LossOutputs:
    loss: torch.Tensor  # [] scalar to call backward on
    per_token_loss: torch.Tensor  # [B, T] before aggregation (gspo: the sequence loss spread over tokens)
    stats: dict[str, float] = field(default_factory=dict)  # token-weighted means over this micro-batch
    tokens: float = 0.0  # masked tokens of this micro-batch (weight for aggregating stats)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020).

    k1 = logp - ref (unbiased, can be negative); k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) -
    (ref - logp) - 1 (unbiased, always >= 0; used by DeepSeekMath). d k3 / d logp = 1 - exp(ref - logp).
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}: expected k1, k2 or k3")


def _prepare(inp: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m = inp.mask.to(torch.float32)
    if inp.logp.shape != m.shape:
        raise ValueError(f"logp {tuple(inp.logp.shape)} and mask {tuple(m.shape)} must have the same shape")
    if inp.advantages.shape != (m.shape[0],):
        raise ValueError(f"advantages must be [B]={m.shape[0]}, got {tuple(inp.advantages.shape)}")
    logp = inp.logp.float()
    old = logp.detach() if inp.old_logp is None else inp.old_logp.detach().float()
    # Zero the log-ratio off-mask so padding garbage cannot overflow exp() or leak NaN into grads.
    log_ratio = torch.where(m > 0, logp - old, torch.zeros_like(logp))
    adv = inp.advantages.detach().float()[:, None]  # [B, 1]
    return m, logp, log_ratio, adv


def _tis_weight(inp: LossInputs, m: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor | None:
    if cfg.tis_cap is None or inp.sampler_logp is None:
        return None
    old = inp.logp.detach().float() if inp.old_logp is None else inp.old_logp.detach().float()
    d = torch.where(m > 0, old - inp.sampler_logp.detach().float(), torch.zeros_like(old))
    return torch.exp(d).clamp(0.0, cfg.tis_cap)


def _kl(inp: LossInputs, logp: torch.Tensor, m: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor | None:
    if cfg.beta == 0.0:
        return None
    if inp.ref_logp is None:
        raise ValueError(f"beta={cfg.beta} > 0 needs ref_logp (the reference model's log-probs)")
    ref = torch.where(m > 0, inp.ref_logp.detach().float(), logp.detach())
    return kl_penalty(logp, ref, cfg.kl_estimator)


def _stats(
    m: torch.Tensor, ratio: torch.Tensor, kl: torch.Tensor | None, entropy: torch.Tensor | None,
    w: torch.Tensor | None, clip_low: torch.Tensor, clip_high: torch.Tensor,
) -> tuple[dict[str, float], float]:
    n = float(m.sum())
    denom = max(n, 1.0)

    def mean(x: torch.Tensor) -> float:
        return float((x.detach().float() * m).sum() / denom)

    s = {
        "clip_frac": mean((clip_low | clip_high).float()),
        "clip_low_frac": mean(clip_low.float()),
        "clip_high_frac": mean(clip_high.float()),
        "ratio_mean": mean(ratio),
    }
    if kl is not None:
        s["kl"] = mean(kl)
    if entropy is not None:
        s["entropy"] = mean(entropy)
    if w is not None:
        s["tis_weight"] = mean(w)
    return s, n


def _clipped_token_loss(
    inp: LossInputs, cfg: ObjectiveConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float], float]:
    m, logp, log_ratio, adv = _prepare(inp)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    w = _tis_weight(inp, m, cfg)
    if w is not None:
        pg = pg * w
    kl = _kl(inp, logp, m, cfg)
    per_tok = pg if kl is None else pg + cfg.beta * kl
    clip_low = (ratio < 1.0 - cfg.eps_low) & (adv < 0)
    clip_high = (ratio > 1.0 + cfg.eps_high) & (adv > 0)
    stats, n = _stats(m, ratio, kl, inp.entropy, w, clip_low, clip_high)
    return per_tok * m, m, stats, n


def _n_seq(inp: LossInputs) -> float:
    return float(inp.num_sequences if inp.num_sequences is not None else inp.mask.shape[0])


def _n_tok(inp: LossInputs, m: torch.Tensor) -> float:
    n = inp.num_tokens if inp.num_tokens is not None else float(m.sum())
    return max(float(n), 1.0)


def grpo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """GRPO (DeepSeekMath eq. 3): per-sequence token mean, then mean over the step's sequences."""
    per_tok, m, stats, n = _clipped_token_loss(inp, cfg)
    seq = per_tok.sum(-1) / m.sum(-1).clamp(min=1.0)
    loss = seq.sum() / _n_seq(inp) * inp.dp_world_size
    return LossOutputs(loss, per_tok, stats, n)


def bnpo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """BNPO: token sum over the *micro-batch's* token count; the step is the mean over micro-batches.

    Kept for comparison: its gradient depends on how a batch is split (a short micro-batch weighs
    its tokens more), which is exactly what ``dapo`` fixes.
    """
    per_tok, m, stats, n = _clipped_token_loss(inp, cfg)
    loss = per_tok.sum() / m.sum().clamp(min=1.0) / inp.num_micro_batches
    return LossOutputs(loss, per_tok, stats, n)


def dr_grpo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """Dr. GRPO: token sum over the constant ``N_seq * L_max`` (no length bias)."""
    per_tok, m, stats, n = _clipped_token_loss(inp, cfg)
    l_max = inp.max_completion_len or cfg.max_completion_len or m.shape[1]
    loss = per_tok.sum() / (_n_seq(inp) * l_max) * inp.dp_world_size
    return LossOutputs(loss, per_tok, stats, n)


def dapo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """DAPO token-level loss: token sum over the step's global token count (split-invariant)."""
    per_tok, m, stats, n = _clipped_token_loss(inp, cfg)
    loss = per_tok.sum() / _n_tok(inp, m) * inp.dp_world_size
    return LossOutputs(loss, per_tok, stats, n)


def gspo_sequence_ratio(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B]
    """GSPO's sequence importance ratio ``s_i = exp(sum_t m (logp - logp_old) / L_i)``.

    The geometric mean of the token ratios: a sequence whose tokens all have log-ratio ``d`` gets
    ``exp(d)`` whatever its length.
    """
    m = mask.to(torch.float32)
    d = torch.where(m > 0, logp.float() - old_logp.detach().float(), torch.zeros_like(m))
    return torch.exp((d * m).sum(-1) / m.sum(-1).clamp(min=1.0))


def gspo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """GSPO: sequence ratio ``s_i = exp(mean_t m (logp - logp_old))``, clipped per sequence.

    Aggregation is always the per-sequence mean (the paper's objective is a mean over sequences);
    ``d s_i / d logp_it = s_i * m_it / L_i``. TIS uses the sequence-level weight
    ``clamp(exp(mean_t (logp_old - logp_sampler)), 0, C)``.
    """
    m, logp, _, adv = _prepare(inp)
    L = m.sum(-1).clamp(min=1.0)  # [B]
    # the float32 logp of _prepare: one cast node, so a bf16 logp's gradient is accumulated as before
    s = gspo_sequence_ratio(logp, logp.detach() if inp.old_logp is None else inp.old_logp, m)  # [B]
    a = adv[:, 0]
    s_clip = s.clamp(1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high)
    seq = -torch.minimum(s * a, s_clip * a)  # [B]
    w = _tis_weight(inp, m, cfg)
    if w is not None:
        w_seq = torch.exp((torch.log(w.clamp(min=1e-30)) * m).sum(-1) / L).clamp(0.0, cfg.tis_cap)
        seq = seq * w_seq
    kl = _kl(inp, logp, m, cfg)
    if kl is not None:
        seq = seq + cfg.beta * (kl * m).sum(-1) / L
    loss = seq.sum() / _n_seq(inp) * inp.dp_world_size
    clip_low = ((s < 1.0 - cfg.gspo_eps_low) & (a < 0))[:, None].expand_as(m)
    clip_high = ((s > 1.0 + cfg.gspo_eps_high) & (a > 0))[:, None].expand_as(m)
    stats, n = _stats(m, s[:, None].expand_as(m), kl, inp.entropy, w, clip_low, clip_high)
    per_tok = seq[:, None] * m / L[:, None]
    return LossOutputs(loss, per_tok, stats, n)


def cispo_loss(inp: LossInputs, cfg: ObjectiveConfig) -> LossOutputs:
    """CISPO (MiniMax-M1): ``-sg(min(r, r_max)) * A * logp``, token sum over global token count.

    The importance weight is clipped and detached, so no token loses its gradient (PPO's clip zeroes
    the gradient of exactly the rare, high-ratio tokens that matter for reflection behaviour).
    """
    m, logp, log_ratio, adv = _prepare(inp)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=cfg.cispo_max_ratio).detach()
    pg = -weight * adv * logp
    w = _tis_weight(inp, m, cfg)
    if w is not None:
        pg = pg * w
    kl = _kl(inp, logp, m, cfg)
    per_tok = (pg if kl is None else pg + cfg.beta * kl) * m
    loss = per_tok.sum() / _n_tok(inp, m) * inp.dp_world_size
    clip_high = ratio > cfg.cispo_max_ratio
    stats, n = _stats(m, ratio, kl, inp.entropy, w, torch.zeros_like(clip_high), clip_high)
    return LossOutputs(loss, per_tok, stats, n)


LOSSES: dict[str, Callable[[LossInputs, ObjectiveConfig], LossOutputs]] = {
    "grpo": grpo_loss,
    "bnpo": bnpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
assert tuple(LOSSES) == LOSS_NAMES  # the names are defined once, in flywheel.config


def compute_loss(variant: str, inp: LossInputs, cfg: ObjectiveConfig | None = None) -> LossOutputs:
    """Dispatch to the named variant (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``cispo``)."""
    try:
        fn = LOSSES[variant]
    except KeyError:
        raise ValueError(f"unknown loss {variant!r}: expected one of {', '.join(LOSSES)}") from None
    return fn(inp, cfg or ObjectiveConfig())


#: Variants whose normaliser is a global sequence count / token count (the trainer computes both).
SEQUENCE_NORMALISED = frozenset({"grpo", "gspo", "dr_grpo"})
TOKEN_NORMALISED = frozenset({"dapo", "cispo"})


def sft_loss(inp: LossInputs) -> LossOutputs:
    """Supervised cross-entropy on answer tokens: ``-sum m logp / N_tok`` (mask = answer tokens).

    Uses the same global token normaliser as ``dapo`` so gradient accumulation and data parallelism
    give the gradient of the whole batch, whatever the split; advantages are ignored.
    """
    m = inp.mask.to(torch.float32)
    per_tok = -inp.logp.float() * m
    n = float(m.sum())
    loss = per_tok.sum() / _n_tok(inp, m) * inp.dp_world_size
    stats = {"nll": float(per_tok.detach().sum() / max(n, 1.0))}
    if inp.entropy is not None:
        stats["entropy"] = float((inp.entropy.detach().float() * m).sum() / max(n, 1.0))
    return LossOutputs(loss, per_tok, stats, n)


# -- preference losses (DPO / RPO) ------------------------------------------------------------------


@dataclass
class PreferenceInputs:
    """Sequence log-probs of ``P`` preference pairs, each summed over the answer's loss-masked tokens.

    ``chosen_logp``/``rejected_logp`` carry the gradient; the reference values are constants (the
    policy's own log-probs before the first update, computed once under ``no_grad``).
    """

    chosen_logp: torch.Tensor  # [P] sum_t m log pi_theta(y_c,t | x, y_c,<t), with grad
    rejected_logp: torch.Tensor  # [P] same for the rejected answer
    ref_chosen_logp: torch.Tensor  # [P] log pi_ref(y_c | x), constant
    ref_rejected_logp: torch.Tensor  # [P] log pi_ref(y_r | x), constant
    chosen_tokens: torch.Tensor  # [P] |y_c|: loss-masked tokens of the chosen answer (RPO's length normaliser)
    num_pairs: int | None = None  # global pair count of the step (all micro-batches and ranks); None = P
    dp_world_size: int = 1  # ranks whose gradients are averaged by DDP/DeepSpeed


@dataclass
class PreferenceOutputs:
    loss: torch.Tensor  # [] scalar to call backward on (this micro-batch's share of the step's mean)
    per_pair_loss: torch.Tensor  # [P] before aggregation
    stats: dict[str, float] = field(default_factory=dict)  # means over this micro-batch's pairs
    pairs: float = 0.0  # pairs of this micro-batch (weight for aggregating stats)


def rpo_loss(inp: PreferenceInputs, beta: float = 0.1, alpha: float = 1.0) -> PreferenceOutputs:
    """RPO: DPO plus a length-normalised NLL term on the chosen answer, per pair::

        margin = beta * ((logp_c - ref_c) - (logp_r - ref_r))
        L      = -log sigmoid(margin) + alpha * (-logp_c) / |y_c|

    averaged over the step's pairs (``num_pairs``, so gradient accumulation over micro-batches gives
    the gradient of the whole batch). ``alpha = 0`` is DPO.

    DPO: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
    Reward Model", arXiv 2305.18290, eq. 7 (``beta`` is the KL strength; the implicit reward of an
    answer is ``beta * (logp - ref)``). RPO: Pang et al. 2024, "Iterative Reasoning Preference
    Optimization", arXiv 2404.19733, eq. 1 (the NLL on the chosen sequence, normalised by its length,
    weighted by ``alpha``; it keeps the chosen log-prob from falling while the margin grows, the
    known failure of plain DPO on tasks with one right answer).

    Gradients (``s = sigmoid(margin)``): ``dL/dlogp_c = -beta (1 - s) - alpha / |y_c|``,
    ``dL/dlogp_r = +beta (1 - s)``; divided by the pair count. Reported statistics: ``margin`` (mean
    ``beta``-scaled reward margin), ``accuracy`` (share of pairs with margin > 0),
    ``chosen_reward`` / ``rejected_reward`` (implicit rewards), ``dpo`` and ``nll`` (the two terms).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the DPO KL strength), got {beta}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (the NLL weight), got {alpha}")
    shapes = {tuple(t.shape) for t in (inp.chosen_logp, inp.rejected_logp, inp.ref_chosen_logp,
                                       inp.ref_rejected_logp, inp.chosen_tokens)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"preference inputs must all be [P] vectors of one length, got shapes {sorted(shapes)}")
    lc, lr = inp.chosen_logp.float(), inp.rejected_logp.float()
    chosen_reward = beta * (lc - inp.ref_chosen_logp.detach().float())
    rejected_reward = beta * (lr - inp.ref_rejected_logp.detach().float())
    margin = chosen_reward - rejected_reward
    dpo = -torch.nn.functional.logsigmoid(margin)
    nll = -lc / inp.chosen_tokens.detach().float().clamp(min=1.0)
    per_pair = dpo + alpha * nll
    p = float(per_pair.shape[0])
    n = float(inp.num_pairs if inp.num_pairs is not None else p)
    loss = per_pair.sum() / max(n, 1.0) * inp.dp_world_size

    def mean(x: torch.Tensor) -> float:
        return float(x.detach().float().sum() / max(p, 1.0))

    stats = {
        "margin": mean(margin), "accuracy": mean((margin > 0).float()), "chosen_reward": mean(chosen_reward),
        "rejected_reward": mean(rejected_reward), "dpo": mean(dpo), "nll": mean(nll),
    }
    return PreferenceOutputs(loss, per_pair, stats, p)


def dpo_loss(inp: PreferenceInputs, beta: float = 0.1) -> PreferenceOutputs:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290): :func:`rpo_loss` with ``alpha = 0``."""
    return rpo_loss(inp, beta=beta, alpha=0.0)
