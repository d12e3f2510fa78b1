"""SIGKILL mid-ingest, then re-run: every record ends up ingested exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
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
    r = ingest_paths(cfg, s, ArtifactStore(cfg.artifacts_dir), [Path(sys.argv[2])],
                     progress=lambda p: print("COMMITTED", p["records"], flush=True))
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
    err = tempfile.TemporaryFile()  # not a pipe: a chatty child must never block on a full one
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(home), str(f), str(workers)], env=env,
                         stdout=subprocess.PIPE, stderr=err, text=True)
    # Kill on the child's own progress, not after a time: once it reports its third committed batch
    # (of 24), so every run is killed mid-file with batches committed, on any machine. (Polling the
    # WAL size by the clock could miss a fast child's whole run and then test nothing.)
    committed = 0
    while committed < 3:
        line = p.stdout.readline()
        if not line:
            err.seek(0)
            raise AssertionError(f"the child ended before its third batch: {err.read()[-2000:]!r}")
        committed += line.startswith("COMMITTED ")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    err.close()
    pids_file = tmp_path / "home.pids"
    pids = [int(x) for x in pids_file.read_text().split()] if pids_file.exists() else []
    assert len(pids) == workers
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
    done = next(line for line in out.stdout.splitlines() if line.startswith("DONE "))
    ingested, dups = map(int, done.split()[1:3])
    assert ingested + dups == n and dups >= 3 * 500  # the three committed batches were not ingested twice
