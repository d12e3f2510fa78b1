"""The GRPO loss family against hand-computed tensors (issue 8, unit tests 1-5).

Every test uses the log-probs themselves as the leaf tensor, so ``grad(logp) = identity`` and the
gradient of the loss with respect to ``logp`` can be written down by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.config import ObjectiveConfig
from flywheel.train.losses import (
    LossInputs,
    compute_loss,
    gspo_sequence_ratio,
    kl_penalty,
)

CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"]

# Two sequences: the first has 3 completion tokens, the second 2 (+1 padding position whose log-prob
# is garbage, -50, and must not matter).
LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -50.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [2.0, -1.0]

# Test 1 expectations: with logp_old = sg(logp) every ratio is 1 (nothing clipped), so the gradient of
# each variant is -A_i * m_it / normaliser:
#   grpo / gspo: per-sequence mean then batch mean -> -A_i / (L_i * B):
#                seq0: -2 / (3 * 2) = -1/3 ; seq1: +1 / (2 * 2) = +1/4
#                (gspo: d s_i / d logp_it = s_i * m_it / L_i with s_i = 1, same numbers)
#   bnpo / dapo / cispo: token sum over the 5 tokens -> -A_i / 5: seq0 -0.4 ; seq1 +0.2
#                (cispo: weight sg(min(r, 5)) = 1, d(-A logp)/d logp = -A)
#   dr_grpo:     token sum over B * L_max = 2 * 3 = 6 -> seq0 -1/3 ; seq1 +1/6
EXPECTED_GRAD = {
    "grpo": [[-1 / 3, -1 / 3, -1 / 3], [0.25, 0.25, 0.0]],
    "gspo": [[-1 / 3, -1 / 3, -1 / 3], [0.25, 0.25, 0.0]],
    "bnpo": [[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]],
    "dapo": [[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]],
    "cispo": [[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]],
    "dr_grpo": [[-1 / 3, -1 / 3, -1 / 3], [1 / 6, 1 / 6, 0.0]],
}


@pytest.mark.parametrize("variant", CLIPPED)
def test_on_policy_gradient_is_minus_advantage_over_normaliser(variant):
    logp = torch.tensor(LOGP, requires_grad=True)
    out = compute_loss(
        variant, LossInputs(logp=logp, mask=torch.tensor(MASK), advantages=torch.tensor(ADV)), ObjectiveConfig()
    )
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(EXPECTED_GRAD[variant]), rtol=0, atol=1e-6)
    assert out.stats["clip_frac"] == 0.0
    assert out.tokens == 5.0


@pytest.mark.parametrize("variant", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_clipped_tokens_have_zero_gradient(variant):
    # Row 0: A = +1 and r = 1.5 > 1 + eps_high = 1.28 -> the min picks the clipped constant 1.28 * A,
    #        whose gradient is 0.
    # Row 1: A = -1 and r = 0.5 < 1 - eps_low = 0.8 -> -min(0.5 * -1, 0.8 * -1) = 0.8 (constant): grad 0.
    # Row 2 (control): A = +1 and r = 0.5 < 0.8: the unclipped 0.5 * A is the min, so the gradient is
    #        -A * r / normaliser = -0.5 / normaliser != 0 (clipping is one-sided, as PPO intends).
    old = torch.tensor([[-1.0], [-1.0], [-1.0]])
    logp = (old + torch.log(torch.tensor([[1.5], [0.5], [0.5]]))).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    out = compute_loss(
        variant, LossInputs(logp=logp, old_logp=old, mask=torch.ones(3, 1), advantages=adv), ObjectiveConfig()
    )
    out.loss.backward()
    assert logp.grad[0, 0] == 0.0
    assert logp.grad[1, 0] == 0.0
    assert logp.grad[2, 0] < -1e-3
    # 2 of 3 tokens are clipped, one from above and one from below.
    assert out.stats["clip_frac"] == pytest.approx(2 / 3)
    assert out.stats["clip_high_frac"] == pytest.approx(1 / 3)
    assert out.stats["clip_low_frac"] == pytest.approx(1 / 3)


def test_k3_is_nonnegative_and_has_the_stated_gradient():
    # Hand example: logp = -1, ref = -2 -> d = ref - logp = -1:
    #   k3 = e^-1 - (-1) - 1 = e^-1 = 0.367879 ; d k3 / d logp = 1 - e^(ref - logp) = 1 - e^-1 = 0.632121
    logp = torch.tensor([-1.0], requires_grad=True)
    k3 = kl_penalty(logp, torch.tensor([-2.0]), "k3")
    k3.sum().backward()
    assert k3.item() == pytest.approx(math.exp(-1), abs=1e-6)
    assert logp.grad.item() == pytest.approx(1 - math.exp(-1), abs=1e-6)

    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(1000, generator=g) * 3).requires_grad_(True)
    ref = torch.randn(1000, generator=g) * 3
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()  # e^x >= 1 + x for every x
    k3.sum().backward()
    torch.testing.assert_close(logp.grad, 1 - torch.exp(ref - logp.detach()))
    # k3 is exactly 0 where the policies agree.
    assert kl_penalty(torch.tensor([-0.7]), torch.tensor([-0.7]), "k3").item() == 0.0


def test_kl_term_enters_the_loss_with_beta():
    # On-policy with A = 0 the loss is beta * mean k3: logp = -1, ref = -2 -> beta * e^-1.
    logp = torch.tensor([[-1.0]], requires_grad=True)
    cfg = ObjectiveConfig(beta=0.1)
    out = compute_loss(
        "dapo",
        LossInputs(logp=logp, mask=torch.ones(1, 1), advantages=torch.zeros(1), ref_logp=torch.tensor([[-2.0]])),
        cfg,
    )
    assert out.loss.item() == pytest.approx(0.1 * math.exp(-1), abs=1e-6)
    assert out.stats["kl"] == pytest.approx(math.exp(-1), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss("dapo", LossInputs(logp=logp, mask=torch.ones(1, 1), advantages=torch.zeros(1)), cfg)


def test_gspo_sequence_ratio_of_equal_token_log_ratios_is_exp_d():
    # Every policy token of sequence i has log-ratio d_i, so the mean log-ratio is d_i and s_i = e^d_i,
    # independent of length; the padding position (mask 0) has a huge log-ratio that must be ignored.
    d = torch.tensor([0.1, -0.05])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = old + d[:, None]
    logp[1, 2] = 10.0  # padding garbage
    s = gspo_sequence_ratio(logp, old, mask)
    torch.testing.assert_close(s, torch.exp(d))


def _split_grad(variant: str, n_micro: int, cfg: ObjectiveConfig) -> torch.Tensor:
    """Accumulate the gradient of a fixed 4-sequence batch split into ``n_micro`` micro-batches."""
    g = torch.Generator().manual_seed(1)
    lengths = [7, 2, 5, 1]  # unequal lengths: the split changes per-micro-batch token counts
    T = max(lengths)
    mask = torch.zeros(4, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(4, T, generator=g) * 3
    logp_all = (old + torch.randn(4, T, generator=g) * 0.3).requires_grad_(True)  # some tokens clip
    sampler = old + torch.randn(4, T, generator=g) * 0.1
    adv = torch.tensor([1.5, -0.5, 0.7, -2.0])
    n_tok = float(mask.sum())
    size = 4 // n_micro
    for k in range(n_micro):
        sl = slice(k * size, (k + 1) * size)
        out = compute_loss(
            variant,
            LossInputs(
                logp=logp_all[sl], old_logp=old[sl], mask=mask[sl], advantages=adv[sl], sampler_logp=sampler[sl],
                num_tokens=n_tok, num_sequences=4, num_micro_batches=n_micro, max_completion_len=T,
            ),
            cfg,
        )
        out.loss.backward()
    return logp_all.grad.clone()


@pytest.mark.parametrize("variant", ["dapo", "grpo", "dr_grpo", "gspo", "cispo"])
def test_global_normalisation_makes_the_gradient_split_invariant(variant):
    # dapo divides the token sum by the step's GLOBAL token count (20 here), so each token's gradient
    # is -A * dr/dlogp * w / 20 whichever micro-batch it lands in; summing over micro-batches
    # reproduces the 1-micro-batch gradient exactly (up to float round-off).
    cfg = ObjectiveConfig(gspo_eps_low=0.2, gspo_eps_high=0.28)
    g1 = _split_grad(variant, 1, cfg)
    for n in (2, 4):
        torch.testing.assert_close(_split_grad(variant, n, cfg), g1, rtol=0, atol=1e-6)


def test_bnpo_gradient_depends_on_the_split():
    # bnpo divides by the micro-batch's own token count: split [7,2 | 5,1] gives the first two
    # sequences weight 1/(9*2) per token instead of 1/20, so the gradients differ.
    cfg = ObjectiveConfig()
    g1 = _split_grad("bnpo", 1, cfg)
    assert (_split_grad("bnpo", 2, cfg) - g1).abs().max() > 1e-3
    assert (_split_grad("bnpo", 4, cfg) - g1).abs().max() > 1e-3


def test_truncated_importance_weight_is_capped():
    # pi_old / pi_sampler = e^2 = 7.39 is capped at C = 3; e^-1 = 0.368 passes through.
    # On-policy dapo gradient becomes -A * w / N = -1 * [3, 0.368] / 2.
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[-3.0, 0.0]])
    out = compute_loss(
        "dapo", LossInputs(logp=logp, mask=torch.ones(1, 2), advantages=torch.ones(1), sampler_logp=sampler),
        ObjectiveConfig(tis_cap=3.0),
    )
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -math.exp(-1) / 2]]))
    logp.grad = None
    compute_loss(
        "dapo", LossInputs(logp=logp, mask=torch.ones(1, 2), advantages=torch.ones(1), sampler_logp=sampler),
        ObjectiveConfig(tis_cap=None),
    ).loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5]]))


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        compute_loss("ppo", LossInputs(logp=torch.zeros(1, 1), mask=torch.ones(1, 1), advantages=torch.zeros(1)))
