"""Prompt prefixes' keys and values reused across generate calls (``policy.prefix_cache_mb``, issue 32).

Real agents send the same long system prompt and tool list with every request, one request at a time,
and each turn of a conversation repeats the turns before it. These tests pin that reusing what an
earlier call encoded changes no answer, that it really skips the shared tokens, and that it never
serves keys and values computed with other weights.
"""

from __future__ import annotations

import pytest
import torch

from flywheel.policy.base import SamplingParams
from flywheel.policy.prefix_cache import PrefixKVCache
from flywheel.policy.testing import make_lora_adapter, tiny_policy

SYSTEM = ("You are Wayfarer, the travel assistant of Acme Journeys. Always use the tools you are given; never "
          "invent prices, availability or forecasts. Dates are ISO 8601. Be concise. " * 2)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_hotels", "description": "Hotels with rooms.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"},
                                                                    "nights": {"type": "integer"}},
                                                     "required": ["city", "nights"]}}},
]
QUESTIONS = ["Weather in Lisbon tomorrow?", "A hotel in Oslo for 3 nights, please.", "Is it raining in Lima?",
             "Find me two nights in Riga."]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)


def _request(q: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, with tiny_home


def _one_at_a_time(pol, params=GREEDY, questions=QUESTIONS):
    return [pol.generate([_request(q)], params, tools=TOOLS)[0] for q in questions]


def _ids(groups):
    return [[s.completion_token_ids for s in g] for g in groups]


def _same(got, want, tol=1e-4):
    """The same answers with the same log-probabilities (to ``tol``): the tiny model's greedy answers are
    often alike whatever its weights, its log-probabilities are not."""
    assert _ids(got) == _ids(want)
    return all(x.logprobs == pytest.approx(y.logprobs, abs=tol)
               for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=True))


def test_requests_one_at_a_time_reuse_the_system_prompt_with_the_same_answers(tiny_home):
    off = tiny_policy(tiny_home, prefix_cache_mb=0)
    on = tiny_policy(tiny_home)
    pc = on._shared.prefix_cache
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
    want_g, want_s = _one_at_a_time(off), _one_at_a_time(off, sampled)
    got_g = _one_at_a_time(on)
    assert _same(got_g, want_g)
    # every request after the first skipped at least the system prompt and the tool list
    prompt = got_g[0][0].prompt_token_ids
    common = next(i for i, (a, b) in enumerate(zip(prompt, got_g[1][0].prompt_token_ids, strict=False)) if a != b)
    assert common > 100
    assert pc.hits >= len(QUESTIONS) - 1
    assert pc.tokens_reused >= (len(QUESTIONS) - 1) * common
    assert off._shared.prefix_cache.hits == 0 and off.prefix_tokens_saved == 0
    assert _same(_one_at_a_time(on, sampled), want_s)


def test_the_next_turn_of_a_conversation_reuses_the_whole_earlier_prompt(tiny_home):
    pol = tiny_policy(tiny_home)
    pc = pol._shared.prefix_cache
    first = _request(QUESTIONS[0])
    a = pol.generate([first], GREEDY, tools=TOOLS)[0][0]
    before = pc.tokens_reused
    second = [*first, {"role": "assistant", "content": a.text or "ok"}, {"role": "user", "content": "And in Oslo?"}]
    b = pol.generate([second], GREEDY, tools=TOOLS)[0][0]
    assert b.prompt_token_ids[: len(a.prompt_token_ids) - 1] == a.prompt_token_ids[:-1]
    assert pc.tokens_reused - before >= len(a.prompt_token_ids) - 1
    fresh = tiny_policy(tiny_home, prefix_cache_mb=0).generate([second], GREEDY, tools=TOOLS)[0]
    assert _same([[b]], [fresh])


