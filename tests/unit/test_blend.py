"""train.champion_blend (flywheel/train/blend.py): the shipped adapter keeps a share of the update from the
champion's adapter, parameter by parameter, registered as its own version with lineage to both."""

from __future__ import annotations

import json

import pytest
import torch

from flywheel.train.blend import BlendError, blend_state


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random model, built once per session."""
    from flywheel.policy.models import ensure_base_model

    return str(ensure_base_model("tiny", tmp_path_factory.mktemp("models")))


def test_blend_state_is_the_parameterwise_interpolation_in_the_trained_dtype():
    champ = {"a.lora_A.weight": torch.tensor([[1.0, 2.0]]), "a.lora_B.weight": torch.tensor([[0.0], [4.0]])}
    trained = {"a.lora_A.weight": torch.tensor([[3.0, -2.0]]), "a.lora_B.weight": torch.tensor([[2.0], [0.0]])}
    mid = blend_state(champ, trained, 0.5)
    assert mid["a.lora_A.weight"].tolist() == [[2.0, 0.0]] and mid["a.lora_B.weight"].tolist() == [[1.0], [2.0]]
    quarter = blend_state(champ, trained, 0.25)
    assert quarter["a.lora_A.weight"].tolist() == [[1.5, 1.0]]
    assert all(torch.equal(blend_state(champ, trained, 1.0)[k], trained[k]) for k in trained)
    assert all(torch.equal(blend_state(champ, trained, 0.0)[k], champ[k]) for k in champ)
    bf = {k: v.to(torch.bfloat16) for k, v in trained.items()}
    assert blend_state(champ, bf, 0.5)["a.lora_A.weight"].dtype == torch.bfloat16


def test_blend_state_refuses_adapters_that_do_not_line_up():
    champ = {"a.lora_A.weight": torch.zeros(2, 3)}
    with pytest.raises(BlendError, match="different tensors"):
        blend_state(champ, {"b.lora_A.weight": torch.zeros(2, 3)}, 0.5)
    with pytest.raises(BlendError, match="shape"):
        blend_state(champ, {"a.lora_A.weight": torch.zeros(4, 3)}, 0.5)
    with pytest.raises(BlendError, match=r"\[0, 1\]"):
        blend_state(champ, champ, 1.5)


@pytest.mark.slow
def test_blend_with_champion_registers_the_midpoint_loads_it_and_traces_both_parents(cfg, store, tiny_dir):
    """Two real SFT versions on the tiny model (the second trained from the first, as cycle 2 trains from the
    champion): the blend is a registered LoRA version whose every tensor is the midpoint, which loads and
    answers like any version; its lineage reaches both models and the demonstrations behind them. A champion
    that is a base model or a full model, or an adapter of another rank, is skipped with the reason."""
    from safetensors.torch import load_file

    from flywheel.artifacts import open_artifacts
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.tracking import Tracker
    from flywheel.train.blend import blend_with_champion
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft

    cfg.train.lora_r, cfg.train.batch_size, cfg.train.sft_lr, cfg.train.seed = 4, 2, 5e-3, 1
    artifacts, tracker = open_artifacts(cfg), Tracker(cfg)

    def demos(tag: str) -> list[Demonstration]:
        return [Demonstration(messages=[{"role": "user", "content": f"weather in city {i}?"}], tools=None,
                              source_entity_id=f"eval:{tag}{i}", split="train", answer_content=f"sunny, {i} degrees")
                for i in range(4)]

    champion = train_sft(cfg, store, artifacts, tracker, demos("w1-"), base=tiny_dir, steps=2)
    trained = train_sft(cfg, store, artifacts, tracker, demos("w2-"), base=champion.model_entity, steps=3)

    def weights(version: int) -> dict[str, torch.Tensor]:
        return load_file(str(tracker.model_dir(cfg.cycle.model_name, version) / "adapter_model.safetensors"))

    res, record = blend_with_champion(cfg, store, tracker, trained=trained.model_entity,
                                      champion=champion.model_entity, weight=0.5)
    assert res is not None and res.mode == "blend" and res.steps == 0
    assert record["model_entity"] == res.model_entity and record["weight"] == 0.5 and "skipped" not in record
    w0, w1, wb = weights(champion.model_version), weights(trained.model_version), weights(res.model_version)
    assert wb.keys() == w1.keys() and any(not torch.equal(w0[k], w1[k]) for k in w1)
    for k in w1:
        torch.testing.assert_close(wb[k].float(), (w0[k].float() + w1[k].float()) / 2, rtol=0, atol=1e-6, msg=k)
    assert tracker.get_alias_version(cfg.cycle.model_name, "challenger") == res.model_version
    cfg_dir = tracker.model_dir(cfg.cycle.model_name, res.model_version)
    assert json.loads((cfg_dir / "flywheel-train.json").read_text())["blend"]["champion"] == champion.model_entity

    policy = load_policy_for_version(cfg, tracker, cfg.cycle.model_name, res.model_version)
    (out,) = policy.generate([[{"role": "user", "content": "weather in city 1?"}]], 4)
    assert out is not None

    ancestors = {a for a, _ in store.lineage(res.model_entity, "down")}
    assert {trained.model_entity, champion.model_entity, "eval:w1-0", "eval:w2-3"} <= ancestors
    (done,) = store.read(res.run_id, types="training.completed")
    assert done.payload["mode"] == "blend" and done.payload["steps"] == 0
    assert set(done.causation) == {trained.model_entity, champion.model_entity}

    skipped, why = blend_with_champion(cfg, store, tracker, trained=trained.model_entity, champion="tiny", weight=0.5)
    assert skipped is None and "base model" in why["skipped"]
    cfg.train.lora_r = 8
    other = train_sft(cfg, store, artifacts, tracker, demos("w3-"), base=tiny_dir, steps=1)
    skipped, why = blend_with_champion(cfg, store, tracker, trained=other.model_entity,
                                       champion=champion.model_entity, weight=0.5)
    assert skipped is None and "r differs" in why["skipped"]
    cfg.train.lora_r = 0  # full fine-tuning: a registered full model (as cycle 1's champion, the base, is)
    full = train_sft(cfg, store, artifacts, tracker, demos("w4-"), base=tiny_dir, steps=1)
    skipped, why = blend_with_champion(cfg, store, tracker, trained=trained.model_entity,
                                       champion=full.model_entity, weight=0.5)
    assert skipped is None and why["skipped"] == f"{full.model_entity} is a full model, not a LoRA adapter to blend"
