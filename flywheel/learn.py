"""The learning stage (``train.mode = "arms"``): real corrections first, then arms chosen on a dev split.

Why this shape (issue 30): plain supervised fine-tuning on the corrections is the simplest thing a user
could do instead of running the flywheel, so the flywheel's learning must never lose to it and should
beat it. The stage therefore always contains plain SFT as its *control* and ships something else only on
evidence that is not the held-out suite.

    dev split      carve whole train-side clusters of real failures out as a dev split (never the
                   held-out suite; the gate stays the only judge of held-out items)
    first pass     SFT over every real train-side correction + replay (earlier waves' corrections, the
                   champion's verified successes from the regression suite), ``first_pass_epochs`` full
                   passes, before any synthetic example; with ``first_pass_seen`` < 1, only that share of the
                   corrections the base already trained on (in its lineage) rejoins it
    probe          greedy answers of the first-pass model on train-side tasks, labelled by the derived
                   verifiers, counted by error kind; the counts aim the synthesis (``flywheel.synth.probe``)
    arms           from the first-pass checkpoint, each within the same budget (``arm_steps`` optimizer
                   steps of ``batch_size`` sequences, and at most ``arm_budget_cpu_s`` process CPU-seconds):
                   control   = continued plain SFT on the real corrections;
                   targeted  = SFT on real corrections + the synthetic variants the probe asked for;
                   rpo       = DPO + NLL on preference pairs: the corrections against the answers that
                               failed in production and against the first-pass model's own verified
                               failures from its rollouts (``flywheel.train.preference``);
                   grpo      = GRPO on the first-pass model's own rollouts, only when at least
                               ``grpo_min_signal_groups`` groups carry signal (else skipped, with the count)
    choice         every arm is decoded greedily on the dev split; the best arm wins only if it passes
                   strictly more dev items than the control, or as many with a higher partial credit, or
                   (the same greedy score) a lower loss on the dev corrections; otherwise the control ships
    regression     before an SFT arm's continuation, its trial model answers the regression suite's items (the
                   champion's verified production successes, train side) greedily; each item it fails joins
                   the continuation's data ``regression_repair`` more times. The gate refuses a challenger that
                   fails an item the champion passes, and one such item refused a 12-to-4 cycle-2 challenger
    continuation   the chosen arm trains ``continue_steps`` more steps from its trial checkpoint on its own
                   data and objective, so the arms are short trials and the budget goes into the model that
                   ships. The control's trial resumes the first pass's data stream and its continuation
                   resumes the trial's: when the control wins, the shipped model is plain SFT on the real
                   corrections for first pass + trial + continuation steps, one data stream (what a user
                   who only fine-tunes would train), plus the fold-in
    fold-in        the dev items' corrections are trained into the chosen model (``dev_fold_in``), so
                   no correction is lost to the dev split; the gate then tests one model against the
                   champion, and its error rate is unchanged

``train.schedule = "one_run"`` (default): first pass, an SFT arm's trial and its continuation are steps of
one warm-up + cosine schedule and carry AdamW's state between phases (in memory), and the dev corrections
join the continuation's data instead of a separate fold-in, so a shipped control is plain SFT in one run.
``"per_phase"``: every phase restarts both (the earlier behaviour).

What is recorded: every arm is its own training run (MLflow run, ``training.completed`` and
``model.registered`` events, as any SFT or GRPO run), and the whole decision is one
``learning.decided`` event on stream ``learn:<id>`` (arms with their budgets in steps, tokens and
process CPU-seconds, their dev scores, the probe's error counts, the choice and why), caused by the arm
runs and models, plus an MLflow run ``learn`` with the same figures. The registered ``challenger`` alias
ends on the shipped model.

Not guaranteed: that an arm other than the control wins (with a small dev split they often tie, and
a tie ships the control); that the budgets are equal in CPU-seconds to the second (they are equal in
steps and sequences, capped in CPU-seconds, and reported in both).
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import Tracker
from flywheel.train.demos import Demonstration, demonstrations_from_tasks
from flywheel.vocab.ids import digest
from flywheel.vocab.refs import parse_model_entity

__all__ = ["ARMS", "TIE_BREAKS", "ArmResult", "LearnResult", "choose_arm", "dev_split", "needs_dev_loss", "regression_repair", "run_learning",
           "split_sources"]

#: The arms the stage knows, in the order they train (the control first).
ARMS = ("control", "targeted", "rpo", "grpo")

Progress = Callable[[str, dict[str, Any]], None]


@dataclass
class ArmResult:
    """One arm: what it trained, at what cost, and how it did on the dev split."""

    name: str
    model_version: int | None = None
    model_entity: str | None = None
    run_id: str | None = None
    mlflow_run_id: str | None = None
    steps: int = 0
    tokens: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    dev_passed: int | None = None
    dev_items: int = 0
    dev_credit: float | None = None  # mean partial credit on dev: 1 per passed item, else its verdict components' mean
    dev_loss: float | None = None  # nats per answer token on the dev corrections; scored only to break a tie
    skipped: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    # AdamW's state at the end of an SFT arm's trial (train.schedule = "one_run"): in memory until the
    # continuation resumes it, never recorded.
    optimizer_state: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The recorded fields (everything but the in-memory optimizer state)."""
        return {k: v for k, v in asdict(self).items() if k != "optimizer_state"}


