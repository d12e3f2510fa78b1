"""HF backend: exact sampler logprobs, batching, seeds, finish reasons, adapters, model loading."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from flywheel.policy.base import Sample, SamplingParams, coerce_params, per_prompt_tools
from flywheel.policy.testing import make_lora_adapter, session_tiny_home, tiny_policy

PROMPTS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France, and why?"}],
    [{"role": "user", "content": "Count to three."}],
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: the tiny model's ops take microseconds, and on a shared 2-core CI box a
    second OpenMP thread that gets descheduled makes every op wait (measured 35 us -> 2.4 ms per
    64x64 linear under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    return session_tiny_home(tmp_path_factory)


@pytest.fixture(scope="session")
def policy(tiny_home):
    return tiny_policy(tiny_home)


def _teacher_forced_logp(policy, s: Sample, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of every completion token, from one full forward pass, no cache, no padding."""
    ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
    with torch.no_grad():
        logits = policy.model(ids).logits[0].float()
    n_prompt = len(s.prompt_token_ids)
    # the logits at position i predict token i+1: completion token k is predicted at n_prompt-1+k
    rows = logits[n_prompt - 1 : n_prompt - 1 + len(s.completion_token_ids)]
    return torch.log_softmax(rows / temperature, dim=-1), torch.tensor(s.completion_token_ids)


def test_sampler_logprobs_equal_teacher_forced_recomputation(policy):
    out = policy.generate(PROMPTS, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=3))
    checked = 0
    for group in out:
        assert len(group) == 3
        for s in group:
            assert len(s.logprobs) == len(s.completion_token_ids) > 0
            logp, toks = _teacher_forced_logp(policy, s, 0.7)
            expected = logp.gather(1, toks[:, None])[:, 0]
            assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
            checked += len(s.logprobs)
    assert checked == sum(len(s.completion_token_ids) for g in out for s in g)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(policy):
    top_p = 0.5
    out = policy.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.5, top_p=top_p, max_new_tokens=8, seed=0))
    for group in out:
        for s in group:
            logp, toks = _teacher_forced_logp(policy, s, 1.5)
            for k, tok in enumerate(toks.tolist()):
                probs, order = logp[k].exp().sort(descending=True)
                before = probs.cumsum(0) - probs
                nucleus = order[before < top_p]  # smallest prefix reaching top_p
                assert tok in set(nucleus.tolist()), "sampled a token outside the nucleus"
                expected = logp[k][tok] - torch.logsumexp(logp[k][nucleus], 0)
                assert s.logprobs[k] == pytest.approx(expected.item(), abs=1e-4)


def test_greedy_takes_argmax_and_reports_untempered_logprobs(policy):
    (group,) = policy.generate(PROMPTS[1:2], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    s = group[0]
    logp, toks = _teacher_forced_logp(policy, s, 1.0)
    assert toks.tolist() == logp.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(s.logprobs), logp.gather(1, toks[:, None])[:, 0], atol=1e-4)


def test_batched_left_padded_n2_greedy_equals_unbatched(policy):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    batched = policy.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = policy.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
        for s in batched[i]:
            assert s.completion_token_ids == alone[0].completion_token_ids
            assert s.prompt_token_ids == alone[0].prompt_token_ids
            assert s.logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)
    # prompts really had different lengths, so left padding was exercised
    assert len({len(g[0].prompt_token_ids) for g in batched}) == 3


def test_small_batch_rows_chunks_give_same_results(tiny_home, policy):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11)
    small = tiny_policy(tiny_home, max_batch_rows=2)
    a = policy.generate(PROMPTS, params)
    b = small.generate(PROMPTS, params)
    assert [[s.completion_token_ids for s in g] for g in a] == [[s.completion_token_ids for s in g] for g in b]


