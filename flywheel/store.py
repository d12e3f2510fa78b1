"""The append-only event store, in one DuckDB file.

Guarantees
- ``event_id`` is deterministic: a hash of type, stream and the canonical JSON payload. Appending an
  event that is already recorded is a no-op reported as ``already_recorded``; re-running a stage
  appends nothing new. ``correlation_id`` is *not* part of the hash.
- ``UNIQUE(stream, stream_version)`` plus ``expected_version`` give optimistic concurrency: a stale
  expected version raises :class:`ConcurrencyError` and appends nothing.
- Every append is one explicit transaction (DuckDB 2 auto-commits each statement of a plain batch),
  events and projections together. Batches go in through Arrow, not row by row.
- Projections (``entity_names``; ``entity_index``, read through the view ``entities``;
  ``lineage_links``, read through the view ``lineage_edges``; ``streams`` is a view over events), keyed
  by 64-bit node ids (:func:`node_id`, migration 003), are maintained on append and can be
  rebuilt from the events alone (:meth:`EventStore.rebuild_projections`); both paths run the same
  aggregation, and a test asserts rebuilt == incremental.

Crash safety (what survives a SIGKILL)
- Committed transactions survive: DuckDB replays its write-ahead log on the next open (the WAL is
  checkpointed into the file every :data:`CHECKPOINT_THRESHOLD` and on close). An append that
  was in flight is absent as a whole; none is half-applied.
- If DuckDB refuses to replay the WAL, ``EventStore(path, recover_wal=True)`` (CLI:
  ``flywheel warehouse recover``) moves the WAL aside as ``<file>.wal.unreplayed-<time>``, opens the
  database, and warns loudly that the transactions in that file are lost from the store (the file is
  kept for forensics).

Concurrency
- DuckDB allows one read-write process per file. A second process gets :class:`StoreLockedError`
  naming the holder's PID. Other processes read Parquet exports (``flywheel warehouse export``).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import CATALOG, check_event

ANY = None  # expected_version: no check
CHECKPOINT_THRESHOLD = "256MiB"
NO_STREAM = 0  # expected_version: the stream must not exist yet


class StoreError(RuntimeError):
    pass


class ConcurrencyError(StoreError):
    """The stream's current version is not the one the caller expected."""

    def __init__(self, stream: str, expected: int, actual: int):
        super().__init__(f"stream {stream!r} is at version {actual}, expected {expected}")
        self.stream, self.expected, self.actual = stream, expected, actual


class StoreLockedError(StoreError):
    """Another process holds the warehouse file."""


@dataclass(frozen=True)
class NewEvent:
    """An event to append. ``causation`` lists the entity ids it was caused by."""

    type: str
    payload: dict[str, Any]
    causation: Sequence[str] = ()


@dataclass(frozen=True)
class Event:
    seq: int
    event_id: str
    stream: str
    stream_version: int
    type: str
    payload: dict[str, Any]
    causation: list[str]
    correlation_id: str | None
    recorded_at: Any
    schema_version: int

    @property
    def entity_id(self) -> str:
        return self.payload.get("entity_id") or self.stream


@dataclass
class AppendResult:
    appended: int = 0
    already_recorded: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    event_ids: list[str] = field(default_factory=list)

    @property
    def is_noop(self) -> bool:
        return self.appended == 0


def canonical_json(payload: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 kept. Raises TypeError on non-JSON values."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event_id_sql(type_col: str = "type", stream_col: str = "stream", payload_col: str = "payload") -> str:
    # 128 bits of sha256 over type, stream and canonical payload, separated by a unit separator.
    return f"'ev_' || left(sha256({type_col} || chr(31) || {stream_col} || chr(31) || {payload_col}), 32)"


def node_id(name: str) -> int:
    """An entity's node id: 64 bits of the name's MD5, as DuckDB's ``(md5_number(name) >> 64)::UBIGINT``.

    (``md5_number`` reads the digest as a little-endian 128-bit integer, so these are its last 8 bytes.
    ``md5_number_lower`` gives the same value at ~4x the cost: 60 ms vs 16 ms per 100k names.)
    """
    import hashlib

    return int.from_bytes(hashlib.md5(name.encode()).digest()[8:], "little")


def compute_event_id(type_: str, stream: str, payload: dict[str, Any] | str) -> str:
    import hashlib

    body = payload if isinstance(payload, str) else canonical_json(payload)
    return "ev_" + hashlib.sha256(f"{type_}\x1f{stream}\x1f{body}".encode()).hexdigest()[:32]


BATCH_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("type", pa.string()),
        ("payload", pa.string()),  # canonical JSON text
        ("causation", pa.list_(pa.string())),
    ]
)

