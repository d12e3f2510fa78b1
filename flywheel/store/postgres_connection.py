"""The PostgreSQL store's connection: :class:`PostgresConnection`, the base of
:class:`~flywheel.store.postgres.PostgresEventStore`.

Connecting (TLS checked when the server is not this machine: :func:`connect_options`), the schema
migrations, this connection's staging tables, and what keeps the store usable when the connection
breaks: a read or an append is tried again on a new connection (for up to
:data:`RECONNECT_TIMEOUT_S`), and an append whose COMMIT acknowledgement was lost is looked for
before it is tried again.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import duckdb
import psycopg

from flywheel.store.contract import (
    AppendResult,
    EventStore,
    SqlParams,
    StoreError,
    StoreUnavailableError,
    redact_url,
)
from flywheel.store.schema import migrations, split_sql

# Tries of a batch append that lost a race with another writer creating the same entity.
APPEND_ATTEMPTS = 5
# How long a store whose connection broke (a server restart, a failover, a network cut) keeps trying
# to reconnect before StoreUnavailableError: a fast restart of a small server takes ~1-2 s here, a
# failover to a standby typically well under 30 s.
RECONNECT_TIMEOUT_S = 30.0
# pg_advisory_xact_lock key of migrations (two int4: "flyw", purpose; appends and rebuilds take
# ("flyw", 1): flywheel.store.postgres).
_MIGRATE_LOCK = (0x666C7977, 2)


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


class PostgresConnection(EventStore):
    """The connection of a store in a PostgreSQL database (see the module docstring); its appends,
    projections and queries are :class:`~flywheel.store.postgres.PostgresEventStore`'s."""

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

    def _stage(self) -> None:
        """This connection's staging tables for the keys of a batch (temporary: no WAL, emptied at every
        commit), created outside any transaction so that a retried append finds them. The batch's keys
        go in by COPY: a Python list of 100k strings as a query parameter cost ~0.5 s to encode (psycopg
        quotes each element), the COPY ~20 ms."""
        for ddl in ('_fw_streams (s TEXT COLLATE "C" NOT NULL)', '_fw_known (s TEXT COLLATE "C" NOT NULL)', '_fw_names (node BIGINT NOT NULL, name TEXT COLLATE "C" NOT NULL)',
                    "_fw_entities (node BIGINT NOT NULL, last BIGINT NOT NULL, n BIGINT NOT NULL)",
                    '_fw_links (child BIGINT NOT NULL, parent BIGINT NOT NULL, seq BIGINT NOT NULL, parent_name TEXT COLLATE "C" NOT NULL)'):
            self.con.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {ddl} ON COMMIT DELETE ROWS")
