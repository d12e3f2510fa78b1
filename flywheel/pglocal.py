"""A private, throwaway PostgreSQL server from the local server binaries (``initdb``, ``pg_ctl``).

For the tests and benchmarks of the PostgreSQL event store, and for trying team mode on one machine
without Docker::

    with LocalPostgres.start() as pg:
        store = EventStore(pg.url)

Guarantees
- The server listens on 127.0.0.1 only, on a free port, with a random password (scram-sha-256); its
  data directory is a fresh temporary directory, removed by :meth:`LocalPostgres.stop`.
- Run as root (CI containers), the server runs as an unprivileged user (``postgres`` if that account
  exists, else ``nobody``): PostgreSQL refuses to run as root.
- :meth:`LocalPostgres.start` returns only once the server accepts connections (``pg_ctl -w``), or
  raises :class:`PostgresUnavailable` with the server's log.

Not guaranteed: durability settings are PostgreSQL's defaults (fsync on); nothing here is tuned for
production use.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries here, or the server did not start."""


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: the PATH first, then Debian's versioned dirs."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK) and os.access(os.path.join(d, "pg_ctl"), os.X_OK):
            return Path(d)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unprivileged_ids() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    import pwd

    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return pw.pw_uid, pw.pw_gid
    raise PostgresUnavailable("running as root and no unprivileged account (postgres, nobody) to run the server as")


@dataclass
class LocalPostgres:
    bin_dir: Path
    root: Path
    port: int
    password: str
    user: str = "flywheel"
    database: str = "flywheel"

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    def url_for(self, database: str) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @classmethod
    def start(cls, *, settings: dict[str, str] | None = None, timeout_s: int = 120) -> LocalPostgres:
        """initdb a fresh cluster in a temporary directory and start it (see the module docstring)."""
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin")
        ids = _unprivileged_ids()
        root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        password = secrets.token_hex(16)
        pg = cls(bin_dir, root, _free_port(), password)
        pwfile = root / "pw"
        pwfile.write_text(password + "\n")
        log = root / "server.log"
        log.touch()
        if ids:
            for p in (root, pwfile, log):
                os.chown(p, *ids)

        def demote() -> None:  # runs in the child between fork and exec
            if ids:
                os.setgid(ids[1])
                os.setuid(ids[0])

        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")

        def run(argv: list[str]) -> None:
            r = subprocess.run(argv, env=env, cwd=root, preexec_fn=demote, capture_output=True, text=True,
                               timeout=timeout_s)
            if r.returncode != 0:
                pg._cleanup()
                raise PostgresUnavailable(f"{Path(argv[0]).name} failed ({r.returncode}): {r.stderr.strip()[-2000:]}\n"
                                          f"{pg._log_tail()}")

        run([str(bin_dir / "initdb"), "-D", str(pg.data_dir), "-U", pg.user, "--pwfile", str(pwfile),
             "--auth", "scram-sha-256", "-E", "UTF8", "--no-instructions"])
        conf = {"listen_addresses": "'127.0.0.1'", "port": str(pg.port), "unix_socket_directories": "''",
                "max_connections": "100", "shared_buffers": "128MB", "logging_collector": "off"}
        conf.update(settings or {})
        with open(pg.data_dir / "postgresql.auto.conf", "a") as f:
            for k, v in conf.items():
                f.write(f"{k} = {v}\n")
        run([str(bin_dir / "pg_ctl"), "-D", str(pg.data_dir), "-l", str(log), "-w", "-t", str(timeout_s), "start"])
        try:
            pg._createdb(pg.database)
        except BaseException:
            pg.stop()
            raise
        return pg

    def _createdb(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{name}"')

    def create_database(self, name: str) -> str:
        """A fresh database on this server; returns its URL."""
        self._createdb(name)
        return self.url_for(name)

    def _log_tail(self) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess:
        ids = _unprivileged_ids()

        def demote() -> None:
            if ids:
                os.setgid(ids[1])
                os.setuid(ids[0])

        return subprocess.run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args],
                              preexec_fn=demote, capture_output=True, timeout=120)

    def restart(self) -> None:
        """Restart the server (fast shutdown: every client connection is cut), on the same port and
        data; returns once it accepts connections again."""
        r = self._pg_ctl("-l", str(self.root / "server.log"), "-m", "fast", "-w", "restart")
        if r.returncode != 0:
            raise PostgresUnavailable(f"pg_ctl restart failed ({r.returncode}): {r.stderr.decode()[-2000:]}\n"
                                      f"{self._log_tail()}")

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its directory."""
        if self.data_dir.exists():
            self._pg_ctl("-m", "fast", "-w", "stop")
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
