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
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
    EXPORT_TABLES,
    SMALL_APPEND,
    AppendResult,
    Event,
    EventStore,
    InvalidEventError,
    SqlParams,
    StoreError,
    StoreUnavailableError,
    redact_url,
)
from flywheel.store.ids import event_id_sql, signed_node_id
from flywheel.store.schema import migrations, read_sql, split_sql

# Tries of a batch append that lost a race with another writer creating the same entity.
APPEND_ATTEMPTS = 5
# How long a store whose connection broke (a server restart, a failover, a network cut) keeps trying
# to reconnect before StoreUnavailableError: a fast restart of a small server takes ~1-2 s here, a
# failover to a standby typically well under 30 s.
RECONNECT_TIMEOUT_S = 30.0
# pg_advisory_xact_lock keys (two int4: "flyw", purpose): appends + rebuilds, and migrations.
_APPEND_LOCK = (0x666C7977, 1)
_MIGRATE_LOCK = (0x666C7977, 2)

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
_BATCH_COLUMNS = "i, event_id, stream, type, payload, causation, entity, node, pnodes"


def _names_of(batch: pa.Table, cols: pa.Table, with_rows: bool = False) -> pa.Table:
    """(node, name) of every entity and causation name of a batch, once, sorted by node; ``with_rows``
    adds ``row``, the first row of the batch that mentions the name (what the collision check needs
    when two of the batch's names share a node id)."""
    causation = batch.column("causation").combine_chunks()
    pnodes = cols.column("pnodes").combine_chunks()
    rows = pa.array(np.arange(batch.num_rows, dtype=np.int64))
    t = pa.concat_tables([
        pa.table({"node": cols.column("node"), "name": cols.column("entity"), "row": rows}),
        pa.table({"node": pc.list_flatten(pnodes), "name": pc.list_flatten(causation),
                  "row": pc.take(rows, pc.list_parent_indices(causation))}),
    ])
    t = t.filter(pc.is_valid(t.column("name")))
    if not with_rows:
        return t.group_by(["node", "name"]).aggregate([]).sort_by("node")
    t = t.group_by(["node", "name"]).aggregate([("row", "min")])
    return t.select(["node", "name", "row_min"]).rename_columns(["node", "name", "row"]).sort_by("node")


def _edges_of(rows: pa.Table, cols: pa.Table, seq: pa.Array) -> pa.Table:
    """(child node, parent node, parent name, seq) for every causation name of the rows that is not the
    row's entity."""
    causation = rows.column("causation").combine_chunks()
    pnodes = cols.column("pnodes").combine_chunks()
    owner = pc.list_parent_indices(causation)
    names = pc.list_flatten(causation)
    t = pa.table({"child": pc.take(cols.column("node"), owner), "parent": pc.list_flatten(pnodes), "name": names,
                  "entity": pc.take(cols.column("entity"), owner), "seq": pc.take(seq, owner)})
    keep = pc.and_(pc.is_valid(t.column("name")), pc.not_equal(t.column("name"), t.column("entity")))
    return t.filter(keep).select(["child", "parent", "name", "seq"])


def _schema_versions(types: pa.ChunkedArray | pa.Array) -> pa.Array:
    versions = pa.array(np.ones(len(types), dtype=np.int32))
    for t, spec in CATALOG.items():
        if spec.schema_version != 1:
            versions = pc.if_else(pc.equal(types, t), pa.scalar(spec.schema_version, pa.int32()), versions)
    return versions


