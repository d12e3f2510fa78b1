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
    assert result["outcome"] in ("promoted", "refused", "insufficient_evidence"), result
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


# ------------------------------------------------------------------ what the cycle leaves in the two UIs


def _prefect_artifacts(api: str, **flt) -> list[dict]:
    r = httpx.post(f"{api}/artifacts/filter", json={"artifacts": flt, "limit": 200}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_prefect_artifacts_summarize_the_cycle(prefect_server, mlflow_server, served_cycle):
    import json
    from pathlib import Path

    result, _, _ = served_cycle
    run_id = result["cycle"].split(":", 1)[1]
    api = prefect_server.api_url
    arts = _prefect_artifacts(api, flow_run_id={"any_": [run_id]})
    by_key = {a["key"]: a for a in arts if a.get("key")}
    # Keys stable per deployment (this run has none: "adhoc"), so the UI keeps their history.
    assert set(result["published"]) >= {"summary", "stages", "report"}
    assert {"flywheel-adhoc-cycle-summary", "flywheel-adhoc-cycle-stages"} <= set(by_key), sorted(by_key)

    md = by_key["flywheel-adhoc-cycle-summary"]
    assert md["type"] == "markdown" and md["flow_run_id"] == run_id
    text = md["data"]
    gate = result["stages"]["gate"]
    assert text.startswith(f"# flywheel cycle: {result['outcome']}")
    assert f"| gate decision | **{gate['outcome']}** |" in text
    assert f"exact sign test p = {gate['p_value']:.4g}: {gate['numbers']['wins']} wins" in text
    n = gate["numbers"]
    assert f"challenger {n['challenger_pass_rate']:.1%}" in text
    if (n.get("by_origin") or {}).get("failure"):
        assert "fix rate (held-out production failures)" in text
    report = Path(result["published"]["report"])
    assert report.is_file() and report.as_uri() in text  # the HTML report was written and is linked
    link = f"{mlflow_server.url}/#/models/policy/versions/{gate['challenger_version']}"
    assert f"[{link}]({link})" in text

    table = by_key["flywheel-adhoc-cycle-stages"]
    assert table["type"] == "table"
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    assert [r["stage"] for r in rows] == list(result["timings"])
    assert all(isinstance(r["seconds"], int | float) and r["counts"] for r in rows)
    ingest = next(r for r in rows if r["stage"] == "ingest")
    assert ingest["counts"].startswith(f"{result['stages']['ingest']['read']} read")

    # Every stage task run carries its own result.
    tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200},
                       timeout=30).json()
    per_task = {a["task_run_id"]: a for a in arts if a.get("task_run_id")}
    for t in tasks:
        a = per_task.get(t["id"])
        assert a is not None and a["type"] == "markdown", f"task run {t['name']} has no result artifact"
        assert a["data"].startswith("### "), a["data"][:80]
    gate_task = next(t for t in tasks if t["name"].rsplit("-", 1)[0] == "gate")
    assert f"{gate['outcome']}: p = {gate['p_value']:.4g}" in per_task[gate_task["id"]]["data"]


