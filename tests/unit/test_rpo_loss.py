"""DPO / RPO losses against hand-computed values, and the preference step of the trainer.

The loss tests use the sequence log-probs themselves as leaf tensors, so the gradient of the loss
with respect to each of them can be written down by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.config import TrainConfig
from flywheel.train.data import TrainSample
from flywheel.train.losses import PreferenceInputs, dpo_loss, rpo_loss
from flywheel.train.trainer import PreferenceSample, Trainer, TrainerOptions

# Two pairs, beta = 0.5, alpha = 1.0.
#   pair 0: logp_c = -2, ref_c = -3, logp_r = -4, ref_r = -3, |y_c| = 4
#           chosen reward  = 0.5 * (-2 - -3) = +0.5 ; rejected reward = 0.5 * (-4 - -3) = -0.5
#           margin = 1.0 ; dpo = -log sigmoid(1) = log(1 + e^-1) = 0.3132617
#           nll = 2 / 4 = 0.5 ; per-pair loss = 0.8132617
#   pair 1: logp_c = ref_c = logp_r = ref_r = -1, |y_c| = 2
#           margin = 0 ; dpo = log 2 = 0.6931472 ; nll = 1 / 2 = 0.5 ; per-pair loss = 1.1931472
#   loss = mean over the 2 pairs = (0.8132617 + 1.1931472) / 2 = 1.0032044
# Gradients (s = sigmoid(margin), divided by the 2 pairs):
#   dL/dlogp_c = (-beta (1 - s) - alpha / |y_c|) / 2 ; dL/dlogp_r = beta (1 - s) / 2
#   pair 0: s = 0.7310586: c = (-0.5 * 0.2689414 - 0.25) / 2 = -0.1922354 ; r = 0.5 * 0.2689414 / 2 = 0.0672354
#   pair 1: s = 0.5:       c = (-0.25 - 0.5) / 2 = -0.375             ; r = 0.25 / 2 = 0.125
BETA, ALPHA = 0.5, 1.0
LC, RC, LR, RR, NC = [-2.0, -1.0], [-3.0, -1.0], [-4.0, -1.0], [-3.0, -1.0], [4.0, 2.0]


def inputs(**kw) -> tuple[PreferenceInputs, torch.Tensor, torch.Tensor]:
    lc = torch.tensor(LC, requires_grad=True)
    lr = torch.tensor(LR, requires_grad=True)
    return PreferenceInputs(chosen_logp=lc, rejected_logp=lr, ref_chosen_logp=torch.tensor(RC),
                            ref_rejected_logp=torch.tensor(RR), chosen_tokens=torch.tensor(NC), **kw), lc, lr


def test_rpo_loss_and_gradient_match_the_equation():
    inp, lc, lr = inputs()
    out = rpo_loss(inp, beta=BETA, alpha=ALPHA)
    dpo0, dpo1 = math.log1p(math.exp(-1.0)), math.log(2.0)
    assert dpo0 == pytest.approx(0.3132617, abs=1e-7)
    torch.testing.assert_close(out.per_pair_loss, torch.tensor([dpo0 + 0.5, dpo1 + 0.5]))
    assert out.loss.item() == pytest.approx(1.0032044, abs=1e-6)
    out.loss.backward()
    s0 = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(lc.grad, torch.tensor([(-0.5 * (1 - s0) - 0.25) / 2, -0.375]))
    torch.testing.assert_close(lr.grad, torch.tensor([0.5 * (1 - s0) / 2, 0.125]))
    assert lc.grad[0].item() == pytest.approx(-0.1922354, abs=1e-6)
    # margin mean (1 + 0) / 2; accuracy: pair 0 only has margin > 0; implicit rewards (0.5 + 0) / 2, (-0.5 + 0) / 2.
    assert out.stats["margin"] == pytest.approx(0.5)
    assert out.stats["accuracy"] == pytest.approx(0.5)
    assert out.stats["chosen_reward"] == pytest.approx(0.25) and out.stats["rejected_reward"] == pytest.approx(-0.25)
    assert out.stats["nll"] == pytest.approx(0.5) and out.pairs == 2.0


def test_dpo_is_rpo_without_the_nll_term():
    # alpha = 0: loss = (0.3132617 + 0.6931472) / 2 = 0.5032044; dL/dlogp_c = -dL/dlogp_r = -beta (1 - s) / 2.
    inp, lc, lr = inputs()
    out = dpo_loss(inp, beta=BETA)
    assert out.loss.item() == pytest.approx(0.5032044, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lc.grad, -lr.grad)
    assert lr.grad.tolist() == pytest.approx([0.0672354, 0.125], abs=1e-6)


def test_gradient_signs_push_chosen_up_and_rejected_down():
    # Whatever the margin, descent raises logp_c (negative gradient) and lowers logp_r (positive).
    inp, lc, lr = inputs()
    rpo_loss(inp, beta=BETA, alpha=ALPHA).loss.backward()
    assert (lc.grad < 0).all() and (lr.grad > 0).all()
    # One plain gradient step on the leaves widens every pair's margin and lowers the loss.
    with torch.no_grad():
        lc2, lr2 = lc - 0.5 * lc.grad, lr - 0.5 * lr.grad
    before = (torch.tensor(LC) - torch.tensor(RC)) - (torch.tensor(LR) - torch.tensor(RR))
    after = (lc2 - torch.tensor(RC)) - (lr2 - torch.tensor(RR))
    assert (after > before).all()
    new = PreferenceInputs(lc2, lr2, torch.tensor(RC), torch.tensor(RR), torch.tensor(NC))
    assert rpo_loss(new, beta=BETA, alpha=ALPHA).loss < rpo_loss(inputs()[0], beta=BETA, alpha=ALPHA).loss


def test_split_into_micro_batches_gives_the_full_batch_gradient():
    # Each half normalised by the global pair count (2): the summed gradients equal the whole batch's.
    full, lc, lr = inputs()
    rpo_loss(full, beta=BETA, alpha=ALPHA).loss.backward()
    lc_h = torch.tensor(LC, requires_grad=True)
    lr_h = torch.tensor(LR, requires_grad=True)
    for i in range(2):
        part = PreferenceInputs(lc_h[i : i + 1], lr_h[i : i + 1], torch.tensor(RC[i : i + 1]), torch.tensor(RR[i : i + 1]),
                                torch.tensor(NC[i : i + 1]), num_pairs=2)
        rpo_loss(part, beta=BETA, alpha=ALPHA).loss.backward()
    torch.testing.assert_close(lc_h.grad, lc.grad)
    torch.testing.assert_close(lr_h.grad, lr.grad)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="beta must be > 0"):
        rpo_loss(inputs()[0], beta=0.0)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        rpo_loss(inputs()[0], beta=0.1, alpha=-1.0)
    bad = PreferenceInputs(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match="one length"):
        rpo_loss(bad)


# -- the trainer's preference step ------------------------------------------------------------------


def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    ))


def pairs() -> list[PreferenceSample]:
    def s(prompt, comp):
        return TrainSample(prompt_ids=prompt, completion_ids=comp, loss_mask=[1] * len(comp))

    return [PreferenceSample(s([1, 5, 6], [9, 10, 2]), s([1, 5, 6], [11, 2]), group_id="p0"),
            PreferenceSample(s([1, 7], [12, 2]), s([1, 7], [13, 14, 15, 2]), group_id="p1"),
            PreferenceSample(s([1, 8, 8, 8], [16, 2]), s([1, 8, 8, 8], [17, 2]), group_id="p2")]


def trainer(budget: int) -> Trainer:
    return Trainer(tiny_lm(), TrainerOptions(objective="rpo", lr=1e-2, total_steps=2, train=TrainConfig(
        lora_r=0, micro_batch_tokens=budget, warmup_steps=0, grad_clip=1e9, logprob_impl="naive")))


def test_preference_step_first_loss_is_log2_plus_nll_and_split_invariant():
    # Before any update the policy is its own reference: every margin is 0, so each pair's loss is
    # log 2 + alpha * (-ref_c / |y_c|), and the step's loss is their mean. A budget of 8 tokens puts
    # every pair in its own chunk (each pair has >= 10 tokens); 1000 puts all three in one: the
    # accumulated gradient (its norm) must not depend on the split.
    norms, losses = [], []
    for budget in (8, 1000):
        tr = trainer(budget)
        ps = pairs()
        tr.preference_reference(ps)
        expected = sum(math.log(2.0) - p.ref_chosen / len(p.chosen.completion_ids) for p in ps) / 3
        m = tr.preference_step(ps, beta=0.1, alpha=1.0)
        assert m.loss == pytest.approx(expected, rel=1e-5)
        assert m.stats["margin"] == pytest.approx(0.0, abs=1e-6) and m.stats["pairs"] == 3.0
        assert m.loss_tokens == 3 + 2 + 2 + 4 + 2 + 2
        norms.append(m.grad_norm)
        losses.append(m.loss)
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_preference_steps_widen_the_margin():
    tr = trainer(1000)
    ps = pairs()
    tr.preference_reference(ps)
    history = [tr.preference_step(ps, beta=0.5, alpha=0.1).stats["margin"] for _ in range(3)]
    # The margin a step reports is measured before its update: 0 at the first, then growing.
    assert history[0] == pytest.approx(0.0, abs=1e-6)
    assert history[2] > history[1] > 0.0


def test_preference_step_needs_reference_logprobs():
    with pytest.raises(ValueError, match="no reference log-probs"):
        trainer(1000).preference_step(pairs())
