"""A second process opening a locked warehouse gets one clear error naming the holder, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flywheel.store import EventStore, StoreLockedError

HOLDER = textwrap.dedent(
    """
    import sys, time
    from flywheel.store import EventStore
    s = EventStore(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes our stdin
    """
)
FLYWHEEL = Path(sys.executable).with_name("flywheel")


@pytest.fixture
def holder(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(home / "warehouse.duckdb")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield home, proc.pid
    proc.stdin.close()
    proc.wait(timeout=30)


def test_second_process_gets_store_locked_error_naming_the_pid(holder):
    home, pid = holder
    with pytest.raises(StoreLockedError) as e:
        EventStore(home / "warehouse.duckdb")
    msg = str(e.value)
    assert f"process {pid}" in msg and "warehouse export" in msg and f"kill {pid}" in msg
    assert "\n" not in msg
    # read-only access from another process is refused the same way (use the Parquet export)
    with pytest.raises(StoreLockedError):
        EventStore(home / "warehouse.duckdb", read_only=True)


@pytest.mark.parametrize("args", [["status"], ["events", "--json"]])
def test_cli_prints_one_line_and_exits_nonzero(holder, args, tmp_path):
    home, pid = holder
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(home), COLUMNS="400")
    r = subprocess.run([str(FLYWHEEL), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and f"process {pid}" in lines[0]
    assert r.stdout == ""
