"""``flywheel_cycle``: one turn of the flywheel as a Prefect flow.

    ingest -> evals -> envs -> synth -> rollouts -> train (SFT warm start when needed, then GRPO)
    -> gate -> deploy

Each stage is a Prefect task that calls the library's stage function (the library knows nothing of
Prefect). Entrypoint for deployments: ``flows/cycle.py:flywheel_cycle``.

- Retries: only for infrastructure errors (:func:`flywheel.cycle.is_infra_error`: a server that is
  down, a connection reset, a held lock), never for a refused gate, invalid data or a bug.
- Caching: every task's cache key is a hash of the entity versions it consumes
  (:func:`flywheel.cycle.inputs_key`) and results are persisted (under ``<home>/prefect`` in the
  embedded default), so a re-run after a crash skips the stages that finished. The stages are also
  idempotent in the event store (deterministic event ids, published-once rollouts), so even a stage
  that runs again appends no duplicate events or artifacts.
- Correlation: ``cycle.started`` / ``cycle.completed`` on stream ``cycle:<flow run id>``; every event
  of the cycle carries the flow run id as its correlation id.
- Early exit: a cycle with no new failures since the last completed cycle, or no learning signal,
  ends early and says why in ``cycle.completed``.
- Sandbox: ``stages["sandbox"]`` (recorded in ``cycle.completed``) is the isolation sandboxed verifiers
  got on this machine (:func:`flywheel.sandbox.isolation_report`); the CLI summary warns loudly when
  it is weak or incomplete.
- Prefect UI: each stage's task run carries a markdown artifact of its result, and the flow run a
  summary and a per-stage table under keys stable per deployment (:mod:`flywheel.flows.ui_artifacts`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.flows.cycle_env import prefect_environment  # noqa: F401 - re-exported
from flywheel.flows.stages import STAGES
from flywheel.flows.ui_artifacts import publish_cycle
from prefect import flow, task

from flywheel.champion import reconcile_champion
from flywheel.config import FlywheelConfig, load_config
from flywheel.cycle import (
    CycleResources,
    failure_watermark,
    inputs_key,
    is_infra_error,
    latest_version,
    new_failures_since_last_cycle,
)
from flywheel.sandbox import isolation_report
from flywheel.store import NewEvent
from flywheel.train.stage import choose_mode

# Progress callback ``(stage, info)`` for the CLI and the demo.
Reporter = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class _CycleRun:
    """One running cycle: created by :func:`flywheel_cycle` and handed to each of its steps. It holds
    the cycle's resources (one writer connection per process), its progress callback, and what the
    cycle records as it goes (``stages``, ``timings``, ``outputs``)."""

    cfg: FlywheelConfig
    res: CycleResources
    reporter: Reporter | None
    cycle_id: str
    corr: str
    t_start: float
    stages: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # wall seconds per stage, in the order they ran
    outputs: list[str] = field(default_factory=list)

    def report(self, stage: str, **info: object) -> None:
        if self.reporter is not None:
            self.reporter(stage, info)

    def report_info(self, stage: str, info: dict[str, Any]) -> None:
        self.report(stage, **info)

    def key(self, stage: str, **inputs: object) -> str:
        """A task's cache key. Cache keys are per home: two homes never share a result."""
        return inputs_key(stage, home=str(self.cfg.home), **inputs)

    def timed(self, stage: str, fn: Callable[..., dict[str, Any]], *args: object) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.timings[stage] = round(self.timings.get(stage, 0.0) + time.perf_counter() - t0, 1)

    def finish(self, end: _End) -> dict[str, Any]:
        """Record ``cycle.completed``, publish the cycle to the Prefect UI and the HTML report; the flow's result."""
        result: dict[str, Any] = {"cycle": self.cycle_id, "stages": self.stages, "timings": self.timings}
        result.update(outcome=end.outcome, reason=end.reason, wall_s=round(time.perf_counter() - self.t_start, 1))
        self.res.store.append(self.cycle_id, NewEvent("cycle.completed", {
            "entity_id": self.cycle_id, "outcome": end.outcome, "reason": end.reason, "stages": self.stages,
            "wall_s": result["wall_s"], "timings": self.timings,
        }, list(dict.fromkeys(self.outputs))), correlation_id=self.corr)
        result["published"] = publish_cycle(self.res, result)  # Prefect artifacts + the HTML report
        self.report("cycle", status="done", outcome=end.outcome, reason=end.reason)
        return result