def test_seeds_are_reproducible_and_samples_differ(policy):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=42)
    a = policy.generate(PROMPTS[:2], params)
    b = policy.generate(PROMPTS[:2], params)
    c = policy.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=43))
    ids = lambda out: [[s.completion_token_ids for s in g] for g in out]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert len({tuple(x) for x in ids(a)[0]}) == 4  # the n samples of one prompt are distinct
    # a prompt's samples do not depend on which other prompt shares its batch
    d = policy.generate([PROMPTS[0], PROMPTS[2]], params)
    assert ids(d)[0] == ids(a)[0]


def test_unseeded_calls_do_not_touch_the_global_rng(policy):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    policy.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=3))
    assert torch.equal(torch.rand(3), expected)


def test_length_finish_and_truncation(policy):
    (group,) = policy.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=5, seed=0))
    for s in group:
        assert len(s.completion_token_ids) == 5
        assert s.finish_reason == "length" and s.truncated
        assert s.gen_ms > 0


def test_end_of_turn_token_stops_a_sample(tiny_home):
    pol = tiny_policy(tiny_home)
    (greedy,) = pol.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    first = greedy[0].completion_token_ids[0]
    pol._eos_ids = {first}  # pretend the model's first greedy token is its end-of-turn token
    (group,) = pol.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    s = group[0]
    assert s.completion_token_ids == [first]  # the end token is kept in the ids (trained on) ...
    assert s.finish_reason == "stop" and not s.truncated


def test_smollm2_end_of_turn_is_an_eos(policy):
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in policy._eos_ids


def test_stop_strings_cut_the_text(policy):
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=7)
    (full,) = policy.generate(PROMPTS[:1], params)
    text = full[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    (cut,) = policy.generate(PROMPTS[:1], SamplingParams(n=1, temperature=1.0, max_new_tokens=12, seed=7, stop=[stop]))
    s = cut[0]
    assert s.finish_reason == "stop"
    assert s.text == text[: text.find(stop)]
    assert len(s.completion_token_ids) < len(full[0].completion_token_ids) or stop in text[-3:]


def test_generate_from_ids_continues_exactly(policy):
    (a,) = policy.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    s = a[0]
    prefix = s.prompt_token_ids + s.completion_token_ids[:3]
    (b,) = policy.generate_from_ids([prefix], SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    assert b[0].completion_token_ids == s.completion_token_ids[3:8]


def test_prompt_longer_than_context_is_rejected(policy):
    too_long = [1] * policy.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="prompt 0 has"):
        policy.generate_from_ids([too_long], 1)


def test_lora_adapter_load_view_unload(tiny_home, tmp_path):
    pol = tiny_policy(tiny_home)
    adapter = make_lora_adapter(tiny_home, tmp_path / "lora")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    base = pol.generate(PROMPTS[:2], params)
    pol.load_adapter(adapter, "ft", activate=False)
    assert pol.generate(PROMPTS[:2], params)[0][0].completion_token_ids == base[0][0].completion_token_ids
    view = pol.adapter_view("ft")
    tuned = view.generate(PROMPTS[:2], params)
    assert [g[0].completion_token_ids for g in tuned] != [g[0].completion_token_ids for g in base]
    # the view's logprobs are the adapter's own distribution
    logp, toks = _teacher_forced_logp(view, tuned[0][0], 1.0)
    pol.unload_adapter("ft")
    assert pol.generate(PROMPTS[:2], params)[0][0].completion_token_ids == base[0][0].completion_token_ids
    from flywheel.policy.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="no longer loaded"):
        view.generate(PROMPTS[:1], params)
    # from_spec with an adapter samples with it from the start
    loaded = tiny_policy(tiny_home, adapter=adapter)
    assert loaded.generate(PROMPTS[:2], params)[0][0].completion_token_ids == tuned[0][0].completion_token_ids
    assert logp.shape[0] == len(toks)


