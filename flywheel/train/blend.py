"""Blend a trained LoRA adapter with the champion's it was trained from (``train.champion_blend``).

From cycle 2 on, the learning stage trains from the champion: its LoRA adapter is the starting point of
the new one. The gate compares the two on the held-out suite item by item, and most of what it sees
is churn: in the cpu profile's cycle 2 the trained adapter won 6-7 items and lost 2-9 of 70 in every
run measured, a few points of net lift under a dozen flips either way. Weight-space ensembling
(Wortsman et al. 2022, "Robust fine-tuning of zero-shot models", WiSE-FT) keeps part of the update:

    shipped = champion + w x (trained - champion)        for every LoRA parameter (A and B)

Both adapters have the same shape and the trained one started from the champion's parameters, so the
blend is an ordinary LoRA adapter of the same rank: served, merged and loaded like any other.
``w = 1`` ships the trained adapter as it is; ``w = 0.5`` is the midpoint. On six cycle-2 runs of the
demo the midpoint halved the flips, but on questions unlike the held-out suite's it kept only half of the
second turn's lift (docs/learning.md has both): no profile turns it on.

The blend is registered as its own version (``mode = blend``) with a ``training.completed`` run of no
steps, caused by both models, so ``flywheel trace`` reaches the corrections behind either.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig
from flywheel.policy.registry import ModelRefError, version_files
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import Tracker
from flywheel.train.stage import TrainResult, register_version
from flywheel.vocab.refs import parse_model_entity

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: adapter_config.json fields that must agree for a parameter-wise blend to mean anything
_SAME_CONFIG = ("r", "lora_alpha", "use_rslora", "use_dora", "peft_type")


class BlendError(ValueError):
    """Two adapters cannot be blended; the message names the reason."""


def blend_state(champion: dict[str, Any], trained: dict[str, Any], weight: float) -> dict[str, Any]:
    """``champion + weight * (trained - champion)`` per tensor, computed in float32 and stored in the
    trained tensor's dtype. Raises :class:`BlendError` when the keys or shapes differ."""
    if not 0.0 <= weight <= 1.0:
        raise BlendError(f"blend weight must be in [0, 1] (got {weight})")
    if set(champion) != set(trained):
        missing = sorted(set(trained) ^ set(champion))[:3]
        raise BlendError(f"the adapters hold different tensors (e.g. {missing})")
    out = {}
    for k, t in trained.items():
        c = champion[k]
        if tuple(c.shape) != tuple(t.shape):
            raise BlendError(f"tensor {k} has shape {tuple(c.shape)} in the champion and {tuple(t.shape)} trained")
        c32 = c.float()
        out[k] = (c32 + weight * (t.float() - c32)).to(t.dtype).contiguous()
    return out


def _config_mismatch(champion_dir: Path, trained_dir: Path) -> str | None:
    c0 = json.loads((champion_dir / ADAPTER_CONFIG).read_text())
    c1 = json.loads((trained_dir / ADAPTER_CONFIG).read_text())
    for k in _SAME_CONFIG:
        if c0.get(k) != c1.get(k):
            return f"adapter_config {k} differs ({c0.get(k)!r} vs {c1.get(k)!r})"
    if sorted(c0.get("target_modules") or []) != sorted(c1.get("target_modules") or []):
        return "the adapters target different modules"
    return None


