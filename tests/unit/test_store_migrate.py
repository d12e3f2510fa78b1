"""`flywheel warehouse migrate --to postgresql://...`: an embedded store copied to a server, verified
event by event; resumable; a foreign target refused; then the CLI reads the server (store.url)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.store import BATCH_SCHEMA, EventStore, NewEvent, StoreError, canonical_json
from flywheel.store.postgres import migrate_events

runner = CliRunner()


def _fill(s: EventStore, n: int = 300) -> None:
    s.append("trace:t1", NewEvent("trace.ingested", {"i": 1, "quote": "it's \t a \\ \"test\""}, ["ingest:b"]))
    s.append("failure:f1", NewEvent("failure.classified", {"kinds": ["tool_call"]}, ["trace:t1"]), correlation_id="c1")
    s.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["failure:f1"]), correlation_id="c1")
    s.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/1"}, ["eval:e1"]))
    s.append_batch(pa.table({
        "stream": [f"trace:x{i}" for i in range(n)], "type": ["trace.ingested"] * n,
        "payload": [canonical_json({"i": i, "status": "success"}) for i in range(n)], "causation": [["ingest:z"]] * n,
    }, schema=BATCH_SCHEMA))


@pytest.fixture
def embedded(cfg):
    with EventStore(cfg.warehouse) as s:
        _fill(s)
    return cfg


def test_migrate_copies_every_event_exactly_and_verifies(embedded, pg_url, monkeypatch):
    r = runner.invoke(app, ["warehouse", "migrate", "--to", pg_url, "--chunk", "64", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout)
    assert out["events"] == out["copied"] == out["verified"] == 304 and out["already_there"] == 0
    assert ":***@" in out["target"] and pg_url.split(":")[2].split("@")[0] not in r.stdout  # no password printed
    with EventStore(embedded.warehouse) as src, EventStore(pg_url) as dst:
        a, b = src.read(), dst.read()
        assert [(e.seq, e.event_id, e.stream, e.stream_version, e.payload, e.causation, e.correlation_id,
                 e.recorded_at, e.schema_version) for e in a] == [
            (e.seq, e.event_id, e.stream, e.stream_version, e.payload, e.causation, e.correlation_id,
             e.recorded_at, e.schema_version) for e in b]
        assert src.projection_rows() == dst.projection_rows()
        assert src.lineage("model:policy/1", "down") == dst.lineage("model:policy/1", "down")
        assert dst.check_integrity() == []
        # the server store goes on where the embedded one stopped
        assert dst.append("trace:t1", NewEvent("trace.ingested", {"i": 2})).first_seq == 305
    # and the CLI reads it once store.url says so
    monkeypatch.setenv("FLYWHEEL_STORE__URL", pg_url)
    r = runner.invoke(app, ["status", "--json"])
    assert r.exit_code == 0, r.output
    status = json.loads(r.stdout)
    assert status["events"] == 305 and status["warehouse"].startswith("postgresql://") and "***" in status["warehouse"]


def test_migrate_resumes_and_refuses_a_foreign_target(embedded, pg_url, pg_server):
    with EventStore(embedded.warehouse) as src, EventStore(pg_url) as dst:
        # an interrupted copy: the first 100 events are there
        dst.import_events(src.read_arrow(limit=100))
        res = migrate_events(src, dst, chunk=50)
        assert (res["already_there"], res["copied"], res["verified"]) == (100, 204, 304)
        again = migrate_events(src, dst, chunk=1000)
        assert (again["already_there"], again["copied"]) == (304, 0)
    other = pg_server.create_database("t_foreign_target")
    with EventStore(other) as foreign:
        foreign.append("trace:zzz", NewEvent("trace.ingested", {"other": True}))
    with EventStore(embedded.warehouse) as src, EventStore(other) as foreign:
        with pytest.raises(StoreError, match="differs between the source and the target"):
            migrate_events(src, foreign)
        assert foreign.last_seq() == 1  # nothing written


def test_migrate_refuses_a_url_that_is_not_postgres(embedded):
    r = runner.invoke(app, ["warehouse", "migrate", "--to", "mysql://x@y/z"])
    assert r.exit_code != 0 and "postgresql://" in r.output
