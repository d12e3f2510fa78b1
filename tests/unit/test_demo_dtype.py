"""``flywheel demo --dtype``: the profile's ``policy.dtype`` replaced, so a CPU that computes bf16 natively
can run the demo as a CPU without it does (the profile's settings win over flywheel.toml and the
environment, so nothing else reaches it)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flywheel import demo as d
from flywheel.cli import app
from flywheel.config import load_config

runner = CliRunner()


def test_dtype_replaces_the_profiles_and_wins_over_the_environment(tmp_path):
    ov = d.demo_overrides("cpu", tmp_path, 3, "float32")
    assert ov["policy"] == {**d.PROFILES["cpu"]["config"]["policy"], "dtype": "float32"}
    assert ov["train"]["seed"] == 3
    cfg = load_config(environ={"FLYWHEEL_POLICY__DTYPE": "bfloat16"}, overrides=ov)
    assert cfg.policy.dtype == "float32"
    # without it the profile's own setting stands, over the environment too
    cfg = load_config(environ={"FLYWHEEL_POLICY__DTYPE": "bfloat16"}, overrides=d.demo_overrides("cpu", tmp_path))
    assert cfg.policy.dtype == "fast"
    assert d.PROFILES["cpu"]["config"]["policy"]["dtype"] == "fast"  # the profile itself is not mutated


def test_an_unknown_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(d.DemoError, match=r"unknown dtype 'float16'.*auto, fast, float32, bfloat16"):
        d.demo_overrides("cpu", tmp_path, None, "float16")


def test_the_cli_passes_it_to_the_run_and_refuses_a_bad_one(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = {}

    def fake_run(cfg, profile, **kw):
        seen["dtype"], seen["profile"] = cfg.policy.dtype, profile
        raise d.DemoError("stopped by the test")

    monkeypatch.setattr(d, "run_demo", fake_run)
    r = runner.invoke(app, ["demo", "--dtype", "float32"])
    assert r.exit_code != 0 and isinstance(r.exception, d.DemoError)
    assert seen == {"dtype": "float32", "profile": "cpu"}
    seen.clear()
    r = runner.invoke(app, ["demo", "--dtype", "half"])
    assert r.exit_code != 0 and "--dtype" in r.output and "unknown dtype 'half'" in r.output
    assert seen == {}
