"""A tiny-model cycle against real servers run as plain processes, the way ``infra/compose.yaml`` runs
them for a team: ``prefect server start`` (orchestration) and ``mlflow server`` (tracking, registry,
proxied artifact store), each on a free loopback port. The cycle runs in its own process with
``PREFECT_API_URL`` and ``MLFLOW_TRACKING_URI`` set; then the flow run is checked through Prefect's API
and the registered model through MLflow's REST API, and both servers are stopped (fixture teardown)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_cycle(prefect_server, mlflow_server, tmp_path_factory, it):
    root = tmp_path_factory.mktemp("real-servers")
    home = root / "home"
    traffic = it.bfcl_traffic(root / "traffic.jsonl")
    (root / "client-prefect-home").mkdir()
    env = it.clean_env(PREFECT_API_URL=prefect_server.api_url, MLFLOW_TRACKING_URI=mlflow_server.url,
                       PREFECT_HOME=str(root / "client-prefect-home"))
    result, proc = it.run_cycle_subprocess(home, [str(traffic)], env=env, timeout_s=900)
    return result, home, proc


def test_flow_run_completed_on_the_prefect_server(prefect_server, served_cycle):
    result, _, _ = served_cycle
    assert result["outcome"] in ("promoted", "refused"), result
    run_id = result["cycle"].split(":", 1)[1]
    api = prefect_server.api_url
    fr = httpx.get(f"{api}/flow_runs/{run_id}", timeout=30)
    assert fr.status_code == 200, f"the server has no flow run {run_id}: {fr.text[:300]}"
    fr = fr.json()
    assert fr["state_type"] == "COMPLETED" and fr["state_name"] == "Completed"
    flow = httpx.get(f"{api}/flows/{fr['flow_id']}", timeout=30).json()
    assert flow["name"] == "flywheel-cycle"
    # Each stage ran as a task of that flow run, and all of them completed.
    tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200},
                       timeout=30).json()
    names = {t["name"].rsplit("-", 1)[0] for t in tasks}
    assert {"ingest", "evals", "envs", "rollouts", "gate"} <= names, names
    assert {"train-sft", "train-grpo"} & names
    assert all(t["state_type"] == "COMPLETED" for t in tasks), [(t["name"], t["state_type"]) for t in tasks]


def test_model_registered_on_the_mlflow_server(mlflow_server, served_cycle):
    result, home, _ = served_cycle
    stages = result["stages"]
    gate = stages["gate"]
    challenger = gate["challenger_version"]
    api = f"{mlflow_server.url}/api/2.0/mlflow"

    rm = httpx.get(f"{api}/registered-models/get", params={"name": "policy"}, timeout=30)
    assert rm.status_code == 200, rm.text[:300]
    aliases = {a["alias"]: int(a["version"]) for a in rm.json()["registered_model"].get("aliases", [])}
    assert aliases.get("challenger") == challenger
    if result["outcome"] == "promoted":
        assert aliases.get("champion") == challenger
    else:
        assert aliases.get("champion") != challenger

    mv = httpx.get(f"{api}/model-versions/get", params={"name": "policy", "version": str(challenger)}, timeout=30)
    mv = mv.json()["model_version"]
    assert mv["status"] == "READY"
    # The weights went to the server's artifact store (proxied), not to the local home.
    assert mv["source"].startswith("mlflow-artifacts:"), mv["source"]
    run = httpx.get(f"{api}/runs/get", params={"run_id": mv["run_id"]}, timeout=30).json()["run"]
    assert run["info"]["status"] == "FINISHED"
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    assert f"model:policy/{challenger}" in tags.get("flywheel.produces", "")
    files = httpx.get(f"{mlflow_server.url}/api/2.0/mlflow-artifacts/artifacts",
                      params={"path": mv["source"].split("mlflow-artifacts:/", 1)[1]}, timeout=30).json()
    assert files.get("files"), "the registered version has no files on the artifact server"
    # Nothing of MLflow was written to the embedded default under the home.
    assert not (home / "mlflow.db").exists()


def test_lineage_links_the_flow_run_and_the_registered_model(served_cycle):
    from flywheel.config import load_config
    from flywheel.store import open_store

    result, home, _ = served_cycle
    run_id = result["cycle"].split(":", 1)[1]
    cfg = load_config(overrides={"home": str(home)}, environ={})
    model = result["stages"].get("grpo", {}).get("model_entity") or result["stages"]["sft"]["model_entity"]
    with open_store(cfg, read_only=True) as store:
        # The Prefect flow run id is the correlation id of the cycle's events.
        assert {e.type for e in store.read(correlation_id=run_id)} >= {"cycle.started", "cycle.completed"}
        assert any(e.startswith("trace:") for e, _ in store.lineage(model, "down"))
