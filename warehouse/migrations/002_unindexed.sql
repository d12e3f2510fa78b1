-- 002: the same tables without ART indexes (PRIMARY KEY / UNIQUE), for append throughput.
--
-- Why: every DuckDB PRIMARY KEY / UNIQUE constraint is an ART index that is updated row by row on
-- insert and serialised on checkpoint. Measured on this 2-core machine (DuckDB 2.0.1), 1M rows in
-- batches of 100k: no index 1.8 s, one UNIQUE on a random 64-bit key 4.8 s, one UNIQUE on the
-- 35-character event_id 7.4 s. 001 had six such indexes and appended ~40k events/s.
--
-- The guarantees the indexes gave are kept by the append transaction itself (flywheel/store.py):
-- the store is the only writer (DuckDB's file lock across processes, a per-file lock inside the
-- process), so inside one transaction it can
--   * assign seq = max(seq) + 1, 2, ...                       (was: PRIMARY KEY (seq))
--   * skip events whose event_id is already recorded (anti-join) (was: UNIQUE (event_id))
--   * number each stream from its projected version + 1, 2, ...  (was: UNIQUE (stream, stream_version))
--   * upsert projections with MERGE / anti-joins               (was: PRIMARY KEY of each projection)
-- EventStore.check_integrity() verifies all four on demand; tests assert it after every operation.
--
-- Rows are copied in seq order so zone maps on seq keep pruning (reads `WHERE seq > n` touch only
-- the newest row groups).

CREATE TABLE events_v2 (
    seq            BIGINT      NOT NULL,   -- global order, 1, 2, 3, ... (assigned by the append)
    event_id       VARCHAR     NOT NULL,   -- hash(type, stream, canonical payload), unique by append
    stream         VARCHAR     NOT NULL,
    stream_version BIGINT      NOT NULL,   -- 1, 2, 3, ... per stream, (stream, version) unique by append
    type           VARCHAR     NOT NULL,
    payload        JSON        NOT NULL,
    causation      VARCHAR[]   NOT NULL,   -- entity ids this event was caused by
    correlation_id VARCHAR,                -- the run (cycle, CLI call) that produced it
    recorded_at    TIMESTAMPTZ NOT NULL,
    schema_version INTEGER     NOT NULL
);
INSERT INTO events_v2 SELECT * FROM events ORDER BY seq;
DROP TABLE events;
ALTER TABLE events_v2 RENAME TO events;

CREATE TABLE streams_v2 (
    stream  VARCHAR NOT NULL,              -- one row per stream (by append)
    version BIGINT  NOT NULL
);
INSERT INTO streams_v2 SELECT * FROM streams;
DROP TABLE streams;
ALTER TABLE streams_v2 RENAME TO streams;

CREATE TABLE entities_v2 (
    entity_id VARCHAR NOT NULL,            -- one row per entity (by append)
    kind      VARCHAR NOT NULL,
    stream    VARCHAR NOT NULL,
    last_type VARCHAR NOT NULL,
    first_seq BIGINT  NOT NULL,
    last_seq  BIGINT  NOT NULL,
    n_events  BIGINT  NOT NULL,
    state     JSON    NOT NULL
);
INSERT INTO entities_v2 SELECT * FROM entities;
DROP TABLE entities;
ALTER TABLE entities_v2 RENAME TO entities;

CREATE TABLE lineage_edges_v2 (
    child  VARCHAR NOT NULL,               -- one row per (child, parent) (by append)
    parent VARCHAR NOT NULL,
    seq    BIGINT  NOT NULL                -- first event that recorded the edge
);
INSERT INTO lineage_edges_v2 SELECT * FROM lineage_edges;
DROP TABLE lineage_edges;
ALTER TABLE lineage_edges_v2 RENAME TO lineage_edges;
