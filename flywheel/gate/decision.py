"""The decision record (:class:`GateDecision`), its deterministic id (:func:`gate_id_for`) and its
human-readable report (:func:`render_markdown`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flywheel.gate.rules import OUTCOMES, RuleResult, _fmt, _fmt4
from flywheel.stats import POWER
from flywheel.vocab.ids import GATE_HEX, short_id


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
    cut = n.get("truncated") or {}
    if cut.get("challenger") or cut.get("champion"):
        lines.append(
            f"- answers cut at max_new_tokens ({cut.get('max_new_tokens')}): challenger {cut.get('challenger')}, "
            f"champion {cut.get('champion')} of {n.get('paired_items')} paired items; {cut.get('undecided')} both "
            "failed with an answer cut short: ties a larger `gate.max_new_tokens` could change (a model that "
            "rambles, as a base model does, fails them at any budget)")
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


