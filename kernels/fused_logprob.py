"""Fused linear + selective log-softmax: log p(target) from hidden states without [tokens, vocab] logits.

A policy-gradient step needs, per generated token, ``log softmax(h @ W.T / T)[target]`` (and sometimes
the entropy of that distribution). The naive way builds the full logits matrix: at 32,768 tokens x
151,936 vocab that is 10 GB in bf16 and 20 GB per fp32 copy, and autograd keeps a copy alive for the
backward. This module walks the tokens in chunks instead, so at most one ``[chunk, vocab]`` block exists
at a time, and recomputes that block in the backward pass (one extra matmul, the same trade Liger-Kernel's
fused linear cross-entropy makes).

Math (z = (h @ W.T + b) / T, p = softmax(z), lse = logsumexp(z)):

    logp_i    = z_i[t_i] - lse_i
    entropy_i = lse_i - sum_j p_ij z_ij          (natural log, nats)
    d logp_i / d z_ij    = onehot(t_i)_j - p_ij
    d entropy_i / d z_ij = -p_ij (log p_ij + entropy_i)
    dZ = g_logp * (onehot - p) - g_ent * p * (log p + entropy)      # per row, per column
    grad_h = dZ @ W / T,   grad_W = dZ.T @ h / T,   grad_b = sum_rows(dZ) / T

Backends:
    ``"torch"``  chunked pure-torch implementation: the reference and the CPU path.
    ``"triton"`` chunked matmuls by torch (cuBLAS on CUDA) plus Triton kernels that stream each row of
                 a chunk once (online logsumexp over vocab blocks) in the forward and turn the recomputed
                 chunk into dZ in place in the backward (see ``fused_logprob_triton``). On CPU tensors
                 it runs only under ``TRITON_INTERPRET=1`` (tests).
    ``"auto"``   triton on CUDA tensors when triton imports, torch otherwise.

Guarantees:
    * log-probs and entropy are returned in float32 whatever the input dtype; the row reductions run in
      float32.
    * Under ``torch.no_grad()`` (or when no input requires grad) nothing is saved for backward and the
      results have no ``grad_fn``.
    * With grad, only hidden, weight, bias, targets, lse and entropy ([N] floats) are saved; peak extra
      memory is one ``[chunk, vocab]`` block (two in the entropy-gradient case) plus the gradients.
    * Gradients flow to hidden, weight and bias, including through the entropy output. With tied
      embeddings pass the embedding matrix as ``weight``: autograd sums this gradient with the
      embedding lookup's, as for any tensor used twice.

Non-guarantees:
    * ``targets`` must be valid ids in ``[0, V)``; there is no ignore index. Mask padded positions in the
      caller (pass any valid id, e.g. 0, and multiply the result by the mask). Out-of-range ids raise.
    * The chunk logits are computed in the matmul dtype (bf16 in, bf16 logits out, as an lm_head would)
      and only then upcast; results therefore match a bf16 model's own logits, not an fp32 oracle, to
      within bf16 rounding of the logits.
    * grad_weight is accumulated across token chunks in the weight's dtype (as Liger does): in bf16 each
      chunk adds one rounding. Cosine to the fp64 gradient stays >= 0.999 at the tested shapes.
    * Under autocast the matmul runs in the autocast dtype like an lm_head would; the casts are
      differentiable, so a cast copy of the weight ([V, H] in bf16) is what gets saved for backward.
    * Logits must be finite (a -inf bias column is not supported).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["fused_logprobs", "naive_logprobs", "default_chunk_size"]

_BACKENDS = ("auto", "triton", "torch")

# Chunk sizing. The torch path on CPU (2-core EPYC shared with other jobs, load average ~12, fp32,
# V=49,152, H=576, 2,048 tokens fwd+bwd; `bench_fused_logprob.py --quick --sweep`, process CPU time):
# chunk 128 -> 8.36 s, 256 -> 6.97 s, 512 -> 6.15 s, 1024 -> 5.92 s, 2048 -> 5.94 s (naive 4.95 s in the
# same run). GEMMs are ~86% of the time (torch profiler, chunk 256) and run at ~97 GFLOP/s with 64 rows,
# ~111 with 256, ~128 with 1024; small chunks also pay one OpenMP fork/join per op. 512 rows keep 96%
# of the 1024-row speed at two thirds of its head memory (209 vs 305 MiB at 2,048 tokens; naive
# 1,157 MiB), so the budget is 512 x 49,152 x fp32 = 96 MiB of logits per chunk.
# Vocab chunking (online logsumexp across vocab blocks) would shrink the GEMMs to win back part of the
# ~13% spent in the row passes; at these shapes that cannot pay, so the torch path chunks tokens only.
_CPU_CHUNK_BYTES = 96 * 2**20
# On CUDA the chunk is a bf16 block read by cuBLAS and streamed twice by the Triton kernels. 512 MiB at
# 151,936 x bf16 gives 1,024 rows: a [1024, 2048] x [2048, 151936] GEMM (0.64 TFLOP) is large enough to
# keep an H200 busy, and the 311 MiB block is <1% of what the naive head needs at 32,768 tokens (an
# estimated ~50 GB: bf16 logits 10 GB + fp32 copy 20 GB + log_softmax output 20 GB, kept for backward).
# Not yet measured on a GPU: benchmarks/gpu_check.py sweeps 256..4096 and prints the figures.
_CUDA_CHUNK_BYTES = 512 * 2**20
_MIN_CHUNK, _MAX_CHUNK = 16, 8192


def default_chunk_size(n_tokens: int, vocab: int, device: torch.device, dtype: torch.dtype) -> int:
    """Tokens per chunk: the largest power of two whose ``[chunk, vocab]`` logits fit the byte budget.

    The budget is per device type (see the measured constants above); the result is clamped to
    [16, 8192] and never exceeds ``n_tokens`` rounded up to a power of two.
    """
    if device.type == "cuda":
        budget, elem = _CUDA_CHUNK_BYTES, torch.empty((), dtype=dtype).element_size()
    else:
        budget, elem = _CPU_CHUNK_BYTES, 4  # the torch path upcasts every chunk to fp32
    rows = max(budget // max(vocab * elem, 1), 1)
    chunk = 1 << (int(rows).bit_length() - 1)  # round down to a power of two
    chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, chunk))
    cap = 1 << max(int(n_tokens) - 1, 0).bit_length()
    return max(1, min(chunk, cap))


# ----------------------------------------------------------------------------------------------------
# Row operations on one chunk of logits. Two implementations share one chunk driver: torch (below) and
# Triton (fused_logprob_triton). Both receive the raw chunk logits ``z = h_c @ W.T`` in the matmul dtype,
# in a workspace buffer they may overwrite, and a ``_Workspace`` for any further [C, V] scratch.
# ----------------------------------------------------------------------------------------------------


class _Workspace:
    """Named ``[rows, V]`` scratch buffers reused across the chunks of one call.

    Why: on CPU a fresh 48 MiB tensor per chunk is mmap'd and page-faulted in on first touch, then
    unmapped on free. Measured (256 x 576 @ 576 x 49,152 fp32, 2 cores): ``h @ W.T`` into a fresh tensor
    302 ms, into a reused buffer 189 ms; a fresh ``exp`` 32 ms vs ~3 ms in place. On CUDA the caching
    allocator makes reuse free either way.
    """

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device, self._bufs = vocab, device, {}

    def get(self, name: str, rows: int, dtype: torch.dtype) -> Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < rows or buf.dtype != dtype:
            buf = torch.empty(rows, self.vocab, dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:rows]


class _TorchRowOps:
    """Row reductions and dZ in plain torch, float32, in place in workspace buffers (no [C, V] allocs)."""

    @staticmethod
    def _scaled_fp32(z: Tensor, bias: Tensor | None, inv_t: float, ws: _Workspace) -> Tensor:
        if z.dtype != torch.float32:
            z = ws.get("z32", z.shape[0], torch.float32).copy_(z)
        if bias is not None:
            z.add_(bias)
        if inv_t != 1.0:
            z.mul_(inv_t)
        return z

    @staticmethod
    def forward(z, targets, bias, inv_t, want_entropy, ws):
        z = _TorchRowOps._scaled_fp32(z, bias, inv_t, ws)
        target_logit = z.gather(1, targets[:, None])[:, 0]
        m = z.amax(dim=-1, keepdim=True)
        z.sub_(m)  # z - max: <= 0, so exp cannot overflow
        entropy = None
        if want_entropy:
            e = torch.exp(z, out=ws.get("p", z.shape[0], torch.float32))
            s = e.sum(-1)
            # H = log s - sum(e * (z - m)) / s, the dot product as a batched matmul (no [C, V] temp)
            dot = torch.bmm(e[:, None, :], z[:, :, None])[:, 0, 0]
            entropy = s.log() - dot / s
        else:
            s = z.exp_().sum(-1)
        lse = m[:, 0] + s.log()
        return target_logit - lse, lse, entropy

    @staticmethod
    def backward(z, targets, bias, inv_t, lse, entropy, g_logp, g_ent, ws):
        """Return dZ (d objective / d raw logits, already times 1/T) in fp32, built in place."""
        z = _TorchRowOps._scaled_fp32(z, bias, inv_t, ws)
        z.sub_(lse[:, None])  # log p
        if g_ent is not None:
            p = torch.exp(z, out=ws.get("p", z.shape[0], torch.float32))
            # -p * (g_logp + g_ent * (log p + H))
            z.add_(entropy[:, None]).mul_(g_ent[:, None])
            if g_logp is not None:
                z.add_(g_logp[:, None])
            z.mul_(p).neg_()
        else:
            z.exp_().mul_(-g_logp[:, None])
        if g_logp is not None:
            z.scatter_add_(1, targets[:, None], g_logp[:, None])
        if inv_t != 1.0:
            z.mul_(inv_t)
        return z


def _row_ops(backend: str):
    if backend == "torch":
        return _TorchRowOps
    from flywheel.kernels import fused_logprob_triton

    return fused_logprob_triton.TritonRowOps


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def _forward_chunks(hidden, weight, bias, targets, inv_t, want_entropy, chunk, ops):
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if want_entropy else None
    ws = _Workspace(weight.shape[0], hidden.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        z = torch.mm(hidden[s:e], weight.T, out=ws.get("z", e - s, weight.dtype))
        lp, ls, en = ops.forward(z, targets[s:e], bias, inv_t, want_entropy, ws)
        logp[s:e], lse[s:e] = lp, ls
        if want_entropy:
            entropy[s:e] = en
    return logp, lse, entropy


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def _backward_chunks(hidden, weight, bias, targets, inv_t, lse, entropy, g_logp, g_ent, chunk, ops, needs):
    need_h, need_w, need_b = needs
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if need_h else None
    # Contiguous (mm's out= must be), and left unfilled: the first chunk writes it, saving a zero pass.
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    ws = _Workspace(weight.shape[0], hidden.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h_c = hidden[s:e]
        z = torch.mm(h_c, weight.T, out=ws.get("z", e - s, weight.dtype))
        dz = ops.backward(
            z,
            targets[s:e],
            bias,
            inv_t,
            lse[s:e],
            None if entropy is None else entropy[s:e],
            None if g_logp is None else g_logp[s:e],
            None if g_ent is None else g_ent[s:e],
            ws,
        )
        if need_b:
            grad_b += dz.sum(0, dtype=torch.float32)
        if dz.dtype != weight.dtype:  # torch path with bf16/fp16 weights: dZ was built in fp32
            dz = z.copy_(dz)
        if need_h:
            torch.mm(dz, weight, out=grad_h[s:e])
        if need_w:
            if s == 0:
                torch.mm(dz.T, h_c, out=grad_w)
            else:
                grad_w.addmm_(dz.T, h_c)
    if need_b:
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


class _FusedLogProbFn(torch.autograd.Function):
    """Saves hidden/weight/bias/targets/lse(/entropy); recomputes chunk logits in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, want_entropy, chunk, backend):
        ops = _row_ops(backend)
        logp, lse, entropy = _forward_chunks(hidden, weight, bias, targets, inv_t, want_entropy, chunk, ops)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.inv_t, ctx.chunk, ctx.backend = inv_t, chunk, backend
        ctx.set_materialize_grads(False)
        if entropy is None:
            entropy = logp.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if entropy is None:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 8
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        g_logp = None if g_logp is None else g_logp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        grad_h, grad_w, grad_b = _backward_chunks(
            hidden, weight, bias, targets, ctx.inv_t, lse, entropy, g_logp, g_ent, ctx.chunk,
            _row_ops(ctx.backend), needs,
        )  # fmt: skip
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"fused_logprobs: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "fused_logprobs: backend='triton' on a non-CUDA tensor needs TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (CPU interpreter, for tests)"
        )
    return backend


