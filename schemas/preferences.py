"""Arrow schema of the preference-pair Parquet (``preferences.published``) that RPO/DPO train on.

One row per pair: a prompt (``messages`` + ``tools``, JSON as in the rollout schema), the chosen
answer (the eval's reference: a correction or a verified success) and the rejected one (the raw
text of a verified failure: the production answer the eval was compiled from, or a sampled answer of
the policy), both as the policy writes them (:func:`flywheel.policy.format.render_answer`, no
end-of-turn token). ``chosen_calls``/``chosen_content`` keep the chosen answer structured so a pair
can be re-rendered exactly; ``source_entity_id`` (``eval:…`` / ``synth:…``) is what lineage follows
to the failures and traces.
"""

from __future__ import annotations

import pyarrow as pa

PREFERENCE_SCHEMA_VERSION = 1

#: Where a rejected answer came from.
PREFERENCE_SOURCES = ("production", "sampled")

PREFERENCE_SCHEMA = pa.schema(
    [
        pa.field("pair_id", pa.string(), nullable=False),  # hash of the row's content (task, prompt, answers)
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("messages", pa.string(), nullable=False),  # JSON: prompt messages (OpenAI format)
        pa.field("tools", pa.string(), nullable=False),  # JSON: OpenAI function specs ([] when none)
        pa.field("chosen", pa.string(), nullable=False),  # rendered chosen answer text
        pa.field("chosen_calls", pa.string(), nullable=True),  # JSON [{name, arguments}] or null
        pa.field("chosen_content", pa.string(), nullable=True),  # text answer or null
        pa.field("rejected", pa.string(), nullable=False),  # raw text of the failed answer
        pa.field("chosen_reward", pa.float32(), nullable=False),
        pa.field("rejected_reward", pa.float32(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # production | sampled
        pa.field("source_entity_id", pa.string(), nullable=False),  # eval:<id> or synth:<batch>
        pa.field("split", pa.string(), nullable=False),  # always "train" (held-out is refused)
    ],
    metadata={b"flywheel.schema": b"preferences",
              b"flywheel.schema_version": str(PREFERENCE_SCHEMA_VERSION).encode()},
)
