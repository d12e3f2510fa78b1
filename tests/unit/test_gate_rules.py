"""Each gate rule passes and fails on constructed evaluation results; lineage-derived facts."""

from __future__ import annotations

import pytest

from flywheel.config import GateConfig
from flywheel.gate import (
    DecontaminationStatus,
    GateDecision,
    GateEvidence,
    RegressionSummary,
    assess_decontamination,
    decide,
    gate_id_for,
    item_labels,
    render_markdown,
    rule_decontaminated,
    rule_max_regression_failures,
    rule_max_slice_regression,
    rule_min_improvement,
    rule_min_pass_rate,
    rule_significance,
    training_signatures,
)
from flywheel.stats import PairedItem, compute_slices, paired_stats


# ---------------------------------------------------------------- min_pass_rate
def test_min_pass_rate_pass_fail_and_boundary():
    assert rule_min_pass_rate(0.6, 10, 0.5).passed
    assert rule_min_pass_rate(0.5, 10, 0.5).passed  # the floor is inclusive
    r = rule_min_pass_rate(0.4, 10, 0.5)
    assert not r.passed and "0.400 < floor 0.500" in r.reason
    r = rule_min_pass_rate(float("nan"), 0, 0.0)
    assert not r.passed and "no scorable" in r.reason


# ---------------------------------------------------------------- significance + min_improvement
def _table(wins, losses, n, both=0):
    """Aligned champion/challenger vectors with the given discordant counts (the rest both fail)."""
    neither = n - wins - losses - both
    champ = [1] * both + [0] * wins + [1] * losses + [0] * neither
    chall = [1] * both + [1] * wins + [0] * losses + [0] * neither
    return champ, chall


def test_min_improvement_uses_the_newcombe_lower_bound_strictly():
    st = paired_stats(*_table(12, 1, 40))
    # one-sided 95% Newcombe bound of 12 wins / 1 loss / 27 ties on 40 items (by flywheel.stats).
    assert st.lower_bound == pytest.approx(0.13809, abs=1e-4)
    assert rule_min_improvement(st, 0.1).passed
    r = rule_min_improvement(st, 0.14)
    assert not r.passed and "does not exceed 0.140" in r.reason and r.value == st.lower_bound


def test_min_improvement_and_significance_refuse_equal_and_worse():
    equal = paired_stats([1, 0, 1, 0, 1] * 8, [1, 0, 1, 0, 1] * 8)
    assert equal.p_value == 1.0 and equal.lower_bound < 0
    assert not rule_min_improvement(equal, 0.0).passed and not rule_significance(equal).passed
    worse = paired_stats([1] * 40, [1] * 30 + [0] * 10)
    assert worse.p_value == 1.0 and worse.newcombe_hi < 0
    assert not rule_min_improvement(worse, 0.0).passed and not rule_significance(worse).passed
    empty = paired_stats([], [])
    assert not rule_min_improvement(empty, 0.0).passed and not rule_significance(empty).passed


# ---------------------------------------------------------------- max_slice_regression
def _items(spec):
    """spec: list of (label, champion, challenger, count)."""
    out = []
    for label, c, h, k in spec:
        for i in range(k):
            out.append(PairedItem(f"{label}-{c}{h}-{i}", c, h, (label,)))
    return out


def test_slice_regression_pass_and_fail():
    # kind:a: 6 items, champion 5/6, challenger 4/6 -> drop 0.167 (> 0.1: fail)
    items = _items([("kind:a", True, True, 4), ("kind:a", True, False, 1), ("kind:a", False, False, 1),
                    ("kind:b", False, True, 6)])
    slices = compute_slices(items)
    by = {s.name: s for s in slices}
    assert by["kind:a"].n == 6 and by["kind:a"].champion_rate == 5 / 6 and by["kind:a"].challenger_rate == 4 / 6
    assert by["kind:b"].wins == 6 and by["kind:a"].losses == 1
    r = rule_max_slice_regression(slices, 0.1, 5)
    assert not r.passed and "kind:a (0.833 -> 0.667, n=6, 0 won / 1 lost)" in r.reason
    assert rule_max_slice_regression(slices, 0.2, 5).passed
    # the same drop on a slice below min_slice_size is ignored
    assert rule_max_slice_regression(slices, 0.1, 7).passed


