"""Event store: appends, idempotence, optimistic concurrency, projections, lineage, export, WAL recovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flywheel.store import (
    BATCH_SCHEMA,
    SMALL_APPEND,
    ConcurrencyError,
    EventStore,
    InvalidEventError,
    NewEvent,
    StoreError,
    canonical_json,
    compute_event_id,
)


@pytest.fixture
def store(store_location):
    """The store contract holds on both backends: every test taking ``store`` runs on DuckDB and on
    PostgreSQL (a real server, started once per session)."""
    s = EventStore(store_location)
    yield s
    s.close()


def ev(i: int, causation=()) -> NewEvent:
    return NewEvent("trace.ingested", {"i": i, "model": "m"}, causation)


def batch(rows: list[tuple[str, str, dict, list[str]]]) -> pa.Table:
    return pa.table(
        {
            "stream": [r[0] for r in rows],
            "type": [r[1] for r in rows],
            "payload": [canonical_json(r[2]) for r in rows],
            "causation": [r[3] for r in rows],
        },
        schema=BATCH_SCHEMA,
    )


def test_append_assigns_seq_versions_and_deterministic_ids(store):
    r = store.append("trace:a", [ev(1, ["ingest:b1"]), ev(2)], expected_version=0, correlation_id="cycle:1")
    assert (r.appended, r.already_recorded, r.first_seq, r.last_seq) == (2, 0, 1, 2)
    assert r.event_ids == [compute_event_id("trace.ingested", "trace:a", {"i": 1, "model": "m"}),
                           compute_event_id("trace.ingested", "trace:a", {"model": "m", "i": 2})]
    events = store.read("trace:a")
    assert [(e.seq, e.stream_version, e.payload["i"], e.correlation_id) for e in events] == [
        (1, 1, 1, "cycle:1"), (2, 2, 2, "cycle:1")]
    assert events[0].causation == ["ingest:b1"] and events[1].causation == []
    assert store.stream_version("trace:a") == 2 and store.stream_version("trace:none") == 0


def test_duplicate_append_is_a_noop_reported_as_already_recorded(store):
    store.append("trace:a", [ev(1), ev(2)])
    again = store.append("trace:a", [ev(1), ev(2)], correlation_id="other-run")
    assert again.is_noop and again.already_recorded == 2
    # a fully recorded append never raises on a stale version (re-running a stage is safe)
    assert store.append("trace:a", ev(1), expected_version=0).is_noop
    mixed = store.append("trace:a", [ev(2), ev(3)])
    assert (mixed.appended, mixed.already_recorded) == (1, 1)
    assert [e.stream_version for e in store.read("trace:a")] == [1, 2, 3]
    assert store.check_integrity() == []


def test_stale_expected_version_raises_and_appends_nothing(store):
    store.append("trace:a", ev(1), expected_version=0)
    with pytest.raises(ConcurrencyError) as e:
        store.append("trace:a", [ev(2), ev(3)], expected_version=0)
    assert (e.value.stream, e.value.expected, e.value.actual) == ("trace:a", 0, 1)
    assert "trace:a" in str(e.value)
    assert store.last_seq() == 1 and store.stream_version("trace:a") == 1
    store.append("trace:a", ev(2), expected_version=1)
    assert store.stream_version("trace:a") == 2


def test_batch_dedups_within_batch_and_against_store_keeping_row_order(store):
    store.append("trace:b", ev(1))
    t = batch([
        ("trace:a", "trace.ingested", {"i": 1}, []),
        ("trace:b", "trace.ingested", {"i": 1, "model": "m"}, []),   # already recorded
        ("trace:a", "trace.ingested", {"i": 2}, ["ingest:x"]),
        ("trace:a", "trace.ingested", {"i": 1}, []),                  # duplicate inside the batch
        ("trace:b", "trace.ingested", {"i": 9}, []),
    ])
    r = store.append_batch(t, correlation_id="c")
    assert (r.appended, r.already_recorded) == (3, 2)
    assert [(e.stream, e.stream_version, e.payload["i"]) for e in store.read(after_seq=1)] == [
        ("trace:a", 1, 1), ("trace:a", 2, 2), ("trace:b", 2, 9)]
    assert store.check_integrity() == []


def test_batch_rejects_unknown_types_nulls_and_invalid_json(store):
    with pytest.raises(ValueError, match="not in the catalog"):
        store.append_batch(batch([("trace:a", "trace.nope", {}, [])]))
    with pytest.raises(ValueError, match="belongs on a 'failure:' stream"):
        store.append_batch(batch([("trace:a", "failure.classified", {}, [])]))
    t = pa.table({"stream": ["trace:a"], "type": ["trace.ingested"], "payload": [None], "causation": [[]]},
                 schema=BATCH_SCHEMA)
    with pytest.raises(ValueError, match="'payload' has 1 null"):
        store.append_batch(t)
    t = pa.table({"stream": ["trace:a"], "type": ["trace.ingested"], "payload": ["{not json"], "causation": [[]]},
                 schema=BATCH_SCHEMA)
    with pytest.raises(InvalidEventError, match="not valid JSON"):
        store.append_batch(t)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        store.append("trace:a", NewEvent("trace.ingested", {"x": object()}))
    assert store.last_seq() == 0 and store.check_integrity() == []


def test_read_filters(store):
    store.append("trace:a", ev(1), correlation_id="r1")
    store.append("failure:f", NewEvent("failure.classified", {"k": 1}, ["trace:a"]), correlation_id="r2")
    store.append("trace:b", ev(2), correlation_id="r2")
    assert [e.stream for e in store.read(stream="trace:*")] == ["trace:a", "trace:b"]
    assert [e.stream for e in store.read(types="failure.classified")] == ["failure:f"]
    assert [e.seq for e in store.read(after_seq=1)] == [2, 3]
    assert [e.seq for e in store.read(correlation_id="r2")] == [2, 3]
    assert [e.seq for e in store.read(limit=2, newest_first=True)] == [3, 2]
    arrow = store.read_arrow(stream="trace:*")
    assert arrow.num_rows == 2 and "event_id" in arrow.column_names


def test_entities_projection_follows_latest_event_and_explicit_entity_ids(store):
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/1", "v": 1}, ["run:1"]))
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/2", "v": 2}, ["run:2"]))
    store.append("trace:a", [ev(1), ev(2)])
    m1 = store.entity("model:policy/1")
    assert m1["kind"] == "model" and m1["stream"] == "model:policy" and m1["state"]["v"] == 1
    t = store.entity("trace:a")
    assert (t["n_events"], t["first_seq"], t["last_seq"], t["state"]["i"]) == (2, 3, 4, 2)
    assert store.entity("model:policy") is None  # the stream is not an entity here
    assert [e["entity_id"] for e in store.entities("model")] == ["model:policy/1", "model:policy/2"]
    assert store.counts_by_kind() == {"model": 2, "trace": 1}


def test_batch_of_new_streams_numbers_rows_in_order_and_merges_entities_seen_before(store):
    """The bulk path (only new streams, no duplicates) agrees with the general one."""
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/1", "v": 1}, ["run:1"]))
    r = store.append_batch(batch([
        ("trace:n1", "trace.ingested", {"i": 1}, ["ingest:a"]),
        ("trace:n2", "trace.ingested", {"i": 2}, []),
        ("trace:n1", "trace.ingested", {"i": 3}, ["ingest:b"]),   # a new stream twice in one batch
    ]), correlation_id="c")
    assert (r.appended, r.first_seq, r.last_seq) == (3, 2, 4)
    assert [(e.seq, e.stream, e.stream_version, e.payload["i"]) for e in store.read(after_seq=1)] == [
        (2, "trace:n1", 1, 1), (3, "trace:n2", 1, 2), (4, "trace:n1", 2, 3)]
    assert store.entity("trace:n1")["n_events"] == 2 and store.entity("trace:n1")["state"] == {"i": 3}
    # A new stream can name an entity that already exists (here one carried by another stream's payload):
    # the entity is updated, not inserted twice.
    store.append_batch(batch([("model:policy/1", "model.registered", {"v": 9}, ["run:2"])]))
    m = store.entity("model:policy/1")
    assert (m["n_events"], m["stream"], m["state"]) == (2, "model:policy/1", {"v": 9})
    assert sorted(store.lineage("model:policy/1", "down")) == [("run:1", 1), ("run:2", 1)]
    assert store.check_integrity() == []
    before = store.projection_rows()
    store.rebuild_projections()
    assert store.projection_rows() == before


def _chain(store):
    store.append("trace:t1", ev(1, ["ingest:b"]))
    store.append("trace:t2", ev(2, ["ingest:b"]))
    store.append("failure:f1", NewEvent("failure.classified", {}, ["trace:t1", "trace:t2"]))
    store.append("eval:e1", NewEvent("eval.created", {}, ["failure:f1"]))
    store.append("suite:train", NewEvent("suite.versioned", {"entity_id": "suite:train@1"}, ["eval:e1"]))
    store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@1"}, ["suite:train@1"]))
    store.append("rollouts:r1", NewEvent("rollouts.published", {}, ["env:train@1", "model:policy/1"]))
    store.append("run:1", NewEvent("training.completed", {}, ["rollouts:r1"]))
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/2"}, ["run:1"]))


def test_lineage_walks_down_to_traces_and_up_to_models(store):
    _chain(store)
    down = dict(store.lineage("model:policy/2", "down"))
    assert down["run:1"] == 1 and down["rollouts:r1"] == 2 and down["trace:t1"] == 7 and down["ingest:b"] == 8
    assert down["model:policy/1"] == 3
    up = dict(store.lineage("trace:t1", "up"))
    assert up == {"failure:f1": 1, "eval:e1": 2, "suite:train@1": 3, "env:train@1": 4, "rollouts:r1": 5,
                  "run:1": 6, "model:policy/2": 7}
    assert dict(store.lineage("model:policy/2", "down", max_depth=2)) == {
        "run:1": 1, "rollouts:r1": 2}
    edges = store.lineage_edges("failure:f1")
    assert ("failure:f1", "trace:t1") in edges and ("trace:t1", "ingest:b") in edges
    with pytest.raises(ValueError):
        store.lineage("x", "sideways")


def test_lineage_keeps_each_node_once_at_its_shortest_depth_through_diamonds_and_cycles(store):
    """suite:train@1 is reached at depth 4 (through env:train@2) and at 6 (through synth:s1 and
    env:train@1); failure:f1 and eval:e1 cause each other. Both backends walk breadth-first and expand
    each node once."""
    store.append("trace:t1", ev(1, ["ingest:b"]))
    store.append("failure:f1", NewEvent("failure.classified", {}, ["trace:t1", "eval:e1"]))
    store.append("eval:e1", NewEvent("eval.created", {}, ["failure:f1"]))
    store.append("suite:train", NewEvent("suite.versioned", {"entity_id": "suite:train@1"}, ["eval:e1"]))
    store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@1"}, ["suite:train@1"]))
    store.append("synth:s1", NewEvent("synth.batch_accepted", {"accepted": 1}, ["env:train@1"]))
    store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@2"}, ["suite:train@1", "synth:s1"]))
    store.append("rollouts:r1", NewEvent("rollouts.published", {}, ["env:train@2"]))
    store.append("run:1", NewEvent("training.completed", {}, ["rollouts:r1", "model:policy/1"]))
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/2"}, ["run:1"]))
    assert store.lineage("model:policy/2", "down") == [
        ("run:1", 1), ("model:policy/1", 2), ("rollouts:r1", 2), ("env:train@2", 3), ("suite:train@1", 4),
        ("synth:s1", 4), ("env:train@1", 5), ("eval:e1", 5), ("failure:f1", 6), ("trace:t1", 7), ("ingest:b", 8)]
    assert store.lineage("trace:t1", "up") == [
        ("failure:f1", 1), ("eval:e1", 2), ("suite:train@1", 3), ("env:train@1", 4), ("env:train@2", 4),
        ("rollouts:r1", 5), ("synth:s1", 5), ("run:1", 6), ("model:policy/2", 7)]
    assert store.lineage("model:policy/2", "down", max_depth=4) == [
        ("run:1", 1), ("model:policy/1", 2), ("rollouts:r1", 2), ("env:train@2", 3), ("suite:train@1", 4),
        ("synth:s1", 4)]
    assert store.lineage("eval:e1", "down") == [("failure:f1", 1), ("trace:t1", 2), ("ingest:b", 3)]
    assert store.lineage_edges("env:train@2", max_depth=2) == [
        ("env:train@2", "suite:train@1"), ("env:train@2", "synth:s1"), ("suite:train@1", "eval:e1"),
        ("synth:s1", "env:train@1")]
    assert store.lineage("nobody:here", "down") == [] and store.lineage_edges("nobody:here") == []


def test_rebuilt_projections_equal_incremental(store):
    _chain(store)
    store.append("trace:t1", [ev(5, ["ingest:c"]), ev(6, ["ingest:b"])])  # known stream, known edge
    store.append_batch(batch([(f"trace:x{i}", "trace.ingested", {"i": i}, ["ingest:z"]) for i in range(50)]))

    incremental = store.projection_rows()
    assert incremental["lineage_edges"] and incremental["entities"]
    counts = store.rebuild_projections()
    assert store.projection_rows() == incremental
    assert counts["events"] == store.last_seq() and counts["lineage_edges"] == len(incremental["lineage_edges"])
    assert store.check_integrity() == []


def test_export_writes_parquet_readable_elsewhere(store, tmp_path):
    _chain(store)
    written = store.export(tmp_path / "export")
    assert set(written) == {"events", "streams", "entities", "lineage_edges"}
    events = pq.read_table(written["events"])
    assert events.num_rows == store.last_seq() and events.column("seq").to_pylist() == list(range(1, 10))
    assert pq.read_table(written["lineage_edges"]).num_rows == store.projection_counts()["lineage_edges"]
    assert not [p for p in os.listdir(tmp_path / "export") if ".tmp" in p]


def test_files_are_private_and_closed_store_refuses_appends(cfg):
    s = EventStore(cfg.warehouse)
    s.append("trace:a", ev(1))
    s.close()
    assert (os.stat(cfg.warehouse).st_mode & 0o777) == 0o600
    with pytest.raises(StoreError, match="closed"):
        s.append("trace:a", ev(2))
    with EventStore(cfg.warehouse, read_only=True) as ro:
        assert ro.last_seq() == 1
        with pytest.raises(StoreError, match="read-only"):
            ro.append("trace:a", ev(2))


def test_reopen_keeps_events_and_continues_numbering(store_location):
    with EventStore(store_location) as s:
        s.append("trace:a", [ev(1), ev(2)])
    with EventStore(store_location) as s:
        assert s.append("trace:a", ev(1)).is_noop
        assert s.append("trace:a", ev(3)).first_seq == 3
        assert s.stream_version("trace:a") == 3 and s.check_integrity() == []


def test_migrates_a_warehouse_created_by_migration_001(cfg):
    """A warehouse made with the indexed 001 schema is rebuilt by 002 with its rows intact."""
    from flywheel.store.schema import migrations as _migrations
    from flywheel.store.schema import split_sql as _split_sql

    version, name, script = _migrations()[0]
    con = duckdb.connect(str(cfg.warehouse))
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, applied_at TIMESTAMPTZ DEFAULT now())")
    for stmt in _split_sql(script):
        con.execute(stmt)
    con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])
    con.execute("INSERT INTO events VALUES (1, 'ev_x', 'trace:a', 1, 'trace.ingested', '{}', [], NULL, now(), 1)")
    con.execute("INSERT INTO streams VALUES ('trace:a', 1)")
    con.close()
    with EventStore(cfg.warehouse) as s:
        assert s.last_seq() == 1 and s.stream_version("trace:a") == 1
        assert s.append("trace:a", ev(1)).first_seq == 2
        n_idx = s.con.execute("SELECT count(*) FROM duckdb_constraints() WHERE constraint_type IN ('PRIMARY KEY', 'UNIQUE') "
                              "AND table_name IN ('events', 'streams', 'entities', 'lineage_edges')").fetchall()[0][0]
        assert n_idx == 0


def test_migrations_003_004_turn_entities_and_edges_into_views(cfg):
    """A warehouse at 002 keeps every entity (state now read from events) and every edge (now by node id)."""
    from flywheel.store.schema import migrations as _migrations
    from flywheel.store.schema import split_sql as _split_sql

    con = duckdb.connect(str(cfg.warehouse))
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, applied_at TIMESTAMPTZ DEFAULT now())")
    for version, name, script in _migrations()[:2]:
        for stmt in _split_sql(script):
            con.execute(stmt)
        con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])
    con.execute("INSERT INTO events VALUES (1, 'ev_x', 'trace:a', 1, 'trace.ingested', '{\"i\":1}', [], NULL, now(), 1), "
                "(2, 'ev_y', 'trace:a', 2, 'trace.ingested', '{\"i\":2}', [], NULL, now(), 1)")
    con.execute("INSERT INTO streams VALUES ('trace:a', 2)")
    con.execute("INSERT INTO entities VALUES ('trace:a', 'trace', 'trace:a', 'trace.ingested', 1, 2, 2, '{\"i\":2}')")
    con.execute("INSERT INTO lineage_edges VALUES ('trace:a', 'ingest:b', 1), ('trace:a', 'file:x', 2)")
    con.close()
    with EventStore(cfg.warehouse) as s:
        assert s.entity("trace:a") == {"entity_id": "trace:a", "kind": "trace", "stream": "trace:a",
                                       "last_type": "trace.ingested", "first_seq": 1, "last_seq": 2,
                                       "n_events": 2, "state": {"i": 2}}
        # 004: the edges move to node ids and read back by name
        assert s.lineage("trace:a", "down") == [("file:x", 1), ("ingest:b", 1)]
        assert s.lineage("ingest:b", "up") == [("trace:a", 1)]
        s.append("trace:a", ev(3, ["ingest:b", "ingest:c"]))
        assert s.lineage_edges("trace:a") == [("trace:a", "file:x"), ("trace:a", "ingest:b"), ("trace:a", "ingest:c")]
        assert s.entity("trace:a")["n_events"] == 3 and s.entity("trace:a")["state"]["i"] == 3
        assert s.check_integrity() == []
        kinds = dict(s.con.execute("SELECT table_name, table_type FROM information_schema.tables "
                                   "WHERE table_name IN ('entities', 'entity_index')").fetchall())
        assert kinds == {"entities": "VIEW", "entity_index": "BASE TABLE"}


# -- WAL recovery ------------------------------------------------------------------------------
_WRITE_AND_DIE = textwrap.dedent(
    """
    import os, sys
    from flywheel.store import EventStore, NewEvent
    s = EventStore(sys.argv[1])
    s.append("trace:a", NewEvent("trace.ingested", {"i": 1}))
    s.con.execute("CHECKPOINT")
    s.append("trace:b", NewEvent("trace.ingested", {"i": 2, "pad": "x" * 2000}))
    os._exit(0)  # no close: the second append lives only in the WAL
    """
)


@pytest.fixture
def corrupt_wal(tmp_path):
    path = tmp_path / "w.duckdb"
    subprocess.run([sys.executable, "-c", _WRITE_AND_DIE, str(path)], check=True, timeout=60)
    wal = tmp_path / "w.duckdb.wal"
    assert wal.exists()
    data = bytearray(wal.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip a byte inside the second transaction's WAL entry
    wal.write_bytes(bytes(data))
    return path


def test_unreplayable_wal_is_a_clear_error_without_the_flag(corrupt_wal):
    with pytest.raises(StoreError) as e:
        EventStore(corrupt_wal)
    assert "flywheel warehouse recover" in str(e.value) and "w.duckdb.wal" in str(e.value)
    assert (corrupt_wal.parent / "w.duckdb.wal").exists()  # nothing was moved


def test_recover_wal_sets_it_aside_and_warns(corrupt_wal):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with EventStore(corrupt_wal, recover_wal=True) as s:
            assert s.recovered_wal is not None and s.recovered_wal.exists()
            assert ".wal.unreplayed-" in s.recovered_wal.name
            assert [e.stream for e in s.read()] == ["trace:a"]  # the checkpointed event survives
            assert s.append("trace:c", NewEvent("trace.ingested", {"i": 3})).first_seq == 2
    assert any("NOT in the store" in str(w.message) for w in caught)


def test_garbage_wal_after_clean_close_is_ignored_by_duckdb(tmp_path):
    """What DuckDB 2.0 does: a WAL whose header is not a WAL at all is skipped (nothing to replay)."""
    path = tmp_path / "w.duckdb"
    with EventStore(path) as s:
        s.append("trace:a", ev(1))
    (tmp_path / "w.duckdb.wal").write_bytes(b"garbage" * 100)
    with EventStore(path) as s:
        assert s.last_seq() == 1 and s.recovered_wal is None


def test_node_ids_match_duckdb_and_a_collision_is_refused():
    from flywheel.store import EventStore, node_id

    con = duckdb.connect()
    names = ["trace:abc", "model:policy/2", "ingest:b0", "é"]
    assert [node_id(n) for n in names] == [
        con.execute("SELECT (md5_number(?) >> 64)::UBIGINT", [n]).fetchall()[0][0] for n in names]
    # A 64-bit collision is astronomically unlikely; fabricate one to see the append refuse the name
    # that comes second (the store's name, else the batch's first, keeps the node id).
    same = pa.table({"name": ["a:x", "a:y"], "node": pa.array([7, 7], pa.uint64())})
    assert EventStore._check_node_ids(same, []) == {"a:y": ("a:x", 7)}
    later = same.append_column("row", pa.array([5, 2], pa.int64()))
    assert EventStore._check_node_ids(later, []) == {"a:x": ("a:y", 7)}
    one = pa.table({"name": ["a:y"], "node": pa.array([7], pa.uint64())})
    assert EventStore._check_node_ids(one, [(7, "a:x")]) == {"a:y": ("a:x", 7)}
    assert EventStore._check_node_ids(one, [(7, "a:y")]) == {}  # the same name seen before is fine


def test_a_batch_in_several_chunks_numbers_each_stream_across_them(store):
    store.append("trace:a", ev(0))
    t = pa.concat_tables([
        batch([("trace:a", "trace.ingested", {"i": 1}, []), ("trace:b", "trace.ingested", {"i": 2}, [])]),
        batch([("trace:b", "trace.ingested", {"i": 3}, []), ("trace:a", "trace.ingested", {"i": 4}, [])]),
    ])
    assert t.column("stream").num_chunks == 2
    r = store.append_batch(t)
    assert (r.appended, r.first_seq, r.last_seq) == (4, 2, 5)
    assert [(e.stream, e.stream_version, e.payload["i"]) for e in store.read(after_seq=1)] == [
        ("trace:a", 2, 1), ("trace:b", 1, 2), ("trace:b", 2, 3), ("trace:a", 3, 4)]
    assert store.check_integrity() == []


def test_export_is_private_under_any_umask(store, tmp_path):
    """Export writes a 0700 directory of 0600 files whatever the caller's umask (traces are user data)."""
    _chain(store)
    old = os.umask(0o022)
    try:
        written = store.export(tmp_path / "export")
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "export").st_mode & 0o777) == 0o700
    for path in written.values():
        assert (os.stat(path).st_mode & 0o777) == 0o600, path