# One lock per warehouse file, shared by every EventStore of this process on that file. DuckDB's file
# lock keeps other processes out; this lock serialises appends of several connections inside one
# process, which is what lets the append transaction (not an index) keep seq, event_id and
# (stream, stream_version) unique.
_PATH_LOCKS: dict[str, threading.RLock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


def _path_lock(path: Path) -> threading.RLock:
    key = os.path.realpath(path)
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.setdefault(key, threading.RLock())


_LOCK_RE = re.compile(r"Conflicting lock is held in (?P<exe>.*?) \(PID (?P<pid>\d+)\)")
_ENTITY_SQL = "coalesce(json_extract_string(payload, '$.entity_id'), stream)"
_NODE_SQL = "(md5_number({}) >> 64)::UBIGINT"  # node_id() in SQL; .format(column)
# The catalog's schema version of b.type, without a join (a join would not keep the batch's row order).
_NON_DEFAULT_VERSIONS = " ".join(
    f"WHEN '{t}' THEN {spec.schema_version}" for t, spec in CATALOG.items() if spec.schema_version != 1
)
_SCHEMA_VERSION_SQL = f"CASE b.type {_NON_DEFAULT_VERSIONS} ELSE 1 END" if _NON_DEFAULT_VERSIONS else "1"


def _sql(name: str) -> str:
    return resources.files("flywheel.warehouse").joinpath(name).read_text()


def _migrations() -> list[tuple[int, str, str]]:
    root = resources.files("flywheel.warehouse").joinpath("migrations")
    out = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".sql"):
            out.append((int(entry.name.split("_", 1)[0]), entry.name, entry.read_text()))
    return out


def _split_sql(script: str) -> list[str]:
    body = "\n".join(line for line in script.splitlines() if not line.strip().startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]


