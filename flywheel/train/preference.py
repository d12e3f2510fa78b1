"""Preference pairs from the flywheel's own data, and RPO (DPO + NLL on the chosen answer) on them.

A pair is a prompt, the answer that should have been given (*chosen*: the eval's reference, i.e. a
person's or an oracle's correction, or a verified success) and an answer the policy really gave that
failed (*rejected*). Two sources:

- ``production`` (:func:`pairs_from_tasks`): the champion's own wrong answer, the last assistant
  message of the trace the eval was compiled from. The compiled eval does not keep it; the failure
  entity (``metadata.origin_failure``) does (``bad_answer`` of ``failure.classified``), and
  :func:`failed_answers` reads it from the store. (A task whose ``metadata`` carries ``bad_answer``
  is read directly; the compiler is left unchanged so recorded eval ids and records stay bit-exact.)
- ``sampled`` (:func:`pairs_from_samples`): the policy's own verifier-scored samples that failed, for
  cycle 1, where the production answers are the base model's prose.

Pairs are published as zstd Parquet (``schemas/preferences.py``) through the content-addressed
artifact store by :func:`publish_pairs`, announced by one ``preferences.published`` event on stream
``preferences:<id>`` whose causation is the pairs' source evals, so ``flywheel trace`` walks from a
model trained on them (``model -> run -> preferences -> eval -> failure -> trace``) to the traces.
:func:`train_rpo` trains on them and registers the result like SFT.

Guarantees
- A held-out task is never turned into a pair: :func:`pairs_from_tasks` and :func:`pairs_from_samples`
  refuse one (:class:`HeldOutPairError`), and :func:`check_pairs` (called by :func:`publish_pairs` and
  :func:`train_rpo`) refuses pairs by split and, with a store, by lineage, as
  :func:`flywheel.train.demos.check_demonstrations` does for demonstrations.
- A pair's two answers differ: a failed answer whose rendering equals the chosen one is skipped, and
  skips are counted by reason (``skipped=``).
- Both answers are rendered exactly as SFT renders a target (:func:`flywheel.policy.format.render_answer`
  for the chosen answer; :func:`flywheel.policy.format` 's assistant-turn rule for a recorded failure:
  well-formed calls in the pythonic format, malformed calls verbatim) and end with the tokenizer's
  end-of-turn token.
- :func:`publish_pairs` is idempotent: the id hashes the pairs (order-free), a second publication
  appends nothing and writes nothing.
- The DPO reference is the starting weights: their sequence log-probs are computed once, under
  ``no_grad``, before the first update (no second model in memory).

Not guaranteed / not covered
- Rewards of ``production`` pairs are the production labels (chosen 1.0, rejected 0.0), not re-scored
  by the verifier; ``sampled`` pairs carry the verifier's reward of the rejected sample.
- Rejected answers are not truncated: a long prose answer costs its full length in every step.
- Multi-turn episodes: only the final answer is compared; earlier turns are prompt.

Torch-free at import (the cycle and the CLI build pairs without loading a trainer); :func:`train_rpo`
imports torch when called.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.policy.format import _assistant_text, render_answer
from flywheel.schemas.gx_suites import validate_frame
from flywheel.schemas.preferences import PREFERENCE_SCHEMA, PREFERENCE_SOURCES
from flywheel.store import EventStore, NewEvent
from flywheel.train.demos import HELDOUT, Demonstration, HeldOutDemonstrationError, check_demonstrations
from flywheel.vocab import ToolCall
from flywheel.vocab.ids import canonical_json, content_id, json_id

if TYPE_CHECKING:  # annotations only: these import torch
    from flywheel.tracking import Tracker
    from flywheel.train.stage import TrainResult
    from flywheel.train.trainer import PreferenceSample

__all__ = [
    "HeldOutPairError", "PreferenceDataError", "PreferencePair", "check_pairs", "failed_answers", "load_pairs",
    "pairs_from_samples", "pairs_from_tasks", "preference_samples", "publish_pairs", "scored_samples",
    "train_rpo",
]


class HeldOutPairError(HeldOutDemonstrationError):
    """A pair comes from (or descends from) a held-out eval: training on it would leak the gate."""


class PreferenceDataError(ValueError):
    """A preference dataset is unusable; the message names it and the reason."""


@dataclass(frozen=True, kw_only=True)
class PreferencePair:
    """One prompt, the answer that should have been given, and one that was given and failed.

    ``chosen_calls`` (a list of :class:`flywheel.vocab.ToolCall`) or ``chosen_content`` (text);
    ``rejected_text`` is the failed answer as the policy wrote it (no end-of-turn token);
    ``source`` is ``production`` or ``sampled``; ``source_entity_id`` the eval (or synth batch) the
    pair comes from, which becomes the causation of the published dataset and the training run.
    """

    task_id: str
    messages: list[dict]
    tools: list[dict] | None
    chosen_calls: list[ToolCall] | None = None
    chosen_content: str | None = None
    rejected_text: str
    chosen_reward: float = 1.0
    rejected_reward: float = 0.0
    source: str = "production"
    source_entity_id: str
    split: str = "train"

    def __post_init__(self) -> None:
        if not self.chosen_calls and self.chosen_content is None:
            raise ValueError(f"pair from {self.source_entity_id}: needs chosen_calls or chosen_content")
        if not self.rejected_text.strip():
            raise ValueError(f"pair from {self.source_entity_id}: rejected_text is empty")
        if self.source not in PREFERENCE_SOURCES:
            raise ValueError(f"pair from {self.source_entity_id}: source {self.source!r} is not one of "
                             f"{', '.join(PREFERENCE_SOURCES)}")

    @property
    def chosen_text(self) -> str:
        """The chosen answer as an SFT target renders it (without the end-of-turn token)."""
        return render_answer(self.chosen_calls or None, self.chosen_content)

    def demonstration(self) -> Demonstration:
        """The chosen side as an SFT demonstration (same rendering, same held-out checks)."""
        return Demonstration(messages=self.messages, tools=self.tools, source_entity_id=self.source_entity_id,
                             split=self.split, answer_calls=self.chosen_calls, answer_content=self.chosen_content)

    def to_row(self) -> dict[str, Any]:
        """The pair as a row of :data:`flywheel.schemas.preferences.PREFERENCE_SCHEMA`."""
        calls = ([{"name": c.name, "arguments": c.arguments} for c in self.chosen_calls]
                 if self.chosen_calls else None)
        row = {
            "task_id": self.task_id, "messages": canonical_json(self.messages), "tools": canonical_json(self.tools or []),
            "chosen": self.chosen_text, "chosen_calls": canonical_json(calls) if calls is not None else None,
            "chosen_content": self.chosen_content if not calls else None, "rejected": self.rejected_text,
            "chosen_reward": float(self.chosen_reward), "rejected_reward": float(self.rejected_reward),
            "source": self.source, "source_entity_id": self.source_entity_id, "split": self.split,
        }
        return {"pair_id": json_id(row), **row}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> PreferencePair:
        calls = json.loads(row["chosen_calls"]) if row.get("chosen_calls") else None
        tools = json.loads(row["tools"]) or None
        return cls(
            task_id=row["task_id"], messages=json.loads(row["messages"]), tools=tools,
            chosen_calls=[ToolCall(c["name"], c.get("arguments") or {}) for c in calls] if calls else None,
            chosen_content=row.get("chosen_content"), rejected_text=row["rejected"],
            chosen_reward=float(row["chosen_reward"]), rejected_reward=float(row["rejected_reward"]),
            source=row["source"], source_entity_id=row["source_entity_id"], split=row["split"],
        )


# -- building pairs -----------------------------------------------------------------------------------


def _split(task: Mapping[str, Any]) -> str:
    return str((task.get("metadata") or {}).get("split", "train"))


def _refuse_heldout(tasks: Iterable[Mapping[str, Any]]) -> None:
    for t in tasks:
        if _split(t) == HELDOUT:
            raise HeldOutPairError(
                f"task {t.get('task_id')} is in the held-out split: held-out evals decide the gate and must "
                "never become preference pairs")


def _chosen(task: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"chosen_calls": [...]}`` or ``{"chosen_content": str}`` from the task's reference, or None."""
    ref = task.get("reference") or {}
    if ref.get("tool_calls"):
        return {"chosen_calls": [ToolCall(c["name"], c.get("arguments") or {}) for c in ref["tool_calls"]]}
    if ref.get("content") is not None:
        return {"chosen_content": str(ref["content"])}
    return None