def test_export_path_with_a_quote_is_a_path_not_sql(store, tmp_path):
    _chain(store)
    out = tmp_path / "it's'; DROP TABLE events; --"
    written = store.export(out)
    assert pq.read_table(written["events"]).num_rows == store.last_seq() == 9
    assert sorted(os.listdir(out)) == sorted(f"{t}.parquet" for t in written)
    assert store.check_integrity() == []


def test_stage_queries_answer_the_same_on_both_backends(store):
    """The questions stages used to ask in DuckDB SQL on store.con, as store methods."""
    store.append("suite:heldout", NewEvent("suite.versioned", {"entity_id": "suite:heldout@1"}))
    store.append("suite:heldout", NewEvent("suite.versioned", {"entity_id": "suite:heldout@2"}))
    store.append("trace:ok", NewEvent("trace.ingested", {"status": "success", "timestamp": "2026-01-02T03:04:05Z"}))
    store.append("trace:bad", NewEvent("trace.ingested", {"status": "failure", "kinds": ["tool_call", "json"],
                                                          "timestamp": "2026-01-03T00:00:00Z"}))
    store.append("trace:bad2", NewEvent("trace.ingested", {"status": "failure", "kinds": ["json"],
                                                           "timestamp": "2026-01-03T10:00:00Z"}))
    store.append("failure:f", [NewEvent("failure.classified", {"entity_id": "failure:f", "n": 1}, ["trace:bad"]),
                               NewEvent("failure.classified", {"entity_id": "failure:f", "n": 2}, ["trace:bad2"])])
    assert store.latest_entity_id("suite:heldout@") == "suite:heldout@2"
    assert store.latest_entity_id("suite:train@") is None
    assert store.event_stats(["failure.classified"]) == (2, 7)
    assert store.event_stats(["failure.classified", "trace.ingested"], after_seq=5) == (2, 7)
    assert sorted(store.existing_streams(["trace:ok", "trace:nope", "failure:f"])) == ["failure:f", "trace:ok"]
    assert sorted(store.existing_streams(pa.array(["trace:bad"]))) == ["trace:bad"]
    heads = store.entity_heads(["failure:f", "failure:none"])
    assert list(heads) == ["failure:f"] and json.loads(heads["failure:f"][0])["n"] == 2 and heads["failure:f"][1] == 2
    assert json.loads(store.entity_states(["trace:ok"])["trace:ok"])["status"] == "success"
    assert [e for e, _ in store.trace_states("success")] == ["trace:ok"]
    assert [e for e, _ in store.trace_states("failure")] == ["trace:bad", "trace:bad2"]
    assert store.failure_kinds_by_day() == [("2026-01-03", "json", 2), ("2026-01-03", "tool_call", 1)]