def _signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _pg_text(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Escape strings for COPY's text format (backslash, tab, newline, carriage return)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if not len(arr) or not pc.any(pc.match_substring_regex(arr, r"[\\\t\n\r]")).as_py():
        return arr
    for a, b in (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r")):
        arr = pc.replace_substring(arr, a, b)
    return arr


def _pg_array(lists: pa.Array | pa.ChunkedArray, quote: bool) -> pa.Array:
    """A list column as PostgreSQL array literals (``{"a","b"}`` / ``{1,2}``); null elements as NULL."""
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    lists = pc.fill_null(lists, pa.scalar([], lists.type))
    start, end = lists.offsets[0].as_py(), lists.offsets[-1].as_py()
    values = lists.values.slice(start, end - start)
    offsets = pc.subtract(lists.offsets, pa.scalar(start, lists.offsets.type))
    text = values.cast(pa.string())
    if quote:
        text = pc.replace_substring(pc.replace_substring(text, "\\", "\\\\"), '"', '\\"')
        text = pc.binary_join_element_wise('"', text, '"', "")
    text = pc.fill_null(text, "NULL")
    joined = pc.binary_join(pa.ListArray.from_arrays(offsets, text), ",")
    return pc.binary_join_element_wise("{", joined, "}", "")


def _is_local_host(host: str) -> bool:
    """A libpq ``host``/``hostaddr`` entry that is this machine: empty (libpq's default socket), a Unix
    socket directory, ``localhost``, or a loopback address."""
    h = host.strip().strip("[]")
    if not h or h.startswith(("/", "@")) or h.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def connect_options(url: str) -> dict[str, str]:
    """What the store adds to ``url`` when it connects: ``sslmode=verify-full`` when any host it may
    reach is not this machine and neither the URL nor ``PGSSLMODE`` chose a mode.

    Why: libpq's default (``prefer``) tries TLS without checking the certificate and falls back to
    plaintext, so the password and every event cross the network readable and to whoever answers.
    ``verify-full`` checks the server's certificate against ``sslrootcert`` (default
    ``~/.postgresql/root.crt``) and its host name. Loopback and Unix sockets keep libpq's default
    (nothing crosses a network). An explicit ``?sslmode=...`` in the URL (or ``PGSSLMODE``) wins,
    e.g. ``require`` for a server whose certificate cannot be checked."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise StoreUnavailableError(f"not a valid PostgreSQL URL ({redact_url(url)}): {e}") from None
    if params.get("sslmode") or os.environ.get("PGSSLMODE"):
        return {}
    hosts = str(params.get("host") or os.environ.get("PGHOST") or params.get("hostaddr")
                or os.environ.get("PGHOSTADDR") or "")
    if all(_is_local_host(h) for h in hosts.split(",")):
        return {}
    return {"sslmode": "verify-full"}


class PostgresEventStore(EventStore):
    """The event store in a PostgreSQL database (see the module docstring)."""

    backend = "postgresql"

    def __init__(self, url: str, *, read_only: bool = False, connect_timeout_s: int = 10, **_ignored: Any):
        self.url = url
        self.read_only = read_only
        self.path = None  # no file: see ``location``
        self._lock = threading.RLock()
        # No JIT: the store's queries are short, and compiling the lineage walk's plan alone cost
        # ~30 ms of a ~600 ms query on a 1M-event store (EXPLAIN ANALYZE, JIT timing). READ COMMITTED
        # whatever the server's or role's default: each statement of an append must see what
        # committed before it (max(seq) read once the lock is held), not a snapshot taken earlier.
        self._connect_kw = dict(autocommit=True, connect_timeout=connect_timeout_s, application_name="flywheel",
                                options="-c jit=off -c default_transaction_isolation=read\\ committed",
                                **connect_options(url))
        # (first seq, last seq, first event id, last event id, result) of the append whose COMMIT is
        # being sent: what a lost acknowledgement is checked against (_transaction).
        self._pending: tuple[int, int, str, str, AppendResult] | None = None
        try:
            self.con = psycopg.connect(url, **self._connect_kw)
        except psycopg.OperationalError as e:
            raise StoreUnavailableError(f"cannot connect to the event store at {redact_url(url)}: "
                                        f"{str(e).strip().splitlines()[0] if str(e).strip() else e}") from None
        self._closed = False
        self._calc = duckdb.connect()  # in-memory: event ids and node ids of batches, off the server
        if not read_only:
            self._migrate()
            self._stage()

    @property
    def location(self) -> str:
        return redact_url(self.url)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.con.close()
        finally:
            self._calc.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"event store {self.location} is closed")

    # -- schema ------------------------------------------------------------------------------
    def _migrate(self) -> None:
        con = self.con
        with self._lock, con.transaction():
            con.execute("SELECT pg_advisory_xact_lock(%s, %s)", _MIGRATE_LOCK)
            con.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT, "
                        "applied_at TIMESTAMPTZ DEFAULT now())")
            done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
            for version, name, script in migrations("postgres"):
                if version in done:
                    continue
                for stmt in split_sql(script):
                    con.execute(stmt)
                con.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", [version, name])

    # -- the connection ------------------------------------------------------------------------
    def _lost(self, e: Exception) -> bool:
        """Whether ``e`` means the connection is gone (server restarted or unreachable), not a failed
        statement on a live connection."""
        return (self.con.closed or self.con.broken
                or isinstance(e, psycopg.errors.AdminShutdown | psycopg.errors.CrashShutdown))

    def _reconnect(self, deadline: float) -> None:
        """A new connection in place of the broken one (tried until ``deadline``), with this
        connection's staging tables (temporary tables die with their connection)."""
        try:
            self.con.close()
        except Exception:  # noqa: BLE001 - it is broken already
            pass
        delay, last = 0.1, None
        while True:
            try:
                self.con = psycopg.connect(self.url, **self._connect_kw)
                break
            except psycopg.OperationalError as e:
                last = e
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(
                        f"lost the connection to the event store at {self.location} and could not reconnect "
                        f"within {RECONNECT_TIMEOUT_S:.0f} s: {str(last).strip().splitlines()[0] if str(last).strip() else last}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if not self.read_only:
            self._stage()

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (one statement, or a read-only transaction) under the lock, again on a new connection
        when the connection broke (safe: reads, or statements the server rolled back with the
        connection)."""
        self._check_open()
        deadline = None
        while True:
            with self._lock:
                try:
                    return fn()
                except psycopg.OperationalError as e:
                    if not self._lost(e):
                        raise
                    deadline = deadline or time.monotonic() + RECONNECT_TIMEOUT_S
                    self._reconnect(deadline)

    def _q(self, sql: str, params: SqlParams = None) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._retrying(lambda: self.con.execute(sql, params).fetchall())
        return rows

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

    def _transaction(self, fn: Callable[[], Any], retry_on: type[Exception] | tuple[type[Exception], ...]) -> Any:
        """``fn()`` in one transaction, tried again (up to APPEND_ATTEMPTS) when it fails with ``retry_on``:
        the transaction was rolled back, so nothing of the failed try was written.

        When the connection breaks (server restart, network cut) the store reconnects (for up to
        :data:`RECONNECT_TIMEOUT_S`) and tries again. If it broke while the COMMIT of an append was
        on its way, the append may have committed without the acknowledgement arriving: the events
        (deterministic ids) are looked for at the seqs the append gave them, and if they are there the
        append's own result is returned, so it is neither written twice nor refused as a conflict with
        itself (its expected version is already passed). Not there: the server rolled it back, and
        it is tried again from the start."""
        self._check_open()
        attempt, deadline = 0, None
        while True:
            self._pending = None
            try:
                with self._lock, self.con.transaction():
                    return fn()
            except retry_on:
                attempt += 1
                if attempt >= APPEND_ATTEMPTS:
                    raise
            except psycopg.OperationalError as e:
                if not self._lost(e):
                    raise
                pending, self._pending = self._pending, None
                deadline = deadline or time.monotonic() + RECONNECT_TIMEOUT_S
                with self._lock:
                    self._reconnect(deadline)
                    if pending is not None and self._committed(pending):
                        return pending[4]

    def _committed(self, pending: tuple[int, int, str, str, AppendResult]) -> bool:
        """Whether the append described by ``pending`` committed: its first and last events hold the
        seqs it gave them (event ids are unique in the store, so no other append can have put them
        there; one that appended the very same events would have left the same store)."""
        first, last, first_id, last_id, _ = pending
        found = dict(self.con.execute("SELECT seq, event_id FROM events WHERE seq = ANY(%s)", [[first, last]]).fetchall())
        return found.get(first) == first_id and found.get(last) == last_id

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
             "nodes": [_signed(n) for n in names.values()]},
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
            e = entities.setdefault(_signed(r.node), [seq, seq, 0])
            e[1], e[2] = seq, e[2] + 1
            for name, parent in zip(r.causation, r.parents, strict=True):
                if name is not None and name != r.entity:
                    links.setdefault((_signed(r.node), _signed(parent)), (seq, name))
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
                {"nn": [_signed(n) for n in names.values()], "nm": list(names), "corr": correlation_id, **ev,
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

    def _stage(self) -> None:
        """This connection's staging tables for the keys of a batch (temporary: no WAL, emptied at every
        commit), created outside any transaction so that a retried append finds them. The batch's keys
        go in by COPY: a Python list of 100k strings as a query parameter cost ~0.5 s to encode (psycopg
        quotes each element), the COPY ~20 ms."""
        for ddl in ('_fw_streams (s TEXT COLLATE "C" NOT NULL)', '_fw_known (s TEXT COLLATE "C" NOT NULL)', '_fw_names (node BIGINT NOT NULL, name TEXT COLLATE "C" NOT NULL)',
                    "_fw_entities (node BIGINT NOT NULL, last BIGINT NOT NULL, n BIGINT NOT NULL)",
                    '_fw_links (child BIGINT NOT NULL, parent BIGINT NOT NULL, seq BIGINT NOT NULL, parent_name TEXT COLLATE "C" NOT NULL)'):
            self.con.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {ddl} ON COMMIT DELETE ROWS")

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
        names = _names_of(batch, cols)
        # Phase 1, no lock: stage the batch's names, look them up (for the collision check and to copy
        # only new ones, and which of them are recorded entities: an entity is a name). One index probe
        # per staged name (OFFSET 0 keeps the subquery a nested loop): without statistics on the staging
        # table the planner hashed all of entity_names instead (100k names against a 500k-name store:
        # 477 ms; probes ~400 ms, and they do not grow with the store).
        watermark = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        self._copy(cur, "_fw_names", "node, name", [pc.cast(names.column("node"), pa.string()), _pg_text(names.column("name"))])
        have = cur.execute(
            "SELECT k.node, n.name, EXISTS (SELECT 1 FROM entity_index i WHERE i.node = k.node) FROM _fw_names k "
            "CROSS JOIN LATERAL (SELECT n.name FROM entity_names n WHERE n.node = k.node OFFSET 0) n").fetchall()
        # A collision: two of the batch's names share a node id, or a stored name that is not among the
        # batch's names holds one of theirs (both rare: the check itself runs only then).
        unique = pc.count_distinct(names.column("node")).as_py() == names.num_rows
        clashes: dict[str, tuple[str, int]] = {}
        if not unique or (have and not pc.all(pc.is_in(pa.array([x for _, x, _ in have], pa.string()),
                                                        value_set=names.column("name"))).as_py()):
            checked = names if unique else _names_of(batch, cols, True)
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
            names = _names_of(batch, cols)
            if not batch.num_rows:
                return AppendResult(rejected=list(rejected.values()))
            expected_versions = expected_of(expected_versions, set(batch.column("stream").to_pylist()))
        n_rows = batch.num_rows
        streams = batch.column("stream")
        ids = cols.column("event_id")
        # Stage the batch's streams and look them up; record its new names.
        self._copy(cur, "_fw_streams", "s", [_pg_text(pc.unique(streams))])
        known_s, known_v, held = self._lookup(cur)
        if len(known_s):  # the streams that exist: those another writer may append to before the lock
            self._copy(cur, "_fw_known", "s", [_pg_text(known_s)])
        known_nodes = pa.array([n for n, _, _ in have], pa.int64())
        fresh_names = names.filter(pc.invert(pc.is_in(names.column("node"), value_set=known_nodes)))
        self._copy(cur, "entity_names", "node, name",
                   [pc.cast(fresh_names.column("node"), pa.string()), _pg_text(fresh_names.column("name"))])
        old_entities = pa.array([n for n, _, is_entity in have if is_entity], pa.int64())
        # The rows' text that does not depend on the numbering, built before the lock is taken.
        corr = "\\N" if correlation_id is None else _pg_text(pa.array([correlation_id]))[0].as_py()
        text = pa.table({
            "event_id": ids, "stream": _pg_text(streams), "type": _pg_text(batch.column("type")),
            "payload": _pg_text(batch.column("payload")), "causation": _pg_text(_pg_array(batch.column("causation"), quote=True)),
            "corr": pa.array([corr] * n_rows, pa.string()), "sv": pc.cast(_schema_versions(batch.column("type")), pa.string()),
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
            edges = _edges_of(rows, fcols, seq)
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
                        _pg_text(new_l.column("name"))])
        if old_l is not None and old_l.num_rows:
            self._copy(cur, "_fw_links", "child, parent, seq, parent_name",
                       [*(pc.cast(old_l.column(c), pa.string()) for c in ("child", "parent", "seq_min")),
                        _pg_text(old_l.column("name"))])
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
                                            [[_signed(n) for n in nodes]])]

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
                pc.cast(t.column("seq"), pa.string()), t.column("event_id"), _pg_text(t.column("stream")),
                pc.cast(t.column("stream_version"), pa.string()), _pg_text(t.column("type")),
                _pg_text(pc.cast(t.column("payload"), pa.string())),
                _pg_text(_pg_array(t.column("causation"), quote=True)),
                pc.if_else(pc.is_null(t.column("correlation_id")), "\\N",
                           _pg_text(pc.fill_null(t.column("correlation_id"), ""))),
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
