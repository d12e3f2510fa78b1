"""Group advantages and DAPO's soft overlong penalty against hand-computed values (issue 8, test 6)."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.advantages import (
    STD_EPS,
    compute_advantages,
    soft_overlong_penalty,
    zero_variance_share,
)

# Group "a": rewards [1, 0, 1, 0] -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735.
# Group "b": rewards [0.7, 0.7, 0.7] -> std 0: every advantage must be exactly 0.
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.7, 0.7, 0.7])
GROUPS = ["a", "a", "a", "a", "b", "b", "b"]


def test_zero_std_group_gets_zero_advantage_in_every_mode():
    for scale in ("group", "batch", "none"):
        adv = compute_advantages(REWARDS, GROUPS, scale)
        assert (adv[4:] == 0.0).all(), scale
    # A group of one sample has no spread either.
    assert compute_advantages(torch.tensor([0.3]), ["solo"]).item() == 0.0
    # 0.1 * 3 / 3 != 0.1 in floats: round-off must not leak a non-zero advantage.
    assert (compute_advantages(torch.tensor([0.1, 0.1, 0.1]), [0, 0, 0]) == 0.0).all()


def test_group_scaling_matches_hand_computation():
    adv = compute_advantages(REWARDS, GROUPS, "group")
    a = 0.5 / (math.sqrt(1 / 3) + STD_EPS)
    torch.testing.assert_close(adv[:4], torch.tensor([a, -a, a, -a]))


def test_none_is_dr_grpo_mean_centering_only():
    adv = compute_advantages(REWARDS, GROUPS, "none")
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_batch_scaling_uses_the_batch_std():
    # Group mean is still subtracted; the scale is the unbiased std of all 7 rewards.
    std_b = REWARDS.std(unbiased=True).item()
    adv = compute_advantages(REWARDS, GROUPS, "batch")
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std_b + STD_EPS))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        compute_advantages(torch.tensor([1.0, 0.0]), ["a", "a", "b"])
    with pytest.raises(ValueError, match="unknown advantage scale"):
        compute_advantages(torch.tensor([1.0]), ["a"], "rank")  # type: ignore[arg-type]


def test_soft_overlong_penalty_ramp():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4, then -1 past 10.
    pen = soft_overlong_penalty(torch.tensor([3, 6, 8, 10, 11]), max_len=10, cache_len=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_zero_variance_share():
    assert zero_variance_share(REWARDS, GROUPS) == 0.5
    assert zero_variance_share(torch.zeros(4), [0, 0, 1, 1]) == 1.0