def test_weights_written_in_place_are_never_served_stale_keys_and_values(tiny_home):
    pol = tiny_policy(tiny_home)
    pc = pol._shared.prefix_cache
    _one_at_a_time(pol, questions=QUESTIONS[:1])
    assert len(pc) == 1
    with torch.no_grad():  # an optimizer step would do this: the prompt's keys and values change
        for name, p in pol.model.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.mul_(1.7)
    hits = pc.hits
    got = _one_at_a_time(pol, questions=QUESTIONS[1:])
    assert pc.hits == hits + len(QUESTIONS) - 2  # the first request after the edit found nothing to reuse
    fresh = tiny_policy(tiny_home, prefix_cache_mb=0)
    with torch.no_grad():
        for name, p in fresh.model.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.mul_(1.7)
    assert _same(got, _one_at_a_time(fresh, questions=QUESTIONS[1:]))
    # what stale keys and values would have given: the edit moves the log-probabilities far beyond 1e-4
    unedited = _one_at_a_time(tiny_policy(tiny_home, prefix_cache_mb=0), questions=QUESTIONS[1:])
    assert _ids(got) != _ids(unedited) or not _same(got, unedited)


def test_adapter_views_and_a_merged_adapter_keep_their_own_entries(tiny_home, tmp_path):
    adapter = make_lora_adapter(tiny_home, tmp_path / "lora", seed=5)
    other = make_lora_adapter(tiny_home, tmp_path / "other", seed=6)
    pol = tiny_policy(tiny_home, adapter=adapter, merge="always")
    pol.load_adapter(other, "other", activate=False)
    view = pol.adapter_view("other")
    want_champ = _ids(_one_at_a_time(tiny_policy(tiny_home, adapter=adapter, prefix_cache_mb=0)))
    want_other = _ids(_one_at_a_time(tiny_policy(tiny_home, adapter=other, prefix_cache_mb=0)))
    assert want_champ != want_other
    got_champ, got_other = [], []
    for q in QUESTIONS:  # interleaved, as serve's requests for two models arrive
        got_champ.append(pol.generate([_request(q)], GREEDY, tools=TOOLS)[0])
        got_other.append(view.generate([_request(q)], GREEDY, tools=TOOLS)[0])
    assert _ids(got_other) == want_other
    assert _ids(got_champ) == want_champ
    assert _same(got_champ, _one_at_a_time(tiny_policy(tiny_home, adapter=adapter, merge="always",
                                                       prefix_cache_mb=0)))
    assert pol._shared.prefix_cache.hits >= len(QUESTIONS)


def test_a_reloaded_adapter_under_the_same_name_expires_the_entries(tiny_home, tmp_path):
    first = make_lora_adapter(tiny_home, tmp_path / "a", seed=7)
    second = make_lora_adapter(tiny_home, tmp_path / "b", seed=8)
    pol = tiny_policy(tiny_home, adapter=first)
    _one_at_a_time(pol, questions=QUESTIONS[:1])
    pol.load_adapter(second, "default")
    got = _one_at_a_time(pol, questions=QUESTIONS[1:2])
    assert _same(got, _one_at_a_time(tiny_policy(tiny_home, adapter=second, prefix_cache_mb=0),
                                     questions=QUESTIONS[1:2]))


def test_config_sets_the_budget_and_zero_turns_it_off(tiny_home):
    from flywheel.config import PolicyConfig
    from flywheel.policy.hf import HFPolicy

    assert PolicyConfig().prefix_cache_mb == 256
    with pytest.raises(ValueError):
        PolicyConfig(prefix_cache_mb=-1)
    cfg = PolicyConfig(base_model="tiny", device="cpu", dtype="float32", prefix_cache_mb=3)
    assert HFPolicy.from_config(cfg, "tiny", tiny_home)._shared.prefix_cache.max_bytes == 3 << 20
    pol = HFPolicy.from_config(cfg.model_copy(update={"prefix_cache_mb": 0}), "tiny", tiny_home)
    _one_at_a_time(pol, questions=QUESTIONS[:2])
    assert len(pol._shared.prefix_cache) == 0 and pol.prefix_tokens_saved == 0


# --------------------------------------------------------------------------- the cache on its own


