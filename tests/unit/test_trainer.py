"""Trainer mechanics on tiny models: log-prob paths, packing, accumulation, LoRA, DeepSpeed ZeRO-1."""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from flywheel.config import ObjectiveConfig, TrainConfig
from flywheel.train.data import TrainSample, make_micro_batches
from flywheel.train.trainer import (
    Trainer,
    TrainerOptions,
    cosine_with_warmup,
    sequence_logprobs,
)

V = 32


def tiny_lm(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def batch(seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c) in enumerate([(3, 5), (6, 2), (2, 7), (4, 4)]):
        out.append(
            TrainSample(
                prompt_ids=torch.randint(1, V, (p,), generator=g).tolist(),
                completion_ids=torch.randint(1, V, (c,), generator=g).tolist(),
                loss_mask=[1] * (c - 1) + [0],  # last token an "observation": no loss
                advantage=[1.0, -0.5, 0.25, -0.75][i],
                group_id=f"g{i // 2}",
            )
        )
    return out


def reference_logprobs(model, s: TrainSample) -> torch.Tensor:
    """Full forward of one unpadded sequence, log_softmax, gather: the oracle."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0].float()
    p = len(s.prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1], -1)
    return lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("impl", ["fused", "naive"])
def test_micro_batch_logprobs_match_per_sequence_forward(packing, impl):
    # Padded rows (right padding, no mask: causal attention never reaches it) and packed rows
    # (restarting position ids, no mask) must both reproduce each sequence's own forward pass: no
    # attention to padding, no cross-sequence attention in packing.
    model = tiny_lm()
    samples = batch()
    padded_rows = 0
    with torch.no_grad():
        for mb in make_micro_batches(samples, token_budget=24, packing=packing):
            assert mb.attention_mask is None and mb.n_tokens == sum(len(s) for s in mb.samples)
            padded_rows += sum(len(s) < mb.input_ids.shape[1] for s in mb.samples) if not packing else 0
            logp, _ = sequence_logprobs(model, mb, impl=impl)
            for k, s in enumerate(mb.samples):
                torch.testing.assert_close(logp[k, : len(s.completion_ids)], reference_logprobs(model, s), atol=2e-5, rtol=1e-5)
    assert packing or padded_rows > 0  # the padded case really had padding


def test_token_budget_is_respected():
    samples = batch()
    for packing in (False, True):
        mbs = make_micro_batches(samples, token_budget=16, packing=packing)
        assert sum(len(mb.samples) for mb in mbs) == 4
        for mb in mbs:
            assert mb.input_ids.numel() <= 16 or len(mb.samples) == 1


def _grads_after_one_step(objective: str, budget: int) -> dict[str, torch.Tensor]:
    model = tiny_lm()
    tr = Trainer(model, TrainerOptions(objective=objective, lr=1e-3,
                                       train=TrainConfig(lora_r=0, micro_batch_tokens=budget, grad_clip=1e9)))
    captured = {}
    orig = tr.optimizer.step

    def capture(*a, **kw):
        for n, p in tr.model.named_parameters():
            captured[n] = p.grad.detach().clone()
        return orig(*a, **kw)

    tr.optimizer.step = capture
    tr.step(batch())
    return captured


@pytest.mark.parametrize("objective", ["dapo", "sft"])
def test_gradient_accumulation_reproduces_the_full_batch_gradient(objective):
    # One micro-batch holding all 4 sequences vs. 4 micro-batches of one: the global normaliser makes
    # the accumulated gradient the same (round-off only). Temperature 1, on-policy: A * grad logp / N.
    g_full = _grads_after_one_step(objective, 10_000)
    g_split = _grads_after_one_step(objective, 8)
    for n in g_full:
        torch.testing.assert_close(g_split[n], g_full[n], atol=1e-6, rtol=1e-4)


def test_lora_changes_adapter_weights_only():
    model = tiny_lm()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = Trainer(model, TrainerOptions(objective="dapo", lr=1e-2, total_steps=3,
                                       train=TrainConfig(lora_r=4, lora_alpha=8, warmup_steps=0)))
    lora_before = {n: p.detach().clone() for n, p in tr.policy.named_parameters() if "lora_" in n}
    assert lora_before, "no LoRA parameters were created"
    for _ in range(3):
        tr.step(batch())
    changed = [n for n, p in tr.policy.named_parameters() if "lora_" in n and not torch.equal(p, lora_before[n])]
    # LoRA B starts at zero, A is random: after 3 steps both move (B first, then A through B).
    assert len(changed) == len(lora_before), "some LoRA weights did not move"
    base_after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
                  for n, p in tr.policy.named_parameters() if "lora_" not in n}
    for n, before in base_before.items():
        assert torch.equal(base_after[n], before), f"base weight {n} changed under LoRA"


def test_full_finetune_changes_every_weight():
    model = tiny_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-2, total_steps=2, train=TrainConfig(lora_r=0, warmup_steps=0)))
    tr.step(batch())
    tr.step(batch())
    for n, p in tr.policy.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change"


def test_schedule_warmup_then_cosine():
    # warmup 2: (0+1)/3, (1+1)/3; then cosine from 1 at step 2 to 0 at step 10, 0.5 halfway (step 6).
    f = [cosine_with_warmup(s, warmup=2, total=10) for s in range(11)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3)
    assert f[2] == pytest.approx(1.0) and f[6] == pytest.approx(0.5) and f[10] == pytest.approx(0.0)


def test_beta_with_lora_uses_the_disabled_adapter_as_reference():
    tr = Trainer(tiny_lm(), TrainerOptions(objective="dapo", lr=5e-2, total_steps=4, train=TrainConfig(
        lora_r=4, warmup_steps=0, objective=ObjectiveConfig(beta=0.1))))
    m0 = tr.step(batch())
    assert m0.stats["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B = 0: policy == reference
    tr.step(batch())
    m2 = tr.step(batch())
    assert m2.stats["kl"] > 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_deepspeed_zero1_on_cpu_matches_plain_step(monkeypatch):
    pytest.importorskip("deepspeed")
    from pathlib import Path

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    cfg = Path(__file__).resolve().parents[2] / "infra" / "deepspeed" / "zero1.json"
    plain = Trainer(tiny_lm(), TrainerOptions(objective="dapo", lr=1e-2,
                                              train=TrainConfig(lora_r=0, micro_batch_tokens=8, warmup_steps=0)))
    ds = Trainer(tiny_lm(), TrainerOptions(objective="dapo", lr=1e-2, train=TrainConfig(
        lora_r=0, micro_batch_tokens=8, warmup_steps=0, deepspeed=str(cfg))))
    assert ds.engine is not None and ds.engine.zero_optimization_stage() == 1
    mp, md = plain.step(batch()), ds.step(batch())
    # Same data, same init, same optimizer: the same update (ZeRO-1 with one rank shards nothing).
    assert md.loss == pytest.approx(mp.loss, abs=1e-6)
    assert md.grad_norm == pytest.approx(mp.grad_norm, rel=1e-4)
    for (n, a), (_, b) in zip(plain.policy.named_parameters(), ds.policy.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=n)


def test_adamw_uses_the_fused_kernel_on_cpu_and_matches_the_default_path():
    from flywheel.train.trainer import make_adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(17, 5)), torch.nn.Parameter(torch.randn(3))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused = make_adamw(a, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    plain = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    for step in range(5):
        for ps, opt in ((a, fused), (b, plain)):
            opt.zero_grad(set_to_none=True)
            loss = sum(((p * (step + 1)) ** 2).sum() for p in ps)
            loss.backward()
            opt.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _lora_trainer(model, *, total: int, offset: int = 0, state=None) -> Trainer:
    return Trainer(model, TrainerOptions(objective="sft", lr=2e-2, total_steps=total, schedule_offset=offset,
                                         train=TrainConfig(lora_r=4, lora_alpha=8, warmup_steps=1)),
                   optimizer_state=state)


def _adapter(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.policy.named_parameters() if "lora_" in n}


def test_a_phase_that_resumes_the_schedule_and_the_optimizer_continues_one_run_exactly():
    """Issue 30 (train.schedule = one_run): the learning stage's first pass, trial and continuation are
    separate trainers; with the schedule offset and AdamW's state carried over, 3 + 2 steps are the same
    run as 5 steps in one trainer. Restarting both (the per_phase behaviour) gives another model."""
    data = [batch(i) for i in range(5)]
    one = _lora_trainer(tiny_lm(), total=5)
    lrs_one = [one.step(b).lr for b in data]

    a = _lora_trainer(tiny_lm(), total=5)
    lrs = [a.step(b).lr for b in data[:3]]
    b = _lora_trainer(a.policy, total=5, offset=3, state=a.optimizer_state())
    lrs += [b.step(x).lr for x in data[3:]]
    assert lrs == pytest.approx(lrs_one) and lrs_one[3] < lrs_one[1]  # one decay, no second warm-up
    want, got = _adapter(one), _adapter(b)
    assert want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)

    r = _lora_trainer(tiny_lm(), total=3)
    for x in data[:3]:
        r.step(x)
    restarted = _lora_trainer(r.policy, total=2)  # a fresh schedule and fresh AdamW moments
    restarted.step(data[3])
    restarted.step(data[4])
    assert any(not torch.allclose(p, want[n], atol=1e-4) for n, p in _adapter(restarted).items())


def test_an_optimizer_state_of_another_adapter_is_refused_by_name():
    a = _lora_trainer(tiny_lm(), total=2)
    a.step(batch())
    other = Trainer(tiny_lm(), TrainerOptions(objective="sft", lr=1e-2, total_steps=2,
                                              train=TrainConfig(lora_r=8, lora_alpha=16)))
    with pytest.raises(ValueError, match="optimizer_state does not fit"):
        Trainer(other.policy, TrainerOptions(objective="sft", lr=1e-2, total_steps=2,
                                             train=TrainConfig(lora_r=8, lora_alpha=16)),
                optimizer_state=a.optimizer_state())


def test_two_trainers_resumed_from_one_optimizer_state_do_not_share_its_moments():
    """The learning stage resumes the control's and the targeted arm's trials from the first pass's one
    state: training the first must leave that state as it was (torch's load_state_dict keeps tensors of
    the same dtype and device, and AdamW updates them in place)."""
    a = _lora_trainer(tiny_lm(), total=5)
    a.step(batch())
    state = a.optimizer_state()
    before = copy.deepcopy(state)
    b = _lora_trainer(a.policy, total=5, offset=1, state=state)
    b.step(batch(1))
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(state["state"][pid][k], v), f"param {pid} {k} changed under the caller"
