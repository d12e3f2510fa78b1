"""Two ingests at once into one store (embedded: the second through the first's process; PostgreSQL:
two clients of the server), on files whose failing traces are the same failure under different trace
ids, in small batches so that their appends interleave. Each failure's state is read, merged and
appended by both: without the versions an append builds on (expected_versions) one ingest's update
silently overwrote the other's (occurrences lost). Every trace is recorded once and the failure counts
every occurrence."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flywheel.store import EventStore

CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from flywheel.artifacts import ArtifactStore
    from flywheel.config import load_config
    from flywheel.ingest import ingest_paths
    from flywheel.store import EventStore
    home, location, path = sys.argv[1:4]
    cfg = load_config(overrides={"home": home, "ingest": {"batch_size": 4, "workers": 0}}, environ={})
    store = EventStore(location)
    print("ready", flush=True)
    sys.stdin.readline()  # both start together
    s = ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [Path(path)])
    print("done", s.ingested, s.new_failures, s.updated_failures, flush=True)
    store.close()
    """
)
FIX = Path(__file__).parents[1] / "fixtures" / "traces" / "kinds.jsonl"
N = 40


def _file(path: Path, tag: str) -> Path:
    rec = json.loads(FIX.read_text().splitlines()[0])  # one failing record: every copy is the same failure
    lines = []
    for i in range(N):
        r = dict(rec, trace_id=f"{tag}-{i}", timestamp=f"2026-11-0{2 + i % 7}T09:00:00Z")
        lines.append(json.dumps(r))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["duckdb", "postgresql"])
def test_two_concurrent_ingests_count_every_occurrence_once(backend, tmp_path, request):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    location = str(home / "warehouse.duckdb") if backend == "duckdb" else request.getfixturevalue("pg_url")
    EventStore(location).close()  # schema in place; on DuckDB the first child then owns the file
    files = [_file(tmp_path / f"{t}.jsonl", t) for t in ("a", "b")]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(home), location, str(f)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert out.split()[:2] == ["done", str(N)]
    with EventStore(location) as s:
        assert s.check_integrity() == []
        traces = s.read(stream="trace:*")
        assert len(traces) == len({e.stream for e in traces}) == 2 * N
        failures = s.entities("failure")
        assert len(failures) == 1
        state = failures[0]["state"]
        assert state["occurrences"] == 2 * N, state["occurrences"]
        versions = [e.stream_version for e in s.read(stream=failures[0]["entity_id"])]
        assert versions == list(range(1, len(versions) + 1))
