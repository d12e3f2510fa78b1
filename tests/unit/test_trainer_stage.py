"""train_grpo end to end on a tiny model: MLflow run + registered version + events + lineage."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random model, built once per session (tokenizer conversion from the GGUF takes ~5 s)."""
    from flywheel.policy.models import ensure_base_model

    return str(ensure_base_model("tiny", tmp_path_factory.mktemp("models")))


def rollout_table(n_groups: int = 2, k: int = 4) -> pa.Table:
    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for g in range(n_groups):
        for i in range(k):
            r = float(i % 2)
            comp = [100 + g, 200 + i, 300]
            vals = {
                "task_id": f"t{g}", "env_id": "env:train@1", "group_id": f"g{g}", "sample_idx": i,
                "policy_version": "model:base/tiny", "messages": "[]", "completion": "x",
                "prompt_token_ids": [1, 50 + g, 60], "completion_token_ids": comp,
                "sampler_logprobs": [-10.0, -10.5, -11.0], "loss_mask": [1, 1, 1], "truncated": False,
                "reward": r, "reward_components": [("pass", r)], "passed": r > 0, "advantage": 0.0,
                "finish_reason": "stop", "infra_error": "sandbox died" if (g, i) == (1, 3) else None,
                "generation_ms": 1.0, "verify_ms": 1.0,
            }
            for key, v in vals.items():
                rows[key].append(v)
    return pa.table(rows, schema=ROLLOUT_SCHEMA)


def publish(store, artifacts, rid: str, table: pa.Table) -> str:
    from flywheel.store import NewEvent

    ref = artifacts.put_table(table)
    eid = f"rollouts:{rid}"
    store.append(eid, NewEvent("rollouts.published", {
        "entity_id": eid, "artifact": {"sha256": ref.sha256, "rows": ref.rows}, "env_ids": ["env:train@1"],
        "policy": "model:base/tiny", "stats": {},
    }, ["env:train@1"]))
    return eid


@pytest.mark.slow
def test_train_grpo_registers_challenger_and_records_lineage(cfg, store, tiny_dir):
    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.stage import train_grpo

    cfg.train.lora_r = 4
    cfg.train.batch_size = 8
    artifacts = open_artifacts(cfg)
    tracker = Tracker(cfg)
    rid = publish(store, artifacts, "r1", rollout_table())
    res = train_grpo(cfg, store, artifacts, tracker, [rid], base=tiny_dir, loss="dapo", steps=2, lr=1e-3)
    assert res.model_entity == f"model:{cfg.cycle.model_name}/{res.model_version}"
    assert res.steps == 2 and res.adapter == "lora"
    assert tracker.get_alias_version(cfg.cycle.model_name, "challenger") == res.model_version
    d = tracker.model_dir(cfg.cycle.model_name, res.model_version)
    assert (d / "adapter_config.json").exists() and (d / "flywheel-train.json").exists()
    ev = store.read(res.run_id)[0]
    assert ev.type == "training.completed" and set(ev.causation) == {rid, "model:base/tiny"}
    assert ev.payload["mlflow_run_id"] == res.mlflow_run_id
    # 7 of 8 rows used: the infra error is excluded, never scored.
    assert ev.payload["rollout_stats"][0]["infra_errors"] == 1
    reg = store.read(f"model:{cfg.cycle.model_name}")[-1]
    assert reg.type == "model.registered" and reg.causation == [res.run_id]
    ancestors = {a for a, _ in store.lineage(res.model_entity, "down")}
    assert {res.run_id, rid, "env:train@1"} <= ancestors
    run = tracker.get_run(res.mlflow_run_id)
    assert "loss" in run.data.metrics and "grad_norm" in run.data.metrics
    assert run.data.tags["flywheel.input.0"] == rid
    # MLflow's own lineage: the run's dataset input is the rollout dataset, by entity id and digest.
    (di,) = run.inputs.dataset_inputs
    sha = store.entity(rid)["state"]["artifact"]["sha256"]
    assert di.dataset.name == rid and di.dataset.digest == sha[:16] and di.dataset.source_type == "flywheel"
    assert {t.key: t.value for t in di.tags}["mlflow.data.context"] == "training"

    # Continue training from the registered LoRA version: its adapter is loaded and trained further.
    res2 = train_grpo(cfg, store, artifacts, tracker, [rid], base=res.model_entity, steps=1)
    assert res2.model_version == res.model_version + 1
    assert res.model_entity in store.read(res2.run_id)[0].causation


