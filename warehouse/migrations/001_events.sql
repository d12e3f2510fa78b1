-- 001: the append-only event store and its projections.
-- Applied in one explicit transaction by flywheel.store (DuckDB 2 auto-commits each statement of a
-- plain batch). Projections are derived: `flywheel warehouse rebuild` recomputes them from events.

CREATE TABLE IF NOT EXISTS events (
    seq            BIGINT      NOT NULL PRIMARY KEY,   -- global order, 1, 2, 3, ...
    event_id       VARCHAR     NOT NULL UNIQUE,        -- hash(type, stream, canonical payload)
    stream         VARCHAR     NOT NULL,
    stream_version BIGINT      NOT NULL,               -- 1, 2, 3, ... per stream
    type           VARCHAR     NOT NULL,
    payload        JSON        NOT NULL,
    causation      VARCHAR[]   NOT NULL,               -- entity ids this event was caused by
    correlation_id VARCHAR,                            -- the run (cycle, CLI call) that produced it
    recorded_at    TIMESTAMPTZ NOT NULL,
    schema_version INTEGER     NOT NULL,
    UNIQUE (stream, stream_version)
);

-- Projection: current version of every stream (what optimistic concurrency checks against).
CREATE TABLE IF NOT EXISTS streams (
    stream  VARCHAR NOT NULL PRIMARY KEY,
    version BIGINT  NOT NULL
);

-- Projection: current state of every entity (the payload of its latest event).
CREATE TABLE IF NOT EXISTS entities (
    entity_id VARCHAR NOT NULL PRIMARY KEY,
    kind      VARCHAR NOT NULL,
    stream    VARCHAR NOT NULL,
    last_type VARCHAR NOT NULL,
    first_seq BIGINT  NOT NULL,
    last_seq  BIGINT  NOT NULL,
    n_events  BIGINT  NOT NULL,
    state     JSON    NOT NULL
);

-- Projection: lineage edges, child entity -> parent entity (from each event's causation).
CREATE TABLE IF NOT EXISTS lineage_edges (
    child  VARCHAR NOT NULL,
    parent VARCHAR NOT NULL,
    seq    BIGINT  NOT NULL,                            -- first event that recorded the edge
    PRIMARY KEY (child, parent)
);
