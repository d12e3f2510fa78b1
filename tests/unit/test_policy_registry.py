"""Model references against the registry (flywheel.policy.registry): what each reference resolves
to, and the one rule for what a registered version's files hold (adapter or full model, and the
adapter's base). The tracker is a stand-in holding versions, tags, directories and aliases: the rules
under test read nothing else."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flywheel.policy.registry import ModelRefError, VersionFiles, resolve_model, version_files


@dataclass
class _Version:
    tags: dict = field(default_factory=dict)


class FakeRegistry:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions: dict[tuple[str, int], _Version] = {}
        self.aliases: dict[tuple[str, str], int] = {}

    def add(self, name: str, version: int, tags: dict | None = None, adapter_config: dict | None = None) -> Path:
        self.versions[(name, version)] = _Version(dict(tags or {}))
        d = self.model_dir(name, version)
        d.mkdir(parents=True)
        if adapter_config is not None:
            (d / "adapter_config.json").write_text(json.dumps(adapter_config))
        return d

    def model_version(self, name: str, version: int) -> _Version:
        if (name, version) not in self.versions:
            raise KeyError(f"RESOURCE_DOES_NOT_EXIST: {name} v{version}")
        return self.versions[(name, version)]

    def model_dir(self, name: str, version: int) -> Path:
        return self.root / name / str(version)

    def get_alias_version(self, name: str, alias: str) -> int | None:
        return self.aliases.get((name, alias))


@pytest.fixture
def reg(tmp_path):
    return FakeRegistry(tmp_path / "models")


def test_champion_before_the_first_promotion_is_the_base_model(cfg, reg):
    m = resolve_model(cfg, reg, None)
    assert (m.ref, m.spec, m.version, m.entity_id) == (f"base:{cfg.policy.base_model}", cfg.policy.base_model,
                                                       None, None)
    with pytest.raises(ModelRefError, match="alias 'champion'"):
        resolve_model(cfg, reg, "champion", registered_only=True)


def test_aliases_resolve_to_the_version_holding_them(cfg, reg):
    name = cfg.cycle.model_name
    reg.add(name, 3)
    reg.aliases[(name, "champion")] = 3
    m = resolve_model(cfg, reg, "champion")
    assert (m.ref, m.name, m.version, m.entity_id) == (f"model:{name}/3", name, 3, f"model:{name}/3")
    with pytest.raises(ModelRefError, match="no model version of .* has the alias 'challenger'"):
        resolve_model(cfg, reg, "challenger")


def test_version_references_must_name_a_registered_version(cfg, reg):
    name = cfg.cycle.model_name
    reg.add(name, 2)
    assert resolve_model(cfg, reg, f"model:{name}/2").version == 2
    assert resolve_model(cfg, reg, f"{name}/2").entity_id == f"model:{name}/2"
    assert resolve_model(cfg, reg, "2", bare_version=True).version == 2
    with pytest.raises(ModelRefError, match=f"model:{name}/9 is not a registered version"):
        resolve_model(cfg, reg, f"model:{name}/9")
    with pytest.raises(ModelRefError, match="model version id"):
        resolve_model(cfg, reg, "model:no-version")


def test_urls_and_specs_pass_through_unless_a_registered_version_is_required(cfg, reg):
    assert resolve_model(cfg, reg, "http://127.0.0.1:8000/v1").url == "http://127.0.0.1:8000/v1"
    m = resolve_model(cfg, reg, "some/local-dir")
    assert (m.ref, m.spec) == ("base:some/local-dir", "some/local-dir")
    with pytest.raises(ModelRefError, match="not a registered model version"):
        resolve_model(cfg, reg, "some/local-dir", registered_only=True)
    assert resolve_model(cfg, reg, "2").spec == "2"  # a bare number is a version only where asked for


def test_version_files_adapter_rule_and_its_base(cfg, reg):
    name = cfg.cycle.model_name
    full = reg.add(name, 1, tags={"adapter": "full"})
    assert version_files(cfg, reg, name, 1) == VersionFiles(full, False, None)
    # the marker file decides; the base comes from the tag first ...
    reg.add(name, 2, tags={"base_model": "tagged-base"}, adapter_config={"base_model_name_or_path": "cfg-base"})
    assert version_files(cfg, reg, name, 2) == VersionFiles(reg.model_dir(name, 2), True, "tagged-base")
    # ... then the adapter config's base ...
    reg.add(name, 3, adapter_config={"base_model_name_or_path": "cfg-base"})
    assert version_files(cfg, reg, name, 3).base_model == "cfg-base"
    # ... then [policy] base_model; and an adapter tag counts without the marker
    reg.add(name, 4, tags={"adapter": "lora"})
    f = version_files(cfg, reg, name, 4)
    assert (f.adapter, f.base_model) == (True, cfg.policy.base_model)
    with pytest.raises(ModelRefError, match=f"model:{name}/5 is not a registered version"):
        version_files(cfg, reg, name, 5)