def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[targets]`` without full logits.

    Args:
        hidden: ``[N, H]`` last hidden states (any float dtype; extra leading dims are flattened and the
            outputs take ``targets``' shape). May require grad.
        weight: ``[V, H]`` lm_head weight; with tied embeddings pass the embedding matrix. If its dtype
            differs from ``hidden``'s, ``hidden`` is cast to it (differentiably).
        targets: ``[N]`` int64 token ids in ``[0, V)``.
        bias: optional ``[V]`` lm_head bias.
        temperature: logits are divided by it (sampling temperature; must be > 0).
        compute_entropy: also return the entropy (nats) of each row's distribution; differentiable.
        chunk_size: tokens per chunk; default from :func:`default_chunk_size` (measured budgets).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).

    Returns:
        ``(logp, entropy)``: float32 tensors shaped like ``targets``; ``entropy`` is None unless asked.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"fused_logprobs: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on "
            "the token dimensions (expected hidden [..., H] and targets [...])"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"fused_logprobs: weight must be [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"fused_logprobs: bias must be [V={vocab}], got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"fused_logprobs: temperature must be > 0, got {temperature}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"fused_logprobs: targets must be integer token ids, got {targets.dtype}")
    out_shape = targets.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).long().contiguous()
    n = hidden.shape[0]
    if n and not (0 <= (lo_hi := torch.aminmax(targets)).min.item() and lo_hi.max.item() < vocab):
        bad = targets[(targets < 0) | (targets >= vocab)][:5].tolist()
        raise IndexError(f"fused_logprobs: target ids {bad} outside the vocabulary [0, {vocab})")
    if torch.is_autocast_enabled(hidden.device.type):
        # Do what an lm_head Linear does under autocast: run the matmul in the autocast dtype. The casts
        # are differentiable, so fp32 master weights still receive fp32 gradients.
        amp_dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(amp_dtype), weight.to(amp_dtype)
        bias = None if bias is None else bias.to(amp_dtype)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    hidden = hidden.contiguous()
    if chunk_size is None:
        chunk_size = default_chunk_size(n, vocab, hidden.device, weight.dtype)
    if chunk_size < 1:
        raise ValueError(f"fused_logprobs: chunk_size must be >= 1, got {chunk_size}")
    resolved = _resolve_backend(backend, hidden.device)
    inv_t = 1.0 / float(temperature)
    bias_f = None if bias is None else bias

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if n == 0:
        logp = hidden.new_zeros(out_shape, dtype=torch.float32)
        return logp, (logp.clone() if compute_entropy else None)
    if needs_grad:
        logp, entropy = _FusedLogProbFn.apply(
            hidden, weight, bias_f, targets, inv_t, compute_entropy, int(chunk_size), resolved
        )
        entropy = entropy if compute_entropy else None
    else:
        # Old / reference log-probs: no autograd node, nothing saved.
        with torch.no_grad():
            logp, _, entropy = _forward_chunks(
                hidden, weight, bias_f, targets, inv_t, compute_entropy, int(chunk_size), _row_ops(resolved)
            )
    logp = logp.reshape(out_shape)
    return logp, (entropy.reshape(out_shape) if entropy is not None else None)


def naive_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference: full logits, ``log_softmax(...).gather(...)``; the peer the benchmark beats.

    The matmul runs in the inputs' dtype (like a model's lm_head), the logits are then upcast to float32
    for the softmax, as TRL-style trainers do. Pass fp32 (or fp64) inputs for an exact oracle. Memory:
    materialises ``[N, V]`` logits (plus fp32 copies), which is what :func:`fused_logprobs` avoids.
    """
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:  # skipped at T=1: a [N, V] division is ~7% of this function's CPU time
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).float()
    entropy = None
    if compute_entropy:
        entropy = -(logprobs.exp() * logprobs).sum(-1).float()
    return logp, entropy
