"""What only the PostgreSQL store has: migration 002 (each lineage edge carries its parent's name, read
by the walks in the same index probe) and the integrity check that guards it, and a batch append that
loses a race for a new stream to another writer between its lookups and its lock."""

from __future__ import annotations

import psycopg
import pyarrow as pa

from flywheel.store import (
    BATCH_SCHEMA,
    SMALL_APPEND,
    EventStore,
    NewEvent,
    _migrations,
    _split_sql,
    canonical_json,
    signed_node_id,
)
from flywheel.store_postgres import PostgresEventStore


def _store_at_001(url: str) -> None:
    """A team store as migration 001 left it: two events, their names, entities and edges."""
    version, name, script = _migrations("postgres")[0]
    assert version == 1
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT, "
                    "applied_at TIMESTAMPTZ DEFAULT now())")
        for stmt in _split_sql(script):
            con.execute(stmt)
        con.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", [version, name])
        t, f, b = (signed_node_id(x) for x in ("trace:t1", "failure:f1", "ingest:b"))
        con.execute("INSERT INTO events (seq, event_id, stream, stream_version, type, payload, causation, schema_version) "
                    "VALUES (1, 'ev_1', 'trace:t1', 1, 'trace.ingested', '{\"i\":1}', '{ingest:b}', 1), "
                    "(2, 'ev_2', 'failure:f1', 1, 'failure.classified', '{}', '{trace:t1}', 1)")
        con.execute("INSERT INTO entity_names VALUES (%s, 'trace:t1'), (%s, 'failure:f1'), (%s, 'ingest:b')", [t, f, b])
        con.execute("INSERT INTO entity_index VALUES (%s, 1, 1, 1), (%s, 2, 2, 1)", [t, f])
        con.execute("INSERT INTO lineage_links VALUES (%s, %s, 1), (%s, %s, 2)", [t, b, f, t])


def test_migration_002_gives_every_existing_edge_its_parent_name(pg_url):
    _store_at_001(pg_url)
    with EventStore(pg_url) as s:
        assert s.lineage("failure:f1", "down") == [("trace:t1", 1), ("ingest:b", 2)]
        assert s.lineage_edges("failure:f1") == [("failure:f1", "trace:t1"), ("trace:t1", "ingest:b")]
        assert s.check_integrity() == []
        rows = s._q("SELECT parent_name FROM lineage_links ORDER BY seq")
        assert [r[0] for r in rows] == ["ingest:b", "trace:t1"]
        # the primary key carries the name: the walk's probe is index-only
        (idx,) = s._q("SELECT pg_get_indexdef('lineage_links_pkey'::regclass)")[0]
        assert "INCLUDE (parent_name)" in idx
        # and appends after the migration record names on their edges
        s.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["failure:f1"]))
        assert s.lineage("eval:e1", "down") == [("failure:f1", 1), ("trace:t1", 2), ("ingest:b", 3)]
        assert s.check_integrity() == []


def test_integrity_check_catches_an_edge_whose_parent_name_is_not_its_parents(pg_url):
    with EventStore(pg_url) as s:
        s.append("trace:t1", NewEvent("trace.ingested", {"i": 1}, ["ingest:b"]))
        assert s.check_integrity() == []
        s._q("UPDATE lineage_links SET parent_name = 'ingest:other' RETURNING 1")
        assert s.check_integrity() == ["a lineage edge's parent_name is not its parent's name"]
        s.rebuild_projections()
        assert s.check_integrity() == [] and s.lineage("trace:t1", "down") == [("ingest:b", 1)]


def test_a_rebuild_leaves_the_planner_statistics_of_every_table(pg_url):
    """`warehouse migrate` bulk-loads and rebuilds: the walks must not be planned blind until autovacuum
    passes (an up-walk planned without statistics scanned lineage_links at every level)."""
    with EventStore(pg_url) as s:
        s.append("trace:t1", NewEvent("trace.ingested", {"i": 1}, ["ingest:b"]))
        s.rebuild_projections()
        analyzed = dict(s._q("SELECT relname, last_analyze IS NOT NULL FROM pg_stat_user_tables"))
        assert {t: analyzed.get(t) for t in ("events", "entity_names", "entity_index", "lineage_links")} == {
            "events": True, "entity_names": True, "entity_index": True, "lineage_links": True}


def _env_batch(tag: str, n: int) -> pa.Table:
    """n events on the stream env:x, each its own entity (env:x@<tag><i>): entity names that differ
    from another writer's, so only the stream can collide."""
    return pa.table({"stream": ["env:x"] * n, "type": ["env.versioned"] * n,
                     "payload": [canonical_json({"entity_id": f"env:x@{tag}{i}"}) for i in range(n)],
                     "causation": [[f"suite:{tag}"]] * n}, schema=BATCH_SCHEMA)


def test_a_batch_that_loses_a_new_stream_to_another_writer_is_retried_and_appended_after_it(pg_url, monkeypatch):
    """Writer A looks its streams up (env:x does not exist), then writer B creates env:x and commits
    before A takes the lock. A's copy fails on UNIQUE (stream, stream_version); A retries, finds
    env:x at B's version and appends after it: every event once, versions 1..n+m, seq gap-free."""
    n = SMALL_APPEND + 6  # above the small-append path: the batch path with its lookups
    a, b = EventStore(pg_url), EventStore(pg_url)
    assert isinstance(a, PostgresEventStore)
    raced = []
    real_lookup = PostgresEventStore._lookup

    def lookup_then_b_appends(cur, only=None):
        out = real_lookup(cur, only)
        if only is None and not raced:  # A's first lookup, before its lock: B wins the race here
            raced.append(None)  # (B's own lookups pass straight through)
            raced[0] = b.append_batch(_env_batch("b", n))
        return out

    monkeypatch.setattr(PostgresEventStore, "_lookup", staticmethod(lookup_then_b_appends))
    try:
        res = a.append_batch(_env_batch("a", n))
        assert raced and raced[0].appended == n
        assert res.appended == n and (res.first_seq, res.last_seq) == (n + 1, 2 * n)
        events = a.read(stream="env:x")
        assert [e.stream_version for e in events] == list(range(1, 2 * n + 1))
        assert [e.payload["entity_id"] for e in events] == [f"env:x@b{i}" for i in range(n)] + [
            f"env:x@a{i}" for i in range(n)]
        assert a.check_integrity() == []
        # the same batch again is recorded already: nothing twice
        again = a.append_batch(_env_batch("a", n))
        assert again.appended == 0 and again.already_recorded == n and a.last_seq() == 2 * n
    finally:
        a.close()
        b.close()
