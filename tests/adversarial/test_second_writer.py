"""A warehouse file held by a process that does not share it: one clear error naming the holder, after a
bounded wait, never a traceback. (Flywheel processes share the file: tests/adversarial/
test_store_concurrent_access.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flywheel.store import EventStore, StoreLockedError

# A DuckDB program that is not a flywheel store (the duckdb CLI, a notebook): it holds the file lock
# and answers nobody.
FOREIGN_HOLDER = textwrap.dedent(
    """
    import sys, duckdb
    con = duckdb.connect(sys.argv[1])
    con.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    print("ready", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes our stdin
    """
)
FLYWHEEL = Path(sys.executable).with_name("flywheel")


@pytest.fixture
def holder(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", FOREIGN_HOLDER, str(home / "warehouse.duckdb")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield home, proc.pid
    proc.stdin.close()
    proc.wait(timeout=30)


def test_foreign_holder_gets_store_locked_error_naming_the_pid_after_a_bounded_wait(holder):
    home, pid = holder
    t0 = time.monotonic()
    with pytest.raises(StoreLockedError) as e:
        EventStore(home / "warehouse.duckdb", open_timeout_s=1.0)
    assert time.monotonic() - t0 >= 1.0  # it waited for the holder before giving up
    msg = str(e.value)
    assert f"process {pid}" in msg and f"kill {pid}" in msg and "does not share it" in msg
    assert "\n" not in msg
    with pytest.raises(StoreLockedError):
        EventStore(home / "warehouse.duckdb", read_only=True, open_timeout_s=0.5)


@pytest.mark.parametrize("args", [["status"], ["events", "--json"]])
def test_cli_prints_one_line_and_exits_nonzero(holder, args, tmp_path):
    home, pid = holder
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(home), COLUMNS="400", FLYWHEEL_STORE__OPEN_TIMEOUT_S="1")
    r = subprocess.run([str(FLYWHEEL), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and f"process {pid}" in lines[0]
    assert r.stdout == ""
