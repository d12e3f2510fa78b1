"""The embedded store's queries: :class:`DuckDBReads`, what
:class:`~flywheel.store.local.DuckDBEventStore` answers from the events and projections (reads, the
stages' questions, lineage walks, the integrity check, exports), in this process or through the
file's owner."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from flywheel.store import ids as store_ids
from flywheel.store.contract import EXPORT_TABLES, Event
from flywheel.store.local_connection import DuckDBConnection
from flywheel.store.schema import read_sql


class DuckDBReads(DuckDBConnection):
    """The queries of the embedded store (see the module docstring): every read goes through
    :meth:`_q` / :meth:`_qa`, which run it in the owning process or forward it to the owner."""

    def check_integrity(self) -> list[str]:
        """The invariants the append transaction keeps without indexes; returns violations (empty = ok).

        seq is 1..n without gaps or repeats; event_id is unique; every
        stream's versions are 1..k; ``entity_index`` agrees with the events; no projection row is
        duplicated; node ids are their names' and unique; every entity and edge has a name.
        """
        checks = {
            "seq is not 1..n": "SELECT count(*) <> count(DISTINCT seq) OR coalesce(max(seq), 0) <> count(*) FROM events",
            "duplicate event_id": "SELECT count(*) <> count(DISTINCT event_id) FROM events",
            "stream versions not contiguous from 1": """
                SELECT count(*) > 0 FROM (SELECT stream, count(*) n, count(DISTINCT stream_version) d,
                       min(stream_version) lo, max(stream_version) hi FROM events GROUP BY stream)
                WHERE n <> d OR lo <> 1 OR hi <> n""",
            "entity_index disagrees with events": f"""
                SELECT count(*) > 0 FROM (
                    SELECT {store_ids.NODE_SQL.format(store_ids.ENTITY_SQL)} AS node,
                           min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events
                    FROM events GROUP BY 1) e
                FULL JOIN entity_index i USING (node)
                WHERE (e.first_seq, e.last_seq, e.n_events) IS DISTINCT FROM (i.first_seq, i.last_seq, i.n_events)""",
            "duplicate entity rows": "SELECT count(*) <> count(DISTINCT node) FROM entity_index",
            "duplicate lineage edges": "SELECT count(*) <> count(DISTINCT (child, parent)) FROM lineage_links",
            "entity names or node ids not unique, or a node id not its name's": f"""
                SELECT count(*) <> count(DISTINCT node) OR count(*) <> count(DISTINCT name)
                       OR bool_or(node <> {store_ids.NODE_SQL.format("name")}) FROM entity_names""",
            "an entity or lineage edge without a name": """
                SELECT count(*) > 0 FROM (
                    SELECT node FROM entity_index UNION ALL SELECT child FROM lineage_links
                    UNION ALL SELECT parent FROM lineage_links
                ) x ANTI JOIN entity_names n ON n.node = x.node""",
        }
        return [name for name, sql in checks.items() if self._q(sql)[0][0]]

    def projection_counts(self) -> dict[str, int]:
        tables = {"events": "events", "streams": "streams", "entities": "entity_index", "lineage_edges": "lineage_links"}
        return {name: self._q(f"SELECT count(*) FROM {t}")[0][0] for name, t in tables.items()}

    def projection_rows(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of the projections as people read them (``streams``, ``entities``,
        ``lineage_edges``), sorted, with JSON as text: what rebuilt == incremental compares."""
        return {
            "streams": [tuple(r) for r in self._q("SELECT stream, version FROM streams ORDER BY ALL")],
            "entities": [tuple(r) for r in self._q(
                "SELECT entity_id, kind, stream, last_type, first_seq, last_seq, n_events, state::VARCHAR "
                "FROM entities ORDER BY ALL")],
            "lineage_edges": [tuple(r) for r in self._q("SELECT child, parent, seq FROM lineage_edges ORDER BY ALL")],
        }

    # -- reading -----------------------------------------------------------------------------
    def stream_version(self, stream: str) -> int:
        return self._q("SELECT coalesce(max(stream_version), 0) FROM events WHERE stream = ?", [stream])[0][0]

    def read(
        self,
        stream: str | None = None,
        types: Sequence[str] | str | None = None,
        after_seq: int | None = None,
        limit: int | None = None,
        correlation_id: str | None = None,
        newest_first: bool = False,
    ) -> list[Event]:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = (
            "SELECT seq, event_id, stream, stream_version, type, payload, causation, correlation_id, "
            f"recorded_at, schema_version FROM events {where} ORDER BY seq {'DESC' if newest_first else ''}"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._event_from_row(r) for r in self._q(sql, params)]

    def read_arrow(self, stream: str | None = None, types: Sequence[str] | str | None = None, after_seq: int | None = None,
                   correlation_id: str | None = None, limit: int | None = None) -> pa.Table:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = f"SELECT * FROM events {where} ORDER BY seq"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self._qa(sql, params)

    @staticmethod
    def _where(stream: str | None, types: Sequence[str] | str | None, after_seq: int | None,
               correlation_id: str | None) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if stream is not None:
            if stream.endswith("*"):
                clauses.append("starts_with(stream, ?)")
                params.append(stream[:-1])
            else:
                clauses.append("stream = ?")
                params.append(stream)
        if types:
            types = [types] if isinstance(types, str) else list(types)
            clauses.append(f"type IN ({', '.join('?' for _ in types)})")
            params.extend(types)
        if after_seq is not None:
            clauses.append("seq > ?")
            params.append(after_seq)
        if correlation_id is not None:
            clauses.append("correlation_id = ?")
            params.append(correlation_id)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", params

    def entity(self, entity_id: str) -> dict[str, Any] | None:
        row = self._q(
            f"""
            SELECT ?::VARCHAR, split_part(?::VARCHAR, ':', 1), e.stream, e.type, i.first_seq, i.last_seq,
                   i.n_events, e.payload
            FROM entity_index i JOIN events e ON e.seq = i.last_seq
            JOIN entity_names n ON n.node = i.node AND n.name = ?::VARCHAR
            WHERE i.node = {store_ids.NODE_SQL.format("?::VARCHAR")}
            """,
            [entity_id, entity_id, entity_id, entity_id],
        )  # the name too: another name may hold this node id (a collision the append refused)
        if not row:
            return None
        keys = ["entity_id", "kind", "stream", "last_type", "first_seq", "last_seq", "n_events", "state"]
        out = dict(zip(keys, row[0], strict=True))
        out["state"] = json.loads(out["state"])
        return out

    def entities(self, kind: str, *, last_type: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT entity_id, last_type, state, first_seq, last_seq FROM entities WHERE kind = ?"
        params: list[Any] = [kind]
        if last_type:
            sql += " AND last_type = ?"
            params.append(last_type)
        sql += " ORDER BY first_seq"
        return [
            {"entity_id": r[0], "last_type": r[1], "state": json.loads(r[2]), "first_seq": r[3], "last_seq": r[4]}
            for r in self._q(sql, params)
        ]

    def counts_by_kind(self) -> dict[str, int]:
        return dict(
            self._q(
                "SELECT split_part(n.name, ':', 1) AS kind, count(*) FROM entity_index i "
                "JOIN entity_names n ON n.node = i.node GROUP BY kind ORDER BY kind"
            )
        )

    def last_seq(self) -> int:
        return self._q("SELECT coalesce(max(seq), 0) FROM events")[0][0]

    # -- queries the stages need (one per question, so both backends can answer it) -----------------
    def latest_entity_id(self, prefix: str) -> str | None:
        """The entity id starting with ``prefix`` (e.g. ``suite:heldout@``) whose latest event is newest."""
        kind = prefix.split(":", 1)[0]
        rows = self._q(
            "SELECT entity_id FROM entities WHERE kind = ? AND starts_with(entity_id, ?) ORDER BY last_seq DESC LIMIT 1",
            [kind, prefix],
        )
        return rows[0][0] if rows else None

    def event_stats(self, types: Sequence[str], after_seq: int = 0) -> tuple[int, int]:
        """(number of events of these types after ``after_seq``, their largest seq or 0)."""
        types = list(types)
        rows = self._q(
            f"SELECT count(*), coalesce(max(seq), 0) FROM events WHERE type IN ({', '.join('?' for _ in types)}) "
            "AND seq > ?",
            [*types, int(after_seq)],
        )
        return int(rows[0][0]), int(rows[0][1])

    def existing_streams(self, streams: Sequence[str] | pa.Array | pa.ChunkedArray) -> list[str]:
        """Which of ``streams`` hold at least one event."""
        values = streams if isinstance(streams, pa.Array | pa.ChunkedArray) else pa.array(list(streams), pa.string())
        if not len(values):
            return []
        return self._with_keys(values, "SELECT DISTINCT stream FROM events WHERE stream IN (SELECT k FROM _fw_keys)")

    def entity_heads(self, entity_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        """For each of these entities that exists: its state (JSON text) and the version its latest
        event has in that event's stream (what an append that builds on the state expects)."""
        if not entity_ids:
            return {}
        rows = self._with_keys(pa.array(list(entity_ids), pa.string()),
                               "SELECT n.name, e.payload::VARCHAR, e.stream_version FROM entity_index i "
                               "JOIN entity_names n ON n.node = i.node JOIN events e ON e.seq = i.last_seq "
                               f"WHERE i.node IN (SELECT {store_ids.NODE_SQL.format('k')} FROM _fw_keys)", one=False)
        wanted = set(entity_ids)
        return {name: (state, int(v)) for name, state, v in rows if name in wanted}

    def _names_holding(self, nodes: list[int]) -> list[tuple[int, str]]:
        return [tuple(r) for r in self._q(
            "SELECT node, name FROM entity_names WHERE node IN (SELECT unnest(?::UBIGINT[]))", [nodes])]

    def _with_keys(self, keys: pa.Array | pa.ChunkedArray, sql: str, *, one: bool = True) -> list[Any]:
        if self._remote is not None:
            # No Arrow registration through the owner: the keys travel as a list literal parameter.
            inline = sql.replace("FROM _fw_keys)", "FROM (SELECT unnest(?::VARCHAR[]) AS k))")
            rows = self._q(inline, [keys.to_pylist()])
        else:
            con = self._rcon()
            con.register("_fw_keys", pa.table({"k": keys}))
            try:
                rows = con.execute(sql).fetchall()
            finally:
                con.unregister("_fw_keys")
        return [r[0] for r in rows] if one else [tuple(r) for r in rows]

    def trace_states(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        """``trace:`` entities whose latest event is ``trace.ingested`` with this outcome status, oldest
        first, with their states (filtered in SQL so the others' payloads are never parsed)."""
        rows = self._q(
            """
            SELECT entity_id, state::VARCHAR FROM entities
            WHERE kind = 'trace' AND last_type = 'trace.ingested' AND coalesce(
                json_extract_string(state, '$.status'),
                json_extract_string(state, '$.outcome.status'),
                json_extract_string(state, '$.trace.outcome.status')) = ?
            ORDER BY first_seq
            """,
            [status],
        )
        return [(r[0], json.loads(r[1])) for r in rows]

    def failure_kinds_by_day(self) -> list[tuple[str, str, int]]:
        """(day, failure kind, count) over ``trace.ingested`` failures, by the trace's own timestamp."""
        rows = self._q(
            """
            SELECT substr(json_extract_string(payload, '$.timestamp'), 1, 10) AS day, kind, count(*) AS n
            FROM (
                SELECT payload, unnest(CAST(json_extract(payload, '$.kinds') AS VARCHAR[])) AS kind
                FROM events WHERE type = 'trace.ingested' AND json_extract_string(payload, '$.status') = 'failure'
            ) GROUP BY ALL ORDER BY day, kind
            """
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    # -- lineage -----------------------------------------------------------------------------
    def lineage(self, entity_id: str, direction: str = "down", max_depth: int = 64) -> list[tuple[str, int]]:
        """Ancestors (``down``: what it was made from) or descendants (``up``: what it made)."""
        if direction not in ("down", "up"):
            raise ValueError("direction must be 'down' or 'up'")
        return [tuple(r) for r in self._q(read_sql(f"queries/lineage_{direction}.sql"), [entity_id, max_depth])]

    def lineage_edges(self, entity_id: str, max_depth: int = 64) -> list[tuple[str, str]]:
        return [tuple(r) for r in self._q(read_sql("queries/lineage_edges_down.sql"), [entity_id, max_depth])]

    # -- export ------------------------------------------------------------------------------
    def _table_batches(self, table: str) -> pa.RecordBatchReader:
        if table not in EXPORT_TABLES:
            raise ValueError(f"not an exported table: {table!r}")
        if self._remote is not None:
            return self._qa(f"SELECT * FROM {table}").to_reader()
        return self._rcon().sql(f"SELECT * FROM {table}").to_arrow_reader()
