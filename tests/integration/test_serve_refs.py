"""`flywheel serve --model` takes the references `rollout --policy` takes: a registered version by
alias (champion, challenger), as model:<name>/<N> or <name>/<N>, besides a spec or a directory."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flywheel.cli import app

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny_home(home, tmp_path, monkeypatch):
    """A home whose champion is the tiny base model, registered by `flywheel init`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_POLICY__BASE_MODEL", "tiny")
    monkeypatch.setenv("FLYWHEEL_POLICY__DEVICE", "cpu")
    r = CliRunner().invoke(app, ["init"])  # not --json: CliRunner's stdout is not the guarded fd
    assert r.exit_code == 0, r.output
    from flywheel.config import load_config

    return load_config()


def test_serve_model_takes_registered_references(tiny_home):
    from flywheel.serve import build_policy

    cfg = tiny_home
    for ref in ("champion", "model:policy/1", "policy/1"):
        name, policy = build_policy(cfg, ref)
        assert name == "policy-1", ref
        assert policy.version == "1", ref
    name, _ = build_policy(cfg, "tiny")  # a spec, as before
    assert name == "tiny"


@pytest.mark.parametrize("ref, why", [
    ("challenger", "no model version of 'policy' has the alias 'challenger'"),
    ("model:policy/9", "model:policy/9 is not a registered version"),
    ("http://127.0.0.1:9/v1", "it is a server already"),
])
def test_serve_model_refuses_what_it_cannot_load_and_says_why(tiny_home, ref, why):
    r = CliRunner().invoke(app, ["serve", "--model", ref, "--port", "0"])
    assert r.exit_code == 2, r.output
    assert why in r.output
