"""Shared fixtures. Every test gets its own FLYWHEEL_HOME under tmp_path; nothing touches ./.flywheel."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect: quiet, and patient with the temporary server on a loaded 2-core machine.
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Prefect's own home (the temporary server's database) stays out of ~/.prefect during tests.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="flywheel-test-prefect-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a set-up error caught elsewhere
        return False


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    # Triton kernels run on CPU tensors through the interpreter (must be set before triton imports).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh flywheel home directory, exported as FLYWHEEL_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("FLYWHEEL_HOME", str(h))
    for k in list(os.environ):
        if k.startswith("FLYWHEEL_") and k not in ("FLYWHEEL_HOME",):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return h


@pytest.fixture
def cfg(home, monkeypatch, tmp_path):
    """A loaded FlywheelConfig whose home is the per-test directory."""
    from flywheel.config import load_config

    monkeypatch.chdir(tmp_path)
    c = load_config()
    c.ensure_home()
    return c


@pytest.fixture
def store(cfg):
    from flywheel.store import open_store

    s = open_store(cfg)
    yield s
    s.close()
