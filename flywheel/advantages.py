"""Group-relative advantages and reward shaping for the GRPO family.

Guarantees
- A group whose rewards are all equal (zero standard deviation, or a single sample) gets advantage
  exactly 0.0 for every sample, in every scaling mode: such a group carries no relative signal
  (DeepSeekMath, arXiv 2402.03300, section 4.1.2), and float round-off in ``R - mean`` must not turn
  into a tiny spurious gradient.
- The standard deviation is the unbiased (Bessel) estimate, as TRL and verl compute it, so figures
  are comparable with those trainers.
- Inputs are not modified; outputs are new float32 tensors on the rewards' device.

Not covered: reward *normalisation across steps* (running statistics); per-token rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

AdvantageScale = Literal["group", "batch", "none"]

#: Added to the standard deviation so a group with a tiny spread does not explode (TRL uses 1e-4).
STD_EPS = 1e-4
#: Groups whose reward spread is below this are treated as zero-variance (rewards are O(1)).
ZERO_STD = 1e-6


def group_index(group_ids: Sequence[str] | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Map arbitrary group labels to dense int64 indices, in order of first appearance.

    ``["b", "a", "b"] -> [0, 1, 0]``.
    """
    if isinstance(group_ids, torch.Tensor):
        _, inv = torch.unique(group_ids, return_inverse=True)
        return inv.to(torch.int64)
    seen: dict[object, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.int64)


def compute_advantages(
    rewards: torch.Tensor,  # [N] float
    group_ids: Sequence[str] | Sequence[int] | torch.Tensor,  # [N] group label per sample
    scale: AdvantageScale = "group",
    *,
    eps: float = STD_EPS,
) -> torch.Tensor:  # [N] float32
    """Advantages of ``N`` samples grouped by prompt.

    - ``group``: ``(R - mean_g) / (std_g + eps)`` (GRPO, DeepSeekMath eq. 3 outcome supervision).
    - ``batch``: ``(R - mean_g) / (std_batch + eps)``: the group mean is still subtracted (the baseline
      must be per prompt), but the scale is the batch's standard deviation, which removes the bias
      towards easy/hard prompts that per-group scaling introduces (Dr. GRPO, arXiv 2503.20783, sec. 3.1
      and TRL's ``scale_rewards="batch"``).
    - ``none``: ``R - mean_g`` (Dr. GRPO: no std scaling at all).

    A zero-std group (including a group of one) gets 0.0 in every mode.
    """
    r = rewards.detach().to(torch.float32).reshape(-1)
    idx = group_index(group_ids).to(r.device)
    if idx.numel() != r.numel():
        raise ValueError(f"compute_advantages: {r.numel()} rewards but {idx.numel()} group ids")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown advantage scale {scale!r}: expected 'group', 'batch' or 'none'")
    if r.numel() == 0:
        return r.clone()
    n_groups = int(idx.max()) + 1
    count = torch.zeros(n_groups, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, idx, r) / count
    centred = r - mean[idx]
    sq = torch.zeros(n_groups, device=r.device).index_add_(0, idx, centred**2)
    # Unbiased variance; a group of one has no spread by definition.
    std_g = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    zero = std_g[idx] < ZERO_STD
    if scale == "group":
        adv = centred / (std_g[idx] + eps)
    elif scale == "batch":
        std_b = r.std(unbiased=True) if r.numel() > 1 else torch.zeros((), device=r.device)
        adv = centred / (std_b + eps)
    else:
        adv = centred
    return torch.where(zero, torch.zeros_like(adv), adv)


def soft_overlong_penalty(
    lengths: torch.Tensor,  # [N] completion lengths in tokens
    max_len: int,
    cache_len: int,
) -> torch.Tensor:  # [N] float32, in [-1, 0]
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward.

    ``0`` while ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the cache
    window (a linear ramp from 0 to -1); ``-1`` beyond ``L_max``.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"soft_overlong_penalty: need 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    y = lengths.to(torch.float32)
    start = max_len - cache_len
    ramp = (start - y) / cache_len
    out = torch.where(y <= start, torch.zeros_like(y), ramp)
    return torch.where(y > max_len, torch.full_like(y, -1.0), out)


def zero_variance_share(
    rewards: torch.Tensor, group_ids: Sequence[str] | Sequence[int] | torch.Tensor
) -> float:
    """Share of groups whose rewards are all equal (what decides an SFT warm start, `train.sft_trigger_zero_variance`)."""
    r = rewards.detach().to(torch.float32).reshape(-1)
    idx = group_index(group_ids).to(r.device)
    if r.numel() == 0:
        return 1.0
    n = int(idx.max()) + 1
    hi = torch.full((n,), -float("inf"), device=r.device).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((n,), float("inf"), device=r.device).scatter_reduce(0, idx, r, "amin")
    return float(((hi - lo) < ZERO_STD).float().mean())
