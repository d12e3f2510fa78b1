"""The embedded store's file and connections: :class:`DuckDBConnection`, the base of
:class:`~flywheel.store.local.DuckDBEventStore`.

Opening the DuckDB file (its schema migrations, a write-ahead log DuckDB will not replay set aside on
request), or, when another flywheel process holds it, connecting to that owner
(:mod:`flywheel.store.share`) and re-attaching when it goes away; the lock and the in-memory head index
(:mod:`flywheel.store.index`) each file has in this process; the read cursors of each thread; the
write transaction.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import duckdb
import pyarrow as pa

from flywheel.store.contract import (
    EventStore,
    SqlParams,
    StoreError,
    StoreLockedError,
    StoreUnavailableError,
)
from flywheel.store.index import HeadIndex
from flywheel.store.schema import migrations, split_sql
from flywheel.store.share import Client, Owner, OwnerGone, ServedStore, socket_path

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



class DuckDBConnection(EventStore):
    """The embedded backend's file and connections (see the module docstring); its appends, projections
    and queries are :class:`~flywheel.store.local.DuckDBEventStore`'s. ``con`` is the DuckDB connection
    in the owning process, or a read-only stand-in (``execute``/``sql`` of SELECT statements) that
    forwards to the owner in the others."""

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
                # the store the owner answers clients with: one of this class that serves nobody
                store_class = type(self)
                self._share = Owner.register(self.path, lambda path: cast(ServedStore, store_class(path, serve=False)))
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
