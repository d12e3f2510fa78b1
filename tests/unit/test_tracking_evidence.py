"""What a cycle leaves in MLflow beside params and metrics (real MLflow on SQLite): dataset inputs
with their context, digest, source entity id, schema and row count; the gate's per-item and rule
tables; the decision as tags on the challenger's model version."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA

from flywheel.tracking import DatasetSpec, Tracker, public_uri


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """One MLflow SQLite store for the module (creating one costs ~8 s of migrations)."""
    from flywheel.config import load_config

    home = tmp_path_factory.mktemp("tracking-evidence") / "home"
    return Tracker(load_config(overrides={"home": str(home)}, environ={}))


def _inputs(tracker: Tracker, run_id: str) -> dict[str, dict]:
    """name -> {digest, source_type, source, schema, profile, context} of a run's dataset inputs."""
    out = {}
    for di in tracker.get_run(run_id).inputs.dataset_inputs:
        d = di.dataset
        out[d.name] = {"digest": d.digest, "source_type": d.source_type, "source": json.loads(d.source),
                       "schema": json.loads(d.schema) if d.schema else None,
                       "profile": json.loads(d.profile) if d.profile else None,
                       "context": {t.key: t.value for t in di.tags}.get("mlflow.data.context")}
    return out


def test_run_logs_flywheel_datasets_with_context_digest_source_and_schema(tracker):
    with tracker.run("train-grpo") as run:
        run.log_datasets([
            DatasetSpec("rollouts:abc", "training", "f" * 64, 8, schema=ROLLOUT_SCHEMA, source={"artifact": "sha256:ff"}),
            DatasetSpec("demonstrations@12", "demonstrations", "12", 3, source={"entity_ids": ["eval:1", "synth:2"]}),
        ])
    got = _inputs(tracker, run.run_id)
    assert set(got) == {"rollouts:abc", "demonstrations@12"}
    r = got["rollouts:abc"]
    assert r["context"] == "training" and r["source_type"] == "flywheel"
    assert r["digest"] == "f" * 36  # MLflow's digest column holds 36 characters
    assert r["source"] == {"entity_id": "rollouts:abc", "artifact": "sha256:ff"}
    assert r["profile"] == {"num_rows": 8}
    cols = {c["name"]: c for c in r["schema"]["mlflow_colspec"]}
    assert set(cols) == set(ROLLOUT_SCHEMA.names)  # every Arrow column has an MLflow type
    assert cols["reward"]["type"] == "float" and cols["passed"]["type"] == "boolean"
    assert cols["completion_token_ids"]["type"] == "array" and cols["infra_error"]["required"] is False
    d = got["demonstrations@12"]
    assert d["context"] == "demonstrations" and d["source"]["entity_ids"] == ["eval:1", "synth:2"]


def test_dataset_context_must_be_known():
    with pytest.raises(ValueError, match="context 'train' is not one of"):
        DatasetSpec("rollouts:x", "train", "d", 1)


def test_demonstrations_dataset_hashes_content_and_names_its_sources():
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import demonstrations_dataset
    from flywheel.verifiers import ToolCall

    msgs = [{"role": "user", "content": "weather?"}]
    a = Demonstration(msgs, None, "eval:1", answer_calls=[ToolCall("get_weather", {"city": "Paris"})])
    b = Demonstration(msgs, None, "synth:2", answer_content="sunny")
    ds = demonstrations_dataset([a, b], ["eval:1", "synth:2"])
    assert ds.context == "demonstrations" and ds.rows == 2 and ds.name is None
    assert ds.entity_id == f"demonstrations@{ds.digest}" and ds.source["entity_ids"] == ["eval:1", "synth:2"]
    other = demonstrations_dataset([a, Demonstration(msgs, None, "synth:2", answer_content="rainy")], ["eval:1", "synth:2"])
    assert other.digest != ds.digest  # the digest follows the content, not just the sources
    assert demonstrations_dataset([a, b], ["eval:1", "synth:2"]).digest == ds.digest


def test_gate_evidence_tables_inputs_and_model_version_tags(tracker, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with tracker.run("train") as run:
        version = tracker.register_model("policy", d, run_id=run.run_id)
    items = [{"item": "eval:a", "slice": "origin:failure, tool:f", "champion_pass": False, "challenger_pass": True,
              "change": "win"},
             {"item": "eval:b", "slice": "origin:success", "champion_pass": True, "challenger_pass": True,
              "change": "both pass"}]
    rules = [{"rule": "significance", "passed": False, "value": 0.25, "threshold": 0.05, "reason": "p = 0.25 >= 0.05"}]
    with tracker.run("gate") as gate_run:
        tracker.log_gate_evidence(
            gate_run, model="policy", version=version, items=items, rules=rules,
            datasets=[DatasetSpec("suite:heldout@2", "evaluation", "ab" * 32, 2, source={"role": "held-out"})],
            version_tags={"gate.outcome": "refused", "gate.p_value": "0.25", "gate.id": "gate:xyz"})
    local = tracker.client.download_artifacts(gate_run.run_id, "gate_items.json", str(tmp_path))
    table = json.loads(open(local).read())
    assert table["columns"] == ["item", "slice", "champion_pass", "challenger_pass", "change"]
    assert [r[0] for r in table["data"]] == ["eval:a", "eval:b"] and table["data"][0][2:4] == [False, True]
    rules_t = json.loads(open(tracker.client.download_artifacts(gate_run.run_id, "gate_rules.json", str(tmp_path))).read())
    assert rules_t["data"] == [["significance", False, "0.25", "0.05", "p = 0.25 >= 0.05"]]
    assert _inputs(tracker, gate_run.run_id)["suite:heldout@2"]["context"] == "evaluation"
    tags = tracker.model_version("policy", version).tags
    assert tags["gate.outcome"] == "refused" and tags["gate.p_value"] == "0.25" and tags["gate.id"] == "gate:xyz"


def test_model_version_link_and_public_uri(tmp_path):
    from flywheel.config import load_config

    t = Tracker(load_config(overrides={"home": str(tmp_path / "h")}, environ={}))
    assert t.model_version_link("policy", 3) == "models:/policy/3"  # a local store has no UI to link to
    t.tracking_uri = "https://alice:s3cret@mlflow.example:5000"
    assert t.model_version_link("policy", 3) == "https://mlflow.example:5000/#/models/policy/versions/3"
    assert public_uri("http://u:p@h/x") == "http://h/x" and public_uri("sqlite:///a/b.db") == "sqlite:///a/b.db"


def test_arrow_types_without_an_mlflow_equivalent_are_left_out_of_the_schema(tracker):
    schema = pa.schema([("ok", pa.string()), ("nested", pa.struct([("a", pa.int32())]))])
    with tracker.run("x") as run:
        run.log_datasets([DatasetSpec("rollouts:s", "training", "d", 0, schema=schema)])
    cols = [c["name"] for c in _inputs(tracker, run.run_id)["rollouts:s"]["schema"]["mlflow_colspec"]]
    assert cols == ["ok"]
