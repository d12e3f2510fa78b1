"""SFT demonstrations: what they are, where the cycle gets them, and the held-out rule. Torch-free,
so the cycle, the CLI and benchmarks build and check demonstrations without loading a trainer
(:mod:`flywheel.train.sft` renders and trains on them).

Guarantees
- A demonstration whose ``split`` is ``"heldout"`` is refused with :class:`HeldOutDemonstrationError`
  naming its source; with an event store, a demonstration any of whose lineage ancestors is an
  ``eval:`` entity recorded with ``split == "heldout"`` is refused too (so a synthetic task derived from
  a held-out eval cannot leak in under a "train" label).
- :func:`demonstrations_from_tasks` never turns a held-out task into a demonstration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.store import EventStore
from flywheel.versioning import load_env, load_suite
from flywheel.vocab import ToolCall

__all__ = ["HELDOUT", "Demonstration", "HeldOutDemonstrationError", "check_demonstrations",
           "demonstrations_from_tasks", "train_split_demonstrations"]

HELDOUT = "heldout"


class HeldOutDemonstrationError(ValueError):
    """A demonstration comes from (or descends from) a held-out eval: training on it would leak the gate."""


@dataclass(frozen=True)
class Demonstration:
    """A conversation and the answer the policy should have given.

    ``answer_calls`` (a list of ``flywheel.vocab.ToolCall``) or ``answer_content`` (plain text);
    ``source_entity_id`` names where it came from (``eval:…``, ``synth:…``, ``trace:…``) and becomes
    the causation of the training run; ``split`` is that source's split (``train`` / ``heldout``).
    """

    messages: list[dict]
    tools: list[dict] | None
    source_entity_id: str
    split: str = "train"
    answer_calls: list[Any] | None = None
    answer_content: str | None = None

    def __post_init__(self) -> None:
        if not self.answer_calls and self.answer_content is None:
            raise ValueError(f"demonstration from {self.source_entity_id}: needs answer_calls or answer_content")


def check_demonstrations(demos: Sequence[Demonstration], store: EventStore | None = None) -> None:
    """Refuse held-out demonstrations (by split, and by lineage when ``store`` is given)."""
    for i, d in enumerate(demos):
        if d.split == HELDOUT:
            raise HeldOutDemonstrationError(
                f"demonstration {i} from {d.source_entity_id} is in the held-out split: held-out evals "
                "decide the gate and must never be trained on"
            )
    if store is None:
        return
    for i, d in enumerate(demos):
        ancestors = [d.source_entity_id] + [a for a, _ in store.lineage(d.source_entity_id, "down")]
        for a in ancestors:
            if not a.startswith("eval:"):
                continue
            ent = store.entity(a)
            if ent is not None and (ent.get("state") or {}).get("split") == HELDOUT:
                raise HeldOutDemonstrationError(
                    f"demonstration {i} from {d.source_entity_id} descends from held-out eval {a}: "
                    "held-out evals must never be trained on"
                )


def demonstrations_from_tasks(train_tasks: list[dict], regression_tasks: list[dict] | None = None) -> list[Demonstration]:
    """SFT demonstrations: the reference answer of every train-split task (corrections of train
    failures, references of accepted synthetic tasks) and of every regression task (the recorded
    answers of successful production traces). Tasks whose split is ``heldout`` are skipped here and
    would be refused by :func:`check_demonstrations` anyway."""
    demos = []
    for t in list(train_tasks) + list(regression_tasks or []):
        meta = t.get("metadata") or {}
        split = meta.get("split", "train")
        if split == "heldout":
            continue
        ref = t.get("reference")
        if not ref:
            continue
        calls = ref.get("tool_calls")
        kw: dict[str, Any] = {}
        if calls:
            kw["answer_calls"] = [ToolCall(c["name"], c.get("arguments") or {}) for c in calls]
        elif ref.get("content") is not None:
            kw["answer_content"] = ref["content"]
        else:
            continue
        # The source must be an entity of the store so lineage reaches the failures: a synthetic task
        # is named by its batch (synth:<batch>, caused by its seed evals), an eval by its own id.
        source = meta.get("synth_batch") or t["task_id"]
        demos.append(Demonstration(
            messages=t["prompt"]["messages"], tools=t["prompt"].get("tools") or None,
            source_entity_id=source, split="train" if split == "regression" else split, **kw,
        ))
    return demos


def train_split_demonstrations(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore) -> list[Demonstration]:
    """The default SFT demonstrations (what ``flywheel train`` and the cycle use when none are given):
    :func:`demonstrations_from_tasks` over the latest ``[cycle] train_env`` environment (train-split
    evals and accepted synthetic tasks) and the latest ``[cycle] regression_suite`` when there is one.
    Raises ``LookupError`` when the training environment was never built."""
    env = load_env(store, artifacts, cfg.cycle.train_env)
    try:
        regression = load_suite(store, artifacts, cfg.cycle.regression_suite).tasks
    except LookupError:
        regression = []
    return demonstrations_from_tasks(env.tasks, regression)