def test_one_flipped_item_in_a_slice_is_no_evidence_of_harm():
    # The demo's cycle 2 (seed 1, 96 tokens): 13 wins / 4 losses on 89 items, p = 0.0245, refused because
    # kind:wrong_arg_value (9 items) went 1 -> 0. Those 13 / 4 outcomes shuffled over the same items trip a
    # one-item rule 22% of the time, a rule that needs two net losses 5% (docs/gate.md).
    items = _items([("kind:a", True, False, 1), ("kind:a", False, False, 8), ("kind:b", False, True, 6)])
    slices = compute_slices(items)
    r = rule_max_slice_regression(slices, 0.1, 5, 2)
    assert r.passed and "kind:a (-0.111, n=9, 0 won / 1 lost)" in r.reason and "fewer than 2 net lost items" in r.reason
    assert not rule_max_slice_regression(slices, 0.1, 5, 1).passed  # the one-item rule refuses it
    # two lost, none won back: refused
    two = compute_slices(_items([("kind:a", True, False, 2), ("kind:a", False, False, 7)]))
    r2 = rule_max_slice_regression(two, 0.1, 5, 2)
    assert not r2.passed and "kind:a (0.222 -> 0.000, n=9, 0 won / 2 lost)" in r2.reason
    # three lost and one won is two net; two lost and one won is one
    assert not rule_max_slice_regression(compute_slices(_items([
        ("kind:a", True, False, 3), ("kind:a", False, True, 1), ("kind:a", False, False, 6)])), 0.1, 5, 2).passed
    assert rule_max_slice_regression(compute_slices(_items([
        ("kind:a", True, False, 2), ("kind:a", False, True, 1), ("kind:a", False, False, 6)])), 0.1, 5, 2).passed


def test_slice_regression_exact_threshold_allowed():
    # 10 items, 6 -> 5 passing: a drop of exactly 0.1 is within max_slice_regression = 0.1
    items = _items([("tool:f", True, True, 5), ("tool:f", True, False, 1), ("tool:f", False, False, 4)])
    assert rule_max_slice_regression(compute_slices(items), 0.1, 5).passed


def test_item_counts_once_per_slice():
    items = [PairedItem("x", False, True, ("kind:a", "kind:a", "tool:f"))]
    s = {x.name: x for x in compute_slices(items)}
    assert s["kind:a"].n == 1 and s["tool:f"].n == 1


# ---------------------------------------------------------------- max_regression_failures
def test_regression_rule_counts_new_failures_against_champion():
    reg = RegressionSummary("suite:regression@1", 20, challenger_failures=3, new_failures=1,
                            champion_present=True, failed_task_ids=("eval:r1",))
    assert rule_max_regression_failures(reg, 1).passed
    r = rule_max_regression_failures(reg, 0)
    assert not r.passed and "1 items the champion passes" in r.reason and "eval:r1" in r.reason


def test_regression_rule_without_champion_counts_all_failures():
    reg = RegressionSummary("suite:regression@1", 20, challenger_failures=3, new_failures=0, champion_present=False)
    assert not rule_max_regression_failures(reg, 2).passed
    assert rule_max_regression_failures(reg, 3).passed
    r = rule_max_regression_failures(None, 0)
    assert r.passed and "no regression suite" in r.reason


# ---------------------------------------------------------------- decontamination
SUITE = "suite:heldout@2"


def _lineage(**extra):
    base = {
        "run:r1": {},
        "env:train@1": {},
        "suite:train@1": {},
        "eval:t1": {"split": "train", "cluster": "c1", "failure_kinds": ["wrong_arg_value"], "tools": ["get_weather"],
                    "origin_failure": "failure:f1"},
        "failure:f1": {"kinds": ["wrong_arg_value"]},
    }
    base.update(extra)
    return base


def test_decontaminated_by_construction_from_train_split():
    st = assess_decontamination(_lineage(), SUITE, "heldout")
    assert st.decontaminated is True and "by construction" in st.basis
    assert rule_decontaminated(st, True).passed


def test_synth_batches_must_name_this_suite_version():
    ok = assess_decontamination(_lineage(**{"synth:b1": {"decontaminated_against": [SUITE]}}), SUITE, "heldout")
    assert ok.decontaminated is True
    old = assess_decontamination(_lineage(**{"synth:b1": {"decontaminated_against": ["suite:heldout@1"]}}), SUITE, "heldout")
    assert old.decontaminated is False and "synth:b1" in old.basis
    r = rule_decontaminated(old, True)
    assert not r.passed and "not decontaminated against suite:heldout@2" in r.reason
    assert rule_decontaminated(old, False).passed  # not required -> reported, not enforced


def test_lineage_reaching_heldout_data_is_contaminated():
    st = assess_decontamination(_lineage(**{"suite:heldout@1": {}}), SUITE, "heldout")
    assert st.decontaminated is False and "suite:heldout@1" in st.basis
    st = assess_decontamination(_lineage(**{"eval:h": {"split": "heldout"}}), SUITE, "heldout")
    assert st.decontaminated is False and "eval:h" in st.basis
    st = assess_decontamination(_lineage(), SUITE, "heldout", contaminated_items=["eval:h9"])
    assert st.decontaminated is False


