"""benchmarks/bench_inference_dtype.py end to end on the tiny random model: both dtypes time every width
on the same prompts, and the JSON says which was faster and how many answers agree."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_inference_dtype.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed")


def _load():
    spec = importlib.util.spec_from_file_location("bench_inference_dtype", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prompts_take_the_four_categories_in_turn():
    b = _load()
    got = b.bfcl_prompts(6)
    assert len(got) == 6
    # simple_python, multiple, parallel, parallel_multiple, then the second of simple_python and multiple
    assert [len(tools) >= 1 for _, tools in got] == [True] * 6
    assert got[0][0] != got[4][0] and got[1][1] != got[0][1]


@pytest.mark.slow
def test_the_benchmark_times_both_dtypes_on_every_width(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(BENCH), "--json", "--model", "tiny", "--home", str(tmp_path),
                          "--widths", "1", "3", "--new-tokens", "4", "--repeats", "1"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = out.stdout[out.stdout.index("{\n"):]  # a library may log a line to stdout before the document
    res = json.loads(doc)
    assert [r["width"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert 0 <= r["identical"] <= r["width"]
        for dt in ("float32", "bfloat16"):
            assert r[dt]["wall_s"] > 0 and r[dt]["cpu_s"] > 0 and 0 < r[dt]["new_tokens"] <= 4 * r["width"]
        assert r["fp32_over_bf16"] == pytest.approx(r["float32"]["wall_s"] / r["bfloat16"]["wall_s"])