def _cache_of(tokens: list[int], *, layers: int = 2, seed: int = 0):
    """A batch-1 DynamicCache over ``tokens`` whose values at position i depend on tokens[:i+1] only."""
    from transformers.cache_utils import DynamicCache

    g = torch.Generator().manual_seed(seed)
    table = torch.randn(1000, 4, generator=g)
    x = table[torch.tensor(tokens)].cumsum(0)  # [L, 4]: a causal function of the tokens
    kv = [(x.reshape(1, 1, len(tokens), 4) * (i + 1), x.reshape(1, 1, len(tokens), 4) - i) for i in range(layers)]
    return DynamicCache(ddp_cache_data=kv)


def test_lookup_returns_the_longest_common_prefix_cropped():
    pc = PrefixKVCache(1 << 20, min_tokens=4)
    a = list(range(10, 40))
    b = list(range(10, 30)) + [999] * 10
    assert pc.store(a, _cache_of(a), ("x", False))
    n, kv = pc.lookup(b, len(b), ("x", False))
    assert n == 20
    want = _cache_of(a[:20])
    for (k, v), layer in zip(kv, want.layers, strict=True):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    assert pc.lookup(b, 3, ("x", False)) is None  # limit below the floor
    assert pc.lookup(b, len(b), ("y", False)) is None  # other weights: no hit
    assert pc.lookup([1, 2, 3, 4, 5, 6], 6, ("x", False)) is None


def test_store_skips_covered_prefixes_replaces_extended_ones_and_keeps_the_budget():
    one = _cache_of(list(range(100)))
    per_token = sum(layer.keys.numel() * 4 * 2 for layer in one.layers) // 100
    pc = PrefixKVCache(per_token * 100, min_tokens=4)
    tag = (None, False)
    assert pc.store(list(range(40)), _cache_of(list(range(40))), tag)
    assert not pc.store(list(range(20)), _cache_of(list(range(20))), tag)  # covered by the first
    assert pc.store(list(range(60)), _cache_of(list(range(60))), tag)  # extends it: replaces it
    assert len(pc) == 1 and pc.bytes == 60 * per_token
    assert pc.store([500 + i for i in range(30)], _cache_of([500 + i for i in range(30)]), tag)
    assert len(pc) == 2 and pc.bytes == 90 * per_token
    pc.lookup(list(range(60)), 60, tag)  # the 60-token entry is now the most recently used
    assert pc.store([700 + i for i in range(30)], _cache_of([700 + i for i in range(30)]), tag)
    assert pc.bytes <= pc.max_bytes and len(pc) == 2
    assert pc.lookup([500 + i for i in range(30)], 30, tag) is None  # the least recently used went
    assert pc.lookup(list(range(60)), 60, tag) is not None
    n_before, bytes_before = len(pc), pc.bytes
    # larger than the budget, and extending a stored entry: refused without evicting anything for it
    assert not pc.store(list(range(200)), _cache_of(list(range(200))), tag)
    assert (len(pc), pc.bytes) == (n_before, bytes_before)
    assert pc.lookup(list(range(60)), 60, tag) is not None


def test_weight_state_changes_empty_the_cache():
    model = torch.nn.Linear(2, 2)
    pc = PrefixKVCache(1 << 20, min_tokens=4)
    pc.sync(model, 0)
    pc.store(list(range(10)), _cache_of(list(range(10))), (None, False))
    pc.sync(model, 0)
    assert len(pc) == 1
    pc.sync(model, 1)  # the policy says its weights changed
    assert len(pc) == 0
    pc.store(list(range(10)), _cache_of(list(range(10))), (None, False))
    with torch.no_grad():
        model.weight.add_(1.0)  # written in place
    pc.sync(model, 1)
    assert len(pc) == 0
    pc.store(list(range(10)), _cache_of(list(range(10))), (None, False))
    model.to(torch.float64)  # cast: new tensors through .data, versions untouched
    pc.sync(model, 1)
    assert len(pc) == 0


def test_a_sliding_window_cache_turns_the_cache_off():
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=8)]
    cache.layers[0].update(torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4))
    pc = PrefixKVCache(1 << 20, min_tokens=4)
    assert not pc.store(list(range(10)), cache, (None, False))
    assert not pc.enabled
    assert pc.lookup(list(range(10)), 10, (None, False)) is None