@dataclass(frozen=True)
class _End:
    """How a cycle ends: the ``outcome`` recorded in ``cycle.completed``, and why."""

    outcome: str
    reason: str


@dataclass(frozen=True)
class _Targets:
    """What the learning stages work on: the training environment version and the held-out suite version."""

    env_id: str
    heldout: str


@dataclass(frozen=True)
class _Start:
    """Where training starts: the policy (``model:<name>/<v>`` of the champion, else the base model), and
    the champion's rollouts (empty when they were skipped)."""

    base: str
    rollouts: dict[str, Any]


# The cycle that is running in this context: set by flywheel_cycle around its body, read by its tasks.
# Tasks get only plain values as parameters so Prefect can record and hash them; a context variable,
# not a parameter, carries the run to them (Prefect runs a flow's tasks in the flow's thread and context).
_RUN: ContextVar[_CycleRun | None] = ContextVar("flywheel_cycle_run", default=None)
# The progress callback run_cycle hands to the flow it calls (a flow's parameters are JSON values).
_REPORTER: ContextVar[Reporter | None] = ContextVar("flywheel_cycle_reporter", default=None)


def _retry_on_infra(task_: Any, task_run: Any, state: Any) -> bool:
    try:
        exc = state.result(raise_on_failure=False)
    except BaseException as e:  # noqa: BLE001 - whatever the state holds is what we classify
        exc = e
    return is_infra_error(exc if isinstance(exc, BaseException) else None)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    return parameters["key"]


STAGE = dict(
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=_retry_on_infra,
    cache_key_fn=_cache_key,
    persist_result=True,
)


def _run() -> _CycleRun:
    run = _RUN.get()
    if run is None:
        raise RuntimeError("cycle resources are not open: call the stages from flywheel_cycle")
    return run


# --------------------------------------------------------------------------------------------- tasks


def _stage(stage: str, key: str, correlation_id: str, **args: Any) -> dict:
    """Run one stage's body (:mod:`flywheel.flows.stages`): in this process, or on its work pool when
    ``cycle.pools`` maps it to one (:mod:`flywheel.flows.pools`)."""
    run = _run()
    r = run.res
    pool = r.cfg.cycle.pools.get(stage)
    if pool is None:
        return STAGES[stage](r, run.report_info, correlation_id=correlation_id, **args)
    from flywheel.flows.pools import run_on_pool

    if stage == "ingest":  # the trace files travel as artifacts: the worker has no access to this disk
        args = {"files": [{**r.artifacts.put_file(p).to_dict(), "name": Path(p).name} for p in args.pop("paths")]}
    run.report(stage, status="running", pool=pool)
    return run_on_pool(r.cfg, r.store, stage, pool, key, args, correlation_id)


@task(name="ingest", **STAGE)
def ingest_stage(key: str, paths: list[str], correlation_id: str) -> dict:
    return _stage("ingest", key, correlation_id, paths=paths)


@task(name="evals", **STAGE)
def evals_stage(key: str, correlation_id: str) -> dict:
    return _stage("evals", key, correlation_id)


@task(name="envs", **STAGE)
def envs_stage(key: str, correlation_id: str) -> dict:
    return _stage("envs", key, correlation_id)


@task(name="synth", **STAGE)
def synth_stage(key: str, correlation_id: str) -> dict:
    return _stage("synth", key, correlation_id)


@task(name="rollouts", **STAGE)
def rollout_stage(key: str, policy: str, correlation_id: str) -> dict:
    return _stage("rollouts", key, correlation_id, policy=policy)


@task(name="train-sft", **STAGE)
def sft_stage(key: str, base: str, correlation_id: str) -> dict:
    return _stage("train-sft", key, correlation_id, base=base)


@task(name="train-grpo", **STAGE)
def grpo_stage(key: str, rollout_ids: list[str], base: str, correlation_id: str) -> dict:
    return _stage("train-grpo", key, correlation_id, rollout_ids=rollout_ids, base=base)


@task(name="learn", **STAGE)
def learn_stage(key: str, base: str, correlation_id: str) -> dict:
    """``train.mode = arms``: the learning stage of :mod:`flywheel.learn`."""
    return _stage("learn", key, correlation_id, base=base)


@task(name="gate", **STAGE)
def gate_stage(key: str, model_version: int, correlation_id: str) -> dict:
    return _stage("gate", key, correlation_id, model_version=model_version)


