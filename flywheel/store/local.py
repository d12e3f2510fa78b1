"""The embedded event store: one DuckDB file on one machine (:class:`DuckDBEventStore`).

The contract it keeps, with the PostgreSQL backend, is described in :mod:`flywheel.store`. How it keeps
it here: one append at a time per file (a lock per file in this process; other processes append
through the file's owner, :mod:`flywheel.store.share`), each one transaction of the events and their
projections; a few events take one statement planned from the in-memory head index
(:mod:`flywheel.store.index`), a batch is planned in Arrow (:mod:`flywheel.store.batch`).

This module holds the appends and the rebuild of the projections; the rest of the class is its bases:
:mod:`flywheel.store.local_reads` (the queries) over :mod:`flywheel.store.local_connection` (the file,
its owner, the cursors and the write transaction). The projections' SQL is
:mod:`flywheel.store.local_projections`.
"""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import CATALOG
from flywheel.store import ids as store_ids
from flywheel.store.batch import (
    SmallRow,
    expected_of,
    normalise_batch,
    plan_append,
    plan_small,
    small_rows,
    small_rows_of,
)
from flywheel.store.contract import (
    SMALL_APPEND,
    AppendResult,
    EventStore,
    InvalidEventError,
    NewEvent,
    StoreError,
)
from flywheel.store.ids import event_id_sql
from flywheel.store.local_connection import CHECKPOINT_THRESHOLD, DEFAULT_OPEN_TIMEOUT_S
from flywheel.store.local_projections import project
from flywheel.store.local_reads import DuckDBReads

__all__ = ["CHECKPOINT_THRESHOLD", "DEFAULT_OPEN_TIMEOUT_S", "DuckDBEventStore"]

# The catalog's schema version of b.type, without a join (a join would not keep the batch's row order).
_NON_DEFAULT_VERSIONS = " ".join(
    f"WHEN '{t}' THEN {spec.schema_version}" for t, spec in CATALOG.items() if spec.schema_version != 1
)
_SCHEMA_VERSION_SQL = f"CASE b.type {_NON_DEFAULT_VERSIONS} ELSE 1 END" if _NON_DEFAULT_VERSIONS else "1"


def _lit(v: str | None) -> str:
    """A SQL string literal (standard strings: only the quote is special), or NULL."""
    return "NULL" if v is None else "'" + v.replace("'", "''") + "'"


