"""SIGKILL mid-ingest, then re-run: every record ends up ingested exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = r"""
import sys
from pathlib import Path
from flywheel.artifacts import ArtifactStore
from flywheel.config import load_config
from flywheel.ingest import ingest_paths
import flywheel.ingest.pipeline as pl
import flywheel.ingest.worker as wk
from flywheel.store import EventStore
pl.PROCESS_MIN_BYTES = 0
real_init = wk.ProcessBatches.__init__
def track(self, *a, **k):
    real_init(self, *a, **k)
    with open(sys.argv[1] + ".pids", "a") as f:
        f.write(f"{self._proc.pid}\n")
wk.ProcessBatches.__init__ = track
cfg = load_config(overrides={"home": sys.argv[1], "ingest": {"batch_size": 500, "workers": int(sys.argv[3])}})
cfg.ensure_home()
with EventStore(cfg.warehouse) as s:
    r = ingest_paths(cfg, s, ArtifactStore(cfg.artifacts_dir), [Path(sys.argv[2])])
print("DONE", r.ingested, r.duplicates, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2], ids=["thread", "2-worker-processes"])
def test_sigkill_then_rerun_is_exactly_once(tmp_path, workers):
    """With worker processes, the killed parent's children must also go (EPIPE on their next write)."""
    n = 12_000
    f = tmp_path / "t.jsonl"
    with open(f, "w") as out:
        for i in range(n):
            fail = i % 3 == 0
            out.write(json.dumps({
                "trace_id": f"c-{i}", "timestamp": "2026-11-02T09:00:00Z", "model": "m",
                "messages": [{"role": "user", "content": f"q{i % 50}"}, {"role": "assistant", "content": "a"}],
                "outcome": {"status": "failure" if fail else "success"}}) + "\n")
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(home), str(f), str(workers)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # kill once some batches are committed (the warehouse WAL grows) but before the end
    wal = home / "warehouse.duckdb.wal"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if wal.exists() and wal.stat().st_size > 200_000:
            break
        time.sleep(0.05)
    killed = p.poll() is None
    if killed:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()
    pids_file = tmp_path / "home.pids"
    pids = [int(x) for x in pids_file.read_text().split()] if pids_file.exists() else []
    assert len(pids) == workers or not killed
    deadline = time.time() + 60
    while any(_alive(x) for x in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(x) for x in pids), "a worker outlived its killed parent"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(home), str(f), str(workers)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from flywheel.store import EventStore

    with EventStore(home / "warehouse.duckdb") as s:
        rows = s.con.execute(
            "SELECT count(*), count(DISTINCT stream) FROM events WHERE type = 'trace.ingested'").fetchall()[0]
        assert rows == (n, n)
        occ = s.con.execute(
            "SELECT sum(CAST(json_extract(state, '$.occurrences') AS BIGINT)) FROM entities WHERE kind = 'failure'"
        ).fetchall()[0][0]
        assert occ == n // 3
        assert s.con.execute("SELECT count(*) FROM events WHERE type = 'ingest.completed'").fetchall()[0][0] == 1
    ingested, dups = map(int, out.stdout.split()[1:3])
    assert ingested + dups == n and (dups > 0 or not killed)
