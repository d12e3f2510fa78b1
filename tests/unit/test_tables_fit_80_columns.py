"""Summary tables fit an 80-column terminal, and identifiers (model refs, entity ids) are wrapped
whole, never split across lines (issue 32). Rendered with a recording rich Console of width 80, as a
terminal of that width or a pipe (rich's default width) would show them."""

from __future__ import annotations

import copy
import re

import pytest
from rich.console import Console

import flywheel.cli.common as common
import flywheel.cli.demo as cli_demo
from flywheel.cli.common import _fit_widths, print_table


@pytest.fixture
def term(monkeypatch):
    c = Console(width=80, record=True, color_system=None)
    monkeypatch.setattr(common, "out", c)
    monkeypatch.setattr(cli_demo, "out", c)
    return c


def _text(c: Console) -> str:
    return c.export_text(styles=False)


def _cells(text: str) -> list[str]:
    """Each table line's cell contents, stripped of the box drawing."""
    return [part.strip() for line in text.splitlines() for part in re.split(r"[│┃]", line)]


def _assert_fits(text: str) -> None:
    too_long = [ln for ln in text.splitlines() if len(ln.rstrip()) > 80]
    assert not too_long, "\n".join(too_long)


def _assert_refs_whole(text: str, refs: list[str]) -> None:
    cells = _cells(text)
    for ref in refs:
        assert any(ref in c for c in cells), f"{ref!r} is not whole on any line:\n{text}"
    # a split ref leaves a cell ending in a prefix of it ("model:policy/" then "1 ...")
    for c in cells:
        assert not re.search(r"(?:model:|policy/?|model:policy/)$", c), f"split ref in {c!r}:\n{text}"
        assert not re.search(r"policy(?!/\d)", c), f"split ref in {c!r}:\n{text}"


def _demo_result() -> dict:
    def gate(outcome, against, w, lo, p):
        return {"outcome": outcome, "p_value": p, "wins": w, "losses": lo, "against": against,
                "suite": "suite:bfcl-heldout@2", "gate_id": "gate:0123456789abcdef"}

    rows = [
        {"model": "model:policy/1", "trained": "base model (smollm2-135m)", "cycle": None, "passed": 0, "items": 44,
         "pass_rate": 0.0, "wilson_lo": 0.0, "wilson_hi": 0.0803, "gate": None, "champion": True,
         "champion_order": 1},
        {"model": "model:policy/3",
         "trained": "SFT 12 steps on 148 demonstrations from model:policy/1 + GRPO 2 steps on its own rollouts",
         "cycle": 1, "passed": 12, "items": 44, "pass_rate": 12 / 44, "wilson_lo": 0.1634, "wilson_hi": 0.4207,
         "gate": gate("promoted", "model:policy/1", 12, 0, 0.000244140625), "champion": True, "champion_order": 2},
        {"model": "model:policy/12",
         "trained": "SFT 12 steps on 96 demonstrations from model:policy/3 + no GRPO (no reward variance)",
         "cycle": 2, "passed": 13, "items": 44, "pass_rate": 13 / 44, "wilson_lo": 0.1812, "wilson_hi": 0.4412,
         "gate": gate("insufficient_evidence", "model:policy/3", 3, 2, 0.5), "champion": False,
         "champion_order": None},
    ]
    cycle = {
        "cycle": "cycle:2f9c1d7e8a41", "outcome": "promoted", "wall_s": 733.2,
        "reason": "challenger beats champion on held-out (p = 0.000244 < 0.05)",
        "stages": {
            "ingest": {"read": 140, "ingested": 138, "quarantined": 2, "new_failures": 120},
            "new_failures": 120,
            "evals": {"splits": {"train": 96, "heldout": 44}, "heldout": {"items": 44, "failures": 40, "successes": 4}},
            "synth": {"counts": {"mutate": 52, "accepted": 48, "rejected": 4}},
            "rollouts": {"policy": "model:policy/2",
                         "stats": {"pass_at_1": 0.31, "pass_at_k": 0.6, "zero_variance_share": 0.5}},
            "train_mode": {"mode": "sft", "why": "train.mode = sft"},
            "sft": {"model_entity": "model:policy/2", "steps": 12, "metrics": {"loss": 0.4321}},
            "grpo": {"model_entity": "model:policy/3", "steps": 2, "metrics": {"loss": 0.0123}},
            "gate": {"outcome": "promoted", "numbers": {"p_value": 0.000244},
                     "reasons": ["12 wins / 0 losses on 44 paired items against model:policy/1"]},
        },
        "published": {"report": "/home/someone/.flywheel/reports/cycle-2f9c1d7e8a41/index.html"},
    }
    return {
        "home": "/home/someone/.flywheel", "profile": "cpu", "champion_before": "model:policy/1", "waves": [],
        "cycles": [cycle, copy.deepcopy(cycle)],
        "scoreboard": {
            "suite": "suite:bfcl-heldout@2", "items": 44, "rows": rows, "champions": [1, 3],
            "final_champion": "model:policy/3",
            "lineage": {"final_champion": {"model": "model:policy/3", "traces": 140, "by_wave": {"1": 140}},
                        "last_challenger": {"model": "model:policy/12", "traces": 210, "by_wave": {"1": 140, "2": 70}}},
        },
        "report": {"path": "/home/someone/.flywheel/reports/cycle-2f9c1d7e8a41/index.html"},
        "timings": {"prepare_s": 41.0, "wave1_s": 311.2, "cycle1_s": 733.0, "cycle1.sft_s": 435.0,
                    "wave2_s": 166.0, "cycle2_s": 855.0, "scoreboard_s": 50.0, "total_s": 2158.0},
    }


