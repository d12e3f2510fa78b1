"""The ingest stage end to end on small fixtures: each format, each failure kind, dedup, quarantine."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flywheel.artifacts import ArtifactStore, load_traces
from flywheel.ingest import (
    IngestRefused,
    ingest_paths,
    list_quarantine,
    replay_quarantine,
    show_quarantine,
)
from flywheel.store import canonical_json

FIX = Path(__file__).parents[1] / "fixtures" / "traces"


@pytest.fixture
def arts(cfg):
    return ArtifactStore(cfg.artifacts_dir)


def _failures(store):
    return {e["entity_id"]: e["state"] for e in store.entities("failure")}


def _good(tid="g-1", **kw):
    t = {"trace_id": tid, "timestamp": "2026-11-02T09:00:00Z", "model": "m",
         "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
         "outcome": {"status": "success"}}
    t.update(kw)
    return t


def _write(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def test_openai_examples_every_kind_and_payload_contract(cfg, store, arts):
    s = ingest_paths(cfg, store, arts, [FIX / "examples.jsonl", FIX / "kinds.jsonl"])
    assert s.read == 16 and s.ingested == 16 and s.quarantined == 0
    assert s.successes == 2
    kinds = {k for st in _failures(store).values() for k in st["kinds"]}
    assert kinds >= {"invalid_json", "unknown_tool", "missing_required_arg", "wrong_arg_type", "wrong_arg_value",
                     "no_tool_call", "extra_tool_call", "test_failure", "runtime_exception", "negative_feedback",
                     "other"}
    # k-dup-a differs from k-no-call only by whitespace/case: one failure, two occurrences
    nc = [st for st in _failures(store).values() if st["kinds"] == ["no_tool_call"]]
    assert len(nc) == 1 and nc[0]["occurrences"] == 2 and sorted(nc[0]["trace_ids"]) == ["k-dup-a", "k-no-call"]
    f = nc[0]
    assert f["bad_answer"]["role"] == "assistant" and f["messages"][-1]["role"] == "user"
    assert f["correction"]["tool_calls"][0]["name"] == "get_weather" and f["source"] == "openai"
    assert f["entity_id"].startswith("failure:") and len(f["entity_id"]) == len("failure:") + 16
    assert f["content_hash"].startswith(f["entity_id"].split(":")[1])
    # causation of a failure = its traces
    assert {p for p, _ in store.lineage(f["entity_id"])} >= {"trace:k-dup-a", "trace:k-no-call"}
    # success traces are recorded with a reference to the full redacted trace
    ok = store.entity("trace:ex-005")["state"]
    assert ok["status"] == "success" and ok["kinds"] == [] and ok["failure_id"] is None
    full = load_traces(arts, [ok])[0]
    assert full["messages"][-1]["content"].startswith("It is 68") and full["tools"][0]["function"]["name"] == "get_weather"
    # event payloads are canonical JSON (event ids are hashes of them)
    for e in store.read(types=["trace.ingested"]):
        raw = store.con.execute("SELECT payload::VARCHAR FROM events WHERE seq = ?", [e.seq]).fetchall()[0][0]
        assert raw == canonical_json(json.loads(raw))


def test_reingest_appends_nothing_and_new_occurrences_update_the_failure(cfg, store, arts, tmp_path):
    ingest_paths(cfg, store, arts, [FIX / "kinds.jsonl"])
    n = store.last_seq()
    again = ingest_paths(cfg, store, arts, [FIX / "kinds.jsonl"])
    assert store.last_seq() == n and again.events_appended == 0 and again.duplicates == 9 and again.ingested == 0
    # a later file with the same failing content under a new id adds an occurrence to the same failure
    rec = json.loads((FIX / "kinds.jsonl").read_text().splitlines()[0])
    rec["trace_id"], rec["timestamp"] = "k-no-call-later", "2026-11-03T09:00:00Z"
    s = ingest_paths(cfg, store, arts, [_write(tmp_path / "later.jsonl", [rec])])
    assert s.new_failures == 0 and s.updated_failures == 1
    f = [st for st in _failures(store).values() if "k-no-call-later" in st["trace_ids"]][0]
    assert f["occurrences"] == 3 and f["last_seen"] == "2026-11-03T09:00:00Z" and f["first_seen"] == "2026-11-02T09:00:00Z"
    assert len(store.read(stream=f["entity_id"])) == 2


def test_otel_new_and_legacy_conventions(cfg, store, arts):
    s = ingest_paths(cfg, store, arts, [FIX / "otel.jsonl"])
    assert s.ingested == 2 and s.quarantined_by_reason == {"otel_no_genai": 1}
    t1 = store.entity("trace:5b8efff798038103d269b633813fc60c")["state"]
    assert t1["source"] == "otel" and t1["status"] == "failure" and t1["model"] == "gpt-4o"
    assert "missing_required_arg" in t1["kinds"] and "runtime_exception" in t1["kinds"]
    full = load_traces(arts, [t1])[0]
    assert full["tools"][0]["function"]["name"] == "get_weather"
    assert json.loads(full["messages"][-1]["tool_calls"][0]["function"]["arguments"]) == {"unit": "celsius"}
    assert full["outcome"]["error"] == "ValueError: city is required"
    assert full["timestamp"].startswith("2026-11-02T")  # earliest span start (the root)
    t2 = load_traces(arts, [store.entity("trace:6c9f00a8a9149214e37ac744924fd71d")["state"]])[0]
    assert [m["role"] for m in t2["messages"]] == ["user", "assistant"] and t2["outcome"]["status"] == "success"


def test_bfcl_replay_adapter(cfg, store, arts):
    s = ingest_paths(cfg, store, arts, [FIX / "bfcl.jsonl"])
    assert s.read == 7 and s.ingested == 6 and s.quarantined_by_reason == {"bfcl_unknown_id": 1}
    states = [e["state"] for e in store.entities("trace")]
    by_src = {}
    for st in states:
        by_src.setdefault(st["source_id"], []).append(st)
    assert {st["status"] for st in by_src["simple_python_0"]} == {"success", "failure"}
    assert by_src["multiple_0"][0]["status"] == "success" and by_src["parallel_0"][0]["status"] == "success"
    assert by_src["simple_python_1"][0]["kinds"] == ["no_tool_call"]
    assert store.entity("trace:bfcl-given-id")["state"]["status"] == "failure"
    fail = [f for f in _failures(store).values() if f["source_id"] == "simple_python_0"][0]
    assert fail["kinds"] == ["wrong_arg_value"]
    assert fail["correction"]["tool_calls"][0]["arguments"]["height"] == {"one_of": [5], "optional": False}
    assert fail["tools"][0]["function"]["parameters"]["type"] == "object"
    assert fail["bad_answer"]["tool_calls"][0]["function"]["name"] == "calculate_triangle_area"


def test_malformed_records_are_quarantined_and_neighbours_kept(cfg, store, arts, tmp_path):
    big = json.dumps(_good("g-big", messages=[{"role": "user", "content": "x" * (10 * 1024 * 1024)},
                                               {"role": "assistant", "content": "ok"}])).encode()
    lines = [
        _good("g-1"),
        b'{"trace_id": "t-trunc", "timestamp": "2026-11-02T09:00:00Z", "messa',
        _good("g-2"),
        {**_good("t-types"), "messages": "not a list"},
        {k: v for k, v in _good("t-missing").items() if k != "outcome"},
        b'{"trace_id": "t-utf8", "model": "\xff\xfe"}',
        _good("t-ts", timestamp="yesterday"),
        _good("t-old", timestamp="1999-01-01T00:00:00Z"),
        _good("t-role", messages=[{"role": "robot", "content": "x"}]),
        big,
        b"[1, 2]",
        b"",
        _good("g-3"),
    ]
    s = ingest_paths(cfg, store, arts, [_write(tmp_path / "bad.jsonl", lines)])
    assert s.quarantined_by_reason == {"invalid_json": 1, "wrong_type": 1, "missing_field": 1, "invalid_utf8": 1,
                                       "bad_timestamp": 1, "timestamp_out_of_range": 1, "schema": 1, "not_an_object": 1}
    assert s.ingested == 4 and s.read == 12  # blank line not a record; the 10 MB line is ingested
    for tid in ("g-1", "g-2", "g-3", "g-big"):
        assert store.entity(f"trace:{tid}") is not None
    (q,) = list_quarantine(store)
    rows = show_quarantine(store, arts, q["stream"])
    by_line = {r["line"]: r for r in rows}
    assert by_line[2]["reason"] == "invalid_json" and "truncated" in by_line[2]["detail"]
    assert by_line[6]["raw"].startswith('{"trace_id": "t-utf8"') and "\\xff" in by_line[6]["raw"]
    assert by_line[4]["detail"].startswith("messages:")
    path = arts.find(q["artifact"])
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_line_over_max_bytes_empty_file_and_cut_gzip(cfg, store, arts, tmp_path):
    cfg.ingest.max_line_bytes = 1024 * 1024
    lines = [_good("a"), json.dumps(_good("huge", model="x" * (2 * 1024 * 1024))).encode(), _good("b")]
    s = ingest_paths(cfg, store, arts, [_write(tmp_path / "long.jsonl", lines)])
    assert s.ingested == 2 and s.quarantined_by_reason == {"line_too_long": 1}
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    s = ingest_paths(cfg, store, arts, [empty])
    assert (s.read, s.ingested, s.quarantined) == (0, 0, 0)
    payload = b"".join(json.dumps(_good(f"z-{i}", model="y" * 200)).encode() + b"\n" for i in range(2000))
    gz = gzip.compress(payload)
    cut = tmp_path / "cut.jsonl"  # no .gz suffix: detected by magic bytes
    cut.write_bytes(gz[: len(gz) // 2])
    s = ingest_paths(cfg, store, arts, [cut])
    assert s.quarantined_by_reason == {"truncated_file": 1} and 0 < s.ingested < 2000
    assert s.files[0]["cut_short"]
    ok = tmp_path / "ok.jsonl.gz"
    ok.write_bytes(gz)
    s = ingest_paths(cfg, store, arts, [ok])
    assert s.ingested + s.duplicates == 2000 and s.quarantined == 0


def test_gx_suite_refuses_a_bad_batch_and_commits_nothing_of_it(cfg, store, arts, tmp_path, monkeypatch):
    import flywheel.ingest.prepare as pl

    # Simulate a validator bug letting through a trace the batch suite must catch (an absurd timestamp
    # and message count): the suite is the second line of defence.
    real = pl.validate

    def lenient(rec, limits):
        prob, dt = real(rec, limits)
        if prob and prob[0] in ("timestamp_out_of_range", "too_many_messages"):
            from flywheel.ingest.validate import parse_timestamp

            return None, parse_timestamp(rec["timestamp"])
        return prob, dt

    monkeypatch.setattr(pl, "validate", lenient)
    f = _write(tmp_path / "x.jsonl", [_good("fine"), _good("ancient", timestamp="1990-01-01T00:00:00Z")])
    with pytest.raises(IngestRefused) as ei:
        ingest_paths(cfg, store, arts, [f])
    assert any(r["column"] == "timestamp_epoch" for r in ei.value.report)
    assert store.entity("trace:fine") is None and store.last_seq() == 0


def test_replay_quarantine_after_a_config_fix(cfg, store, arts, tmp_path):
    cfg.ingest.max_messages = 2
    long = _good("three", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                    {"role": "user", "content": "c"}])
    f = _write(tmp_path / "q.jsonl", [_good("one"), long])
    s = ingest_paths(cfg, store, arts, [f])
    assert s.quarantined_by_reason == {"too_many_messages": 1}
    assert replay_quarantine(cfg, store, arts).ingested == 0  # nothing fixed yet: still quarantined
    cfg.ingest.max_messages = 10
    r = replay_quarantine(cfg, store, arts)
    assert r.ingested == 1 and store.entity("trace:three") is not None
    (q,) = list_quarantine(store)
    assert q["remaining"] == 0
    n = store.last_seq()
    assert replay_quarantine(cfg, store, arts).events_appended == 0 and store.last_seq() == n
    assert "quarantine:" in str(store.lineage("trace:three"))


def test_cli_ingest_json_and_quarantine_commands(cfg, tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app

    f = _write(tmp_path / "c.jsonl", [_good("c-1"), b"{broken"])
    r = CliRunner().invoke(app, ["ingest", str(f), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ingested"] == 1 and d["quarantined_by_reason"] == {"invalid_json": 1}
    r = CliRunner().invoke(app, ["quarantine", "list", "--json"])
    (q,) = json.loads(r.stdout)
    r = CliRunner().invoke(app, ["quarantine", "show", q["stream"].split(":")[1][:10], "--json"])
    assert json.loads(r.stdout)[0]["raw"] == "{broken"
    r = CliRunner().invoke(app, ["ingest", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 1 and "no such file" in " ".join(r.output.split())



# -- worker processes ------------------------------------------------------------------------------
def _mixed_lines() -> list:
    """Every path a record can take, repeated so that batches of 7 cut through all of them."""
    kinds = [json.loads(x) for x in (FIX / "kinds.jsonl").read_text().splitlines() if x.strip()]
    lines: list = [b"\xef\xbb\xbf" + json.dumps(_good("bom-1")).encode()]
    for i in range(40):
        k = dict(kinds[i % len(kinds)])
        k["trace_id"] = f"k-{i}"
        lines += [k, _good(f"g-{i}"), b""]
        if i % 5 == 0:
            lines.append(b'{"trace_id": "cut", "messa')
        if i % 7 == 0:
            lines.append(_good(f"g-{i}"))  # duplicate id (in the same batch or a later one)
        if i % 9 == 0:
            lines.append(_good(f"pii-{i}", messages=[{"role": "user", "content": "mail jane.doe@example.com"},
                                                     {"role": "assistant", "content": "ok"}]))
    return lines


def _events(store) -> list[tuple]:
    return store.con.execute("SELECT stream, type, payload::VARCHAR, causation FROM events ORDER BY seq").fetchall()


def test_worker_processes_commit_exactly_what_the_thread_path_commits(cfg, store, arts, tmp_path, monkeypatch):
    import flywheel.ingest.pipeline as pl
    from flywheel.config import load_config
    from flywheel.store import open_store

    cfg.ingest.batch_size = 7
    f = _write(tmp_path / "mixed.jsonl", _mixed_lines())
    cfg.ingest.workers = 0
    s_thread = ingest_paths(cfg, store, arts, [f])
    for workers in (1, 2, 3):
        cfg2 = load_config(overrides={"home": str(tmp_path / f"home-w{workers}"),
                                      "ingest": {"batch_size": 7, "workers": workers}})
        cfg2.ensure_home()
        monkeypatch.setattr(pl, "PROCESS_MIN_BYTES", 0)
        store2 = open_store(cfg2)
        try:
            s_proc = ingest_paths(cfg2, store2, ArtifactStore(cfg2.artifacts_dir), [f])
            skip = {"elapsed_s", "files"}
            assert {k: v for k, v in s_proc.to_dict().items() if k not in skip} == \
                   {k: v for k, v in s_thread.to_dict().items() if k not in skip}
            # Same events, byte for byte (payloads name the artifacts by content hash: same artifacts).
            assert _events(store2) == _events(store)
            again = ingest_paths(cfg2, store2, ArtifactStore(cfg2.artifacts_dir), [f])
            assert again.events_appended == 0 and again.duplicates == s_proc.ingested + s_proc.duplicates
        finally:
            store2.close()
    assert s_thread.redactions_by_rule.get("email") and s_thread.quarantined and s_thread.duplicates
    dump = b"".join(p.read_bytes() for p in Path(cfg.artifacts_dir).rglob("*") if p.is_file())
    assert b"jane.doe@example.com" not in dump


def test_a_worker_killed_mid_file_raises_keeps_committed_batches_and_rerun_is_exactly_once(
        cfg, store, arts, tmp_path, monkeypatch):
    import os
    import signal

    import flywheel.ingest.pipeline as pl
    import flywheel.ingest.worker as wk

    cfg.ingest.batch_size = 5
    # ~150 KB per batch: more than the pipe holds (64 KiB), so a killed worker loses a batch in flight.
    big = [{"role": "user", "content": "x" * 30_000}, {"role": "assistant", "content": "ok"}]
    lines = [_good(f"w-{i}", messages=big) for i in range(60)]
    f = _write(tmp_path / "w.jsonl", lines)
    monkeypatch.setattr(pl, "PROCESS_MIN_BYTES", 0)
    cfg.ingest.workers = 2
    started: list[wk.ProcessBatches] = []
    real_init = wk.ProcessBatches.__init__

    def track(self, *a, **k):
        real_init(self, *a, **k)
        started.append(self)

    monkeypatch.setattr(wk.ProcessBatches, "__init__", track)
    real_commit = pl._Committer.commit
    committed: list[int] = []

    def commit_then_kill(self, b, *a, **k):
        real_commit(self, b, *a, **k)
        committed.append(b.no)
        if b.no == 1:
            os.kill(started[0]._proc.pid, signal.SIGKILL)  # the worker that owns batches 0, 2, 4, ...

    monkeypatch.setattr(pl._Committer, "commit", commit_then_kill)
    with pytest.raises(wk.WorkerDied, match="re-run the ingest"):
        ingest_paths(cfg, store, arts, [f])
    assert committed == [0, 1]
    assert all(p._proc.poll() is not None for p in started)  # both children reaped, none left behind
    n_before = store.con.execute("SELECT count(*) FROM events WHERE type = 'trace.ingested'").fetchall()[0][0]
    assert n_before == 10
    monkeypatch.setattr(pl._Committer, "commit", real_commit)
    s = ingest_paths(cfg, store, arts, [f])
    assert s.ingested == 50 and s.duplicates == 10
    rows = store.con.execute(
        "SELECT count(*), count(DISTINCT stream) FROM events WHERE type = 'trace.ingested'").fetchall()[0]
    assert rows == (60, 60)


def test_a_worker_that_fails_reports_its_traceback(cfg, tmp_path):
    from flywheel.ingest.worker import ProcessBatches, WorkerDied

    missing = tmp_path / "gone.jsonl"
    with ProcessBatches(cfg.ingest, "openai", missing, missing.name, "0" * 64, 0) as child:
        with pytest.raises(WorkerDied, match="FileNotFoundError"):
            list(child)


def test_strided_preparers_interleave_into_the_single_preparer_sequence(cfg):
    from flywheel.ingest.prepare import Preparer
    from flywheel.ingest.reader import Line

    cfg.ingest.batch_size = 4
    raw = [json.dumps(x).encode() if not isinstance(x, bytes) else x for x in _mixed_lines()]
    lines = [Line(i + 1, x) for i, x in enumerate(raw)] + [Line(len(raw) + 1, b"", error="cut short")]

    def run(stride, offset):
        p = Preparer(cfg.ingest, "openai", "m.jsonl", "0" * 64)
        return list(p.batches(iter(lines), lambda: 0, stride=stride, offset=offset)), p.stats()

    single, st = run(1, 0)
    parts = [run(3, o) for o in range(3)]
    merged = sorted((b for bs, _ in parts for b in bs), key=lambda b: b.no)
    assert [b.no for b in merged] == [b.no for b in single] == list(range(len(single)))
    for a, b in zip(single, merged, strict=True):
        assert a.table.equals(b.table) and a.quarantine == b.quarantine and a.read == b.read
        assert a.first_payloads == b.first_payloads and a.in_batch_duplicates == b.in_batch_duplicates
    assert st.records == sum(s.records for _, s in parts) and st.cut == "cut short"
    assert [s.cut for _, s in parts].count("cut short") == 1 and all(s.lines == st.lines for _, s in parts)


def test_failure_states_kept_between_batches_equal_states_read_back_from_the_store(tmp_path, monkeypatch):
    """The committer's in-memory failure states (bounded LRU) give the events a store read would."""
    import flywheel.ingest.pipeline as pl
    from flywheel.config import load_config
    from flywheel.store import open_store

    f = _write(tmp_path / "mixed.jsonl", _mixed_lines())
    results = {}
    for cache_size in (0, 2, 20_000):  # 0: every state read from the store; 2: constant eviction
        monkeypatch.setattr(pl, "FAILURE_STATE_CACHE", cache_size)
        cfg = load_config(overrides={"home": str(tmp_path / f"h{cache_size}"), "ingest": {"batch_size": 7}})
        cfg.ensure_home()
        with open_store(cfg) as s:
            summary = ingest_paths(cfg, s, ArtifactStore(cfg.artifacts_dir), [f])
            results[cache_size] = (_events(s), _failures(s))
        assert summary.updated_failures > 0  # failures recur across batches: states were merged
    assert results[2] == results[0] and results[20_000] == results[0]
    assert any(st["occurrences"] > 1 for st in results[0][1].values())
