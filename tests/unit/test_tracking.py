"""MLflow glue on a SQLite store under tmp: run tags name entity ids, registry versions and aliases."""

from __future__ import annotations

import pytest

from flywheel.config import load_config
from flywheel.tracking import Tracker

pytestmark = pytest.mark.slow  # MLflow's first use (imports + SQLite migrations) takes ~5 s


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-home")
    cfg = load_config(environ={"FLYWHEEL_HOME": str(home)})
    return Tracker(cfg)


def test_run_tags_name_consumed_and_produced_entities(tracker):
    with tracker.run("train", consumes=["rollouts:r1", "model:policy/1"], produces=["model:policy/2"],
                     correlation_id="cycle:7", tags={"extra": 1}) as run:
        run.log_params({"lr": 1e-5, "steps": 8})
        run.log_metrics({"loss": 0.5, "nan": float("nan")}, step=3)
        run.log_text("hello", "notes/hello.txt")
    got = tracker.get_run(run.run_id)
    tags = got.data.tags
    assert tags["flywheel.consumes"] == "rollouts:r1,model:policy/1"
    assert tags["flywheel.produces"] == "model:policy/2"
    assert tags["flywheel.input.0"] == "rollouts:r1" and tags["flywheel.input.1"] == "model:policy/1"
    assert tags["flywheel.correlation_id"] == "cycle:7" and tags["extra"] == "1"
    assert got.data.params == {"lr": "1e-05", "steps": "8"}
    assert got.data.metrics == {"loss": 0.5}  # NaN dropped
    assert got.info.status == "FINISHED"
    assert tracker.tracking_uri.startswith("sqlite:///") and str(tracker.cfg.home) in tracker.tracking_uri


def test_failed_run_is_marked_failed(tracker):
    with pytest.raises(RuntimeError):
        with tracker.run("gate") as run:
            raise RuntimeError("boom")
    assert tracker.get_run(run.run_id).info.status == "FAILED"


def test_register_and_alias_round_trip(tracker, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    with tracker.run("train", produces=["model:policy"]) as run:
        pass
    v1 = tracker.register_model("policy", model, run_id=run.run_id, tags={"flywheel.entity": "model:policy/1"})
    v2 = tracker.register_model("policy", model, run_id=run.run_id)
    assert v2 == v1 + 1
    assert tracker.get_alias_version("policy", "champion") is None
    tracker.set_alias("policy", "champion", v1)
    tracker.set_alias("policy", "challenger", v2)
    assert tracker.get_alias_version("policy", "champion") == v1
    tracker.set_alias("policy", "champion", v2)  # promote
    assert tracker.get_alias_version("policy", "champion") == v2
    tracker.delete_alias("policy", "challenger")
    assert tracker.get_alias_version("policy", "challenger") is None
    assert [int(mv.version) for mv in tracker.model_versions("policy")] == [v1, v2]
    assert tracker.model_version("policy", v1).tags["flywheel.entity"] == "model:policy/1"
    assert (tracker.model_dir("policy", v1) / "config.json").read_text() == '{"a": 1}'