# -- small appends planned from the embedded store's in-memory head index -------------------------------
def test_small_and_bulk_appends_interleaved_on_the_same_streams_keep_the_contract(store):
    """A small append after bulk appends (which the embedded store's head index learns by reading the
    events it has not seen) numbers, deduplicates and links exactly as a fresh look at the store would."""
    store.append("trace:a", ev(1, ["ingest:b1"]))  # small: the index is built here
    filler = [(f"trace:f{k}", "trace.ingested", {"i": k}, ["ingest:b2"]) for k in range(SMALL_APPEND)]
    r = store.append_batch(batch([("trace:a", "trace.ingested", {"i": 2, "model": "m"}, ["ingest:b2"]),
                                  ("trace:b", "trace.ingested", {"i": 1, "model": "m"}, ["ingest:b2"]), *filler]))
    assert r.last_seq == 3 + SMALL_APPEND  # more rows than a small append: the Arrow path
    r = store.append("trace:a", [ev(2), ev(3, ["ingest:b1", "ingest:b2", "ingest:b3"])], expected_version=2)
    assert (r.appended, r.already_recorded, r.first_seq) == (1, 1, 4 + SMALL_APPEND)  # i=2 came with the batch
    with pytest.raises(ConcurrencyError):
        store.append("trace:b", ev(9), expected_version=0)  # the batch created it
    assert store.append("trace:b", ev(1)).is_noop  # recorded by the batch
    assert store.append("trace:b", ev(2), expected_version=1).first_seq == 5 + SMALL_APPEND
    assert store.lineage_edges("trace:a") == [("trace:a", "ingest:b1"), ("trace:a", "ingest:b2"), ("trace:a", "ingest:b3")]
    assert store.entity("trace:a")["n_events"] == 3
    assert store.check_integrity() == []
    incremental = store.projection_rows()
    store.rebuild_projections()
    assert store.projection_rows() == incremental
    assert store.append("trace:a", ev(4, ["ingest:b3"])).first_seq == 6 + SMALL_APPEND  # after a rebuild
    assert store.check_integrity() == []