class EventStore:
    """The event store. Use as a context manager; one instance per process."""

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False, recover_wal: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self.recovered_wal: Path | None = None
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = _path_lock(self.path)
        self.con = self._connect(recover_wal)
        if not read_only:
            for p in (self.path, Path(str(self.path) + ".wal")):
                if p.exists():
                    os.chmod(p, 0o600)
            # DuckDB checkpoints (rewrites the WAL into the file) once the WAL passes the threshold,
            # 16 MiB by default: that is every bulk append of 100k events, and checkpointing each one
            # cost ~0.4 s per 1M events. With 256 MiB the WAL replays in about a second after a crash.
            self.con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_THRESHOLD}'")
            self._migrate()

    # -- opening -----------------------------------------------------------------------------
    def _connect(self, recover_wal: bool) -> duckdb.DuckDBPyConnection:
        try:
            return duckdb.connect(str(self.path), read_only=self.read_only)
        except duckdb.IOException as e:
            m = _LOCK_RE.search(str(e))
            if m:
                raise StoreLockedError(
                    f"warehouse {self.path} is in use by process {m['pid']} ({m['exe']}). DuckDB allows one "
                    f"writer per file: wait for that process to finish or stop it (kill {m['pid']}); to read "
                    f"while it runs, use `flywheel warehouse export DIR` from that process and read the Parquet."
                ) from None
            raise
        except duckdb.Error as e:
            wal = Path(str(self.path) + ".wal")
            if not (recover_wal and wal.exists()):
                if wal.exists():
                    raise StoreError(
                        f"DuckDB could not open {self.path} ({e}). If it failed while replaying its write-ahead "
                        f"log, run `flywheel warehouse recover` to set {wal.name} aside and open without it."
                    ) from None
                raise
            aside = wal.with_name(f"{wal.name}.unreplayed-{time.strftime('%Y%m%dT%H%M%S')}")
            wal.rename(aside)
            self.recovered_wal = aside
            import warnings

            warnings.warn(
                f"WAL of {self.path} could not be replayed ({e}); moved to {aside}. Transactions committed "
                f"after the last checkpoint are NOT in the store; re-run the stages that produced them.",
                stacklevel=2,
            )
            return duckdb.connect(str(self.path), read_only=self.read_only)

    def _migrate(self) -> None:
        con = self.con
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, "
            "applied_at TIMESTAMPTZ DEFAULT now())"
        )
        done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, name, script in _migrations():
            if version in done:
                continue
            with self.transaction():
                for stmt in _split_sql(script):
                    con.execute(stmt)
                con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])

    def _writable(self) -> duckdb.DuckDBPyConnection:
        if self.con is None:
            raise StoreError(f"event store {self.path} is closed")
        if self.read_only:
            raise StoreError(f"event store {self.path} is open read-only; appends need a writable store")
        return self.con

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None  # type: ignore[assignment]

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.con.execute("BEGIN TRANSACTION")
        try:
            yield self.con
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        else:
            self.con.execute("COMMIT")

    # -- appending ---------------------------------------------------------------------------
    def append(
        self,
        stream: str,
        events: NewEvent | Iterable[NewEvent],
        *,
        expected_version: int | None = ANY,
        correlation_id: str | None = None,
    ) -> AppendResult:
        """Append events to one stream in one transaction.

        ``expected_version``: ``None`` appends at the end; an int (``NO_STREAM`` = 0 for a new stream)
        must equal the stream's current version, else :class:`ConcurrencyError`. Events already recorded
        (same event_id) are skipped and counted as ``already_recorded``; a fully recorded append is a
        no-op that never raises on version.
        """
        if isinstance(events, NewEvent):
            events = [events]
        events = list(events)
        if not events:
            return AppendResult()
        rows = {"stream": [], "type": [], "payload": [], "causation": []}
        for i, ev in enumerate(events):
            check_event(ev.type, stream)
            try:
                body = canonical_json(ev.payload)
            except (TypeError, ValueError) as e:
                raise TypeError(f"event {i} ({ev.type} on {stream}): payload is not JSON-serialisable: {e}") from None
            rows["stream"].append(stream)
            rows["type"].append(ev.type)
            rows["payload"].append(body)
            rows["causation"].append([str(c) for c in ev.causation])
        table = pa.table(rows, schema=BATCH_SCHEMA)
        return self.append_batch(
            table,
            correlation_id=correlation_id,
            expected_versions={stream: expected_version} if expected_version is not None else None,
            validated=True,
        )

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
        whole append runs under the store's per-file lock in one transaction, so ``seq`` continues from
        ``max(seq)``, each stream continues from its current version, and an event is recognised as
        recorded by its id among the events of the batch's *existing* streams only (an event_id hashes
        its stream, so an event on a new stream cannot be recorded). :meth:`_append_locked` plans
        this in Arrow.
        """
        if table.num_rows == 0:
            return AppendResult()
        table = table.select(BATCH_SCHEMA.names).cast(BATCH_SCHEMA)
        for col in ("stream", "type", "payload"):
            if table.column(col).null_count:
                raise ValueError(f"append_batch: column {col!r} has {table.column(col).null_count} null value(s)")
        batch = table.append_column("_i", pa.array(range(table.num_rows), type=pa.int64()))
        with self._lock:
            con = self._writable()
            con.register("_batch_in", batch)
            try:
                if not validated:
                    pairs = con.execute(
                        "SELECT DISTINCT type, split_part(stream, ':', 1) FROM _batch_in"
                    ).fetchall()
                    for type_, prefix in pairs:
                        check_event(type_, prefix + ":")
                with self.transaction():
                    return self._append_locked(con, batch, correlation_id, expected_versions)
            finally:
                con.unregister("_batch_in")

    def _append_locked(
        self,
        con: duckdb.DuckDBPyConnection,
        batch: pa.Table,
        correlation_id: str | None,
        expected_versions: dict[str, int] | None,
    ) -> AppendResult:
        """Plan the append in Arrow (which rows are fresh, their seq and stream versions), then insert.

        Three queries whatever the batch: the event ids (sha256 in DuckDB), the batch's streams that
        exist already with their versions and the batch's events they hold, and the INSERT. The rest
        is vectorised Arrow/numpy; the SQL windows and anti-joins this replaces cost ~0.2 s per 50k.
        """
        n_rows = batch.num_rows
        base = con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]
        # No ORDER BY (a sort of the batch): DuckDB keeps the scan's order (preserve_insertion_order),
        # and the check below sorts only if it ever did not.
        ids = con.sql(f"SELECT {event_id_sql()} AS event_id, _i FROM _batch_in").to_arrow_table()
        if pc.any(pc.not_equal(ids.column("_i"), batch.column("_i"))).as_py():
            ids = ids.sort_by("_i")
        event_ids = ids.column("event_id")
        con.register("_batch_ids", ids)
        try:
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
            ).to_arrow_table()
        finally:
            con.unregister("_batch_ids")
        fresh = np.ones(n_rows, dtype=bool)
        if pc.count_distinct(event_ids).as_py() != n_rows:  # a repeat inside the batch: keep the first
            first = pc.index_in(event_ids, value_set=event_ids).to_numpy(zero_copy_only=False)
            fresh &= first == np.arange(n_rows)
        held = pc.list_flatten(known.column("held")) if known.num_rows else None
        if held is not None and len(held):
            fresh &= ~pc.is_in(event_ids, value_set=held).to_numpy(zero_copy_only=False)
        n_new = int(fresh.sum())
        result = AppendResult(appended=n_new, already_recorded=n_rows - n_new)
        if n_new == 0:
            return result
        prior = dict(zip(known.column("stream").to_pylist(), known.column("version").to_pylist(), strict=True))
        for stream, expected in (expected_versions or {}).items():
            if expected is not None and prior.get(stream, 0) != expected:
                raise ConcurrencyError(stream, expected, prior.get(stream, 0))
        rows = batch.filter(pa.array(fresh)) if n_new < n_rows else batch
        new_ids = event_ids.filter(pa.array(fresh)) if n_new < n_rows else event_ids
        streams = rows.column("stream")
        # stream_version = the stream's prior version + the row's rank among the stream's fresh rows
        if pc.count_distinct(streams).as_py() == n_new:
            rank = np.ones(n_new, dtype=np.int64)
        else:
            codes = pc.dictionary_encode(streams).combine_chunks().indices.to_numpy()
            order = np.argsort(codes, kind="stable")
            sorted_codes = codes[order]
            starts = np.r_[0, np.flatnonzero(np.diff(sorted_codes)) + 1]
            pos = np.arange(n_new) - np.repeat(starts, np.diff(np.r_[starts, n_new]))
            rank = np.empty(n_new, dtype=np.int64)
            rank[order] = pos + 1
        version = rank
        if prior:
            before = pc.index_in(streams, value_set=known.column("stream"))
            prior_v = pc.take(known.column("version"), before)
            version = version + pc.fill_null(prior_v, 0).to_numpy(zero_copy_only=False)
        plan = rows.append_column("seq", pa.array(np.arange(base + 1, base + 1 + n_new, dtype=np.int64)))
        plan = plan.append_column("event_id", new_ids).append_column("stream_version", pa.array(version))
        con.register("_batch_plan", plan)
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
            con.unregister("_batch_plan")
        self._project(con, base)
        result.first_seq, result.last_seq = base + 1, base + n_new
        if n_new <= 10_000:
            result.event_ids = new_ids.to_pylist()
        return result

    # Projections: one code path used both incrementally (over the events after ``after_seq``) and on
    # rebuild (``after_seq=0`` over emptied tables), so the two cannot drift apart. Everything is keyed
    # by node id (:func:`node_id`, migration 003).
    @staticmethod
    def _project(con: duckdb.DuckDBPyConnection, after_seq: int) -> None:
        after = int(after_seq)
        # The new events' entity ids and node ids, computed once for all projections.
        new = con.sql(
            f"""
            SELECT seq, entity_id, {_NODE_SQL.format("entity_id")} AS node, causation
            FROM (SELECT seq, {_ENTITY_SQL} AS entity_id, causation FROM events WHERE seq > {after})
            """
        ).to_arrow_table()
        if new.num_rows == 0:
            return
        con.register("_new_events", new)
        try:
            EventStore._project_names(con)
            updated = EventStore._project_entities(con, new)
            EventStore._project_lineage(con, updated)
        finally:
            con.unregister("_new_events")

    @staticmethod
    def _project_names(con: duckdb.DuckDBPyConnection) -> None:
        """entity_names: every entity id and every name in a causation, once (an anti-join on ids)."""
        names = con.sql(
            f"""
            SELECT entity_id AS name, node FROM _new_events
            UNION
            SELECT name, {_NODE_SQL.format("name")}
            FROM (SELECT DISTINCT unnest(causation) AS name FROM _new_events) WHERE name IS NOT NULL
            """
        ).to_arrow_table()
        con.register("_names", names)
        try:
            known = con.execute(
                "SELECT n.node, n.name FROM entity_names n SEMI JOIN _names b ON n.node = b.node"
            ).fetchall()
            EventStore._check_node_ids(names, known)
            con.execute(
                "INSERT INTO entity_names SELECT b.node, b.name FROM _names b ANTI JOIN entity_names n ON n.node = b.node"
            )
        finally:
            con.unregister("_names")

    @staticmethod
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

    @staticmethod
    def _project_lineage(con: duckdb.DuckDBPyConnection, any_old_entity: bool) -> None:
        """lineage_links: one row per (child, parent) node pair, from each event's causation."""
        edges = f"""
            SELECT child, {_NODE_SQL.format("parent")} AS parent, seq FROM (
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

    @staticmethod
    def _check_node_ids(names: pa.Table, known: list[tuple[int, str]]) -> None:
        """Refuse an append that would give two names one node id (a 64-bit MD5 prefix collision)."""
        ids = names.column("node")
        clash = None
        if pc.count_distinct(ids).as_py() != names.num_rows:
            counts = pc.value_counts(ids)
            dup = next(v["values"] for v in counts.to_pylist() if v["counts"] > 1)
            clash = sorted(n for n, i in zip(names.column("name").to_pylist(), ids.to_pylist(), strict=True) if i == dup)
        elif known:
            batch = dict(zip(ids.to_pylist(), names.column("name").to_pylist(), strict=True))
            clash = next(([old, batch[node]] for node, old in known if batch[node] != old), None)
        if clash:
            raise StoreError(
                f"entity ids collide: {clash[0]!r} and {clash[1]!r} share the node id {node_id(clash[0])}; "
                "rename one of these entities (nothing was appended)"
            )

    def rebuild_projections(self) -> dict[str, int]:
        """Drop and recompute every projection from the events alone."""
        with self._lock, self.transaction() as con:
            for t in ("entity_index", "lineage_links", "entity_names"):
                con.execute(f"DELETE FROM {t}")
            self._project(con, 0)
        return self.projection_counts()

    def check_integrity(self) -> list[str]:
        """The invariants the append transaction keeps without indexes; returns violations (empty = ok).

        seq is 1..n without gaps or repeats; event_id is unique; every stream's versions are 1..k;
        ``entity_index`` agrees with the events; no projection row is duplicated; node ids are their
        names' and unique; every entity and edge has a name.
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
                    SELECT {_NODE_SQL.format(_ENTITY_SQL)} AS node,
                           min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events
                    FROM events GROUP BY 1) e
                FULL JOIN entity_index i USING (node)
                WHERE (e.first_seq, e.last_seq, e.n_events) IS DISTINCT FROM (i.first_seq, i.last_seq, i.n_events)""",
            "duplicate entity rows": "SELECT count(*) <> count(DISTINCT node) FROM entity_index",
            "duplicate lineage edges": "SELECT count(*) <> count(DISTINCT (child, parent)) FROM lineage_links",
            "entity names or node ids not unique, or a node id not its name's": f"""
                SELECT count(*) <> count(DISTINCT node) OR count(*) <> count(DISTINCT name)
                       OR bool_or(node <> {_NODE_SQL.format("name")}) FROM entity_names""",
            "an entity or lineage edge without a name": """
                SELECT count(*) > 0 FROM (
                    SELECT node FROM entity_index UNION ALL SELECT child FROM lineage_links
                    UNION ALL SELECT parent FROM lineage_links
                ) x ANTI JOIN entity_names n ON n.node = x.node""",
        }
        return [name for name, sql in checks.items() if self.con.execute(sql).fetchall()[0][0]]

    def projection_counts(self) -> dict[str, int]:
        tables = {"events": "events", "streams": "streams", "entities": "entity_index", "lineage_edges": "lineage_links"}
        return {name: self.con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for name, t in tables.items()}

    # -- reading -----------------------------------------------------------------------------
    def stream_version(self, stream: str) -> int:
        return self.con.execute(
            "SELECT coalesce(max(stream_version), 0) FROM events WHERE stream = ?", [stream]
        ).fetchall()[0][0]

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
        return [
            Event(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), list(r[6]), r[7], r[8], r[9])
            for r in self.con.execute(sql, params).fetchall()
        ]

    def read_arrow(self, stream=None, types=None, after_seq=None, correlation_id=None) -> pa.Table:
        where, params = self._where(stream, types, after_seq, correlation_id)
        return self.con.sql(f"SELECT * FROM events {where} ORDER BY seq", params=params).to_arrow_table()

    @staticmethod
    def _where(stream, types, after_seq, correlation_id) -> tuple[str, list[Any]]:
        clauses, params = [], []
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
        row = self.con.execute(
            f"""
            SELECT ?::VARCHAR, split_part(?::VARCHAR, ':', 1), e.stream, e.type, i.first_seq, i.last_seq,
                   i.n_events, e.payload
            FROM entity_index i JOIN events e ON e.seq = i.last_seq WHERE i.node = {_NODE_SQL.format("?::VARCHAR")}
            """,
            [entity_id, entity_id, entity_id],
        ).fetchall()
        if not row:
            return None
        row = row[0]
        keys = ["entity_id", "kind", "stream", "last_type", "first_seq", "last_seq", "n_events", "state"]
        out = dict(zip(keys, row, strict=True))
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
            for r in self.con.execute(sql, params).fetchall()
        ]

    def counts_by_kind(self) -> dict[str, int]:
        return dict(
            self.con.execute(
                "SELECT split_part(n.name, ':', 1) AS kind, count(*) FROM entity_index i "
                "JOIN entity_names n ON n.node = i.node GROUP BY kind ORDER BY kind"
            ).fetchall()
        )

    def last_seq(self) -> int:
        return self.con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]

    # -- lineage -----------------------------------------------------------------------------
    def lineage(self, entity_id: str, direction: str = "down", max_depth: int = 64) -> list[tuple[str, int]]:
        """Ancestors (``down``: what it was made from) or descendants (``up``: what it made)."""
        if direction not in ("down", "up"):
            raise ValueError("direction must be 'down' or 'up'")
        return [tuple(r) for r in self.con.execute(_sql(f"queries/lineage_{direction}.sql"), [entity_id, max_depth]).fetchall()]

    def lineage_edges(self, entity_id: str, max_depth: int = 64) -> list[tuple[str, str]]:
        return [tuple(r) for r in self.con.execute(_sql("queries/lineage_edges_down.sql"), [entity_id, max_depth]).fetchall()]

    # -- export ------------------------------------------------------------------------------
    def export(self, directory: str | os.PathLike[str]) -> dict[str, str]:
        """Write every table as Parquet (zstd) for readers in other processes. Atomic per file."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        for t in ("events", "streams", "entities", "lineage_edges"):
            final = out / f"{t}.parquet"
            tmp = out / f".{t}.parquet.tmp-{os.getpid()}"
            self.con.execute(f"COPY (SELECT * FROM {t}) TO '{tmp}' (FORMAT parquet, COMPRESSION zstd)")
            os.replace(tmp, final)
            written[t] = str(final)
        return written


def open_store(cfg: Any, **kw: Any) -> EventStore:
    """Open the configured warehouse (creating the home directory, 0700)."""
    cfg.ensure_home()
    return EventStore(cfg.warehouse, **kw)
