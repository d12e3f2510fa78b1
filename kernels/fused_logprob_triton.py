"""Triton row kernels for :mod:`flywheel.kernels.fused_logprob` (the CUDA path).

The chunk driver in ``fused_logprob`` computes each ``[C, V]`` block of raw logits ``z = h_c @ W.T`` with
a torch matmul (cuBLAS on CUDA, the part that needs tensor cores) and hands it to these kernels, one
program per row, each streaming its row through the vocabulary in ``BLOCK_V`` blocks:

* ``_logprob_fwd_kernel``: online logsumexp (running max ``m`` and rescaled sum ``s``; Milakov and
  Gimelshein 2018, "Online normalizer calculation for softmax"), the target logit and, optionally, the
  running ``sum exp(z - m) * z`` for the entropy. Reads the block once, writes three floats per row.
* ``_dlogits_bwd_kernel``: with ``lse`` (and entropy) known from the forward, one pass turns the
  recomputed block into ``dZ = (g_logp * (onehot - p) - g_ent * p * (log p + H)) / T`` in place, in the
  block's dtype, ready for the two backward matmuls (``dZ @ W`` and ``dZ.T @ h``) done by torch.

This is the Liger-Kernel split (cuBLAS for the GEMMs, Triton for the row passes). Every row statistic is
float32 regardless of the block dtype. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors
(numpy interpreter), which is how the tests exercise them without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _logprob_fwd_kernel(
    Z, stride_z, TARGETS, BIAS, LOGP, LSE, ENT, V, inv_t,
    HAS_BIAS: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    a = 0.0  # sum_j exp(z_j - m) * z_j, for the entropy
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        z = z * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # masked lanes: exp(-inf) = 0
        s = s * scale + tl.sum(e, axis=0)
        if HAS_ENT:
            a = a * scale + tl.sum(e * tl.where(mask, z, 0.0), axis=0)  # no 0 * -inf on masked lanes
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(TARGETS + row)
    zt = tl.load(z_row + t).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(BIAS + t).to(tl.float32)
    zt = zt * inv_t
    tl.store(LOGP + row, zt - lse)
    tl.store(LSE + row, lse)
    if HAS_ENT:
        tl.store(ENT + row, lse - a / s)


@triton.jit
def _dlogits_bwd_kernel(
    Z, stride_z, TARGETS, BIAS, LSE, ENT, G_LOGP, G_ENT, V, inv_t,
    HAS_BIAS: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(LSE + row)
    t = tl.load(TARGETS + row)
    g = 0.0
    if HAS_GLOGP:
        g = tl.load(G_LOGP + row)
    ge = 0.0
    h = 0.0
    if HAS_GENT:
        ge = tl.load(G_ENT + row)
        h = tl.load(ENT + row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        logp = z * inv_t - lse
        p = tl.exp(logp)
        d = -p * g
        if HAS_GENT:
            d -= ge * p * (logp + h)
        if HAS_GLOGP:
            d = tl.where(cols == t, d + g, d)
        d = d * inv_t
        tl.store(z_row + cols, d.to(Z.dtype.element_ty), mask=mask)


def _block_v(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps). 4,096 x 8 warps streams a row in 37 steps at V=151,936 (Liger uses up to
    32K-wide blocks with 32 warps for its CE kernel; 4K keeps registers low with the entropy path on).
    The interpreter pays per op, not per element, so it gets the widest block that covers V."""
    if _INTERPRET:
        return min(triton.next_power_of_2(vocab), 65536), 4
    return min(triton.next_power_of_2(vocab), 4096), 8


class TritonRowOps:
    """Same contract as ``fused_logprob._TorchRowOps``, backed by the kernels above."""

    @staticmethod
    def forward(z: Tensor, targets: Tensor, bias: Tensor | None, inv_t: float, want_entropy: bool, ws=None):
        if z.stride(1) != 1:
            z = z.contiguous()
        rows, vocab = z.shape
        logp = torch.empty(rows, dtype=torch.float32, device=z.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else lse  # placeholder pointer when unused
        block, warps = _block_v(vocab)
        _logprob_fwd_kernel[(rows,)](
            z, z.stride(0), targets, bias if bias is not None else lse, logp, lse, ent, vocab, inv_t,
            HAS_BIAS=bias is not None, HAS_ENT=want_entropy, BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
        return logp, lse, (ent if want_entropy else None)

    @staticmethod
    def backward(z, targets, bias, inv_t, lse, entropy, g_logp, g_ent, ws=None):
        """Overwrite ``z`` with dZ (times 1/T) in its own dtype and return it."""
        if z.stride(1) != 1:
            z = z.contiguous()
        rows, vocab = z.shape
        block, warps = _block_v(vocab)
        _dlogits_bwd_kernel[(rows,)](
            z, z.stride(0), targets, bias if bias is not None else lse, lse,
            entropy if g_ent is not None else lse,
            g_logp if g_logp is not None else lse, g_ent if g_ent is not None else lse,
            vocab, inv_t,
            HAS_BIAS=bias is not None, HAS_GLOGP=g_logp is not None, HAS_GENT=g_ent is not None,
            BLOCK_V=block, num_warps=warps,
        )  # fmt: skip
        return z
