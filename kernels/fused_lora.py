"""A LoRA linear layer for training as GEMMs only: no elementwise pass over its output.

peft computes an adapted linear layer as ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the
GEMMs, a multiplication and an addition over the ``[tokens, out]`` output in the forward, the
multiplication's backward over the same shape, and autograd's sum of the two input gradients over
``[tokens, in]``. A Llama block has seven adapted linears; SmolLM2-135M has thirty blocks, so an SFT step
makes about 840 such passes over activations, each reading and writing memory while the GEMMs wait.

:class:`LoraLinearFunction` folds them into the GEMMs' accumulation (``addmm_`` with ``alpha``):

- forward: ``h = x Aᵀ`` (``[tokens, r]``), ``out = x Wᵀ + b``, then ``out += scaling · h Bᵀ`` in place;
- backward: ``u = g B`` (``[tokens, r]``), ``dx = g W``, then ``dx += scaling · u A`` in place;
  ``dB = scaling · gᵀ h`` and ``dA = scaling · uᵀ x`` are ``[out, r]`` and ``[r, in]``.

It keeps ``x`` (which peft's graph keeps too, for ``lora_A``'s gradient) and ``h`` (``r`` wide). The values
are the same sums in another order: equal to fp32 rounding (tests compare values and gradients with peft's
forward, and a float64 gradcheck).

:func:`patch_lora_for_training` swaps the forward of every peft LoRA ``Linear`` in a model; the fused path
runs only where it computes what peft would: one active adapter of plain LoRA (no DoRA or other variant), no
dropout in effect, no bias on ``lora_B``, not merged, adapters enabled, no per-row ``adapter_names``, a plain
``nn.Linear`` base layer, the input, base weight and adapter weights all of one dtype, and no autocast on the
input's device. Anything else (a bf16 base with float32 adapters under autocast, the Intel path of
``policy.dtype = "fast"``; quantised bases; DeepSpeed ZeRO-3's partitioned weights) runs peft's own forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F


class LoraLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias) + scaling * (x @ a.T) @ b.T`` with GEMM accumulation only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, scaling: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        out = F.linear(x2, weight, bias)
        out.addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, a, b, h)
        ctx.scaling = scaling
        ctx.in_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, a, b, h = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        u = g @ b if (need_x or need_a) else None  # [tokens, r]
        dx = dw = dbias = da = db = None
        if need_x:
            assert u is not None
            dx = (g @ weight).addmm_(u, a, alpha=s).view(ctx.in_shape)
        if need_w:  # a trainable base weight (not LoRA's case; kept for completeness)
            dw = g.t() @ x2
        if need_bias:
            dbias = g.sum(0)
        if need_a:
            assert u is not None
            da = torch.mm(u.t(), x2).mul_(s)
        if need_b:
            db = torch.mm(g.t(), h).mul_(s)
        return dx, dw, dbias, da, db, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                scaling: float) -> torch.Tensor:
    return LoraLinearFunction.apply(x, weight, bias, a, b, scaling)  # type: ignore[no-any-return]


def _fusable(layer: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The adapter's ``(A, B, scaling)`` when the fused path computes what peft's forward would, else None."""
    if kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}):
        return None
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and dropout.training and dropout.p > 0:
        return None
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if type(base) is not torch.nn.Linear or type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return None
    if lora_a.bias is not None or lora_b.bias is not None or base.weight.numel() == 0:  # ZeRO-3 placeholders
        return None
    a, b, w = lora_a.weight, lora_b.weight, base.weight
    if not (x.dtype == w.dtype == a.dtype == b.dtype) or torch.is_autocast_enabled(x.device.type):
        return None
    if base.bias is not None and base.bias.dtype != x.dtype:
        return None
    return a, b, float(layer.scaling[name])


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    fused = None if args else _fusable(self, x, kwargs)
    if fused is None:
        return self._flywheel_peft_forward(x, *args, **kwargs)  # type: ignore[no-any-return]
    a, b, scaling = fused
    return lora_linear(x, self.base_layer.weight, self.base_layer.bias, a, b, scaling)


def patch_lora_for_training(model: torch.nn.Module) -> int:
    """Swap in the fused forward on every peft LoRA ``Linear`` of ``model`` (module docstring); returns how
    many. Idempotent: a layer already patched is counted and left as it is."""
    try:
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
    except ImportError:  # no peft, so no LoRA layers to patch
        return 0
    n = 0
    for module in model.modules():
        if not isinstance(module, PeftLoraLinear):
            continue
        if "_flywheel_peft_forward" not in module.__dict__:
            object.__setattr__(module, "_flywheel_peft_forward", module.forward)
            module.__dict__["forward"] = types.MethodType(_fused_forward, module)
        n += 1
    return n


def unpatch_lora(model: torch.nn.Module) -> int:
    """Restore peft's forward on every layer :func:`patch_lora_for_training` patched; returns how many."""
    n = 0
    for module in model.modules():
        if module.__dict__.pop("_flywheel_peft_forward", None) is not None:
            module.__dict__.pop("forward", None)  # the class's forward again
            n += 1
    return n
