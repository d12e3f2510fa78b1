"""Episode harnesses: single turn and the multi-turn tool loop, with exact token accounting.

Most tests use :class:`ScriptedPolicy` over :class:`CharTokenizer` (one id per character), so the
expected token ids and loss masks can be written down by hand from the text segments."""

from __future__ import annotations

import math

import pytest

from flywheel.envs.harness import Episode, run_episodes
from flywheel.envs.testing import IM_END, IM_START, CharTokenizer, ScriptedPolicy, tool_spec
from flywheel.policy.base import SamplingParams
from flywheel.policy.format import template_messages

WEATHER = tool_spec(
    "get_weather",
    {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    ["city"],
)
RECORDED = '{"temp": 68, "sky": "clear"}'
CALL = "[get_weather(city='Lima', unit='fahrenheit')]"
FINAL = "It is 68F and clear in Lima."
WEATHER_CODE = (
    "def get_weather(city, unit='celsius'):\n"
    "    temps = {'Oslo': 3, 'Lima': 20}\n"
    "    return {'city': city, 'temp': temps[city], 'unit': unit}\n"
)


def loop_task(task_id: str = "eval:loop", *, recorded: bool = True, python: str | None = None) -> dict:
    return {
        "task_id": task_id,
        "prompt": {"messages": [{"role": "user", "content": "Weather in Lima in fahrenheit"}], "tools": [WEATHER]},
        "verifier": {"kind": "tool_call", "tools": [WEATHER], "scope": "all",
                     "expected": [{"name": "get_weather", "arguments": {"city": "Lima", "unit": "fahrenheit"}}]},
        "harness": "tool_loop",
        "tool_env": {"recorded": [{"name": "get_weather", "arguments": {"city": "Lima", "unit": "fahrenheit"},
                                   "content": RECORDED}] if recorded else [],
                     "python": python, "replay": False},
        "reference": None,
        "metadata": {},
    }


def single_task(task_id: str, city: str) -> dict:
    return {
        "task_id": task_id,
        "prompt": {"messages": [{"role": "user", "content": f"Weather in {city}?"}], "tools": [WEATHER]},
        "verifier": {"kind": "tool_call", "tools": [WEATHER], "expected": [{"name": "get_weather", "arguments": {"city": city}}]},
        "harness": "single_turn", "tool_env": None, "reference": None, "metadata": {},
    }


def weather_bot(prompt_text: str, j: int) -> str:
    """Calls the tool until it has seen its output, then answers in words."""
    return FINAL if "[tool output: get_weather]" in prompt_text else CALL


def test_single_turn_batches_all_tasks_in_one_call_and_masks_every_completion_token():
    tok = CharTokenizer()
    pol = ScriptedPolicy(lambda p, j: "[get_weather(city='Oslo')]" if "Oslo" in p else "no idea", tok)
    tasks = [single_task("eval:a", "Oslo"), single_task("eval:b", "Rome")]
    eps = run_episodes(tasks, pol, SamplingParams(n=3, max_new_tokens=64))
    assert pol.calls == [("generate", 2)]
    assert [[e.task_id for e in row] for row in eps] == [["eval:a"] * 3, ["eval:b"] * 3]
    assert [e.sample_idx for e in eps[0]] == [0, 1, 2]
    e = eps[0][0]
    assert isinstance(e, Episode) and e.turns == 1 and e.finish_reason == "stop" and not e.truncated
    assert e.completion_token_ids == tok.encode("[get_weather(city='Oslo')]") + [1]
    assert e.loss_mask == [1] * len(e.completion_token_ids)
    assert e.logprobs == [-(k + 1) / 100 for k in range(len(e.completion_token_ids))]
    assert e.messages[-1] == {"role": "assistant", "content": "[get_weather(city='Oslo')]"}
    assert all(x.passed for x in eps[0]) and not any(x.passed for x in eps[1])
    assert e.verify_ms >= 0 and e.gen_ms == 1.0


def test_tool_loop_answers_from_the_recorded_trace_and_masks_exactly_the_model_tokens():
    tok = CharTokenizer()
    pol = ScriptedPolicy(weather_bot, tok)
    (ep,), = run_episodes([loop_task()], pol, SamplingParams(n=1, max_new_tokens=64), context={"max_turns": 4})

    # Expected token segments, written by hand from the ChatML template (tool turns become user
    # turns tagged "[tool output: <name>]" for templates without a tool role).
    model_1 = tok.encode(CALL) + [1]  # the model ends its turn with <|im_end|> (id 1)
    env = tok.encode(f"\n{IM_START}user\n[tool output: get_weather]\n{RECORDED}{IM_END}\n{IM_START}assistant\n")
    model_2 = tok.encode(FINAL) + [1]
    assert ep.completion_token_ids == model_1 + env + model_2
    assert ep.loss_mask == [1] * len(model_1) + [0] * len(env) + [1] * len(model_2)
    lp1 = [-(k + 1) / 100 for k in range(len(model_1))]
    lp2 = [-(k + 1) / 100 for k in range(len(model_2))]
    assert ep.logprobs == lp1 + [0.0] * len(env) + lp2

    # prompt + completion is exactly the conversation as the template renders it.
    rendered = tok.apply_chat_template(template_messages(tok, ep.messages, [WEATHER]), add_generation_prompt=False)
    assert tok.decode(ep.prompt_token_ids + ep.completion_token_ids) == rendered.removesuffix("\n")

    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2]["content"] == RECORDED and ep.messages[2]["name"] == "get_weather"
    assert ep.observations == [{"name": "get_weather", "source": "recorded", "raised": False, "infra_error": None}]
    assert (ep.turns, ep.tool_calls, ep.finish_reason, ep.truncated, ep.exact_tokens) == (2, 1, "stop", False, True)
    assert ep.passed and ep.reward == 1.0
    assert ep.completion_text == CALL + tok.decode(env) + FINAL
    assert pol.calls == [("generate", 1), ("generate_from_ids", 1)]


