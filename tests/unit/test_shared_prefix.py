"""``train.share_prompt_prefix``: the prefix a micro-batch's sequences share is encoded once, and the
log-probs, losses and gradients are those of one forward per sequence (issue 32: agents send the same
system prompt and tool list with every request; the demo's BFCL prompts share the chat template)."""

from __future__ import annotations

import pytest
import torch
from test_trainer import V, reference_logprobs, tiny_lm

from flywheel.config import TrainConfig
from flywheel.train.data import TrainSample, common_prefix_len, make_micro_batches
from flywheel.train.trainer import PreferenceSample, Trainer, TrainerOptions, apply_lora, sequence_logprobs


def shared_batch(seed: int = 0, shared: int = 12) -> list[TrainSample]:
    """Four sequences that start with the same ``shared`` tokens (a system prompt), then differ."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, V, (shared,), generator=g).tolist()
    out = []
    for i, (p, c) in enumerate([(5, 4), (2, 6), (9, 3), (1, 5)]):
        out.append(TrainSample(
            prompt_ids=head + torch.randint(1, V, (p,), generator=g).tolist(),
            completion_ids=torch.randint(1, V, (c,), generator=g).tolist(),
            loss_mask=[1] * (c - 1) + [0],
            advantage=[1.0, -0.5, 0.25, -0.75][i],
            group_id=f"g{i}",
        ))
    return out


def test_common_prefix_stops_before_the_shortest_prompts_last_token():
    samples = shared_batch(shared=12)
    # The last sample's prompt is the 12 shared tokens + 1: the trunk may take 12 of its 13 tokens.
    assert common_prefix_len(samples) == 12
    whole = TrainSample(prompt_ids=samples[0].prompt_ids[:12], completion_ids=[3, 4], loss_mask=[1, 1])
    # A prompt that is the shared prefix itself: its last token must stay in the row, to predict the answer.
    assert common_prefix_len([*samples, whole]) == 11
    assert common_prefix_len([samples[0]]) == len(samples[0].prompt_ids) - 1


@pytest.mark.parametrize("impl", ["fused", "naive"])
def test_shared_prefix_logprobs_equal_each_sequences_own_forward(impl):
    model = tiny_lm(seed=1)
    samples = shared_batch(seed=2)
    with torch.no_grad():
        mbs = make_micro_batches(samples, token_budget=1000, share_prefix=True)
        assert len(mbs) == 1 and mbs[0].trunk_ids is not None and mbs[0].trunk_ids.shape == (1, 12)
        mb = mbs[0]
        # The rows hold only what follows the trunk; the trunk is encoded once.
        assert mb.input_ids.shape[1] == max(len(s) for s in samples) - 12
        assert mb.n_encoded == 12 + 4 * mb.input_ids.shape[1] < sum(len(s) for s in samples)
        assert mb.n_tokens == sum(len(s) for s in samples)  # the data trained on, as without sharing
        assert mb.n_computed == mb.n_tokens - 3 * 12  # the trunk counted once, padding excluded
        logp, _ = sequence_logprobs(model, mb, impl=impl)
        for k, s in enumerate(mb.samples):
            torch.testing.assert_close(logp[k, : len(s.completion_ids)], reference_logprobs(model, s),
                                       atol=2e-5, rtol=1e-5)


def test_no_trunk_below_min_shared_or_with_packing():
    samples = shared_batch(shared=5)
    assert all(mb.trunk_ids is None for mb in make_micro_batches(samples, token_budget=1000, share_prefix=True,
                                                                  min_shared=8))
    assert all(mb.trunk_ids is None for mb in make_micro_batches(shared_batch(), token_budget=1000, packing=True,
                                                                  share_prefix=True))


def test_budget_counts_the_trunk_once():
    """Eight sequences of 12 shared + at most 14 own tokens: without sharing a 120-token budget holds
    four padded rows of 26; with sharing 12 + 7 rows of 14 = 110 fit in one."""
    samples = shared_batch(seed=3) + shared_batch(seed=3)
    plain = make_micro_batches(samples, token_budget=120)
    shared = make_micro_batches(samples, token_budget=120, share_prefix=True)
    assert len(shared) < len(plain)
    for mb in shared:
        assert mb.n_encoded <= 120


def test_rows_attending_over_repeated_trunks_stay_within_a_multiple_of_the_budget():
    """A long shared prompt with short answers: the budget alone (trunk once + rows) would take every row,
    but each row attends over its own copy of the trunk's keys and values; SHARED_KV_FACTOR bounds those."""
    from flywheel.train.data import SHARED_KV_FACTOR

    g = torch.Generator().manual_seed(11)
    head = torch.randint(1, V, (40,), generator=g).tolist()
    samples = [TrainSample(prompt_ids=head + [1 + i % (V - 1), 2], completion_ids=[3, 4], loss_mask=[1, 1])
               for i in range(40)]
    for budget in (200, 400):
        mbs = make_micro_batches(samples, token_budget=budget, share_prefix=True)
        assert all(mb.trunk_ids is not None for mb in mbs)
        for mb in mbs:
            L = int(mb.trunk_ids.shape[1])
            assert mb.n_encoded <= budget
            assert len(mb.samples) * (L + mb.input_ids.shape[1]) <= SHARED_KV_FACTOR * budget
        assert sum(len(mb.samples) for mb in mbs) == 40
    # 40 rows of 3 after a 41-token trunk: 161 positions fit a budget of 200, but 40 x 44 = 1,760 key/value
    # positions exceed 4 x 200, so the rows are split
    assert len(make_micro_batches(samples, token_budget=200, share_prefix=True)) > 1


