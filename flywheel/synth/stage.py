"""The synth stage: one batch from the training environment's seeds, through the generators and
the funnel, to a new environment version and one recorded ``synth.batch_accepted`` event.

Records and identity
--------------------
- Candidate ids are content hashes ``synth:<16 hex>`` of (prompt, verifier, harness, reference).
- The batch id ``synth:b-<16 hex>`` hashes the environment name, the suites its seeds come from, the
  seeds' content, the generators and their parameters, the seed, ``per_seed`` (or the plan: variants
  per generator, when one is given), the dedup and
  decontamination settings, the held-out suite version, and (with the difficulty filter) the policy.
  It deliberately does not hash the environment *version*: accepting a batch creates a new one, and
  re-running the same batch must find the batch already recorded and append nothing.
- Accepted tasks go into the environment as a new version (:func:`flywheel.versioning.add_tasks_to_env`),
  then one ``synth.batch_accepted`` event on ``synth:b-<id>`` records the funnel counts, rejections
  by reason, the accepted and rejected Parquet artifacts, the held-out suite version it was checked
  against and the new environment version; causation = the environment version it widened and the
  seed evals. Crash between the two appends: the re-run excludes its own batch's tasks from the
  dedup reference, recomputes the same accepted set, finds the env already holding it (no new
  version) and records the event.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.contamination import protected_texts, synthetic_batches, synthetic_tasks
from flywheel.dedup import SemanticIndex, _semantic_model_dir
from flywheel.policy.base import Policy
from flywheel.store import EventStore, NewEvent
from flywheel.synth.funnel import (
    FUNNEL,
    Rejection,
    _reject,
    check_solvable,
    decontaminate,
    dedup_candidates,
    measure_difficulty,
    validate_candidates,
)
from flywheel.synth.generators import (
    Candidate,
    Generator,
    Progress,
    generate_candidates,
    generate_planned,
    make_generators,
)
from flywheel.synth.keys import SYNTH_VERSION, seed_tasks
from flywheel.verifiers import VerifyContext
from flywheel.versioning import Env, Suite, add_tasks_to_env, load_env, load_suite
from flywheel.vocab.ids import canonical_json, json_id


@dataclass
class SynthSummary:
    """What one :func:`run_synth` did."""

    batch: str
    env: str | None
    widened_env: str | None
    counts: dict[str, int]
    rejected_by_reason: dict[str, int]
    by_generator: dict[str, dict[str, int]] = field(default_factory=dict)
    not_applicable: int = 0
    seeds: int = 0
    accepted_artifact: dict | None = None
    rejected_artifact: dict | None = None
    decontaminated_against: list[str] = field(default_factory=list)
    gx: dict = field(default_factory=dict)
    new: bool = True
    events_appended: int = 0
    seconds: float = 0.0
    accepted_ids: list[str] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    plan: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "env": self.env,
            "widened_env": self.widened_env,
            "seeds": self.seeds,
            "funnel": {k: self.counts.get(k, 0) for k in FUNNEL},
            "rejected_by_reason": dict(self.rejected_by_reason),
            "by_generator": self.by_generator,
            "not_applicable": self.not_applicable,
            "accepted_artifact": self.accepted_artifact,
            "rejected_artifact": self.rejected_artifact,
            "decontaminated_against": list(self.decontaminated_against),
            "gx": self.gx,
            "new": self.new,
            "events_appended": self.events_appended,
            "seconds": round(self.seconds, 3),
            "plan": dict(self.plan) if self.plan is not None else None,
        }


def batch_id(*, env_name: str, suites: Sequence[str], seeds: Sequence[dict], generators: Sequence[Generator],
             per_seed: int | None, seed: int, settings: dict, heldout: str | None, policy: str | None = None,
             plan: dict[str, int] | None = None) -> str:
    """``synth:b-<16 hex>``; see the module docstring for what it hashes and why (a ``plan`` is
    hashed only when given, so batches recorded before plans existed keep their ids)."""
    return "synth:b-" + json_id({
        **({"plan": dict(sorted(plan.items()))} if plan is not None else {}),
        "v": SYNTH_VERSION,
        "env": env_name,
        "suites": sorted(suites),
        "seeds": [[s["task_id"], json_id({k: s.get(k) for k in ("prompt", "verifier", "reference")})] for s in seeds],
        "generators": {g.name: g.params for g in generators},
        "per_seed": per_seed,
        "seed": seed,
        "settings": settings,
        "heldout": heldout,
        "policy": policy,
    })


def reattest_batches(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, suite: Suite, *,
                     correlation_id: str | None = None) -> dict[str, Any]:
    """Check every recorded batch that was not decontaminated against ``suite`` (a held-out suite
    version that grew since) against it, and record the result as ``synth.batch_rechecked``.

    A batch whose accepted tasks are all clean gets ``suite`` added to its ``decontaminated_against``
    (the gate's decontamination rule reads it); a batch with a contaminated task keeps its list and
    records the pairs (``contaminated``), so a gate on ``suite`` refuses any model trained on it and
    says why. The evals stage keeps new held-out items away from recorded synthetic tasks
    (:func:`flywheel.contamination.contaminated_by_synthetic`), so the second case needs thresholds changed in between.
    """
    ref = str(suite.entity_id)
    protected = protected_texts(store, suite)
    out: dict[str, Any] = {"rechecked": [], "contaminated": {}}
    for ev, tasks in synthetic_batches(store, artifacts):
        bid = ev.stream
        latest = store.read(stream=bid)[-1]
        done = list(latest.payload.get("decontaminated_against") or [])
        if ref in done:
            continue
        cands = [Candidate(task=t, generator=str((t.get("metadata") or {}).get("generator")),
                           seed_ids=[str((t.get("metadata") or {}).get("seed_task"))]) for t in tasks]
        _, rejected = decontaminate(cands, protected, jaccard_threshold=cfg.synth.contamination_jaccard,
                                    ngram=cfg.synth.contamination_ngram)
        pairs = [[r.task_id, r.matched] for r in rejected]
        payload = {**latest.payload, "rechecked_against": ref, "contaminated": pairs,
                   "decontaminated_against": done if pairs else [*done, ref]}
        # No causation: an edge to the held-out suite would put it in the lineage of every model
        # trained on this batch, which is what decontamination forbids.
        store.append(bid, NewEvent("synth.batch_rechecked", payload, []),
                     expected_version=latest.stream_version, correlation_id=correlation_id)
        out["rechecked"].append(bid)
        if pairs:
            out["contaminated"][bid] = pairs[:20]
    return out


def _tables(accepted: list[Candidate], rejections: list[Rejection], by_id: dict[str, Candidate]) -> tuple[pa.Table, pa.Table]:
    acc = pa.table({
        "task_id": pa.array([c.task_id for c in accepted], pa.string()),
        "seed_task": pa.array([c.seed_ids[0] for c in accepted], pa.string()),
        "generator": pa.array([c.generator for c in accepted], pa.string()),
        "task_json": pa.array([canonical_json(c.task) for c in accepted], pa.string()),
    })
    rej = pa.table({
        "task_id": pa.array([r.task_id for r in rejections], pa.string()),
        "seed_task": pa.array([r.seed_task for r in rejections], pa.string()),
        "generator": pa.array([r.generator for r in rejections], pa.string()),
        "stage": pa.array([r.stage for r in rejections], pa.string()),
        "reason_kind": pa.array([r.reason_kind for r in rejections], pa.string()),
        "reason": pa.array([r.reason for r in rejections], pa.string()),
        "matched": pa.array([r.matched for r in rejections], pa.string()),
        "similarity": pa.array([r.similarity for r in rejections], pa.float64()),
        "task_json": pa.array([canonical_json(by_id[r.task_id].task) if r.task_id in by_id else None
                               for r in rejections], pa.string()),
    })
    return acc, rej


@dataclass(frozen=True)
class _Selection:
    """Which generators make the batch, and how many variants: ``per_seed`` each, or a ``plan``."""

    names: list[str]
    generators: list[Generator]
    per_seed: int | None
    plan: dict[str, int] | None


@dataclass(frozen=True)
class _Inputs:
    """What the batch widens and is checked against: the environment, its seeds, the held-out suite."""

    env: Env
    seeds: list[dict]
    suite: Suite | None

    @property
    def heldout_ref(self) -> str | None:
        return self.suite.entity_id if self.suite else None


@dataclass(frozen=True)
class _Identity:
    """The batch id and the settings it hashes (and the event records)."""

    batch: str
    settings: dict[str, Any]
    difficulty_on: bool
    policy_id: str | None
    uses_policy: bool


@dataclass(frozen=True)
class _Funnel:
    """What went through the funnel: the candidates, the accepted ones, every rejection and the counts."""

    candidates: list[Candidate]
    by_id: dict[str, Candidate]
    not_applicable: int
    accepted: list[Candidate]
    rejections: list[Rejection]
    counts: dict[str, int]
    gx: dict


def _select(cfg: FlywheelConfig, *, per_seed: int | None, generators: Sequence[str] | None, policy: Policy | None,
            generator_params: dict[str, dict] | None, plan: dict[str, int] | None) -> _Selection:
    """The generators and counts of the batch, from ``plan``, else the arguments, else ``cfg.synth``."""
    scfg = cfg.synth
    if plan is not None:
        bad = {g: n for g, n in plan.items() if isinstance(n, bool) or not isinstance(n, int) or n < 0}
        if bad:
            raise ValueError(f"plan counts must be non-negative integers, got {bad}")
        plan = {g: int(n) for g, n in plan.items() if n > 0}
        names = list(plan)
        per_seed = None
        if not names:
            raise ValueError("the synth plan gives no generator any variant")
    else:
        per_seed = scfg.per_seed if per_seed is None else int(per_seed)
        names = list(generators if generators is not None else scfg.generators)
    if not names:
        raise ValueError("no synth generators selected")
    gens = make_generators(names, generator_params)
    if "paraphrase" in names and policy is None:
        raise ValueError("the paraphrase generator needs a policy; drop 'paraphrase' from the generators or pass one")
    return _Selection(names=names, generators=gens, per_seed=per_seed, plan=plan)


def _load_inputs(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, env: str, *,
                 correlation_id: str | None) -> _Inputs:
    """The environment and its seeds, and the held-out suite (re-attesting older batches against it)."""
    cur = load_env(store, artifacts, env)
    seeds = seed_tasks(cur.tasks)
    try:
        suite: Suite | None = load_suite(store, artifacts, cfg.cycle.heldout_suite)
    except LookupError:
        suite = None
    if suite is not None:
        # Batches accepted against an older held-out version (carried over in the environment, and in
        # the lineage of models trained on them) are checked against the items added since.
        reattest_batches(cfg, store, artifacts, suite, correlation_id=correlation_id)
    return _Inputs(env=cur, seeds=seeds, suite=suite)


def _identify(cfg: FlywheelConfig, sel: _Selection, inp: _Inputs, policy: Policy | None) -> _Identity:
    """The batch id: what it hashes is in the module docstring."""
    scfg = cfg.synth
    difficulty_on = policy is not None and scfg.difficulty_samples > 0
    policy_id = f"{getattr(policy, 'name', '?')}@{getattr(policy, 'version', '?')}" if policy is not None else None
    settings = {
        "near_dup_jaccard": scfg.near_dup_jaccard,
        "contamination_jaccard": scfg.contamination_jaccard,
        "contamination_ngram": scfg.contamination_ngram,
        "semantic_dedup": scfg.semantic_dedup,
        "semantic_threshold": scfg.semantic_threshold if scfg.semantic_dedup else None,
        "difficulty_samples": scfg.difficulty_samples if difficulty_on else 0,
        "difficulty_drop": scfg.difficulty_drop if difficulty_on else "none",
    }
    uses_policy = difficulty_on or "paraphrase" in sel.names
    bid = batch_id(env_name=inp.env.name, suites=inp.env.suites, seeds=inp.seeds, generators=sel.generators,
                   per_seed=sel.per_seed, seed=scfg.seed, settings=settings, heldout=inp.heldout_ref,
                   policy=policy_id if uses_policy else None, plan=sel.plan)
    return _Identity(batch=bid, settings=settings, difficulty_on=difficulty_on, policy_id=policy_id,
                     uses_policy=uses_policy)


def _recorded(store: EventStore, bid: str, t0: float) -> SynthSummary | None:
    """The summary of batch ``bid`` as it was recorded (``new=False``), or None when it was not."""
    recorded = store.read(stream=bid, types="synth.batch_accepted")
    if not recorded:
        return None
    p = recorded[-1].payload
    return SynthSummary(
        batch=bid, env=p.get("env"), widened_env=p.get("widened_env"), counts=dict(p.get("counts") or {}),
        rejected_by_reason=dict(p.get("rejected_by_reason") or {}), by_generator=p.get("by_generator") or {},
        not_applicable=int(p.get("not_applicable") or 0), seeds=len(p.get("seed_tasks") or []),
        accepted_artifact=p.get("accepted_artifact"), rejected_artifact=p.get("rejected_artifact"),
        decontaminated_against=list(p.get("decontaminated_against") or []), gx=p.get("gx") or {}, new=False,
        events_appended=0, seconds=time.perf_counter() - t0, plan=p.get("plan"),
    )


def _generate(cfg: FlywheelConfig, sel: _Selection, inp: _Inputs, bid: str, policy: Policy | None,
              progress: Progress | None) -> tuple[list[Candidate], int]:
    """The batch's candidates (tagged with the batch id) and how many seeds no generator applied to."""
    seed = cfg.synth.seed
    if sel.plan is not None:
        cands, not_applicable = generate_planned(inp.seeds, sel.generators, sel.plan, seed=seed, policy=policy,
                                                 progress=progress)
    else:
        cands, not_applicable = generate_candidates(inp.seeds, sel.generators, int(sel.per_seed or 0), seed=seed,
                                                    policy=policy, progress=progress)
    for c in cands:
        c.task["metadata"]["synth_batch"] = bid
    return cands, not_applicable


def _solvable(valid: list[Candidate], vctx: VerifyContext, rejections: list[Rejection],
              progress: Progress | None) -> list[Candidate]:
    """The candidates whose reference passes their verifier; the others are rejected (``unsolvable``)."""
    solvable = []
    for i, c in enumerate(valid):
        ok, why = check_solvable(c.task, vctx)
        if ok:
            solvable.append(c)
        else:
            rejections.append(_reject(c, "solvable", "unsolvable", f"unsolvable: {why}"))
        if progress and (i % 50 == 49 or i == len(valid) - 1):
            progress("verify", i + 1, len(valid))
    return solvable


def _unique(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, solvable: list[Candidate],
            inp: _Inputs, bid: str, rejections: list[Rejection], progress: Progress | None) -> list[Candidate]:
    """The candidates that duplicate nothing in the env, in earlier batches or earlier in this batch."""
    scfg = cfg.synth
    semantic = SemanticIndex(scfg.semantic_threshold) if scfg.semantic_dedup else None
    if semantic is not None:
        _semantic_model_dir()  # fail now, with the install hint, not halfway through
    reference = [t for t in inp.env.tasks if (t.get("metadata") or {}).get("synth_batch") != bid]
    seen = {t["task_id"] for t in reference}
    for t in synthetic_tasks(store, artifacts, bid):
        if t["task_id"] not in seen:
            reference.append(t)
            seen.add(t["task_id"])
    unique, rej = dedup_candidates(solvable, reference, threshold=scfg.near_dup_jaccard, semantic=semantic)
    rejections += rej
    if progress:
        progress("dedup", len(solvable), len(solvable))
    return unique


def _uncontaminated(cfg: FlywheelConfig, store: EventStore, unique: list[Candidate], suite: Suite | None,
                    rejections: list[Rejection], progress: Progress | None) -> list[Candidate]:
    """The candidates that do not overlap the held-out suite."""
    scfg = cfg.synth
    protected = protected_texts(store, suite) if suite else []
    sem2 = SemanticIndex(scfg.semantic_threshold) if scfg.semantic_dedup else None
    clean, rej = decontaminate(unique, protected, jaccard_threshold=scfg.contamination_jaccard,
                               ngram=scfg.contamination_ngram, semantic=sem2)
    rejections += rej
    if progress:
        progress("decontaminate", len(unique), len(unique))
    return clean


def _difficulty(cfg: FlywheelConfig, clean: list[Candidate], policy: Policy, vctx: VerifyContext,
                rejections: list[Rejection], progress: Progress | None) -> list[Candidate]:
    """The candidates the policy neither always nor (with ``difficulty_drop = both``) never solves."""
    scfg = cfg.synth
    measure_difficulty(clean, policy, scfg.difficulty_samples, max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=cfg.rollout.temperature, seed=scfg.seed, context=vctx)
    accepted = []
    for c in clean:
        rate = c.task["metadata"]["difficulty"]["pass_rate"]
        if rate == 1.0 and scfg.difficulty_drop in ("too_easy", "both"):
            rejections.append(_reject(c, "difficulty", "too_easy",
                                      f"too easy: all {scfg.difficulty_samples} samples pass"))
        elif rate == 0.0 and scfg.difficulty_drop == "both":
            rejections.append(_reject(c, "difficulty", "too_hard",
                                      f"too hard: none of {scfg.difficulty_samples} samples pass"))
        else:
            accepted.append(c)
    if progress:
        progress("difficulty", len(clean), len(clean))
    return accepted


def _run_funnel(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, sel: _Selection, inp: _Inputs,
                ident: _Identity, policy: Policy | None, progress: Progress | None) -> _Funnel:
    """Generate the batch and take it through the funnel: valid, solvable, unique, uncontaminated,
    then (optionally) of useful difficulty."""
    bid = ident.batch
    cands, not_applicable = _generate(cfg, sel, inp, bid, policy, progress)
    by_id = {c.task_id: c for c in cands}
    counts = {"generated": len(cands)}
    rejections: list[Rejection] = []
    valid, rej, gx = validate_candidates(cands, sel.names)
    rejections += rej
    counts["valid"] = len(valid)
    if progress:
        progress("validate", len(cands), len(cands))
    vctx = VerifyContext(sandbox=cfg.sandbox, judge=cfg.judge)
    solvable = _solvable(valid, vctx, rejections, progress)
    counts["solvable"] = len(solvable)
    unique = _unique(cfg, store, artifacts, solvable, inp, bid, rejections, progress)
    counts["unique"] = len(unique)
    clean = _uncontaminated(cfg, store, unique, inp.suite, rejections, progress)
    counts["uncontaminated"] = len(clean)
    accepted = clean
    if ident.difficulty_on and policy is not None:  # difficulty_on implies a policy
        accepted = _difficulty(cfg, clean, policy, vctx, rejections, progress)
    counts["accepted"] = len(accepted)
    return _Funnel(candidates=cands, by_id=by_id, not_applicable=not_applicable, accepted=accepted, rejections=rejections,
                   counts=counts, gx=gx)


def _record(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, sel: _Selection, inp: _Inputs,
            ident: _Identity, fun: _Funnel, *, correlation_id: str | None, t0: float) -> SynthSummary:
    """Artifacts first, then the new env version, then ``synth.batch_accepted`` (see the module
    docstring for a crash between the two appends)."""
    cur, bid, accepted, rejections = inp.env, ident.batch, fun.accepted, fun.rejections
    acc_tbl, rej_tbl = _tables(accepted, rejections, fun.by_id)
    acc_ref = artifacts.put_table(acc_tbl)
    rej_ref = artifacts.put_table(rej_tbl)
    new_env = cur.entity_id
    if accepted:
        new_env = add_tasks_to_env(cfg, store, artifacts, cur.name, [c.task for c in accepted],
                                   [bid, cur.entity_id], correlation_id=correlation_id)
    by_gen: dict[str, dict[str, int]] = {}
    for c in fun.candidates:
        by_gen.setdefault(c.generator, {"generated": 0, "accepted": 0})["generated"] += 1
    for c in accepted:
        by_gen[c.generator]["accepted"] += 1
    reasons = dict(sorted(Counter(r.reason_kind for r in rejections).items()))
    seed_ids = sorted({s for c in fun.candidates for s in c.seed_ids} | {s["task_id"] for s in inp.seeds})
    heldout_ref = inp.heldout_ref
    payload = {
        "entity_id": bid,
        "env_name": cur.name,
        "generators": {g.name: g.params for g in sel.generators},
        "seed": cfg.synth.seed,
        "per_seed": sel.per_seed,
        "plan": sel.plan,
        "settings": ident.settings,
        "counts": {k: fun.counts.get(k, 0) for k in FUNNEL},
        "rejected_by_reason": reasons,
        "by_generator": by_gen,
        "not_applicable": fun.not_applicable,
        "accepted_artifact": acc_ref.to_dict(),
        "rejected_artifact": rej_ref.to_dict(),
        "decontaminated_against": [heldout_ref] if heldout_ref else [],
        "widened_env": cur.entity_id,
        "env": new_env,
        "seed_tasks": [s["task_id"] for s in inp.seeds],
        "gx": {"success": fun.gx["success"], "failed_expectations": fun.gx["failed_expectations"]},
        **({"policy": ident.policy_id} if ident.uses_policy else {}),
    }
    res = store.append(bid, NewEvent("synth.batch_accepted", payload, [cur.entity_id, *seed_ids]),
                       expected_version=0, correlation_id=correlation_id)
    return SynthSummary(
        batch=bid, env=new_env, widened_env=cur.entity_id, counts=payload["counts"], rejected_by_reason=reasons,
        by_generator=by_gen, not_applicable=fun.not_applicable, seeds=len(inp.seeds),
        accepted_artifact=acc_ref.to_dict(), rejected_artifact=rej_ref.to_dict(),
        decontaminated_against=payload["decontaminated_against"], gx=payload["gx"], new=True,
        events_appended=res.appended + int(new_env != cur.entity_id), seconds=time.perf_counter() - t0,
        accepted_ids=[c.task_id for c in accepted], rejections=rejections, plan=sel.plan,
    )


def run_synth(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    *,
    env: str = "train",
    per_seed: int | None = None,
    generators: Sequence[str] | None = None,
    policy: Policy | None = None,
    correlation_id: str | None = None,
    progress: Progress | None = None,
    generator_params: dict[str, dict] | None = None,
    plan: dict[str, int] | None = None,
) -> SynthSummary:
    """Generate, validate, dedup and decontaminate one batch of synthetic tasks from the training
    environment ``env``; add the accepted ones to it as a new version and record the batch.

    ``plan`` (e.g. from :func:`flywheel.synth.probe.plan_generators`): variants per generator for
    the whole batch, overriding ``generators``/``per_seed`` and ``cfg.synth``; generator ``g`` makes
    ``plan[g]`` variants spread over the seeds it applies to (:func:`generate_planned`); generators
    planned at 0 do not run. The plan is hashed into the batch id and recorded in the event payload
    (``plan``; ``per_seed`` is then None).

    Idempotent: the same inputs give the same batch id, and a recorded batch is returned as it was
    (``new=False``) without generating anything or appending an event. Raises ``LookupError`` when
    the environment has no version, ``ValueError`` for an unknown generator or a paraphrase without
    a policy, :class:`flywheel.dedup.SemanticUnavailable` when semantic dedup is on without its package.
    """
    t0 = time.perf_counter()
    sel = _select(cfg, per_seed=per_seed, generators=generators, policy=policy, generator_params=generator_params,
                  plan=plan)
    inp = _load_inputs(cfg, store, artifacts, env, correlation_id=correlation_id)
    ident = _identify(cfg, sel, inp, policy)
    recorded = _recorded(store, ident.batch, t0)
    if recorded is not None:
        return recorded
    fun = _run_funnel(cfg, store, artifacts, sel, inp, ident, policy, progress)
    return _record(cfg, store, artifacts, sel, inp, ident, fun, correlation_id=correlation_id, t0=t0)
