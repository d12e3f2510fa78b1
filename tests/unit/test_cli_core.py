"""CLI core commands: every --json output parses as JSON and says what happened."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.store import EventStore, NewEvent

runner = CliRunner()


def run(*args):
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def run_json(*args):
    return json.loads(run(*args, "--json").stdout)


@pytest.fixture
def seeded(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    info = run_json("init", "--no-champion")
    with EventStore(info["warehouse"]) as s:
        s.append("trace:t1", NewEvent("trace.ingested", {"i": 1}, ["ingest:b"]))
        s.append("failure:f1", NewEvent("failure.classified", {"kind": "tool_call"}, ["trace:t1"]), correlation_id="c1")
        s.append("eval:e1", NewEvent("eval.created", {}, ["failure:f1"]), correlation_id="c1")
    return info


def test_init_creates_private_home(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    info = run_json("init", "--no-champion")
    assert info["home"] == str(home) and info["events"] == 0
    assert (home.stat().st_mode & 0o777) == 0o700
    assert run_json("init", "--no-champion")["events"] == 0  # idempotent


def test_status_counts_and_recent_events(seeded):
    data = run_json("status", "--last", "2")
    assert data["events"] == 3 and data["entities"] == {"eval": 1, "failure": 1, "trace": 1}
    assert [e["type"] for e in data["recent_events"]] == ["eval.created", "failure.classified"]
    assert "entities (3 events)" in run("status").stdout


def test_events_filters(seeded):
    assert [e["seq"] for e in run_json("events")] == [1, 2, 3]
    assert [e["stream"] for e in run_json("events", "--type", "failure.classified")] == ["failure:f1"]
    assert [e["seq"] for e in run_json("events", "--correlation", "c1", "--limit", "1")] == [3]
    e = run_json("events", "--stream", "trace:*")[0]
    assert e["causation"] == ["ingest:b"] and e["payload"] == {"i": 1}


def test_lineage_down_and_up(seeded):
    down = run_json("lineage", "eval:e1", "--down")
    assert [(n["entity_id"], n["depth"]) for n in down["nodes"]] == [("failure:f1", 1), ("trace:t1", 2), ("ingest:b", 3)]
    up = run_json("lineage", "trace:t1", "--up")
    assert up["direction"] == "up" and [n["entity_id"] for n in up["nodes"]] == ["failure:f1", "eval:e1"]
    r = runner.invoke(app, ["lineage", "trace:nope", "--json"])
    assert r.exit_code == 1 and "unknown entity" in r.output


def test_warehouse_rebuild_export_recover(seeded, tmp_path):
    rebuilt = run_json("warehouse", "rebuild")["rebuilt"]
    assert rebuilt == {"events": 3, "streams": 3, "entities": 3, "lineage_edges": 3}
    exported = run_json("warehouse", "export", str(tmp_path / "out"))["exported"]
    assert set(exported) == {"events", "streams", "entities", "lineage_edges"}
    assert all((tmp_path / "out" / f"{t}.parquet").exists() for t in exported)
    rec = run_json("warehouse", "recover")
    assert rec["wal_set_aside"] is None and rec["events"] == 3


def test_bad_config_is_one_line_error(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flywheel.toml").write_text("[gate]\nnope = 1\n")
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 1 and "gate.nope: unknown key" in r.output and r.exception.__class__ is SystemExit


@pytest.mark.slow
def test_init_registers_the_base_model_as_champion_once(home, tmp_path, monkeypatch):
    """On a fresh home `champion` names a registered version (trace champion, serve --champion work
    before the first promotion); a second init keeps it and registers nothing. Run as the real CLI
    process: building the model imports libraries that print to stdout, which only the real
    process's --json guard (cli.common.reserve_stdout_for_json, fd level) keeps off the JSON."""
    import os
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "FLYWHEEL_POLICY__BASE_MODEL": "tiny", "FLYWHEEL_POLICY__DEVICE": "cpu"}

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "flywheel", *args, "--json"], env=env, capture_output=True,
                           text=True, timeout=1800)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout)

    first = cli("init")
    assert first["champion"] == {"model": "model:policy/1", "created": True, "reason": None}
    again = cli("init")
    assert again["champion"] == {"model": "model:policy/1", "created": False, "reason": None}
    assert again["events"] == first["events"]
    assert cli("trace", "champion")["root"] == "model:policy/1"
    with EventStore(first["warehouse"]) as s:
        assert [e.type for e in s.read(stream="model:policy")][:1] == ["model.registered"]


def test_init_without_a_local_base_model_says_why_and_succeeds(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_POLICY__BASE_MODEL", str(tmp_path / "missing-model"))
    info = run_json("init")
    assert info["champion"]["model"] is None and "missing-model" in info["champion"]["reason"]
    assert info["events"] == 0


def test_status_names_the_artifact_store(seeded, home, monkeypatch):
    data = run_json("status")
    assert data["artifact_store"] == {"kind": "local", "url": None, "local": str(home / "artifacts"),
                                      "local_role": "store"}
    # a team's store: shown without its credentials, and not reached (no network for a status)
    monkeypatch.setenv("FLYWHEEL_ARTIFACTS__URL", "s3://AKID:SECRET@team-bucket/flywheel?region=eu-west-1")
    data = run_json("status")
    assert data["artifact_store"] == {"kind": "s3", "url": "s3://team-bucket/flywheel?region=eu-west-1",
                                      "local": str(home / "artifacts"), "local_role": "cache"}
    assert "SECRET" not in run("status").stdout and "s3://team-bucket/flywheel" in run("status").stdout
    # the MLflow proxy needs an HTTP tracking server: the status says so instead of failing
    monkeypatch.setenv("FLYWHEEL_ARTIFACTS__URL", "mlflow-artifacts:/team")
    d = run_json("status")["artifact_store"]
    assert d["kind"] == "mlflow-artifacts" and "mlflow_tracking_uri" in d["error"]
