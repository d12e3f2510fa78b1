"""``train.lora_layers``: LoRA on the top N transformer blocks only, so the backward stops at the lowest
adapted block (issue 32, build item 2). A measured option, not a default: these tests pin what it does
(which blocks carry an adapter, where autograd stops, the loss at init, saving and reloading), not whether
it learns as well as every block (benchmarks/bench_lora_layers.py measures its cost only)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from test_trainer import batch, tiny_lm

from flywheel.config import TrainConfig
from flywheel.policy.models import TINY, load_model
from flywheel.policy.testing import session_tiny_home, tiny_policy
from flywheel.train.trainer import Trainer, TrainerOptions, apply_lora

BLOCKS = 4


def _adapted(model) -> dict[int, set[str]]:
    """Block index -> names of the linear layers in it that carry LoRA weights."""
    out: dict[int, set[str]] = {}
    for n, _ in model.named_parameters():
        if "lora_A" in n:
            parts = n.split(".")
            i = parts.index("layers")
            out.setdefault(int(parts[i + 1]), set()).add(parts[parts.index("lora_A") - 1])
    return out


def _trainer(model, layers, **kw) -> Trainer:
    tc = TrainConfig(lora_r=4, lora_alpha=8, lora_layers=layers, micro_batch_tokens=1000, warmup_steps=0, **kw)
    return Trainer(model, TrainerOptions(objective="sft", lr=1e-2, total_steps=4, temperature=1.0,
                                         max_completion_len=16, train=tc))


def test_only_the_top_blocks_get_lora_and_the_same_layers_as_all_linear():
    full = _adapted(apply_lora(tiny_lm(seed=1, layers=BLOCKS), r=4, alpha=8))
    top = _adapted(apply_lora(tiny_lm(seed=1, layers=BLOCKS), r=4, alpha=8, layers=2))
    assert sorted(full) == [0, 1, 2, 3] and sorted(top) == [2, 3]
    assert all(top[i] == full[i] for i in top)  # all-linear, expanded by name, adapts what peft's rule adapts
    assert full[3] >= {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for n in (BLOCKS, BLOCKS + 5):  # at least every block: today's adapter, config included
        m = apply_lora(tiny_lm(seed=1, layers=BLOCKS), r=4, alpha=8, layers=n)
        assert _adapted(m) == full and m.peft_config["default"].layers_to_transform is None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_backward_never_reaches_the_blocks_below_the_adapter(checkpointing):
    """One SFT step: the lower blocks' outputs carry no grad_fn (autograd recorded nothing there) and a
    backward hook on them never fires, while every top-block LoRA B gets a non-zero gradient. Without
    the option the same hooks see a graph through block 0 (so the check can tell the difference)."""

    def run(layers):
        tr = _trainer(tiny_lm(seed=2, layers=BLOCKS), layers, gradient_checkpointing=checkpointing)
        base = tr.policy.get_base_model().model
        tracked, backward = {}, set()
        handles = [base.embed_tokens.register_forward_hook(
            lambda m, a, out: tracked.__setitem__("embed", out.requires_grad))]
        for i, block in enumerate(base.layers):
            def fwd(m, a, out, i=i):
                h = out[0] if isinstance(out, tuple) else out
                tracked[i] = tracked.get(i, False) or h.grad_fn is not None
            handles.append(block.register_forward_hook(fwd))
            handles.append(block.register_full_backward_hook(lambda m, gi, go, i=i: backward.add(i)))
        grads: dict[str, float] = {}
        for n, p in tr.policy.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p, n=n: grads.__setitem__(n, grads.get(n, 0.0) + float(p.grad.abs().sum())))
        tr.step(batch(seed=3))
        for h in handles:
            h.remove()
        return tracked, backward, grads

    tracked, backward, grads = run(2)
    assert tracked == {"embed": False, 0: False, 1: False, 2: True, 3: True}
    assert backward == {2, 3}
    b = {n: g for n, g in grads.items() if "lora_B" in n}
    assert b and all(".layers.2." in n or ".layers.3." in n for n in grads)
    assert all(g > 0 for g in b.values()), b
    tracked_all, backward_all, grads_all = run(None)
    assert tracked_all[0] and backward_all >= {1, 2, 3}
    # no input-grad hook on the embeddings with every block either (transformers adds one with gradient
    # checkpointing; the trainer removes it), and block 0's adapter still learns without it
    assert not tracked_all["embed"]
    b_all = {n: g for n, g in grads_all.items() if "lora_B" in n}
    assert any(".layers.0." in n for n in b_all) and all(g > 0 for g in b_all.values()), b_all


def test_loss_at_init_equals_the_all_blocks_adapter():
    """LoRA B starts at zero, so before the first update both adapters are the base model."""
    samples = batch(seed=4)
    top = _trainer(tiny_lm(seed=5, layers=BLOCKS), 1).step(samples)
    every = _trainer(tiny_lm(seed=5, layers=BLOCKS), None).step(samples)
    assert top.loss == pytest.approx(every.loss, rel=1e-6, abs=1e-7)
    assert top.stats["nll"] == pytest.approx(every.stats["nll"], rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    return session_tiny_home(tmp_path_factory)


def test_a_saved_partial_adapter_reloads_merges_and_refreshes_to_the_same_logits(tiny_home, tmp_path):
    model, _ = load_model(TINY, home=tiny_home, device="cpu", dtype="float32")
    tr = _trainer(model, 1, lean_layers=False)
    with torch.no_grad():  # visible adapter weights (one SFT step on a random model moves B very little)
        g = torch.Generator().manual_seed(6)
        for n, p in tr.policy.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3, generator=g)
    out = tr.save(tmp_path / "adapter")
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["layers_to_transform"] == [1] and saved["layers_pattern"] == "layers"
    trained = tr.policy.eval()
    ids = torch.tensor([[1, 17, 230, 5, 99, 42, 7, 301]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        base = tiny_policy(tiny_home).model(input_ids=ids).logits
        assert not torch.allclose(want, base, atol=1e-3)  # the adapter changes the logits at all

        loaded = tiny_policy(tiny_home, adapter=out)
        assert sorted(_adapted(loaded.model)) == [1]
        assert torch.equal(loaded.model(input_ids=ids).logits, want)

        merged = tiny_policy(tiny_home, adapter=out, merge="auto")
        assert merged.merged
        torch.testing.assert_close(merged.model(input_ids=ids).logits, want, atol=1e-4, rtol=1e-5)

        refreshed = tiny_policy(tiny_home)
        refreshed.set_weights_from(trained)  # the in-process refresh between GRPO iterations
        assert sorted(_adapted(refreshed.model)) == [1]
        assert torch.equal(refreshed.model(input_ids=ids).logits, want)

    # training on from the registered version keeps its layers, whatever lora_layers says now
    again, _ = load_model(TINY, home=tiny_home, device="cpu", dtype="float32", adapter=out)
    cont = _trainer(again, None)
    assert {n.split(".layers.")[1].split(".")[0] for n, p in cont.policy.named_parameters() if p.requires_grad} == {"1"}


def test_the_config_refuses_zero_blocks():
    with pytest.raises(ValidationError, match="train.lora_layers must be at least 1"):
        TrainConfig(lora_layers=0)
    with pytest.raises(ValueError, match=">= 1"):
        apply_lora(tiny_lm(layers=2), r=4, alpha=8, layers=0)
    assert TrainConfig().lora_layers is None  # the default adapts every block
