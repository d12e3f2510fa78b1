"""Killing the cycle mid-way and running it again: it finishes, with no duplicate events and no orphan
half-written artifacts.

The cycle runs in a child process (the embedded default: ephemeral Prefect, DuckDB, MLflow on SQLite,
all under one home) that reports its progress as JSON lines. The test SIGKILLs the child's whole
process group (the cycle and its temporary Prefect server: what a crashed machine or an OOM kill
does) at two points chosen from that progress, not from a timer: during rollouts, then, in the
second run, during training. A third run in the same home must complete; then the store and the
artifact directory are audited."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHA = re.compile(r"^[0-9a-f]{64}$")


def _artifact_refs(value, out: set[str]) -> set[str]:
    """Every artifact reference anywhere in an event payload: ``{"sha256", "ext", ...}`` (an
    :class:`~flywheel.artifacts.ArtifactRef`) or ``{"sha256", "row"}`` (a trace inside an ingested
    batch). Input files also carry a ``sha256`` (with a ``path``): they are not artifacts."""
    if isinstance(value, dict):
        sha = value.get("sha256")
        if isinstance(sha, str) and SHA.match(sha) and ("ext" in value or "row" in value):
            out.add(sha)
        for v in value.values():
            _artifact_refs(v, out)
    elif isinstance(value, list):
        for v in value:
            _artifact_refs(v, out)
    return out


def _in_rollouts(ev: dict) -> bool:
    info = ev.get("info") or {}
    return ev.get("stage") == "rollouts" and info.get("tasks_done", 0) >= 1


def _in_training(ev: dict) -> bool:
    info = ev.get("info") or {}
    return ev.get("stage") in ("train-sft", "train-grpo") and info.get("step", 0) >= 1


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory, it):
    root = tmp_path_factory.mktemp("kill")
    home = root / "home"
    traffic = it.bfcl_traffic(root / "traffic.jsonl")
    env = it.clean_env()  # no PREFECT_API_URL, no PREFECT_HOME: Prefect's database lives under the home
    kills = []
    for name, at in (("rollouts", _in_rollouts), ("training", _in_training)):
        cp = it.CycleProcess(home, [str(traffic)], env=env, log=root / f"kill-{name}.stderr")
        try:
            hit = cp.wait_until(lambda e, at=at: at(e) or e.get("kind") == "result", timeout_s=600)
            if hit is None:
                raise AssertionError(f"the cycle never reached {name} (exit {cp.proc.poll()}):\n{cp.stderr_tail()}")
            if hit.get("kind") == "result":
                kills.append((name, None))  # it finished before reaching that point: nothing to kill
                cp.finish()
                continue
            cp.kill()
            assert cp.proc.returncode == -9
            kills.append((name, hit))
        finally:
            cp.finish()
    result, cp = it.run_cycle_subprocess(home, [str(traffic)], env=env, timeout_s=900)
    return home, result, kills, cp


def test_the_rerun_finishes(killed_and_rerun):
    home, result, kills, _ = killed_and_rerun
    assert result["outcome"] in ("promoted", "refused", "insufficient_evidence"), result
    assert kills[0][1] is not None, "the first run was not killed during rollouts"
    # The killed runs left a started cycle behind; the re-run opened and closed its own.
    from flywheel.config import load_config
    from flywheel.store import open_store

    with open_store(load_config(overrides={"home": str(home)}, environ={}), read_only=True) as store:
        started = {e.stream for e in store.read(types=["cycle.started"])}
        completed = {e.stream for e in store.read(types=["cycle.completed"])}
    assert result["cycle"] in completed and completed <= started
    assert len(started) == 3 and len(completed) == 1 + sum(1 for _, hit in kills if hit is None)


def test_no_duplicate_events(killed_and_rerun):
    from flywheel.config import load_config
    from flywheel.store import open_store

    home, _, _, _ = killed_and_rerun
    with open_store(load_config(overrides={"home": str(home)}, environ={}), read_only=True) as store:
        assert store.check_integrity() == []
        dup_ids = store.con.execute(
            "SELECT event_id, count(*) FROM events GROUP BY event_id HAVING count(*) > 1").fetchall()
        dup_versions = store.con.execute(
            "SELECT stream, stream_version, count(*) FROM events GROUP BY ALL HAVING count(*) > 1").fetchall()
        published = Counter(e.stream for e in store.read(types=["rollouts.published"]))
        registered = Counter(e.entity_id for e in store.read(types=["model.registered"]))
        ingested = Counter(e.stream for e in store.read(types=["trace.ingested"]))
    assert dup_ids == [] and dup_versions == []
    assert published and all(n == 1 for n in published.values()), published
    assert registered and all(n == 1 for n in registered.values()), registered
    # The same traffic was ingested by three runs: each trace once.
    assert ingested and set(ingested.values()) == {1}


def test_no_orphan_or_corrupt_artifacts(killed_and_rerun):
    from flywheel.artifacts import ArtifactStore
    from flywheel.config import load_config
    from flywheel.store import open_store

    home, _, _, _ = killed_and_rerun
    cfg = load_config(overrides={"home": str(home)}, environ={})
    leftovers = [str(p) for p in cfg.artifacts_dir.rglob("*") if ".tmp-" in p.name]
    assert leftovers == [], f"half-written artifacts left behind: {leftovers}"
    arts = ArtifactStore(cfg.artifacts_dir)
    with open_store(cfg, read_only=True) as store:
        refs: set[str] = set()
        for e in store.read():
            _artifact_refs(e.payload, refs)
    assert refs, "no event references an artifact: the audit would prove nothing"
    for sha in sorted(refs):
        path = arts.verify(sha)  # raises on a missing or corrupted file
        assert Path(path).stat().st_size > 0
    # Every file under its final name is an artifact whose bytes hash to that name.
    for p in arts.objects.rglob("*"):
        if p.is_file():
            sha = p.name.split(".", 1)[0]
            assert SHA.match(sha), f"stray file in the artifact store: {p}"
            arts.verify(sha)

