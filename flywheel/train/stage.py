"""Training stages (what the CLI and the Prefect flows call): GRPO on rollouts, SFT on demonstrations.

Each stage: loads the base policy, trains with :class:`flywheel.train.trainer.Trainer`, records an
MLflow run (params, per-step metrics, input entity ids as tags), registers the result as a new version
of ``cfg.cycle.model_name`` with alias ``challenger``, and appends ``training.completed`` (stream
``run:<id>``) and ``model.registered`` (stream ``model:<name>``) events.

What a registered version holds
- LoRA (``lora_r > 0``): the peft adapter (``adapter_config.json``, ``adapter_model.safetensors``),
  the tokenizer, and ``flywheel-train.json``; the version is tagged ``adapter=lora`` and
  ``base_model=<spec or directory>``. Weights are NOT merged: load with :func:`load_policy` (or
  ``load_model(base_model, adapter=dir)``); vLLM serves it as a LoRA module on the base model.
- Full fine-tuning: a complete Hugging Face model directory (``adapter=full``).

``base`` may be a model spec (``tiny``, ``smollm2-135m``, a local directory) or a registered
version ``model:<name>/<N>``; training from a LoRA version continues its adapter.

Lineage: ``training.completed`` is caused by the rollout datasets (GRPO) or the demonstration
sources (SFT: eval/synth/trace ids) plus the base model's entity id (``model:<name>/<N>`` or
``model:base/<spec>``); ``model.registered`` is caused by the run.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig, objective_temperature
from flywheel.policy.models import load_model, resolve_device
from flywheel.policy.registry import ModelRefError, resolve_model, version_files
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import DatasetSpec, Tracker
from flywheel.train.demos import Demonstration, check_demonstrations
from flywheel.vocab.ids import canonical_json, json_id
from flywheel.vocab.refs import parse_model_entity

if TYPE_CHECKING:  # annotations only: flywheel.train.trainer imports torch
    from flywheel.train.trainer import TrainerOptions


@dataclass
class TrainResult:
    run_id: str  # run:<id>
    model_version: int
    model_entity: str  # model:<name>/<version>
    metrics: dict[str, float]
    mode: str = "grpo"
    mlflow_run_id: str = ""
    steps: int = 0
    adapter: str = "lora"
    base: str = ""
    history: list[dict[str, float]] = field(default_factory=list)
    #: The optimizer's state at the end (``keep_optimizer_state=True``): in memory only, for a phase of the
    #: learning stage that continues this run (``train.schedule = "one_run"``); never registered.
    optimizer_state: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("history", "optimizer_state")}


class TrainStageError(RuntimeError):
    """A training stage cannot run; the message names the input and the reason."""


# -- base model resolution ---------------------------------------------------------------------------


def base_entity(base: str) -> str:
    """Entity id of a base: ``model:<name>/<N>`` as is, a spec as ``model:base/<name>``."""
    if base.startswith("model:"):
        return base
    return f"model:base/{Path(base).name or base}"


def load_policy(cfg: FlywheelConfig, tracker: Tracker, base: str, *, device: str = "cpu") -> tuple[Any, Any, str]:
    """Load ``base`` (spec or ``model:<name>/<N>``) -> ``(model, tokenizer, base_model_spec)``.

    ``base_model_spec`` is what a LoRA adapter trained from it must be applied to. A registered
    version is read by the one rule of :func:`flywheel.policy.registry.version_files` (adapter or
    full model, and the adapter's base).
    """
    if not base.startswith("model:"):
        model, tok = load_model(base, home=cfg.home, device=device, dtype=cfg.policy.dtype)
        return model, tok, base
    try:
        files = version_files(cfg, tracker, *parse_model_entity(base))
    except (ValueError, ModelRefError) as e:
        raise TrainStageError(str(e)) from None
    if files.adapter:
        # float32: the adapter trains on as the optimizer's master copy, as a fresh one does (apply_lora)
        model, tok = load_model(files.base_model, home=cfg.home, device=device, dtype=cfg.policy.dtype,
                                adapter=files.directory, adapter_float32=True)
        return model, tok, files.base_model
    model, tok = load_model(str(files.directory), home=cfg.home, device=device, dtype=cfg.policy.dtype)
    return model, tok, base  # the registry reference, not this machine's directory: any worker resolves it


# -- shared run/registration plumbing ------------------------------------------------------------------


def trainer_options(cfg: FlywheelConfig, *, objective: str, lr: float, steps: int) -> TrainerOptions:
    """The :class:`~flywheel.train.trainer.TrainerOptions` of one run: every knob comes from
    ``cfg.train``; the run sets the objective, peak ``lr`` and length. The log-prob temperature is the
    sampler's for GRPO (:func:`flywheel.config.objective_temperature`) and 1.0 for SFT."""
    from flywheel.train.trainer import TrainerOptions  # torch: heavy, only when training

    try:
        temperature = 1.0 if objective == "sft" else objective_temperature(cfg)
    except ValueError as e:
        raise TrainStageError(str(e)) from None
    return TrainerOptions(
        objective=objective, lr=lr, total_steps=max(steps, 1), temperature=temperature,
        max_completion_len=cfg.train.objective.max_completion_len or cfg.rollout.max_new_tokens, train=cfg.train,
    )


def _device(cfg: FlywheelConfig) -> str:
    return resolve_device(cfg.policy.device)


def _train_and_register(
    cfg: FlywheelConfig, store: EventStore, tracker: Tracker, *, mode: str, base: str, consumes: list[str], model: Any,
    tokenizer: Any, base_spec: str, options: TrainerOptions, steps: int, step_batches: Callable[[Any], Any],
    on_step: Callable[[int, dict[str, float]], None] | None, extra_params: dict[str, Any], run_payload: dict[str, Any],
    datasets: list[DatasetSpec], budget_cpu_s: float | None = None,
    optimizer_state: dict[str, Any] | None = None, keep_optimizer_state: bool = False,
) -> TrainResult:
    from flywheel.train.trainer import Trainer  # torch: heavy, only when training

    run_id = f"run:{uuid.uuid4().hex[:16]}"
    name = cfg.cycle.model_name
    base_ent = base_entity(base)
    causation = list(dict.fromkeys([*consumes, base_ent]))
    if tokenizer.pad_token_id is not None:
        options = replace(options, pad_id=int(tokenizer.pad_token_id))
    try:
        trainer = Trainer(model, options, device=_device(cfg), optimizer_state=optimizer_state)
    except ValueError as e:
        if optimizer_state is None:
            raise
        raise TrainStageError(f"cannot continue from {base}: {e}") from None
    history: list[dict[str, float]] = []
    adapter = "lora" if trainer.is_lora else "full"
    with tracker.run(f"train-{mode}", consumes=causation, produces=[run_id],
                     tags={"flywheel.run": run_id, "flywheel.mode": mode, "base_model": base_spec}) as run:
        t = options.train
        run.log_params({
            "mode": mode, "objective": options.objective, "lr": options.lr, "steps": steps,
            "lora_r": t.lora_r, "lora_alpha": t.lora_alpha, "micro_batch_tokens": t.micro_batch_tokens,
            "warmup_steps": t.warmup_steps, "grad_clip": t.grad_clip, "logprob_impl": t.logprob_impl,
            "deepspeed": t.deepspeed or "", "base": base, "base_model": base_spec,
            "n_params": trainer.n_params, "n_trainable": trainer.n_trainable,
            **{f"objective.{k}": v for k, v in t.objective.model_dump().items()},
            "objective.temperature": options.temperature,
            **extra_params,
        })
        run.log_datasets(datasets)
        logged = len(datasets)
        t0, c0 = time.perf_counter(), time.process_time()
        stopped = ""
        for batch in step_batches(trainer):
            m = trainer.step(batch)
            flat = m.flat()
            history.append(flat)
            run.log_metrics({k: v for k, v in flat.items() if k != "step"}, step=m.step)
            if on_step is not None:
                on_step(m.step, flat)
            if budget_cpu_s is not None and time.process_time() - c0 >= budget_cpu_s:
                stopped = f"CPU budget of {budget_cpu_s} s reached after {len(history)} steps"
                break
        wall = time.perf_counter() - t0
        cpu_s = time.process_time() - c0
        run.log_datasets(datasets[logged:])  # rollouts sampled by later GRPO iterations
        summary = _summary(history, wall)
        summary["cpu_s"] = cpu_s
        run.log_metrics({f"final.{k}": v for k, v in summary.items()}, step=len(history))

        def write(tmp: Path) -> None:
            trainer.save(tmp)
            tokenizer.save_pretrained(str(tmp))

        version = register_version(cfg, tracker, run, write, run_id=run_id, mode=mode, adapter=adapter,
                                   base_spec=base_spec, base=base, consumes=causation)
    model_ent = f"model:{name}/{version}"
    store.append(run_id, NewEvent("training.completed", {
        "entity_id": run_id, "mlflow_run_id": run.run_id, "mode": mode, "objective": options.objective,
        "steps": len(history), "loss": summary.get("loss"), "metrics": summary, "base": base, "base_model": base_spec,
        "adapter": adapter, **run_payload, **({"stopped": stopped} if stopped else {}),
        **({"threads": trainer.threads.summary()} if trainer.threads is not None else {}),
    }, causation))
    store.append(f"model:{name}", NewEvent("model.registered", {
        "entity_id": model_ent, "name": name, "version": version, "run": run_id, "mlflow_run_id": run.run_id,
        "adapter": adapter, "base_model": base_spec, "aliases": ["challenger"],
    }, [run_id]))
    return TrainResult(run_id=run_id, model_version=version, model_entity=model_ent, metrics=summary, mode=mode,
                       mlflow_run_id=run.run_id, steps=len(history), adapter=adapter, base=base, history=history,
                       optimizer_state=trainer.optimizer_state() if keep_optimizer_state else None)


def register_version(cfg: FlywheelConfig, tracker: Tracker, run: Any, write: Callable[[Path], None], *, run_id: str,
                     mode: str, adapter: str, base_spec: str, base: str, consumes: list[str],
                     meta: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> int:
    """Register what ``write(dir)`` puts in a fresh directory (weights, tokenizer) as a new version of
    ``cfg.cycle.model_name`` from MLflow run ``run``, with ``flywheel-train.json`` (``meta`` added) and the
    version tags (``tags`` added); alias it ``challenger`` and tag the run with what it produced."""
    name = cfg.cycle.model_name
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-train-", dir=cfg.home))
    try:
        write(tmp)
        (tmp / "flywheel-train.json").write_text(json.dumps(
            {"run": run_id, "mode": mode, "adapter": adapter, "base_model": base_spec, "base": base,
             "consumes": consumes, **(meta or {})}, indent=1, sort_keys=True))
        version = tracker.register_model(
            name, tmp, run_id=run.run_id,
            tags={"base_model": base_spec, "adapter": adapter, "flywheel.run": run_id, "mode": mode, "base": base,
                  **(tags or {})},
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tracker.set_alias(name, "challenger", version)
    # The run produced the training run entity and the registered version.
    run.set_tags({"flywheel.produces": f"{run_id},model:{name}/{version}", "flywheel.model": f"model:{name}/{version}"})
    return version


def _summary(history: list[dict[str, float]], wall: float) -> dict[str, float]:
    if not history:
        return {"wall_s": wall}
    last = history[-1]
    tokens = sum(h["tokens"] for h in history)
    out = {k: float(v) for k, v in last.items() if k not in ("step", "seconds", "tokens_per_s")}
    out["first_loss"] = float(history[0]["loss"])
    out["tokens_per_s"] = tokens / max(sum(h["seconds"] for h in history), 1e-9)
    out["wall_s"] = wall
    return out


# -- MLflow dataset inputs ---------------------------------------------------------------------------


def rollouts_dataset(entity_id: str, table: Any, payload: dict[str, Any]) -> DatasetSpec:
    """A published rollout dataset as a ``training`` input: digest = its Parquet artifact's sha256 (for
    rollouts sampled during training, which carry no payload here: the id, itself a hash of the inputs)."""
    sha = (payload.get("artifact") or {}).get("sha256") or ""
    source = {"artifact": f"sha256:{sha}"} if sha else {}
    return DatasetSpec(entity_id, "training", sha[:16] or entity_id.split(":", 1)[-1][:16], table.num_rows,
                       schema=table.schema, source={**source, "envs": payload.get("env_ids"), "policy": payload.get("policy")})


def demonstrations_dataset(demos: Sequence[Demonstration], sources: Sequence[str]) -> DatasetSpec:
    """SFT demonstrations as a ``demonstrations`` input, named ``demonstrations@<digest>``: the digest
    hashes every demonstration (conversation, tools, answer, source), the source lists the
    event-store entities they came from (the same ids as the run's causation, at most 200)."""
    rows = [{"source_entity_id": d.source_entity_id, "split": d.split, "messages": canonical_json(d.messages),
             "tools": canonical_json(d.tools or []),
             "answer": canonical_json([[c.name, c.arguments] for c in d.answer_calls] if d.answer_calls
                                      else d.answer_content)} for d in demos]
    schema = pa.schema([(k, pa.string()) for k in ("source_entity_id", "split", "messages", "tools", "answer")])
    digest = json_id(rows)
    return DatasetSpec(f"demonstrations@{digest}", "demonstrations", digest, len(rows), schema=schema,
                       source={"entity_ids": list(sources)[:200], "entities": len(sources)})


# -- GRPO -------------------------------------------------------------------------------------------


def _check_sampling_temperature(tables: Sequence[tuple[str, Any, dict[str, Any]]], temperature: float) -> None:
    """Every rollout dataset was sampled at the objective's temperature, and not greedily."""
    if temperature == 0.0:
        raise TrainStageError(
            "rollout.temperature is 0 (greedy): GRPO needs sampled groups (greedy samples of one prompt are all "
            "the same answer) and log-probs at a finite temperature; set rollout.temperature > 0")
    for eid, _, payload in tables:
        sampled = (payload.get("params") or {}).get("temperature")
        if sampled is None:
            continue  # datasets published without their sampling parameters: nothing to compare
        if float(sampled) == 0.0:
            raise TrainStageError(
                f"{eid} was sampled greedily (temperature 0): every sample of a group is the same answer, so "
                "GRPO has no signal, and no log-prob temperature matches a greedy sampler; sample rollouts with "
                "rollout.temperature > 0")
        if float(sampled) != float(temperature):
            raise TrainStageError(
                f"{eid} was sampled at temperature {sampled} but the objective computes log-probs at "
                f"{temperature} (train.objective.temperature, default rollout.temperature): the importance ratio "
                "would compare two different distributions; sample new rollouts or set rollout.temperature to "
                f"{sampled}")


def train_grpo(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    rollout_ids: Sequence[str],
    *,
    base: str | None = None,
    loss: str | None = None,
    steps: int | None = None,
    lr: float | None = None,
    rollout_fn: Callable[[Any], Any] | None = None,
    iterations: int = 1,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    exclude_tasks: set[str] | frozenset[str] = frozenset(),
    budget_cpu_s: float | None = None,
    drop_zero_variance: bool = False,
) -> TrainResult:
    """GRPO-family training on published rollout datasets; registers the result as ``challenger``.

    ``exclude_tasks``: task ids whose groups are not trained on (the learning stage's dev split);
    ``budget_cpu_s``: stop once the run has used this many process CPU-seconds; ``drop_zero_variance``:
    DAPO's dynamic sampling on the given datasets -- groups whose rewards are all equal (no advantage,
    no gradient) are dropped and every batch is filled with groups that carry signal.

    ``steps`` optimizer steps per iteration of ``cfg.train.batch_size`` sequences (whole groups) at
    peak learning rate ``lr`` (default ``cfg.train.lr``); every other knob is ``cfg.train``. With
    ``iterations > 1`` and a ``rollout_fn`` (:class:`flywheel.train.trainer.RolloutCallback`), later
    iterations sample fresh rollouts from the current policy; a returned table whose schema metadata
    carries ``flywheel.entity_id`` (a published ``rollouts:<id>``) is added to the run's causation.

    Refused (:class:`TrainStageError`) before any model is loaded: a rollout dataset sampled at a
    temperature other than the objective's (the importance ratio would compare two distributions),
    and greedy rollouts (temperature 0: every sample of a group is the same answer, so there is no
    group signal, and no finite temperature matches a greedy sampler).
    """
    from flywheel.train.data import load_rollout_tables, samples_from_rollouts  # torch: heavy
    from flywheel.train.trainer import batches  # torch: heavy, only when training

    if not rollout_ids:
        raise TrainStageError("train_grpo needs at least one rollout dataset id")
    if iterations > 1 and rollout_fn is None:
        raise TrainStageError("iterations > 1 needs a rollout_fn to sample fresh rollouts")
    base = base or cfg.policy.base_model
    variant = loss or cfg.train.loss
    n_steps = cfg.train.steps if steps is None else steps
    tables = load_rollout_tables(store, artifacts, rollout_ids)
    consumes = [eid for eid, _, _ in tables]
    opts = trainer_options(cfg, objective=variant, lr=cfg.train.lr if lr is None else lr, steps=n_steps * iterations)
    _check_sampling_temperature(tables, opts.temperature)

    def to_samples(table: Any) -> list[Any]:
        return samples_from_rollouts(
            table, scale=cfg.rollout.advantage, objective=cfg.train.objective,
            max_completion_len=cfg.rollout.max_new_tokens,
        )[0]

    samples, stats_list = [], []
    datasets = [rollouts_dataset(eid, table, payload) for eid, table, payload in tables]
    for eid, table, _ in tables:
        s, st = samples_from_rollouts(table, scale=cfg.rollout.advantage, objective=cfg.train.objective,
                                      max_completion_len=cfg.rollout.max_new_tokens, source=eid)
        for x in s:  # group ids are only unique within one dataset
            x.group_id = f"{eid}#{x.group_id}"
        samples.extend(x for x in s if x.task_id not in exclude_tasks)
        stats_list.append(st.to_dict())
    if drop_zero_variance:
        rewards: dict[str, set[float]] = {}
        for x in samples:
            rewards.setdefault(x.group_id, set()).add(round(float(x.reward), 9))
        samples = [x for x in samples if len(rewards[x.group_id]) > 1]
    if not samples:
        raise TrainStageError(f"rollouts {consumes}: no usable samples (all rows had infra errors?)")
    model, tok, base_spec = load_policy(cfg, tracker, base, device=_device(cfg))

    def step_batches(trainer: Any):
        current = samples
        for it in range(iterations):
            if it > 0:
                trainer.policy.eval()
                table = rollout_fn(trainer.policy)
                trainer.policy.train()
                meta = (table.schema.metadata or {}).get(b"flywheel.entity_id")
                if meta:
                    consumes.append(meta.decode())
                    datasets.append(rollouts_dataset(meta.decode(), table, {}))
                current = to_samples(table)
                if not current:
                    continue
            if n_steps > 1:
                trainer.compute_old_logprobs(current)
            yield from batches(current, cfg.train.batch_size, n_steps, seed=cfg.train.seed + it)

    return _train_and_register(
        cfg, store, tracker, mode="grpo", base=base, consumes=consumes, model=model, tokenizer=tok,
        base_spec=base_spec, options=opts, steps=n_steps, step_batches=step_batches, on_step=on_step,
        extra_params={"iterations": iterations, "advantage": cfg.rollout.advantage, "batch_size": cfg.train.batch_size,
                      "rollout_rows": sum(s["rows"] for s in stats_list)},
        run_payload={"rollouts": consumes, "rollout_stats": stats_list}, datasets=datasets, budget_cpu_s=budget_cpu_s,
    )


# -- SFT --------------------------------------------------------------------------------------------


def train_sft(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    demonstrations: Sequence[Demonstration],
    *,
    base: str | None = None,
    steps: int | None = None,
    lr: float | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    budget_cpu_s: float | None = None,
    start_step: int = 0,
    schedule: tuple[int, int] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    keep_optimizer_state: bool = False,
    extra_demonstrations: Sequence[Demonstration] = (),
    decision_weight: float | None = None,
) -> TrainResult:
    """Supervised warm start on demonstrations (answer tokens only); registers the result as ``challenger``.
    ``budget_cpu_s``: stop once the run has used this many process CPU-seconds (the learning stage's arms).
    ``start_step``: resume the data stream of an earlier run on the same demonstrations after its first
    ``start_step`` batches (same seed), so continued training sees new batches, not the first ones again.
    ``schedule = (offset, total)``: this run is steps ``offset ..`` of one warm-up + cosine schedule of
    ``total`` steps (default: its own schedule of ``steps``); ``optimizer_state``: AdamW's state where an
    earlier phase stopped (``keep_optimizer_state=True`` returns it in :attr:`TrainResult.optimizer_state`).
    Together they make phases of the learning stage one uninterrupted run.
    ``extra_demonstrations``: trained exactly once each, added round-robin to the run's batches
    (:func:`flywheel.train.trainer.spread`) without changing the data stream of ``demonstrations`` (the
    learning stage's dev corrections and regression repairs in a continuation).
    ``decision_weight``: the loss weight of the answer tokens that decide its structure (default
    ``cfg.train.decision_weight``; 1.0 is plain SFT, :func:`flywheel.train.sft.decision_token_weights`).

    Refuses held-out demonstrations (:class:`flywheel.train.demos.HeldOutDemonstrationError`) before
    loading anything. ``cfg.train.sft_steps`` steps of ``cfg.train.batch_size`` demonstrations at
    ``cfg.train.sft_lr`` unless ``steps``/``lr`` say otherwise; every other knob is ``cfg.train``.
    """
    from flywheel.train.sft import demonstration_samples  # torch: heavy, only when training
    from flywheel.train.trainer import batches, spread  # torch: heavy, only when training

    if not demonstrations:
        raise TrainStageError("train_sft needs at least one demonstration")
    extras = list(extra_demonstrations)
    check_demonstrations([*demonstrations, *extras], store)
    base = base or cfg.policy.base_model
    n_steps = cfg.train.sft_steps if steps is None else steps
    model, tok, base_spec = load_policy(cfg, tracker, base, device=_device(cfg))
    weight = cfg.train.decision_weight if decision_weight is None else decision_weight
    every = demonstration_samples(tok, [*demonstrations, *extras], decision_weight=weight)
    samples, extra_samples = every[: len(demonstrations)], every[len(demonstrations):]
    # Each demonstration is its own group, so `batches` shuffles them individually.
    opts = trainer_options(cfg, objective="sft", lr=cfg.train.sft_lr if lr is None else lr, steps=n_steps)
    if schedule is not None:
        offset, total = schedule
        if offset < 0 or total < offset + 1:
            raise TrainStageError(f"train_sft: schedule (offset {offset}, total {total}) must have 0 <= offset < total")
        opts = replace(opts, schedule_offset=offset, total_steps=total)
    sources = list(dict.fromkeys(d.source_entity_id for d in [*demonstrations, *extras]))

    def step_batches(trainer: Any):
        stream = batches(samples, cfg.train.batch_size, n_steps, seed=cfg.train.seed, skip=start_step)
        yield from (spread(stream, extra_samples, n_steps) if extra_samples and n_steps > 0 else stream)

    return _train_and_register(
        cfg, store, tracker, mode="sft", base=base, consumes=sources, model=model, tokenizer=tok,
        base_spec=base_spec, options=opts, steps=n_steps, step_batches=step_batches, on_step=on_step,
        extra_params={"demonstrations": len(demonstrations), "extra_demonstrations": len(extras),
                      "batch_size": cfg.train.batch_size, "start_step": start_step,
                      "schedule_offset": opts.schedule_offset, "schedule_total": opts.total_steps,
                      "resumed_optimizer": optimizer_state is not None, "decision_weight": weight},
        run_payload={"demonstrations": len(demonstrations), "sources": len(sources), "start_step": start_step,
                     **({"extra_demonstrations": len(extras)} if extras else {}),
                     **({"schedule": {"offset": opts.schedule_offset, "total": opts.total_steps,
                                      "resumed_optimizer": optimizer_state is not None}} if schedule is not None else {})},
        datasets=[demonstrations_dataset([*demonstrations, *extras], sources)], budget_cpu_s=budget_cpu_s,
        optimizer_state=optimizer_state, keep_optimizer_state=keep_optimizer_state,
    )


def choose_mode(zero_variance_share: float, pass_at_k: float, *, threshold: float) -> tuple[str, str]:
    """The ``auto`` policy: ``("sft", why)`` when GRPO would learn (almost) nothing, else grpo.

    SFT first when the share of zero-variance groups exceeds ``threshold`` (default 0.9) or no
    sample passed at all (pass@K = 0): every advantage is then (nearly) zero.
    """
    if pass_at_k <= 0.0:
        return "sft", "pass@K is 0: no sample ever passed, every GRPO advantage would be 0"
    if zero_variance_share > threshold:
        return "sft", f"{zero_variance_share:.0%} of groups have zero reward variance (> {threshold:.0%})"
    return "grpo", f"{zero_variance_share:.0%} zero-variance groups, pass@K {pass_at_k:.2f}"


def resolve_base(cfg: FlywheelConfig, tracker: Tracker, ref: str | None = None) -> str:
    """What to train from: ``ref`` (any reference of :func:`flywheel.policy.registry.resolve_model`;
    default ``champion``, as the cycle does) as ``model:<name>/<N>`` for a registered version, else
    the base spec or directory. A server URL is refused: training needs the weights."""
    m = resolve_model(cfg, tracker, ref or "champion")
    if m.url is not None:
        raise TrainStageError(f"cannot train from {m.url}: a server URL has no weights to train")
    return m.ref if m.version is not None else m.spec  # type: ignore[return-value]


def latest_rollouts(store: EventStore) -> list[str]:
    """The default rollouts of ``flywheel train``: the most recently published rollout dataset, as
    ``[rollouts:<id>]`` (empty when none was ever published)."""
    last = store.read(types="rollouts.published", limit=1, newest_first=True)
    return [last[0].stream] if last else []


def auto_mode(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, rollout_ids: Sequence[str]) -> tuple[str, str]:
    """``train.mode = auto`` over published rollout datasets: :func:`choose_mode` on their share of
    zero-variance groups and whether any sample passed (rows with an infrastructure error excluded)."""
    import torch  # heavy: only when choosing a mode over rollouts

    from flywheel.advantages import zero_variance_share  # torch: heavy, only when choosing a mode
    from flywheel.train.data import load_rollout_tables  # torch: heavy, only when choosing a mode

    zv, passed, n = 0.0, 0, 0
    for _, t, _ in load_rollout_tables(store, artifacts, rollout_ids):
        d = t.to_pydict()
        ok = [e is None for e in d.get("infra_error", [None] * t.num_rows)]
        r = torch.tensor([x for x, k in zip(d["reward"], ok, strict=True) if k])
        g = [x for x, k in zip(d["group_id"], ok, strict=True) if k]
        zv += zero_variance_share(r, g) * len(set(g))
        n += len(set(g))
        passed += sum(p for p, k in zip(d["passed"], ok, strict=True) if k)
    return choose_mode(zv / max(n, 1), float(passed > 0), threshold=cfg.train.sft_trigger_zero_variance)