@task(name="deploy", **STAGE)
def deploy_stage(key: str, model_version: int, gate_id: str, correlation_id: str) -> dict:
    return _stage("deploy", key, correlation_id, model_version=model_version, gate_id=gate_id)


# ------------------------------------------------------------------------------------------- helpers


def _inbox_paths(cfg: FlywheelConfig) -> list[str]:
    inbox = Path(cfg.home) / "inbox"
    if not inbox.is_dir():
        return []
    return sorted(str(p) for p in inbox.iterdir() if p.is_file() and not p.name.startswith("."))


def _files_key(paths: list[str]) -> list[list[Any]]:
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append([str(Path(p).resolve()), st.st_size, int(st.st_mtime)])
    return out


def _flow_run_id() -> str:
    try:
        from prefect.runtime import flow_run

        fid = flow_run.get_id()
        if fid:
            return str(fid)
    except Exception:  # noqa: BLE001 - outside a flow run (direct call in tests)
        pass
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------- steps
# The flow's steps, in order. A step that can end the cycle returns an _End instead of its result.


def _start(run: _CycleRun, traces: list[str] | None, force: bool) -> list[str]:
    """Record ``cycle.started`` (the cycle's first event) and the sandbox isolation; the files to ingest."""
    cfg = run.cfg
    paths = list(traces) if traces else _inbox_paths(cfg)
    run.res.store.append(run.cycle_id, NewEvent("cycle.started", {
        "entity_id": run.cycle_id, "traces": paths, "force": force, "model": cfg.cycle.model_name,
    }), expected_version=0, correlation_id=run.corr)
    run.stages["sandbox"] = isolation_report(cfg.sandbox)
    return paths


def _ingest(run: _CycleRun, paths: list[str], force: bool) -> _End | None:
    """1. Ingest the files; end the cycle when no new failure arrived since the last one (unless ``force``)."""
    stages = run.stages
    if paths:
        run.report("ingest", status="running", files=len(paths))
        stages["ingest"] = run.timed("ingest", ingest_stage, run.key("ingest", files=_files_key(paths)), paths, run.corr)
        run.report("ingest", status="done", **{k: stages["ingest"].get(k) for k in ("read", "ingested", "quarantined")})
    new_failures, last_cycle = new_failures_since_last_cycle(run.res.store)
    stages["new_failures"] = new_failures
    if new_failures == 0 and not force:
        return _End("nothing_new", "no new failures since the last cycle"
                    + (f" (seq {last_cycle})" if last_cycle else "") + ": nothing new to learn")
    return None


def _evals_and_envs(run: _CycleRun) -> _Targets | _End:
    """2. Evals and environments: the training environment and the held-out suite, when both exist."""
    cfg, store, stages = run.cfg, run.res.store, run.stages
    run.report("evals", status="running")
    stages["evals"] = run.timed("evals", evals_stage, run.key("evals", watermark=failure_watermark(store),
                                evals=cfg.evals.model_dump(), gate=cfg.gate.min_paired_items), run.corr)
    for warning in stages["evals"].get("warnings") or []:  # said before any training is spent
        run.report("evals", status="warning", warning=warning)
    run.report("envs", status="running")
    suites = {n: latest_version(store, "suite", n) for n in ("train", cfg.cycle.heldout_suite, cfg.cycle.regression_suite)}
    stages["envs"] = run.timed("envs", envs_stage, run.key("envs", suites=suites), run.corr)
    env_id = latest_version(store, "env", cfg.cycle.train_env)
    heldout = latest_version(store, "suite", cfg.cycle.heldout_suite)
    if env_id is None:
        return _End("no_signal", "no training environment: every failure went to the held-out split "
                                 "or none could be compiled (see the evals stage)")
    if heldout is None:
        return _End("no_signal", "no held-out suite: nothing to gate a challenger on")
    run.outputs.extend([env_id, heldout])
    return _Targets(env_id=env_id, heldout=heldout)


def _widen(run: _CycleRun, targets: _Targets) -> _Targets:
    """3. Synthetic widening (train.mode = arms with a probe: later, aimed by the probe)."""
    cfg = run.cfg
    probe_aims_synth = cfg.train.mode == "arms" and "targeted" in cfg.train.arms and cfg.train.probe_tasks > 0
    if not (cfg.synth.per_seed > 0 and cfg.synth.generators and not probe_aims_synth):
        return targets
    run.report("synth", status="running")
    run.stages["synth"] = run.timed("synth", synth_stage, run.key("synth", env=targets.env_id, heldout=targets.heldout,
                                    synth=cfg.synth.model_dump()), run.corr)
    env_id = latest_version(run.res.store, "env", cfg.cycle.train_env)
    assert env_id is not None  # synth widened a version of it: it has a latest one
    run.outputs.append(env_id)
    return _Targets(env_id=env_id, heldout=targets.heldout)


