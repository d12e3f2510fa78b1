"""The decode loop's keys and values written in place (``flywheel.policy.kv_cache``, issue 32).

transformers' ``DynamicLayer`` copies every layer's whole cache each step to append one position;
``PreallocatedLayer`` writes it in place. These tests pin that nothing a caller can see changes: the
layer's contents after any sequence of the operations the decode loop uses, and the policy's answers
and log-probabilities bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from flywheel.policy.base import SamplingParams
from flywheel.policy.kv_cache import PreallocatedLayer, preallocated_cache, supports_preallocated
from flywheel.policy.testing import tiny_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, with tiny_home


def _kv(b: int, t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


@pytest.mark.parametrize("capacity", [0, 5, 64])  # 0 and 5: the buffers must grow; 64: room for everything
def test_the_layer_holds_what_a_dynamic_layer_holds_through_the_decode_loops_operations(capacity):
    g = torch.Generator().manual_seed(0)
    ref, new = DynamicLayer(), PreallocatedLayer(capacity)

    def both(op, *args):
        for layer in (ref, new):
            out = getattr(layer, op)(*args)
        return out

    def check():
        assert new.get_seq_length() == ref.get_seq_length()
        assert torch.equal(new.keys, ref.keys) and torch.equal(new.values, ref.values)

    k, v = _kv(1, 7, g)  # a shared prefix, encoded for one row
    ka, va = ref.update(k, v)
    kb, vb = new.update(k, v)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    check()
    both("batch_repeat_interleave", 3)  # fanned out to three prompts
    check()
    k, v = _kv(3, 4, g)  # each row's own tail
    both("update", k, v)
    check()
    both("batch_repeat_interleave", 2)  # two samples per prompt
    check()
    for step in range(12):  # decode steps, rows finishing on the way
        k, v = _kv(ref.keys.shape[0], 1, g)
        ka, va = ref.update(k, v)
        kb, vb = new.update(k, v)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        if step in (3, 8) and ref.keys.shape[0] > 1:
            keep = torch.arange(0, ref.keys.shape[0], 2)
            both("batch_select_indices", keep)
        check()
    both("crop", -3)
    check()
    k, v = _kv(ref.keys.shape[0], 2, g)
    both("update", k, v)
    check()


def test_a_step_writes_in_place_instead_of_copying_the_cache():
    layer = PreallocatedLayer(32)
    g = torch.Generator().manual_seed(1)
    layer.update(*_kv(4, 10, g))
    base = layer.keys.untyped_storage().data_ptr()
    for _ in range(20):
        layer.update(*_kv(4, 1, g))
    assert layer.keys.untyped_storage().data_ptr() == base  # no step reallocated the buffer
    ref = DynamicLayer()
    ref.update(*_kv(4, 10, g))
    before = ref.keys.untyped_storage().data_ptr()
    ref.update(*_kv(4, 1, g))
    assert ref.keys.untyped_storage().data_ptr() != before  # what the in-place layer avoids


def test_a_batch_of_the_wrong_width_is_refused_even_when_the_buffer_must_grow():
    g = torch.Generator().manual_seed(2)
    for capacity in (8, 3):  # 3: the second update needs a larger buffer, whose copy would broadcast one row
        layer = PreallocatedLayer(capacity)
        layer.update(*_kv(1, 3, g))
        with pytest.raises(ValueError, match="3 rows given to a cache of 1"):
            layer.update(*_kv(3, 1, g))


def test_growth_stops_at_the_longest_the_generation_can_get():
    g = torch.Generator().manual_seed(3)
    layer = PreallocatedLayer(12, max_capacity=15)
    layer.update(*_kv(2, 10, g))
    for _ in range(5):
        layer.update(*_kv(2, 1, g))
    assert layer._kbuf.shape[-2] == 15  # doubling would have made 24
    layer.update(*_kv(2, 2, g))  # past the bound: exactly what is needed
    assert layer._kbuf.shape[-2] == 17 and layer.get_seq_length() == 17


def test_only_full_attention_models_get_it():
    from transformers import LlamaConfig, MistralConfig

    class M:
        def __init__(self, config):
            self.config = config

    assert supports_preallocated(M(LlamaConfig(num_hidden_layers=2)))
    assert not supports_preallocated(M(MistralConfig(num_hidden_layers=2, sliding_window=8)))
    assert not supports_preallocated(object())
    cache = preallocated_cache(16)
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    assert isinstance(cache.layers[0], PreallocatedLayer) and cache.get_seq_length() == 3


PROMPTS = [
    [{"role": "system", "content": "You are a terse assistant. Answer in one line. " * 4},
     {"role": "user", "content": q}]
    for q in ("hi", "What is the capital of France, and why?", "Count to three.", "Call get_weather for Oslo.")
]


@pytest.mark.parametrize("params", [
    SamplingParams(n=1, temperature=0.0, max_new_tokens=14),
    SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5),
    # near-uniform samples of the random tiny model hit a common letter at different steps: rows finish
    # one by one, and each finish drops a row from the cache (batch_select_indices)
    SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=9, stop=["e", "a"]),
], ids=["greedy", "sampled", "rows-finish-apart"])
@pytest.mark.parametrize("headroom", [256, 3], ids=["room", "grows"])
def test_answers_and_log_probs_are_bit_identical_to_the_dynamic_cache(tiny_home, params, headroom, monkeypatch):
    import flywheel.policy.hf as hf

    monkeypatch.setattr(hf, "KV_HEADROOM", headroom)  # 3: the buffers must grow during the decode
    pol = tiny_policy(tiny_home, prefix_cache_mb=0)
    pol.preallocate_kv = False
    want = pol.generate(PROMPTS, params)
    pol.preallocate_kv = True
    got = pol.generate(PROMPTS, params)
    lengths = set()
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.completion_token_ids == y.completion_token_ids
            assert x.logprobs == y.logprobs  # exactly: the same numbers reach the same kernels
            lengths.add(len(x.completion_token_ids))
    if params.stop:
        assert len(lengths) > 2, lengths
    single = pol.generate(PROMPTS[1:2], params)  # one prompt, no shared prefix
    pol.preallocate_kv = False
    assert [s.logprobs for s in single[0]] == [s.logprobs for s in pol.generate(PROMPTS[1:2], params)[0]]
