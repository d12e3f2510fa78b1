"""Team mode on PostgreSQL, as a team runs it (issue 31, finding 8): the connection is encrypted and its
certificate checked when the server is not on this machine, a server restart is survived, an append
whose COMMIT acknowledgement was lost is not reported as failed (nor as a conflict with itself), and
the password never reaches a printed URL.

The restart and lost-acknowledgement tests use a server of their own (started here on 127.0.0.1),
so restarting it cannot disturb the session's shared one."""

from __future__ import annotations

import json

import psycopg
import pytest
from typer.testing import CliRunner

from flywheel.store import EventStore, NewEvent, redact_url


@pytest.mark.parametrize("url, secret", [
    ("postgresql://flywheel:s3cret@db.example:5432/flywheel", "s3cret"),
    ("postgresql://flywheel@db.example/flywheel?password=s3cret&application_name=x", "s3cret"),
    ("postgresql://flywheel@db.example/flywheel?sslmode=require&PassWord=s3cret", "s3cret"),
    ("postgresql://flywheel:p@ss-w0rd@db.example/flywheel", "ss-w0rd"),
    ("postgresql://flywheel:p%40ss-w0rd@db.example/flywheel", "ss-w0rd"),
    ("postgresql://flywheel:pa/ss?wd@db.example/flywheel", "ss?wd"),
    ("postgresql://flywheel@db.example/flywheel?sslpassword=keypass", "keypass"),
])
def test_redact_url_masks_every_password_form_of_a_connection_string(url, secret):
    """Finding 8: `?password=` stayed visible, and so did the part of a password after an `@`."""
    shown = redact_url(url)
    assert secret not in shown
    assert "db.example" in shown and "***" in shown  # still says where the store is


def test_redact_url_leaves_a_url_without_a_password_and_a_file_path_alone():
    assert redact_url("postgresql://flywheel@db.example:5432/flywheel") == "postgresql://flywheel@db.example:5432/flywheel"
    assert redact_url("/home/x/.flywheel/warehouse.duckdb") == "/home/x/.flywheel/warehouse.duckdb"


def test_flywheel_config_prints_the_store_url_masked(home, tmp_path, monkeypatch):
    """Finding 8: `flywheel config` printed store.url as configured, password included."""
    from flywheel.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_STORE__URL", "postgresql://flywheel:s3cret@db.example/flywheel?password=other")
    runner = CliRunner()
    r = runner.invoke(app, ["config", "--json"])
    assert r.exit_code == 0, r.output
    assert "s3cret" not in r.stdout and "other" not in r.stdout
    assert "db.example" in json.loads(r.stdout)["store"]["url"]
    r = runner.invoke(app, ["config"])
    assert r.exit_code == 0 and "s3cret" not in r.stdout and "other" not in r.stdout


def test_a_remote_host_gets_verify_full_a_local_one_is_left_as_libpq_has_it(pg_url):
    """Finding 8: without sslmode libpq falls back to plaintext and checks no certificate. A host that
    is not this machine now needs verify-full: connecting by a remote name to a server without TLS
    (here the local one, reached through ``hostaddr``) is refused instead of sent in clear; the URL
    can still say otherwise, and loopback stays as it was."""
    from flywheel.store import StoreUnavailableError

    port = psycopg.conninfo.conninfo_to_dict(pg_url)["port"]
    remote = pg_url.replace(f"127.0.0.1:{port}", f"db.example:{port}") + "?hostaddr=127.0.0.1"
    with pytest.raises(StoreUnavailableError, match="SSL|ssl"):
        EventStore(remote)
    with EventStore(remote + "&sslmode=disable") as s:  # an explicit choice in the URL wins
        assert s.last_seq() == 0
    with EventStore(pg_url) as s:  # loopback: libpq's default, no certificate needed
        assert s.last_seq() == 0
    with EventStore(pg_url.replace("127.0.0.1", "localhost")) as s:
        assert s.last_seq() == 0


@pytest.fixture
def own_server():
    from flywheel.pglocal import LocalPostgres, find_bin_dir

    if find_bin_dir() is None:
        pytest.skip("no PostgreSQL server binaries")
    pg = LocalPostgres.start()
    yield pg
    pg.stop()


def test_the_store_reconnects_after_a_server_restart(own_server):
    """Finding 8: after a restart of the server every later call of an open store failed."""
    with EventStore(own_server.url) as s:
        s.append("trace:t1", NewEvent("trace.ingested", {"i": 1}, ["ingest:b"]))
        own_server.restart()
        assert [e.stream for e in s.read()] == ["trace:t1"]  # a read reconnects
        own_server.restart()
        r = s.append("trace:t2", NewEvent("trace.ingested", {"i": 2}, ["ingest:b"]), expected_version=0)
        assert r.appended == 1 and r.first_seq == 2  # and so does an append (the first statement failed)
        import pyarrow as pa

        from flywheel.store import BATCH_SCHEMA, canonical_json
        own_server.restart()
        batch = pa.table({"stream": [f"trace:b{i}" for i in range(100)], "type": ["trace.ingested"] * 100,
                          "payload": [canonical_json({"i": i}) for i in range(100)],
                          "causation": [["ingest:b"]] * 100}, schema=BATCH_SCHEMA)
        assert s.append_batch(batch).appended == 100  # the batch path's staging tables are made again
        assert s.last_seq() == 102 and s.check_integrity() == []


@pytest.mark.parametrize("n", [1, 100])
def test_an_append_whose_commit_acknowledgement_is_lost_is_reported_as_appended(own_server, monkeypatch, n):
    """Finding 8: the server committed, the client lost the connection before the acknowledgement.
    The append was reported as failed, and retried with its expected version it raised a conflict with
    its own write. Now the store reconnects, finds its events (deterministic ids) at the seqs it gave
    them, and reports the append as done; nothing is appended twice."""
    import pyarrow as pa

    from flywheel.store import BATCH_SCHEMA, canonical_json

    with EventStore(own_server.url) as s:
        real_exit = psycopg.Transaction.__exit__
        lost = []

        def commit_then_lose_the_connection(self, exc_type, exc, tb):
            out = real_exit(self, exc_type, exc, tb)  # the COMMIT reaches the server and is applied
            if exc_type is None and not lost and self._conn is s.con:
                lost.append(True)
                s.con.close()  # ... and the acknowledgement never arrives
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return out

        monkeypatch.setattr(psycopg.Transaction, "__exit__", commit_then_lose_the_connection)
        streams = [f"trace:t{i}" for i in range(n)]
        batch = pa.table({"stream": streams, "type": ["trace.ingested"] * n,
                          "payload": [canonical_json({"i": i}) for i in range(n)], "causation": [["ingest:b"]] * n},
                         schema=BATCH_SCHEMA)
        r = s.append_batch(batch, expected_versions=dict.fromkeys(streams, 0))
        assert lost, "the test did not lose an acknowledgement"
        assert (r.appended, r.already_recorded, r.first_seq, r.last_seq) == (n, 0, 1, n)
        monkeypatch.undo()
        assert s.last_seq() == n and s.check_integrity() == []
