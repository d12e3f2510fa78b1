"""Lean SwiGLU / RMSNorm: the same values and gradients as transformers' modules, fewer saved tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from flywheel.kernels.fused_layers import patch_for_training, rms_norm, silu_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_rms_norm_match_the_reference_in_value_and_gradient(dtype):
    torch.manual_seed(0)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    g = torch.randn(7, 33, dtype=dtype, requires_grad=True)
    u = torch.randn(7, 33, dtype=dtype, requires_grad=True)
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    out, ref = silu_mul(g, u), torch.nn.functional.silu(g2) * u2
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(g.grad, g2.grad, **tol)
    torch.testing.assert_close(u.grad, u2.grad, **tol)

    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(16, dtype=dtype, requires_grad=True)
    x2, weight2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = rms_norm(x, weight, 1e-6)
    x32 = x2.float()
    ref = weight2 * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(weight.grad, weight2.grad, **tol)


def test_gradcheck_in_float64():
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (g, u))
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))


def test_patched_llama_gives_the_same_loss_and_gradients_and_keeps_fewer_activations():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = LlamaForCausalLM(cfg).train()
    lean = copy.deepcopy(ref)
    assert patch_for_training(lean) == {"mlp": 2, "rmsnorm": 5}  # 2 per layer + the final norm
    ids = torch.randint(0, 101, (3, 17))

    def run(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, sum(saved)

    loss_ref, grads_ref, saved_ref = run(ref)
    loss_lean, grads_lean, saved_lean = run(lean)
    torch.testing.assert_close(loss_lean, loss_ref)
    for n, gr in grads_ref.items():
        torch.testing.assert_close(grads_lean[n], gr, atol=1e-5, rtol=1e-4, msg=n)
    assert saved_lean < saved_ref  # fewer elements kept for backward


def test_unknown_modules_are_left_alone():
    class OddMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = self.up_proj = self.down_proj = torch.nn.Linear(2, 2)
            self.act_fn = torch.nn.SiLU()

    m = OddMLP()
    before = m.forward
    assert patch_for_training(m) == {"mlp": 0, "rmsnorm": 0} and m.forward == before
