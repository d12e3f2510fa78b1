"""The embedded store shared between the processes of one machine (flywheel/store/share.py): what a
client does when the owner is slow, gone or not who it should be, and how a lock conflict that DuckDB
reports without naming its holder is read."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import duckdb
import pyarrow as pa
import pytest

from flywheel.store import EventStore, NewEvent, StoreError, StoreUnavailableError
from flywheel.store import local_connection as store_mod
from flywheel.store import share as store_share
from flywheel.store.share import Client, OwnerGone, _recv, _send, _to_ipc, socket_path


def _fake_owner(path: str, slow_sql: str, delay_s: float) -> threading.Thread:
    """An owner that answers ping, and answers each query with its own SQL text as one row, the query
    ``slow_sql`` only after ``delay_s``."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            while (msg := _recv(conn)) is not None:
                header, _body = msg
                if header["op"] == "ping":
                    _send(conn, {"ok": True, "pid": os.getpid()})
                    continue
                if header["sql"] == slow_sql:
                    time.sleep(delay_s)
                try:
                    _send(conn, {"ok": True}, _to_ipc(pa.table({"sql": [header["sql"]]})))
                except OSError:  # the client hung up
                    return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_request_that_timed_out_never_hands_its_late_reply_to_the_next_request(tmp_path, monkeypatch):
    """The first query times out; its answer arrives later. The connection must not be used again: the
    second query used to read the first one's answer (and every reply after was one request late)."""
    monkeypatch.setattr(store_share, "REQUEST_TIMEOUT_S", 0.3)
    path = str(tmp_path / "owner.sock")
    owner = _fake_owner(path, "SELECT 'first'", delay_s=0.8)
    client = Client.connect(path)
    assert client is not None
    with pytest.raises(StoreUnavailableError, match="did not answer"):
        client.query("SELECT 'first'")
    time.sleep(0.8)  # the late answer is in the socket by now
    with pytest.raises(OwnerGone):  # the store re-attaches on OwnerGone: a fresh connection
        client.query("SELECT 'second'")
    owner.join(5)


def test_an_owner_lost_during_a_long_request_is_taken_over_not_given_up(tmp_path):
    """The owner went away under a request that had run longer than open_timeout_s: the store must try
    to take the file over (the deadline counts from when the owner is found gone), not give up at once."""
    store = EventStore(tmp_path / "w.duckdb", open_timeout_s=0.2)
    attached: list[float] = []

    class SlowThenGone:
        def request(self) -> None:
            time.sleep(0.4)  # longer than open_timeout_s
            raise OwnerGone("the owner closed the connection")

        def close(self) -> None:
            pass

    def reattach() -> None:  # stands for the takeover: this process owns the file again
        attached.append(time.monotonic())
        store._remote = None

    store._remote = SlowThenGone()
    store._reattach = reattach  # type: ignore[method-assign]
    try:
        assert store._call_remote(lambda c: c.request()) is None  # None: run it locally now
        assert len(attached) == 1
    finally:
        store._remote = None
        store.close()


@pytest.mark.parametrize(
    ("message", "holder"),
    [
        ('IO Error: Could not set lock on file "/x/w.duckdb": Conflicting lock is held in /usr/bin/python3.11 '
         "(PID 7026). See also https://duckdb.org/docs/stable/connect/concurrency", ("7026", "/usr/bin/python3.11")),
        ('IO Error: Could not set lock on file "/x/w.duckdb": Conflicting lock is held in /opt/My Apps/python '
         "(PID 8420) by user al. See also https://duckdb.org/docs", ("8420", "/opt/My Apps/python")),
        ('IO Error: Could not set lock on file "/x/w.duckdb": Conflicting lock is held in PID 7026. See also x',
         ("7026", "")),
        # the holder let go between DuckDB's two fcntl calls (PID 0): nothing after the colon
        ('IO Error: Could not set lock on file "/x/w.duckdb": . See also https://duckdb.org/docs', ("?", "")),
        ('IO Error: Could not set lock on file "/x/w.duckdb": No locks available. See also https://duckdb.org', None),
        ('IO Error: Cannot open file "/x/w.duckdb": Permission denied', None),
    ],
)
def test_lock_conflicts_are_read_in_every_form_duckdb_reports(message, holder):
    assert store_mod._lock_holder(message) == holder


def test_a_lock_conflict_reported_without_its_holder_is_waited_on_like_any_other(tmp_path, monkeypatch):
    """During a takeover the exiting owner can let go between DuckDB's two lock calls: the error then
    names no holder. It used to be raised as an unreadable file (a raw IOException; with a WAL present,
    "run flywheel warehouse recover"; under recover_wal, the live WAL set aside)."""
    path = tmp_path / "w.duckdb"
    with EventStore(path) as s:
        s.append("trace:a", NewEvent("trace.ingested", {"i": 1}, []))
    real_connect = duckdb.connect
    refused: list[str] = []

    def connect_once_refused(database: str = ":memory:", *args, **kwargs):
        if str(database) == str(path) and not refused:
            refused.append(str(database))
            raise duckdb.IOException(f'IO Error: Could not set lock on file "{path}": . See also '
                                     "https://duckdb.org/docs/stable/connect/concurrency")
        return real_connect(database, *args, **kwargs)

    monkeypatch.setattr(store_mod.duckdb, "connect", connect_once_refused)
    with EventStore(path, recover_wal=True) as s:
        assert refused and s.is_owner and s.last_seq() == 1 and s.recovered_wal is None


def test_the_socket_of_a_long_warehouse_path_does_not_depend_on_tmpdir(tmp_path, monkeypatch):
    """Owner and client must find the same socket even when started with different TMPDIRs (a scheduler,
    a systemd unit)."""
    deep = tmp_path.joinpath(*["d" * 30] * 4) / "warehouse.duckdb"
    places = []
    for tmp in ("a", "b"):
        (tmp_path / tmp).mkdir()
        monkeypatch.setenv("TMPDIR", str(tmp_path / tmp))
        monkeypatch.setattr("tempfile.tempdir", None)
        places.append(socket_path(deep))
    assert places[0] == places[1] and len(places[0].encode()) <= 107


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="needs root on Linux to run a fake owner as another user")
def test_a_client_refuses_an_owner_running_as_another_user(tmp_path):
    """Only the owner checked its peer's uid: a socket served by another user would have been handed
    this store's appends (and could answer reads with anything)."""
    path = str(tmp_path / "owner.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fake owner: listens as nobody (SO_PEERCRED reports the listener's uid then)
        try:
            os.close(release_w)
            os.setgid(65534)
            os.setuid(65534)
            srv.listen(4)
            os.read(release_r, 1)  # until the test is done
        finally:
            os._exit(0)
    srv.close()
    os.close(release_r)
    try:
        deadline = time.monotonic() + 10
        while True:  # until the child listens: connecting needs no accept
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(path)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the fake owner never listened"
                    time.sleep(0.02)
        with pytest.raises(StoreError, match="served by another user"):
            Client.connect(path)
    finally:
        os.close(release_w)
        os.waitpid(pid, 0)
