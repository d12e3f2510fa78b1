"""The bodies of the cycle's stages, one plain function each: ``(resources, report, **args) -> summary``.

``flows/cycle.py`` runs them in the cycle's own process (the embedded default) and
``flows/pools.py`` runs them as ``flywheel-stage/<pool>`` deployments on a Prefect work pool
(``cycle.pools``). Either way a stage gets only plain JSON values as arguments (entity ids, model
refs, artifact refs), reads its inputs from the event store and the artifact store, and returns a
JSON-safe summary (published to the Prefect UI by :func:`flywheel.flows.ui_artifacts.publish_stage`).
So a stage never needs the disk of the machine that ran the stage before it.

``report(stage, info)`` is the progress callback of the CLI and the demo (a no-op on a worker).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.flows.ui_artifacts import publish_stage

from flywheel.cycle import CycleResources, summarize

Report = Callable[[str, dict[str, Any]], None]


def no_report(stage: str, info: dict[str, Any]) -> None:
    """The progress callback of a stage that runs on a worker: nobody watches its terminal."""


def ingest(r: CycleResources, report: Report, *, correlation_id: str, paths: list[str] | None = None,
           files: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Ingest trace files: local ``paths`` (in-process), or ``files`` -- artifact refs
    ``{sha256, ext, name}`` the cycle uploaded, fetched here under their original names (ingest ids
    derive from the file's name and content, so a pooled ingest records what a local one would)."""
    from flywheel.ingest import ingest_paths

    tmp: Path | None = None
    try:
        if files is not None:
            tmp = Path(tempfile.mkdtemp(prefix="ingest-", dir=r.cfg.home))
            local = []
            for f in files:
                dest = tmp / Path(f["name"]).name
                shutil.copyfile(r.artifacts.verify(f["sha256"]), dest)
                local.append(dest)
        else:
            local = [Path(p) for p in paths or []]
        report("ingest", {"status": "running", "files": len(local)})
        s = ingest_paths(r.cfg, r.store, r.artifacts, local, correlation_id=correlation_id)
        return publish_stage("ingest", summarize(s))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def evals(r: CycleResources, report: Report, *, correlation_id: str) -> dict[str, Any]:
    from flywheel.evals import build_evals

    return publish_stage("evals", summarize(build_evals(r.cfg, r.store, r.artifacts, correlation_id=correlation_id)))


def envs(r: CycleResources, report: Report, *, correlation_id: str) -> dict[str, Any]:
    from flywheel.envs import build_envs

    return publish_stage("envs", summarize(build_envs(r.cfg, r.store, r.artifacts, correlation_id=correlation_id)))


def synth(r: CycleResources, report: Report, *, correlation_id: str) -> dict[str, Any]:
    from flywheel.synth import run_synth

    return publish_stage("synth", summarize(run_synth(r.cfg, r.store, r.artifacts, env=r.cfg.cycle.train_env,
                                                      correlation_id=correlation_id)))


def rollouts(r: CycleResources, report: Report, *, policy: str, correlation_id: str) -> dict[str, Any]:
    from flywheel.rollouts import run_rollouts

    t0 = time.perf_counter()
    s = run_rollouts(r.cfg, r.store, r.artifacts, r.tracker, policy=policy, correlation_id=correlation_id,
                     progress=lambda p: report("rollouts", {"status": "running", "policy": policy, **p}))
    out = summarize(s)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return publish_stage("rollouts", out)


def train_sft(r: CycleResources, report: Report, *, base: str, correlation_id: str) -> dict[str, Any]:
    from flywheel.train.demos import train_split_demonstrations
    from flywheel.train.stage import train_sft as _train_sft

    demos = train_split_demonstrations(r.cfg, r.store, r.artifacts)
    if not demos:
        return publish_stage("train-sft", {"skipped": "no demonstrations: no train task has a reference answer"})

    def on_step(step: int, m: dict[str, Any]) -> None:
        report("train-sft", {"status": "running", "step": step, "total": r.cfg.train.sft_steps, "loss": m.get("loss")})

    res = _train_sft(r.cfg, r.store, r.artifacts, r.tracker, demos, base=base, on_step=on_step)
    out = summarize(res)
    out["demonstrations"] = len(demos)
    out["history"] = [{"step": h.get("step"), "loss": h.get("loss")} for h in res.history]
    return publish_stage("train-sft", out)


def train_grpo(r: CycleResources, report: Report, *, rollout_ids: list[str], base: str,
               correlation_id: str) -> dict[str, Any]:
    from flywheel.train.stage import train_grpo as _train_grpo

    def on_step(step: int, m: dict[str, Any]) -> None:
        report("train-grpo", {"status": "running", "step": step, "total": r.cfg.train.steps, "loss": m.get("loss"),
                              "reward": m.get("reward_mean")})

    res = _train_grpo(r.cfg, r.store, r.artifacts, r.tracker, rollout_ids, base=base, on_step=on_step)
    out = summarize(res)
    out["history"] = [{k: h.get(k) for k in ("step", "loss", "reward_mean", "kl", "clip_frac", "grad_norm")}
                      for h in res.history]
    return publish_stage("train-grpo", out)


def learn(r: CycleResources, report: Report, *, base: str, correlation_id: str) -> dict[str, Any]:
    """``train.mode = arms``: the learning stage of :mod:`flywheel.learn` (first pass, probe-aimed
    synthesis, arms, choice on dev, fold-in). Its synthesis runs where it runs."""
    from flywheel.learn import run_learning
    from flywheel.synth import run_synth

    def synthesize(plan: dict[str, int]) -> dict[str, Any]:
        return summarize(run_synth(r.cfg, r.store, r.artifacts, env=r.cfg.cycle.train_env,
                                   correlation_id=correlation_id, plan=plan))

    res = run_learning(r.cfg, r.store, r.artifacts, r.tracker, base=base, correlation_id=correlation_id,
                       progress=report, synthesize=synthesize)
    return publish_stage("learn", summarize(res))


def gate(r: CycleResources, report: Report, *, model_version: int, correlation_id: str) -> dict[str, Any]:
    from flywheel.gate import run_gate

    report("gate", {"status": "running", "model_version": model_version})
    d = run_gate(r.cfg, r.store, r.artifacts, r.tracker, model_version, correlation_id=correlation_id)
    return publish_stage("gate", summarize(d))


def deploy(r: CycleResources, report: Report, *, model_version: int, gate_id: str,
           correlation_id: str) -> dict[str, Any]:
    from flywheel.deploy import promote

    dep = promote(r.cfg, r.store, r.tracker, model_version, correlation_id=correlation_id)
    return publish_stage("deploy", summarize(dep))


#: Stage name (as in ``cycle.pools`` and the Prefect task names) -> body.
STAGES: dict[str, Callable[..., dict[str, Any]]] = {
    "ingest": ingest,
    "evals": evals,
    "envs": envs,
    "synth": synth,
    "rollouts": rollouts,
    "train-sft": train_sft,
    "train-grpo": train_grpo,
    "learn": learn,
    "gate": gate,
    "deploy": deploy,
}
