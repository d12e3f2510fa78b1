"""The embedded event store: one DuckDB file on one machine (:class:`DuckDBEventStore`).

The contract it keeps, with the PostgreSQL backend, is described in :mod:`flywheel.store`. How it keeps
it here: one append at a time per file (a lock per file in this process; other processes append
through the file's owner, :mod:`flywheel.store.share`), each one transaction of the events and their
projections; a few events take one statement planned from the in-memory head index
(:mod:`flywheel.store.index`), a batch is planned in Arrow (:mod:`flywheel.store.batch`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
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
    EXPORT_TABLES,
    SMALL_APPEND,
    AppendResult,
    Event,
    EventStore,
    InvalidEventError,
    NewEvent,
    SqlParams,
    StoreError,
    StoreLockedError,
    StoreUnavailableError,
)
from flywheel.store.ids import event_id_sql
from flywheel.store.index import HeadIndex
from flywheel.store.schema import migrations, read_sql, split_sql
from flywheel.store.share import Client, Owner, OwnerGone, socket_path

CHECKPOINT_THRESHOLD = "256MiB"
# How long opening an embedded store waits for a file held by a process that does not serve it (or
# an owner still starting up) before StoreLockedError. Opening, migrations and a clean close of a
# 1M-event warehouse take ~1 s here; a read-only reader holds it for well under that.
DEFAULT_OPEN_TIMEOUT_S = 60.0

# One lock per warehouse file, shared by every EventStore of this process on that file. DuckDB's file
# lock keeps other processes out (they append through the owner, flywheel.store.share); this lock
# serialises appends of several connections inside one process, which is what lets the append
# transaction (not an index) keep seq, event_id and (stream, stream_version) unique.
_PATH_LOCKS: dict[str, threading.RLock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


_PATH_INDEXES: dict[str, HeadIndex] = {}


def _path_lock(path: Path) -> threading.RLock:
    key = os.path.realpath(path)
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.setdefault(key, threading.RLock())


def _path_index(path: Path) -> HeadIndex:
    """The in-memory head index of this warehouse file in this process (flywheel.store.index), used
    under the file's lock."""
    key = os.path.realpath(path)
    with _PATH_LOCKS_GUARD:
        return _PATH_INDEXES.setdefault(key, HeadIndex())


# DuckDB's lock conflict: 'Could not set lock on file "...": Conflicting lock is held in <program>
# (PID <n>)...', with the program left out when it cannot be read (another PID namespace), and nothing
# after the colon when the holder let go between DuckDB's two fcntl calls (it reads PID 0): exactly
# what a takeover from an exiting owner meets. Not a conflict: an fcntl failure ("No locks available").
_LOCK_RE = re.compile(r'Conflicting lock is held|Could not set lock on file "[^"]*":\s*(?:\.|$)')
_HOLDER_RE = re.compile(r"Conflicting lock is held in (?:(?P<exe>.*?) )?\(?PID (?P<pid>\d+)\)?")


def _lock_holder(message: str) -> tuple[str, str] | None:
    """(pid, program) of the process DuckDB says holds the file's lock, or None when ``message`` is not
    a lock conflict; ('?', '') where DuckDB does not name the holder, ('<pid>', '') without its program."""
    if not _LOCK_RE.search(message):
        return None
    m = _HOLDER_RE.search(message)
    if m is None:
        return "?", ""
    return m["pid"], (m["exe"] or "").strip()


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



