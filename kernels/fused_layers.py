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

``compiled=True`` (``train.compile_lean_layers``) runs the same formulas through ``torch.compile``
(inductor: one generated loop per function, on CPU a vectorised C++ loop) instead of eight or so
eager passes over ``[tokens, width]`` tensors, each with its own float32 copies. Values are the same
formulas with eager's roundings (inductor's ``emulate_precision_casts``: a bf16 intermediate is rounded
where eager rounds it; tests compare the two paths); the first call of each function per
process and dtype compiles it (seconds, cached on disk by inductor for later processes), and a
compile that fails (no C++ compiler, an unsupported torch) falls back to the eager formulas for the
rest of the process with one warning. Inputs go in flattened to ``[rows, width]`` so one dynamic-shape
compile serves every micro-batch shape. Measured on SmolLM2-135M, bf16 on a 2-core AMX Xeon: the eager
``SiluMul`` backward took 11.6 ms on a ``3 x 661 x 1536`` micro-batch and its compiled form 1.2 ms; the
whole SFT step is in ``benchmarks/bench_cpu_limits.py``'s output.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _up(t: torch.Tensor) -> torch.Tensor:
    """Half precision computes in float32 (as transformers' norm does); float32/float64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# -- the formulas (eager; also what torch.compile traces) -------------------------------------------------


def _silu_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _silu_mul_bwd(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_, g = _up(gate), _up(grad)
    sig = torch.sigmoid(gate_)
    d_up = (g * gate_ * sig).to(up.dtype)
    d_gate = (g * _up(up) * sig * (1 + gate_ * (1 - sig))).to(gate.dtype)
    return d_gate, d_up


def _rms_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = _up(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


def _rms_bwd_x(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    normed = _up(x) * rstd
    dn = _up(grad) * _up(weight)
    return (rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))).to(x.dtype)


def _rms_bwd_w(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    normed = _up(x) * rstd
    return (_up(grad) * _up(normed.to(x.dtype))).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)


class _Compiled:
    """``fn`` through ``torch.compile`` (dynamic shapes), compiled on first use; eager once compiling fails.

    Tensors go in flattened to 2-D ``[rows, width]`` (``rows > 1`` in practice), so a 3-D micro-batch of
    any batch size and length reuses one compiled graph instead of specialising on a batch of 1.
    """

    failed: str | None = None  # class-wide: one failure (no compiler) disables every compiled function

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if _Compiled.failed is None:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.fn, dynamic=True, options={"emulate_precision_casts": True})
                return self._compiled(*args)
            except Exception as e:  # a missing C++ compiler, an inductor bug: the eager formulas still hold
                _Compiled.failed = f"{type(e).__name__}: {e}"[:300]
                log.warning("train.compile_lean_layers: torch.compile failed (%s); the lean layers run eager "
                            "for the rest of this process", _Compiled.failed)
        return self.fn(*args)


_silu_mul_fwd_c = _Compiled(_silu_mul_fwd)
_silu_mul_bwd_c = _Compiled(_silu_mul_bwd)
_rms_fwd_c = _Compiled(_rms_fwd)
_rms_bwd_x_c = _Compiled(_rms_bwd_x)
_rms_bwd_w_c = _Compiled(_rms_bwd_w)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# -- autograd functions ------------------------------------------------------------------------------------


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.compiled = compiled
        if compiled:
            return _silu_mul_fwd_c(_rows(gate), _rows(up)).view(gate.shape)
        return _silu_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        if ctx.compiled:
            d_gate, d_up = _silu_mul_bwd_c(_rows(gate), _rows(up), _rows(grad))
            return d_gate.view(gate.shape), d_up.view(up.shape), None
        d_gate, d_up = _silu_mul_bwd(gate, up, grad)
        return d_gate, d_up, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, compiled: bool = False) -> torch.Tensor:
    return SiluMul.apply(gate, up, compiled)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` computed in float32 as transformers' RMSNorm does,
    keeping ``x`` and the per-row ``rstd`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, compiled: bool = False) -> torch.Tensor:
        ctx.compiled = compiled
        if compiled:
            out, rstd = _rms_fwd_c(_rows(x), weight, eps)
            out = out.view(x.shape)
        else:
            out, rstd = _rms_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        shape = x.shape
        bwd_x: Callable[..., torch.Tensor]
        bwd_w: Callable[..., torch.Tensor]
        if ctx.compiled:
            x, grad = _rows(x), _rows(grad)
            bwd_x, bwd_w = _rms_bwd_x_c, _rms_bwd_w_c
        else:
            bwd_x, bwd_w = _rms_bwd_x, _rms_bwd_w
        d_weight = bwd_w(x, weight, rstd, grad) if ctx.needs_input_grad[1] else None
        d_x = bwd_x(x, weight, rstd, grad).view(shape) if ctx.needs_input_grad[0] else None
        return d_x, d_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, compiled: bool = False) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps, compiled)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x), compiled=self._flywheel_compiled))


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, compiled=self._flywheel_compiled)


# transformers classes whose forward is ``down(act(gate(x)) * up(x))`` / the float32 RMSNorm above
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _is_silu(fn: Any) -> bool:
    return isinstance(fn, torch.nn.SiLU) or type(fn).__name__ == "SiLUActivation"


def patch_for_training(model: torch.nn.Module, *, compiled: bool = False) -> dict[str, int]:
    """Swap in the lean forwards of known MLP and RMSNorm classes; returns the counts patched.

    ``compiled``: their elementwise math through ``torch.compile`` (module docstring)."""
    counts = {"mlp": 0, "rmsnorm": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in MLP_CLASSES and _is_silu(getattr(module, "act_fn", None)):
            object.__setattr__(module, "_flywheel_compiled", compiled)  # a plain flag, not a parameter or buffer
            module.forward = types.MethodType(_mlp_forward, module)
            counts["mlp"] += 1
        elif name in NORM_CLASSES:
            object.__setattr__(module, "_flywheel_compiled", compiled)
            module.forward = types.MethodType(_rms_forward, module)
            counts["rmsnorm"] += 1
    return counts


def compile_failure() -> str | None:
    """Why ``torch.compile`` failed in this process (the lean layers then run eager), or None."""
    return _Compiled.failed