def _lora(seed: int):
    model = apply_lora(tiny_lm(seed=seed), r=4, alpha=8)
    for n, p in model.named_parameters():  # peft zero-inits B: give it values so A gets a gradient
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    return model


def test_shared_prefix_gradient_equals_the_per_sequence_gradient():
    """Backward through the repeated trunk keys and values sums every row's contribution: the LoRA
    gradient is the padded path's, including the adapters of the layers' key and value projections,
    which the trunk positions reach only through the rows' attention."""
    samples = shared_batch(seed=4)

    def grads(share: bool):
        model = _lora(seed=6)
        (mb,) = make_micro_batches(samples, token_budget=1000, share_prefix=share)
        assert (mb.trunk_ids is not None) == share
        logp, _ = sequence_logprobs(model, mb)
        (-(logp * mb.mask).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, shared = grads(False), grads(True)
    assert set(plain) == set(shared) and any("k_proj" in n for n in plain)
    for n in plain:
        torch.testing.assert_close(shared[n], plain[n], atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_trainer_steps_are_the_same_with_and_without_sharing(objective):
    def run(share: bool) -> list[tuple[float, float]]:
        tc = TrainConfig(lora_r=4, lora_alpha=8, share_prompt_prefix=share, micro_batch_tokens=64, warmup_steps=0,
                         lean_layers=False)
        tr = Trainer(tiny_lm(seed=7), TrainerOptions(objective=objective, lr=1e-2, total_steps=4, temperature=1.0,
                                                     max_completion_len=16, train=tc))
        out = []
        for k in range(3):
            shared_trunks[str(share)] += sum(mb.trunk_ids is not None for mb in tr.micro_batches(shared_batch(seed=10 + k)))
            m = tr.step(shared_batch(seed=10 + k))
            out.append((m.loss, m.grad_norm))
        return out

    shared_trunks = {"False": 0, "True": 0}

    plain, shared = run(False), run(True)
    assert shared_trunks["False"] == 0 and shared_trunks["True"] > 0  # the shared arm really shared
    for (la, ga), (lb, gb) in zip(plain, shared, strict=True):
        assert lb == pytest.approx(la, rel=1e-4, abs=1e-6)
        assert gb == pytest.approx(ga, rel=1e-3, abs=1e-6)


def test_preference_pairs_share_their_prompt():
    """A pair's chosen and rejected answers continue one prompt: one trunk, the same DPO log-probs."""
    a, b = shared_batch(seed=8)[:2]
    pair = PreferenceSample(chosen=a, rejected=TrainSample(prompt_ids=a.prompt_ids, completion_ids=b.completion_ids,
                                                            loss_mask=b.loss_mask), group_id="p0")

    def logps(share: bool):
        tc = TrainConfig(lora_r=4, lora_alpha=8, share_prompt_prefix=share, lean_layers=False)
        tr = Trainer(tiny_lm(seed=9), TrainerOptions(objective="rpo", lr=1e-3, total_steps=1, temperature=1.0,
                                                     max_completion_len=16, train=tc))
        (mb,) = tr.micro_batches([pair.chosen, pair.rejected])
        assert (mb.trunk_ids is not None) == share
        if share:
            assert mb.trunk_ids.shape[1] == len(a.prompt_ids) - 1
        with torch.no_grad():
            c, r, _, _ = tr._pair_logps(tr.model, [pair])
        return float(c[0]), float(r[0])

    assert logps(True) == pytest.approx(logps(False), rel=1e-5, abs=1e-5)


def test_models_whose_cache_or_rope_differs_across_calls_do_not_share():
    """Dynamic RoPE picks its frequencies from the longest position in each call, so the trunk's keys and the
    rows' would be rotated differently; activation checkpointing drops the KV cache in training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    torch.manual_seed(0)
    tc = TrainConfig(lora_r=4, lora_alpha=8, lean_layers=False)
    opts = TrainerOptions(objective="sft", lr=1e-3, total_steps=1, temperature=1.0, max_completion_len=16, train=tc)
    assert not Trainer(LlamaForCausalLM(cfg), opts).shares_prefix
    checkpointed = tiny_lm(seed=0)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not Trainer(checkpointed, opts).shares_prefix
    assert Trainer(tiny_lm(seed=0), opts).shares_prefix  # "auto" on CPU
    assert not Trainer(tiny_lm(seed=0), TrainerOptions(
        objective="sft", lr=1e-3, total_steps=1, temperature=1.0, max_completion_len=16,
        train=TrainConfig(lora_r=4, lora_alpha=8, lean_layers=False, share_prompt_prefix=False))).shares_prefix


def test_sliding_window_models_do_not_share():
    """A sliding-window layer's cache keeps only the window: the trainer keeps one forward per sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)
    torch.manual_seed(0)
    tc = TrainConfig(lora_r=4, lora_alpha=8, share_prompt_prefix=True, lean_layers=False)
    tr = Trainer(MistralForCausalLM(cfg), TrainerOptions(objective="sft", lr=1e-3, total_steps=1, temperature=1.0,
                                                         max_completion_len=16, train=tc))
    assert all(mb.trunk_ids is None for mb in tr.micro_batches(shared_batch()))
    tc = TrainConfig(lora_r=4, lora_alpha=8, share_prompt_prefix=True, lean_layers=False)
    tr = Trainer(tiny_lm(seed=0), TrainerOptions(objective="sft", lr=1e-3, total_steps=1, temperature=1.0,
                                                 max_completion_len=16, train=tc))
    assert all(mb.trunk_ids is not None for mb in tr.micro_batches(shared_batch()))


def test_rows_that_did_not_run_on_the_trunk_raise():
    """Activation checkpointing in training makes transformers drop the KV cache (with a warning only): the
    rows would run without the trunk. sequence_logprobs checks the cache grew by the rows and refuses."""
    model = tiny_lm(seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    (mb,) = make_micro_batches(shared_batch(), token_budget=1000, share_prefix=True)
    with pytest.raises(RuntimeError, match="did not run on the trunk"):
        sequence_logprobs(model, mb)
