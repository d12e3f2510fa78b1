"""A LoRA version folded into float32 weights answers exactly as the unmerged adapter (issue 32).

The gate and ``flywheel serve`` load registered LoRA versions through
:func:`flywheel.policy.registry.load_policy_for_version`, which folds the adapter into the base weights
when they are float32 (``policy.merge_adapters = "auto"``); these tests pin what that may change: nothing
a greedy answer can see.
"""

from __future__ import annotations

import pytest
import torch

from flywheel.policy.base import SamplingParams
from flywheel.policy.hf import should_merge
from flywheel.policy.testing import make_lora_adapter, tiny_policy

PROMPTS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France, and why?"}],
    [{"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": "Call get_weather for Tel Aviv, Israel."}],
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, with tiny_home


def test_merged_fp32_adapter_gives_identical_greedy_answers_and_close_logits(tiny_home, tmp_path):
    adapter = make_lora_adapter(tiny_home, tmp_path / "lora", seed=3)
    plain = tiny_policy(tiny_home, adapter=adapter)
    merged = tiny_policy(tiny_home, adapter=adapter, merge="auto")
    assert merged.merged and not plain.merged
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    a = plain.generate(PROMPTS, greedy)
    b = merged.generate(PROMPTS, greedy)
    assert [g[0].completion_token_ids for g in a] == [g[0].completion_token_ids for g in b]
    # the adapter changes the answers at all (otherwise the equality above would prove nothing)
    base = tiny_policy(tiny_home).generate(PROMPTS, greedy)
    assert [g[0].completion_token_ids for g in base] != [g[0].completion_token_ids for g in a]
    ids = torch.tensor([a[1][0].prompt_token_ids + a[1][0].completion_token_ids])
    with torch.no_grad():
        la = plain.model(ids).logits
        lb = merged.model(ids).logits
    diff = float((la - lb).abs().max())
    scale = float(la.abs().max())
    # fp32 rounding of W + s*BA through every layer (measured 1.6e-5 here), nothing more
    assert diff <= 1e-4 * max(scale, 1.0), (diff, scale)
    # sampled answers stay merged: a second call does not silently un-merge the adapter
    merged.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    assert merged.merged


def test_merged_policy_switching_to_another_view_unmerges_first(tiny_home, tmp_path):
    """A runtime adapter loaded beside a merged champion (``flywheel serve``) applies to the base alone."""
    champion = make_lora_adapter(tiny_home, tmp_path / "champ", seed=3)
    other = make_lora_adapter(tiny_home, tmp_path / "other", seed=4)
    pol = tiny_policy(tiny_home, adapter=champion, merge="always")
    pol.load_adapter(other, "other", activate=False)
    view = pol.adapter_view("other")
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    want = tiny_policy(tiny_home, adapter=other).generate(PROMPTS, greedy)
    got = view.generate(PROMPTS, greedy)
    assert [g[0].completion_token_ids for g in got] == [g[0].completion_token_ids for g in want]
    assert not pol.merged  # peft un-merged the champion before switching


def test_merge_policy_folds_only_float32_under_auto():
    assert should_merge("auto", torch.float32)
    assert not should_merge("auto", torch.bfloat16)
    assert should_merge("always", torch.bfloat16)
    assert not should_merge("never", torch.float32)
    with pytest.raises(ValueError, match="auto, always or never"):
        should_merge("sometimes", torch.float32)


SYSTEM = ("You are an agent of the ACME support desk. Answer with a tool call when a tool fits, else in one "
          "sentence. Never invent order numbers; ask for them. " * 3)
SHARED = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order 1234?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Cancel it."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What are your opening hours on Sunday, please?"}],
]


def test_a_shared_system_prompt_is_encoded_once_with_the_same_answers(tiny_home):
    """Issue 32: the prompt prefix a batch shares is encoded once; answers and sampler log-probs are those
    of encoding every prompt whole."""
    pol = tiny_policy(tiny_home)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)
    pol.prefix_sharing = False
    whole_g, whole_s = pol.generate(SHARED, greedy), pol.generate(SHARED, sampled)
    assert pol.prefix_tokens_saved == 0
    pol.prefix_sharing = True
    shared_g, shared_s = pol.generate(SHARED, greedy), pol.generate(SHARED, sampled)
    assert pol.prefix_tokens_saved > 2 * 40  # two of the three rows skipped the shared system prompt, twice
    assert [g[0].completion_token_ids for g in shared_g] == [g[0].completion_token_ids for g in whole_g]
    for a, b in zip(shared_s, whole_s, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.completion_token_ids == y.completion_token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    from flywheel.policy.hf import shared_prefix_len

    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter prompt keeps its last token
    assert shared_prefix_len([[1, 2], [3, 2]]) == 0
    assert shared_prefix_len([[7, 7, 7]]) == 2
