"""GRPO-family learning on a toy verifiable task.

Task: the prompt is ``[BOS, x]`` with ``x`` in 2..11; the policy samples a 2-token completion and the
verifier pays 1 when the first token is ``x + 1`` ("answer with the token that follows x"). A randomly
initialised 1-layer model over a 16-token vocabulary starts near 1/16 = 0.06 mean reward, so any
rise to >= 0.8 within the fixed budget is learning, not luck. The sampler+reward loop lives in the
test and plugs into :func:`run_iterations` (below) as the rollout callback.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA

from flywheel.config import TrainConfig
from flywheel.train.data import samples_from_rollouts
from flywheel.train.trainer import Trainer, TrainerOptions, batches

V = 16
PROMPTS = list(range(2, 12))
G = 8  # samples per prompt (the GRPO group)
STEPS = 60  # budget: the runs reach >= 0.8 at ~35 steps (measured, seed 0)


def tiny_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def make_rollout(gen: torch.Generator, history: list[float]):
    """Rollout callback: sample 2 tokens per prompt x G from ``policy``, score, return a rollout table."""

    def rollout(policy) -> pa.Table:
        prompts = torch.tensor([[1, x] for x in PROMPTS for _ in range(G)])
        ids, lps = prompts, []
        with torch.no_grad():
            for _ in range(2):
                lp = torch.log_softmax(policy(input_ids=ids).logits[:, -1].float(), -1)
                tok = torch.multinomial(lp.exp(), 1, generator=gen)
                lps.append(lp.gather(1, tok)[:, 0])
                ids = torch.cat([ids, tok], 1)
        comp = ids[:, 2:]
        reward = (comp[:, 0] == prompts[:, 1] + 1).float()
        history.append(float(reward.mean()))
        n = len(reward)
        rows = {
            "task_id": [f"t{int(x)}" for x in prompts[:, 1]], "env_id": ["env:toy@1"] * n,
            "group_id": [f"g{int(x)}" for x in prompts[:, 1]], "sample_idx": [i % G for i in range(n)],
            "policy_version": ["test"] * n, "messages": ["[]"] * n, "completion": [""] * n,
            "prompt_token_ids": prompts.tolist(), "completion_token_ids": comp.tolist(),
            "sampler_logprobs": torch.stack(lps, 1).tolist(), "loss_mask": [[1, 1]] * n,
            "truncated": [False] * n, "reward": reward.tolist(), "reward_components": [[] for _ in range(n)],
            "passed": (reward > 0).tolist(), "advantage": [0.0] * n, "finish_reason": ["length"] * n,
            "infra_error": [None] * n, "generation_ms": [0.0] * n, "verify_ms": [0.0] * n,
        }
        return pa.table(rows, schema=ROLLOUT_SCHEMA)

    return rollout


def run_iterations(trainer, rollout, to_samples, *, iterations, steps_per_iteration, batch_size, seed=0):
    """Multi-iteration GRPO: ``rollout -> N steps -> refresh sampler -> rollout`` for ``iterations`` rounds
    (with ``steps_per_iteration > 1`` the old log-probs are computed once before the first update)."""
    history = []
    for it in range(iterations):
        trainer.policy.eval()
        table = rollout(trainer.policy)
        trainer.policy.train()
        samples = to_samples(table)
        if not samples:
            continue
        if steps_per_iteration > 1:
            trainer.compute_old_logprobs(samples)
        for batch in batches(samples, batch_size, steps_per_iteration, seed=seed + it):
            history.append(trainer.step(batch))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_toy_task_reward_rises_from_chance_to_080(loss):
    trainer = Trainer(
        tiny_lm(),
        TrainerOptions(objective=loss, lr=1e-2, total_steps=STEPS,
                       train=TrainConfig(warmup_steps=0, min_lr_ratio=1.0, lora_r=0)),
    )
    history: list[float] = []
    rollout = make_rollout(torch.Generator().manual_seed(0), history)

    def to_samples(table):
        return samples_from_rollouts(table, scale="group")[0]

    # Stop early once the policy is good: the assertion is about reaching 0.8 within the budget.
    for _ in range(STEPS):
        run_iterations(trainer, rollout, to_samples, iterations=1, steps_per_iteration=1, batch_size=len(PROMPTS) * G)
        if len(history) >= 3 and min(history[-3:]) >= 0.8:
            break
    assert history[0] <= 0.3, f"{loss}: the untrained policy already scores {history[0]}"
    assert max(history) >= 0.8, f"{loss}: mean reward only reached {max(history):.2f} in {len(history)} steps"
