"""benchmarks/demo_seeds.py --cycles 2 on the smoke profile: both cycles per seed, wave 2 through the
champion cycle 1 left, cycle 2 gated on the grown held-out suite (issue 30: how often cycle 2 promotes).
No timing or learning is asserted: the tiny random model learns nothing and both gates lack evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_seeds.py"


def test_demo_seeds_runs_both_cycles_per_seed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.run([sys.executable, str(BENCH), "--profile", "smoke", "--seeds", "3", "--cycles", "2",
                           "--workdir", str(tmp_path / "w"), "--json"],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    c1, c2 = out["runs"]
    assert (c1["seed"], c1["cycle"], c2["seed"], c2["cycle"]) == (3, 1, 3, 2)
    assert out["cycle1_promoted"] == out["cycle2_promoted"] == 0 and out["promoted"] == 0
    # cycle 1 did not promote, so wave 2 was answered by the base model and cycle 2 gated against it,
    # on a held-out suite grown by wave 2's items
    assert c1["champion"] == c2["champion"] == "model:policy/1" and c2["challenger"] != c1["challenger"]
    assert c2["paired_items"] > c1["paired_items"] > 0
    inbox = sorted(p.name for p in (tmp_path / "w" / "seed-3" / "inbox").iterdir())
    assert any(n.startswith("bfcl-wave1") for n in inbox) and any(n.startswith("bfcl-wave2") for n in inbox)