def test_recorded_outputs_match_normalised_arguments_but_never_other_arguments():
    tok = CharTokenizer()
    pol = ScriptedPolicy(lambda p, j: "done" if "tool output" in p else
                         ("[get_weather(city='lima', unit='Fahrenheit')]" if j == 0 else "[get_weather(city='Quito')]"), tok)
    (a, b), = run_episodes([loop_task()], pol, SamplingParams(n=2, max_new_tokens=64))
    assert a.messages[2]["content"] == RECORDED and a.observations[0]["source"] == "recorded"
    assert b.observations[0]["source"] == "error" and "no recorded result" in b.messages[2]["content"]


@pytest.mark.slow
def test_tool_loop_answers_from_the_sandboxed_python_implementation():
    tok = CharTokenizer()
    pol = ScriptedPolicy(lambda p, j: "ok" if "tool output" in p else
                         ("[get_weather(city='Oslo')]" if j == 0 else "[get_weather(city='Atlantis')]"), tok)
    (ok, boom), = run_episodes([loop_task(recorded=False, python=WEATHER_CODE)], pol, SamplingParams(n=2, max_new_tokens=64))
    assert ok.observations[0]["source"] == "python" and not ok.observations[0]["raised"]
    assert ok.messages[2]["content"] == '{"city": "Oslo", "temp": 3, "unit": "celsius"}'
    assert boom.observations[0]["raised"] and boom.messages[2]["content"].startswith("Error: KeyError")
    # The observation text is what the model saw: it is in the env segment, masked out.
    env_ids = [t for t, m in zip(ok.completion_token_ids, ok.loss_mask, strict=True) if m == 0]
    assert '"temp": 3' in tok.decode(env_ids)


def test_max_turns_ends_a_model_that_never_stops_calling():
    tok = CharTokenizer()
    pol = ScriptedPolicy(lambda p, j: CALL, tok)
    (ep,), = run_episodes([loop_task()], pol, SamplingParams(n=1, max_new_tokens=64), context={"max_turns": 3})
    assert (ep.turns, ep.tool_calls, ep.finish_reason) == (3, 2, "max_turns")
    model = tok.encode(CALL) + [1]
    # The episode ends on a model turn: no environment tokens after it.
    assert ep.loss_mask[-len(model):] == [1] * len(model)
    assert sum(ep.loss_mask) == 3 * len(model)
    assert pol.calls == [("generate", 1), ("generate_from_ids", 1), ("generate_from_ids", 1)]


