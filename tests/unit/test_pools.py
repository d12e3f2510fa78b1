"""``cycle.pools`` (flows/pools.py): what the cycle sends to a worker, what it requires, and how it reads
a pooled stage's end -- without a Prefect server (``run_deployment`` is replaced by a recorder that
returns the flow run a server would). The whole path on real servers: tests/integration/test_team_mode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flywheel.config import load_config
from flywheel.store import NewEvent


def _state(kind: str, message: str = ""):
    return SimpleNamespace(type=SimpleNamespace(value=kind), message=message,
                           is_completed=lambda: kind == "COMPLETED")


@pytest.fixture
def pools(monkeypatch):
    import prefect.deployments
    from flywheel.flows import pools as p

    calls: list[dict] = []
    outcome: dict = {"state": _state("COMPLETED"), "record": None}

    def fake_run_deployment(name, parameters, **kw):
        calls.append({"name": name, "parameters": parameters, **kw})
        if outcome["record"] is not None:
            outcome["record"](parameters)
        return SimpleNamespace(id="fr-1", state=outcome["state"])

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    monkeypatch.setattr(p, "ensure_stage_deployment", lambda pool: f"{p.STAGE_FLOW}/{pool}")
    return SimpleNamespace(module=p, calls=calls, outcome=outcome)


def _record(store, key, result):
    def rec(parameters):
        store.append(f"stage:{key}", NewEvent("stage.completed", {
            "entity_id": f"stage:{key}", "stage": parameters["stage"], "key": key, "pool": parameters["pool"],
            "host": "h", "worker_home": "w", "flow_run": "fr-1", "result": result}), expected_version=0)
    return rec


def test_a_completed_stage_run_returns_what_the_worker_recorded(cfg, store, pools):
    pools.outcome["record"] = _record(store, "evals-abc", {"evals": 3})
    out = pools.module.run_on_pool(cfg, store, "evals", "cpu", "evals-abc", {}, "corr-1")
    assert out == {"evals": 3}
    (call,) = pools.calls
    assert call["name"] == "flywheel-stage/cpu" and call["as_subflow"] is True
    assert call["parameters"]["stage"] == "evals" and call["parameters"]["correlation_id"] == "corr-1"


def test_a_stage_completed_before_is_not_run_again(cfg, store, pools):
    _record(store, "gate-1", {"outcome": "refused"})({"stage": "gate", "pool": "gpu"})
    assert pools.module.run_on_pool(cfg, store, "gate", "gpu", "gate-1", {}, "c") == {"outcome": "refused"}
    assert pools.calls == []


@pytest.mark.parametrize("kind, message, infra", [
    ("CRASHED", "worker process exited with -9", True),
    ("CANCELLED", "cancelled by a user", True),
    ("FAILED", "Flow run encountered an exception: StageInfraError: stage learn on pool gpu: connection reset", True),
    ("FAILED", "Flow run encountered an exception: ValueError: bad task record", False),
])
def test_how_a_failed_stage_run_is_classified(cfg, store, pools, kind, message, infra):
    from flywheel.cycle import is_infra_error

    pools.outcome["state"] = _state(kind, message)
    with pytest.raises(Exception) as ei:
        pools.module.run_on_pool(cfg, store, "learn", "gpu", f"learn-{kind}", {"base": "b"}, "c")
    assert is_infra_error(ei.value) is infra  # infra: the cycle's task submits the stage again to its pool
    assert "learn" in str(ei.value) and "gpu" in str(ei.value) and message in str(ei.value)


def test_a_run_that_completed_without_recording_is_an_infra_error(cfg, store, pools):
    from flywheel.cycle import is_infra_error

    with pytest.raises(Exception, match="without recording stage.completed") as ei:
        pools.module.run_on_pool(cfg, store, "envs", "cpu", "envs-x", {}, "c")
    assert is_infra_error(ei.value)


def test_the_worker_gets_the_settings_without_this_machines_paths(home, tmp_path):
    from flywheel.flows.pools import stage_overrides

    cfg = load_config(overrides={"home": str(tmp_path / "gateway-home"), "cycle": {"pools": {"learn": "gpu"}},
                                 "train": {"sft_steps": 7}, "store": {"url": "postgresql://db.example/flywheel"}})
    ov = stage_overrides(cfg)
    assert "home" not in ov and "warehouse" not in ov and "mlflow_artifact_root" not in ov
    assert "pools" not in ov["cycle"]  # a stage never dispatches further
    assert ov["train"]["sft_steps"] == 7 and ov["store"]["url"] == "postgresql://db.example/flywheel"
    assert str(tmp_path) not in repr(ov)
    worker = load_config(overrides={**ov, "home": str(tmp_path / "worker-home")})
    assert worker.train == cfg.train and worker.home == tmp_path / "worker-home"


def test_a_pooled_cycle_requires_the_teams_shared_services(home, tmp_path):
    from flywheel.flows.pools import PoolConfigError, check_team_config

    cfg = load_config(overrides={"home": str(tmp_path / "h"), "cycle": {"pools": {"gate": "gpu"}}})
    with pytest.raises(PoolConfigError) as ei:
        check_team_config(cfg)
    msg = str(ei.value)
    assert "store.url" in msg and "artifacts.url" in msg and "mlflow_tracking_uri" in msg
    ok = load_config(overrides={"home": str(tmp_path / "h"), "cycle": {"pools": {"gate": "gpu"}},
                                "store": {"url": "postgresql://db/flywheel"}, "artifacts": {"url": "s3://b/p"},
                                "mlflow_tracking_uri": "http://mlflow:5000"})
    check_team_config(ok)


def test_pools_and_endpoints_are_validated(home, tmp_path):
    from flywheel.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="unknown stage"):
        load_config(overrides={"home": str(tmp_path), "cycle": {"pools": {"trian": "gpu"}}})
    with pytest.raises((ConfigError, ValueError), match="empty pool"):
        load_config(overrides={"home": str(tmp_path), "cycle": {"pools": {"learn": " "}}})
    with pytest.raises((ConfigError, ValueError), match="must start with"):
        load_config(overrides={"home": str(tmp_path), "artifacts": {"url": "ftp://x/y"}})
    c = load_config(overrides={"home": str(tmp_path), "policy": {"base_url": "http://a:1/v1, http://b:2/v1"}})
    assert c.policy.endpoints == ["http://a:1/v1", "http://b:2/v1"]
    assert load_config(overrides={"home": str(tmp_path), "policy": {"base_url": "http://a:1/v1"}}).policy.endpoints \
        == ["http://a:1/v1"]
    with pytest.raises((ConfigError, ValueError), match="http"):
        load_config(overrides={"home": str(tmp_path), "policy": {"base_url": ["a:1"]}})
