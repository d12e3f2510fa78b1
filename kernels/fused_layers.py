"""Memory-lean SwiGLU and RMSNorm for training: same forward, fewer activations kept for backward.

Autograd keeps what each elementwise op needs for its own backward. In a Llama-style block that is,
per token and layer, four ``intermediate``-wide tensors in the MLP (``gate``, ``silu(gate)``, ``up``,
their product) and, in each RMSNorm, the normalised input besides the input itself. The functions
here keep only their inputs (and the per-row ``rstd`` of the norm) and recompute the rest in
backward, which costs a few elementwise ops (the idea of Liger-Kernel's fused SwiGLU/RMSNorm, in
plain torch so it runs on CPU and CUDA alike).

Measured on SmolLM2-135M (30 layers, hidden 576, intermediate 1536), fp32 on CPU, a 4 x 386-token
micro-batch: the forward keeps ~1.9 MB of activations per token; these two save ~0.3 MB of it
(``benchmarks/bench_vs_trl.py`` has the end-to-end figure).

:func:`patch_for_training` swaps, in place, the forwards of the MLPs and RMSNorms of the model
families whose transformers code is exactly these formulas (:data:`MLP_CLASSES`, :data:`NORM_CLASSES`:
Llama, which SmolLM2 is, Mistral, Qwen2, Qwen3); other modules are left alone (Gemma's norm, for
one, scales by ``1 + weight``). peft's LoRA wraps the projections, not the MLP, so a
patched MLP calls the adapted projections as before. Outputs equal the originals (tests: values
and gradients against the unpatched module, fp32 and bf16).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    """Half precision computes in float32 (as transformers' norm does); float32/float64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        gate_, g = _up(gate), _up(grad)
        sig = torch.sigmoid(gate_)
        d_up = (g * gate_ * sig).to(up.dtype)
        d_gate = (g * _up(up) * sig * (1 + gate_ * (1 - sig))).to(gate.dtype)
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SiluMul.apply(gate, up)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` computed in float32 as transformers' RMSNorm does,
    keeping ``x`` and the per-row ``rstd`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = _up(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = _up(x) * rstd
        g = _up(grad)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (g * _up(normed.to(x.dtype))).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            dn = g * _up(weight)
            d_x = (rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))).to(x.dtype)
        return d_x, d_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


# transformers classes whose forward is ``down(act(gate(x)) * up(x))`` / the float32 RMSNorm above
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _is_silu(fn: Any) -> bool:
    return isinstance(fn, torch.nn.SiLU) or type(fn).__name__ == "SiLUActivation"


def patch_for_training(model: torch.nn.Module) -> dict[str, int]:
    """Swap in the lean forwards of known MLP and RMSNorm classes; returns the counts patched."""
    counts = {"mlp": 0, "rmsnorm": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in MLP_CLASSES and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_mlp_forward, module)
            counts["mlp"] += 1
        elif name in NORM_CLASSES:
            module.forward = types.MethodType(_rms_forward, module)
            counts["rmsnorm"] += 1
    return counts