@dataclass
class LearnResult:
    learn_id: str
    model_version: int
    model_entity: str
    chosen: str
    why: str
    arms: list[ArmResult]
    first_pass: dict[str, Any]
    dev: dict[str, Any]
    probe: dict[str, Any] | None = None
    continuation: dict[str, Any] | None = None
    fold_in: dict[str, Any] | None = None
    regression: dict[str, Any] | None = None  # the pre-continuation check on the regression suite
    blend: dict[str, Any] | None = None  # train.champion_blend < 1: the shipped blend with the champion (or why not)
    mode: str = "arms"
    schedule: dict[str, Any] = field(default_factory=dict)  # train.schedule and, for one_run, its total steps
    metrics: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0  # process CPU-seconds of the whole stage (dev decoding and registration included)
    wall_s: float = 0.0

    @property
    def steps(self) -> int:
        return (int(self.first_pass.get("steps", 0)) + sum(a.steps for a in self.arms)
                + int((self.continuation or {}).get("steps", 0)) + int((self.fold_in or {}).get("steps", 0)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arms"] = [a.to_dict() for a in self.arms]
        d["steps"] = self.steps
        return d


# -- data -------------------------------------------------------------------------------------------


def _md(task: dict) -> dict:
    return task.get("metadata") or {}


def is_synthetic(task: dict) -> bool:
    return bool(_md(task).get("synth_batch"))


def split_sources(env_tasks: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(real train-side evals, synthetic tasks) of a training environment; held-out tasks are dropped."""
    real, synth = [], []
    for t in env_tasks:
        if _md(t).get("split") == "heldout":
            continue
        (synth if is_synthetic(t) else real).append(t)
    return real, synth


def dev_split(real: Sequence[dict], *, fraction: float, min_items: int, seed: int = 0) -> set[str]:
    """Task ids of the dev split: whole clusters of real *failure* evals, chosen by a hash of the cluster.

    Clusters are ranked by ``digest(seed|cluster)`` and taken in that order until ``fraction`` of the
    failure evals (at least ``min_items``, at most half) are in; the same tasks and seed always give the
    same split, and a later wave only adds clusters (a cluster's rank never changes).
    """
    failures = [t for t in real if _md(t).get("origin_outcome", "failure") == "failure"]
    if fraction <= 0 or not failures:
        return set()
    by_cluster: dict[str, list[str]] = {}
    for t in failures:
        by_cluster.setdefault(str(_md(t).get("cluster") or t["task_id"]), []).append(t["task_id"])
    want = max(min_items, math.ceil(fraction * len(failures)))
    want = min(want, len(failures) // 2)
    out: set[str] = set()
    for c in sorted(by_cluster, key=lambda c: digest(f"dev|{seed}|{c}")):
        if len(out) >= want:
            break
        out.update(by_cluster[c])
    return out


def _without(tasks: Sequence[dict], dev: set[str]) -> list[dict]:
    """Tasks that are not dev items and do not descend from one (a synthetic variant of a dev task)."""
    out = []
    for t in tasks:
        md = _md(t)
        seeds = {md.get("seed_task"), *(md.get("seed_tasks") or [])} - {None}
        if t["task_id"] in dev or seeds & dev:
            continue
        out.append(t)
    return out


TIE_BREAKS = ("partial_credit_then_loss", "partial_credit", "control")


def _dev_key(a: ArmResult, tie_break: str) -> tuple[int, float]:
    """What the dev split says of an arm before any loss: pass count, then (unless ``tie_break =
    "control"``) mean partial credit to six digits."""
    credit = round(a.dev_credit, 6) if (tie_break != "control" and a.dev_credit is not None) else 0.0
    return int(a.dev_passed or 0), credit


def needs_dev_loss(arms: Sequence[ArmResult], *, tie_break: str) -> list[str]:
    """The arms whose dev loss decides the choice: with ``tie_break = "partial_credit_then_loss"``, the
    control and every arm that ties it on pass count and partial credit, when none beats it on those
    (else no loss is needed: [])."""
    if tie_break != "partial_credit_then_loss":
        return []
    scored = [a for a in arms if a.skipped is None and a.dev_passed is not None]
    control = next((a for a in scored if a.name == "control"), None)
    if control is None:
        return []
    top = max(_dev_key(a, tie_break) for a in scored)
    if _dev_key(control, tie_break) != top:
        return []
    tied = [a.name for a in scored if _dev_key(a, tie_break) == top]
    return tied if len(tied) > 1 else []


def choose_arm(arms: Sequence[ArmResult], *, tie_break: str = "partial_credit_then_loss") -> tuple[str, str]:
    """The arm to ship: the best on dev if it is strictly better than the control there, else the control.

    Better on dev: more dev items passed; unless ``tie_break = "control"``, an equal pass count and a
    higher :attr:`ArmResult.dev_credit` (a finer score of the same dev items: parseable, right functions,
    required arguments, values), so two arms that pass the same few of 15 items are told apart by how close
    the failures came; with ``tie_break = "partial_credit_then_loss"`` (the default), equal on both (two
    short trials from one checkpoint often give the same greedy answers) and a lower
    :attr:`ArmResult.dev_loss` (nats per answer token of the dev corrections, to six digits): the model
    that puts more probability on the right answers. ``tie_break = "control"``: pass counts only. Equal on
    every score, or a loss missing: the control ships. Ties between non-control arms go to the earlier arm
    in :data:`ARMS` order."""
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"choose_arm: tie_break must be one of {', '.join(TIE_BREAKS)}, got {tie_break!r}")
    scored = {a.name: a for a in arms if a.skipped is None and a.dev_passed is not None}
    if "control" not in scored:
        raise ValueError("choose_arm: the control arm has no dev score")
    control = scored["control"]
    use_loss = tie_break == "partial_credit_then_loss"

    def loss_key(a: ArmResult) -> float:
        return -round(a.dev_loss, 6) if (use_loss and a.dev_loss is not None) else float("-inf")

    best = max(scored.values(),
               key=lambda a: (*_dev_key(a, tie_break), loss_key(a), -ARMS.index(a.name) if a.name in ARMS else -99))
    if best.name != "control":
        (bp, bc), (cp, cc) = _dev_key(best, tie_break), _dev_key(control, tie_break)
        if bp > cp:
            return best.name, (f"{best.name} passed {best.dev_passed}/{best.dev_items} dev items against the control's "
                               f"{control.dev_passed}/{control.dev_items}")
        if bp == cp and bc > cc:
            return best.name, (f"{best.name} passed as many dev items as the control ({best.dev_passed}/{best.dev_items}) "
                               f"and came closer on the rest: partial credit {bc:.3f} against {cc:.3f}")
        if (bp, bc) == (cp, cc) and use_loss and best.dev_loss is not None and control.dev_loss is not None \
                and round(best.dev_loss, 6) < round(control.dev_loss, 6):
            return best.name, (f"{best.name} gave the control's dev score ({best.dev_passed}/{best.dev_items}, partial "
                               f"credit {bc:.3f}) and a lower loss on the dev corrections: {best.dev_loss:.4f} against "
                               f"{control.dev_loss:.4f} nats per answer token")
    if len(scored) == 1:
        return "control", "the control was the only arm that trained"
    others = ", ".join(f"{a.name} {a.dev_passed}" for a in scored.values() if a.name != "control")
    loss_note = ""
    if use_loss and control.dev_loss is not None:
        losses = ", ".join(f"{a.name} {a.dev_loss:.4f}" for a in scored.values() if a.dev_loss is not None)
        loss_note = f"; tied, and the dev loss did not favour another arm ({losses})"
    return "control", (f"no arm beat the control on dev (control {control.dev_passed}/{control.dev_items}; "
                       f"{others}{loss_note}): the control ships")


# -- the stage --------------------------------------------------------------------------------------


class _Clock:
    """Wall and process CPU seconds of one phase (CPU: every thread of this process, torch's included)."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def done(self) -> tuple[float, float]:
        return round(time.perf_counter() - self.t0, 2), round(time.process_time() - self.c0, 2)


def cap_synthetic(synth: Sequence[dict], n_real: int, share: float, *, seed: int = 0) -> list[dict]:
    """The synthetic tasks the targeted arm trains when they may make up at most ``share`` of its
    demonstrations beside ``n_real`` real ones (``train.synthetic_share``): all of them when they fit,
    else ``floor(share / (1 - share) x n_real)`` of them, each generator keeping its share of what was
    accepted (largest remainder, ties by generator name) and, within a generator, a seeded hash order."""
    if share >= 1.0 or not synth:
        return list(synth)
    keep = math.floor(share / (1.0 - share) * n_real + 1e-9)
    if keep >= len(synth):
        return list(synth)
    from flywheel.synth.probe import largest_remainder

    by_gen: dict[str, list[dict]] = {}
    for t in synth:
        by_gen.setdefault(str(_md(t).get("generator") or "?"), []).append(t)
    quota = largest_remainder(keep, {g: float(len(by_gen[g])) for g in sorted(by_gen)})
    kept = []
    for g, ts in by_gen.items():
        kept += sorted(ts, key=lambda x: digest(f"synthetic_share|{seed}|{x['task_id']}"))[: quota[g]]
    chosen = {x["task_id"] for x in kept}
    return [t for t in synth if t["task_id"] in chosen]


def _demos(tasks: Sequence[dict], regression: Sequence[dict] = ()) -> list[Demonstration]:
    return demonstrations_from_tasks(list(tasks), list(regression))


def regression_repair(checked: Sequence[dict], passed_ids: Sequence[str], copies: int) -> tuple[list[str], list[Demonstration]]:
    """The regression items of ``checked`` whose ids are not in ``passed_ids`` (the checked model failed
    them), and their demonstrations ``copies`` times each: what the continuation trains on besides its own
    data so the shipped model keeps the champion's verified successes."""
    ok = {str(x) for x in passed_ids}
    failed = [x for x in checked if str(x["task_id"]) not in ok]
    return [str(x["task_id"]) for x in failed], _demos((), failed) * max(0, copies)


def _tokens(res: Any) -> int:
    return int(sum(h.get("tokens", 0) for h in getattr(res, "history", []) or []))


def _credit(verdict: Any) -> float:
    """One dev item's partial credit (the verifiers' own, as ``reward_mode = "partial"`` scores it); 0.0
    when the verifier could not judge."""
    from flywheel.verifiers.registry import partial_credit

    return 0.0 if getattr(verdict, "infra_error", None) else partial_credit(verdict)


def _dev_score(cfg: FlywheelConfig, tracker: Tracker, version: int,
               dev_tasks: Sequence[dict]) -> tuple[int, list[str], float]:
    """Greedy pass count of ``model:<name>/<version>`` on the dev tasks (the gate's decoding), the ids
    that passed, and the mean partial credit (:func:`_credit`). Infrastructure errors count as not
    passed (credit 0) for every arm alike."""
    from flywheel.envs.harness import run_episodes
    from flywheel.evaluate import decoding_for, item_row
    from flywheel.policy.base import SamplingParams
    from flywheel.policy.registry import load_policy_for_version

    d = decoding_for(cfg.gate)
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=d["max_new_tokens"], seed=d["seed"])
    policy = load_policy_for_version(cfg, tracker, cfg.cycle.model_name, version)
    episodes = run_episodes(list(dev_tasks), policy, params, context=cfg)
    passed = [str(t["task_id"]) for t, eps in zip(dev_tasks, episodes, strict=True) if item_row(t, eps)["passed"]]
    credits = [_credit(eps[0].verdict) if eps else 0.0 for eps in episodes]
    return len(passed), passed, round(sum(credits) / len(credits), 6) if credits else 0.0


def _dev_loss(cfg: FlywheelConfig, tracker: Tracker, version: int, dev_tasks: Sequence[dict]) -> float:
    """Mean loss of ``model:<name>/<version>`` on the dev tasks' corrections (nats per answer token,
    teacher-forced, rendered as training renders them; :func:`flywheel.train.sft.mean_answer_nll`), through
    the same loading as the gate (a merged adapter where the gate merges one)."""
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.train.sft import demonstration_samples, mean_answer_nll

    policy = load_policy_for_version(cfg, tracker, cfg.cycle.model_name, version)
    samples = demonstration_samples(policy.tokenizer, _demos(dev_tasks))
    return round(mean_answer_nll(policy.model, samples, device=policy.device), 6)


def run_learning(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    *,
    base: str,
    correlation_id: str | None = None,
    progress: Progress | None = None,
    synthesize: Callable[[dict[str, int]], Any] | None = None,
) -> LearnResult:
    """Run the learning stage from ``base`` (a spec or ``model:<name>/<N>``) on the latest training
    environment and regression suite; returns the shipped model (alias ``challenger``).

    ``synthesize(plan)``: runs the synthesis stage with ``plan`` (variants per generator) and returns its
    summary; the cycle passes its synth stage here so the probe can aim it. Without it the targeted arm
    uses whatever synthetic tasks the environment already holds.
    """
    from flywheel.train.stage import TrainStageError, train_sft
    from flywheel.versioning import load_env, load_suite

    t = cfg.train
    say = progress or (lambda stage, info: None)
    learn_id = f"learn:{uuid.uuid4().hex[:16]}"
    whole = _Clock()
    env = load_env(store, artifacts, cfg.cycle.train_env)
    try:
        regression = [x for x in load_suite(store, artifacts, cfg.cycle.regression_suite).tasks
                      if _md(x).get("split") != "heldout"]
    except LookupError:
        regression = []
    real, _ = split_sources(env.tasks)
    # train.synthesis_in = "stream": nothing is chosen on dev, so no correction is held out for it
    stream = t.synthesis_in == "stream" and "targeted" in t.arms and t.probe_tasks > 0
    dev = set() if stream else dev_split(real, fraction=t.dev_fraction, min_items=t.dev_min_items, seed=t.seed)
    dev_tasks = [x for x in real if x["task_id"] in dev]
    train_real = _without(real, dev)
    real_demos = _demos(train_real, _without(regression, dev))
    # train.probe_holdout (stream only: the trials' control resumes the first pass's data stream): the
    # probe's tasks sit out the first pass and join the stream; only when at least as many tasks remain
    probe_ids = ({x["task_id"] for x in _probe_tasks(t, train_real)} if t.probe_holdout and stream else set())
    if 2 * len(probe_ids) > len(train_real):
        probe_ids = set()
    # train.first_pass_seen < 1: of the corrections the base already trained on (cycle 2's champion: wave 1's),
    # only a seeded sample rejoins the first pass; the new ones train in full
    seen, resting = _seen_corrections(store, base, train_real, t.first_pass_seen, seed=t.seed)
    if len(resting | probe_ids) >= len(train_real):
        resting = set()  # never an empty first pass
    skip = probe_ids | resting
    first_demos = _demos(_without(train_real, skip), _without(regression, dev)) if skip else real_demos
    if not real_demos:
        raise TrainStageError("the learning stage has no demonstrations: no train-side task has a reference answer")
    dev_info: dict[str, Any] = {"items": len(dev_tasks), "clusters": len({_md(x).get("cluster") for x in dev_tasks}),
                "train_real": len(train_real), "replay": len(regression)}
    arms_wanted = [a for a in ARMS if a in t.arms]
    if stream:
        arms_wanted = ["targeted"]
        dev_info["note"] = ("train.synthesis_in = stream: no dev split and no trials; the probe-aimed synthesis "
                            "joins the shipped data stream")
    elif not dev_tasks:
        arms_wanted = ["control"]  # nothing to choose on: the control is what ships
        dev_info["note"] = "no dev split (too few train-side failures): only the control trains"

    # 1. first pass over the real corrections and replay
    per_epoch = math.ceil(len(first_demos) / t.batch_size)
    fp_steps = max(1, math.ceil(per_epoch * t.first_pass_epochs))
    say("learn", {"status": "running", "phase": "first pass", "demonstrations": len(first_demos), "steps": fp_steps})
    # train.schedule = "one_run": first pass, an SFT arm's trial and its continuation are steps of one
    # schedule with one optimizer state, so a shipped control is plain SFT in one run (no warm-up restarts,
    # no AdamW moments reset between phases).
    one_run = t.schedule == "one_run"
    total = fp_steps + t.arm_steps + t.continue_steps
    schedule_info = {"mode": t.schedule, **({"total_steps": total} if one_run else {}),
                     "synthesis_in": "stream" if stream else "trial"}
    clock = _Clock()
    first = train_sft(cfg, store, artifacts, tracker, first_demos, base=base, steps=fp_steps,
                      on_step=lambda s, m: say("learn", {"phase": "first pass", "step": s, "total": fp_steps,
                                                         "loss": m.get("loss")}),
                      schedule=(0, total) if one_run else None, keep_optimizer_state=one_run)
    wall, cpu = clock.done()
    first_info = {"base": base, "model_entity": first.model_entity, "model_version": first.model_version, "run_id": first.run_id,
                  "mlflow_run_id": first.mlflow_run_id, "steps": first.steps, "demonstrations": len(first_demos), "tokens": _tokens(first), "cpu_s": cpu,
                  "wall_s": wall, "epochs": t.first_pass_epochs, "loss": first.metrics.get("loss"),
                  **({"probe_held_out": len(probe_ids)} if probe_ids else {}),
                  **({"seen_by_base": len(seen), "seen_replayed": len(seen) - len(resting)} if seen else {})}
    ckpt = first.model_entity

    # 2. probe: what the first-pass model still gets wrong on train-side tasks aims the synthesis
    probe_info: dict[str, Any] | None = None
    if "targeted" in arms_wanted and t.probe_tasks > 0:
        probe_info = _probe_and_synthesize(cfg, tracker, first.model_version, train_real, synthesize, say)
        env = load_env(store, artifacts, cfg.cycle.train_env)

    if stream:
        arm, stream_check = _stream(cfg, store, artifacts, tracker, first, train_real, regression, env, say,
                                 correlation_id=correlation_id, total=total if one_run else None)
        first.optimizer_state = arm.optimizer_state = None
        if arm.model_version is None or arm.model_entity is None:
            raise TrainStageError(f"the shipped stream trained nothing: {arm.skipped}")
        why = (f"train.synthesis_in = stream: the first-pass model continued {arm.steps} steps on the real corrections "
               f"and {arm.detail.get('synthetic', 0)} synthetic tasks; no trial, no dev split")
        if arm.detail.get("real_tail"):
            why += f"; the last {arm.detail['real_tail']['steps']} steps on the real corrections alone (train.stream_real_tail)"
        if arm.name == "control":
            why = f"train.synthesis_in = stream, but {arm.detail.get('why', 'no synthetic task was accepted')}: the control's stream ships"
        version, entity, blend = _blend(cfg, store, tracker, arm.model_version, arm.model_entity, base,
                                        correlation_id=correlation_id, say=say)
        tracker.set_alias(cfg.cycle.model_name, "challenger", version)
        result = LearnResult(learn_id=learn_id, model_version=version, model_entity=entity,
                             chosen=arm.name, why=why, arms=[arm], first_pass=first_info, dev=dev_info, probe=probe_info,
                             regression=stream_check, schedule=schedule_info, blend=blend)
        result.wall_s, result.cpu_s = whole.done()
        _record(cfg, store, tracker, result, correlation_id=correlation_id)
        say("learn", {"status": "done", "chosen": arm.name, "model": arm.model_entity})
        return result

    # 3. the first-pass model's own samples: sampled failures for RPO's pairs, groups for GRPO
    roll = None
    if "rpo" in arms_wanted or "grpo" in arms_wanted:
        from flywheel.rollouts import run_rollouts

        say("learn", {"status": "running", "phase": "rollouts of the first-pass model"})
        # Every group is kept here (an all-fail group holds the sampled failures RPO pairs with the
        # corrections); the GRPO arm drops zero-variance groups itself and trains on the rest.
        keep_all = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dynamic_sampling": "off"})})
        roll = run_rollouts(keep_all, store, artifacts, tracker, policy=ckpt, correlation_id=correlation_id)

    # 4. arms from the first-pass checkpoint, one budget each
    results: list[ArmResult] = []
    for name in arms_wanted:
        say("learn", {"status": "running", "phase": f"arm {name}"})
        arm = _train_arm(name, cfg, store, artifacts, tracker, ckpt, train_real, regression, env, dev, say,
                         roll=roll, correlation_id=correlation_id, start_step=first.steps if name == "control" else 0,
                         resume=(first.steps, total, first.optimizer_state) if one_run else None)
        results.append(arm)
    first.optimizer_state = None  # the arms hold their own copies

    # 5. dev scores and the choice
    for arm in results:
        if arm.skipped is None and arm.model_version is not None and dev_tasks:
            say("learn", {"status": "running", "phase": f"dev {arm.name}", "items": len(dev_tasks)})
            arm.dev_passed, passed_ids, arm.dev_credit = _dev_score(cfg, tracker, arm.model_version, dev_tasks)
            arm.dev_items = len(dev_tasks)
            arm.detail["dev_passed_ids"] = passed_ids
    # a tie on the greedy dev answers: the loss on the dev corrections of the tied arms decides (no decoding)
    tied = set(needs_dev_loss(results, tie_break=t.dev_tie_break) if dev_tasks else [])
    for scored in (a for a in results if a.name in tied):
        assert scored.model_version is not None
        say("learn", {"status": "running", "phase": f"dev loss {scored.name}", "items": len(dev_tasks)})
        loss_clock = _Clock()
        scored.dev_loss = _dev_loss(cfg, tracker, scored.model_version, dev_tasks)
        scored.detail["dev_loss_cpu_s"] = loss_clock.done()[1]
    if dev_tasks:
        chosen, why = choose_arm(results, tie_break=t.dev_tie_break)
    else:
        chosen, why = "control", dev_info["note"]
    winner = next(a for a in results if a.name == chosen)
    final_version, final_entity = winner.model_version, winner.model_entity

    # 5b. the chosen arm continues from its trial checkpoint: the budget goes into the model that ships
    cont: dict[str, Any] | None = None
    dev_demos = _demos(dev_tasks)
    # one_run: an SFT arm's continuation goes on with its trial's schedule and optimizer, and the dev
    # corrections join its data now that the choice is made (no separate fold-in at a restarted schedule).
    carry = one_run and winner.optimizer_state is not None
    folded_into_continuation = False
    reg_check: dict[str, Any] | None = None
    repair_demos: list[Demonstration] = []
    if t.continue_steps == 0 and t.regression_repair > 0 and _without(regression, dev):
        reg_check = {"skipped": "train.continue_steps = 0: no continuation to train the repairs in"}
    if t.continue_steps > 0 and final_entity:
        reg_check, repair_demos = _regression_check(cfg, tracker, winner, _without(regression, dev), say)
        say("learn", {"status": "running", "phase": f"continue {chosen}", "steps": t.continue_steps})
        resume = winner.steps + (first.steps if chosen == "control" else 0)
        extra = dev_demos if (carry and t.dev_fold_in) else []
        more = _train_arm(chosen, cfg, store, artifacts, tracker, final_entity, train_real, regression, env, dev, say,
                          roll=roll, correlation_id=correlation_id, steps=t.continue_steps, start_step=resume,
                          budget_cpu_s=None, phase="continue", extra_demos=extra, repair_demos=repair_demos,
                          resume=(first.steps + winner.steps, total, winner.optimizer_state) if carry else None)
        if more.model_entity is not None:
            cont = {"arm": chosen, "from": final_entity, "model_entity": more.model_entity, "run_id": more.run_id,
                    "mlflow_run_id": more.mlflow_run_id, "steps": more.steps, "start_step": resume,
                    "tokens": more.tokens, "cpu_s": more.cpu_s, "wall_s": more.wall_s, "detail": more.detail}
            final_version, final_entity = more.model_version, more.model_entity
            folded_into_continuation = bool(extra)
        else:
            cont = {"arm": chosen, "skipped": more.skipped}
    for arm in results:
        arm.optimizer_state = None  # in-memory only: free it before the fold-in loads another model

    # 6. fold the dev items' corrections into the shipped model (one_run: already in the continuation's data)
    fold: dict[str, Any] | None = None
    if folded_into_continuation:
        fold = {"into": "continuation", "dev": len(dev_tasks), "demonstrations": len(dev_demos),
                "run_id": (cont or {}).get("run_id"), "model_entity": final_entity, "steps": 0}
    elif t.dev_fold_in and dev_demos and final_entity:
        clock = _Clock()
        # The dev corrections with as many replayed train-side ones: steps on 15 dev items alone at the
        # peak learning rate would pull the shipped model toward those items only.
        replay = sorted(real_demos, key=lambda d: digest(f"fold|{t.seed}|{d.source_entity_id}"))[: len(dev_demos)]
        dev_demos = dev_demos + replay
        steps = max(1, math.ceil(len(dev_demos) / t.batch_size))
        say("learn", {"status": "running", "phase": "fold-in", "demonstrations": len(dev_demos), "steps": steps})
        fr = train_sft(cfg, store, artifacts, tracker, dev_demos, base=final_entity, steps=steps)
        wall, cpu = clock.done()
        fold = {"base": final_entity, "model_entity": fr.model_entity, "run_id": fr.run_id, "steps": fr.steps, "demonstrations": len(dev_demos),
                "dev": len(dev_tasks), "replayed": len(replay),
                "tokens": _tokens(fr), "cpu_s": cpu, "wall_s": wall}
        final_version, final_entity = fr.model_version, fr.model_entity
    assert final_version is not None and final_entity is not None
    final_version, final_entity, blend = _blend(cfg, store, tracker, final_version, final_entity, base,
                                                correlation_id=correlation_id, say=say)
    tracker.set_alias(cfg.cycle.model_name, "challenger", final_version)

    result = LearnResult(learn_id=learn_id, model_version=final_version, model_entity=final_entity, chosen=chosen,
                         why=why, arms=results, first_pass=first_info, dev=dev_info, probe=probe_info,
                         continuation=cont, fold_in=fold, regression=reg_check, schedule=schedule_info, blend=blend)
    result.wall_s, result.cpu_s = whole.done()
    _record(cfg, store, tracker, result, correlation_id=correlation_id)
    say("learn", {"status": "done", "chosen": chosen, "model": final_entity})
    return result


def _blend(cfg: FlywheelConfig, store: EventStore, tracker: Tracker, version: int, entity: str, base: str, *,
           correlation_id: str | None, say: Progress) -> tuple[int, str, dict[str, Any] | None]:
    """``train.champion_blend < 1``: the trained model blended with the champion it was trained from
    (:func:`flywheel.train.blend.blend_with_champion`), else the trained model as it is. Returns the
    version and entity that ship and the record (``None`` when the setting is 1)."""
    weight = cfg.train.champion_blend
    if weight >= 1.0:
        return version, entity, None
    from flywheel.train.blend import blend_with_champion

    say("learn", {"status": "running", "phase": "blend with the champion", "weight": weight})
    blended, record = blend_with_champion(cfg, store, tracker, trained=entity, champion=base, weight=weight,
                                          correlation_id=correlation_id)
    if blended is None:
        return version, entity, record
    return blended.model_version, blended.model_entity, record


def _stream(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, tracker: Tracker, first: Any,
            train_real: list[dict], regression: list[dict], env: Any, say: Progress, *, correlation_id: str | None,
            total: int | None) -> tuple[ArmResult, dict[str, Any] | None]:
    """``train.synthesis_in = "stream"``: the first-pass model continues on the real corrections and the
    probe-aimed synthesis for ``arm_steps + continue_steps`` steps (one schedule and optimizer with the
    first pass under ``one_run``), after the regression check of the first-pass model; the control's
    data when the synthesis accepted nothing. Returns the arm that ships and the regression check."""
    t = cfg.train
    steps = t.arm_steps + t.continue_steps
    # train.stream_real_tail: the last steps continue plain SFT's data stream (the real corrections alone)
    tail = min(steps - 1, math.floor(t.stream_real_tail * steps + 1e-9)) if steps > 1 else 0
    checked = ArmResult("targeted", model_version=first.model_version, model_entity=first.model_entity)
    reg_check, repair_demos = _regression_check(cfg, tracker, checked, regression, say)
    resume = (first.steps, total, first.optimizer_state) if total is not None else None
    arm = _train_arm("targeted", cfg, store, artifacts, tracker, first.model_entity, train_real, regression, env, set(),
                     say, correlation_id=correlation_id, steps=steps - tail, budget_cpu_s=None, phase="stream",
                     repair_demos=repair_demos, resume=resume)
    if arm.skipped is not None:  # no synthetic task: the same steps of plain SFT, the control's stream
        why_control = arm.skipped
        arm = _train_arm("control", cfg, store, artifacts, tracker, first.model_entity, train_real, regression, env,
                         set(), say, correlation_id=correlation_id, steps=steps, start_step=first.steps,
                         budget_cpu_s=None, phase="stream", repair_demos=repair_demos, resume=resume)
        arm.detail["why"] = why_control
    elif tail > 0 and arm.model_entity is not None:
        mixed, mixed_entity = arm, arm.model_entity
        resume = (first.steps + mixed.steps, total, mixed.optimizer_state) if total is not None else None
        real = _train_arm("control", cfg, store, artifacts, tracker, mixed_entity, train_real, regression, env,
                          set(), say, correlation_id=correlation_id, steps=tail, start_step=first.steps,
                          budget_cpu_s=None, phase="stream real tail", resume=resume)
        if real.model_entity is not None:
            arm = ArmResult("targeted", model_version=real.model_version, model_entity=real.model_entity,
                            run_id=real.run_id, mlflow_run_id=real.mlflow_run_id, steps=mixed.steps + real.steps,
                            tokens=mixed.tokens + real.tokens, cpu_s=mixed.cpu_s + real.cpu_s,
                            wall_s=mixed.wall_s + real.wall_s, detail=dict(mixed.detail),
                            optimizer_state=real.optimizer_state)
            arm.detail["real_tail"] = {"steps": real.steps, "mixed_steps": mixed.steps,
                                       "mixed_model_entity": mixed.model_entity, "demonstrations": real.detail.get("demonstrations")}
    arm.detail["phase"] = "stream"
    return arm, reg_check


def _regression_check(cfg: FlywheelConfig, tracker: Tracker, winner: ArmResult, regression: Sequence[dict],
                      say: Progress) -> tuple[dict[str, Any] | None, list[Demonstration]]:
    """The winner's trial model on (a seeded sample of) the regression suite's train-side items, and the
    demonstrations its continuation adds for the items it fails (:func:`regression_repair`). ``None`` when
    there is nothing to check; a record saying why when the check does not apply."""
    t = cfg.train
    if t.regression_repair <= 0 or not regression or winner.model_version is None:
        return None, []
    if winner.name not in ("control", "targeted"):
        return {"skipped": f"the {winner.name} arm's continuation trains on its own objective, not on demonstrations"}, []
    checked = sorted(regression, key=lambda x: digest(f"regression|{t.seed}|{x['task_id']}"))[: t.regression_check_items]
    say("learn", {"status": "running", "phase": "regression check", "items": len(checked)})
    clock = _Clock()
    n, passed, _ = _dev_score(cfg, tracker, winner.model_version, checked)
    failed, demos = regression_repair(checked, passed, t.regression_repair)
    wall, cpu = clock.done()
    return {"model_entity": winner.model_entity, "items": len(checked), "suite_items": len(regression), "passed": n,
            "failed": failed, "copies": t.regression_repair, "demonstrations": len(demos),
            "cpu_s": cpu, "wall_s": wall}, demos


def _seen_corrections(store: EventStore, base: str, train_real: Sequence[dict], share: float, *,
                      seed: int) -> tuple[set[str], set[str]]:
    """(the train-side tasks ``base`` already trained on, those of them that sit out the first pass).

    A task is *seen* when its eval is in the base model's lineage (what its training runs were made from);
    a base that is a spec (the cycle-1 base model) has seen none. With ``share`` < 1 all but a seeded
    ``ceil(share x seen)`` of them sit out: the first pass rehearses a sample of what the champion learned
    and spends the rest of its steps on the corrections it has not trained on.
    """
    if share >= 1.0 or not base.startswith("model:"):
        return set(), set()
    ids = {x["task_id"] for x in train_real}
    seen = {e for e, _ in store.lineage(base, "down") if e in ids}
    order = sorted(seen, key=lambda i: digest(f"seen|{seed}|{i}"))
    return seen, set(order[math.ceil(share * len(seen)):])


def _probe_tasks(t: Any, train_real: Sequence[dict]) -> list[dict]:
    """The train-side tasks the probe decodes: ``train.probe_tasks`` of them in a seeded hash order."""
    return sorted(train_real, key=lambda x: digest(f"probe|{t.seed}|{x['task_id']}"))[: t.probe_tasks]


def _probe_and_synthesize(cfg: FlywheelConfig, tracker: Tracker, version: int, train_real: Sequence[dict],
                          synthesize: Callable[[dict[str, int]], Any] | None, say: Progress) -> dict[str, Any]:
    """Greedy answers of the first-pass model on up to ``probe_tasks`` train-side tasks, counted by error
    kind; when ``synthesize`` is given, the synthesis runs with the plan the counts give."""
    from flywheel.policy.registry import load_policy_for_version
    from flywheel.synth.probe import PLANNED_GENERATORS, plan_generators, run_probe

    t = cfg.train
    tasks = _probe_tasks(t, train_real)
    say("learn", {"status": "running", "phase": "probe", "tasks": len(tasks)})
    clock = _Clock()
    policy = load_policy_for_version(cfg, tracker, cfg.cycle.model_name, version)
    report = run_probe(policy, tasks, max_new_tokens=cfg.gate.max_new_tokens)
    budget = max(cfg.synth.per_seed, 1) * len(train_real)
    # Only the generators the user configured (synth.generators), in the planner's order: a list without
    # `parallel` must not get parallel variants because the probe counted missing calls.
    allowed = [g for g in PLANNED_GENERATORS if g in cfg.synth.generators]
    if not allowed:
        raise ValueError(f"synth.generators {list(cfg.synth.generators)} names none of the generators the probe "
                         f"can plan ({', '.join(PLANNED_GENERATORS)}): add one of them")
    plan = plan_generators(report, budget, generators=allowed)
    info: dict[str, Any] = {"tasks": len(tasks), "counts": dict(report.counts), "plan": plan}
    if synthesize is not None and plan:
        say("learn", {"status": "running", "phase": "synth (aimed by the probe)", "plan": plan})
        summary = synthesize(plan)
        if isinstance(summary, dict):
            info["synth"] = {"batch": summary.get("batch"), "accepted": (summary.get("funnel") or {}).get("accepted"),
                             "by_generator": summary.get("by_generator")}
    info["wall_s"], info["cpu_s"] = clock.done()
    return info


_TRIAL_BUDGET = object()  # _train_arm's default budget: train.arm_budget_cpu_s


def _train_arm(name: str, cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, tracker: Tracker,
               ckpt: str, train_real: list[dict], regression: list[dict], env: Any, dev: set[str], say: Progress,
               *, roll: Any = None, correlation_id: str | None, steps: int | None = None, start_step: int = 0,
               budget_cpu_s: Any = _TRIAL_BUDGET, phase: str = "arm", extra_demos: Sequence[Demonstration] = (),
               repair_demos: Sequence[Demonstration] = (), resume: tuple[int, int, dict[str, Any] | None] | None = None) -> ArmResult:
    """Train arm ``name`` from ``ckpt`` for ``steps`` (default ``train.arm_steps``: its trial) within
    ``budget_cpu_s`` (default ``train.arm_budget_cpu_s``). ``start_step``: batches of the same data stream
    already trained (the first pass's for the control's trial, the trial's for a continuation).
    ``extra_demos``: more demonstrations for an SFT arm (the dev corrections, in a one_run continuation);
    ``repair_demos``: the regression items its trial model failed, repeated (:func:`_regression_check`).
    Both are trained exactly once each, spread over the steps (``train_sft(extra_demonstrations=...)``).
    ``resume = (offset, total, optimizer_state)``: an SFT arm continues that schedule and optimizer
    (``train.schedule = "one_run"``) and keeps its own final state in :attr:`ArmResult.optimizer_state`;
    RPO and GRPO arms ignore it."""
    from flywheel.train.stage import train_sft

    t = cfg.train
    arm = ArmResult(name)
    clock = _Clock()
    budget = t.arm_budget_cpu_s if budget_cpu_s is _TRIAL_BUDGET else budget_cpu_s
    n_steps = t.arm_steps if steps is None else steps

    def on_step(s: int, m: dict) -> None:
        say("learn", {"phase": f"{phase} {name}", "step": s, "total": n_steps, "loss": m.get("loss")})

    res = None
    # The dev corrections and the regression repairs are added to the steps, each trained exactly once, and
    # leave the arm's own data stream as it was (a control's continuation stays plain SFT's next batches).
    extras = [*extra_demos, *repair_demos]
    carry: dict[str, Any] = {}
    if resume is not None:
        offset, total, state = resume
        total = max(total, offset + n_steps)
        carry = {"schedule": (offset, total), "optimizer_state": state, "keep_optimizer_state": True}
        arm.detail["schedule"] = {"offset": offset, "total": total, "resumed_optimizer": state is not None}
    if name == "control":
        demos = _demos(train_real, _without(regression, dev))
        res = train_sft(cfg, store, artifacts, tracker, demos, base=ckpt, steps=n_steps, on_step=on_step,
                        budget_cpu_s=budget, start_step=start_step, extra_demonstrations=extras, **carry)
        arm.detail.update(demonstrations=len(demos), start_step=start_step)
    elif name == "targeted":
        _, synth = split_sources(env.tasks)
        synth = _without(synth, dev)
        real_demos = _demos(train_real, _without(regression, dev))
        kept = cap_synthetic(synth, len(real_demos), t.synthetic_share, seed=t.seed)
        if not synth:
            arm.skipped = "no synthetic task was accepted for the targeted arm"
        elif not kept:
            # the cap left no synthetic task: this arm would train the control's data in a restarted stream (in
            # the stream, the first pass's batches again, in the same order); the control's own stream goes on
            arm.skipped = (f"train.synthetic_share = {t.synthetic_share} leaves none of the {len(synth)} accepted "
                           f"synthetic tasks beside {len(real_demos)} real demonstrations")
        else:
            demos = real_demos + _demos(kept)
            res = train_sft(cfg, store, artifacts, tracker, demos, base=ckpt, steps=n_steps, on_step=on_step,
                            budget_cpu_s=budget, start_step=start_step, extra_demonstrations=extras, **carry)
            arm.detail.update(demonstrations=len(demos), synthetic=len(kept), start_step=start_step)
            if len(kept) < len(synth):
                arm.detail["synthetic_capped"] = {"accepted": len(synth), "share": t.synthetic_share}
    elif name == "rpo":
        from flywheel.train.preference import pairs_from_samples, pairs_from_tasks, publish_pairs, train_rpo

        why_not: Counter[str] = Counter()
        pairs = pairs_from_tasks(train_real, store=store, skipped=why_not)
        production = len(pairs)
        sampled = _sampled_pairs(store, artifacts, roll, train_real, why_not, pairs_from_samples)
        pairs += sampled
        arm.detail.update(production_pairs=production, sampled_pairs=len(sampled))
        # Only the pairs the arm's steps will see: train_rpo scores every pair it is given under the starting
        # weights first, and ~100 pairs of ~350-token prompts cost that pass minutes on 2 CPU cores when 3
        # steps use 12 of them. Production pairs (what the policy really got wrong) come first.
        # A continuation takes the trial's pairs and the next ones in the same order.
        use = (start_step + n_steps) * max(1, t.batch_size // 2)
        if len(pairs) > use:
            order = sorted(range(len(pairs)), key=lambda i: (pairs[i].source != "production",
                                                             digest(f"rpo|{t.seed}|{pairs[i].task_id}|{i}")))
            pairs = [pairs[i] for i in order[:use]]
        arm.detail["pairs_used"] = len(pairs)
        if why_not:
            arm.detail["pairs_skipped"] = dict(why_not)
        if not pairs:
            arm.skipped = ("no preference pair: no train-side failure kept a rejected answer different from its "
                           f"correction ({dict(why_not)})")
        else:
            pid = publish_pairs(cfg, store, artifacts, pairs, correlation_id=correlation_id)
            res = train_rpo(cfg, store, artifacts, tracker, pairs, base=ckpt, steps=n_steps, lr=t.rpo_lr or t.sft_lr,
                            beta=t.rpo_beta, alpha=t.rpo_alpha, on_step=on_step, preferences_id=pid,
                            budget_cpu_s=budget, start_step=start_step)
            arm.detail.update(pairs=len(pairs), preferences=pid)
    elif name == "grpo":
        res = _grpo_arm(cfg, store, artifacts, tracker, ckpt, dev, arm, on_step, roll, steps=n_steps, budget_cpu_s=budget)
    else:  # pragma: no cover - config validation admits only ARMS
        raise ValueError(f"unknown arm {name!r}")
    if extra_demos and res is not None and name in ("control", "targeted"):
        arm.detail["dev_folded_in"] = len(extra_demos)
    if repair_demos and res is not None and name in ("control", "targeted"):
        arm.detail["regression_repair"] = len(repair_demos)
    arm.wall_s, arm.cpu_s = clock.done()
    if res is not None:
        arm.model_version, arm.model_entity, arm.run_id = res.model_version, res.model_entity, res.run_id
        arm.mlflow_run_id = res.mlflow_run_id
        arm.steps, arm.tokens = res.steps, _tokens(res)
        arm.optimizer_state = getattr(res, "optimizer_state", None)
    else:
        say("learn", {"status": "skipped", "phase": f"arm {name}", "why": arm.skipped})
    return arm


def _sampled_pairs(store: EventStore, artifacts: ArtifactStore, roll: Any, train_real: list[dict],
                   why_not: Counter[str], pairs_from_samples: Callable[..., list]) -> list:
    """Pairs of the first-pass model's verified failures (its rollouts) against the corrections: in a first
    cycle the production answers are the base model's, often prose; its own sampled failures are the
    mistakes it still makes. Dev tasks are never in ``train_real``."""
    if roll is None or not getattr(roll, "published", False):
        return []
    from flywheel.train.data import load_rollout_tables
    from flywheel.train.preference import scored_samples

    tables = load_rollout_tables(store, artifacts, [roll.rollout_id])
    by_task: dict[str, list] = {}
    for _, table, _ in tables:
        for k, v in scored_samples(table).items():
            by_task.setdefault(k, []).extend(v)
    ids = {t["task_id"] for t in train_real}
    return pairs_from_samples([t for t in train_real if t["task_id"] in by_task and t["task_id"] in ids],
                              by_task, skipped=why_not)


def _grpo_arm(cfg: FlywheelConfig, store: EventStore, artifacts: ArtifactStore, tracker: Tracker, ckpt: str,
              dev: set[str], arm: ArmResult, on_step: Callable[[int, dict], None], roll: Any, *, steps: int,
              budget_cpu_s: float | None) -> Any:
    """GRPO on the first-pass model's rollouts, only when enough groups carry signal."""
    from flywheel.train.stage import train_grpo

    t = cfg.train
    if roll is None:
        arm.skipped = "no rollouts of the first-pass model"
        return None
    st = dict(roll.stats or {})
    groups = int(st.get("groups") or 0)
    signal = int(round(groups * (1.0 - float(st.get("zero_variance_share", 1.0)))))
    arm.detail.update(rollouts=roll.rollout_id, groups=groups, signal_groups=signal,
                      zero_variance_share=st.get("zero_variance_share"))
    if not roll.published:
        arm.skipped = f"no rollout dataset was published: {roll.reason}"
        return None
    if signal < t.grpo_min_signal_groups:
        arm.skipped = (f"{signal} of {groups} rollout groups carry signal (< train.grpo_min_signal_groups = "
                       f"{t.grpo_min_signal_groups}): GRPO would spend its budget on a no-op")
        return None
    return train_grpo(cfg, store, artifacts, tracker, [roll.rollout_id], base=ckpt, steps=steps,
                      on_step=on_step, exclude_tasks=dev, budget_cpu_s=budget_cpu_s, drop_zero_variance=True)


def _record(cfg: FlywheelConfig, store: EventStore, tracker: Tracker, r: LearnResult, *, correlation_id: str | None) -> None:
    """``learning.decided`` on ``learn:<id>`` and an MLflow run ``learn`` with every arm's figures."""
    arms = [a.to_dict() for a in r.arms]
    entities = [x for a in r.arms for x in (a.run_id, a.model_entity) if x]
    later = [x for phase in (r.continuation, r.fold_in, r.blend) if phase for x in (phase.get("run_id"), phase.get("model_entity")) if x]
    causation = list(dict.fromkeys([r.first_pass["run_id"], r.first_pass["model_entity"], *entities, *later]))
    with tracker.run("learn", consumes=causation, produces=[r.learn_id],
                     tags={"flywheel.learn": r.learn_id, "flywheel.chosen": r.chosen,
                           "flywheel.model": r.model_entity}) as run:
        run.log_params({"chosen": r.chosen, "arms": ",".join(a.name for a in r.arms), "dev_items": r.dev.get("items", 0),
                        "first_pass_steps": r.first_pass.get("steps"), "arm_steps": cfg.train.arm_steps,
                        "continue_steps": cfg.train.continue_steps, "champion_blend": cfg.train.champion_blend})
        metrics: dict[str, float] = {"first_pass.cpu_s": float(r.first_pass["cpu_s"]),
                                     "first_pass.tokens": float(r.first_pass["tokens"])}
        for a in r.arms:
            metrics[f"{a.name}.cpu_s"] = a.cpu_s
            metrics[f"{a.name}.tokens"] = float(a.tokens)
            if a.dev_passed is not None:
                metrics[f"{a.name}.dev_passed"] = float(a.dev_passed)
            if a.dev_credit is not None:
                metrics[f"{a.name}.dev_credit"] = float(a.dev_credit)
            if a.dev_loss is not None:
                metrics[f"{a.name}.dev_loss"] = float(a.dev_loss)
        if r.continuation and r.continuation.get("cpu_s") is not None:
            metrics["continuation.cpu_s"] = float(r.continuation["cpu_s"])
            metrics["continuation.tokens"] = float(r.continuation.get("tokens") or 0)
        run.log_metrics(metrics, step=0)
        r.metrics = metrics
    name, version = parse_model_entity(r.model_entity)
    store.append(r.learn_id, NewEvent("learning.decided", {
        "entity_id": r.learn_id, "model": r.model_entity, "model_name": name, "model_version": version,
        "chosen": r.chosen, "why": r.why, "arms": arms, "first_pass": r.first_pass, "dev": r.dev, "probe": r.probe,
        "continuation": r.continuation, "fold_in": r.fold_in, "regression": r.regression, "blend": r.blend, "schedule": r.schedule, "cpu_s": r.cpu_s, "wall_s": r.wall_s,
    }, causation), correlation_id=correlation_id)
