"""The event store on PostgreSQL (team mode: ``store.url = "postgresql://..."``).

Same contract as the embedded store (:mod:`flywheel.store`, :mod:`flywheel.store.local`); what differs is how it is kept:

- Uniqueness is the server's: PRIMARY KEY (seq), UNIQUE (stream, stream_version)
  (``warehouse/postgres/001_events.sql``), so any number of writers on any number of machines share
  the store; an event id is unique by the append, which skips an id its stream already holds.
- An append is one transaction in three phases. (1) Without the lock: the batch's event ids, entity
  ids and node ids are computed in this process (DuckDB over the Arrow batch, the same SQL as the
  embedded store), its streams' versions and the names and entities it mentions are looked up, and
  its new names are COPYed into ``entity_names``. (2) Under ``pg_advisory_xact_lock``: ``seq``
  continues from ``max(seq)``; of the streams that existed in phase 1, those another writer appended
  to since are looked up again; ``expected_versions`` are checked; the events, the new entities and
  the new lineage edges (each with its parent's name, migration 002) are COPYed in (COPY's text
  format, built column-wise in Arrow), known entities updated. (3) COMMIT, which releases the lock:
  appends commit in seq order, so seq has no gaps and a reader that saw seq n has seen every event
  before it. A writer that created one of the batch's streams, entities or names between (1) and (2)
  makes the copy fail on a unique index: the append is retried from (1), where it finds them.
  Batches of up to :data:`flywheel.store.SMALL_APPEND` events skip COPY: one lookup and one statement,
  under the lock from the start. Such an append, or a rebuild, can hold the lock and wait on the names
  a batch copied in (1) while that batch waits on the lock: the server breaks the deadlock after its
  ``deadlock_timeout`` (1 s by default) by aborting one of them, which is retried (nothing of it was
  written). Transactions run READ COMMITTED whatever the server's default, so that each statement
  sees what committed before it.
- Lineage walks are recursive CTEs over the (child, parent) INCLUDE (parent_name) primary key, which
  gives each ancestor's name in the probe that finds it, and the (parent, child) index
  (``warehouse/postgres/queries``). Why not DuckDB attached to PostgreSQL through its ``postgres``
  extension: that extension is downloaded from DuckDB's extension repository at ``INSTALL`` time
  (nothing on PyPI ships it for DuckDB 2.0), which an offline worker cannot reach, and the
  recursive CTE on the server answers the benchmark's model -> traces walk within its target
  (``benchmarks/bench_event_store.py``).

Driver: psycopg 3 (``COPY ... FROM STDIN`` for batches, server-side cursors for exports); asyncpg
(installed with Prefect) would need an event loop in every stage for the same COPY.

This module holds the appends, the rebuild of the projections and the copy of an embedded store to a
server (:func:`migrate_events`); the rest of the class is its bases: :mod:`flywheel.store.postgres_reads`
(the queries) over :mod:`flywheel.store.postgres_connection` (connecting, migrations, reconnecting, the
append's transaction). A batch's COPY text form is :mod:`flywheel.store.postgres_copy`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import duckdb
import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import CATALOG
from flywheel.store import ids as store_ids
from flywheel.store.batch import expected_of, normalise_batch, plan_append, small_rows
from flywheel.store.contract import (
    SMALL_APPEND,
    AppendResult,
    EventStore,
    InvalidEventError,
    StoreError,
)
from flywheel.store.ids import event_id_sql, signed_node_id
from flywheel.store.postgres_copy import edges_of, names_of, pg_array, pg_text, schema_versions, signed
from flywheel.store.postgres_reads import EVENTS_ARROW, PostgresReads

# pg_advisory_xact_lock key (two int4: "flyw", purpose) of appends and rebuilds (migrations take
# ("flyw", 2): flywheel.store.postgres_connection).
_APPEND_LOCK = (0x666C7977, 1)
_BATCH_COLUMNS = "i, event_id, stream, type, payload, causation, entity, node, pnodes"


class PostgresEventStore(PostgresReads):
    """The event store in a PostgreSQL database (see the module docstring)."""

    backend = "postgresql"

    # -- appending ---------------------------------------------------------------------------
    def append_batch(
        self,
        table: pa.Table,
        *,
        correlation_id: str | None = None,
        expected_versions: dict[str, int] | None = None,
        validated: bool = False,
    ) -> AppendResult:
        """Append many events (any streams) in one transaction; see :meth:`EventStore.append_batch` of the
        embedded store for the semantics and the module docstring for how it is done here."""
        self._check_open()
        if table.num_rows == 0:
            return AppendResult()
        if self.read_only:
            raise StoreError(f"event store {self.location} is open read-only; appends need a writable store")
        batch = normalise_batch(table, validated)
        if batch.num_rows <= SMALL_APPEND:
            rows = small_rows(batch)
            if rows is not None:
                # Held the lock and waited on a name a batch had copied before asking for it: aborted by
                # the server to break the deadlock.
                small: AppendResult = self._transaction(
                    lambda: self._append_small(rows, correlation_id, expected_versions), psycopg.errors.DeadlockDetected)
                return small
        cols = self._prepare(batch)
        try:
            # Another writer created one of this batch's streams, entities, names or edges between the
            # lookups and the copy, or the lock's holder (a small append, a rebuild) waited on the names this
            # batch copied before asking for the lock and the server aborted this batch: look again.
            res: AppendResult = self._transaction(lambda: self._append_tx(batch, cols, correlation_id, expected_versions),
                                                  (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected))
            return res
        except psycopg.errors.InvalidTextRepresentation as e:
            raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None

    def _append_small(self, rows: list[Any], correlation_id: str | None,
                      expected_versions: dict[str, int] | None) -> AppendResult:
        """A few events (what stages do between batches): under the lock from the start, one lookup and
        one statement of inserts from arrays (no COPY, no staging table); the same plan and projections
        as the batch path."""
        cur = self.con.cursor()
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _APPEND_LOCK)
        names: dict[str, int] = {}  # in the order the batch mentions them
        for r in rows:
            names.setdefault(r.entity, r.node)
            for c, p in zip(r.causation, r.parents, strict=True):
                if c is not None:
                    names.setdefault(c, p)
        # One lookup: the last seq (kind 0), the batch's streams that exist with their versions and the
        # batch's event ids they hold (kind 1), and the store's names that hold the batch's node ids
        # (kind 2: for the collision check).
        found = cur.execute(
            """
            SELECT 0, NULL::text, coalesce(max(seq), 0), NULL::text[] FROM events
            UNION ALL
            SELECT 1, s, (SELECT max(stream_version) FROM events e WHERE e.stream = s),
                   ARRAY(SELECT e.event_id FROM events e WHERE e.stream = s AND e.event_id = ANY(%(ids)s))
            FROM unnest(%(streams)s::text[]) AS s
            UNION ALL
            SELECT 2, n.name, n.node, NULL FROM entity_names n WHERE n.node = ANY(%(nodes)s::bigint[])
            """,
            {"ids": [r.event_id for r in rows], "streams": sorted({r.stream for r in rows}),
             "nodes": [signed(n) for n in names.values()]},
        ).fetchall()
        base = found[0][2]
        # A stored name that is not among the batch's names holds one of their node ids: a collision.
        held = [(n % (1 << 64), x) for kind, x, n, _ in found if kind == 2]
        rejected: dict[int, dict[str, Any]] = {}
        if any(x not in names for _, x in held) or len(set(names.values())) != len(names):
            clashes = EventStore._check_node_ids(
                pa.table({"name": list(names), "node": pa.array(list(names.values()), pa.uint64())}), held)
            if clashes:
                rejected = EventStore._rejected_rows([r.stream for r in rows], [r.type for r in rows],
                                                     [r.event_id for r in rows], [r.entity for r in rows],
                                                     [r.causation for r in rows], clashes)
                rows = [r for k, r in enumerate(rows) if k not in rejected]
                if not rows:
                    return AppendResult(rejected=list(rejected.values()))
                mentioned = {n for r in rows for n in (r.entity, *r.causation)}
                names = {n: v for n, v in names.items() if n in mentioned}
                expected_versions = expected_of(expected_versions, {r.stream for r in rows})
        known = [(st, v, ids) for kind, st, v, ids in found if kind == 1 and v is not None]
        plan = plan_append(pa.array([r.stream for r in rows], pa.string()), pa.array([r.event_id for r in rows], pa.string()),
                           pa.array([k[0] for k in known], pa.string()), pa.array([k[1] for k in known], pa.int64()),
                           pa.array([i for k in known for i in k[2]], pa.string()), expected_versions)
        n_new = plan.n_new
        result = AppendResult(appended=n_new, already_recorded=len(rows) - n_new, rejected=list(rejected.values()))
        if n_new == 0:
            return result
        fresh = [r for r, keep in zip(rows, plan.fresh, strict=True) if keep]
        ev = {"seq": [], "id": [], "stream": [], "version": [], "type": [], "payload": [], "causation": [], "sv": []}
        entities: dict[int, list[int]] = {}
        links: dict[tuple[int, int], int] = {}
        for k, (r, version) in enumerate(zip(fresh, plan.versions.tolist(), strict=True)):
            seq = base + 1 + k
            for key, v in (("seq", seq), ("id", r.event_id), ("stream", r.stream), ("version", version), ("type", r.type),
                           ("payload", r.payload), ("causation", "{" + ",".join(
                               '"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' if c is not None else "NULL"
                               for c in r.causation) + "}"),
                           ("sv", CATALOG[r.type].schema_version if r.type in CATALOG else 1)):
                ev[key].append(v)
            e = entities.setdefault(signed(r.node), [seq, seq, 0])
            e[1], e[2] = seq, e[2] + 1
            for name, parent in zip(r.causation, r.parents, strict=True):
                if name is not None and name != r.entity:
                    links.setdefault((signed(r.node), signed(parent)), (seq, name))
        try:
            clash = cur.execute(
                """
                WITH x AS (SELECT * FROM unnest(%(nn)s::bigint[], %(nm)s::text[]) AS x(node, name)),
                have AS MATERIALIZED (SELECT x.name, n.name AS old FROM x JOIN entity_names n ON n.node = x.node),
                nm AS (INSERT INTO entity_names (node, name) SELECT node, name FROM x ORDER BY node ON CONFLICT (node) DO NOTHING),
                ins AS (
                    INSERT INTO events (seq, event_id, stream, stream_version, type, payload, causation, correlation_id,
                                        recorded_at, schema_version)
                    SELECT seq, id, stream, version, type, payload::json, causation::text[], %(corr)s, now(), sv
                    FROM unnest(%(seq)s::bigint[], %(id)s::text[], %(stream)s::text[], %(version)s::bigint[],
                                %(type)s::text[], %(payload)s::text[], %(causation)s::text[], %(sv)s::int[])
                         AS e(seq, id, stream, version, type, payload, causation, sv)
                ),
                ent AS (
                    INSERT INTO entity_index (node, first_seq, last_seq, n_events)
                    SELECT * FROM unnest(%(en)s::bigint[], %(ef)s::bigint[], %(el)s::bigint[], %(ec)s::bigint[])
                    ON CONFLICT (node) DO UPDATE SET last_seq = excluded.last_seq,
                                                     n_events = entity_index.n_events + excluded.n_events
                ),
                lin AS (
                    INSERT INTO lineage_links (child, parent, seq, parent_name)
                    SELECT * FROM unnest(%(lc)s::bigint[], %(lp)s::bigint[], %(ls)s::bigint[], %(ln)s::text[])
                    ON CONFLICT (child, parent) DO NOTHING
                )
                SELECT old, name FROM have WHERE name <> old LIMIT 1
                """,
                {"nn": [signed(n) for n in names.values()], "nm": list(names), "corr": correlation_id, **ev,
                 "en": list(entities), "ef": [v[0] for v in entities.values()], "el": [v[1] for v in entities.values()],
                 "ec": [v[2] for v in entities.values()], "lc": [c for c, _ in links], "lp": [p for _, p in links],
                 "ls": [q for q, _ in links.values()], "ln": [n for _, n in links.values()]},
            ).fetchone()
        except psycopg.errors.InvalidTextRepresentation as e:
            raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
        if clash:
            raise StoreError(f"entity ids collide: {clash[0]!r} and {clash[1]!r} share the node id "
                             f"{signed_node_id(clash[0])}; rename one of these entities (nothing was appended)")
        result.first_seq, result.last_seq = base + 1, base + n_new
        result.event_ids = [r.event_id for r in fresh]
        self._pending = (base + 1, base + n_new, fresh[0].event_id, fresh[-1].event_id, result)
        return result

    def _prepare(self, batch: pa.Table) -> pa.Table:
        """Event ids, entity ids, node ids (signed) and the causation's node ids, computed in DuckDB."""
        node = store_ids.NODE_SQL  # read at call time: one definition of the node id for both backends
        self._calc.register("_b", batch)
        try:
            out = self._calc.sql(
                f"""
                SELECT i, event_id, entity, {node.format("entity")} AS node, pnodes FROM (
                    SELECT _i AS i, {event_id_sql()} AS event_id, {store_ids.ENTITY_SQL} AS entity,
                           list_transform(causation, lambda x: {node.format("x")}) AS pnodes
                    FROM _b)
                ORDER BY i
                """
            ).to_arrow_table()
        except (duckdb.InvalidInputException, duckdb.ConversionException) as e:
            raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
        finally:
            self._calc.unregister("_b")
        out = out.set_column(3, "node", pc.cast(out.column("node"), pa.int64(), safe=False))
        pn = out.column("pnodes").combine_chunks()
        pn = pa.ListArray.from_arrays(pn.offsets, pc.cast(pn.values, pa.int64(), safe=False))
        return out.set_column(4, "pnodes", pn)

    @staticmethod
    def _lookup(cur: Any, only: list[str] | None = None) -> tuple[pa.Array, pa.Array, pa.Array]:
        """Of the staged streams (or of ``only`` among them): those that exist, their versions, and the
        event ids they hold (an event_id hashes its stream, so only existing streams can hold one)."""
        where = "WHERE m.v IS NOT NULL" + (" AND k.s = ANY(%s)" if only is not None else "")
        rows = cur.execute(
            f"""
            SELECT k.s, m.v, h.ids FROM _fw_streams k
            CROSS JOIN LATERAL (SELECT max(e.stream_version) AS v FROM events e WHERE e.stream = k.s) m
            CROSS JOIN LATERAL (SELECT array_agg(e.event_id) AS ids FROM events e WHERE e.stream = k.s AND m.v IS NOT NULL) h
            {where}
            """, [only] if only is not None else None).fetchall()
        return (pa.array([r[0] for r in rows], pa.string()), pa.array([int(r[1]) for r in rows], pa.int64()),
                pa.array([i for r in rows for i in r[2]], pa.string()))

    @staticmethod
    def _copy(cur: Any, table: str, columns: str, fields: list[pa.Array], then: Callable[[], Any] | None = None) -> Any:
        """COPY rows given as columns already in COPY's text form (built column-wise in Arrow). ``then``
        runs once the rows are sent, while the server is still inserting them (the client's next work
        overlaps the server's); its result is returned."""
        fields = [f.combine_chunks() if isinstance(f, pa.ChunkedArray) else f for f in fields]
        rows = pc.binary_join_element_wise(*fields, "\t") if len(fields) > 1 else fields[0]
        rows = pc.binary_join_element_wise(rows, "", "\n")  # "row\n": the value buffer is the COPY stream
        if not len(rows):
            return then() if then is not None else None
        offsets = np.frombuffer(rows.buffers()[1], dtype=np.int32, count=len(rows) + 1 + rows.offset)
        first, last = int(offsets[rows.offset]), int(offsets[-1])
        with cur.copy(f"COPY {table} ({columns}) FROM STDIN") as cp:
            cp.write(memoryview(rows.buffers()[2])[first:last])
            return then() if then is not None else None

    def _append_tx(self, batch: pa.Table, cols: pa.Table, correlation_id: str | None,
                   expected_versions: dict[str, int] | None) -> AppendResult:
        """One try of a batch append (see the module docstring). Raises UniqueViolation when another
        writer created one of the batch's streams, entities or names meanwhile: the caller retries."""
        cur = self.con.cursor()
        names = names_of(batch, cols)
        # Phase 1, no lock: stage the batch's names, look them up (for the collision check and to copy
        # only new ones, and which of them are recorded entities: an entity is a name). One index probe
        # per staged name (OFFSET 0 keeps the subquery a nested loop): without statistics on the staging
        # table the planner hashed all of entity_names instead (100k names against a 500k-name store:
        # 477 ms; probes ~400 ms, and they do not grow with the store).
        watermark = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        self._copy(cur, "_fw_names", "node, name", [pc.cast(names.column("node"), pa.string()), pg_text(names.column("name"))])
        have = cur.execute(
            "SELECT k.node, n.name, EXISTS (SELECT 1 FROM entity_index i WHERE i.node = k.node) FROM _fw_names k "
            "CROSS JOIN LATERAL (SELECT n.name FROM entity_names n WHERE n.node = k.node OFFSET 0) n").fetchall()
        # A collision: two of the batch's names share a node id, or a stored name that is not among the
        # batch's names holds one of theirs (both rare: the check itself runs only then).
        unique = pc.count_distinct(names.column("node")).as_py() == names.num_rows
        clashes: dict[str, tuple[str, int]] = {}
        if not unique or (have and not pc.all(pc.is_in(pa.array([x for _, x, _ in have], pa.string()),
                                                        value_set=names.column("name"))).as_py()):
            checked = names if unique else names_of(batch, cols, True)
            unsigned = checked.set_column(0, "node", pc.cast(checked.column("node"), pa.uint64(), safe=False))
            clashes = EventStore._check_node_ids(unsigned, [(n % (1 << 64), x) for n, x, _ in have])
        rejected: dict[int, dict[str, Any]] = {}
        if clashes:  # refuse the rows that mention a colliding name (and their streams' other rows)
            rejected = EventStore._rejected_rows(
                *(batch.column(c).to_pylist() for c in ("stream", "type")), cols.column("event_id").to_pylist(),
                cols.column("entity").to_pylist(), batch.column("causation").to_pylist(), clashes,
                rows=batch.column("_i").to_pylist())
            keep = np.ones(batch.num_rows, dtype=bool)
            keep[list(rejected)] = False
            batch, cols = batch.filter(pa.array(keep)), cols.filter(pa.array(keep))
            names = names_of(batch, cols)
            if not batch.num_rows:
                return AppendResult(rejected=list(rejected.values()))
            expected_versions = expected_of(expected_versions, set(batch.column("stream").to_pylist()))
        n_rows = batch.num_rows
        streams = batch.column("stream")
        ids = cols.column("event_id")
        # Stage the batch's streams and look them up; record its new names.
        self._copy(cur, "_fw_streams", "s", [pg_text(pc.unique(streams))])
        known_s, known_v, held = self._lookup(cur)
        if len(known_s):  # the streams that exist: those another writer may append to before the lock
            self._copy(cur, "_fw_known", "s", [pg_text(known_s)])
        known_nodes = pa.array([n for n, _, _ in have], pa.int64())
        fresh_names = names.filter(pc.invert(pc.is_in(names.column("node"), value_set=known_nodes)))
        self._copy(cur, "entity_names", "node, name",
                   [pc.cast(fresh_names.column("node"), pa.string()), pg_text(fresh_names.column("name"))])
        old_entities = pa.array([n for n, _, is_entity in have if is_entity], pa.int64())
        # The rows' text that does not depend on the numbering, built before the lock is taken.
        corr = "\\N" if correlation_id is None else pg_text(pa.array([correlation_id]))[0].as_py()
        text = pa.table({
            "event_id": ids, "stream": pg_text(streams), "type": pg_text(batch.column("type")),
            "payload": pg_text(batch.column("payload")), "causation": pg_text(pg_array(batch.column("causation"), quote=True)),
            "corr": pa.array([corr] * n_rows, pa.string()), "sv": pc.cast(schema_versions(batch.column("type")), pa.string()),
        })
        # Phase 2: number the events under the lock.
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _APPEND_LOCK)
        base = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        if base > watermark and len(known_s):
            # Another writer appended since the lookups: of the streams found then, look again at those it
            # appended to. A stream that did not exist then and does now (another writer created it
            # meanwhile) needs no look: this batch's version 1 of it fails the copy on UNIQUE (stream,
            # stream_version), nothing is appended, and the retry finds the stream. (Joining every event
            # since the watermark with all the batch's streams cost 0.3 s per 100k-event batch under the
            # lock with 4 writers, where new streams are the rule.)
            touched = [r[0] for r in cur.execute(
                "SELECT DISTINCT e.stream FROM events e JOIN _fw_known k ON e.stream = k.s WHERE e.seq > %s",
                [watermark]).fetchall()]
            if touched:  # another writer appended to our streams meanwhile: look those up again
                s2, v2, h2 = self._lookup(cur, touched)
                keep = pc.invert(pc.is_in(known_s, value_set=pa.array(touched, pa.string())))
                known_s = pa.concat_arrays([known_s.filter(keep), s2])
                known_v = pa.concat_arrays([known_v.filter(keep), v2])
                held = pa.concat_arrays([held, h2])
        plan = plan_append(streams, ids, known_s, known_v, held, expected_versions)
        n_new = plan.n_new
        result = AppendResult(appended=n_new, already_recorded=n_rows - n_new, rejected=list(rejected.values()))
        if n_new == 0:
            return result
        mask = pa.array(plan.fresh)
        rows = batch.filter(mask) if n_new < n_rows else batch
        fcols = cols.filter(mask) if n_new < n_rows else cols
        text = text.filter(mask) if n_new < n_rows else text
        seq = pa.array(np.arange(base + 1, base + 1 + n_new, dtype=np.int64))

        def projections() -> tuple[pa.Table, pa.Table, pa.Table | None, pa.Table | None]:
            """entity_index rows (new, known) and lineage_links rows (of new entities, of known ones),
            sorted by their index keys: a B-tree takes sorted keys at ~2x the rate of random ones (1M
            random 64-bit keys into a primary key, here: 3.7 s unsorted, 1.4 s sorted)."""
            agg = pa.table({"node": fcols.column("node"), "seq": seq}).group_by("node").aggregate(
                [("seq", "min"), ("seq", "max"), ("seq", "count")]).sort_by("node")
            is_old = pc.is_in(agg.column("node"), value_set=old_entities)
            # One row per (child, parent), the first event that recorded it; an edge can exist already
            # only if its child entity did.
            edges = edges_of(rows, fcols, seq)
            if not edges.num_rows:
                return agg.filter(pc.invert(is_old)), agg.filter(is_old), None, None
            edges = edges.group_by(["child", "parent", "name"]).aggregate([("seq", "min")]).sort_by(
                [("child", "ascending"), ("parent", "ascending")])
            old_child = pc.is_in(edges.column("child"), value_set=old_entities)
            return (agg.filter(pc.invert(is_old)), agg.filter(is_old), edges.filter(pc.invert(old_child)),
                    edges.filter(old_child))

        new_e, old_e, new_l, old_l = self._copy(
            cur, "events", "seq, event_id, stream, stream_version, type, payload, causation, correlation_id, schema_version",
            [pc.cast(seq, pa.string()), text.column("event_id"), text.column("stream"),
             pc.cast(pa.array(plan.versions), pa.string()), *(text.column(c) for c in ("type", "payload", "causation", "corr", "sv"))],
            then=projections)
        self._copy(cur, "entity_index", "node, first_seq, last_seq, n_events",
                   [pc.cast(new_e.column(c), pa.string()) for c in ("node", "seq_min", "seq_max", "seq_count")])
        if old_e.num_rows:
            self._copy(cur, "_fw_entities", "node, last, n",
                       [pc.cast(old_e.column(c), pa.string()) for c in ("node", "seq_max", "seq_count")])
            cur.execute("UPDATE entity_index e SET last_seq = u.last, n_events = e.n_events + u.n "
                        "FROM _fw_entities u WHERE e.node = u.node")
        if new_l is not None:
            self._copy(cur, "lineage_links", "child, parent, seq, parent_name",
                       [*(pc.cast(new_l.column(c), pa.string()) for c in ("child", "parent", "seq_min")),
                        pg_text(new_l.column("name"))])
        if old_l is not None and old_l.num_rows:
            self._copy(cur, "_fw_links", "child, parent, seq, parent_name",
                       [*(pc.cast(old_l.column(c), pa.string()) for c in ("child", "parent", "seq_min")),
                        pg_text(old_l.column("name"))])
            cur.execute("INSERT INTO lineage_links (child, parent, seq, parent_name) SELECT child, parent, seq, parent_name "
                        "FROM _fw_links ORDER BY child, parent ON CONFLICT (child, parent) DO NOTHING")
        result.first_seq, result.last_seq = base + 1, base + n_new
        if n_new <= 10_000:
            result.event_ids = fcols.column("event_id").to_pylist()
        new_ids = fcols.column("event_id")
        self._pending = (base + 1, base + n_new, new_ids[0].as_py(), new_ids[-1].as_py(), result)
        return result

    # -- projections -------------------------------------------------------------------------
    def rebuild_projections(self) -> dict[str, int]:
        """Drop and recompute every projection from the events alone (under the append lock), then
        refresh the planner's statistics (``flywheel warehouse migrate`` ends with this)."""
        self._check_open()
        # A batch had copied names before asking for the lock and the truncate waited on it: the server
        # aborted the rebuild; again, after that batch.
        self._transaction(self._rebuild, psycopg.errors.DeadlockDetected)
        return self.projection_counts()

    def _rebuild(self) -> None:
        """One try of :meth:`rebuild_projections`, inside its transaction."""
        con = self.con
        con.execute("SELECT pg_advisory_xact_lock(%s, %s)", _APPEND_LOCK)
        con.execute("TRUNCATE entity_index, lineage_links, entity_names")
        con.execute(
            """
            CREATE TEMP TABLE _fw_ev ON COMMIT DROP AS
            SELECT seq, coalesce(payload->>'entity_id', stream) AS entity, causation FROM events
            """
        )
        con.execute(
            """
            INSERT INTO entity_names (node, name)
            SELECT DISTINCT flywheel_node(name), name FROM (
                SELECT entity AS name FROM _fw_ev UNION SELECT unnest(causation) FROM _fw_ev
            ) x WHERE name IS NOT NULL
            """
        )
        con.execute(
            "INSERT INTO entity_index SELECT flywheel_node(entity), min(seq), max(seq), count(*) FROM _fw_ev "
            "GROUP BY entity"
        )
        con.execute(
            """
            INSERT INTO lineage_links (child, parent, seq, parent_name)
            SELECT flywheel_node(entity), flywheel_node(parent), min(seq), parent
            FROM _fw_ev CROSS JOIN LATERAL unnest(causation) AS parent
            WHERE parent IS NOT NULL AND parent <> entity
            GROUP BY 1, 2, 4
            """
        )
        # Statistics for the rebuilt tables now, not when autovacuum next passes: without them the
        # planner guessed a sequential scan of lineage_links for each level of an up-walk (trace ->
        # model on a 1M-event store straight after a bulk load: 1.1 s; with them 0.9 ms).
        con.execute("ANALYZE events, entity_names, entity_index, lineage_links")

    # -- migration from the embedded store ------------------------------------------------------
    def import_events(self, table: pa.Table) -> int:
        """Copy events exactly as recorded elsewhere (seq, ids, versions, times), in one transaction;
        the batch must continue this store's seq. Projections are not touched (rebuild afterwards)."""
        self._check_open()
        if table.num_rows == 0:
            return 0
        t = table.select(EVENTS_ARROW.names)
        with self._lock, self.con.transaction():
            cur = self.con.cursor()
            cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _APPEND_LOCK)
            base = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
            first = t.column("seq")[0].as_py()
            if first != base + 1:
                raise StoreError(f"import: the batch starts at seq {first}, the store is at {base}")
            ts = pc.cast(t.column("recorded_at"), pa.timestamp("us", tz="UTC"))
            fields = [
                pc.cast(t.column("seq"), pa.string()), t.column("event_id"), pg_text(t.column("stream")),
                pc.cast(t.column("stream_version"), pa.string()), pg_text(t.column("type")),
                pg_text(pc.cast(t.column("payload"), pa.string())),
                pg_text(pg_array(t.column("causation"), quote=True)),
                pc.if_else(pc.is_null(t.column("correlation_id")), "\\N",
                           pg_text(pc.fill_null(t.column("correlation_id"), ""))),
                pc.strftime(ts, format="%Y-%m-%dT%H:%M:%S+00:00"),  # Arrow's %S has the microseconds
                pc.cast(t.column("schema_version"), pa.string()),
            ]
            fields = [f.combine_chunks() if isinstance(f, pa.ChunkedArray) else f for f in fields]
            rows = pc.binary_join_element_wise(*fields, "\t")
            text = "\n".join(rows.to_pylist()) + "\n"
            with cur.copy("COPY events (seq, event_id, stream, stream_version, type, payload, causation, "
                          "correlation_id, recorded_at, schema_version) FROM STDIN") as cp:
                cp.write(text.encode())
        n: int = t.num_rows
        return n