def _champion_rollouts(run: _CycleRun, targets: _Targets) -> _Start:
    """4. Rollouts from the champion: what GRPO learns from, and what train.mode = auto decides on.
    With train.mode = sft they would be sampled and thrown away (the GRPO step samples the SFT model
    instead), so they are skipped."""
    cfg = run.cfg
    name = cfg.cycle.model_name
    champion = reconcile_champion(run.res.store, run.res.tracker, name).champion  # an interrupted promotion is completed
    champion_ref = f"model:{name}/{champion}" if champion is not None else f"base:{cfg.policy.base_model}"
    roll: dict[str, Any] = {}
    if cfg.train.mode not in ("sft", "arms"):
        run.report("rollouts", status="running", policy=champion_ref)
        roll = run.timed("rollouts", rollout_stage, run.key("rollouts", env=targets.env_id, policy=champion_ref,
                                                             rollout=cfg.rollout.model_dump()),
                         champion_ref if champion is not None else cfg.policy.base_model, run.corr)
        run.stages["rollouts"] = roll
        if roll.get("published"):
            run.outputs.append(roll["rollout_id"])
    return _Start(base=champion_ref if champion is not None else cfg.policy.base_model, rollouts=roll)


def _train(run: _CycleRun, targets: _Targets, start: _Start) -> int | _End:
    """5. Training: SFT warm start when GRPO would learn nothing, then GRPO. The challenger's version."""
    cfg = run.cfg
    st = start.rollouts.get("stats") or {}
    mode: str = cfg.train.mode
    why = f"train.mode = {mode}"
    if mode == "auto":
        mode, why = choose_mode(st.get("zero_variance_share", 1.0), st.get("pass_at_k", 0.0),
                                threshold=cfg.train.sft_trigger_zero_variance)
    run.stages["train_mode"] = {"mode": mode, "why": why}
    if mode == "arms":
        return _learn(run, targets, start.base, why)
    if mode == "sft":
        return _sft_then_grpo(run, targets, start.base, why)
    roll = start.rollouts
    if not roll.get("published"):
        return _End("no_signal", f"no rollout dataset was published: {roll.get('reason')}")
    return _grpo(run, targets, roll["rollout_id"], start.base)


def _learn(run: _CycleRun, targets: _Targets, base: str, why: str) -> int:
    """train.mode = arms: the learning stage of :mod:`flywheel.learn`."""
    cfg = run.cfg
    run.report("learn", status="running", why=why)
    learn = run.timed("learn", learn_stage, run.key("learn", env=targets.env_id, base=base,
                                                    train=cfg.train.model_dump(), synth=cfg.synth.model_dump()),
                      base, run.corr)
    run.stages["learn"] = learn
    run.outputs.extend([learn["learn_id"], learn["model_entity"]])
    return learn["model_version"]


def _sft_then_grpo(run: _CycleRun, targets: _Targets, base: str, why: str) -> int | _End:
    """SFT from ``base``; then (``train.steps > 0``) GRPO on top of the SFT model, from its own rollouts."""
    cfg = run.cfg
    run.report("train-sft", status="running", why=why)
    sft = run.timed("train-sft", sft_stage, run.key("sft", env=targets.env_id, base=base,
                                                    train=cfg.train.model_dump()), base, run.corr)
    run.stages["sft"] = sft
    if "skipped" in sft:
        return _End("no_signal", f"SFT was needed ({why}) but {sft['skipped']}")
    challenger: int = sft["model_version"]
    run.outputs.append(sft["model_entity"])
    if cfg.train.steps <= 0:
        return challenger
    # GRPO on top of the SFT model, from its own rollouts.
    sft_ref = sft["model_entity"]
    roll2 = run.timed("rollouts-after-sft", rollout_stage, run.key("rollouts", env=targets.env_id, policy=sft_ref,
                      rollout=cfg.rollout.model_dump()), sft_ref, run.corr)
    run.stages["rollouts_after_sft"] = roll2
    st2 = roll2.get("stats") or {}
    if roll2.get("published") and st2.get("zero_variance_share", 1.0) < 1.0:
        run.outputs.append(roll2["rollout_id"])
        return _grpo(run, targets, roll2["rollout_id"], sft_ref)
    run.stages["grpo"] = {"skipped": "every group of the SFT model's rollouts has zero reward variance: "
                                     "no GRPO signal; gating the SFT model"}
    return challenger


