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

# The resources of the running cycle (one writer connection per process): set by the flow, read by
# its tasks. Tasks get only plain values as parameters so Prefect can record and hash them.
_R: CycleResources | None = None
# Optional progress callback ``(stage, info)`` for the CLI and the demo.
reporter: Callable[[str, dict[str, Any]], None] | None = None


def _report(stage: str, **info: Any) -> None:
    if reporter is not None:
        reporter(stage, info)


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


def _res() -> CycleResources:
    if _R is None:
        raise RuntimeError("cycle resources are not open: call the stages from flywheel_cycle")
    return _R


# --------------------------------------------------------------------------------------------- tasks


def _stage(stage: str, key: str, correlation_id: str, **args: Any) -> dict:
    """Run one stage's body (:mod:`flywheel.flows.stages`): in this process, or on its work pool when
    ``cycle.pools`` maps it to one (:mod:`flywheel.flows.pools`)."""
    r = _res()
    pool = r.cfg.cycle.pools.get(stage)
    if pool is None:
        return STAGES[stage](r, _report_info, correlation_id=correlation_id, **args)
    from flywheel.flows.pools import run_on_pool

    if stage == "ingest":  # the trace files travel as artifacts: the worker has no access to this disk
        args = {"files": [{**r.artifacts.put_file(p).to_dict(), "name": Path(p).name} for p in args.pop("paths")]}
    _report(stage, status="running", pool=pool)
    return run_on_pool(r.cfg, r.store, stage, pool, key, args, correlation_id)


def _report_info(stage: str, info: dict[str, Any]) -> None:
    _report(stage, **info)


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


# ---------------------------------------------------------------------------------------------- flow


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