def test_set_weights_from_plain_and_peft_models(tiny_home, tmp_path):
    pol = tiny_policy(tiny_home)
    trainer = copy.deepcopy(pol.model)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = pol.generate(PROMPTS[:1], params)[0][0]
    pol.set_weights_from(trainer)
    ids = torch.tensor([before.prompt_token_ids])
    with torch.no_grad():
        assert torch.allclose(pol.model(ids).logits, trainer(ids).logits, atol=1e-5)
    # a peft training model: its adapter is copied into the policy's "default" adapter
    from peft import PeftModel

    fresh = tiny_policy(tiny_home)
    adapter = make_lora_adapter(tiny_home, tmp_path / "lora2", seed=1)
    base_model = tiny_policy(tiny_home).model
    peft_trainer = PeftModel.from_pretrained(base_model, str(adapter), is_trainable=True)
    fresh.set_weights_from(peft_trainer)
    assert fresh.adapter == "default"
    with torch.no_grad():
        assert torch.allclose(fresh.model(ids).logits, peft_trainer(ids).logits, atol=1e-5)
    with pytest.raises(Exception, match="state dicts differ"):
        pol.set_weights_from(torch.nn.Linear(2, 2))


def test_coerce_params_and_tools_shapes():
    assert coerce_params(None) == SamplingParams()
    assert coerce_params(3).n == 3
    with pytest.raises(TypeError):
        coerce_params("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert per_prompt_tools(None, 2) == [[], []]
    assert per_prompt_tools([], 2) == [[], []]
    assert per_prompt_tools([tool], 2) == [[tool], [tool]]
    assert per_prompt_tools([[tool], []], 2) == [[tool], []]
    with pytest.raises(ValueError, match="one list per prompt"):
        per_prompt_tools([[tool]], 2)


def test_tiny_model_is_deterministic_and_cached(tiny_home):
    from flywheel.policy.models import TINY, build_tiny_model, ensure_base_model, load_model

    path = ensure_base_model(TINY, tiny_home)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    model, tok = load_model(TINY, home=tiny_home)
    rebuilt = build_tiny_model(tok)
    for (n, a), (_, b) in zip(model.state_dict().items(), rebuilt.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert sum(p.numel() for p in model.parameters()) < 4_000_000
    assert not math.isnan(float(next(model.parameters()).detach().sum()))


def test_fast_dtype_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    from flywheel.policy import models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert models.resolve_dtype("fast", "cpu") is torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    assert models.resolve_dtype("fast", "cpu") is torch.float32  # emulated bf16 is slower than fp32
    assert models.resolve_dtype("fast", "cuda") is torch.bfloat16
    assert models.resolve_dtype("auto", "cpu") is torch.float32  # the default does not change on CPU
    with pytest.raises(models.ModelLoadError, match="not one of auto, fast"):
        models.resolve_dtype("int8", "cpu")


def test_a_bf16_cpu_policy_with_fp32_lora_generates_and_trains(tiny_home, tmp_path):
    """The cpu demo profile's dtype ("fast" -> bf16 on this CPU): bf16 base weights, float32 LoRA
    adapters trained under bf16 autocast, a finite SFT step, the adapter loaded back in bf16, and a
    generation with finite logprobs."""
    from flywheel.config import TrainConfig
    from flywheel.policy.models import TINY, load_model
    from flywheel.train.data import TrainSample
    from flywheel.train.trainer import Trainer, TrainerOptions

    model, tok = load_model(TINY, home=tiny_home, dtype="bfloat16")
    assert next(model.parameters()).dtype is torch.bfloat16
    options = TrainerOptions(objective="sft", lr=1e-2, total_steps=1, pad_id=0,
                             train=TrainConfig(lora_r=4, lora_alpha=8, warmup_steps=0))
    trainer = Trainer(model, options)
    lora = [p for _, p in trainer.policy.named_parameters() if p.requires_grad]
    assert lora and all(p.dtype is torch.float32 for p in lora)
    before = [p.detach().clone() for p in lora]
    sample = TrainSample(prompt_ids=[5, 6, 7, 8], completion_ids=[9, 10, 11], loss_mask=[1, 1, 1], group_id="g")
    metrics = trainer.step([sample, sample])
    assert math.isfinite(metrics.loss) and metrics.loss > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, lora, strict=True))

    # The adapters' matmuls run in bf16 under autocast (float32 master weights), without peft's
    # float32 copy of each layer input; the switch is scoped to the trainer's forward.
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuner_layers = [m for m in trainer.policy.modules() if isinstance(m, BaseTunerLayer)]
    assert tuner_layers
    with trainer._autocast():
        assert torch.is_autocast_enabled("cpu")
        assert not any(m.cast_input_dtype_enabled for m in tuner_layers)
    assert not torch.is_autocast_enabled("cpu")
    assert all(m.cast_input_dtype_enabled for m in tuner_layers)

    # Loaded for inference, the adapter takes the base weights' dtype (no float32 copies per layer)
    # and computes what the trainer's bf16 forward computes, to bf16 rounding.
    from flywheel.policy.models import attach_adapter

    trainer.policy.save_pretrained(str(tmp_path / "adapter"))
    base, _ = load_model(TINY, home=tiny_home, dtype="bfloat16")
    served = attach_adapter(base, tmp_path / "adapter")
    assert {p.dtype for n, p in served.named_parameters() if "lora_" in n} == {torch.bfloat16}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        with trainer._autocast():
            trained_logits = trainer.policy(input_ids=ids).logits.float()
        served_logits = served(input_ids=ids).logits.float()
    assert torch.allclose(served_logits, trained_logits, atol=0.1, rtol=0.05)

    policy = tiny_policy(tiny_home, dtype="bfloat16")
    out = policy.generate([[{"role": "user", "content": "hello"}]], SamplingParams(n=2, max_new_tokens=6, seed=1))
    assert len(out[0]) == 2
    for s in out[0]:
        assert s.completion_token_ids and all(math.isfinite(x) and x <= 0 for x in s.logprobs)