def test_max_turns_comes_from_the_config_when_not_given(cfg):
    cfg.rollout.max_turns = 2
    pol = ScriptedPolicy(lambda p, j: CALL)
    (ep,), = run_episodes([loop_task()], pol, SamplingParams(n=1, max_new_tokens=64), context=cfg)
    assert ep.turns == 2 and ep.finish_reason == "max_turns"


def test_a_truncated_model_turn_ends_the_episode():
    pol = ScriptedPolicy(weather_bot)
    (ep,), = run_episodes([loop_task()], pol, SamplingParams(n=1, max_new_tokens=10))
    assert ep.truncated and ep.finish_reason == "length" and ep.turns == 1
    assert len(ep.completion_token_ids) == 10 and ep.loss_mask == [1] * 10
    assert not ep.passed


def test_episodes_continue_independently_and_each_turn_is_one_batched_call():
    tok = CharTokenizer()

    def bot(p: str, j: int) -> str:  # sample 0 answers at once; sample 1 calls the tool first
        return FINAL if (j == 0 or "tool output" in p) else CALL

    pol = ScriptedPolicy(bot, tok)
    eps = run_episodes([loop_task(f"eval:{i}") for i in range(3)], pol, SamplingParams(n=2, max_new_tokens=64))
    assert pol.calls == [("generate", 3), ("generate_from_ids", 3)]
    for row in eps:
        assert [e.turns for e in row] == [1, 2]
        assert not row[0].passed and row[1].passed  # the verifier needs the call (scope "all")


def test_an_llm_judge_without_endpoint_is_an_infra_error_not_a_failure():
    task = single_task("eval:j", "Oslo")
    task["verifier"] = {"kind": "llm_judge", "rubric": "be nice"}
    (ep,), = run_episodes([task], ScriptedPolicy(lambda p, j: "hi"), SamplingParams(n=1, max_new_tokens=8))
    assert ep.verdict.infra_error and not ep.verdict.ok_for_training


def test_unknown_harness_is_refused_with_the_task_named():
    task = single_task("eval:x", "Oslo")
    task["harness"] = "bogus"
    with pytest.raises(ValueError, match="eval:x"):
        run_episodes([task], ScriptedPolicy(lambda p, j: "x"), SamplingParams(n=1))


# ------------------------------------------------------------------------------ real tokenizer / model
@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    from flywheel.policy.testing import tiny_model_home

    return tiny_model_home(tmp_path_factory.mktemp("harness-policy"))


