"""Recording a decision, the last steps of :func:`flywheel.gate.run_gate`: its id, reasons and numbers,
the report file, the MLflow run ``gate`` (thresholds, numbers, report, item-level evidence) and the
payload of the ``gate.decided`` event."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flywheel.artifacts import ArtifactRef, ArtifactStore
from flywheel.config import GateConfig
from flywheel.gate.decision import GateDecision, _clean, gate_id_for
from flywheel.gate.evidence import _Assessment, _Contestants, _Evaluations, _GateSuites
from flywheel.gate.rules import EVIDENCE_RULES, _fmt
from flywheel.stats import PairedItem, SliceResult
from flywheel.tracking import DatasetSpec, Tracker


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


def _truncation(evals: _Evaluations, paired: Sequence[PairedItem]) -> dict[str, Any]:
    """How many paired held-out answers stopped at the decoding budget (``max_new_tokens``).

    A cut-off call rarely parses, so an item both models failed with an answer cut short
    (``undecided_ids``) is a tie the sign test ignores that a larger ``gate.max_new_tokens`` might turn
    into a win or a loss -- or not: a base model that rambles is cut at any budget. ``counted`` is false
    when an evaluation was recorded before answers were counted (its rows have no ``n_truncated``)."""
    ch, cp = evals.challenger.by_task(), evals.champion.by_task()

    def cut(rows: Mapping[str, Mapping[str, Any]], tid: str) -> bool:
        return bool((rows.get(tid) or {}).get("n_truncated"))

    ids = [p.task_id for p in paired]
    undecided = [p.task_id for p in paired if not p.champion and not p.challenger and (cut(ch, p.task_id) or cut(cp, p.task_id))]
    return {
        "max_new_tokens": evals.challenger.decoding.get("max_new_tokens"),
        "counted": all(r.get("n_truncated") is not None for rows in (ch, cp) for r in rows.values()),
        "challenger": sum(cut(ch, t) for t in ids), "champion": sum(cut(cp, t) for t in ids),
        "undecided": len(undecided), "undecided_ids": undecided[:50],
    }


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
        "truncated": _truncation(evals, paired),
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


