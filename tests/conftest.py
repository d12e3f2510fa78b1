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
# Under pytest-xdist (`make test`) every worker is a process of its own: its torch and BLAS get the cores
# divided by the workers, not every core each (two workers x two threads on two cores spin against each
# other). Set before torch is imported; a variable the caller set wins.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _workers > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _workers))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)


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


@pytest.fixture(autouse=True)
def _umask_per_test():
    """Every test starts from the worker's own umask. An in-process CLI call (``flywheel.cli.common.load``)
    sets 077 for the whole process, so without this a test's outcome depended on which files ran before
    it in the same pytest-xdist worker: a sandbox test's venv came out 0700 and its grader exited 126."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One OpenMP thread for a module's tiny-model policies (``pytestmark = pytest.mark.usefixtures(...)``):
    faster for the tiny model on a busy box, and one rounding of its GEMMs on every call."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    """The tiny model's home, one per test process (flywheel.policy.testing.session_tiny_home)."""
    from flywheel.policy.testing import session_tiny_home

    return session_tiny_home(tmp_path_factory)


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


@pytest.fixture(scope="session")
def pg_server():
    """One private PostgreSQL server per test session (initdb + pg_ctl on 127.0.0.1, flywheel.pglocal)."""
    from flywheel.pglocal import LocalPostgres, find_bin_dir

    if find_bin_dir() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin: "
                    "install Debian's postgresql package (.ci/run does)")
    pg = LocalPostgres.start()
    yield pg
    pg.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database on the session's server; dropped after the test."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    url = pg_server.create_database(name)
    yield url
    with psycopg.connect(pg_server.url_for("postgres"), autocommit=True) as con:
        con.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["duckdb", "postgresql"])
def store_location(request, cfg):
    """Where a store test's store lives: the embedded file, then a PostgreSQL database (same test)."""
    if request.param == "duckdb":
        return cfg.warehouse
    return request.getfixturevalue("pg_url")
