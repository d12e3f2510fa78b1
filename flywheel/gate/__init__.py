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
                            than this (champion rate - challenger rate). ``origin:success`` (the
                            held-out production successes) is a slice: its drop is the keep rate's.
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

Not guaranteed: that the held-out suite is representative of production traffic; the gate only says
the challenger is better *on this suite version* at the stated confidence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flywheel import evaluate
from flywheel.artifacts import ArtifactRef, ArtifactStore
from flywheel.champion import reconcile_champion
from flywheel.config import FlywheelConfig, GateConfig
from flywheel.evaluate import EvalResult, ModelRef, PolicyLoader, evaluate_model, parse_suite_spec
from flywheel.stats import (
    POWER,
    PairedItem,
    PairedStats,
    SliceResult,
    compute_slices,
    paired_stats,
)
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import DatasetSpec, Tracker
from flywheel.versioning import Suite, load_suite, versioned_event
from flywheel.vocab.ids import GATE_HEX, short_id
from flywheel.vocab.refs import parse_model_entity


class GateError(RuntimeError):
    """The gate could not be evaluated (missing suite, unreadable artifact, unknown model, ...): an
    error, never a refusal and never a pass."""


OUTCOMES = ("passed", "refused", "insufficient_evidence")


# --------------------------------------------------------------------------------------------
# rules


@dataclass(frozen=True)
class RuleResult:
    """One gate rule: ``value`` measured, ``threshold`` from config, a one-line ``reason``."""

    rule: str
    passed: bool
    value: Any
    threshold: Any
    reason: str