def blend_with_champion(cfg: FlywheelConfig, store: EventStore, tracker: Tracker, *, trained: str, champion: str,
                        weight: float, correlation_id: str | None = None) -> tuple[TrainResult | None, dict[str, Any]]:
    """Register ``champion + weight x (trained - champion)`` as a new version of ``cfg.cycle.model_name``.

    ``trained`` and ``champion`` are ``model:<name>/<N>`` entities. Returns ``(result, record)``: the
    registered version (``None`` when the blend does not apply) and what ``learning.decided`` records
    (the weight, both models, the new version and its cost; or ``skipped`` with the reason: the
    champion is not a LoRA adapter, the adapters differ in base model, rank, targets or tensors).
    """
    from safetensors.torch import load_file, save_file

    record: dict[str, Any] = {"weight": weight, "trained": trained, "champion": champion}
    if not champion.startswith("model:"):
        return None, {**record, "skipped": f"the champion {champion} is a base model, not a LoRA adapter to blend with"}
    try:
        f0 = version_files(cfg, tracker, *parse_model_entity(champion))
        f1 = version_files(cfg, tracker, *parse_model_entity(trained))
    except (ValueError, ModelRefError) as e:
        return None, {**record, "skipped": str(e)}
    for ent, files in ((champion, f0), (trained, f1)):
        if not files.adapter:
            return None, {**record, "skipped": f"{ent} is a full model, not a LoRA adapter to blend"}
    if str(f0.base_model) != str(f1.base_model):
        return None, {**record, "skipped": f"the adapters apply to different base models ({f0.base_model} vs {f1.base_model})"}
    d0, d1 = Path(f0.directory), Path(f1.directory)
    mismatch = _config_mismatch(d0, d1)
    if mismatch:
        return None, {**record, "skipped": mismatch}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        state = blend_state(load_file(str(d0 / ADAPTER_WEIGHTS)), load_file(str(d1 / ADAPTER_WEIGHTS)), weight)
    except BlendError as e:
        return None, {**record, "skipped": str(e)}

    name = cfg.cycle.model_name
    run_id = f"run:{uuid.uuid4().hex[:16]}"
    causation = [trained, champion]
    mv = tracker.model_version(*parse_model_entity(trained))
    tags = dict(getattr(mv, "tags", {}) or {})
    base_spec = str(tags.get("base_model") or f1.base_model)
    with tracker.run("train-blend", consumes=causation, produces=[run_id], correlation_id=correlation_id,
                     tags={"flywheel.run": run_id, "flywheel.mode": "blend", "base_model": base_spec}) as run:
        run.log_params({"mode": "blend", "weight": weight, "trained": trained, "champion": champion})

        def write(tmp: Path) -> None:
            for f in d1.iterdir():  # the trained version's tokenizer, adapter config, template ...
                if f.is_file() and f.name not in (ADAPTER_WEIGHTS, "flywheel-train.json"):
                    shutil.copy2(f, tmp / f.name)
            save_file(state, str(tmp / ADAPTER_WEIGHTS))

        version = register_version(cfg, tracker, run, write, run_id=run_id, mode="blend", adapter="lora",
                                   base_spec=base_spec, base=str(tags.get("base") or trained), consumes=causation,
                                   meta={"blend": {"weight": weight, "trained": trained, "champion": champion}},
                                   tags={"blend_weight": weight})
    model_ent = f"model:{name}/{version}"
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    metrics = {"wall_s": wall, "cpu_s": cpu}
    store.append(run_id, NewEvent("training.completed", {
        "entity_id": run_id, "mlflow_run_id": run.run_id, "mode": "blend", "objective": "blend", "steps": 0,
        "loss": None, "metrics": metrics, "base": trained, "base_model": base_spec, "adapter": "lora",
        "blend": {"weight": weight, "trained": trained, "champion": champion},
    }, causation), correlation_id=correlation_id)
    store.append(f"model:{name}", NewEvent("model.registered", {
        "entity_id": model_ent, "name": name, "version": version, "run": run_id, "mlflow_run_id": run.run_id,
        "adapter": "lora", "base_model": base_spec, "aliases": ["challenger"],
    }, [run_id]), correlation_id=correlation_id)
    record.update({"model_entity": model_ent, "model_version": version, "run_id": run_id,
                   "mlflow_run_id": run.run_id, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)})
    return TrainResult(run_id=run_id, model_version=version, model_entity=model_ent, metrics=metrics, mode="blend",
                       mlflow_run_id=run.run_id, steps=0, adapter="lora", base=trained), record
