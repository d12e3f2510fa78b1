"""The pure helpers of benchmarks/bench_engines.py: the item split, the exactness comparison, the
adoption rule and the table. Hand-computed expectations; nothing here needs llama-cpp-python or a model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engines.py"


@pytest.fixture(scope="module")
def b():
    spec = importlib.util.spec_from_file_location("bench_engines", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_category_counts_largest_remainder(b):
    w = {"simple_python": 60, "multiple": 30, "parallel": 25, "parallel_multiple": 25}
    # 24 x (60, 30, 25, 25) / 140 = 10 r40, 5 r20, 4 r40, 4 r40: one left, the first of the r40s takes it
    assert b.category_counts(24, w) == {"simple_python": 11, "multiple": 5, "parallel": 4, "parallel_multiple": 4}
    # 8: 3 r60, 1 r100, 1 r60, 1 r60: two left -> multiple (r100), then simple_python (first r60)
    assert b.category_counts(8, w) == {"simple_python": 4, "multiple": 2, "parallel": 1, "parallel_multiple": 1}
    assert b.category_counts(0, w) == dict.fromkeys(w, 0)
    assert sum(b.category_counts(97, w).values()) == 97


def test_first_divergence(b):
    assert b.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert b.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert b.first_divergence([1, 2], [1, 2, 3]) == 2  # one answer stopped earlier
    assert b.first_divergence([], []) is None


def test_compare_answers_counts_texts_ids_and_verdicts(b):
    ref_t = ["[f(a=1)]", "[g(b=2)]", "prose", "[h()]"]
    oth_t = ["[f(a=1)]", "[g(b=3)]", "prose", "[h(x=1)]"]
    ref_i = [[1, 2], [3, 4], [5], [6, 7]]
    oth_i = [[1, 2], [3, 9], [5], [6, 8, 7]]
    ref_p = [True, True, False, False]
    oth_p = [True, False, False, True]
    ex = b.compare_answers(ref_t, oth_t, ref_i, oth_i, ref_p, oth_p)
    assert ex["items"] == 4
    assert ex["identical_text"] == 2 and ex["identical_ids"] == 2
    assert ex["exact_share"] == 0.5
    assert ex["differ"] == [1, 3]
    assert ex["first_diff_token"] == {1: 1, 3: 1}
    assert ex["verdict_differs"] == 2 and ex["gained"] == 1 and ex["lost"] == 1
    assert ex["passed"] == 2 and ex["ref_passed"] == 2
    with pytest.raises(ValueError):
        b.compare_answers(ref_t, oth_t[:3], ref_i, oth_i, ref_p, oth_p)


def _exact(identical, items=24):
    return {"items": items, "identical_ids": identical, "identical_text": identical, "verdict_differs": 0,
            "passed": 3}


def test_decide_needs_margin_in_wall_and_cpu_and_every_answer_identical(b):
    hf = {"engine": "hf", "wall_s": 60.0, "cpu_s": 120.0, "tokens": 600}
    fast_exact = {"engine": "llama-f32-batch", "wall_s": 30.0, "cpu_s": 60.0, "tokens": 600, "exact": _exact(24)}
    assert b.decide([hf, fast_exact])[0] == "adopt llama-f32-batch"
    # 2.0x wall but only 1.2x in CPU seconds: a scheduling accident is not evidence
    cpu_slow = dict(fast_exact, cpu_s=100.0)
    verdict, reason = b.decide([hf, cpu_slow])
    assert verdict == "keep hf" and "1.20x CPU-s" in reason
    # fast enough, one answer differs
    inexact = dict(fast_exact, exact=_exact(23))
    verdict, reason = b.decide([hf, inexact])
    assert verdict == "keep hf" and "1/24 answers differ" in reason
    # quantised rows are never candidates
    q8 = dict(fast_exact, engine="llama-q8_0-batch")
    assert b.decide([hf, q8]) == ("keep hf", "no fp32 llama.cpp row was measured")
    # a handful of items decides nothing, however fast
    few = dict(fast_exact, exact=_exact(2, items=2))
    assert b.decide([hf, few]) == ("no decision", "2 items < 20: too few to decide")


def test_format_table_fits_80_columns(b):
    rows = [
        {"engine": "hf", "wall_s": 60.0, "cpu_s": 120.0, "tokens": 600, "passed": 3},
        {"engine": "llama-f32-batch", "wall_s": 40.0, "cpu_s": 80.0, "tokens": 600, "exact": _exact(22)},
        {"engine": "llama-q8_0-batch", "wall_s": 1234.5, "cpu_s": 2469.0, "tokens": 612, "exact": _exact(9)},
    ]
    out = b.format_table(rows)
    lines = out.splitlines()
    assert all(len(x) <= 80 for x in lines)
    assert len(lines) == 2 + len(rows)
    hf, f32 = lines[2].split(), lines[3].split()
    assert hf == ["hf", "60.0", "120.0", "10.0", "1.00", "1.00", "ref", "-", "3"]
    # 600 tokens / 40 s = 15.0 tok/s; 60/40 = 1.50x wall, 120/80 = 1.50x CPU
    assert f32 == ["llama-f32-batch", "40.0", "80.0", "15.0", "1.50", "1.50", "22/24", "0", "3"]