def _unregister(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Unregister an Arrow view; in an aborted transaction DuckDB refuses until the rollback, after
    which the append unregisters again."""
    try:
        con.unregister(name)
    except duckdb.Error:
        pass


class DuckDBEventStore(DuckDBReads):
    """The embedded backend: one DuckDB file, shared between the processes of one machine by its owner
    (see the module docstring). ``con`` is the DuckDB connection in the owning process, or a read-only
    stand-in (``execute``/``sql`` of SELECT statements) that forwards to the owner in the others."""

    backend = "duckdb"

    # -- appending ---------------------------------------------------------------------------
    def append_batch(
        self,
        table: pa.Table,
        *,
        correlation_id: str | None = None,
        expected_versions: dict[str, int] | None = None,
        validated: bool = False,
    ) -> AppendResult:
        """Append many events (any streams) in one transaction, through Arrow.

        ``table`` has the columns of :data:`BATCH_SCHEMA`; ``payload`` must already be canonical JSON
        (:func:`canonical_json`, or polars' ``struct.json_encode`` over sorted keys) and is validated as
        JSON by DuckDB. Order within a stream follows row order; a row whose event_id appears earlier in
        the batch or is already recorded is skipped (counted in ``already_recorded``).

        ``expected_versions`` maps streams to the version the caller expects them to be at; it is
        checked only when something new would be appended (a fully recorded batch is a no-op), and a
        mismatch raises :class:`ConcurrencyError` with nothing appended.

        How the constraints hold without indexes (migration 002 explains why there are none): the
        whole append runs under the store's per-file lock in one transaction (appends of other
        processes arrive through the owner and take the same lock), so ``seq`` continues from
        ``max(seq)``, each stream continues from its current version, and an event is recognised as
        recorded by its id among the events of the batch's *existing* streams only (an event_id hashes
        its stream, so an event on a new stream cannot be recorded). :meth:`_append_locked` plans
        this in Arrow.
        """
        self._check_open()
        if table.num_rows == 0:
            return AppendResult()
        if self.read_only:
            raise StoreError(f"event store {self.path} is open read-only; appends need a writable store")
        batch = normalise_batch(table, validated)
        if self._remote is not None:
            res = self._call_remote(lambda c: c.append_batch(batch.drop_columns(["_i"]), correlation_id=correlation_id,
                                                               expected_versions=expected_versions))
            if res is not None:
                return res
        return self.append_local(batch, correlation_id, expected_versions)

    def _append_small_events(self, stream: str, events: list[NewEvent], correlation_id: str | None,
                             expected_versions: dict[str, int] | None) -> AppendResult | None:
        self._check_open()
        if self.read_only or self._remote is not None:
            return None  # the refusal, or the owner, is append_batch's
        rows = small_rows_of(stream, events)
        if rows is None:
            return None
        with self._lock:
            return self._append_small(self._writable(), rows, correlation_id, expected_versions)

    def append_local(self, batch: pa.Table, correlation_id: str | None,
                     expected_versions: dict[str, int] | None) -> AppendResult:
        """Append a normalised batch (:func:`~flywheel.store.batch.normalise_batch`) in this process,
        which owns the file: what :meth:`append_batch` does here, and what the owner does for a client."""
        if batch.num_rows <= SMALL_APPEND:
            rows = small_rows(batch)
            if rows is not None:
                with self._lock:
                    return self._append_small(self._writable(), rows, correlation_id, expected_versions)
        with self._lock:
            con = self._writable()
            con.register("_batch_in", batch)
            try:
                with self.transaction():
                    res = self._append_locked(con, batch, correlation_id, expected_versions)
                if res.last_seq is not None:
                    self._index.head = res.last_seq  # the index catches up from the events when next used
                return res
            except (duckdb.ConversionException, duckdb.InvalidInputException) as e:
                if "JSON" in str(e):  # the entity ids are read before the insert: as InvalidInput there
                    raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
                raise
            finally:
                for name in ("_batch_in", "_batch_ids", "_batch_plan"):
                    _unregister(con, name)

    def _append_small(self, con: duckdb.DuckDBPyConnection, rows: list[SmallRow], correlation_id: str | None,
                      expected_versions: dict[str, int] | None) -> AppendResult:
        """The append of a few events (what stages do between batches): planned from the in-memory
        head index (:mod:`flywheel.store.index`: no scans), then one ``BEGIN; ...; COMMIT`` of the
        inserts as literals. Same plan and projections as :meth:`_append_locked` (Arrow path), which
        costs ~10 queries whatever the batch size."""
        idx = self._index
        base = idx.sync(con)
        # Names first, in the order the batch mentions them: a name whose node id another name holds
        # (a 64-bit collision) refuses the rows that mention it, before anything is planned.
        names: dict[str, int] = {}
        for r in rows:
            names.setdefault(r.entity, r.node)
            for c, p in zip(r.causation, r.parents, strict=True):
                if c is not None:
                    names.setdefault(c, p)
        add: dict[str, int] = {}
        held: list[tuple[int, str]] = []
        for name, node in names.items():
            state = idx.name_state(name, node)
            if state == "new":
                add[name] = node
            elif state == "clash":
                held += con.execute("SELECT node, name FROM entity_names WHERE node = ?", [node]).fetchall()
        rejected: dict[int, dict[str, Any]] = {}
        if held or len(set(names.values())) != len(names):
            clashes = EventStore._check_node_ids(
                pa.table({"name": list(names), "node": pa.array(list(names.values()), pa.uint64())}), held)
            if clashes:
                rejected = EventStore._rejected_rows([r.stream for r in rows], [r.type for r in rows],
                                                     [r.event_id for r in rows], [r.entity for r in rows],
                                                     [r.causation for r in rows], clashes)
                rows = [r for k, r in enumerate(rows) if k not in rejected]
                mentioned = {n for r in rows for n in (r.entity, *r.causation)}
                add = {n: v for n, v in add.items() if n in mentioned}
                expected_versions = expected_of(expected_versions, {r.stream for r in rows})
        known = {}
        for st in {r.stream for r in rows}:
            v = idx.stream_version(st)
            if v:
                known[st] = (v, set(idx.recorded([r.event_id for r in rows if r.stream == st])))
        keep, versions = plan_small(rows, known, expected_versions)
        n_new = len(versions)
        result = AppendResult(appended=n_new, already_recorded=len(rows) - n_new, rejected=list(rejected.values()))
        if n_new == 0:
            return result
        fresh = [r for r, k in zip(rows, keep, strict=True) if k]
        stmts = ["BEGIN TRANSACTION"]
        corr = _lit(correlation_id)
        values = []
        entities: dict[int, list[int]] = {}
        links: dict[tuple[int, int], int] = {}
        heads: dict[str, int] = {}
        parents_of: dict[int, set[int]] = {}
        for k, (r, version) in enumerate(zip(fresh, versions, strict=True)):
            seq = base + 1 + k
            heads[r.stream] = version
            cause = "[" + ", ".join(_lit(c) for c in r.causation) + "]::VARCHAR[]"
            sv = CATALOG[r.type].schema_version if r.type in CATALOG else 1
            values.append(f"({seq}, '{r.event_id}', {_lit(r.stream)}, {version}, {_lit(r.type)}, {_lit(r.payload)}::JSON, "
                          f"{cause}, {corr}, now(), {sv})")
            e = entities.setdefault(r.node, [seq, seq, 0])
            e[1], e[2] = seq, e[2] + 1
            for name, parent in zip(r.causation, r.parents, strict=True):
                if name is not None and name != r.entity:
                    if r.node not in parents_of:
                        parents_of[r.node] = idx.parents(r.node) if idx.entity_exists(r.node) else set()
                    if parent not in parents_of[r.node]:
                        links.setdefault((r.node, parent), seq)
        old_entities = {n for n in entities if idx.entity_exists(n)}
        stmts.append("INSERT INTO events VALUES " + ", ".join(values))
        if add:
            stmts.append("INSERT INTO entity_names VALUES " + ", ".join(f"({n}, {_lit(x)})" for x, n in sorted(add.items(), key=lambda i: i[1])))
        ins = [f"({n}, {a}, {b}, {c})" for n, (a, b, c) in entities.items() if n not in old_entities]
        if ins:
            stmts.append("INSERT INTO entity_index VALUES " + ", ".join(ins))
        for n, (_a, b, c) in entities.items():
            if n in old_entities:
                stmts.append(f"UPDATE entity_index SET last_seq = {b}, n_events = n_events + {c} WHERE node = {n}")
        if links:
            stmts.append("INSERT INTO lineage_links VALUES " + ", ".join(f"({c}, {p}, {q})" for (c, p), q in links.items()))
        stmts.append("COMMIT")
        try:
            con.execute(";\n".join(stmts))
        except duckdb.Error as e:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if isinstance(e, duckdb.ConversionException) and "JSON" in str(e):
                raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
            raise
        result.first_seq, result.last_seq = base + 1, base + n_new
        result.event_ids = [r.event_id for r in fresh]
        idx.record(base + n_new, heads, result.event_ids, add, [n for n in entities if n not in old_entities], links)
        return result

    def _append_locked(
        self,
        con: duckdb.DuckDBPyConnection,
        batch: pa.Table,
        correlation_id: str | None,
        expected_versions: dict[str, int] | None,
    ) -> AppendResult:
        """Plan the append in Arrow (which rows are fresh, their seq and stream versions), then insert.

        Five queries whatever the batch: the event ids, entity ids and node ids (sha256 and md5 in
        DuckDB), the batch's names with the store's names that hold their node ids, the batch's
        streams that exist already with their versions and the batch's events they hold, and the
        INSERT. The rest is vectorised Arrow/numpy (:func:`plan_append`); the SQL windows and
        anti-joins this replaces cost ~0.2 s per 50k.

        A name whose node id another name holds (a 64-bit MD5 prefix collision; the store's name, or
        the batch's first, keeps it) refuses every row that mentions it, and the other rows of those
        rows' streams, before anything is planned: they are reported in ``AppendResult.rejected``
        and the rest of the batch is appended (:meth:`EventStore._rejected_rows`).
        """
        base = con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]
        # No ORDER BY (a sort of the batch): DuckDB keeps the scan's order (preserve_insertion_order),
        # and the check below sorts only if it ever did not. The entity and node ids are computed here,
        # once: the collision check needs them before the insert, and the projections reuse them.
        ids = con.sql(
            f"SELECT event_id, _i, entity, {store_ids.NODE_SQL.format('entity')} AS node FROM "
            f"(SELECT {event_id_sql()} AS event_id, _i, {store_ids.ENTITY_SQL} AS entity FROM _batch_in)").to_arrow_table()
        if pc.any(pc.not_equal(ids.column("_i"), batch.column("_i"))).as_py():
            ids = ids.sort_by("_i")
        con.register("_batch_ids", ids)
        try:
            # Every name of the batch (entities and causation) with its node id and first row, and the
            # store's names that hold those node ids (for the collision check, and so that only new
            # names are recorded).
            names = con.sql(
                f"""
                WITH c AS (SELECT name, min(i) AS row FROM (SELECT unnest(causation) AS name, _i AS i FROM _batch_in)
                           WHERE name IS NOT NULL GROUP BY name)
                SELECT name, any_value(node) AS node, min(row) AS row FROM (
                    SELECT entity AS name, node, _i AS row FROM _batch_ids
                    UNION ALL SELECT name, {store_ids.NODE_SQL.format("name")}, row FROM c)
                GROUP BY name
                """
            ).to_arrow_table()
            con.register("_names", names)
            try:
                held = con.execute("SELECT n.node, n.name FROM entity_names n SEMI JOIN _names b ON n.node = b.node").fetchall()
            finally:
                _unregister(con, "_names")
            # A stored name that is not among the batch's names holds one of their node ids: a collision.
            held_names = pa.array([x for _, x in held], pa.string())
            clashes = EventStore._check_node_ids(names, held) if (
                held and not pc.all(pc.is_in(held_names, value_set=names.column("name"))).as_py()
            ) or pc.count_distinct(names.column("node")).as_py() != names.num_rows else {}
            rejected: dict[int, dict[str, Any]] = {}
            if clashes:
                rejected = EventStore._rejected_rows(
                    *(batch.column(c).to_pylist() for c in ("stream", "type")), ids.column("event_id").to_pylist(),
                    ids.column("entity").to_pylist(), batch.column("causation").to_pylist(), clashes)
                keep = np.ones(batch.num_rows, dtype=bool)
                keep[list(rejected)] = False
                batch, ids = batch.filter(pa.array(keep)), ids.filter(pa.array(keep))
                for name, t in (("_batch_in", batch), ("_batch_ids", ids)):
                    _unregister(con, name)
                    con.register(name, t)
                names = names.filter(pc.invert(pc.is_in(names.column("name"), value_set=pa.array(list(clashes), pa.string()))))
                if batch.num_rows:  # only the names the rows that remain mention
                    mentioned = pa.concat_arrays([ids.column("entity").combine_chunks(),
                                                  pc.list_flatten(batch.column("causation").combine_chunks())])
                    names = names.filter(pc.is_in(names.column("name"), value_set=mentioned))
                expected_versions = expected_of(expected_versions, set(batch.column("stream").to_pylist()))
            # Streams of the batch that exist already: their versions, and which of the batch's event
            # ids they hold (an event_id hashes its stream, so only these streams can hold one). One
            # scan of events.stream; in the bulk case (new traces) it returns nothing.
            known = con.sql(
                """
                SELECT e.stream, max(e.stream_version) AS version,
                       list(e.event_id) FILTER (WHERE e.event_id IN (SELECT event_id FROM _batch_ids)) AS held
                FROM events e SEMI JOIN _batch_in b ON e.stream = b.stream
                GROUP BY e.stream
                """
            ).to_arrow_table() if batch.num_rows else None
        finally:
            _unregister(con, "_batch_ids")
        n_rows = batch.num_rows
        result = AppendResult(already_recorded=0, rejected=list(rejected.values()))
        if n_rows == 0:
            return result
        event_ids = ids.column("event_id")
        held_ids = pc.list_flatten(known.column("held")) if known.num_rows else None
        plan = plan_append(batch.column("stream"), event_ids, known.column("stream"), known.column("version"), held_ids,
                           expected_versions)
        n_new = plan.n_new
        result.appended, result.already_recorded = n_new, n_rows - n_new
        if n_new == 0:
            return result
        mask = pa.array(plan.fresh)
        rows = batch.filter(mask) if n_new < n_rows else batch
        fresh_ids = ids.filter(mask) if n_new < n_rows else ids
        new_ids = fresh_ids.column("event_id")
        seq = pa.array(np.arange(base + 1, base + 1 + n_new, dtype=np.int64))
        planned = rows.append_column("seq", seq)
        planned = planned.append_column("event_id", new_ids).append_column("stream_version", pa.array(plan.versions))
        con.register("_batch_plan", planned)
        try:
            con.execute(
                f"""
                INSERT INTO events
                SELECT b.seq, b.event_id, b.stream, b.stream_version, b.type, b.payload::JSON,
                       coalesce(b.causation, []::VARCHAR[]), $corr::VARCHAR, now(), {_SCHEMA_VERSION_SQL}
                FROM _batch_plan b
                """,
                {"corr": correlation_id},
            ).fetchall()
        finally:
            _unregister(con, "_batch_plan")
        held_nodes = pa.array([n for n, _ in held], pa.uint64())
        new_names = names.filter(pc.invert(pc.is_in(names.column("node"), value_set=held_nodes))) if held else names
        new = pa.table({"seq": seq, "entity_id": fresh_ids.column("entity"), "node": fresh_ids.column("node"),
                        "causation": pc.fill_null(rows.column("causation"), pa.scalar([], pa.list_(pa.string())))})
        project(con, base, new, new_names.select(["node", "name"]))
        result.first_seq, result.last_seq = base + 1, base + n_new
        if n_new <= 10_000:
            result.event_ids = new_ids.to_pylist()
        return result

    def rebuild_projections(self) -> dict[str, int]:
        """Drop and recompute every projection from the events alone."""
        self._check_open()
        if self._remote is not None:
            res = self._call_remote(lambda c: c.call("rebuild"))
            if res is not None:
                return res
        with self._lock:
            self._index.reset()  # it mirrors the projections, which are about to be replaced
            with self.transaction() as con:
                for t in ("entity_index", "lineage_links", "entity_names"):
                    con.execute(f"DELETE FROM {t}")
                project(con, 0)
        return self.projection_counts()
