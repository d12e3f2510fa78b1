-- PostgreSQL 001: the event store and its projections for team mode (store.url = "postgresql://...").
-- The same tables as the embedded DuckDB warehouse after its migration 003. The server enforces
-- PRIMARY KEY (seq) and UNIQUE (stream, stream_version) for any number of writers on any number of
-- machines; event_id uniqueness is the append's (under its advisory lock it skips an event whose id its
-- stream already holds, found through the (stream, stream_version) index): an id hashes its stream,
-- and a UNIQUE index on 35-character random ids cost more per append than any other index here.
-- check_integrity() verifies it. Applied by flywheel.store_postgres under an advisory lock (writers
-- starting at once migrate once).

CREATE TABLE events (
    seq            BIGINT      NOT NULL PRIMARY KEY,   -- global order, 1, 2, 3, ... (commit order)
    event_id       TEXT COLLATE "C" NOT NULL,          -- hash(type, stream, canonical payload), unique by append
    stream         TEXT COLLATE "C" NOT NULL,          -- "C": byte order, as DuckDB sorts, and cheap to index
    stream_version BIGINT      NOT NULL,               -- 1, 2, 3, ... per stream
    type           TEXT        NOT NULL,
    payload        JSON        NOT NULL,               -- json keeps the canonical text the id hashes
    causation      TEXT[]      NOT NULL,               -- entity ids this event was caused by
    correlation_id TEXT,                               -- the run (cycle, CLI call) that produced it
    recorded_at    TIMESTAMPTZ NOT NULL DEFAULT now(), -- the appending transaction's start
    schema_version INTEGER     NOT NULL,
    UNIQUE (stream, stream_version)
);

-- node(name): the same 64 bits as DuckDB's (md5_number(name) >> 64)::UBIGINT (the last 8 bytes of
-- the name's MD5, little-endian), read as a signed BIGINT. Clients compute it for appends; the
-- server needs it for rebuilds, integrity checks and the start of a lineage walk.
CREATE FUNCTION flywheel_node(name TEXT) RETURNS BIGINT LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT AS $$
    SELECT (get_byte(d, 15)::BIGINT << 56) | (get_byte(d, 14)::BIGINT << 48) | (get_byte(d, 13)::BIGINT << 40)
         | (get_byte(d, 12)::BIGINT << 32) | (get_byte(d, 11)::BIGINT << 24) | (get_byte(d, 10)::BIGINT << 16)
         | (get_byte(d, 9)::BIGINT << 8) | get_byte(d, 8)::BIGINT
    FROM (SELECT decode(md5(name), 'hex') AS d) x
$$;

CREATE TABLE entity_names (
    node BIGINT NOT NULL PRIMARY KEY,      -- flywheel_node(name)
    name TEXT COLLATE "C" NOT NULL
);

CREATE TABLE entity_index (
    node      BIGINT NOT NULL PRIMARY KEY, -- entity_names.node
    first_seq BIGINT NOT NULL,
    last_seq  BIGINT NOT NULL,             -- the entity's latest event: its stream, type and payload
    n_events  BIGINT NOT NULL
);

CREATE TABLE lineage_links (
    child  BIGINT NOT NULL,                -- entity_names.node
    parent BIGINT NOT NULL,
    seq    BIGINT NOT NULL,                -- first event that recorded the edge
    PRIMARY KEY (child, parent)
);
CREATE INDEX lineage_links_parent ON lineage_links (parent, child);

CREATE VIEW entities AS
    SELECT n.name AS entity_id, split_part(n.name, ':', 1) AS kind, e.stream, e.type AS last_type,
           i.first_seq, i.last_seq, i.n_events, e.payload AS state
    FROM entity_index i JOIN entity_names n ON n.node = i.node JOIN events e ON e.seq = i.last_seq;

CREATE VIEW lineage_edges AS
    SELECT c.name AS child, p.name AS parent, l.seq
    FROM lineage_links l JOIN entity_names c ON c.node = l.child JOIN entity_names p ON p.node = l.parent;

CREATE VIEW streams AS
    SELECT stream, max(stream_version) AS version FROM events GROUP BY stream;
