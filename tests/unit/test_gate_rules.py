"""Each gate rule passes and fails on constructed evaluation results; lineage-derived facts."""

from __future__ import annotations

from flywheel.config import GateConfig
from flywheel.gate import (
    DecontaminationStatus,
    GateDecision,
    GateEvidence,
    PairedItem,
    RegressionSummary,
    assess_decontamination,
    compute_slices,
    decide,
    gate_id_for,
    item_labels,
    paired_bootstrap,
    render_markdown,
    rule_decontaminated,
    rule_max_regression_failures,
    rule_max_slice_regression,
    rule_min_improvement,
    rule_min_pass_rate,
    training_signatures,
)


def boot(champ, chall, **kw):
    return paired_bootstrap(champ, chall, samples=kw.pop("samples", 2000), seed=0, **kw)


# ---------------------------------------------------------------- min_pass_rate
def test_min_pass_rate_pass_fail_and_boundary():
    assert rule_min_pass_rate(0.6, 10, 0.5).passed
    assert rule_min_pass_rate(0.5, 10, 0.5).passed  # the floor is inclusive
    r = rule_min_pass_rate(0.4, 10, 0.5)
    assert not r.passed and "0.400 < floor 0.500" in r.reason
    r = rule_min_pass_rate(float("nan"), 0, 0.0)
    assert not r.passed and "no scorable" in r.reason


# ---------------------------------------------------------------- min_improvement
def test_min_improvement_uses_ci_lower_bound_strictly():
    # CI [0.25, 1.0] (hand-derived in test_bootstrap.py)
    b = boot([0, 0, 0, 1], [1, 1, 1, 1])
    assert rule_min_improvement(b, 0.2).passed
    r = rule_min_improvement(b, 0.25)
    assert not r.passed and "does not exceed 0.250" in r.reason and "3 wins / 0 losses" in r.reason
    assert r.value == 0.25


def test_min_improvement_refuses_equal_and_worse():
    equal = boot([1, 0, 1, 0, 1] * 4, [1, 0, 1, 0, 1] * 4)
    assert equal.lo == 0.0 and not rule_min_improvement(equal, 0.0).passed
    worse = boot([1] * 10, [1] * 5 + [0] * 5)
    r = rule_min_improvement(worse, 0.0)
    assert not r.passed and worse.hi < 0
    assert not rule_min_improvement(boot([], []), 0.0).passed


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
    assert not r.passed and "kind:a (0.833 -> 0.667, n=6)" in r.reason
    assert rule_max_slice_regression(slices, 0.2, 5).passed
    # the same drop on a slice below min_slice_size is ignored
    assert rule_max_slice_regression(slices, 0.1, 7).passed


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
def _evidence(champ, chall, decon=True, reg=None):
    b = boot(champ, chall)
    items = [PairedItem(str(i), bool(c), bool(h), ("kind:x",)) for i, (c, h) in enumerate(zip(champ, chall, strict=True))]
    return GateEvidence(b, tuple(compute_slices(items)), reg, DecontaminationStatus(decon, "by construction"))


def test_decide_runs_every_rule_and_collects_reasons():
    cfg = GateConfig(min_pass_rate=0.5, min_improvement=0.0, bootstrap_samples=2000)
    better = _evidence([0] * 10 + [1] * 10, [1] * 18 + [0] * 2)
    passed, rules = decide(better, cfg)
    assert passed and [r.rule for r in rules] == [
        "min_pass_rate", "min_improvement", "max_slice_regression", "max_regression_failures", "require_decontaminated"]
    worse = _evidence([1] * 18 + [0] * 2, [0] * 10 + [1] * 10, decon=False)
    passed, rules = decide(worse, cfg)
    failed = {r.rule for r in rules if not r.passed}
    assert not passed and failed == {"min_improvement", "max_slice_regression", "require_decontaminated"}


def test_report_and_gate_id():
    cfg = GateConfig()
    ev = _evidence([0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 1])
    passed, rules = decide(ev, cfg)
    d = GateDecision("gate:abc", passed, [r.reason for r in rules if not r.passed], rules,
                     {"challenger": "model:policy/2", "champion": "model:policy/1", "slices": [], "confidence": 0.95},
                     suite=SUITE)
    md = render_markdown(d)
    assert md.startswith("# Gate gate:abc: ") and "| min_improvement |" in md and "| require_decontaminated | pass |" in md
    assert gate_id_for({"a": 1, "b": [1.0]}) == gate_id_for({"b": [1.0], "a": 1})
    assert gate_id_for({"a": 1}) != gate_id_for({"a": 2})
    assert GateDecision.from_payload({**d.to_json(), "entity_id": d.gate_id}).rules == rules
