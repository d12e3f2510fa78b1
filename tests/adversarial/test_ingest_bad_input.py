"""Known bad input is a quarantine reason of its own, not an internal error (issue 31, finding 14).

A lone surrogate (``"\\ud800"``: valid JSON text, not valid Unicode) and nesting deeper than the store
can write were quarantined as ``internal_error`` and ``flywheel ingest`` printed a Python traceback per
record on the terminal. Now they are ``invalid_unicode`` and ``too_deep`` with a detail that says what
to fix, the terminal shows no traceback for them, and a real internal error shows one line there while
its traceback goes to ``<home>/logs/ingest.log``.

Not covered: a record that is bad in a way no check names still ends as ``internal_error`` (that is the
point of the isolation: it is never lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flywheel.artifacts import ArtifactStore
from flywheel.ingest import ingest_paths, list_quarantine, show_quarantine


def _trace(tid: str, **kw: Any) -> dict[str, Any]:
    t = {"trace_id": tid, "timestamp": "2026-11-02T09:00:00Z", "model": "agent-v3",
         "messages": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Sunny."}],
         "outcome": {"status": "failure", "error": "wrong city"}}
    t.update(kw)
    return t


def _nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    cur = d
    for _ in range(depth):
        cur["a"] = {}
        cur = cur["a"]
    return d


SURROGATE = json.dumps(_trace("bad-surrogate")).replace("wrong city", "wrong \\ud800 city").encode()
SURROGATE_KEY = json.dumps(_trace("bad-surrogate-key", metadata={"k\\udc00": 1})).replace("\\\\udc00", "\\udc00").encode()
DEEP_400 = json.dumps(_trace("bad-deep", metadata=_nested(400))).encode()
DEEP_2000 = b'{"trace_id": "bad-deeper", "metadata": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2001


def _write(path: Path, lines: list[bytes | dict[str, Any]]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def test_bad_input_problem_names_surrogates_and_depth_without_recursing():
    """Finding 14: the check behind the reasons; iterative, so 100,000 levels do not raise."""
    from flywheel.ingest.formats import bad_input_problem

    assert bad_input_problem({"a": ["ok", "x\ud800"]})[0] == "invalid_unicode"
    assert bad_input_problem({"k\udc00": 1})[0] == "invalid_unicode"
    assert bad_input_problem(_nested(400))[0] == "too_deep"
    assert bad_input_problem(_nested(150)) is None
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    assert bad_input_problem(deep)[0] == "too_deep"


def test_lone_surrogate_and_deep_nesting_are_quarantined_with_their_own_reason(cfg, store, tmp_path):
    """Finding 14: each bad record gets invalid_unicode / too_deep and a detail that says why; the good
    records around them are ingested; nothing is an internal_error."""
    arts = ArtifactStore(cfg.artifacts_dir)
    f = _write(tmp_path / "bad.jsonl", [_trace("good-1"), SURROGATE, SURROGATE_KEY, DEEP_400, DEEP_2000,
                                        _trace("good-2")])
    s = ingest_paths(cfg, store, arts, [f])
    assert s.quarantined_by_reason == {"invalid_unicode": 2, "too_deep": 2}, s.quarantined_by_reason
    assert s.ingested == 2 and store.entity("trace:good-1") and store.entity("trace:good-2")
    rows = {r["line"]: r for q in list_quarantine(store) for r in show_quarantine(store, arts, q["stream"])}
    assert "lone surrogate" in rows[2]["detail"] and "lone surrogate" in rows[3]["detail"]
    assert "nested deeper than" in rows[4]["detail"] and "nested deeper than" in rows[5]["detail"]
    for r in rows.values():
        r["detail"].encode("utf-8")  # no lone surrogate reached the Parquet artifact
        assert "Error" not in r["detail"], r["detail"]  # not an exception's text


@pytest.mark.slow
def test_cli_prints_no_traceback_for_bad_input_and_one_line_for_an_internal_error(tmp_path):
    """Finding 14: ``flywheel ingest`` on a file with bad input and one record whose preparation
    raises (an injected fault): the terminal has no traceback at all, one line for the internal error
    naming the log file, and the log file has that error's traceback (and only that one)."""
    home = tmp_path / "home"
    f = _write(tmp_path / "in.jsonl", [_trace("good-1"), SURROGATE, DEEP_400, _trace("boom")])
    script = textwrap.dedent(f"""
        import flywheel.ingest.prepare as prep
        real = prep.classify
        def classify(rec):
            if rec.get("trace_id") == "boom":
                raise RuntimeError("injected fault")
            return real(rec)
        prep.classify = classify
        from flywheel.cli import app
        app(["ingest", {str(f)!r}], prog_name="flywheel")
    """)
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    terminal = proc.stdout + proc.stderr
    assert "Traceback" not in terminal, terminal[-3000:]
    lines = [ln for ln in terminal.splitlines() if "internal error" in ln]
    assert len(lines) == 1 and "ingest.log" in lines[0] and "line 4" in lines[0], lines
    assert "invalid_unicode" in terminal and "too_deep" in terminal
    log = (home / "logs" / "ingest.log").read_text()
    assert log.count("Traceback") == 1 and "injected fault" in log