@flow(name="flywheel-cycle", log_prints=False, persist_result=True)
def flywheel_cycle(
    traces: list[str] | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Run one flywheel cycle. ``traces``: files to ingest (default: everything in ``<home>/inbox``).
    ``force``: run the learning stages even when no new failure arrived since the last cycle."""
    global _R

    cfg = load_config(config_path, overrides)
    if cfg.cycle.pools:
        from flywheel.flows.pools import check_team_config

        check_team_config(cfg)  # before anything is appended: a pooled stage needs the team's services

    def K(stage: str, **inputs: Any) -> str:  # cache keys are per home: two homes never share a result
        return inputs_key(stage, home=str(cfg.home), **inputs)

    run_id = _flow_run_id()
    cycle_id = f"cycle:{run_id}"
    corr = run_id
    t_start = time.perf_counter()
    _R = CycleResources.open(cfg)
    store = _R.store
    stages: dict[str, Any] = {}
    timings: dict[str, float] = {}  # wall seconds per stage, in the order they ran
    outputs: list[str] = []
    result: dict[str, Any] = {"cycle": cycle_id, "stages": stages, "timings": timings}

    def timed(stage: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - t0, 1)

    def finish(outcome: str, reason: str) -> dict[str, Any]:
        result.update(outcome=outcome, reason=reason, wall_s=round(time.perf_counter() - t_start, 1))
        store.append(cycle_id, NewEvent("cycle.completed", {
            "entity_id": cycle_id, "outcome": outcome, "reason": reason, "stages": stages,
            "wall_s": result["wall_s"], "timings": timings,
        }, list(dict.fromkeys(outputs))), correlation_id=corr)
        result["published"] = publish_cycle(_res(), result)  # Prefect artifacts + the HTML report
        _report("cycle", status="done", outcome=outcome, reason=reason)
        return result

    try:
        paths = list(traces) if traces else _inbox_paths(cfg)
        store.append(cycle_id, NewEvent("cycle.started", {
            "entity_id": cycle_id, "traces": paths, "force": force, "model": cfg.cycle.model_name,
        }), expected_version=0, correlation_id=corr)
        stages["sandbox"] = isolation_report(cfg.sandbox)

        # 1. ingest
        if paths:
            _report("ingest", status="running", files=len(paths))
            stages["ingest"] = timed("ingest", ingest_stage, K("ingest", files=_files_key(paths)), paths, corr)
            _report("ingest", status="done", **{k: stages["ingest"].get(k) for k in ("read", "ingested", "quarantined")})
        new_failures, last_cycle = new_failures_since_last_cycle(store)
        stages["new_failures"] = new_failures
        if new_failures == 0 and not force:
            return finish("nothing_new", "no new failures since the last cycle"
                          + (f" (seq {last_cycle})" if last_cycle else "") + ": nothing new to learn")

        # 2. evals and environments
        _report("evals", status="running")
        stages["evals"] = timed("evals", evals_stage, K("evals", watermark=failure_watermark(store),
                                 evals=cfg.evals.model_dump(), gate=cfg.gate.min_paired_items), corr)
        for warning in stages["evals"].get("warnings") or []:  # said before any training is spent
            _report("evals", status="warning", warning=warning)
        _report("envs", status="running")
        suites = {n: latest_version(store, "suite", n) for n in ("train", cfg.cycle.heldout_suite, cfg.cycle.regression_suite)}
        stages["envs"] = timed("envs", envs_stage, K("envs", suites=suites), corr)
        env_id = latest_version(store, "env", cfg.cycle.train_env)
        heldout = latest_version(store, "suite", cfg.cycle.heldout_suite)
        if env_id is None:
            return finish("no_signal", "no training environment: every failure went to the held-out split "
                                       "or none could be compiled (see the evals stage)")
        if heldout is None:
            return finish("no_signal", "no held-out suite: nothing to gate a challenger on")
        outputs += [env_id, heldout]

        # 3. synthetic widening (train.mode = arms with a probe: later, aimed by the probe)
        probe_aims_synth = cfg.train.mode == "arms" and "targeted" in cfg.train.arms and cfg.train.probe_tasks > 0
        if cfg.synth.per_seed > 0 and cfg.synth.generators and not probe_aims_synth:
            _report("synth", status="running")
            stages["synth"] = timed("synth", synth_stage, K("synth", env=env_id, heldout=heldout,
                                     synth=cfg.synth.model_dump()), corr)
            env_id = latest_version(store, "env", cfg.cycle.train_env)
            outputs.append(env_id)

        # 4. rollouts from the champion: what GRPO learns from, and what train.mode = auto decides on.
        # With train.mode = sft they would be sampled and thrown away (the GRPO step samples the SFT
        # model instead), so they are skipped.
        tracker = _R.tracker
        name = cfg.cycle.model_name
        champion = reconcile_champion(store, tracker, name).champion  # an interrupted promotion is completed
        champion_ref = f"model:{name}/{champion}" if champion is not None else f"base:{cfg.policy.base_model}"
        roll: dict[str, Any] = {}
        if cfg.train.mode not in ("sft", "arms"):
            _report("rollouts", status="running", policy=champion_ref)
            roll = timed("rollouts", rollout_stage, K("rollouts", env=env_id, policy=champion_ref,
                                                      rollout=cfg.rollout.model_dump()),
                         champion_ref if champion is not None else cfg.policy.base_model, corr)
            stages["rollouts"] = roll
            if roll.get("published"):
                outputs.append(roll["rollout_id"])
        base = champion_ref if champion is not None else cfg.policy.base_model

        # 5. training: SFT warm start when GRPO would learn nothing, then GRPO
        st = roll.get("stats") or {}
        mode = cfg.train.mode
        why = f"train.mode = {mode}"
        if mode == "auto":
            mode, why = choose_mode(st.get("zero_variance_share", 1.0), st.get("pass_at_k", 0.0),
                                    threshold=cfg.train.sft_trigger_zero_variance)
        stages["train_mode"] = {"mode": mode, "why": why}
        challenger: int | None = None
        if mode == "arms":
            _report("learn", status="running", why=why)
            learn = timed("learn", learn_stage, K("learn", env=env_id, base=base, train=cfg.train.model_dump(),
                                                  synth=cfg.synth.model_dump()), base, corr)
            stages["learn"] = learn
            challenger = learn["model_version"]
            outputs += [learn["learn_id"], learn["model_entity"]]
        elif mode == "sft":
            _report("train-sft", status="running", why=why)
            sft = timed("train-sft", sft_stage, K("sft", env=env_id, base=base, train=cfg.train.model_dump()), base, corr)
            stages["sft"] = sft
            if "skipped" in sft:
                return finish("no_signal", f"SFT was needed ({why}) but {sft['skipped']}")
            challenger = sft["model_version"]
            outputs.append(sft["model_entity"])
            if cfg.train.steps > 0:
                # GRPO on top of the SFT model, from its own rollouts.
                sft_ref = sft["model_entity"]
                roll2 = timed("rollouts-after-sft", rollout_stage, K("rollouts", env=env_id, policy=sft_ref,
                                 rollout=cfg.rollout.model_dump()), sft_ref, corr)
                stages["rollouts_after_sft"] = roll2
                st2 = roll2.get("stats") or {}
                if roll2.get("published") and st2.get("zero_variance_share", 1.0) < 1.0:
                    outputs.append(roll2["rollout_id"])
                    grpo = timed("train-grpo", grpo_stage, K("grpo", rollouts=[roll2["rollout_id"]], base=sft_ref,
                                 train=cfg.train.model_dump()), [roll2["rollout_id"]], sft_ref, corr)
                    stages["grpo"] = grpo
                    challenger = grpo["model_version"]
                    outputs.append(grpo["model_entity"])
                else:
                    stages["grpo"] = {"skipped": "every group of the SFT model's rollouts has zero reward variance: "
                                                 "no GRPO signal; gating the SFT model"}
        else:
            if not roll.get("published"):
                return finish("no_signal", f"no rollout dataset was published: {roll.get('reason')}")
            grpo = timed("train-grpo", grpo_stage, K("grpo", rollouts=[roll["rollout_id"]], base=base,
                             train=cfg.train.model_dump()), [roll["rollout_id"]], base, corr)
            stages["grpo"] = grpo
            challenger = grpo["model_version"]
            outputs.append(grpo["model_entity"])

        # 6. gate and deploy
        gate = timed("gate", gate_stage, K("gate", model=f"model:{name}/{challenger}", suite=heldout,
                             gate=cfg.gate.model_dump()), challenger, corr)
        stages["gate"] = gate
        outputs.append(gate["gate_id"])
        if gate["outcome"] == "passed":
            dep = timed("deploy", deploy_stage, K("deploy", model=challenger, gate=gate["gate_id"]), challenger,
                        gate["gate_id"], corr)
            stages["deploy"] = dep
            return finish("promoted", f"model:{name}/{challenger} passed the gate and is the new champion")
        if gate["outcome"] == "insufficient_evidence":
            return finish("insufficient_evidence", f"model:{name}/{challenger} was not promoted: insufficient "
                          "evidence (the champion stays): " + "; ".join(gate["reasons"]))
        return finish("refused", f"model:{name}/{challenger} was refused by the gate: " + "; ".join(gate["reasons"]))
    except BaseException as e:
        _report("cycle", status="failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        _R.close()
        _R = None


def run_cycle(
    cfg: FlywheelConfig,
    *,
    traces: list[str] | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run :func:`flywheel_cycle` now (ephemeral Prefect, or the server in ``PREFECT_API_URL``)."""
    global reporter
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_RESULTS_PERSIST_BY_DEFAULT,
        temporary_settings,
    )

    storage = Path(cfg.home) / "prefect" / "storage"
    storage.mkdir(parents=True, exist_ok=True, mode=0o700)
    ov = dict(overrides or {})
    ov.setdefault("home", str(cfg.home))
    reporter = on_progress
    try:
        with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_RESULTS_PERSIST_BY_DEFAULT: True}):
            return flywheel_cycle(traces=traces, config_path=config_path, overrides=ov, force=force)
    finally:
        reporter = None