@pytest.mark.slow
def test_tool_loop_token_accounting_with_the_smollm2_tokenizer(tiny_home):
    from flywheel.policy.testing import tiny_policy

    tok = tiny_policy(tiny_home).tokenizer
    pol = ScriptedPolicy(weather_bot, tok)
    (ep,), = run_episodes([loop_task()], pol, SamplingParams(n=1, max_new_tokens=64))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model_1 = tok(CALL, add_special_tokens=False)["input_ids"] + [end]
    model_2 = tok(FINAL, add_special_tokens=False)["input_ids"] + [end]
    n_env = len(ep.completion_token_ids) - len(model_1) - len(model_2)
    assert n_env > 0
    assert ep.completion_token_ids[: len(model_1)] == model_1 and ep.completion_token_ids[-len(model_2):] == model_2
    assert ep.loss_mask == [1] * len(model_1) + [0] * n_env + [1] * len(model_2)
    env_text = tok.decode(ep.completion_token_ids[len(model_1): -len(model_2)])
    assert env_text == f"\n<|im_start|>user\n[tool output: get_weather]\n{RECORDED}<|im_end|>\n<|im_start|>assistant\n"
    # One tokenisation of the whole rendered conversation gives the same ids as the segments.
    rendered = tok.apply_chat_template(template_messages(tok, ep.messages, [WEATHER]), tokenize=False,
                                       add_generation_prompt=False)
    whole = tok(rendered.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert ep.prompt_token_ids + ep.completion_token_ids == whole


class _ScriptedFirstTurn:
    """First turn scripted (a tool call), later turns sampled by the real tiny model from ids."""

    def __init__(self, hf, scripted):
        self.hf, self.scripted = hf, scripted
        self.tokenizer = hf.tokenizer
        self.model = hf.model
        self.name, self.version = "hybrid", "0"

    def generate(self, prompts, params=None, *, tools=None):
        import dataclasses

        return self.scripted.generate(prompts, dataclasses.replace(params, max_new_tokens=256), tools=tools)

    def generate_from_ids(self, ids, params=None):
        return self.hf.generate_from_ids(ids, params)


@pytest.mark.slow
def test_tiny_hf_model_continues_from_env_tokens_and_its_logprobs_match_teacher_forcing(tiny_home):
    import torch

    from flywheel.policy.testing import tiny_policy

    hf = tiny_policy(tiny_home)
    pol = _ScriptedFirstTurn(hf, ScriptedPolicy(lambda p, j: CALL, hf.tokenizer))
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=0)
    row, = run_episodes([loop_task()], pol, params, context={"max_turns": 2})
    end = hf.tokenizer.convert_tokens_to_ids("<|im_end|>")
    model_1 = hf.tokenizer(CALL, add_special_tokens=False)["input_ids"] + [end]
    for ep in row:
        assert ep.turns == 2 and ep.exact_tokens
        mask = ep.loss_mask
        first_env, last_env = mask.index(0), len(mask) - 1 - mask[::-1].index(0)
        assert mask == [1] * len(model_1) + [0] * (last_env - first_env + 1) + [1] * (len(mask) - last_env - 1)
        assert 1 <= len(mask) - last_env - 1 <= 6
        # Teacher forcing prompt + completion reproduces the sampler's log-probs of the model's second
        # turn: the model really conditioned on exactly these ids, env tokens included.
        ids = torch.tensor([ep.prompt_token_ids + ep.completion_token_ids])
        with torch.no_grad():
            logits = hf.model(ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        n_p = len(ep.prompt_token_ids)
        for k in range(last_env + 1, len(mask)):
            pos = n_p + k
            want = logp[pos - 1, ids[0, pos]].item()
            assert math.isclose(ep.logprobs[k], want, abs_tol=1e-4), (k, ep.logprobs[k], want)


@pytest.mark.slow
def test_tiny_hf_model_single_turn_episodes(tiny_home):
    from flywheel.policy.format import render_prompt
    from flywheel.policy.testing import tiny_policy

    hf = tiny_policy(tiny_home)
    tasks = [single_task("eval:a", "Oslo"), loop_task("eval:b")]
    eps = run_episodes(tasks, hf, SamplingParams(n=2, max_new_tokens=5, seed=1))
    want_prompt = hf.tokenizer(render_prompt(hf.tokenizer, tasks[0]["prompt"]["messages"], [WEATHER]),
                               add_special_tokens=False)["input_ids"]
    assert eps[0][0].prompt_token_ids == want_prompt
    for row in eps:
        for ep in row:
            n = len(ep.completion_token_ids)
            assert len(ep.logprobs) == n == len(ep.loss_mask) and 1 <= n
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in ep.logprobs[:5])
            assert ep.verdict.infra_error is None and not ep.passed  # a random model does not call tools


def test_a_tool_sandbox_that_cannot_start_makes_the_episode_an_infra_error(monkeypatch):
    import flywheel.sandbox as sandbox
    from flywheel.sandbox import SandboxResult

    def broken(*a, **k):
        return SandboxResult(False, 0, 0, {}, "", "", 0.0, "netns", infra_error="unshare: permission denied")

    monkeypatch.setattr(sandbox, "run_python_tests", broken)
    pol = ScriptedPolicy(lambda p, j: "ok" if "tool output" in p else "[get_weather(city='Oslo')]")
    (ep,), = run_episodes([loop_task(recorded=False, python=WEATHER_CODE)], pol, SamplingParams(n=1, max_new_tokens=64))
    assert ep.observations[0]["infra_error"] == "unshare: permission denied"
    assert ep.verdict.infra_error and "tool environment" in ep.verdict.infra_error and not ep.verdict.ok_for_training