def test_an_empty_entity_id_names_the_same_entity_on_the_small_and_the_batch_path(store):
    """``{"entity_id": ""}`` is a present (empty) entity id for the batch path, the rebuild and the
    integrity check (SQL coalesce keeps ''); the small path computed its ids in Python and took the
    stream instead, so its projections disagreed with the events ("entity_index disagrees")."""
    store.append("env:x", NewEvent("env.versioned", {"entity_id": ""}, ["suite:s"]))  # small path
    assert store.check_integrity() == []
    filler = [(f"env:y{k}", "env.versioned", {"entity_id": f"env:y@{k}"}, []) for k in range(SMALL_APPEND)]
    store.append_batch(batch([("env:z", "env.versioned", {"entity_id": "", "v": 2}, ["suite:t"]), *filler]))
    assert store.check_integrity() == []
    assert store.entity("")["n_events"] == 2 and store.entity("env:x") is None
    assert [e.entity_id for e in store.read("env:x")] == [""]
    assert store.lineage_edges("") == [("", "suite:s"), ("", "suite:t")]
    incremental = store.projection_rows()
    store.rebuild_projections()
    assert store.projection_rows() == incremental

_APPEND_ELSEWHERE = textwrap.dedent(
    """
    import sys
    from flywheel.store import EventStore, NewEvent
    with EventStore(sys.argv[1]) as s:
        s.append("trace:a", NewEvent("trace.ingested", {"i": 2, "model": "m"}, ["ingest:other"]))
        s.append("trace:z", NewEvent("trace.ingested", {"i": 1, "model": "m"}, ["ingest:other"]))
    """
)


