"""Arrow schema of the rollout Parquet that the rollouts stage writes and the trainer reads.

One row per sample. Token-level columns are aligned: ``completion_token_ids``, ``sampler_logprobs``
and ``loss_mask`` have the same length. For multi-turn trajectories the completion is the whole
model/environment interleaving after the prompt; ``loss_mask`` is 1 exactly on tokens the policy
sampled and 0 on tool/observation tokens the environment inserted (their sampler logprob is 0.0).
"""

from __future__ import annotations

import pyarrow as pa

ROLLOUT_SCHEMA_VERSION = 1

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("env_id", pa.string(), nullable=False),  # env:<name>@<version>
        pa.field("group_id", pa.string(), nullable=False),  # one group = K samples of one task
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("policy_version", pa.string(), nullable=False),  # model:<name>/<version> or a path/URL
        pa.field("messages", pa.string(), nullable=False),  # JSON: prompt messages (+ tools) as sent
        pa.field("completion", pa.string(), nullable=False),  # decoded completion text
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("sampler_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("reward_components", pa.map_(pa.string(), pa.float32()), nullable=False),
        pa.field("passed", pa.bool_(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | tool_calls | error
        pa.field("infra_error", pa.string(), nullable=True),  # set: the sample is excluded from training
        pa.field("generation_ms", pa.float32(), nullable=False),
        pa.field("verify_ms", pa.float32(), nullable=False),
    ],
    metadata={b"flywheel.schema": b"rollouts", b"flywheel.schema_version": str(ROLLOUT_SCHEMA_VERSION).encode()},
)