# -- copying an embedded store to a server ----------------------------------------------------------
def _comparable(t: pa.Table) -> list[tuple[Any, ...]]:
    """Rows of an events table in a form both backends agree on (instants as UTC microseconds)."""
    t = t.select(EVENTS_ARROW.names)
    cols = []
    for name in EVENTS_ARROW.names:
        c = t.column(name)
        if name == "recorded_at":
            c = pc.cast(pc.cast(c, pa.timestamp("us", tz="UTC")), pa.int64())
        elif name == "payload":
            c = pc.cast(c, pa.string())
        cols.append(c.to_pylist())
    return list(zip(*cols, strict=True))


def migrate_events(src: EventStore, dst: PostgresEventStore, *, chunk: int = 100_000,
                   progress: Any = None) -> dict[str, Any]:
    """Copy every event of ``src`` into ``dst`` exactly (seq, ids, versions, payload text, times),
    rebuild ``dst``'s projections, then verify event by event and check ``dst``'s integrity.

    Resumable: a target that already holds the first k events of the source (verified first)
    continues at k + 1; a target holding anything else is refused with nothing written.
    ``progress(done, total, phase)`` is called after every chunk.
    """
    total, have = src.last_seq(), dst.last_seq()
    if have > total:
        raise StoreError(f"the target holds {have} events, the source {total}: it is not a copy of this store")

    def compare(upto: int, phase: str) -> int:
        """Events 1..upto equal on both sides (chunk by chunk); returns the number compared."""
        done = 0
        while done < upto:
            n = min(chunk, upto - done)
            a = _comparable(src.read_arrow(after_seq=done, limit=n))
            b = _comparable(dst.read_arrow(after_seq=done, limit=n))
            if a != b:
                bad = next((x, y) for x, y in zip(a + [None] * len(b), b + [None] * len(a), strict=False) if x != y)
                where = (bad[0] or bad[1])[0]
                raise StoreError(f"event seq {where} differs between the source and the target ({phase}): "
                                 f"source {bad[0]!r:.300}, target {bad[1]!r:.300}")
            done += n
            if progress:
                progress(done, upto, phase)
        return done

    compare(have, "checking what the target already holds")
    copied, done = 0, have
    while done < total:
        t = src.read_arrow(after_seq=done, limit=chunk)
        copied += dst.import_events(t)
        done += t.num_rows
        if progress:
            progress(done, total, "copying events")
    dst.rebuild_projections()
    verified = compare(total, "verifying")
    problems = dst.check_integrity()
    if problems:
        raise StoreError(f"the target fails its integrity check after the copy: {problems}")
    return {"events": total, "copied": copied, "already_there": have, "verified": verified,
            "projections": dst.projection_counts()}