def test_unknown_rollouts_are_refused(cfg, store):
    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.data import TrainDataError
    from flywheel.train.stage import train_grpo

    with pytest.raises(TrainDataError, match="rollouts:nope: no rollouts.published"):
        train_grpo(cfg, store, open_artifacts(cfg), Tracker(cfg), ["nope"], base="tiny")


def test_choose_mode():
    from flywheel.train.stage import choose_mode

    assert choose_mode(0.5, 0.0, threshold=0.9)[0] == "sft"
    assert choose_mode(0.95, 0.2, threshold=0.9)[0] == "sft"
    assert choose_mode(0.5, 0.2, threshold=0.9)[0] == "grpo"


def _publish_sampled_at(store, artifacts, rid: str, temperature: float) -> str:
    from flywheel.store import NewEvent

    ref = artifacts.put_table(rollout_table())
    eid = f"rollouts:{rid}"
    store.append(eid, NewEvent("rollouts.published", {
        "entity_id": eid, "artifact": {"sha256": ref.sha256, "rows": ref.rows}, "env_ids": ["env:train@1"],
        "policy": "model:base/tiny", "stats": {}, "params": {"temperature": temperature, "n": 4},
    }, ["env:train@1"]))
    return eid


@pytest.mark.parametrize("sampled,rollout_t,needle", [
    (0.7, 1.0, "sampled at temperature 0.7 but the objective computes log-probs at 1.0"),
    (0.0, 1.0, "sampled greedily \\(temperature 0\\)"),
    (1.0, 0.0, "rollout.temperature is 0 \\(greedy\\)"),
])
def test_grpo_refuses_rollouts_sampled_at_another_temperature(cfg, store, sampled, rollout_t, needle):
    """Finding: rollout.temperature and train.objective.temperature had to agree and nothing checked it.
    The dataset records the temperature it was sampled at; GRPO refuses a mismatch, and greedy data,
    before loading any model (base '/nonexistent' would fail later)."""
    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.stage import TrainStageError, train_grpo

    cfg.rollout.temperature = rollout_t
    artifacts = open_artifacts(cfg)
    rid = _publish_sampled_at(store, artifacts, "t", sampled)
    with pytest.raises(TrainStageError, match=needle):
        train_grpo(cfg, store, artifacts, Tracker(cfg), [rid], base="/nonexistent")


def test_dynamic_sampling_drops_zero_variance_groups_and_refills_batches_from_signal_groups(cfg, store, tiny_dir,
                                                                                           monkeypatch):
    """Issue 30 (DAPO dynamic sampling): with drop_zero_variance, all-pass and all-fail groups never reach
    the trainer, nor do the dev split's tasks (exclude_tasks); every batch is filled with signal groups."""
    import flywheel.train.trainer as trainer_mod
    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.stage import train_grpo

    rows = rollout_table(n_groups=4, k=4).to_pylist()
    for r in rows:
        g = int(r["group_id"][1:])
        r["infra_error"] = None
        if g == 1:
            r["reward"], r["passed"] = 0.0, False  # all fail: no signal
        elif g == 2:
            r["reward"], r["passed"] = 1.0, True  # all pass: no signal
        # g0 and g3 alternate 0/1 (signal); t3 is the dev split's task
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    cfg.train.lora_r = 4
    cfg.train.batch_size = 4
    artifacts = open_artifacts(cfg)
    rid = publish(store, artifacts, "dyn", table)
    seen: list[list[str]] = []
    real_batches = trainer_mod.batches

    def spy(samples, batch_size, steps, *, seed=0):
        for b in real_batches(samples, batch_size, steps, seed=seed):
            seen.append([s.group_id for s in b])
            yield b

    monkeypatch.setattr(trainer_mod, "batches", spy)
    res = train_grpo(cfg, store, artifacts, Tracker(cfg), [rid], base=tiny_dir, steps=2, lr=1e-3,
                     drop_zero_variance=True, exclude_tasks={"t3"})
    assert res.steps == 2 and len(seen) == 2
    # only group g0 carries signal outside the dev split: every batch is 4 of its samples
    assert all(len(b) == 4 and {g.rsplit("#", 1)[-1] for g in b} == {"g0"} for b in seen), seen