def _source(task: Mapping[str, Any]) -> str:
    # As for demonstrations: a synthetic task is named by its batch (an entity of the store, caused by
    # its seed evals), an eval by its own id, so lineage reaches the failures.
    return (task.get("metadata") or {}).get("synth_batch") or str(task["task_id"])


def _answer_text(answer: Any, where: str) -> str:
    """A recorded answer (an OpenAI assistant message, or already text) as the policy would write it."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, Mapping):
        return _assistant_text(dict(answer), where)
    raise ValueError(f"{where}: an answer must be an assistant message or text, got {type(answer).__name__}")


def failed_answers(store: EventStore, tasks: Iterable[Mapping[str, Any]]) -> dict[str, dict]:
    """``task_id -> the failed assistant message`` of each task compiled from a production failure:
    the ``bad_answer`` of its ``metadata.origin_failure`` entity (``failure.classified``)."""
    out: dict[str, dict] = {}
    for t in tasks:
        fid = (t.get("metadata") or {}).get("origin_failure")
        if not fid:
            continue
        ent = store.entity(str(fid))
        bad = ((ent or {}).get("state") or {}).get("bad_answer")
        if isinstance(bad, dict):
            out[str(t["task_id"])] = bad
    return out


def pairs_from_tasks(
    train_tasks: Iterable[Mapping[str, Any]],
    failed: Mapping[str, Any] | None = None,
    *,
    store: EventStore | None = None,
    skipped: Counter[str] | None = None,
) -> list[PreferencePair]:
    """``production`` pairs: each train-split failure eval's reference (chosen) against the production
    answer that failed (rejected, rewards 1.0 / 0.0).

    The failed answer is ``task["metadata"]["bad_answer"]`` when the task carries one, else
    ``failed[task_id]``; without ``failed``, it is read from ``store`` (:func:`failed_answers`: the
    compiled eval does not keep it, its failure entity does). With neither, every task without an
    inline ``bad_answer`` is skipped as ``no_failed_answer``. A held-out task raises
    :class:`HeldOutPairError`; other tasks are skipped and counted in ``skipped`` by reason:
    ``not_train`` (regression / excluded split), ``no_reference``, ``no_failed_answer``,
    ``unreadable_failed_answer``, ``same_as_chosen``.
    """
    tasks = list(train_tasks)
    _refuse_heldout(tasks)
    skipped = skipped if skipped is not None else Counter()
    if failed is None and store is not None:
        failed = failed_answers(store, tasks)
    failed = failed or {}
    pairs = []
    for t in tasks:
        tid = str(t["task_id"])
        if _split(t) != "train":
            skipped["not_train"] += 1
            continue
        chosen = _chosen(t)
        if chosen is None:
            skipped["no_reference"] += 1
            continue
        bad = (t.get("metadata") or {}).get("bad_answer") or failed.get(tid)
        if bad is None:
            skipped["no_failed_answer"] += 1
            continue
        try:
            text = _answer_text(bad, f"{tid}: failed answer")
        except ValueError:
            skipped["unreadable_failed_answer"] += 1
            continue
        if not text.strip():
            skipped["no_failed_answer"] += 1
            continue
        pair = PreferencePair(task_id=tid, messages=t["prompt"]["messages"], tools=t["prompt"].get("tools") or None,
                              rejected_text=text, source="production", source_entity_id=_source(t), **chosen)
        if text.strip() == pair.chosen_text.strip():
            skipped["same_as_chosen"] += 1
            continue
        pairs.append(pair)
    return pairs


def _scored(sample: Any) -> tuple[str, float, bool, bool]:
    """``(text, reward, passed, trainable)`` of a rollout row (dict) or a harness episode."""
    if isinstance(sample, Mapping):
        text = sample.get("completion", sample.get("text"))
        return (str(text or ""), float(sample.get("reward", 0.0)), bool(sample.get("passed", False)),
                not sample.get("infra_error"))
    verdict = sample.verdict
    return (str(sample.completion_text or ""), float(verdict.reward), bool(verdict.passed),
            bool(verdict.ok_for_training))


def scored_samples(table: pa.Table) -> dict[str, list[dict[str, Any]]]:
    """A rollout table (``schemas/rollouts.py``) as ``task_id -> [{completion, reward, passed,
    infra_error}]`` in sample order, the input :func:`pairs_from_samples` takes."""
    cols = table.select(["task_id", "sample_idx", "completion", "reward", "passed", "infra_error"]).to_pylist()
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(cols, key=lambda r: (r["task_id"], r["sample_idx"])):
        out.setdefault(r["task_id"], []).append(r)
    return out


def pairs_from_samples(
    tasks: Iterable[Mapping[str, Any]],
    samples_by_task: Mapping[str, Sequence[Any]],
    *,
    max_per_task: int = 2,
    skipped: Counter[str] | None = None,
) -> list[PreferencePair]:
    """``sampled`` pairs: each train-split task's reference (chosen, reward 1.0) against up to
    ``max_per_task`` distinct samples of the policy that the verifier failed (rejected, with their
    reward), lowest reward first, ties in sample order.

    A sample is a rollout row (a dict with ``completion``, ``reward``, ``passed``, ``infra_error``;
    :func:`scored_samples`) or a harness episode (``completion_text``, ``verdict``). Samples with an
    infrastructure error or a verdict unfit for training are never used (an infrastructure failure
    is not a failed answer). A held-out task raises :class:`HeldOutPairError`; skips are counted in
    ``skipped``: ``not_train``, ``no_reference``, ``no_failed_sample`` (tasks), ``same_as_chosen``
    (samples).
    """
    if max_per_task < 1:
        raise ValueError(f"max_per_task must be >= 1, got {max_per_task}")
    tasks = list(tasks)
    _refuse_heldout(tasks)
    skipped = skipped if skipped is not None else Counter()
    pairs = []
    for t in tasks:
        tid = str(t["task_id"])
        if _split(t) != "train":
            skipped["not_train"] += 1
            continue
        chosen = _chosen(t)
        if chosen is None:
            skipped["no_reference"] += 1
            continue
        chosen_text = render_answer(chosen.get("chosen_calls"), chosen.get("chosen_content")).strip()
        failed = [(r, i, text) for i, (text, r, passed, ok) in enumerate(map(_scored, samples_by_task.get(tid, ())))
                  if ok and not passed and text.strip()]
        seen: set[str] = set()
        n = 0
        for reward, _, text in sorted(failed, key=lambda x: (x[0], x[1])):
            if text.strip() == chosen_text:
                skipped["same_as_chosen"] += 1
                continue
            if text in seen:
                continue
            seen.add(text)
            pairs.append(PreferencePair(
                task_id=tid, messages=t["prompt"]["messages"], tools=t["prompt"].get("tools") or None,
                rejected_text=text, rejected_reward=reward, source="sampled", source_entity_id=_source(t), **chosen,
            ))
            n += 1
            if n >= max_per_task:
                break
        if n == 0:
            skipped["no_failed_sample"] += 1
    return pairs


def check_pairs(pairs: Sequence[PreferencePair], store: EventStore | None = None) -> None:
    """Refuse held-out pairs: by split, and with ``store`` by lineage (a pair whose source descends
    from a held-out eval), with :class:`HeldOutPairError`."""
    try:
        check_demonstrations([p.demonstration() for p in pairs], store)
    except HeldOutPairError:
        raise
    except HeldOutDemonstrationError as e:
        raise HeldOutPairError(f"preference pair: {e}") from None


# -- the Parquet dataset ------------------------------------------------------------------------------


def _frame(table: pa.Table) -> Any:
    df = table.select(["pair_id", "task_id", "source", "split", "source_entity_id", "chosen_reward",
                       "rejected_reward"]).to_pandas()
    chosen, rejected = table["chosen"].to_pylist(), table["rejected"].to_pylist()
    df["chosen_len"] = [len(c.strip()) for c in chosen]
    df["rejected_len"] = [len(r.strip()) for r in rejected]
    df["same_answer"] = [int(c.strip() == r.strip()) for c, r in zip(chosen, rejected, strict=True)]
    return df


def publish_pairs(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    pairs: Sequence[PreferencePair],
    *,
    correlation_id: str | None = None,
) -> str:
    """Publish ``pairs`` as one Parquet dataset; returns its entity id ``preferences:<id>``.

    The id hashes the pairs' ids (sorted: the same pairs in any order are the same dataset). Refused
    before anything is written: held-out pairs (:func:`check_pairs`, by lineage), and a dataset that
    fails the ``preferences`` expectation suite (``schemas/gx/preferences.json``). Then the artifact
    is written atomically (content-addressed, zstd) and one ``preferences.published`` event is
    appended, caused by the pairs' source entities. Publishing the same pairs again returns the id
    and appends nothing.
    """
    if not pairs:
        raise PreferenceDataError("publish_pairs needs at least one pair")
    check_pairs(pairs, store)
    rows = sorted({r["pair_id"]: r for r in (p.to_row() for p in pairs)}.values(), key=lambda r: r["pair_id"])
    pid = content_id("preferences", [r["pair_id"] for r in rows])
    existing = store.entity(pid)
    if existing is not None and existing["last_type"] == "preferences.published":
        return pid
    table = pa.Table.from_pylist(rows, schema=PREFERENCE_SCHEMA)
    ok, report = validate_frame("preferences", _frame(table), {})
    if not ok:
        raise PreferenceDataError(f"preference dataset {pid} failed its expectation suite; not published: "
                                  f"{json.dumps(report)[:800]}")
    ref = artifacts.put_table(table, row_group_size=cfg.rollout.row_group_size)
    sources = list(dict.fromkeys(r["source_entity_id"] for r in rows))
    payload = {
        "entity_id": pid, "artifact": ref.to_dict(), "pairs": len(rows),
        "tasks": len({r["task_id"] for r in rows}), "sources": len(sources),
        "by_source": dict(sorted(Counter(r["source"] for r in rows).items())),
        "schema_version": int(PREFERENCE_SCHEMA.metadata[b"flywheel.schema_version"]),
    }
    store.append(pid, [NewEvent("preferences.published", payload, sources)], expected_version=0,
                 correlation_id=correlation_id)
    return pid


def load_pairs(store: EventStore, artifacts: ArtifactStore, preferences_id: str) -> list[PreferencePair]:
    """The pairs of a published dataset (its artifact's sha256 verified on read)."""
    pid = preferences_id if preferences_id.startswith("preferences:") else f"preferences:{preferences_id}"
    ent = store.entity(pid)
    if ent is None or ent["last_type"] != "preferences.published":
        raise PreferenceDataError(f"{pid}: no preferences.published event in the store")
    art = ent["state"].get("artifact") or {}
    table = artifacts.read_table(art["sha256"])
    if art.get("rows") is not None and table.num_rows != int(art["rows"]):
        raise PreferenceDataError(f"{pid}: artifact has {table.num_rows} rows, the event says {art['rows']}")
    return [PreferencePair.from_row(r) for r in table.to_pylist()]


# -- training -----------------------------------------------------------------------------------------


def preference_samples(tokenizer: Any, pairs: Sequence[PreferencePair]) -> list[PreferenceSample]:
    """Tokenised pairs: the prompt rendered as SFT renders it, each answer + end-of-turn as the
    completion with loss mask 1 on every answer token (the same rule as SFT targets)."""
    from flywheel.train.data import TrainSample  # torch: heavy, only when training
    from flywheel.train.sft import end_of_turn, render_demonstration
    from flywheel.train.trainer import PreferenceSample

    eot = end_of_turn(tokenizer)
    out = []
    for p in pairs:
        prompt, chosen = render_demonstration(tokenizer, p.demonstration(), eot)
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        c = list(tokenizer(chosen, add_special_tokens=False)["input_ids"])
        r = list(tokenizer(p.rejected_text + eot, add_special_tokens=False)["input_ids"])
        pid = p.to_row()["pair_id"]
        out.append(PreferenceSample(
            chosen=TrainSample(prompt_ids=ids, completion_ids=c, loss_mask=[1] * len(c), group_id=pid),
            rejected=TrainSample(prompt_ids=list(ids), completion_ids=r, loss_mask=[1] * len(r), group_id=pid),
            group_id=pid,
        ))
    return out


def preferences_dataset(pairs: Sequence[PreferencePair], preferences_id: str | None, sources: Sequence[str]) -> Any:
    """The pairs as a ``training`` input of the MLflow run: the published dataset by id when given,
    else ``preferences@<digest>`` over the pairs' ids."""
    from flywheel.tracking import DatasetSpec

    ids = sorted(p.to_row()["pair_id"] for p in pairs)
    digest = json_id(ids)
    return DatasetSpec(preferences_id or f"preferences@{digest}", "training", digest, len(pairs),
                       schema=PREFERENCE_SCHEMA, source={"entity_ids": list(sources)[:200], "entities": len(sources)})


def train_rpo(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    pairs: Sequence[PreferencePair],
    *,
    base: str | None = None,
    steps: int | None = None,
    lr: float | None = None,
    beta: float = 0.1,
    alpha: float = 1.0,
    batch_pairs: int | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    preferences_id: str | None = None,
    budget_cpu_s: float | None = None,
    start_step: int = 0,
) -> TrainResult:
    """RPO on preference pairs (``alpha = 0``: DPO); registers the result as ``challenger`` like SFT.

    ``steps`` optimizer steps (default ``cfg.train.sft_steps``) of ``batch_pairs`` pairs (default
    ``cfg.train.batch_size // 2``: as many sequences as an SFT step) at peak learning rate ``lr``
    (default ``cfg.train.sft_lr``); ``beta`` and ``alpha`` as in :func:`flywheel.train.losses.rpo_loss`;
    every other knob is ``cfg.train`` (LoRA, micro-batch tokens, clipping, schedule). ``base`` is a
    model spec or ``model:<name>/<N>`` (:func:`flywheel.train.stage.load_policy`). ``budget_cpu_s``:
    stop once the run has used this many process CPU-seconds (the reference pass counts: it is part
    of what RPO costs). ``start_step``: skip the first batches of the same pair stream (a continued run).

    Before the first update the starting weights' sequence log-probs of every pair are computed once
    (the DPO reference). The run (mode ``rpo``) is caused by the pairs' source entities, the published
    dataset ``preferences_id`` when given, and the base model. Refused before loading a model:
    no pairs, held-out pairs (split or lineage), an unpublished ``preferences_id``, ``beta <= 0``.
    """
    from flywheel.train import stage  # torch: heavy, only when training
    from flywheel.train.trainer import TrainerOptions, batches

    if not pairs:
        raise stage.TrainStageError("train_rpo needs at least one preference pair")
    if beta <= 0 or alpha < 0:
        raise stage.TrainStageError(f"train_rpo needs beta > 0 and alpha >= 0, got beta={beta}, alpha={alpha}")
    check_pairs(pairs, store)
    if preferences_id is not None:
        ent = store.entity(preferences_id)
        if ent is None or ent["last_type"] != "preferences.published":
            raise stage.TrainStageError(f"{preferences_id}: no preferences.published event in the store")
    base = base or cfg.policy.base_model
    n_steps = cfg.train.sft_steps if steps is None else steps
    n_batch = batch_pairs or max(1, cfg.train.batch_size // 2)
    model, tok, base_spec = stage.load_policy(cfg, tracker, base, device=stage._device(cfg))
    samples = preference_samples(tok, pairs)
    # The GRPO KL term is not part of this objective (the DPO reference is precomputed): beta 0 keeps
    # the trainer from holding a reference copy of a fully fine-tuned model.
    train_cfg = cfg.train.model_copy(update={"objective": cfg.train.objective.model_copy(update={"beta": 0.0})})
    opts = TrainerOptions(objective="rpo", lr=cfg.train.sft_lr if lr is None else lr, total_steps=max(n_steps, 1),
                          temperature=1.0, train=train_cfg)
    sources = list(dict.fromkeys(p.source_entity_id for p in pairs))
    consumes = [*sources, *([preferences_id] if preferences_id else [])]

    def step_batches(trainer: Any):
        trainer.preference_reference(samples)
        # stage._train_and_register drives `trainer.step(batch)`: on this trainer a step is a
        # preference step (an instance attribute; the class's step is untouched).
        trainer.step = functools.partial(trainer.preference_step, beta=beta, alpha=alpha)
        yield from batches(samples, n_batch, n_steps, seed=cfg.train.seed, skip=start_step)  # type: ignore[arg-type]

    by_source = dict(sorted(Counter(p.source for p in pairs).items()))
    return stage._train_and_register(
        cfg, store, tracker, mode="rpo", base=base, consumes=consumes, model=model, tokenizer=tok,
        base_spec=base_spec, options=opts, steps=n_steps, step_batches=step_batches, on_step=on_step,
        extra_params={"pairs": len(pairs), "batch_pairs": n_batch, "rpo.beta": beta, "rpo.alpha": alpha,
                      "preferences": preferences_id or ""},
        run_payload={"pairs": len(pairs), "sources": len(sources), "by_source": by_source,
                     "preferences": preferences_id, "beta": beta, "alpha": alpha},
        datasets=[preferences_dataset(pairs, preferences_id, sources)], budget_cpu_s=budget_cpu_s,
    )
