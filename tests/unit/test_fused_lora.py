"""``train.fused_lora``: peft's LoRA linears as GEMMs only (flywheel/kernels/fused_lora.py) -- the same values and
gradients as peft's forward, the fused path only where it computes what peft would, and the trainer using it."""

from __future__ import annotations

import copy

import pytest
import torch
from flywheel.kernels import fused_lora
from flywheel.kernels.fused_lora import lora_linear, patch_lora_for_training, unpatch_lora
from test_trainer import V, batch, tiny_lm

from flywheel.config import TrainConfig
from flywheel.train.trainer import Trainer, TrainerOptions, apply_lora


def _lora_model(seed: int = 0, dropout: float = 0.0):
    model = apply_lora(tiny_lm(seed=seed), r=4, alpha=8, dropout=dropout)
    torch.manual_seed(seed + 100)
    with torch.no_grad():  # peft starts B at zero, which hides A's gradient and the adapter's output
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def calls(monkeypatch):
    """How many times the fused function ran."""
    seen = {"n": 0}
    orig = fused_lora.LoraLinearFunction.apply

    def counting(*a):
        seen["n"] += 1
        return orig(*a)

    monkeypatch.setattr(fused_lora.LoraLinearFunction, "apply", counting)
    return seen


def test_the_fused_layer_gives_peft_s_loss_and_gradients(calls):
    ref = _lora_model().train()
    fused = copy.deepcopy(ref)
    n_linear = sum(1 for m in ref.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    assert patch_lora_for_training(fused) == n_linear == 2 * 7  # 2 blocks x q, k, v, o, gate, up, down
    ids = torch.randint(1, V, (3, 11), generator=torch.Generator().manual_seed(0))
    loss_ref, g_ref = _loss_and_grads(ref, ids)
    loss_fused, g_fused = _loss_and_grads(fused, ids)
    assert calls["n"] == n_linear  # every adapted linear ran fused, once
    torch.testing.assert_close(loss_fused, loss_ref, atol=1e-6, rtol=1e-6)
    assert set(g_fused) == set(g_ref) and any("lora_A" in n for n in g_ref)
    for n, g in g_ref.items():
        assert g.abs().sum() > 0, n  # B random: both adapter matrices get a gradient
        torch.testing.assert_close(g_fused[n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_gradcheck_in_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.randn(2, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: lora_linear(*t, 0.5), (x, w, bias, a, b))
    ref = torch.nn.functional.linear(x, w, bias) + 0.5 * (x @ a.t()) @ b.t()
    torch.testing.assert_close(lora_linear(x, w, bias, a, b, 0.5), ref)


def test_what_it_cannot_compute_as_peft_does_runs_peft_s_forward(calls):
    """Dropout in training, disabled adapters, a merged adapter, and a bf16 base under autocast with float32
    adapters (the bf16 CPU path) all keep peft's forward, with peft's values."""
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(2))

    drop = _lora_model(dropout=0.5).train()
    patch_lora_for_training(drop)
    torch.manual_seed(0)
    out = drop(input_ids=ids).logits
    unpatch_lora(drop)
    torch.manual_seed(0)
    torch.testing.assert_close(out, drop(input_ids=ids).logits)
    assert calls["n"] == 0
    drop.eval()  # dropout off in eval: fusable again
    patch_lora_for_training(drop)
    drop(input_ids=ids)
    assert calls["n"] == 14

    model = _lora_model()
    base_logits = copy.deepcopy(model).get_base_model()
    patch_lora_for_training(model)
    calls["n"] = 0
    with model.disable_adapter():
        off = model(input_ids=ids).logits
    assert calls["n"] == 0
    with torch.no_grad():
        for m in base_logits.modules():  # the same base without the adapter's contribution
            if hasattr(m, "lora_B"):
                for p in m.lora_B.values():
                    p.weight.zero_()
        torch.testing.assert_close(off, base_logits(input_ids=ids).logits)
    unfused = model(input_ids=ids).logits
    assert calls["n"] == 14
    model.merge_adapter()
    calls["n"] = 0
    torch.testing.assert_close(model(input_ids=ids).logits, unfused, atol=1e-5, rtol=1e-5)
    assert calls["n"] == 0

    half = _lora_model()
    for n, p in half.named_parameters():
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)  # a bf16 base with float32 adapters, as the bf16 CPU path trains
    patch_lora_for_training(half)
    calls["n"] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half(input_ids=ids)
    assert calls["n"] == 0


def _trainer(fused: bool) -> Trainer:
    tc = TrainConfig(lora_r=4, lora_alpha=8, micro_batch_tokens=1000, warmup_steps=0, fused_lora=fused)
    torch.manual_seed(3)  # the same adapter init in both trainers
    return Trainer(tiny_lm(seed=3), TrainerOptions(objective="sft", lr=1e-2, total_steps=3, temperature=1.0,
                                                   max_completion_len=16, train=tc))


def test_the_trainer_trains_through_the_fused_layers_to_the_same_losses(calls):
    on, off = _trainer(True), _trainer(False)
    assert on.fused_lora_layers == 14 and off.fused_lora_layers == 0
    losses = {"on": [], "off": []}
    for k in range(3):
        for name, tr in (("on", on), ("off", off)):
            losses[name].append(tr.step(batch(k)).loss)
    assert calls["n"] > 0  # the fused trainer's steps ran the fused layers (the other never does)
    assert losses["on"][2] != losses["on"][0]  # it trains
    for a, b in zip(losses["on"], losses["off"], strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    w_on = {n: p for n, p in on.model.named_parameters() if "lora_" in n}
    w_off = dict(off.model.named_parameters())
    for n, p in w_on.items():
        torch.testing.assert_close(p, w_off[n], atol=1e-5, rtol=1e-4, msg=n)
