"""Lean SwiGLU / RMSNorm: the same values and gradients as transformers' modules, fewer saved tensors."""

from __future__ import annotations

import copy
import logging
import os
import shutil

import pytest
import torch
from flywheel.kernels import fused_layers
from flywheel.kernels.fused_layers import compile_failure, patch_for_training, rms_norm, silu_mul

from flywheel.train.trainer import COMPILE_MIN_MLP_WIDTH, compile_lean_layers

# torch.compile on CPU builds C++ (inductor's default compiler, or $CXX); without one the product falls back to
# eager (tested below) and the compiled-path tests have nothing to compare.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler for inductor")


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


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_cxx)], ids=["eager", "compiled"])
def test_patched_llama_gives_the_same_loss_and_gradients_and_keeps_fewer_activations(compiled):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = LlamaForCausalLM(cfg).train()
    lean = copy.deepcopy(ref)
    assert patch_for_training(lean, compiled=compiled) == {"mlp": 2, "rmsnorm": 5}  # 2 per layer + the final norm
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
    assert compile_failure() is None  # the compiled run really ran compiled, not the eager fallback


@needs_cxx
@pytest.mark.parametrize("batch", [1, 3])
def test_the_compiled_formulas_match_the_eager_ones_in_bf16(batch):
    """What the cpu demo profile trains with (bf16 weights, float32 math inside): the compiled path gives
    the eager path's values and gradients, for a batch of one (flattened, so no shape specialisation)
    and of three."""
    torch.manual_seed(1)
    gate = torch.randn(batch, 37, 48, dtype=torch.bfloat16)
    up = torch.randn(batch, 37, 48, dtype=torch.bfloat16)
    x = torch.randn(batch, 37, 24, dtype=torch.bfloat16)
    weight = torch.randn(24, dtype=torch.bfloat16)
    grad_a, grad_b = torch.randn_like(gate), torch.randn_like(x)  # fixed, so both backwards get the same input

    def run(compiled):
        g, u, xx, w = (t.clone().requires_grad_() for t in (gate, up, x, weight))
        a = silu_mul(g, u, compiled=compiled)
        b = rms_norm(xx, w, 1e-5, compiled=compiled)
        torch.autograd.backward([a, b], [grad_a, grad_b])
        return [a, b, g.grad, u.grad, xx.grad, w.grad]

    eager, comp = run(False), run(True)
    assert compile_failure() is None
    for name, e, c in zip(["silu_mul", "rms_norm", "d_gate", "d_up", "d_x", "d_weight"], eager, comp, strict=True):
        assert c.shape == e.shape and c.dtype == e.dtype, name
        # the same formulas with eager's roundings (emulate_precision_casts): equal up to one bf16 ulp where a
        # float32 sum's order differs (d_weight); 1/128 is one ulp relative to the value
        torch.testing.assert_close(c, e, atol=1e-6, rtol=1 / 128, msg=lambda m, name=name: f"{name}: {m}")


def test_a_failed_compile_falls_back_to_the_eager_formulas_with_one_warning(monkeypatch, caplog):
    def no_compiler(*a, **k):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(fused_layers._Compiled, "failed", None)
    fn = fused_layers._Compiled(fused_layers._silu_mul_fwd)
    g, u = torch.randn(4, 6), torch.randn(4, 6)
    with caplog.at_level(logging.WARNING, logger="flywheel.kernels.fused_layers"):
        out = fn(g, u)
        again = fn(g, u)
    torch.testing.assert_close(out, torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(again, out)
    assert "No working C++ compiler" in (compile_failure() or "")
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not once per call


def test_compile_lean_layers_auto_compiles_wide_mlps_on_cpu_only():
    class Cfg:
        def __init__(self, width):
            self.intermediate_size = width

    class M:
        def __init__(self, width):
            self.config = Cfg(width)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_lean_layers("auto", M(1536), cpu) is True  # SmolLM2-135M
    assert compile_lean_layers("auto", M(COMPILE_MIN_MLP_WIDTH - 1), cpu) is False  # the tiny test model's kind
    assert compile_lean_layers("auto", M(1536), cuda) is False
    assert compile_lean_layers("auto", object(), cpu) is False  # no config: nothing to judge by
    assert compile_lean_layers("on", M(8), cuda) is True
    assert compile_lean_layers("off", M(4096), cpu) is False


def test_unknown_modules_are_left_alone():
    class OddMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = self.up_proj = self.down_proj = torch.nn.Linear(2, 2)
            self.act_fn = torch.nn.SiLU()

    m = OddMLP()
    before = m.forward
    assert patch_for_training(m) == {"mlp": 0, "rmsnorm": 0} and m.forward == before