def test_reopened_warehouse_plans_small_appends_from_what_another_process_wrote(tmp_path):
    """The head index lives in the process that owns the file: when this process reopens the file
    after another one appended, it starts afresh (no stale versions, no events recorded twice)."""
    path = tmp_path / "w.duckdb"
    with EventStore(path) as s:
        s.append("trace:a", ev(1, ["ingest:mine"]))
    subprocess.run([sys.executable, "-c", _APPEND_ELSEWHERE, str(path)], check=True, timeout=120)
    with EventStore(path) as s:
        assert s.append("trace:a", ev(2, ["ingest:other"])).is_noop
        r = s.append("trace:a", ev(3, ["ingest:other"]), expected_version=2)
        assert (r.first_seq, s.stream_version("trace:a")) == (4, 3)
        assert s.append("trace:z", ev(5), expected_version=1).first_seq == 5
        assert s.check_integrity() == []
        assert len(s.con.execute("SELECT * FROM entity_names WHERE name = 'ingest:other'").fetchall()) == 1


def test_small_append_refuses_a_name_whose_node_id_an_other_name_holds(tmp_path):
    """The index knows each name by its node id and 128 bits of its SHA-256: a different name under a
    recorded node id (a 64-bit collision, fabricated here) is refused with both names."""
    from flywheel.store import node_id

    path = tmp_path / "w.duckdb"
    with EventStore(path) as s:
        s.append("trace:a", ev(1))
        s.con.execute("INSERT INTO entity_names VALUES (?, 'ingest:impostor')", [node_id("ingest:b1")])
    with EventStore(path) as s:
        with pytest.raises(StoreError, match="'ingest:b1' and 'ingest:impostor'"):
            s.append("trace:b", ev(1, ["ingest:b1"]))
        assert s.last_seq() == 1