def test_model_dirs_appear_atomically(tmp_path, tiny_home, monkeypatch):
    from flywheel.policy import models

    # a crash mid-build leaves only a hidden temp dir, never the target
    def boom(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("crash while writing")

    target = tmp_path / "models" / "base" / "x"
    with pytest.raises(RuntimeError, match="crash"):
        models._atomic_dir(target, boom, {})
    assert not target.exists()
    assert list(target.parent.iterdir()) == []
    # a completed build is reused without rebuilding
    calls = []
    models._atomic_dir(target, lambda t: calls.append((t / "config.json").write_text("{}")), {"k": 1})
    models._atomic_dir(target, lambda t: calls.append(1), {"k": 1})
    assert len(calls) == 1 and (target / "config.json").exists()


def test_unknown_specs_are_rejected_clearly(tmp_path):
    from flywheel.policy.models import ModelLoadError, ensure_base_model

    with pytest.raises(ModelLoadError, match="hub names are not downloaded"):
        ensure_base_model("HuggingFaceTB/SmolLM2-135M", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        ensure_base_model(str(tmp_path / "empty"), tmp_path)


@pytest.mark.slow
def test_smollm2_gguf_is_converted_once_to_loadable_safetensors(tmp_path):
    """~20 s: the real GGUF -> dequantized -> safetensors path (a plain GGUF load cannot be saved)."""
    import json as _json

    from flywheel.policy.models import SMOLLM2, ensure_base_model, load_model

    path = ensure_base_model(SMOLLM2, tmp_path)
    assert (path / "model.safetensors").exists() and (path / "flywheel-model.json").exists()
    assert "quantization_config" not in _json.loads((path / "config.json").read_text())
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(SMOLLM2, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    model, tok = load_model(SMOLLM2, home=tmp_path)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_decode_threads_auto_measures_both_counts_restores_torch_s_and_changes_no_answer(tiny_home):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    fixed = tiny_policy(tiny_home, decode_threads=1)
    auto = tiny_policy(tiny_home)  # policy.decode_threads defaults to "auto"
    assert auto.decode_threads == "auto"
    want = fixed.generate(PROMPTS, params)
    torch.set_num_threads(2)  # the module runs at 1 thread; auto measures the process's count and 1
    try:
        got = auto.generate(PROMPTS, params)
        assert torch.get_num_threads() == 2  # the process gets its own count back
    finally:
        torch.set_num_threads(1)
    assert [[s.completion_token_ids for s in g] for g in got] == [[s.completion_token_ids for s in g] for g in want]
    assert set(auto.decode_thread_steps) == {1, 2}  # both were timed (3 trial steps each)
    assert min(auto.decode_thread_steps.values()) >= 3
    assert set(fixed.decode_thread_steps) == {1}


def test_a_bad_decode_threads_setting_is_refused_when_the_policy_is_made(tiny_home):
    with pytest.raises(ValueError, match="decode threads must be 'auto' or a count >= 0 \\(got 'many'\\)"):
        tiny_policy(tiny_home, decode_threads="many")


def test_a_policy_made_with_the_device_as_a_string_decodes(policy):
    # HFPolicy(model, tokenizer, device="cpu"): the decode loop's thread chooser once read `device.type`
    from flywheel.policy.hf import HFPolicy

    p = HFPolicy(policy.model, policy.tokenizer, device="cpu")
    (group,) = p.generate([PROMPTS[0]], SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    assert len(group[0].completion_token_ids) >= 1


def test_training_on_from_a_saved_adapter_keeps_its_float32_master_weights(tiny_home, tmp_path):
    """Issue 30: every phase continued from a registered adapter (the learning stage's stream, cycle 2 from
    the champion) loaded it in the bf16 base's dtype and trained bf16 weights, so AdamW's small updates
    rounded away -- on the cpu profile the stream's adapter was saved in bf16 and its model made four times
    plain SFT's extra calls. Loaded for training, the adapter keeps the float32 values it was saved with;
    the trainer makes any adapter it is handed float32; a step at a late-schedule learning rate moves it."""
    from flywheel.config import TrainConfig
    from flywheel.policy.models import TINY, load_model
    from flywheel.train.data import TrainSample
    from flywheel.train.trainer import Trainer, TrainerOptions

    def trainer_on(model, lr: float) -> Trainer:
        return Trainer(model, TrainerOptions(objective="sft", lr=lr, total_steps=1, pad_id=0,
                                             train=TrainConfig(lora_r=4, lora_alpha=8, warmup_steps=0)))

    sample = TrainSample(prompt_ids=[5, 6, 7, 8], completion_ids=[9, 10, 11], loss_mask=[1, 1, 1], group_id="g")
    base, _ = load_model(TINY, home=tiny_home, dtype="bfloat16")
    first = trainer_on(base, 1e-2)
    first.step([sample, sample])
    first.policy.save_pretrained(str(tmp_path / "adapter"))
    saved = {n.replace(".default", ""): p.detach().clone() for n, p in first.policy.named_parameters() if "lora_" in n}

    model, _ = load_model(TINY, home=tiny_home, dtype="bfloat16", adapter=tmp_path / "adapter", adapter_float32=True)
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert loaded.keys() == saved.keys()
    assert all(p.dtype is torch.float32 and torch.equal(p.detach(), saved[n]) for n, p in loaded.items())

    # Loaded for inference (the base's dtype) and handed to the trainer: it trains float32 weights.
    served, _ = load_model(TINY, home=tiny_home, dtype="bfloat16", adapter=tmp_path / "adapter")
    assert {p.dtype for n, p in served.named_parameters() if "lora_" in n} == {torch.bfloat16}
    on = trainer_on(served, 1e-5)
    lora = [p for _, p in on.policy.named_parameters() if p.requires_grad]
    assert lora and all(p.dtype is torch.float32 for p in lora)
    before = [p.detach().clone() for p in lora]
    on.step([sample, sample])
    # lr 1e-5 moves each weight by about 1e-5, under half a bf16 step of a weight of ~1e-2: as bf16
    # weights nearly all of them stayed put.
    moved = sum(int((a != b.detach()).sum()) for a, b in zip(before, lora, strict=True))
    assert moved > 0.5 * sum(p.numel() for p in lora)
