"""What only the PostgreSQL store has: migration 002 (each lineage edge carries its parent's name, read
by the walks in the same index probe) and the integrity check that guards it, a batch append that
loses a race for a new stream to another writer between its lookups and its lock, deadlocks between a
batch's unlocked phase and a holder of the lock (a small append, a rebuild), broken by the server and
retried, and READ COMMITTED whatever the server's default."""

from __future__ import annotations

import threading
import time

import psycopg
import pyarrow as pa

from flywheel.store import (
    BATCH_SCHEMA,
    SMALL_APPEND,
    EventStore,
    NewEvent,
    canonical_json,
    signed_node_id,
)
from flywheel.store.postgres import PostgresEventStore
from flywheel.store.schema import migrations as _migrations
from flywheel.store.schema import split_sql as _split_sql


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


# -- deadlocks between a batch's unlocked phase and a holder of the append lock ---------------------

def _backend_waits_on_a_lock(url: str, pid: int, timeout_s: float = 20.0) -> None:
    """Until the backend ``pid`` waits on a heavyweight lock (a row's transaction or a table)."""
    with psycopg.connect(url, autocommit=True) as mon:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = mon.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            if row and row[0] == "Lock":
                return
            time.sleep(0.02)
    raise AssertionError(f"backend {pid} never waited on a lock")


def _race_a_paused_batch(pg_url, monkeypatch, other, *, batch_timeout: str, other_timeout: str):
    """Writer A appends a batch that mentions the new name suite:shared. Right after its unlocked phase
    has copied that name (uncommitted), and before it asks for the append lock, ``other(store)`` runs
    in a thread on its own store and takes the append lock first; once ``other`` waits on A's
    uncommitted rows, A goes on to ask for the lock: a deadlock, which the server breaks by aborting
    the side whose ``deadlock_timeout`` runs out first. The server checks a wait for a deadlock once,
    when its timeout runs out: the batch's short timeout (200 ms, counted from when the cycle is
    already closed) always makes the batch the one aborted; other's (2 s, counted from before the
    batch asks for the lock) makes other the one aborted unless the batch takes longer than that to
    ask, in which case the batch is, after its own timeout; either way both must end recorded once.
    Returns A's result, other's result (or the exception it raised) and A."""
    a, o = EventStore(pg_url), EventStore(pg_url)
    a.con.execute(f"SET deadlock_timeout = '{batch_timeout}'")
    o.con.execute(f"SET deadlock_timeout = '{other_timeout}'")
    o_pid = o.con.execute("SELECT pg_backend_pid()").fetchone()[0]
    out: dict = {}

    def run_other() -> None:
        try:
            out["other"] = other(o)
        except BaseException as e:  # reported by the test
            out["other"] = e

    real_copy = PostgresEventStore._copy
    thread = threading.Thread(target=run_other)

    def copy_then_let_other_in(cur, table, columns, fields, then=None):
        res = real_copy(cur, table, columns, fields, then)
        if table == "entity_names" and not thread.is_alive() and "other" not in out:
            thread.start()
            _backend_waits_on_a_lock(pg_url, o_pid)
        return res

    monkeypatch.setattr(PostgresEventStore, "_copy", staticmethod(copy_then_let_other_in))
    n = SMALL_APPEND + 6
    batch = pa.table({"stream": [f"trace:{i:04d}" for i in range(n)], "type": ["trace.ingested"] * n,
                      "payload": [canonical_json({"i": i}) for i in range(n)],
                      "causation": [["suite:shared"]] * n}, schema=BATCH_SCHEMA)
    try:
        res = a.append_batch(batch)
    finally:
        thread.join(60)
        o.close()
    return res, out["other"], a


def test_a_small_append_that_deadlocks_with_a_batch_is_retried(pg_url, monkeypatch):
    """The small append holds the lock and waits on the batch's uncommitted name; the batch waits on the
    lock. The server aborts the small append (its deadlock_timeout runs out first); it is retried, not
    raised, and both appends are recorded once (before the retry: DeadlockDetected from append)."""
    def small(store):
        return store.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["suite:shared"]))

    res, other, a = _race_a_paused_batch(pg_url, monkeypatch, small, batch_timeout="60s", other_timeout="2s")
    try:
        assert not isinstance(other, BaseException), f"the small append failed: {other!r}"
        assert res.appended == SMALL_APPEND + 6 and other.appended == 1
        assert a.last_seq() == SMALL_APPEND + 7 and a.check_integrity() == []
        assert a.lineage("eval:e1", "down") == [("suite:shared", 1)]
    finally:
        a.close()


def test_a_batch_that_deadlocks_with_a_small_append_is_retried(pg_url, monkeypatch):
    """The same deadlock, broken the other way: the batch's deadlock_timeout runs out first, the server
    aborts it, and the batch is retried after the small append commits."""
    def small(store):
        return store.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["suite:shared"]))

    res, other, a = _race_a_paused_batch(pg_url, monkeypatch, small, batch_timeout="200ms", other_timeout="60s")
    try:
        assert not isinstance(other, BaseException), f"the small append failed: {other!r}"
        assert other.appended == 1 and (other.first_seq, other.last_seq) == (1, 1)
        assert res.appended == SMALL_APPEND + 6 and res.first_seq == 2
        assert a.check_integrity() == []
    finally:
        a.close()


def test_a_rebuild_that_deadlocks_with_a_batch_is_retried(pg_url, monkeypatch):
    """A rebuild holds the append lock and waits to truncate entity_names, which the batch's unlocked
    copy holds; the batch waits on the lock. The rebuild is aborted, retried after the batch, and
    rebuilds the projections of every event."""
    res, other, a = _race_a_paused_batch(pg_url, monkeypatch, lambda store: store.rebuild_projections(),
                                         batch_timeout="60s", other_timeout="2s")
    try:
        assert not isinstance(other, BaseException), f"the rebuild failed: {other!r}"
        assert res.appended == SMALL_APPEND + 6
        assert a.check_integrity() == [] and a.projection_counts()["lineage_edges"] == SMALL_APPEND + 6
    finally:
        a.close()


def test_the_store_runs_read_committed_whatever_the_servers_default(pg_url):
    """Each statement of an append must see what committed before it (the lock's holder reads max(seq)
    after it gets the lock): a server or role whose default is REPEATABLE READ would give the append
    a snapshot taken before the lock."""
    with psycopg.connect(pg_url, autocommit=True) as con:
        db = con.execute("SELECT current_database()").fetchone()[0]
        con.execute(f'ALTER DATABASE "{db}" SET default_transaction_isolation = \'repeatable read\'')
    with EventStore(pg_url) as s, s.con.transaction():
        assert s.con.execute("SHOW transaction_isolation").fetchone()[0] == "read committed"