def _grpo(run: _CycleRun, targets: _Targets, rollout_id: str, base: str) -> int:
    """GRPO from ``base`` on the rollout dataset ``rollout_id``."""
    grpo = run.timed("train-grpo", grpo_stage, run.key("grpo", rollouts=[rollout_id], base=base,
                     train=run.cfg.train.model_dump()), [rollout_id], base, run.corr)
    run.stages["grpo"] = grpo
    run.outputs.append(grpo["model_entity"])
    return grpo["model_version"]


def _gate_and_deploy(run: _CycleRun, targets: _Targets, challenger: int) -> _End:
    """6. Gate the challenger on the held-out suite; deploy it when it passes."""
    name = run.cfg.cycle.model_name
    gate = run.timed("gate", gate_stage, run.key("gate", model=f"model:{name}/{challenger}", suite=targets.heldout,
                     gate=run.cfg.gate.model_dump()), challenger, run.corr)
    run.stages["gate"] = gate
    run.outputs.append(gate["gate_id"])
    if gate["outcome"] == "passed":
        dep = run.timed("deploy", deploy_stage, run.key("deploy", model=challenger, gate=gate["gate_id"]), challenger,
                        gate["gate_id"], run.corr)
        run.stages["deploy"] = dep
        return _End("promoted", f"model:{name}/{challenger} passed the gate and is the new champion")
    if gate["outcome"] == "insufficient_evidence":
        return _End("insufficient_evidence", f"model:{name}/{challenger} was not promoted: insufficient "
                    "evidence (the champion stays): " + "; ".join(gate["reasons"]))
    return _End("refused", f"model:{name}/{challenger} was refused by the gate: " + "; ".join(gate["reasons"]))


# ---------------------------------------------------------------------------------------------- flow


@flow(name="flywheel-cycle", log_prints=False, persist_result=True)
def flywheel_cycle(
    traces: list[str] | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Run one flywheel cycle. ``traces``: files to ingest (default: everything in ``<home>/inbox``).
    ``force``: run the learning stages even when no new failure arrived since the last cycle."""
    cfg = load_config(config_path, overrides)
    if cfg.cycle.pools:
        from flywheel.flows.pools import check_team_config

        check_team_config(cfg)  # before anything is appended: a pooled stage needs the team's services
    run_id = _flow_run_id()
    t_start = time.perf_counter()
    run = _CycleRun(cfg=cfg, res=CycleResources.open(cfg), reporter=_REPORTER.get(), cycle_id=f"cycle:{run_id}",
                    corr=run_id, t_start=t_start)
    token = _RUN.set(run)
    try:
        paths = _start(run, traces, force)
        if (end := _ingest(run, paths, force)) is not None:
            return run.finish(end)
        targets = _evals_and_envs(run)
        if isinstance(targets, _End):
            return run.finish(targets)
        targets = _widen(run, targets)
        start = _champion_rollouts(run, targets)
        challenger = _train(run, targets, start)
        if isinstance(challenger, _End):
            return run.finish(challenger)
        return run.finish(_gate_and_deploy(run, targets, challenger))
    except BaseException as e:
        run.report("cycle", status="failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        try:
            run.res.close()
        finally:
            _RUN.reset(token)


def run_cycle(
    cfg: FlywheelConfig,
    *,
    traces: list[str] | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    on_progress: Reporter | None = None,
) -> dict[str, Any]:
    """Run :func:`flywheel_cycle` now (ephemeral Prefect, or the server in ``PREFECT_API_URL``)."""
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_RESULTS_PERSIST_BY_DEFAULT,
        temporary_settings,
    )

    storage = Path(cfg.home) / "prefect" / "storage"
    storage.mkdir(parents=True, exist_ok=True, mode=0o700)
    ov = dict(overrides or {})
    ov.setdefault("home", str(cfg.home))
    token = _REPORTER.set(on_progress)
    try:
        with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_RESULTS_PERSIST_BY_DEFAULT: True}):
            return flywheel_cycle(traces=traces, config_path=config_path, overrides=ov, force=force)
    finally:
        _REPORTER.reset(token)