@dataclass(frozen=True)
class RegressionSummary:
    """The challenger on the regression suite (successful production traces)."""

    suite: str
    n: int
    challenger_failures: int
    new_failures: int  # champion passes, challenger fails
    champion_present: bool
    infra_errors: int = 0
    failed_task_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecontaminationStatus:
    """Whether the challenger's training data is clean with respect to one held-out suite version.

    ``decontaminated`` is ``None`` when lineage cannot tell (no training data recorded).
    """

    decontaminated: bool | None
    basis: str
    details: dict[str, Any] = field(default_factory=dict)


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _fmt4(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def rule_min_pass_rate(challenger_rate: float, n: int, threshold: float) -> RuleResult:
    if n == 0:
        return RuleResult("min_pass_rate", False, None, threshold, "no scorable held-out items (all excluded or suite empty)")
    ok = challenger_rate >= threshold
    op = ">=" if ok else "<"
    return RuleResult(
        "min_pass_rate", ok, challenger_rate, threshold,
        f"challenger pass rate {_fmt(challenger_rate)} {op} floor {_fmt(threshold)} on {n} items",
    )


def rule_min_paired_items(stats: PairedStats, min_items: int) -> RuleResult:
    """Enough paired items to decide at all; failing it makes the outcome *insufficient evidence*."""
    ok = stats.n >= min_items
    if ok:
        return RuleResult("min_paired_items", True, stats.n, min_items, f"{stats.n} paired items >= {min_items}")
    need = stats.items_needed
    if need is not None:
        more = (f"the observed effect ({stats.wins} wins / {stats.losses} losses) would need about "
                f"{max(need, min_items)} paired items to show at {POWER:.0%} power")
    else:
        more = "the observed effect is no improvement, so more items would not make it pass"
    return RuleResult("min_paired_items", False, stats.n, min_items,
                      f"only {stats.n} paired held-out items (< {min_items}): insufficient evidence; {more}")


def rule_significance(stats: PairedStats) -> RuleResult:
    """The exact one-sided sign test on the discordant items rejects "no better" at ``1 - confidence``."""
    if stats.n == 0:
        return RuleResult("significance", False, None, stats.alpha, "no paired items: nothing to test")
    ok = stats.p_value < stats.alpha
    return RuleResult(
        "significance", ok, stats.p_value, stats.alpha,
        f"exact sign test on {stats.wins} wins / {stats.losses} losses ({stats.n} items): one-sided p = "
        f"{stats.p_value:.4g} " + ("<" if ok else ">=") + f" {stats.alpha:.4g}",
    )


def rule_min_improvement(stats: PairedStats, threshold: float) -> RuleResult:
    """The one-sided Newcombe lower bound of (challenger - champion) exceeds ``threshold`` strictly."""
    if stats.n == 0:
        return RuleResult("min_improvement", False, None, threshold, "no paired items: the improvement cannot be estimated")
    ok = stats.lower_bound > threshold
    return RuleResult(
        "min_improvement", ok, stats.lower_bound, threshold,
        f"one-sided {stats.confidence:.0%} lower bound of challenger - champion (Newcombe hybrid score) is "
        f"{_fmt(stats.lower_bound)} (diff {_fmt(stats.diff)}); it " + ("exceeds" if ok else "does not exceed")
        + f" {_fmt(threshold)}",
    )


def rule_max_slice_regression(slices: Sequence[SliceResult], max_drop: float, min_size: int) -> RuleResult:
    eligible = [s for s in slices if s.n >= min_size]
    if not eligible:
        return RuleResult(
            "max_slice_regression", True, None, max_drop,
            f"no slice has >= {min_size} paired items; nothing to check",
        )
    worst = min(eligible, key=lambda s: (s.delta, s.name))
    drop = -worst.delta
    # A tiny epsilon so that a drop of exactly the threshold (0.1 from 0.6 -> 0.5) is allowed.
    bad = [s for s in eligible if -s.delta > max_drop + 1e-12]
    if bad:
        names = ", ".join(f"{s.name} ({_fmt(s.champion_rate)} -> {_fmt(s.challenger_rate)}, n={s.n})" for s in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return RuleResult(
            "max_slice_regression", False, drop, max_drop,
            f"{len(bad)} slice(s) dropped more than {_fmt(max_drop)}: {names}{more}",
        )
    return RuleResult(
        "max_slice_regression", True, drop, max_drop,
        f"worst slice {worst.name} changes {_fmt(worst.delta)} (allowed drop {_fmt(max_drop)}, "
        f"{len(eligible)} slices with >= {min_size} items)",
    )


def rule_max_regression_failures(reg: RegressionSummary | None, threshold: int) -> RuleResult:
    if reg is None:
        return RuleResult("max_regression_failures", True, None, threshold, "no regression suite recorded; nothing to check")
    counted = reg.new_failures if reg.champion_present else reg.challenger_failures
    what = "items the champion passes and the challenger fails" if reg.champion_present else "challenger failures (no champion)"
    ok = counted <= threshold
    ids = f" (e.g. {', '.join(reg.failed_task_ids[:3])})" if (not ok and reg.failed_task_ids) else ""
    return RuleResult(
        "max_regression_failures", ok, counted, threshold,
        f"{counted} {what} on {reg.suite} ({reg.n} items) {'<=' if ok else '>'} {threshold}{ids}",
    )


def rule_decontaminated(status: DecontaminationStatus, required: bool) -> RuleResult:
    if not required:
        return RuleResult("require_decontaminated", True, status.decontaminated, False, f"not required ({status.basis})")
    ok = status.decontaminated is True
    return RuleResult("require_decontaminated", ok, status.decontaminated, True, status.basis)


@dataclass(frozen=True)
class GateEvidence:
    """Everything the rules look at, computed from the two evaluations and lineage."""

    stats: PairedStats
    slices: tuple[SliceResult, ...]
    regression: RegressionSummary | None
    decontamination: DecontaminationStatus


# Rules whose failure says "can't tell yet", not "worse": with too few items the outcome is
# insufficient evidence unless a blocking rule fails.
EVIDENCE_RULES = frozenset({"min_paired_items", "significance", "min_improvement"})


def decide(evidence: GateEvidence, gate_cfg: GateConfig) -> tuple[str, list[RuleResult]]:
    """Apply every rule (no short-circuit: the report always shows all of them) and return the
    outcome, one of :data:`OUTCOMES`:

    - ``refused`` when a blocking rule fails (``min_pass_rate``, ``max_slice_regression``,
      ``max_regression_failures``, ``require_decontaminated``): evidence of harm needs no large suite;
    - else ``insufficient_evidence`` when fewer than ``min_paired_items`` items were paired;
    - else ``passed`` when the exact test is significant and the lower bound clears
      ``min_improvement``, ``refused`` otherwise.
    """
    s = evidence.stats
    rules = [
        rule_min_paired_items(s, gate_cfg.min_paired_items),
        rule_significance(s),
        rule_min_improvement(s, gate_cfg.min_improvement),
        rule_min_pass_rate(s.challenger_rate, s.n, gate_cfg.min_pass_rate),
        rule_max_slice_regression(evidence.slices, gate_cfg.max_slice_regression, gate_cfg.min_slice_size),
        rule_max_regression_failures(evidence.regression, gate_cfg.max_regression_failures),
        rule_decontaminated(evidence.decontamination, gate_cfg.require_decontaminated),
    ]
    if any(not r.passed for r in rules if r.rule not in EVIDENCE_RULES):
        return "refused", rules
    if not rules[0].passed:
        return "insufficient_evidence", rules
    return ("passed" if all(r.passed for r in rules) else "refused"), rules


# --------------------------------------------------------------------------------------------
# lineage-derived facts (pure: they take entity states, not the store)


def _as_list(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [str(x) for x in v]


def entity_facts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Failure kinds, tool names, cluster, split and origin failure of a failure/eval entity state.

    Tolerant of where the producing stage put them (top level or under ``metadata``), because
    failure and eval payloads are owned by other stages; unknown -> empty.
    """
    md = state.get("metadata") if isinstance(state.get("metadata"), Mapping) else {}
    kinds = _as_list(state.get("failure_kinds") or md.get("failure_kinds") or state.get("kinds") or state.get("kind"))
    tools = _as_list(state.get("tools") if isinstance(state.get("tools"), list) and all(
        isinstance(t, str) for t in state.get("tools")) else md.get("tools"))
    return {
        "kinds": kinds,
        "tools": tools,
        "cluster": state.get("cluster") or md.get("cluster"),
        "split": state.get("split") or md.get("split"),
        "origin_failure": state.get("origin_failure") or md.get("origin_failure") or state.get("failure_id"),
    }


def training_signatures(lineage_states: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """From the challenger's lineage (entity id -> state), the failures its training data came from.

    Returns ``failures`` (failure entity ids), ``clusters``, and ``signatures``: the set of
    ``(failure_kind, tool)`` pairs (tool ``""`` when the failure names none) of those failures and of
    the eval cases built from them.
    """
    failures: set[str] = set()
    clusters: set[str] = set()
    sigs: set[tuple[str, str]] = set()
    for eid, state in lineage_states.items():
        kind = eid.split(":", 1)[0]
        if kind not in ("failure", "eval"):
            continue
        f = entity_facts(state or {})
        if kind == "failure":
            failures.add(eid)
        elif f["origin_failure"]:
            failures.add(str(f["origin_failure"]))
        if f["cluster"]:
            clusters.add(str(f["cluster"]))
        for k in f["kinds"]:
            for t in f["tools"] or [""]:
                sigs.add((k, t))
    return {"failures": failures, "clusters": clusters, "signatures": sigs}


def item_labels(metadata: Mapping[str, Any], training: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Slice labels of one held-out item.

    ``kind:<failure kind>``, ``tool:<tool name>``, ``source:<source>`` from the item's metadata, and
    ``originating_failures`` when the item belongs to the originating-failures slice:

    an item is in it when one of its (failure kind, tool) pairs equals a (failure kind, tool) pair of
    a failure the challenger's training data descends from (lineage: model -> run -> rollouts/synth ->
    env -> suite -> evals -> failures). The held-out split is by failure *cluster*, so the exact
    failures trained on are never in the held-out suite; this slice asks the next best question:
    are failures *of the same kind on the same tool* fixed on evals the model never saw? Items whose
    own cluster or origin failure appears in the training lineage would be contamination; they get
    the label ``contaminated`` (and fail :func:`assess_decontamination`).
    """
    md = metadata or {}
    kinds = _as_list(md.get("failure_kinds"))
    tools = _as_list(md.get("tools"))
    labels = [f"kind:{k}" for k in kinds] + [f"tool:{t}" for t in tools]
    if md.get("source"):
        labels.append(f"source:{md['source']}")
    origin = md.get("origin_outcome") or ("failure" if md.get("origin_failure") else None)
    if origin in ("failure", "success"):
        labels.append(f"origin:{origin}")
    if training:
        sigs = training.get("signatures", set())
        if any((k, t) in sigs for k in kinds for t in (tools or [""])):
            labels.append("originating_failures")
        if (md.get("cluster") and md["cluster"] in training.get("clusters", set())) or (
            md.get("origin_failure") and md["origin_failure"] in training.get("failures", set())
        ):
            labels.append("contaminated")
    return tuple(labels)


def assess_decontamination(
    lineage_states: Mapping[str, Mapping[str, Any]],
    suite_id: str,
    heldout_suite_name: str,
    contaminated_items: Sequence[str] = (),
) -> DecontaminationStatus:
    """Was the challenger's training data decontaminated against ``suite_id`` (``suite:heldout@N``)?

    The rule, from the challenger's lineage (every entity its training descends from):

    1. Not decontaminated if the lineage reaches any version of the held-out suite
       (``suite:<heldout>@*``) or any eval whose split is held-out, or if a held-out item of
       ``suite_id`` shares a failure cluster or origin failure with the lineage
       (``contaminated_items``).
    2. Every synthetic batch (``synth:*``) in the lineage must list exactly ``suite_id`` in its
       ``decontaminated_against`` payload field: decontamination against an older held-out version
       does not cover items added since.
    3. Data built only from train-split evals (no synthetic batch) is decontaminated by
       construction: the split is by failure cluster, so no held-out cluster is in the train split.
    4. No recorded training data at all (no eval, failure or synth in the lineage): unknown
       (``None``), which fails the rule when it is required; a gate cannot vouch for data it cannot see.
    """
    heldout_prefix = f"suite:{heldout_suite_name}@"
    touched = sorted(e for e in lineage_states if e.startswith(heldout_prefix))
    heldout_evals = sorted(
        e for e, s in lineage_states.items()
        if e.startswith("eval:") and str(entity_facts(s or {})["split"] or "").lower() in ("heldout", "held-out", "held_out")
    )
    synth = {e: s for e, s in lineage_states.items() if e.startswith("synth:")}
    evals = [e for e in lineage_states if e.startswith(("eval:", "failure:"))]
    details: dict[str, Any] = {
        "suite": suite_id, "synth_batches": len(synth), "evals_and_failures": len(evals),
    }
    if touched or heldout_evals or contaminated_items:
        details.update(heldout_suites=touched, heldout_evals=heldout_evals[:20], contaminated_items=list(contaminated_items)[:20])
        what = touched[:2] or heldout_evals[:2] or list(contaminated_items)[:2]
        return DecontaminationStatus(False, f"training lineage reaches held-out data ({', '.join(what)})", details)
    missing = sorted(e for e, s in synth.items() if suite_id not in _as_list((s or {}).get("decontaminated_against")))
    if missing:
        details["not_decontaminated"] = missing[:20]
        return DecontaminationStatus(
            False, f"{len(missing)} synthetic batch(es) not decontaminated against {suite_id} (e.g. {missing[0]})", details
        )
    if synth:
        return DecontaminationStatus(True, f"all {len(synth)} synthetic batch(es) decontaminated against {suite_id}", details)
    if evals:
        return DecontaminationStatus(True, f"trained only on train-split evals ({len(evals)} in lineage): clean by construction", details)
    return DecontaminationStatus(None, "no training data recorded in lineage: decontamination cannot be verified", details)


# --------------------------------------------------------------------------------------------
# decision record and report


@dataclass
class GateDecision:
    """The outcome of one gate run. ``numbers`` holds every measured value and threshold.

    ``outcome`` is one of :data:`OUTCOMES`; ``passed`` is ``outcome == "passed"`` (kept for callers
    that only need the yes/no).
    """

    gate_id: str
    outcome: str
    reasons: list[str]
    rules: list[RuleResult]
    numbers: dict[str, Any]
    report_path: Path | None = None
    model: str = ""
    challenger_version: int | None = None
    champion: str | None = None
    suite: str = ""
    cached: bool = False

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"gate outcome must be one of {OUTCOMES} (got {self.outcome!r})")

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def entity_id(self) -> str:
        return self.gate_id

    def to_json(self) -> dict[str, Any]:
        return {
            "gate_id": self.gate_id,
            "outcome": self.outcome,
            "passed": self.passed,
            "p_value": self.numbers.get("p_value"),
            "reasons": self.reasons,
            "rules": [asdict(r) for r in self.rules],
            "numbers": self.numbers,
            "report_path": str(self.report_path) if self.report_path else None,
            "model": self.model,
            "challenger_version": self.challenger_version,
            "champion": self.champion,
            "suite": self.suite,
            "cached": self.cached,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], report_path: Path | None = None) -> GateDecision:
        # Decisions recorded before the third outcome existed carry only ``passed``.
        outcome = payload.get("outcome") or ("passed" if payload.get("passed") else "refused")
        return cls(
            gate_id=payload["entity_id"],
            outcome=outcome,
            reasons=list(payload.get("reasons", [])),
            rules=[RuleResult(**r) for r in payload.get("rules", [])],
            numbers=dict(payload.get("numbers", {})),
            report_path=report_path,
            model=payload.get("model", ""),
            challenger_version=payload.get("challenger_version"),
            champion=payload.get("champion"),
            suite=payload.get("suite", ""),
            cached=True,
        )


def _clean(x: Any) -> Any:
    """JSON-safe numbers: NaN/inf -> None (the event store rejects NaN), numpy scalars -> Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def gate_id_for(inputs: Mapping[str, Any]) -> str:
    """Deterministic gate id from the decision's inputs: re-running the same gate is a no-op."""
    body = json.dumps(_clean(dict(inputs)), sort_keys=True, separators=(",", ":"), default=str)
    return "gate:" + short_id(body, GATE_HEX)


_HEADLINE = {"passed": "PASSED", "refused": "REFUSED", "insufficient_evidence": "INSUFFICIENT EVIDENCE"}


def _pct(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


def render_markdown(decision: GateDecision) -> str:
    """The human-readable report (also logged as an MLflow artifact of the gate run)."""
    n = decision.numbers
    conf = n.get("confidence") or 0.95
    lines = [
        f"# Gate {decision.gate_id}: {_HEADLINE[decision.outcome]}",
        "",
        f"- challenger: `{n.get('challenger')}`",
        f"- champion: `{n.get('champion')}`",
        f"- suite: `{decision.suite}`; regression suite: `{n.get('regression_suite')}`",
        f"- paired items: {n.get('paired_items')} (minimum {n.get('min_paired_items')}; excluded: "
        f"{n.get('infra_excluded')} infra errors, {n.get('nondeterministic_excluded')} non-deterministic, "
        f"{n.get('unpaired')} unpaired)",
        f"- pass rate: champion {_fmt(n.get('champion_pass_rate'))}, challenger {_fmt(n.get('challenger_pass_rate'))}; "
        f"diff {_pct(n.get('diff'))}",
        f"- decision statistic: exact one-sided sign test on the discordant items, {n.get('wins')} wins / "
        f"{n.get('losses')} losses: p = {_fmt4(n.get('p_value'))} (alpha {_fmt4(n.get('alpha'))})",
        f"- one-sided {conf:.0%} lower bound of the difference (Newcombe hybrid score): {_pct(n.get('lower_bound'))}; "
        f"two-sided {conf:.0%} interval [{_pct(n.get('newcombe_lo'))}, {_pct(n.get('newcombe_hi'))}]",
        f"- effect size: paired-bootstrap {conf:.0%} CI [{_pct(n.get('ci_lo'))}, {_pct(n.get('ci_hi'))}] "
        f"({n.get('bootstrap_samples')} samples, seed {n.get('seed')}; descriptive, not the decision)",
        f"- minimum detectable improvement at {n.get('paired_items')} items ({POWER:.0%} power): "
        f"{_pct(n.get('mde'))} with no losses" + (f", {_pct(n.get('mde_observed'))} at the observed disagreement rate"
                                                   if n.get("mde_observed") is not None else ""),
        "- items the observed effect would need (80% power): "
        + (str(n.get("items_needed")) if n.get("items_needed") is not None else "none would do: no improvement observed"),
    ]
    origin = n.get("by_origin") or {}
    if origin:
        lines += ["", "## Fix rate and keep rate", "",
                  "| held-out items from | n | champion | challenger | wins | losses |", "|---|---|---|---|---|---|"]
        for key, label in (("failure", "production failures (fix rate)"), ("success", "production successes (keep rate)")):
            o = origin.get(key)
            if o:
                lines.append(f"| {label} | {o['n']} | {_fmt(o['champion_rate'])} | {_fmt(o['challenger_rate'])} | "
                             f"{o['wins']} | {o['losses']} |")
    lines += [
        "",
        "## Rules",
        "",
        "| rule | result | value | threshold | reason |",
        "|---|---|---|---|---|",
    ]
    for r in decision.rules:
        val = _fmt4(r.value) if isinstance(r.value, float) else r.value
        lines.append(f"| {r.rule} | {'pass' if r.passed else 'FAIL'} | {val} | {r.threshold} | {r.reason.replace('|', '/')} |")
    lines += ["", "## Slices", "", "| slice | n | champion | challenger | delta | wins | losses |", "|---|---|---|---|---|---|---|"]
    for s in n.get("slices", []):
        lines.append(
            f"| {s['name']} | {s['n']} | {_fmt(s['champion_rate'])} | {_fmt(s['challenger_rate'])} | "
            f"{_fmt(s['delta'])} | {s['wins']} | {s['losses']} |"
        )
    if n.get("win_ids") or n.get("loss_ids"):
        lines += ["", "## Item-level changes", ""]
        lines.append("- wins: " + (", ".join(f"`{t}`" for t in n.get("win_ids", [])) or "none"))
        lines.append("- losses: " + (", ".join(f"`{t}`" for t in n.get("loss_ids", [])) or "none"))
    if n.get("infra_error_ids"):
        lines += ["", "## Infrastructure errors (excluded from both sides)", ""]
        lines += [f"- `{t}`" for t in n["infra_error_ids"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# the stage: run_gate, a list of the steps below


def _lineage_states(store: EventStore, entity_id: str | None) -> dict[str, dict[str, Any]]:
    if not entity_id:
        return {}
    states: dict[str, dict[str, Any]] = {}
    for eid, _depth in store.lineage(entity_id, "down"):
        ent = store.entity(eid)
        states[eid] = (ent or {}).get("state") or {}
    return states


def _champion_ref(cfg: FlywheelConfig, tracker: Tracker, challenger_version: int) -> ModelRef:
    """The registered ``champion`` alias, else the challenger's base model (the first promotion must
    beat the model it was trained from)."""
    name = cfg.cycle.model_name
    v = tracker.get_alias_version(name, "champion")
    if v is not None:
        if int(v) == int(challenger_version):
            raise GateError(f"model:{name}/{challenger_version} is already the champion; nothing to gate")
        return ModelRef.registered(name, int(v))
    tags = dict(getattr(tracker.model_version(name, challenger_version), "tags", {}) or {})
    base = tags.get("base_model") or cfg.policy.base_model
    if base.startswith("model:"):  # trained from a registered full model: that version is the baseline
        return ModelRef.registered(*parse_model_entity(base))
    return ModelRef.base(base)


def _regression_summary(ch: EvalResult, cp: EvalResult | None, champion_present: bool) -> RegressionSummary:
    chr_ = ch.by_task()
    cpr = cp.by_task() if cp is not None else {}
    n = infra = failures = new = 0
    failed: list[str] = []
    for tid, row in chr_.items():
        other = cpr.get(tid)
        if row["infra_error"] is not None or (other is not None and other["infra_error"] is not None):
            infra += 1
            continue
        n += 1
        if not row["passed"]:
            failures += 1
            if champion_present and other is not None and other["passed"]:
                new += 1
                failed.append(tid)
            elif not champion_present:
                failed.append(tid)
    return RegressionSummary(ch.suite, n, failures, new, champion_present, infra, tuple(failed[:20]))


def _load_suite(store: EventStore, artifacts: ArtifactStore, spec: Suite | str, what: str) -> Suite | None:
    """The suite ``spec`` names; ``None`` when no such version is recorded. A recorded suite whose
    artifact is missing, corrupt or malformed raises :class:`GateError`: a gate never decides (and
    a rule never passes) on a suite it could not read."""
    if not isinstance(spec, str):
        return spec
    try:
        recorded = versioned_event(store, "suite", "suite.versioned", spec)
    except ValueError as e:
        raise GateError(f"{what} suite {spec!r}: {e}") from None
    if recorded is None:
        return None
    try:
        return load_suite(store, artifacts, spec)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the gate must not go on
        raise GateError(f"{what} suite {spec!r} is recorded but unreadable: {type(e).__name__}: {e}") from None


# What passes between the steps of run_gate.


@dataclass(frozen=True)
class _Contestants:
    """The challenger ``model:<name>/<version>`` and the champion it must beat."""

    name: str
    version: int
    challenger: ModelRef
    champion: ModelRef


@dataclass(frozen=True)
class _GateSuites:
    """The held-out suite the gate decides on, and the regression suite (``None``: none recorded)."""

    heldout: Suite
    heldout_id: str  # suite:<name>@N
    heldout_name: str
    regression: Suite | None


@dataclass(frozen=True)
class _RegressionEvaluations:
    """Both models on the regression suite."""

    suite: Suite
    challenger: EvalResult
    champion: EvalResult


@dataclass(frozen=True)
class _Evaluations:
    """Both models on the held-out suite and, when the regression suite has items, on it."""

    challenger: EvalResult
    champion: EvalResult
    regression: _RegressionEvaluations | None

    @property
    def regression_ids(self) -> list[str]:
        r = self.regression
        return [] if r is None else [r.challenger.evaluation_id, r.champion.evaluation_id]


@dataclass(frozen=True)
class _Pairing:
    """The held-out items scored for both models, and what was kept out of the comparison."""

    paired: tuple[PairedItem, ...]
    infra_ids: tuple[str, ...]  # an infrastructure error on either side
    nondeterministic: int
    unpaired: int  # scored for one model only
    contaminated: tuple[str, ...]  # share a cluster or origin failure with the training lineage


@dataclass(frozen=True)
class _Assessment:
    """The evidence, every rule applied to it, and the outcome."""

    pairing: _Pairing
    evidence: GateEvidence
    outcome: str
    rules: tuple[RuleResult, ...]
    include_nondeterministic: bool
    training_failures: int  # failures the challenger's training data descends from


# The steps of run_gate, in order.


def _contestants(cfg: FlywheelConfig, store: EventStore, tracker: Tracker, model_version: int) -> _Contestants:
    name = cfg.cycle.model_name
    version = int(model_version)
    try:
        tracker.model_version(name, version)
    except Exception as e:
        raise GateError(f"model:{name}/{version} is not a registered model version: {e}") from None
    challenger = ModelRef.registered(name, version)
    reconcile_champion(store, tracker, name)  # complete an interrupted promotion before comparing with it
    return _Contestants(name, version, challenger, _champion_ref(cfg, tracker, version))


def _gate_suites(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, suite: Suite | str | None) -> _GateSuites:
    spec = suite if suite is not None else cfg.cycle.heldout_suite
    heldout = _load_suite(store, artifacts, spec, "held-out")
    if heldout is None:
        raise GateError(f"suite {spec!r} has no such version; run `flywheel evals build` first")
    suite_id = str(heldout.entity_id)
    heldout_name = parse_suite_spec(suite_id)[0]
    # No regression suite recorded yet: the rule says so. One recorded but unreadable: an error.
    regression = _load_suite(store, artifacts, cfg.cycle.regression_suite, "regression")
    return _GateSuites(heldout, suite_id, heldout_name, regression)


def _evaluate(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    models: _Contestants,
    suites: _GateSuites,
    policy_loader: PolicyLoader | None,
    correlation_id: str | None,
) -> _Evaluations:
    # Looked up on the module at call time, so a replaced flywheel.evaluate.default_policy_loader is used.
    base_loader = policy_loader or evaluate.default_policy_loader(cfg, tracker)
    loaded: dict[ModelRef, object] = {}

    def load_once(ref: ModelRef) -> object:  # held-out and regression suites share one loaded model
        if ref not in loaded:
            loaded[ref] = base_loader(ref)
        return loaded[ref]

    def on(model: ModelRef, suite: Suite) -> EvalResult:
        return evaluate_model(cfg, store, artifacts, tracker, model, suite,
                              policy_loader=load_once, correlation_id=correlation_id)

    ch_eval = on(models.challenger, suites.heldout)
    cp_eval = on(models.champion, suites.heldout)
    reg = suites.regression
    if reg is None or len(list(reg.tasks)) == 0:
        return _Evaluations(ch_eval, cp_eval, None)
    return _Evaluations(ch_eval, cp_eval, _RegressionEvaluations(reg, on(models.challenger, reg), on(models.champion, reg)))


def _pair_heldout(ch_eval: EvalResult, cp_eval: EvalResult, training: Mapping[str, Any], include_nd: bool) -> _Pairing:
    ch_rows, cp_rows = ch_eval.by_task(), cp_eval.by_task()
    paired: list[PairedItem] = []
    infra_ids: list[str] = []
    nondet = unpaired = 0
    contaminated: list[str] = []
    for tid, a in ch_rows.items():
        b = cp_rows.get(tid)
        if b is None:
            unpaired += 1
            continue
        if a["infra_error"] is not None or b["infra_error"] is not None:
            infra_ids.append(tid)
            continue
        if not include_nd and not (a["deterministic"] and b["deterministic"]):
            nondet += 1
            continue
        labels = item_labels(a, training)
        if "contaminated" in labels:
            contaminated.append(tid)
        paired.append(PairedItem(tid, bool(b["passed"]), bool(a["passed"]), labels))
    unpaired += sum(1 for tid in cp_rows if tid not in ch_rows)
    return _Pairing(tuple(paired), tuple(infra_ids), nondet, unpaired, tuple(contaminated))


def _assess(cfg: FlywheelConfig, store: EventStore, models: _Contestants, suites: _GateSuites,
            evals: _Evaluations) -> _Assessment:
    """Pair the held-out items, compute the evidence and apply the rules."""
    lineage = _lineage_states(store, models.challenger.entity_id)
    training = training_signatures(lineage)
    include_nd = bool(cfg.evals.include_llm_judge_in_gate)
    pairing = _pair_heldout(evals.challenger, evals.champion, training, include_nd)
    g = cfg.gate
    paired = pairing.paired
    stats = paired_stats([p.champion for p in paired], [p.challenger for p in paired],
                         confidence=g.confidence, bootstrap_samples=g.bootstrap_samples, seed=g.seed)
    slices = compute_slices(paired)
    r = evals.regression
    regression = _regression_summary(r.challenger, r.champion, not models.champion.is_base) if r is not None else None
    decon = assess_decontamination(lineage, suites.heldout_id, suites.heldout_name, pairing.contaminated)
    evidence = GateEvidence(stats, tuple(slices), regression, decon)
    outcome, rules = decide(evidence, g)
    return _Assessment(pairing, evidence, outcome, tuple(rules), include_nd, len(training["failures"]))


def _gate_id(gate_cfg: GateConfig, evals: _Evaluations, a: _Assessment) -> str:
    """``gate:<hash>`` of everything the decision depends on."""
    return gate_id_for({
        "challenger": evals.challenger.evaluation_id, "champion": evals.champion.evaluation_id,
        "regression": evals.regression_ids,
        "gate": gate_cfg.model_dump(), "include_nondeterministic": a.include_nondeterministic,
        "decontamination": a.evidence.decontamination.basis,
    })


def _reasons(a: _Assessment) -> list[str]:
    stats, rules = a.evidence.stats, a.rules
    if a.outcome == "passed":
        return [f"challenger beats champion: {_fmt(stats.challenger_rate)} vs {_fmt(stats.champion_rate)} on "
                f"{stats.n} items, {stats.wins} wins / {stats.losses} losses, p = {stats.p_value:.4g}"]
    if a.outcome == "insufficient_evidence":
        return [rules[0].reason] + [r.reason for r in rules[1:] if not r.passed and r.rule not in EVIDENCE_RULES]
    return [r.reason for r in rules if not r.passed and r.rule != "min_paired_items"]


def _by_origin(slices: Sequence[SliceResult]) -> dict[str, dict[str, int | float]]:
    """The fix rate (held-out production failures) and the keep rate (held-out successes)."""
    by_origin: dict[str, dict[str, int | float]] = {}
    for key in ("failure", "success"):
        sl = next((x for x in slices if x.name == f"origin:{key}"), None)
        if sl is not None:
            by_origin[key] = {"n": sl.n, "champion_rate": sl.champion_rate, "challenger_rate": sl.challenger_rate,
                              "wins": sl.wins, "losses": sl.losses}
    return by_origin


def _numbers(g: GateConfig, models: _Contestants, suites: _GateSuites, evals: _Evaluations,
             a: _Assessment) -> dict[str, Any]:
    """Every measured value and threshold of the decision (JSON-safe)."""
    ch_eval, cp_eval, reg_suite = evals.challenger, evals.champion, suites.regression
    stats, boot, pairing, paired = a.evidence.stats, a.evidence.stats.boot, a.pairing, a.pairing.paired
    slices, regression, decon = a.evidence.slices, a.evidence.regression, a.evidence.decontamination
    return _clean({
        "outcome": a.outcome,
        "challenger": str(models.challenger), "champion": str(models.champion), "suite": suites.heldout_id,
        "regression_suite": str(reg_suite.entity_id) if reg_suite is not None else None,
        "challenger_evaluation": ch_eval.evaluation_id, "champion_evaluation": cp_eval.evaluation_id,
        "challenger_evaluation_cached": ch_eval.cached, "champion_evaluation_cached": cp_eval.cached,
        "decoding": ch_eval.decoding,
        "items": ch_eval.n_items, "paired_items": stats.n, "min_paired_items": g.min_paired_items,
        "infra_excluded": len(pairing.infra_ids), "nondeterministic_excluded": pairing.nondeterministic,
        "unpaired": pairing.unpaired,
        "infra_error_ids": pairing.infra_ids[:50],
        "champion_pass_rate": stats.champion_rate, "challenger_pass_rate": stats.challenger_rate,
        "champion_passed": stats.both + stats.losses, "challenger_passed": stats.both + stats.wins,
        "diff": stats.diff, "p_value": stats.p_value, "alpha": stats.alpha, "lower_bound": stats.lower_bound,
        "newcombe_lo": stats.newcombe_lo, "newcombe_hi": stats.newcombe_hi,
        "ci_lo": boot.lo, "ci_hi": boot.hi, "confidence": g.confidence,
        "bootstrap_samples": boot.samples, "seed": boot.seed,
        "mde": stats.mde, "mde_observed": stats.mde_observed, "items_needed": stats.items_needed,
        "wins": stats.wins, "losses": stats.losses, "ties": stats.ties, "both_pass": stats.both,
        "both_fail": stats.neither,
        "by_origin": _by_origin(slices),
        "win_ids": [p.task_id for p in paired if p.challenger and not p.champion][:50],
        "loss_ids": [p.task_id for p in paired if p.champion and not p.challenger][:50],
        "slices": [{**asdict(s), "delta": s.delta} for s in slices],
        "regression": asdict(regression) if regression else None,
        "decontamination": asdict(decon),
        "training_failures": a.training_failures,
        "thresholds": g.model_dump(),
    })


def _write_report(report_path: Path, md: str, artifacts: ArtifactStore) -> ArtifactRef:
    """``md`` at ``report_path`` (written whole or not at all) and in the artifact store."""
    report_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = report_path.with_name(f".{report_path.name}.tmp")
    tmp.write_text(md)
    tmp.replace(report_path)
    return artifacts.put_bytes(md.encode(), "md")


def _consumes(models: _Contestants, suites: _GateSuites, evals: _Evaluations) -> list[str]:
    """The causation of ``gate.decided``: models, suite versions and evaluations."""
    r = evals.regression
    return [c for c in (models.challenger.entity_id, models.champion.entity_id, suites.heldout_id,
                        str(r.suite.entity_id) if r is not None else None,
                        evals.challenger.evaluation_id, evals.champion.evaluation_id,
                        *evals.regression_ids) if c]


def _evidence_items(paired: Sequence[PairedItem]) -> list[dict[str, object]]:
    """One row per paired held-out item, for ``gate_items.json``."""
    return [{"item": p.task_id, "slice": ", ".join(p.labels), "champion_pass": p.champion,
             "challenger_pass": p.challenger,
             "change": ("win" if p.challenger else "loss") if p.champion != p.challenger
             else ("both pass" if p.champion else "both fail")} for p in paired]


def _datasets(suites: _GateSuites, evals: _Evaluations) -> list[DatasetSpec]:
    """The suites the gate evaluated on, as MLflow dataset inputs of its run."""
    reg = evals.regression.suite if evals.regression is not None else None
    return [DatasetSpec(str(s.entity_id), "evaluation", s.version_hash, len(s.tasks),
                        source={"artifact": f"sha256:{(s.artifact or {}).get('sha256')}", "role": role})
            for s, role in ((suites.heldout, "held-out"), (reg, "regression")) if s is not None]


def _log_run(
    tracker: Tracker,
    g: GateConfig,
    decision: GateDecision,
    md: str,
    a: _Assessment,
    suites: _GateSuites,
    evals: _Evaluations,
    consumes: list[str],
    version: int,
    correlation_id: str | None,
) -> str:
    """The MLflow run ``gate``: thresholds, numbers, report, item-level evidence, version tags. Its run id."""
    outcome, numbers = decision.outcome, decision.numbers
    with tracker.run("gate", consumes=consumes, produces=[decision.gate_id], correlation_id=correlation_id,
                     tags={"flywheel.gate.passed": str(outcome == "passed").lower(),
                           "flywheel.gate.outcome": outcome}) as run:
        run.log_params({f"gate.{k}": v for k, v in g.model_dump().items()})
        run.log_metrics({k: numbers[k] for k in (
            "champion_pass_rate", "challenger_pass_rate", "diff", "p_value", "lower_bound", "ci_lo", "ci_hi",
            "wins", "losses", "ties", "paired_items", "infra_excluded", "mde") if isinstance(numbers.get(k), int | float)})
        run.log_metrics({"passed": float(outcome == "passed")})
        run.log_text(md, "gate_report.md")
        tracker.log_gate_evidence(
            run, model=decision.model, version=version,
            items=_evidence_items(a.pairing.paired),
            rules=[asdict(r) for r in a.rules],
            datasets=_datasets(suites, evals),
            version_tags={"gate.outcome": outcome, "gate.p_value": f"{a.evidence.stats.p_value:.6g}",
                          "gate.id": decision.gate_id, "gate.champion": decision.champion, "gate.suite": decision.suite},
        )
        run_id = run.run_id
    return run_id


def _decided_payload(decision: GateDecision, md_ref: ArtifactRef, run_id: str) -> dict[str, Any]:
    """The payload of ``gate.decided``."""
    return {
        "entity_id": decision.gate_id, "outcome": decision.outcome, "passed": decision.outcome == "passed",
        "p_value": decision.numbers["p_value"],
        "reasons": decision.reasons,
        "rules": [_clean(asdict(r)) for r in decision.rules], "numbers": decision.numbers,
        "model": decision.model, "challenger_version": decision.challenger_version, "champion": decision.champion,
        "suite": decision.suite,
        "report": md_ref.to_dict(), "mlflow_run_id": run_id,
    }


def run_gate(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    model_version: int,
    *,
    suite: Suite | str | None = None,
    correlation_id: str | None = None,
    policy_loader: PolicyLoader | None = None,
) -> GateDecision:
    """Gate ``model:<[cycle] model_name>/<model_version>`` against the champion on ``suite``.

    ``suite``: a suite object or spec (default: the latest version of ``[cycle] heldout_suite``).
    The regression suite (``[cycle] regression_suite``, latest version) is used when one exists.
    Appends one ``gate.decided`` event (``gate:<hash of the inputs>``, causation: challenger,
    champion, suite versions, evaluations), writes ``<home>/reports/gate/<id>.md`` and logs it to an
    MLflow run named ``gate``. Re-running with the same inputs returns the recorded decision
    (``cached=True``) without evaluating or logging again.

    Raises :class:`GateError` (or :class:`flywheel.evaluate.EvaluationError`) when the gate cannot be
    evaluated; a refusal is a normal return with ``passed=False``.
    """
    models = _contestants(cfg, store, tracker, model_version)
    suites = _gate_suites(cfg, store, artifacts, suite)
    evals = _evaluate(cfg, store, artifacts, tracker, models, suites, policy_loader, correlation_id)
    a = _assess(cfg, store, models, suites, evals)

    gate_id = _gate_id(cfg.gate, evals, a)
    report_path = Path(cfg.home) / "reports" / "gate" / f"{gate_id.split(':', 1)[1]}.md"
    prior = store.read(stream=gate_id, types="gate.decided")
    if prior:
        return GateDecision.from_payload(prior[-1].payload, report_path if report_path.exists() else None)

    decision = GateDecision(
        gate_id=gate_id, outcome=a.outcome, reasons=_reasons(a), rules=list(a.rules),
        numbers=_numbers(cfg.gate, models, suites, evals, a), report_path=report_path, model=models.name,
        challenger_version=models.version, champion=str(models.champion), suite=suites.heldout_id,
    )
    md = render_markdown(decision)
    md_ref = _write_report(report_path, md, artifacts)
    consumes = _consumes(models, suites, evals)
    run_id = _log_run(tracker, cfg.gate, decision, md, a, suites, evals, consumes, models.version, correlation_id)
    store.append(gate_id, NewEvent("gate.decided", _decided_payload(decision, md_ref, run_id), consumes),
                 correlation_id=correlation_id)
    return decision