def test_sft_phases_through_the_registry_are_one_run_when_the_schedule_and_optimizer_carry(cfg, store, tiny_dir):
    """Issue 30 (train.schedule = one_run): the learning stage trains its first pass, the control's trial and
    its continuation as three registered versions. Carrying the schedule (offset, total) and AdamW's state
    through train_sft -- the adapter saved, registered and loaded back between phases -- gives the adapter
    one train_sft of all the steps gives; the phases without them (per_phase) give another."""
    from safetensors.torch import load_file

    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft

    cfg.train.lora_r, cfg.train.batch_size, cfg.train.sft_lr, cfg.train.seed = 4, 2, 5e-3, 1
    artifacts, tracker = open_artifacts(cfg), Tracker(cfg)
    demos = [Demonstration(messages=[{"role": "user", "content": f"weather in city {i}?"}], tools=None,
                           source_entity_id=f"eval:e{i}", split="train", answer_content=f"sunny, {i} degrees")
             for i in range(6)]

    def adapter(res):
        d = tracker.model_dir(cfg.cycle.model_name, res.model_version)
        return load_file(str(d / "adapter_model.safetensors"))

    torch.manual_seed(0)  # LoRA's A starts random: every fresh adapter below starts from the same one
    one = adapter(train_sft(cfg, store, artifacts, tracker, demos, base=tiny_dir, steps=5))
    torch.manual_seed(0)
    a = train_sft(cfg, store, artifacts, tracker, demos, base=tiny_dir, steps=3, schedule=(0, 5), keep_optimizer_state=True)
    assert a.optimizer_state is not None and "optimizer_state" not in a.to_dict()
    b = train_sft(cfg, store, artifacts, tracker, demos, base=a.model_entity, steps=2, start_step=3, schedule=(3, 5),
                  optimizer_state=a.optimizer_state)
    two = adapter(b)
    assert one.keys() == two.keys() and one
    for n in one:
        torch.testing.assert_close(two[n], one[n], rtol=0, atol=1e-6, msg=n)
    ev = store.read(b.run_id)[0].payload
    assert ev["schedule"] == {"offset": 3, "total": 5, "resumed_optimizer": True} and ev["start_step"] == 3

    torch.manual_seed(0)
    p = train_sft(cfg, store, artifacts, tracker, demos, base=tiny_dir, steps=3)
    restarted = adapter(train_sft(cfg, store, artifacts, tracker, demos, base=p.model_entity, steps=2, start_step=3))
    assert any(not torch.allclose(restarted[n], one[n], atol=1e-4) for n in one)


def test_extra_demonstrations_are_trained_once_each_on_top_of_the_same_stream(cfg, store, tiny_dir):
    """train_sft(extra_demonstrations=...): the learning stage's dev corrections and regression repairs join a
    continuation's steps (each once) without reshuffling the demonstrations' own stream."""
    from flywheel.artifacts import open_artifacts
    from flywheel.tracking import Tracker
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft

    cfg.train.lora_r, cfg.train.batch_size, cfg.train.seed = 4, 2, 1
    artifacts, tracker = open_artifacts(cfg), Tracker(cfg)

    def demo(i: int, source: str) -> Demonstration:
        return Demonstration(messages=[{"role": "user", "content": f"weather in city {i}?"}], tools=None,
                             source_entity_id=source, split="train", answer_content=f"sunny, {i} degrees")

    demos = [demo(i, f"eval:e{i}") for i in range(6)]
    extras = [demo(90, "eval:r1"), demo(91, "eval:dev1"), demo(90, "eval:r1")]
    plain = train_sft(cfg, store, artifacts, tracker, demos, base=tiny_dir, steps=3, start_step=2)
    more = train_sft(cfg, store, artifacts, tracker, demos, base=tiny_dir, steps=3, start_step=2,
                     extra_demonstrations=extras)
    from transformers import AutoTokenizer

    from flywheel.train.sft import demonstration_samples

    per_extra = [s.n_loss_tokens for s in demonstration_samples(AutoTokenizer.from_pretrained(tiny_dir), extras)]
    added = [m["loss_tokens"] - p["loss_tokens"] for m, p in zip(more.history, plain.history, strict=True)]
    assert added == per_extra and min(added) > 0  # step i trained the same batch as before plus extras[i]
    ev = store.read(more.run_id)[0]
    assert ev.payload["extra_demonstrations"] == 3 and ev.payload["demonstrations"] == 6
    assert {"eval:r1", "eval:dev1", "eval:e0"} <= set(ev.causation)