def test_head_index_runs_merge_keeping_every_row_and_the_newest_stream_version():
    import numpy as np

    from flywheel.store.index import KeyRuns

    runs = KeyRuns(2, latest=True)
    for version in range(1, 6000):  # past the dict's size: frozen into runs, then merged
        runs.add(7, (1, version))
        runs.add(version * 1000, (2, 1))
    runs.add_many(np.array([7, 7, 3], dtype=np.uint64), np.array([[1, 6000], [9, 1], [1, 1]], dtype=np.uint64))
    for _ in range(10):
        runs.add_many(np.array([5], dtype=np.uint64), np.array([[1, 1]], dtype=np.uint64))
    assert max(v for d, v in runs.get(7) if d == 1) == 6000 and (9, 1) in runs.get(7)
    assert runs.get(3) == [(1, 1)] and runs.get(5000) == [(2, 1)] and runs.get(4) == []
    assert len(runs.keys) <= 9 and len(runs) < 2 * 6000 + 20  # merged, older versions of key 7 dropped
    links = KeyRuns(1)
    for _ in range(3):
        links.add_many(np.arange(1000, dtype=np.uint64), np.ones((1000, 1), dtype=np.uint64))
    links._merge()
    assert len(links) == 1000 and links.get(999) == [(1,)]  # identical rows kept once