class DuckDBEventStore(EventStore):
    """The embedded backend: one DuckDB file, shared between the processes of one machine by its owner
    (see the module docstring). ``con`` is the DuckDB connection in the owning process, or a read-only
    stand-in (``execute``/``sql`` of SELECT statements) that forwards to the owner in the others."""

    backend = "duckdb"

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False, recover_wal: bool = False,
                 open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S, serve: bool = True):
        self.path = Path(path)
        self.read_only = read_only
        self.recovered_wal: Path | None = None
        self.open_timeout_s = open_timeout_s
        self._serve = serve and not read_only
        self._recover_wal = recover_wal
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = _path_lock(self.path)
        self._index = _path_index(self.path)
        self._tls = threading.local()
        self._cursor_guard = threading.Lock()
        self._cursors: list[Any] = []
        self._remote: Any = None  # flywheel.store.share.Client when another process owns the file
        self._share: Any = None  # flywheel.store.share.Owner registration when this one serves it
        self.con: Any = None
        self._wcon: duckdb.DuckDBPyConnection | None = None
        self._closed = False
        self._attach(time.monotonic() + open_timeout_s)

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def is_owner(self) -> bool:
        """True when this process holds the DuckDB file (else it talks to the process that does)."""
        return self._remote is None and self.con is not None

    # -- opening -----------------------------------------------------------------------------
    def _attach(self, deadline: float) -> None:
        """Open the file, or connect to the flywheel process that holds it; wait (bounded) for a holder
        that serves nobody or for an owner that is still starting."""
        sock = socket_path(self.path)
        delay = 0.02
        while True:
            holder = self._open_local()
            if holder is None:
                return
            client = Client.connect(sock)
            if client is not None:
                self._remote = client
                self.con = client.connection(read_only=self.read_only)
                return
            if time.monotonic() >= deadline:
                pid, exe = holder
                who = f"process {pid}" + (f" ({exe})" if exe else "") if pid != "?" else "another process"
                stop = f"stop it (kill {pid})" if pid != "?" else "stop it (`fuser` names it)"
                raise StoreLockedError(
                    f"warehouse {self.path} is held by {who}, which does not share it (not a "
                    f"flywheel store, or one opened read-only); waited {self.open_timeout_s:.0f} s. Wait for "
                    f"that process to finish or {stop}; flywheel processes share the file "
                    f"between them, and `flywheel warehouse export DIR` works from any of them."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _open_local(self) -> tuple[str, str] | None:
        """Open the DuckDB file in this process; on a lock held elsewhere return (pid, exe) of the holder."""
        try:
            con = self._connect(self._recover_wal)
        except duckdb.IOException as e:
            holder = _lock_holder(str(e))
            if holder is not None:
                return holder
            raise
        self.con = con
        self._wcon = None if self.read_only else con.cursor()
        if not self.read_only:
            for p in (self.path, Path(str(self.path) + ".wal")):
                if p.exists():
                    os.chmod(p, 0o600)
            # DuckDB checkpoints (rewrites the WAL into the file) once the WAL passes the threshold,
            # 16 MiB by default: that is every bulk append of 100k events, and checkpointing each one
            # cost ~0.4 s per 1M events. With 256 MiB the WAL replays in about a second after a crash.
            self.con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_THRESHOLD}'")
            self._migrate()
            with self._lock:  # another process may have appended while this one did not hold the file
                self._index.reset()
            if self._serve:
                self._share = Owner.register(self.path, lambda path: DuckDBEventStore(path, serve=False))
        return None

    def _connect(self, recover_wal: bool) -> duckdb.DuckDBPyConnection:
        try:
            return duckdb.connect(str(self.path), read_only=self.read_only)
        except duckdb.IOException as e:
            if _LOCK_RE.search(str(e)):
                raise
            return self._connect_failed(e, recover_wal)
        except duckdb.Error as e:
            return self._connect_failed(e, recover_wal)

    def _connect_failed(self, e: Exception, recover_wal: bool) -> duckdb.DuckDBPyConnection:
        wal = Path(str(self.path) + ".wal")
        if not (recover_wal and wal.exists()):
            if wal.exists():
                raise StoreError(
                    f"DuckDB could not open {self.path} ({e}). If it failed while replaying its write-ahead "
                    f"log, run `flywheel warehouse recover` to set {wal.name} aside and open without it."
                ) from None
            raise e
        aside = wal.with_name(f"{wal.name}.unreplayed-{time.strftime('%Y%m%dT%H%M%S')}")
        wal.rename(aside)
        self.recovered_wal = aside
        import warnings

        warnings.warn(
            f"WAL of {self.path} could not be replayed ({e}); moved to {aside}. Transactions committed "
            f"after the last checkpoint are NOT in the store; re-run the stages that produced them.",
            stacklevel=4,
        )
        return duckdb.connect(str(self.path), read_only=self.read_only)

    def _migrate(self) -> None:
        con = self._wcon
        assert con is not None
        with self._lock:
            con.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMPTZ DEFAULT now())"
            )
            done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
            for version, name, script in migrations():
                if version in done:
                    continue
                with self.transaction():
                    for stmt in split_sql(script):
                        con.execute(stmt)
                    con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])

    def _reattach(self) -> None:
        """The owner this process talked to went away: take the file over or find the new owner."""
        if self._remote is not None:
            self._remote.close()
        self._remote = None
        self.con = None
        self._attach(time.monotonic() + self.open_timeout_s)

    def _call_remote(self, fn: Any) -> Any:
        """Run ``fn(client)`` against the owner; on a lost owner, re-attach and retry (bounded)."""
        deadline = None  # counted from when the owner is first found gone, not from the request's start
        while True:
            if self._remote is None:
                return None  # this process owns the file now: the caller runs locally
            try:
                return fn(self._remote)
            except OwnerGone:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.open_timeout_s
                elif now >= deadline:
                    raise StoreUnavailableError(f"the process serving {self.path} went away and none took over") from None
                self._reattach()

    def _writable(self) -> duckdb.DuckDBPyConnection:
        if self._closed or (self.con is None and self._remote is None):
            raise StoreError(f"event store {self.path} is closed")
        if self.read_only:
            raise StoreError(f"event store {self.path} is open read-only; appends need a writable store")
        assert self._wcon is not None
        return self._wcon

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"event store {self.path} is closed")

    def _rcon(self) -> Any:
        """The connection for reads in the calling thread: through the owner in a client process; in the
        owning process, a cursor per thread (a DuckDB connection must not be used by two threads at once,
        and the owner's socket threads read beside the stages' threads)."""
        self._check_open()
        if self._remote is not None:
            return self.con
        cur = getattr(self._tls, "cur", None)
        if cur is None:
            with self._cursor_guard:
                cur = self.con.cursor()
                self._cursors.append(cur)
            self._tls.cur = cur
        return cur

    def open_cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor of the owning process's connection, for a client's reads (the caller closes it)."""
        with self._cursor_guard:
            cur: duckdb.DuckDBPyConnection = self.con.cursor()
        return cur

    def drop_thread_cursor(self) -> None:
        """Close the calling thread's read cursor (threads that end: the owner's socket threads)."""
        cur = getattr(self._tls, "cur", None)
        if cur is not None:
            del self._tls.cur
            with self._cursor_guard:
                if cur in self._cursors:
                    self._cursors.remove(cur)
            cur.close()

    def _q(self, sql: str, params: SqlParams = None) -> list[tuple[Any, ...]]:
        """Rows of a read query, in this process or through the owner (retried if the owner changes)."""
        while True:
            con = self._rcon()
            if self._remote is None:
                return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()
            rows = self._call_remote(lambda c: c.query(sql, params).rows())
            if rows is not None:
                return rows

    def _qa(self, sql: str, params: SqlParams = None) -> pa.Table:
        while True:
            con = self._rcon()
            if self._remote is None:
                return con.sql(sql, params=params).to_arrow_table() if params is not None else con.sql(sql).to_arrow_table()
            t = self._call_remote(lambda c: c.query(sql, params).table)
            if t is not None:
                return t

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self._share is not None:
            self._share.release()
            self._share = None
        for cur in self._cursors:
            try:
                cur.close()
            except duckdb.Error:
                pass
        if self._wcon is not None:
            self._wcon.close()
            self._wcon = None
        if self.con is not None:
            self.con.close()
        self.con = None

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A write transaction on this process's write connection, under the per-file lock (appends of
        other threads and of the processes this one serves wait for it)."""
        with self._lock:
            con = self._writable()
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            else:
                con.execute("COMMIT")

    @contextmanager
    def memory_limit(self, mb: int) -> Iterator[None]:
        """Cap DuckDB's buffer pool while the block runs (owner only). DuckDB defaults to 80% of RAM and
        never gives pages back on its own: measured here, an ingest's peak RSS grew from 1.2 GB (10^5
        traces) to 2.0 GB (10^6) without a cap. The previous limit is restored afterwards."""
        if self._remote is not None or self.con is None:
            yield
            return
        con = self.con
        before = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        con.execute(f"SET memory_limit = '{int(mb)}MB'")
        try:
            yield
        finally:
            if self.con is not None:
                self.con.execute(f"SET memory_limit = '{before}'")

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
        self._project(con, base, new, new_names.select(["node", "name"]))
        result.first_seq, result.last_seq = base + 1, base + n_new
        if n_new <= 10_000:
            result.event_ids = new_ids.to_pylist()
        return result

    # Projections: one code path used both incrementally (over the events after ``after_seq``) and on
    # rebuild (``after_seq=0`` over emptied tables), so the two cannot drift apart. Everything is keyed
    # by node id (:func:`node_id`, migration 003).
    @staticmethod
    def _project(con: duckdb.DuckDBPyConnection, after_seq: int, new: pa.Table | None = None,
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
                DuckDBEventStore._project_names(con)
            elif new_names.num_rows:
                con.register("_names", new_names)
                try:
                    con.execute("INSERT INTO entity_names SELECT node, name FROM _names")
                finally:
                    con.unregister("_names")
            updated = DuckDBEventStore._project_entities(con, new)
            DuckDBEventStore._project_lineage(con, updated)
        finally:
            con.unregister("_new_events")

    @staticmethod
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
                self._project(con, 0)
        return self.projection_counts()

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