def test_no_training_data_is_unknown_and_fails_when_required():
    st = assess_decontamination({"run:r1": {}}, SUITE, "heldout")
    assert st.decontaminated is None
    assert not rule_decontaminated(st, True).passed


# ---------------------------------------------------------------- slices from lineage
def test_originating_failures_slice_and_contamination_label():
    training = training_signatures(_lineage())
    assert ("wrong_arg_value", "get_weather") in training["signatures"]
    assert training["failures"] == {"failure:f1"} and training["clusters"] == {"c1"}
    same_kind_tool = {"failure_kinds": ["wrong_arg_value"], "tools": ["get_weather"], "source": "bfcl", "cluster": "c7"}
    labels = item_labels(same_kind_tool, training)
    assert set(labels) == {"kind:wrong_arg_value", "tool:get_weather", "source:bfcl", "originating_failures"}
    other_tool = {"failure_kinds": ["wrong_arg_value"], "tools": ["send_email"], "cluster": "c8"}
    assert "originating_failures" not in item_labels(other_tool, training)
    leaked = {"failure_kinds": ["no_tool_call"], "tools": [], "cluster": "c1"}
    assert "contaminated" in item_labels(leaked, training)


# ---------------------------------------------------------------- decide + report
def _evidence(champ, chall, decon=True, reg=None, labels=("kind:x",)):
    st = paired_stats(champ, chall, bootstrap_samples=2000)
    items = [PairedItem(str(i), bool(c), bool(h), labels) for i, (c, h) in enumerate(zip(champ, chall, strict=True))]
    return GateEvidence(st, tuple(compute_slices(items)), reg, DecontaminationStatus(decon, "by construction"))


RULES = ["min_paired_items", "significance", "min_improvement", "min_pass_rate", "max_slice_regression",
         "max_regression_failures", "require_decontaminated"]


def test_decide_runs_every_rule_and_collects_reasons():
    cfg = GateConfig(min_pass_rate=0.5, min_improvement=0.0, bootstrap_samples=2000, min_paired_items=20)
    better = _evidence([0] * 10 + [1] * 10, [1] * 18 + [0] * 2)
    outcome, rules = decide(better, cfg)
    assert outcome == "passed" and [r.rule for r in rules] == RULES and all(r.passed for r in rules)
    worse = _evidence([1] * 18 + [0] * 2, [0] * 10 + [1] * 10, decon=False)
    outcome, rules = decide(worse, cfg)
    failed = {r.rule for r in rules if not r.passed}
    assert outcome == "refused"
    assert failed == {"significance", "min_improvement", "max_slice_regression", "require_decontaminated"}


# Known answers (issue: "the flywheel must prove each lift").
def test_four_wins_no_loss_of_nine_is_not_evidence():
    cfg = GateConfig(min_paired_items=1)
    st = paired_stats(*_table(4, 0, 9))
    assert st.p_value == pytest.approx(1 / 16, abs=1e-12)  # 0.0625 > 0.05
    # The percentile bootstrap would have passed it (lower bound +11% on the demo's run).
    assert st.boot.lo > 0
    outcome, rules = decide(_evidence(*_table(4, 0, 9)), cfg)
    assert outcome == "refused" and not next(r for r in rules if r.rule == "significance").passed
    # With the default minimum of 30 paired items it is not even a decision.
    outcome, rules = decide(_evidence(*_table(4, 0, 9)), GateConfig())
    assert outcome == "insufficient_evidence"
    why = rules[0].reason
    assert "only 9 paired held-out items (< 30)" in why and "would need about" in why


def test_three_wins_one_loss_of_four_is_refused():
    st = paired_stats(*_table(3, 1, 4))
    assert st.p_value == pytest.approx(5 / 16, abs=1e-12)
    assert decide(_evidence(*_table(3, 1, 4)), GateConfig(min_paired_items=1))[0] == "refused"


def test_twelve_wins_one_loss_of_forty_passes():
    st = paired_stats(*_table(12, 1, 40))
    assert st.p_value == pytest.approx(14 / 8192, abs=1e-12)
    outcome, rules = decide(_evidence(*_table(12, 1, 40)), GateConfig())
    assert outcome == "passed", [r.reason for r in rules if not r.passed]