def test_demo_final_table_fits_80_columns_with_model_refs_whole(term):
    res = _demo_result()
    before = copy.deepcopy(res)
    cli_demo.render(res)
    text = _text(term)
    _assert_fits(text)
    _assert_refs_whole(text, ["policy/1", "policy/3", "policy/12"])
    board = text[text.index("every gated model"):]
    assert "model:policy/" not in board.split("lineage of")[0], "the scoreboard uses short refs"
    assert "policy/12" in board and "(champion)" in board
    assert res == before, "rendering leaves the result (what --json prints) unchanged"


def test_demo_json_output_keeps_full_entity_ids():
    """``--json`` prints ``result.to_dict()`` as is: the short refs are a rendering of the table only."""
    import inspect

    src = inspect.getsource(cli_demo.demo)
    assert "emit_json(data)" in src and "short_ref" not in src


def test_wide_table_keeps_ids_whole_and_fits(term):
    ids = ["trace:0a1b2c3d", "model:policy/17", "suite:heldout@12", "eval:simple_12"]
    rows = [(i, ids[i % 4], 1, ids[(i + 1) % 4],
             f"{{'failure_kinds': ['wrong_args', 'missing_call'], 'tool': 'area', 'entity': '{ids[(i + 2) % 4]}'}}")
            for i in range(4)]
    print_table("4 events", ["seq", "stream", "v", "causation", "payload"], rows)
    text = _text(term)
    _assert_fits(text)
    cells = _cells(text)
    for ident in ids:
        assert any(ident in c for c in cells), f"{ident} split:\n{text}"


def test_two_column_summary_wraps_long_text_at_spaces(term):
    rows = [("outcome", "promoted: challenger beats champion model:policy/1 on held-out suite:bfcl-heldout@2 "
                        "(p = 0.000244 < 0.05) with 12 wins and 0 losses on 44 paired items"),
            ("report", "/home/someone/.flywheel/reports/cycle-2f9c1d7e8a41/index.html")]
    print_table("cycle cycle:2f9c1d7e8a41", ["stage", "result"], rows)
    text = _text(term)
    _assert_fits(text)
    _assert_refs_whole(text, ["model:policy/1", "suite:bfcl-heldout@2",
                              "/home/someone/.flywheel/reports/cycle-2f9c1d7e8a41/index.html"])


def test_a_table_that_fits_is_rendered_as_before(term):
    rows = [("prepare_s", 41.0), ("total_s", 2158.0)]
    print_table("timings (s)", ["step", "seconds"], rows)
    plain = Console(width=80, record=True, color_system=None)
    plain.print(common.table("timings (s)", ["step", "seconds"], rows))
    assert _text(term) == plain.export_text(styles=False)


def test_fit_widths_never_exceeds_the_space_and_keeps_words():
    assert _fit_widths([10, 20], [5, 8], 40) is None
    w = _fit_widths([12, 90, 60], [10, 14, 15], 60)
    assert sum(w) <= 60 and w[0] == 12 and w[1] >= 14 and w[2] >= 15
    # words wider than the whole table: fold the widest, still within the space
    w = _fit_widths([70, 70], [70, 70], 50)
    assert sum(w) <= 50 and min(w) >= 1


def test_one_row_summary_too_wide_is_printed_one_line_per_column(term):
    cols = ["read", "ingested", "duplicates", "quarantined", "successes", "new failures", "updated failures",
            "events", "seconds"]
    print_table("ingest summary", cols, [(140, 138, 0, 2, 18, 120, 0, 1534, 12.3)])
    text = _text(term)
    _assert_fits(text)
    cells = _cells(text)
    for c in cols:  # before: headers folded mid-word ("quarantin" / "ed")
        assert c in cells, f"{c!r} is not whole:\n{text}"
    assert "1534" in cells and "12.3" in cells
