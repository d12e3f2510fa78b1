"""The README's main job, end to end with a tiny random model (`flywheel demo --profile smoke`):
base model registered as champion, a real `flywheel serve --champion` process answering BFCL
questions over HTTP, the gateway log ingested by one Prefect cycle, a gate decision, a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_smoke_profile(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.run(
        [sys.executable, "-m", "flywheel", "demo", "--profile", "smoke", "--home", str(home), "--json"],
        capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["champion_before"] == "model:policy/1"
    # Production traffic went through the real server and was logged as a gateway would.
    assert res["traffic"]["requests"] == 16
    log = Path(res["traffic"]["log"])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 16 and all({"bfcl_id", "answer", "model", "timestamp"} <= set(r) for r in records)
    cycle = res["cycle"]
    st = cycle["stages"]
    assert st["ingest"]["ingested"] == 16
    assert cycle["outcome"] in ("promoted", "refused")
    gate = st["gate"]
    assert isinstance(gate["passed"], bool) and (gate["passed"] or gate["reasons"])
    # The lineage of the trained model reaches the logged production traces.
    assert res["lineage"]["traces"], "no production trace behind the trained model"
    report = Path(res["report"]["path"])
    assert report.exists() and "<svg" in report.read_text()
    # Nothing outside the home directory: everything the demo wrote lives under it.
    assert (home / "warehouse.duckdb").exists() and (home / "mlflow.db").exists()
    assert oct(home.stat().st_mode & 0o777) == "0o700"
