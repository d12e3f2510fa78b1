"""Issue 31, finding 9: entity ids are keyed by 64-bit node ids (MD5); a name whose node id another
name holds must cost only the records that mention it, on both backends.

A real 64-bit MD5 collision cannot be found, so ``collide(a, b)`` makes the node function give ``b``
the node id of ``a`` everywhere it is computed: Python (:func:`flywheel.store.ids.node_id`), DuckDB SQL
(``flywheel.store.ids.NODE_SQL``, which the PostgreSQL backend's batch step uses too) and, on a
PostgreSQL store, the server's ``flywheel_node``.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from flywheel.store import (
    BATCH_SCHEMA,
    SMALL_APPEND,
    EntityIdCollisionError,
    EventStore,
    NewEvent,
    canonical_json,
)


@pytest.fixture
def collide(monkeypatch):
    import flywheel.store.ids as st

    def make(a: str, b: str, store: EventStore) -> None:
        orig = st.node_id
        monkeypatch.setattr(st, "node_id", lambda n: orig(a if n == b else n))
        # the column once (it may be a ? parameter): through a one-element list
        monkeypatch.setattr(st, "NODE_SQL", "(md5_number(list_transform([({0})], lambda n_: CASE WHEN n_ = "
                                             f"'{b}' THEN '{a}' ELSE n_ END)[1]) >> 64)::UBIGINT")
        if store.backend == "postgresql":
            with psycopg.connect(store.url, autocommit=True) as con:
                con.execute(f"""
                    CREATE OR REPLACE FUNCTION flywheel_node(name TEXT) RETURNS BIGINT LANGUAGE sql IMMUTABLE STRICT AS $$
                    SELECT (get_byte(d, 15)::BIGINT << 56) | (get_byte(d, 14)::BIGINT << 48) | (get_byte(d, 13)::BIGINT << 40)
                         | (get_byte(d, 12)::BIGINT << 32) | (get_byte(d, 11)::BIGINT << 24) | (get_byte(d, 10)::BIGINT << 16)
                         | (get_byte(d, 9)::BIGINT << 8) | get_byte(d, 8)::BIGINT
                    FROM (SELECT decode(md5(CASE WHEN name = '{b}' THEN '{a}' ELSE name END), 'hex') AS d) x $$""")
        assert st.node_id(a) == st.node_id(b)

    return make


@pytest.fixture
def store(store_location):
    s = EventStore(store_location)
    yield s
    s.close()


def _trace(i: int | str, ingest: str = "ingest:b1") -> tuple[str, str, str, list[str]]:
    return (f"trace:{i}", "trace.ingested", canonical_json({"i": str(i), "model": "m"}), [ingest])


def _table(rows) -> pa.Table:
    return pa.table({k: [r[j] for r in rows] for j, k in enumerate(BATCH_SCHEMA.names)}, schema=BATCH_SCHEMA)


def _consistent(store: EventStore) -> None:
    assert store.check_integrity() == []
    incremental = store.projection_rows()
    store.rebuild_projections()
    assert store.projection_rows() == incremental


@pytest.mark.parametrize("n_other", [3, SMALL_APPEND + 20], ids=["small", "arrow"])
def test_a_batch_with_one_colliding_trace_appends_the_rest_and_reports_the_one(store, collide, n_other):
    """Finding 9: the second of two colliding trace ids in one batch is refused alone (with the events
    that mention it: a failure caused by it); every other event of the batch is appended."""
    collide("trace:a", "trace:b", store)
    rows = [_trace("a"), *(_trace(i) for i in range(n_other)), _trace("b"),
            ("failure:f1", "failure.classified", canonical_json({"n": 1}), ["trace:0", "trace:b"]),
            ("failure:f2", "failure.classified", canonical_json({"n": 2}), ["trace:0", "trace:a"])]
    res = store.append_batch(_table(rows))
    assert res.appended == len(rows) - 2 and res.already_recorded == 0
    assert [(r["row"], r["stream"], r["entity"], r["collides_with"]) for r in res.rejected] == [
        (n_other + 1, "trace:b", "trace:b", "trace:a"), (n_other + 2, "failure:f1", "trace:b", "trace:a")]
    assert "'trace:b' and 'trace:a'" in res.rejected[0]["reason"]
    assert store.read("trace:b") == [] and store.read("failure:f1") == []
    assert len(store.read("trace:a")) == 1 and len(store.read("failure:f2")) == 1
    assert store.last_seq() == len(rows) - 2
    _consistent(store)


@pytest.mark.parametrize("n_other", [3, SMALL_APPEND + 20], ids=["small", "arrow"])
def test_a_name_the_store_holds_keeps_its_node_id_and_later_batches_go_on(store, collide, n_other):
    """Finding 9: once trace:a is recorded, every later batch carrying trace:b appends all but trace:b
    (before: 'nothing was appended', batch after batch)."""
    collide("trace:a", "trace:b", store)
    store.append_batch(_table([_trace("a")]))
    for k in range(2):
        rows = [*(_trace(f"{k}-{i}") for i in range(n_other)), _trace("b", ingest=f"ingest:{k}")]
        res = store.append_batch(_table(rows))
        assert res.appended == n_other and [r["entity"] for r in res.rejected] == ["trace:b"]
    assert store.read("trace:b") == [] and store.last_seq() == 1 + 2 * n_other
    # the refused rows' other names were not recorded either: a rebuild gives the same projections
    _consistent(store)


@pytest.mark.parametrize("n_events", [1, SMALL_APPEND + 5], ids=["small", "arrow"])
def test_append_of_a_colliding_single_stream_raises_naming_both_and_appends_nothing(store, collide, n_events):
    """Finding 9: store.append to one stream is all-or-nothing: a colliding entity (or causation name)
    raises EntityIdCollisionError naming both names, and nothing of the stream is appended."""
    collide("trace:a", "trace:b", store)
    store.append("trace:a", NewEvent("trace.ingested", {"i": 0}))
    evs = [NewEvent("trace.ingested", {"i": i}) for i in range(n_events)]
    with pytest.raises(EntityIdCollisionError, match="'trace:b' and 'trace:a'.*nothing was appended") as e:
        store.append("trace:b", evs)
    assert (e.value.name, e.value.other) == ("trace:b", "trace:a")
    caused = [NewEvent("trace.ingested", {"i": i}, ["trace:b"] if i == n_events - 1 else []) for i in range(n_events)]
    with pytest.raises(EntityIdCollisionError, match="'trace:b' and 'trace:a'"):
        store.append("trace:c", caused)
    assert store.last_seq() == 1 and store.read("trace:c") == []
    _consistent(store)


def _good(tid: str) -> dict:
    return {"trace_id": tid, "timestamp": "2026-11-02T09:00:00Z", "model": "m",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "outcome": {"status": "success"}}


def test_ingest_quarantines_the_colliding_trace_and_keeps_the_rest_of_the_file(cfg, store, collide, tmp_path: Path):
    """Finding 9: a trace whose id collides (with a trace of the same batch, or of the store) is
    quarantined as entity_id_collision with a detail naming both ids; the file's other traces go in."""
    from flywheel.artifacts import ArtifactStore
    from flywheel.ingest import ingest_paths, list_quarantine, show_quarantine

    arts = ArtifactStore(cfg.artifacts_dir)
    collide("trace:t-1", "trace:t-2", store)
    f1 = tmp_path / "one.jsonl"
    f1.write_text("".join(json.dumps(_good(t)) + "\n" for t in ("t-0", "t-1", "t-2", "t-3")))
    s = ingest_paths(cfg, store, arts, [f1])
    assert (s.ingested, s.quarantined_by_reason) == (3, {"entity_id_collision": 1})
    assert store.entity("trace:t-2") is None and store.entity("trace:t-3") is not None
    (q,) = list_quarantine(store)
    (row,) = show_quarantine(store, arts, q["stream"])
    assert row["reason"] == "entity_id_collision" and row["line"] == 3
    assert "'trace:t-2'" in row["detail"] and "'trace:t-1'" in row["detail"]
    # a later file carrying trace t-2 again: quarantined again, its neighbours ingested
    f2 = tmp_path / "two.jsonl"
    f2.write_text("".join(json.dumps(_good(t)) + "\n" for t in ("t-2", "t-4")))
    s = ingest_paths(cfg, store, arts, [f2])
    assert (s.ingested, s.quarantined_by_reason) == (1, {"entity_id_collision": 1})
    assert store.entity("trace:t-4") is not None
    _consistent(store)
