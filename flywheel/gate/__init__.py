"""Gate-as-code: does the challenger beat the champion, with confidence, on evals it never trained on?

The statistics (:func:`flywheel.stats.paired_stats`, :func:`flywheel.stats.compute_slices`) and the
rules (the ``rule_*`` functions, :func:`decide`) are pure functions of evaluation results, so each rule
is tested on constructed results. :func:`run_gate` is the stage: it evaluates both models (cached, see
:mod:`flywheel.evaluate`), applies the rules, appends one ``gate.decided`` event and writes a report.

Outcomes: ``passed`` (promote), ``refused`` (evidence says no), ``insufficient_evidence`` (too few
paired items to tell; the champion stays, and the report says how many items the observed effect
would need). The CLI exits 0, 3 and 4 respectively.

Rules (thresholds from ``[gate]`` in ``flywheel.toml``, :class:`flywheel.config.GateConfig`)

==========================  ===============================================================
``min_paired_items``        at least this many paired held-out items; below it the outcome is
                            ``insufficient_evidence`` (unless a blocking rule refuses).
``significance``            exact one-sided McNemar (sign) test on the discordant items: p <
                            ``1 - confidence``. 4 wins / 0 losses gives p = 1/16 and is refused
                            at 95%; 12 wins / 1 loss gives p = 0.0017.
``min_improvement``         the one-sided ``confidence`` lower bound of (challenger - champion)
                            pass rate by Newcombe's hybrid score method is strictly greater than
                            the threshold. With the default 0.0 an *equal* model is refused.
``min_pass_rate``           challenger pass rate on the paired held-out items >= the floor.
``max_slice_regression``    no slice with at least ``min_slice_size`` paired items drops by more
                            than this (champion rate - challenger rate) while losing at least
                            ``min_slice_net_losses`` (2) more items than it won. ``origin:success``
                            (the held-out production successes) is a slice: its drop is the keep
                            rate's.
``max_regression_failures`` regression suite (successful production traces on the train side): the
                            number of items the champion passes and the challenger fails is at
                            most this. Without a champion, every challenger failure counts.
                            Without a regression suite the rule passes and says so.
``require_decontaminated``  the challenger's training data was decontaminated against *this*
                            held-out suite version (see :func:`assess_decontamination`).
==========================  ===============================================================

Why not the bootstrap: the percentile bootstrap of the paired difference is anti-conservative at the
sizes held-out suites have (3 wins / 1 loss on 4 items clears a 95% "lower bound > 0" rule). It stays
in the report as an effect-size estimate. The statistics are in :mod:`flywheel.stats`.

The held-out suite holds production failures *and* successes of the clusters dealt to held-out
(:mod:`flywheel.evals`), so a challenger that breaks what worked loses items, and the report shows the
fix rate (held-out failures) and the keep rate (held-out successes) apart.

Pairing: only items scored for both models enter the comparison. An item with an infrastructure
error on either side (sandbox crash, judge endpoint down: ``Verdict.infra_error``) is excluded from
both sides and counted in the report; an infrastructure failure is never a candidate failure.
Non-deterministic items (``llm_judge``) are excluded unless ``[evals] include_llm_judge_in_gate``.

Modules: :mod:`~flywheel.gate.rules` (the rules, :func:`decide`, :data:`OUTCOMES`),
:mod:`~flywheel.gate.lineage` (facts from the challenger's lineage: training signatures, item labels,
:func:`assess_decontamination`), :mod:`~flywheel.gate.evidence` (contestants, suites, evaluations,
pairing: the evidence the rules read), :mod:`~flywheel.gate.decision` (:class:`GateDecision`, its id,
the Markdown report), :mod:`~flywheel.gate.recording` (numbers, report file, MLflow run, event
payload) and :mod:`~flywheel.gate.stage` (:func:`run_gate`). This package re-exports their public names.

Not guaranteed: that the held-out suite is representative of production traffic; the gate only says
the challenger is better *on this suite version* at the stated confidence.
"""

from __future__ import annotations

from flywheel.gate.decision import GateDecision, gate_id_for, render_markdown
from flywheel.gate.evidence import GateError
from flywheel.gate.lineage import assess_decontamination, entity_facts, item_labels, training_signatures
from flywheel.gate.rules import (
    EVIDENCE_RULES,
    OUTCOMES,
    DecontaminationStatus,
    GateEvidence,
    RegressionSummary,
    RuleResult,
    decide,
    rule_decontaminated,
    rule_max_regression_failures,
    rule_max_slice_regression,
    rule_min_improvement,
    rule_min_paired_items,
    rule_min_pass_rate,
    rule_significance,
)
from flywheel.gate.stage import run_gate

__all__ = [
    "EVIDENCE_RULES",
    "OUTCOMES",
    "DecontaminationStatus",
    "GateDecision",
    "GateError",
    "GateEvidence",
    "RegressionSummary",
    "RuleResult",
    "assess_decontamination",
    "decide",
    "entity_facts",
    "gate_id_for",
    "item_labels",
    "render_markdown",
    "rule_decontaminated",
    "rule_max_regression_failures",
    "rule_max_slice_regression",
    "rule_min_improvement",
    "rule_min_paired_items",
    "rule_min_pass_rate",
    "rule_significance",
    "run_gate",
    "training_signatures",
]
