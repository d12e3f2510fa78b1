"""Collecting the evidence, the first steps of :func:`flywheel.gate.run_gate`: the contestants
(challenger and champion), the suites, both models evaluated on them (cached, see
:mod:`flywheel.evaluate`), the held-out items paired, and the rules applied (:func:`_assess`).
:class:`GateError` is raised when the gate cannot be evaluated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flywheel import evaluate
from flywheel.artifacts import ArtifactStore
from flywheel.champion import reconcile_champion
from flywheel.config import FlywheelConfig
from flywheel.evaluate import EvalResult, ModelRef, PolicyLoader, evaluate_model, parse_suite_spec
from flywheel.gate.lineage import assess_decontamination, item_labels, training_signatures
from flywheel.gate.rules import GateEvidence, RegressionSummary, RuleResult, decide
from flywheel.stats import PairedItem, compute_slices, paired_stats
from flywheel.store import EventStore
from flywheel.tracking import Tracker
from flywheel.versioning import Suite, load_suite, versioned_event
from flywheel.vocab.refs import parse_model_entity


class GateError(RuntimeError):
    """The gate could not be evaluated (missing suite, unreadable artifact, unknown model, ...): an
    error, never a refusal and never a pass."""


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


