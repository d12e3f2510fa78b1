"""Issue 34, item 2: an adapter trained on one machine is loaded on another by its registry reference alone.

Found by tests/integration/test_team_mode.py: an adapter trained from a registered *full* model (the champion
`flywheel init` registers) recorded its base as the directory that version had been downloaded to on the
training machine (`/…/gpu-worker/models/registry/policy/1`), so `flywheel serve --model model:policy/2` on
another machine failed with "not a local directory". The base is now recorded as `model:policy/1` and
resolved on each machine; versions recorded the old way fall back to their `base` tag."""

from __future__ import annotations

import json

import pytest

from flywheel.deploy import bootstrap_champion
from flywheel.policy.registry import ModelRefError, version_files
from flywheel.tracking import Tracker


@pytest.fixture
def registry(cfg, store, tmp_path):
    tracker = Tracker(cfg)
    version, _ = bootstrap_champion(cfg, store, tracker)  # the base (tiny) as a full registered model
    base_dir = version_files(cfg, tracker, "policy", version).directory

    def adapter(tags: dict) -> int:
        d = tmp_path / f"adapter-{len(list(tmp_path.glob('adapter-*')))}"
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere/not/here"}))
        with tracker.run("t") as run:
            return tracker.register_model("policy", d, run_id=run.run_id, tags={"adapter": "lora", **tags})

    return tracker, version, base_dir, adapter


@pytest.fixture
def cfg(cfg):
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"base_model": "tiny"})})


def test_a_base_recorded_as_a_registry_reference_resolves_to_this_machines_copy(cfg, registry):
    tracker, v1, base_dir, adapter = registry
    v2 = adapter({"base_model": f"model:policy/{v1}", "base": f"model:policy/{v1}"})
    files = version_files(cfg, tracker, "policy", v2)
    assert files.adapter and files.base_model == str(base_dir)


def test_a_base_recorded_as_another_machines_directory_falls_back_to_its_registry_reference(cfg, registry):
    tracker, v1, base_dir, adapter = registry
    v2 = adapter({"base_model": "/other-machine/home/models/registry/policy/1", "base": f"model:policy/{v1}"})
    assert version_files(cfg, tracker, "policy", v2).base_model == str(base_dir)


def test_an_adapter_cannot_be_the_base_of_an_adapter(cfg, registry):
    tracker, v1, _, adapter = registry
    v2 = adapter({"base_model": f"model:policy/{v1}"})
    v3 = adapter({"base_model": f"model:policy/{v2}"})
    with pytest.raises(ModelRefError, match="itself an adapter"):
        version_files(cfg, tracker, "policy", v3)


def test_training_from_a_registered_full_model_records_its_reference(cfg, registry):
    from flywheel.train.stage import load_policy

    tracker, v1, base_dir, _ = registry
    _, _, spec = load_policy(cfg, tracker, f"model:policy/{v1}")
    assert spec == f"model:policy/{v1}"
    assert str(cfg.home) not in spec
