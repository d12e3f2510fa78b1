"""The layer contracts of pyproject.toml ([tool.importlinter]) hold for the tree, and each kind of
contract catches a violation planted in a copy of it.

grimp (import-linter's graph) walks the root package's directory, so the packages mapped from other
folders by ``[tool.setuptools] package-dir`` (flows/, kernels/, schemas/, warehouse/) would be
invisible and every import of them silently dropped: the tree is staged in its installed layout
first (``<tmp>/flywheel/flows`` ...), and ``lint-imports`` runs on that copy, with ``.ci/`` on the path
for the contract type of its own that pyproject.toml registers (``config_sections``: each stage reads
only the configuration sections it declares).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
CI = ROOT / ".ci"  # config_sections_contract.py, the contract type of the "config-sections" contract


def _lint_imports() -> str:
    exe = Path(sys.executable).parent / "lint-imports"
    found = str(exe) if exe.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed: it is in the dev extra (pip install -e '.[dev]')"
    return found


def stage_tree(dest: Path) -> Path:
    """Copy the package into ``dest`` in its installed layout; return the staged root package dir."""
    mapping = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*package.split("."))
        if target.exists():  # a mapped subpackage replaces whatever the parent's copy holds there
            shutil.rmtree(target)
        shutil.copytree(ROOT / folder, target, ignore=ignore)
    return dest / "flywheel"


def run_contracts(staged_root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(staged_root.parent), str(CI)])}
    return subprocess.run([_lint_imports(), str(PYPROJECT), "--no-cache"], cwd=staged_root.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_layer_contract(tmp_path):
    res = run_contracts(stage_tree(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 kept, 0 broken" in res.stdout


def test_staging_sees_the_packages_mapped_from_other_folders(tmp_path):
    root = stage_tree(tmp_path)
    for sub in ("flows/cycle.py", "kernels/fused_logprob.py", "schemas/rollouts.py", "warehouse/__init__.py"):
        assert (root / sub).is_file(), sub


@pytest.mark.parametrize(
    ("module", "planted", "message"),
    [
        # core importing a face
        ("store/local.py", "import flywheel.cli", "flywheel.store is not allowed to import flywheel.cli"),
        # inside the event store: the base class importing a backend (the cycle the package's layers forbid)
        ("store/contract.py", "from flywheel.store.local import DuckDBEventStore",
         "flywheel.store.contract is not allowed to import flywheel.store.local"),
        # the DuckDB backend importing the PostgreSQL one (the backends are independent)
        ("store/local.py", "from flywheel.store.postgres import PostgresEventStore",
         "flywheel.store.local is not allowed to import flywheel.store.postgres"),
        # a stage importing another stage (lazily: function-level imports count)
        ("rollouts.py", "from flywheel.gate import run_gate", "flywheel.rollouts is not allowed to import flywheel.gate"),
        # a face in flows/ (mapped from another folder) imported by core
        ("versioning.py", "import flywheel.flows.cycle", "flywheel.versioning is not allowed to import flywheel.flows"),
        # core pulling a heavy optional package
        ("config/loading.py", "import torch", "flywheel.config is not allowed to import torch"),
        # production code importing a test helper
        ("synth/__init__.py", "from flywheel.envs.testing import failure_payload",
         "- flywheel.synth -> flywheel.envs.testing"),
        # a stage reading a configuration section it does not declare
        ("gate/__init__.py", "return cfg.synth", "flywheel.gate reads cfg.synth: flywheel.gate may read only"),
        # a module on no line of the map reading a section (an engine is handed its section instead)
        ("split.py", "return cfg.gate", "flywheel.split reads cfg.gate: it is on no line of the map"),
    ],
)
def test_a_planted_violation_breaks_the_contracts(tmp_path, module, planted, message):
    root = stage_tree(tmp_path)
    target = root / module
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {planted}\n")
    res = run_contracts(root)
    assert res.returncode != 0, res.stdout
    assert message in res.stdout, res.stdout + res.stderr


def test_importing_the_config_loads_no_other_flywheel_module():
    """``import flywheel.config`` (what every face and worker does first) pulls no stage, engine or
    store module: read from ``python -X importtime``, as a reviewer would check it."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import flywheel.config"],
                         capture_output=True, text=True, timeout=120, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    modules = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    ours = sorted(m for m in modules if m == "flywheel" or m.startswith("flywheel."))
    # flywheel.config is a package: its own modules load with it, nothing else of the project does
    assert [m for m in ours if m != "flywheel" and m.split(".")[:2] != ["flywheel", "config"]] == [], ours
    assert "flywheel.config" in ours, ours


def test_a_declared_config_section_no_longer_read_is_a_warning_and_an_unknown_one_breaks():
    """The config-sections contract's judgement, on its own: reads against a declared map."""
    sys.path.insert(0, str(CI))
    try:
        from config_sections_contract import Read, find_reads, judge
    finally:
        sys.path.remove(str(CI))
    sections = frozenset({"gate", "policy", "synth"})
    source = "def f(cfg, other: int, c: 'FlywheelConfig'):\n    return cfg.gate, other.synth, c.policy, cfg.home\n"
    found = find_reads(source, sections)
    assert [(s, text) for s, _, text in found] == [("gate", "cfg.gate"), ("policy", "c.policy")]
    reads = [Read("flywheel.gate.stage", s, "flywheel/gate/stage.py", line, text) for s, line, text in found]
    violations, warnings = judge(reads, {"flywheel.gate": frozenset({"gate", "policy", "synth"})}, [], sections)
    assert violations == [] and warnings == ["flywheel.gate declares synth but reads none of it: narrow its line"]
    violations, _ = judge(reads, {"flywheel.gate": frozenset({"gate", "policy", "sinth"})}, [], sections)
    assert violations == ["flywheel.gate declares sinth, which is no section of the configuration\n"
                          "(pyproject.toml, the config-sections contract)"]


def test_a_class_field_or_an_unannotated_parameter_does_not_hide_a_read():
    """Found in review: a class field ``cfg: int`` anywhere in a module hid every ``def f(cfg): cfg.synth``
    of that module (the class body was no scope of its own and an unannotated parameter shadowed nothing)."""
    sys.path.insert(0, str(CI))
    try:
        from config_sections_contract import find_reads
    finally:
        sys.path.remove(str(CI))
    source = ("class R:\n    cfg: int\n\n    def m(self, cfg):\n        return cfg.gate\n\n"
              "def f(cfg):\n    return cfg.synth\n\n"
              "def g(cfg: int):\n    return cfg.synth\n")
    found = find_reads(source, frozenset({"gate", "synth"}))
    assert [(s, line) for s, line, _ in found] == [("gate", 5), ("synth", 8)]
