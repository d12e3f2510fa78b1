"""fused_logprobs against the fp64 naive reference: values, gradients, modes, and what it saves.

Tolerances (from the issue): log-probs within 1e-3 of the reference, gradient cosine >= 0.999 for hidden
and weight. bf16 inputs are compared against the fp64 reference on the same (bf16-rounded) inputs; the
logits themselves are rounded to bf16 (as a bf16 lm_head's are), which moves a logit of magnitude ~8 by
up to ~0.03, hence the 0.1 bound there.

The Triton cases run through the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when CUDA
is missing) and on the GPU when there is one; interpreter shapes stay small (one program per row).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from flywheel.kernels.fused_logprob import default_chunk_size, fused_logprobs, naive_logprobs

CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"
try:
    import triton  # noqa: F401

    HAS_TRITON = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
except ImportError:  # pragma: no cover - triton is a Linux dependency of the project
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable / no interpreter")


def _inputs(n, v, h, *, seed=0, bias=False, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (scale / math.sqrt(h))  # logits std ~ scale
    b = torch.randn(v, generator=g) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    g_logp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g)
    return hidden, weight, b, targets, g_logp, g_ent


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _run(fn, hidden, weight, bias, targets, g_logp, g_ent, *, dtype, device, entropy, **kw):
    """Forward + backward of sum(g_logp * logp [+ g_ent * entropy]); returns values and grads (fp64)."""

    def leaf(x):  # a fresh leaf, never the caller's tensor (.to() returns self when nothing changes)
        return x.detach().to(device=device, dtype=dtype).clone().requires_grad_()

    h, w = leaf(hidden), leaf(weight)
    b = None if bias is None else leaf(bias)
    logp, ent = fn(h, w, targets.to(device), bias=b, compute_entropy=entropy, **kw)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    obj = (logp * g_logp.to(device)).sum()
    if entropy:
        obj = obj + (ent * g_ent.to(device)).sum()
    obj.backward()
    out = {"logp": logp.detach().double().cpu(), "gh": h.grad.double().cpu(), "gw": w.grad.double().cpu()}
    if entropy:
        out["ent"] = ent.detach().double().cpu()
    if b is not None:
        out["gb"] = b.grad.double().cpu()
    return out


def _reference(hidden, weight, bias, targets, g_logp, g_ent, *, dtype, entropy, temperature):
    # Round to the tested dtype first, then compute exactly in fp64.
    def rt(x):
        return None if x is None else x.to(dtype).double()

    return _run(
        naive_logprobs, rt(hidden), rt(weight), rt(bias), targets, g_logp.double(), g_ent.double(),
        dtype=torch.float64, device="cpu", entropy=entropy, temperature=temperature,
    )  # fmt: skip


def _check(got, ref, *, atol, min_cos=0.999):
    assert (got["logp"] - ref["logp"]).abs().max().item() <= atol
    if "ent" in ref:
        assert (got["ent"] - ref["ent"]).abs().max().item() <= atol
    for k in ("gh", "gw", "gb"):
        if k in ref:
            assert _cos(got[k], ref[k]) >= min_cos, k


# -------------------------------------------------------------------------------------- torch path


@pytest.mark.parametrize(
    "n,v,h,bias,temperature,entropy,chunk",
    [
        (7 * 33, 1000, 64, False, 1.0, False, None),  # odd token count, one chunk by default
        (7 * 33, 1000, 64, True, 0.7, True, 50),  # bias, T != 1, entropy, ragged last chunk (231 = 4*50+31)
        (33, 49152, 48, False, 1.3, True, 8),  # SmolLM2 vocabulary, 5 chunks
        (6, 123, 431, True, 1.0, False, 1),  # hidden > vocab, chunk of one token
    ],
)
def test_torch_path_matches_fp64_reference(n, v, h, bias, temperature, entropy, chunk):
    args = _inputs(n, v, h, bias=bias)
    got = _run(
        fused_logprobs, *args, dtype=torch.float32, device="cpu", entropy=entropy,
        temperature=temperature, chunk_size=chunk, backend="torch",
    )  # fmt: skip
    ref = _reference(*args, dtype=torch.float32, entropy=entropy, temperature=temperature)
    _check(got, ref, atol=1e-3)
    # fp32 lands far inside the bound; a regression to e.g. bf16 logits would not.
    assert (got["logp"] - ref["logp"]).abs().max().item() < 1e-4


def test_torch_path_bf16_inputs_on_cpu():
    args = _inputs(7 * 33, 1000, 64, bias=True)
    got = _run(
        fused_logprobs, *args, dtype=torch.bfloat16, device="cpu", entropy=True, temperature=0.8,
        chunk_size=64, backend="torch",
    )  # fmt: skip
    ref = _reference(*args, dtype=torch.bfloat16, entropy=True, temperature=0.8)
    _check(got, ref, atol=0.1)
    assert (got["logp"] - ref["logp"]).abs().mean().item() < 0.02


def test_hand_computed_logprob_and_gradient():
    # h = [1], W = [[0], [1], [2]] -> logits [0, 1, 2]; target 2, T = 1:
    #   logp = 2 - log(1 + e + e^2);  p = [1, e, e^2] / Z
    #   d logp / dh = W[2] - sum_j p_j W[j] = 2 - (p_1 + 2 p_2)
    #   d logp / dW[j] = (onehot_j - p_j) * h  -> [-p_0, -p_1, 1 - p_2]
    z = 1 + math.e + math.e**2
    p = [1 / z, math.e / z, math.e**2 / z]
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[0.0], [1.0], [2.0]], requires_grad=True)
    logp, ent = fused_logprobs(h, w, torch.tensor([2]), backend="torch", compute_entropy=True)
    assert logp.item() == pytest.approx(2 - math.log(z), abs=1e-6)
    # H = -sum p log p
    assert ent.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)
    logp.sum().backward()
    assert h.grad.item() == pytest.approx(2 - (p[1] + 2 * p[2]), abs=1e-6)
    assert w.grad[:, 0].tolist() == pytest.approx([-p[0], -p[1], 1 - p[2]], abs=1e-6)


def test_chunking_does_not_change_results():
    args = _inputs(37, 300, 16, bias=True)
    runs = [
        _run(fused_logprobs, *args, dtype=torch.float32, device="cpu", entropy=True, temperature=0.9,
             chunk_size=c, backend="torch")
        for c in (1, 5, 37, 4096)
    ]  # fmt: skip
    for r in runs[1:]:
        for k in runs[0]:
            assert torch.allclose(r[k], runs[0][k], atol=1e-5, rtol=1e-5), k


def test_tied_embeddings_accumulate_both_gradients():
    # A toy LM: embedding -> tanh(linear) -> head tied to the embedding. The embedding matrix gets a
    # gradient from the lookup AND from the head; both must land in the same .grad.
    torch.manual_seed(0)
    v, h, n = 500, 32, 40
    ids = torch.randint(0, v, (n,))
    targets = torch.randint(0, v, (n,))

    def grads(fn, **kw):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(v, h)
        proj = torch.nn.Linear(h, h)
        hidden = torch.tanh(proj(emb(ids)))
        logp, _ = fn(hidden, emb.weight, targets, **kw)
        logp.mean().backward()
        return emb.weight.grad.clone(), proj.weight.grad.clone()

    ge_f, gp_f = grads(fused_logprobs, backend="torch", chunk_size=16)
    ge_n, gp_n = grads(naive_logprobs)
    assert torch.allclose(ge_f, ge_n, atol=1e-6)
    assert torch.allclose(gp_f, gp_n, atol=1e-6)
    # The lookup's contribution is really there: rows looked up but never a target/in softmax mass
    # would be ~0 without it; compare against the head-only gradient.
    torch.manual_seed(1)
    emb = torch.nn.Embedding(v, h)
    proj = torch.nn.Linear(h, h)
    hidden = torch.tanh(proj(emb(ids))).detach()
    w = emb.weight.detach().clone().requires_grad_()
    fused_logprobs(hidden, w, targets, backend="torch")[0].mean().backward()
    assert not torch.allclose(w.grad, ge_f, atol=1e-6)


def test_no_grad_mode_saves_nothing():
    hidden, weight, _, targets, _, _ = _inputs(20, 200, 16)
    hidden.requires_grad_()
    weight.requires_grad_()
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            logp, ent = fused_logprobs(hidden, weight, targets, compute_entropy=True, backend="torch")
        assert logp.grad_fn is None and ent.grad_fn is None and not logp.requires_grad
        assert packed == []
        # With grad it saves only [N, H], [V, H], [N] tensors: never a [N, V] block.
        logp, _ = fused_logprobs(hidden, weight, targets, chunk_size=8, backend="torch")
    assert logp.grad_fn is not None
    # hidden [N, H], weight [V, H], targets and lse [N]: never a [rows, V] logits block.
    assert set(packed) == {(20, 16), (200, 16), (20,)}, packed
    # Same values either way.
    with torch.no_grad():
        ref, _ = fused_logprobs(hidden, weight, targets, backend="torch")
    assert torch.equal(ref, logp.detach())


def test_frozen_head_only_hidden_gets_gradient():
    hidden, weight, _, targets, g, _ = _inputs(30, 400, 16)
    h = hidden.clone().requires_grad_()
    logp, _ = fused_logprobs(h, weight, targets, backend="torch", chunk_size=7)
    (logp * g).sum().backward()
    h2 = hidden.clone().double().requires_grad_()
    (naive_logprobs(h2, weight.double(), targets)[0] * g.double()).sum().backward()
    assert _cos(h.grad, h2.grad) >= 0.9999
    assert weight.grad is None


def test_autocast_runs_the_matmul_in_the_autocast_dtype_like_an_lm_head():
    hidden, weight, _, targets, g, _ = _inputs(40, 300, 32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = fused_logprobs(h, w, targets, chunk_size=16, backend="torch")
        ref = torch.log_softmax((h2 @ w2.T).float(), -1).gather(1, targets[:, None])[:, 0]
    # Same bf16 logits as the autocast lm_head, so equal up to fp32 reduction order, not bf16 rounding.
    assert logp.dtype == torch.float32
    assert (logp - ref).abs().max().item() < 1e-4
    (logp * g).sum().backward()
    (ref * g).sum().backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32  # fp32 masters keep fp32 grads
    assert _cos(w.grad, w2.grad) >= 0.999 and _cos(h.grad, h2.grad) >= 0.999


def test_non_contiguous_weight_gets_a_correct_gradient():
    # A [V, H] weight stored as the transpose of an [H, V] leaf (e.g. a checkpoint kept head-major).
    hidden, weight, _, targets, g, _ = _inputs(30, 200, 16)
    w_t = weight.T.contiguous().requires_grad_()  # leaf [H, V]
    logp, _ = fused_logprobs(hidden, w_t.T, targets, backend="torch", chunk_size=8)
    (logp * g).sum().backward()
    w2 = weight.double().requires_grad_()
    (naive_logprobs(hidden.double(), w2, targets)[0] * g.double()).sum().backward()
    assert _cos(w_t.grad.T, w2.grad) >= 0.9999


def test_leading_dims_are_flattened_and_restored():
    hidden, weight, _, targets, _, _ = _inputs(24, 100, 8)
    logp, ent = fused_logprobs(hidden.view(4, 6, 8), weight, targets.view(4, 6), compute_entropy=True)
    flat, flat_ent = fused_logprobs(hidden, weight, targets, compute_entropy=True)
    assert logp.shape == (4, 6) and ent.shape == (4, 6) and logp.dtype == torch.float32
    assert torch.allclose(logp.flatten(), flat) and torch.allclose(ent.flatten(), flat_ent)


def test_rejections_name_the_problem(monkeypatch):
    hidden, weight, _, targets, _, _ = _inputs(4, 10, 8)
    with pytest.raises(IndexError, match=r"\[10\].*outside the vocabulary"):
        fused_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="disagree"):
        fused_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        fused_logprobs(hidden, weight, targets, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not CUDA:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            fused_logprobs(hidden, weight, targets, backend="triton")


def test_default_chunk_size_follows_the_byte_budget():
    # 96 MiB of fp32 logits per chunk on CPU: 512 rows at 49,152.
    assert default_chunk_size(8192, 49152, torch.device("cpu"), torch.float32) == 512
    assert default_chunk_size(8192, 49152, torch.device("cpu"), torch.bfloat16) == 512  # upcast to fp32
    assert default_chunk_size(8192, 151936, torch.device("cpu"), torch.float32) == 128
    # 512 MiB of bf16 on CUDA: 1,024 rows at 151,936.
    assert default_chunk_size(32768, 151936, torch.device("cuda"), torch.bfloat16) == 1024
    # Never more than the (power-of-two-rounded) token count; never below 1.
    assert default_chunk_size(5, 49152, torch.device("cpu"), torch.float32) == 8
    assert default_chunk_size(1, 10, torch.device("cpu"), torch.float32) == 1


# ------------------------------------------------------------------------------------- triton path


@needs_triton
@pytest.mark.parametrize(
    "n,v,h,bias,temperature,entropy,chunk,dtype",
    [
        (7 * 33, 1000, 64, False, 1.0, False, None, torch.float32),
        (7 * 33, 1000, 64, True, 0.7, True, 100, torch.float32),
        (7 * 9, 1000, 64, True, 1.5, True, 16, torch.bfloat16),
        (5, 49152, 32, False, 1.0, True, 2, torch.float32),  # full SmolLM2 vocabulary, small N
    ],
)
def test_triton_path_matches_fp64_reference(n, v, h, bias, temperature, entropy, chunk, dtype):
    args = _inputs(n, v, h, bias=bias, seed=3)
    got = _run(
        fused_logprobs, *args, dtype=dtype, device=TRITON_DEVICE, entropy=entropy,
        temperature=temperature, chunk_size=chunk, backend="triton",
    )  # fmt: skip
    ref = _reference(*args, dtype=dtype, entropy=entropy, temperature=temperature)
    _check(got, ref, atol=1e-3 if dtype == torch.float32 else 0.1)


@needs_triton
def test_triton_and_torch_paths_agree_in_no_grad_mode():
    hidden, weight, bias, targets, _, _ = _inputs(7 * 33, 1000, 64, bias=True, seed=5)
    with torch.no_grad():
        a, ea = fused_logprobs(hidden.to(TRITON_DEVICE), weight.to(TRITON_DEVICE), targets.to(TRITON_DEVICE),
                               bias=bias.to(TRITON_DEVICE), temperature=0.6, compute_entropy=True,
                               backend="triton")  # fmt: skip
        b, eb = fused_logprobs(hidden, weight, targets, bias=bias, temperature=0.6, compute_entropy=True,
                               backend="torch")  # fmt: skip
    assert a.grad_fn is None
    assert torch.allclose(a.cpu(), b, atol=1e-5) and torch.allclose(ea.cpu(), eb, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.slow
def test_triton_on_gpu_at_a_real_head_shape():
    # 2,048 tokens x Qwen-sized vocabulary x 1,024 hidden, bf16, against fp32 naive on the same inputs.
    args = _inputs(2048, 151936, 1024, seed=7)
    got = _run(fused_logprobs, *args, dtype=torch.bfloat16, device="cuda", entropy=True,
               temperature=1.0, backend="auto")  # fmt: skip
    hidden, weight, _, targets, g_logp, g_ent = args
    ref = _run(naive_logprobs, hidden.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float(), None,
               targets, g_logp, g_ent, dtype=torch.float32, device="cuda", entropy=True,
               temperature=1.0)  # fmt: skip
    _check(got, ref, atol=0.1)
    assert (got["logp"] - ref["logp"]).abs().mean().item() < 0.02