def test_equal_models_are_refused_at_any_size():
    for n in (30, 200):
        champ = [1, 0] * (n // 2)
        outcome, _ = decide(_evidence(champ, list(champ)), GateConfig())
        assert outcome == "refused"
    # A swap of equal numbers of wins and losses is no evidence either.
    champ, chall = _table(10, 10, 60)
    assert decide(_evidence(champ, chall), GateConfig())[0] == "refused"


def test_one_worse_slice_blocks_an_otherwise_significant_lift():
    # 40 items: 15 wins overall, but the 'tool:g' slice (10 items) loses 3 it used to pass.
    champ = [0] * 15 + [0] * 15 + [1] * 3 + [1] * 7
    chall = [1] * 15 + [0] * 15 + [0] * 3 + [1] * 7
    items = [PairedItem(str(i), bool(c), bool(h), ("tool:f",) if i < 30 else ("tool:g",))
             for i, (c, h) in enumerate(zip(champ, chall, strict=True))]
    st = paired_stats(champ, chall)
    assert st.p_value < 0.05 and st.lower_bound > 0
    ev = GateEvidence(st, tuple(compute_slices(items)), None, DecontaminationStatus(True, "by construction"))
    outcome, rules = decide(ev, GateConfig())
    assert outcome == "refused"
    assert [r.rule for r in rules if not r.passed] == ["max_slice_regression"]
    # A blocking rule refuses even below min_paired_items: harm needs no large suite.
    outcome, _ = decide(ev, GateConfig(min_paired_items=100))
    assert outcome == "refused"


def test_a_significant_lift_with_one_flipped_item_in_a_slice_passes_by_default():
    # 40 items: 15 wins overall; the 'tool:g' slice (8 items) loses one item it used to pass (-0.125) and wins none.
    champ = [0] * 15 + [0] * 17 + [1] * 1 + [1] * 7
    chall = [1] * 15 + [0] * 17 + [0] * 1 + [1] * 7
    items = [PairedItem(str(i), bool(c), bool(h), ("tool:f",) if i < 32 else ("tool:g",))
             for i, (c, h) in enumerate(zip(champ, chall, strict=True))]
    ev = GateEvidence(paired_stats(champ, chall), tuple(compute_slices(items)), None,
                      DecontaminationStatus(True, "by construction"))
    outcome, rules = decide(ev, GateConfig())
    assert outcome == "passed", [r.reason for r in rules if not r.passed]
    assert GateConfig().min_slice_net_losses == 2
    outcome, rules = decide(ev, GateConfig(min_slice_net_losses=1))
    assert outcome == "refused" and [r.rule for r in rules if not r.passed] == ["max_slice_regression"]


def test_p_values_equal_scipy_binomtest():
    from scipy.stats import binomtest

    from flywheel.stats import sign_test

    for wins in range(0, 61):
        for losses in range(0, 61 - wins):
            if wins + losses == 0:
                assert sign_test(0, 0) == 1.0
                continue
            ref = binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue
            assert abs(sign_test(wins, losses) - ref) <= 1e-12
    # ... and the gate's own statistics carry exactly that p-value.
    for wins, losses in ((4, 0), (3, 1), (12, 1), (9, 4), (0, 5), (20, 20)):
        ref = binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue
        assert abs(paired_stats(*_table(wins, losses, 45)).p_value - ref) <= 1e-12


def test_report_and_gate_id():
    cfg = GateConfig()
    ev = _evidence([0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 1])
    outcome, rules = decide(ev, cfg)
    assert outcome == "insufficient_evidence"
    d = GateDecision("gate:abc", outcome, [r.reason for r in rules if not r.passed], rules,
                     {"challenger": "model:policy/2", "champion": "model:policy/1", "slices": [], "confidence": 0.95,
                      "p_value": ev.stats.p_value, "paired_items": 6, "min_paired_items": 30,
                      "by_origin": {"failure": {"n": 4, "champion_rate": 0.25, "challenger_rate": 0.75, "wins": 2,
                                                "losses": 0}}},
                     suite=SUITE)
    md = render_markdown(d)
    assert md.startswith("# Gate gate:abc: INSUFFICIENT EVIDENCE") and "| min_improvement |" in md
    assert "| require_decontaminated | pass |" in md and "fix rate" in md and "p = 0.25 " in md
    assert not d.passed and d.to_json()["outcome"] == "insufficient_evidence"
    assert gate_id_for({"a": 1, "b": [1.0]}) == gate_id_for({"b": [1.0], "a": 1})
    assert gate_id_for({"a": 1}) != gate_id_for({"a": 2})
    back = GateDecision.from_payload({**d.to_json(), "entity_id": d.gate_id})
    assert back.rules == rules and back.outcome == "insufficient_evidence"
    # A decision recorded before outcomes existed reads back as passed/refused.
    legacy = {k: v for k, v in d.to_json().items() if k != "outcome"}
    assert GateDecision.from_payload({**legacy, "entity_id": "gate:x", "passed": True}).outcome == "passed"
    assert GateDecision.from_payload({**legacy, "entity_id": "gate:y", "passed": False}).outcome == "refused"