def _mlflow(url: str, path: str, **params) -> dict:
    r = httpx.get(f"{url}/api/2.0/mlflow/{path}", params=params, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_model_versions_name_their_training_data_as_mlflow_datasets(mlflow_server, served_cycle):
    from flywheel.config import load_config
    from flywheel.store import open_store

    result, home, _ = served_cycle
    cfg = load_config(overrides={"home": str(home)}, environ={})
    checked = []
    with open_store(cfg, read_only=True) as store:
        for key in ("sft", "grpo"):
            st = result["stages"].get(key)
            if not isinstance(st, dict) or "model_version" not in st:
                continue
            mv = _mlflow(mlflow_server.url, "model-versions/get", name="policy", version=str(st["model_version"]))
            run = _mlflow(mlflow_server.url, "runs/get", run_id=mv["model_version"]["run_id"])["run"]
            inputs = {}
            for di in run["inputs"]["dataset_inputs"]:
                tags = {t["key"]: t["value"] for t in di.get("tags", [])}
                inputs[di["dataset"]["name"]] = (tags.get("mlflow.data.context"), di["dataset"])
            done = store.read(stream=st["run_id"], types=["training.completed"])[0]
            base = done.payload["base"]
            learned_from = [c for c in done.causation if c != base and not c.startswith("model:base/")]
            if key == "grpo":
                # One dataset per rollout dataset of the run, by entity id, digest = its artifact's sha256.
                assert {n for n, (ctx, _) in inputs.items() if ctx == "training"} == set(done.payload["rollouts"])
                for rid in done.payload["rollouts"]:
                    sha = store.entity(rid)["state"]["artifact"]["sha256"]
                    assert inputs[rid][1]["digest"] == sha[:16] and inputs[rid][1]["source_type"] == "flywheel"
            else:
                (name,) = [n for n, (ctx, _) in inputs.items() if ctx == "demonstrations"]
                ds = inputs[name][1]
                import json

                src = json.loads(ds["source"])
                assert name.startswith("demonstrations@") and src["entity_ids"] == learned_from[:200]
                assert json.loads(ds["profile"])["num_rows"] == done.payload["demonstrations"]
            checked.append(key)
    assert checked, "the cycle registered no model version"


def test_gate_run_holds_one_row_per_paired_item_and_tags_the_model_version(mlflow_server, served_cycle, tmp_path):
    import json

    from mlflow.tracking import MlflowClient

    from flywheel.config import load_config
    from flywheel.store import open_store

    result, home, _ = served_cycle
    gate = result["stages"]["gate"]
    cfg = load_config(overrides={"home": str(home)}, environ={})
    with open_store(cfg, read_only=True) as store:
        payload = store.read(stream=gate["gate_id"], types=["gate.decided"])[0].payload
    client = MlflowClient(tracking_uri=mlflow_server.url)
    local = client.download_artifacts(payload["mlflow_run_id"], "gate_items.json", str(tmp_path))
    table = json.loads(open(local).read())
    assert table["columns"] == ["item", "slice", "champion_pass", "challenger_pass", "change"]
    assert len(table["data"]) == gate["numbers"]["paired_items"] > 0
    items = {r[0]: r for r in table["data"]}
    assert len(items) == len(table["data"])  # one row per item
    assert sum(1 for r in table["data"] if r[4] == "win") == gate["numbers"]["wins"]
    assert sum(1 for r in table["data"] if r[4] == "loss") == gate["numbers"]["losses"]
    rules = json.loads(open(client.download_artifacts(payload["mlflow_run_id"], "gate_rules.json", str(tmp_path))).read())
    assert [r[0] for r in rules["data"]] == [r["rule"] for r in gate["rules"]]
    run = client.get_run(payload["mlflow_run_id"])
    evaluation = {di.dataset.name for di in run.inputs.dataset_inputs
                  if {t.key: t.value for t in di.tags}.get("mlflow.data.context") == "evaluation"}
    assert gate["suite"] in evaluation
    tags = client.get_model_version("policy", str(gate["challenger_version"])).tags
    assert tags["gate.outcome"] == gate["outcome"] and tags["gate.id"] == gate["gate_id"]
    assert float(tags["gate.p_value"]) == pytest.approx(gate["p_value"], rel=1e-5)


def test_where_to_look_screenshots(prefect_server, mlflow_server, served_cycle, tmp_path, it):
    """The pages docs/where-to-look.md shows, rendered by headless Chromium from the real servers: each
    page's DOM (after its scripts ran) must show what the page is about, then a screenshot is taken
    (copied to ``$FLYWHEEL_SCREENSHOTS`` when set: that is how the docs' images are made)."""
    from mlflow.tracking import MlflowClient

    result, _, _ = served_cycle
    gate = result["stages"]["gate"]
    run_id = result["cycle"].split(":", 1)[1]
    arts = {a["key"]: a["id"] for a in _prefect_artifacts(prefect_server.api_url, flow_run_id={"any_": [run_id]})
            if a.get("key")}
    client = MlflowClient(tracking_uri=mlflow_server.url)
    mv = client.get_model_version("policy", str(gate["challenger_version"]))
    train_run = client.get_run(mv.run_id)
    exp = train_run.info.experiment_id
    (gate_run,) = client.search_runs([exp], f"tags.`flywheel.produces` = '{gate['gate_id']}'")
    first_item = gate["numbers"]["win_ids"] or gate["numbers"]["loss_ids"] or []
    ui = prefect_server.url
    pages = [
        ("prefect-cycle-summary", f"{ui}/artifacts/artifact/{arts['flywheel-adhoc-cycle-summary']}",
         f"flywheel cycle: {result['outcome']}", 1400),
        ("prefect-cycle-stages", f"{ui}/artifacts/artifact/{arts['flywheel-adhoc-cycle-stages']}",
         f"{result['stages']['ingest']['read']} read", 1400),
        ("prefect-flow-run", f"{ui}/runs/flow-run/{run_id}", "flywheel-cycle", 1400),  # the graph is a canvas
        ("mlflow-model-version", f"{mlflow_server.url}/#/models/policy/versions/{gate['challenger_version']}",
         "gate.outcome", 1600),
        ("mlflow-training-run", f"{mlflow_server.url}/#/experiments/{exp}/runs/{mv.run_id}",
         train_run.inputs.dataset_inputs[0].dataset.name, 1600),
        ("mlflow-gate-items", f"{mlflow_server.url}/#/experiments/{exp}/runs/{gate_run.info.run_id}/artifacts/"
         "gate_items.json", (first_item[:1] or ["champion_pass"])[0], 1600),
    ]
    for name, url, expected, width in pages:
        png = it.screenshot(tmp_path, name, url, expected, width=width)
        assert png.stat().st_size > 10_000
