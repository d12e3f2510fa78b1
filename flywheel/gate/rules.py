"""The gate's rules: each ``rule_*`` function is a pure function of the evidence (:class:`GateEvidence`:
the paired statistics, the slices, the regression suite, the decontamination status) and a
threshold of ``[gate]``; :func:`decide` applies them all and returns one of :data:`OUTCOMES`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.config import GateConfig
from flywheel.stats import POWER, PairedStats, SliceResult

OUTCOMES = ("passed", "refused", "insufficient_evidence")


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


def rule_max_slice_regression(slices: Sequence[SliceResult], max_drop: float, min_size: int,
                              min_net_losses: int = 1) -> RuleResult:
    """No slice of at least ``min_size`` items drops by more than ``max_drop`` with at least
    ``min_net_losses`` more items lost than won (1: any such drop fails)."""
    eligible = [s for s in slices if s.n >= min_size]
    if not eligible:
        return RuleResult(
            "max_slice_regression", True, None, max_drop,
            f"no slice has >= {min_size} paired items; nothing to check",
        )
    worst = min(eligible, key=lambda s: (s.delta, s.name))
    drop = -worst.delta
    # A tiny epsilon so that a drop of exactly the threshold (0.1 from 0.6 -> 0.5) is allowed.
    dropped = [s for s in eligible if -s.delta > max_drop + 1e-12]
    bad = [s for s in dropped if s.losses - s.wins >= min_net_losses]
    if bad:
        names = ", ".join(f"{s.name} ({_fmt(s.champion_rate)} -> {_fmt(s.challenger_rate)}, n={s.n}, "
                          f"{s.wins} won / {s.losses} lost)" for s in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return RuleResult(
            "max_slice_regression", False, drop, max_drop,
            f"{len(bad)} slice(s) dropped more than {_fmt(max_drop)}: {names}{more}",
        )
    if dropped:
        names = ", ".join(f"{s.name} ({_fmt(s.delta)}, n={s.n}, {s.wins} won / {s.losses} lost)" for s in dropped[:3])
        return RuleResult(
            "max_slice_regression", True, drop, max_drop,
            f"{names}: dropped more than {_fmt(max_drop)} by fewer than {min_net_losses} net lost items, which "
            f"a challenger better everywhere shows somewhere by chance; {len(eligible)} slices with >= {min_size} items",
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
        rule_max_slice_regression(evidence.slices, gate_cfg.max_slice_regression, gate_cfg.min_slice_size,
                                  gate_cfg.min_slice_net_losses),
        rule_max_regression_failures(evidence.regression, gate_cfg.max_regression_failures),
        rule_decontaminated(evidence.decontamination, gate_cfg.require_decontaminated),
    ]
    if any(not r.passed for r in rules if r.rule not in EVIDENCE_RULES):
        return "refused", rules
    if not rules[0].passed:
        return "insufficient_evidence", rules
    return ("passed" if all(r.passed for r in rules) else "refused"), rules


