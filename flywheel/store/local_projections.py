"""The embedded store's projections (``entity_names``, ``entity_index``, ``lineage_links``), written in
DuckDB from the events after a seq: :func:`project`, what an append and a rebuild of
:class:`~flywheel.store.local.DuckDBEventStore` both run."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.store import ids as store_ids
from flywheel.store.contract import EventStore, StoreError


# Projections: one code path used both incrementally (over the events after ``after_seq``) and on
# rebuild (``after_seq=0`` over emptied tables), so the two cannot drift apart. Everything is keyed
# by node id (:func:`node_id`, migration 003).
def project(con: duckdb.DuckDBPyConnection, after_seq: int, new: pa.Table | None = None,
            new_names: pa.Table | None = None) -> None:
    """Project the events after ``after_seq``. An append passes what it computed already: ``new``
    (seq, entity_id, node, causation of its events) and ``new_names`` (node, name: its names the
    store did not hold, checked for collisions); a rebuild reads the events."""
    after = int(after_seq)
    if new is None:
        # The new events' entity ids and node ids, computed once for all projections.
        new = con.sql(
            f"""
            SELECT seq, entity_id, {store_ids.NODE_SQL.format("entity_id")} AS node, causation
            FROM (SELECT seq, {store_ids.ENTITY_SQL} AS entity_id, causation FROM events WHERE seq > {after})
            """
        ).to_arrow_table()
    if new.num_rows == 0:
        return
    con.register("_new_events", new)
    try:
        if new_names is None:
            _project_names(con)
        elif new_names.num_rows:
            con.register("_names", new_names)
            try:
                con.execute("INSERT INTO entity_names SELECT node, name FROM _names")
            finally:
                con.unregister("_names")
        updated = _project_entities(con, new)
        _project_lineage(con, updated)
    finally:
        con.unregister("_new_events")


def _project_names(con: duckdb.DuckDBPyConnection) -> None:
    """entity_names: every entity id and every name in a causation, once (an anti-join on ids)."""
    names = con.sql(
        f"""
        SELECT entity_id AS name, node FROM _new_events
        UNION
        SELECT name, {store_ids.NODE_SQL.format("name")}
        FROM (SELECT DISTINCT unnest(causation) AS name FROM _new_events) WHERE name IS NOT NULL
        """
    ).to_arrow_table()
    con.register("_names", names)
    try:
        known = con.execute(
            "SELECT n.node, n.name FROM entity_names n SEMI JOIN _names b ON n.node = b.node"
        ).fetchall()
        clashes = EventStore._check_node_ids(names, known)
        if clashes:  # the events were recorded: a rebuild cannot refuse some of them
            name, (other, node) = next(iter(clashes.items()))
            raise StoreError(EventStore._collision_message(name, other, node) + " (the projections were not rebuilt)")
        con.execute(
            "INSERT INTO entity_names SELECT b.node, b.name FROM _names b ANTI JOIN entity_names n ON n.node = b.node"
        )
    finally:
        con.unregister("_names")


def _project_entities(con: duckdb.DuckDBPyConnection, new: pa.Table) -> bool:
    """entity_index; returns whether an entity of the batch existed before it."""
    # The entities of the batch that exist already are looked up first (a semi-join on 64-bit ids);
    # when there are none (the bulk case: new traces) the new rows are inserted as they are, else
    # one MERGE updates and inserts (a MERGE costs ~3x the INSERT per 100k rows). When every entity
    # has one event in the batch, its row needs no aggregation.
    one_each = pc.count_distinct(new.column("node")).as_py() == new.num_rows
    rows = (
        "SELECT node, seq AS first_seq, seq AS last_seq, 1::BIGINT AS n_events FROM _new_events"
        if one_each
        else "SELECT node, min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events "
        "FROM _new_events GROUP BY node"
    )
    n_old = con.execute(
        "SELECT count(*) FROM entity_index i SEMI JOIN _new_events n ON i.node = n.node"
    ).fetchall()[0][0]
    if n_old == 0:
        con.execute(f"INSERT INTO entity_index {rows}")
        return False
    con.execute(
        f"""
        MERGE INTO entity_index USING ({rows}) n ON entity_index.node = n.node
        WHEN MATCHED THEN UPDATE SET last_seq = n.last_seq, n_events = entity_index.n_events + n.n_events
        WHEN NOT MATCHED THEN INSERT VALUES (n.node, n.first_seq, n.last_seq, n.n_events)
        """
    )
    return True


def _project_lineage(con: duckdb.DuckDBPyConnection, any_old_entity: bool) -> None:
    """lineage_links: one row per (child, parent) node pair, from each event's causation."""
    edges = f"""
        SELECT child, {store_ids.NODE_SQL.format("parent")} AS parent, seq FROM (
            SELECT child, parent, min(seq) AS seq FROM (
                SELECT node AS child, entity_id, unnest(causation) AS parent, seq FROM _new_events
            ) WHERE parent IS NOT NULL AND parent <> entity_id
            GROUP BY child, parent
        )
    """
    if not any_old_entity:
        # An edge can already exist only if its child entity existed before this batch.
        con.execute(f"INSERT INTO lineage_links {edges}")
        return
    con.execute(
        f"""
        INSERT INTO lineage_links
        WITH n AS ({edges}),
        old AS (SELECT l.child, l.parent FROM lineage_links l SEMI JOIN _new_events e ON l.child = e.node)
        SELECT n.* FROM n ANTI JOIN old ON old.child = n.child AND old.parent = n.parent
        """
    )
