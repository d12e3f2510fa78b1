"""The PostgreSQL store's queries: :class:`PostgresReads`, what
:class:`~flywheel.store.postgres.PostgresEventStore` answers from the events and projections (reads, the
stages' questions, lineage walks, the integrity check, exports through server-side cursors)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from flywheel.store.contract import EXPORT_TABLES, Event, SqlParams
from flywheel.store.ids import signed_node_id
from flywheel.store.postgres_connection import PostgresConnection
from flywheel.store.postgres_copy import signed
from flywheel.store.schema import read_sql

EVENTS_ARROW = pa.schema([
    ("seq", pa.int64()), ("event_id", pa.string()), ("stream", pa.string()), ("stream_version", pa.int64()),
    ("type", pa.string()), ("payload", pa.string()), ("causation", pa.list_(pa.string())),
    ("correlation_id", pa.string()), ("recorded_at", pa.timestamp("us", tz="UTC")), ("schema_version", pa.int32()),
])
_EXPORT_SQL = {
    "events": ("SELECT seq, event_id, stream, stream_version, type, payload::text, causation, correlation_id, "
               "recorded_at, schema_version FROM events ORDER BY seq", EVENTS_ARROW),
    "streams": ("SELECT stream, version FROM streams ORDER BY stream COLLATE \"C\"",
                pa.schema([("stream", pa.string()), ("version", pa.int64())])),
    "entities": ("SELECT entity_id, kind, stream, last_type, first_seq, last_seq, n_events, state::text AS state "
                 "FROM entities ORDER BY first_seq",
                 pa.schema([("entity_id", pa.string()), ("kind", pa.string()), ("stream", pa.string()),
                            ("last_type", pa.string()), ("first_seq", pa.int64()), ("last_seq", pa.int64()),
                            ("n_events", pa.int64()), ("state", pa.string())])),
    "lineage_edges": ("SELECT child, parent, seq FROM lineage_edges ORDER BY seq, child COLLATE \"C\", parent COLLATE \"C\"",
                      pa.schema([("child", pa.string()), ("parent", pa.string()), ("seq", pa.int64())])),
}


class PostgresReads(PostgresConnection):
    """The queries of the PostgreSQL store (see the module docstring), each one statement through
    :meth:`_q` (tried again on a new connection when the connection broke)."""

    def check_integrity(self) -> list[str]:
        """The store's invariants (the server enforces the unique ones; the projections are checked
        against the events); returns violations (empty = ok)."""
        checks = {
            "seq is not 1..n": "SELECT count(*) <> count(DISTINCT seq) OR coalesce(max(seq), 0) <> count(*) FROM events",
            "duplicate event_id": "SELECT count(*) <> count(DISTINCT event_id) FROM events",
            "stream versions not contiguous from 1": """
                SELECT count(*) > 0 FROM (SELECT stream, count(*) n, count(DISTINCT stream_version) d,
                       min(stream_version) lo, max(stream_version) hi FROM events GROUP BY stream) s
                WHERE n <> d OR lo <> 1 OR hi <> n""",
            "entity_index disagrees with events": """
                SELECT count(*) > 0 FROM (
                    SELECT flywheel_node(coalesce(payload->>'entity_id', stream)) AS node,
                           min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events
                    FROM events GROUP BY 1) e
                FULL JOIN entity_index i USING (node)
                WHERE (e.first_seq, e.last_seq, e.n_events) IS DISTINCT FROM (i.first_seq, i.last_seq, i.n_events)""",
            "duplicate entity rows": "SELECT count(*) <> count(DISTINCT node) FROM entity_index",
            "duplicate lineage edges": "SELECT count(*) <> count(DISTINCT (child, parent)) FROM lineage_links",
            "entity names or node ids not unique, or a node id not its name's": """
                SELECT count(*) <> count(DISTINCT node) OR count(*) <> count(DISTINCT name)
                       OR coalesce(bool_or(node <> flywheel_node(name)), false) FROM entity_names""",
            "an entity or lineage edge without a name": """
                SELECT count(*) > 0 FROM (
                    SELECT node FROM entity_index UNION ALL SELECT child FROM lineage_links
                    UNION ALL SELECT parent FROM lineage_links
                ) x WHERE NOT EXISTS (SELECT 1 FROM entity_names n WHERE n.node = x.node)""",
            "a lineage edge's parent_name is not its parent's name": """
                SELECT count(*) > 0 FROM lineage_links l JOIN entity_names n ON n.node = l.parent
                WHERE n.name <> l.parent_name""",
        }
        return [name for name, sql in checks.items() if self._q(sql)[0][0]]

    def projection_counts(self) -> dict[str, int]:
        tables = {"events": "events", "streams": "streams", "entities": "entity_index", "lineage_edges": "lineage_links"}
        return {name: self._q(f"SELECT count(*) FROM {t}")[0][0] for name, t in tables.items()}

    def projection_rows(self) -> dict[str, list[tuple[Any, ...]]]:
        c = 'COLLATE "C"'
        return {
            "streams": [tuple(r) for r in self._q(f"SELECT stream, version FROM streams ORDER BY stream {c}")],
            "entities": [tuple(r) for r in self._q(
                "SELECT entity_id, kind, stream, last_type, first_seq, last_seq, n_events, state::text FROM entities "
                f"ORDER BY entity_id {c}, first_seq")],
            "lineage_edges": [tuple(r) for r in self._q(
                f"SELECT child, parent, seq FROM lineage_edges ORDER BY child {c}, parent {c}, seq")],
        }

    # -- reading -----------------------------------------------------------------------------
    _EVENT_COLS = ("seq, event_id, stream, stream_version, type, payload::text, causation, correlation_id, "
                   "recorded_at, schema_version")

    def stream_version(self, stream: str) -> int:
        version: int = self._q("SELECT coalesce(max(stream_version), 0) FROM events WHERE stream = %s", [stream])[0][0]
        return version

    @staticmethod
    def _where(stream: str | None, types: Sequence[str] | str | None, after_seq: int | None,
               correlation_id: str | None) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if stream is not None:
            if stream.endswith("*"):
                clauses.append("starts_with(stream, %s)")
                params.append(stream[:-1])
            else:
                clauses.append("stream = %s")
                params.append(stream)
        if types:
            clauses.append("type = ANY(%s)")
            params.append([types] if isinstance(types, str) else list(types))
        if after_seq is not None:
            clauses.append("seq > %s")
            params.append(after_seq)
        if correlation_id is not None:
            clauses.append("correlation_id = %s")
            params.append(correlation_id)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", params

    def read(self, stream: str | None = None, types: Sequence[str] | str | None = None, after_seq: int | None = None,
             limit: int | None = None, correlation_id: str | None = None, newest_first: bool = False) -> list[Event]:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = f"SELECT {self._EVENT_COLS} FROM events {where} ORDER BY seq {'DESC' if newest_first else ''}"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._event_from_row(r) for r in self._q(sql, params)]

    def read_arrow(self, stream: str | None = None, types: Sequence[str] | str | None = None, after_seq: int | None = None,
                   correlation_id: str | None = None, limit: int | None = None) -> pa.Table:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = f"SELECT {self._EVENT_COLS} FROM events {where} ORDER BY seq"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return pa.Table.from_batches(list(self._batches(sql, params, EVENTS_ARROW)), schema=EVENTS_ARROW)

    def _batches(self, sql: str, params: SqlParams, schema: pa.Schema, size: int = 50_000) -> Iterator[pa.RecordBatch]:
        """Rows of a query as Arrow record batches, through a server-side cursor (bounded memory)."""
        self._check_open()
        # A broken connection is replaced before the export starts (the first fetch); one that breaks
        # after rows were handed out raises: the reader cannot be restarted half-way.
        self._retrying(lambda: self.con.execute("SELECT 1").fetchall())
        with self._lock, self.con.transaction():
            with self.con.cursor(name="flywheel_export") as cur:
                cur.itersize = size
                cur.execute(sql, params)
                while rows := cur.fetchmany(size):
                    cols = list(zip(*rows, strict=True))
                    yield pa.RecordBatch.from_arrays(
                        [pa.array(list(c), type=f.type) for c, f in zip(cols, schema, strict=True)], schema=schema)

    def _table_batches(self, table: str) -> pa.RecordBatchReader:
        if table not in EXPORT_TABLES:
            raise ValueError(f"not an exported table: {table!r}")
        sql, schema = _EXPORT_SQL[table]
        return pa.RecordBatchReader.from_batches(schema, self._batches(sql, None, schema))

    def entity(self, entity_id: str) -> dict[str, Any] | None:
        rows = self._q(
            "SELECT e.stream, e.type, i.first_seq, i.last_seq, i.n_events, e.payload::text "
            "FROM entity_index i JOIN events e ON e.seq = i.last_seq "
            "JOIN entity_names n ON n.node = i.node AND n.name = %s WHERE i.node = %s",
            [entity_id, signed_node_id(entity_id)],  # the name too: another name may hold this node id
        )
        if not rows:
            return None
        r = rows[0]
        return {"entity_id": entity_id, "kind": entity_id.split(":", 1)[0], "stream": r[0], "last_type": r[1],
                "first_seq": r[2], "last_seq": r[3], "n_events": r[4], "state": json.loads(r[5])}

    def entities(self, kind: str, *, last_type: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT entity_id, last_type, state::text, first_seq, last_seq FROM entities WHERE kind = %s"
        params: list[Any] = [kind]
        if last_type:
            sql += " AND last_type = %s"
            params.append(last_type)
        sql += " ORDER BY first_seq"
        return [{"entity_id": r[0], "last_type": r[1], "state": json.loads(r[2]), "first_seq": r[3], "last_seq": r[4]}
                for r in self._q(sql, params)]

    def counts_by_kind(self) -> dict[str, int]:
        return dict(self._q(
            "SELECT split_part(n.name, ':', 1) AS kind, count(*) FROM entity_index i "
            "JOIN entity_names n ON n.node = i.node GROUP BY 1 ORDER BY 1"))

    def last_seq(self) -> int:
        seq: int = self._q("SELECT coalesce(max(seq), 0) FROM events")[0][0]
        return seq

    def latest_entity_id(self, prefix: str) -> str | None:
        rows = self._q(
            "SELECT entity_id FROM entities WHERE kind = %s AND starts_with(entity_id, %s) ORDER BY last_seq DESC LIMIT 1",
            [prefix.split(":", 1)[0], prefix])
        return rows[0][0] if rows else None

    def event_stats(self, types: Sequence[str], after_seq: int = 0) -> tuple[int, int]:
        r = self._q("SELECT count(*), coalesce(max(seq), 0) FROM events WHERE type = ANY(%s) AND seq > %s",
                    [list(types), int(after_seq)])[0]
        return int(r[0]), int(r[1])

    def existing_streams(self, streams: Sequence[str] | pa.Array | pa.ChunkedArray) -> list[str]:
        values = streams.to_pylist() if isinstance(streams, pa.Array | pa.ChunkedArray) else list(streams)
        if not values:
            return []
        return [r[0] for r in self._q(
            "SELECT s FROM unnest(%s::text[]) AS s WHERE EXISTS (SELECT 1 FROM events e WHERE e.stream = s)", [values])]

    def _names_holding(self, nodes: list[int]) -> list[tuple[int, str]]:
        return [(n, x) for n, x in self._q("SELECT node, name FROM entity_names WHERE node = ANY(%s::bigint[])",
                                            [[signed(n) for n in nodes]])]

    def entity_heads(self, entity_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        ids = list(entity_ids)
        if not ids:
            return {}
        rows = self._q(
            "SELECT n.name, e.payload::text, e.stream_version FROM entity_index i JOIN entity_names n ON n.node = i.node "
            "JOIN events e ON e.seq = i.last_seq WHERE i.node = ANY(%s)", [[signed_node_id(x) for x in ids]])
        wanted = set(ids)
        return {name: (state, int(v)) for name, state, v in rows if name in wanted}

    def trace_states(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        rows = self._q(
            """
            SELECT entity_id, state::text FROM entities
            WHERE kind = 'trace' AND last_type = 'trace.ingested'
              AND coalesce(state->>'status', state->'outcome'->>'status', state->'trace'->'outcome'->>'status') = %s
            ORDER BY first_seq
            """, [status])
        return [(r[0], json.loads(r[1])) for r in rows]

    def failure_kinds_by_day(self) -> list[tuple[str, str, int]]:
        rows = self._q(
            """
            SELECT substr(payload->>'timestamp', 1, 10) AS day, k.kind, count(*) AS n
            FROM events CROSS JOIN LATERAL json_array_elements_text(
                CASE WHEN json_typeof(payload->'kinds') = 'array' THEN payload->'kinds' ELSE '[]'::json END) AS k(kind)
            WHERE type = 'trace.ingested' AND payload->>'status' = 'failure'
            GROUP BY 1, 2 ORDER BY substr(payload->>'timestamp', 1, 10) COLLATE "C", k.kind COLLATE "C"
            """)
        return [(r[0], r[1], int(r[2])) for r in rows]

    # -- lineage -----------------------------------------------------------------------------
    def lineage(self, entity_id: str, direction: str = "down", max_depth: int = 64) -> list[tuple[str, int]]:
        if direction not in ("down", "up"):
            raise ValueError("direction must be 'down' or 'up'")
        params = {"node": signed_node_id(entity_id), "name": entity_id, "depth": int(max_depth)}
        if direction == "up":
            return [tuple(r) for r in self._q(read_sql("postgres/queries/lineage_up.sql"), params)]
        # one row per depth, its ancestors' names sorted (see the query)
        return [(name, depth) for depth, names in self._q(read_sql("postgres/queries/lineage_down.sql"), params)
                for name in names]

    def lineage_edges(self, entity_id: str, max_depth: int = 64) -> list[tuple[str, str]]:
        return [tuple(r) for r in self._q(read_sql("postgres/queries/lineage_edges_down.sql"),
                                          {"node": signed_node_id(entity_id), "name": entity_id, "depth": int(max_depth)})]
