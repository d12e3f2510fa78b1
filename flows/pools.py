"""Stages on the work pool that fits them (``cycle.pools``): team mode across machines.

The cycle stays one Prefect flow for the user (``flywheel-cycle``). A stage mapped to a pool, e.g.
``cycle.pools = {learn = "gpu", gate = "gpu", ingest = "cpu"}``, runs as a flow run of the deployment
``flywheel-stage/<pool>`` on a ``prefect worker`` of that pool, linked in Prefect's UI as a sub-run of the
cycle; the other stages run in the cycle's own process as before.

What makes that work across machines (nothing here reads another machine's disk):

- the stage gets plain JSON arguments (entity ids, model refs, and for ingest the trace files as artifact
  refs the cycle uploaded) and the cycle's settings without its machine-local paths
  (:func:`stage_overrides`); the worker's own ``FLYWHEEL_HOME`` is its local cache;
- inputs and outputs travel through the team's shared services, which :func:`check_team_config` requires:
  the PostgreSQL event store (``store.url``), the remote artifact store (``artifacts.url``) and the MLflow
  server (``mlflow_tracking_uri``: models are found by registry reference);
- the stage's summary comes back as a ``stage.completed`` event on ``stage:<key>`` (the cycle's cache key of
  that stage: its inputs' hash), which also says which pool, host and flow run ran it. A stage whose
  ``stage.completed`` exists is not run again: a re-run cycle resumes after its last completed stage.

Retries: a stage run that crashed (its worker died) or failed with an infrastructure error
(:func:`flywheel.cycle.is_infra_error`, re-raised on the worker as :class:`StageInfraError`) raises
:class:`~flywheel.vocab.errors.InfraError` in the cycle, whose task then submits a new run to the same pool
(the task's retries, infrastructure errors only). Any other failure fails the cycle with the worker's
message.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

from prefect import flow

from flywheel.config import FlywheelConfig, load_config
from flywheel.cycle import CycleResources, is_infra_error
from flywheel.store import ConcurrencyError, NewEvent
from flywheel.vocab.errors import InfraError

STAGE_FLOW = "flywheel-stage"
STAGE_ENTRYPOINT = "flows/pools.py:flywheel_stage"
# Settings that name this machine's disk: a worker uses its own.
_LOCAL_FIELDS = ("home", "warehouse", "mlflow_artifact_root")


class PoolConfigError(ValueError):
    """``cycle.pools`` is set but the shared services a pooled stage needs are not."""


class StageInfraError(InfraError):
    """An infrastructure error on a worker (server down, connection reset): the cycle retries the stage."""


def check_team_config(cfg: FlywheelConfig) -> None:
    """Pooled stages run on other machines: they need the team's shared store, artifacts and MLflow."""
    missing = []
    if not cfg.store.url:
        missing.append("store.url (the PostgreSQL event store every worker reaches)")
    if not cfg.artifacts.url:
        missing.append("artifacts.url (an object store or mlflow-artifacts:, not one machine's disk)")
    if not str(cfg.mlflow_tracking_uri).startswith(("http://", "https://")):
        missing.append(f"mlflow_tracking_uri as an http(s) server URL (is {cfg.mlflow_tracking_uri!r})")
    if missing:
        raise PoolConfigError(
            f"cycle.pools sends stages ({', '.join(sorted(cfg.cycle.pools))}) to other workers, which need: "
            + "; ".join(missing) + ". See infra/README.md, 'Across machines'.")


def stage_overrides(cfg: FlywheelConfig) -> dict[str, Any]:
    """The cycle's settings as a worker should run the stage: everything but this machine's paths
    (and ``cycle.pools``: a stage never dispatches further)."""
    d = cfg.model_dump(mode="json")
    for k in _LOCAL_FIELDS:
        d.pop(k, None)
    if not str(d.get("mlflow_tracking_uri", "")).startswith(("http://", "https://")):
        d.pop("mlflow_tracking_uri", None)  # a file under this home (check_team_config refuses it for pools)
    d["cycle"] = {k: v for k, v in d["cycle"].items() if k != "pools"}
    return d


def home_id(home: str | os.PathLike[str]) -> str:
    """A short, path-free name of a worker's home (recorded, so a test or a person can tell which worker
    ran a stage without the event naming a directory)."""
    return hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:12]


def stage_stream(key: str) -> str:
    return f"stage:{key}"


def completed_stage(store: Any, key: str) -> dict[str, Any] | None:
    """The payload of ``stage:<key>``'s ``stage.completed`` event, or None."""
    evs = store.read(stream=stage_stream(key), types=["stage.completed"], limit=1)
    return evs[0].payload if evs else None


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.get_id() or "") or None
    except Exception:  # noqa: BLE001 - outside a flow run
        return None


@flow(name=STAGE_FLOW, log_prints=False, persist_result=False)
def flywheel_stage(stage: str, key: str, args: dict[str, Any], correlation_id: str, pool: str,
                   overrides: dict[str, Any]) -> dict[str, Any]:
    """One cycle stage on this worker (``cycle.pools``): runs it unless ``stage:<key>`` already completed,
    records ``stage.completed`` with its summary, returns the summary."""
    from flywheel.flows.stages import STAGES, no_report

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    cfg = load_config(None, overrides)
    try:
        r = CycleResources.open(cfg)
    except BaseException as e:
        if is_infra_error(e):
            raise StageInfraError(f"stage {stage} on pool {pool}: {type(e).__name__}: {e}") from e
        raise
    try:
        done = completed_stage(r.store, key)
        if done is not None:
            return done["result"]
        try:
            result = STAGES[stage](r, no_report, correlation_id=correlation_id, **args)
        except BaseException as e:
            if is_infra_error(e):
                raise StageInfraError(f"stage {stage} on pool {pool}: {type(e).__name__}: {e}") from e
            raise
        payload = {"entity_id": stage_stream(key), "stage": stage, "key": key, "pool": pool,
                   "host": socket.gethostname(), "worker_home": home_id(cfg.home), "flow_run": _flow_run_id(),
                   "result": result}
        try:
            r.store.append(stage_stream(key), NewEvent("stage.completed", payload), expected_version=0,
                           correlation_id=correlation_id)
        except ConcurrencyError:  # another run of this stage recorded it first: its summary stands
            return completed_stage(r.store, key)["result"]  # type: ignore[index]
        return result
    finally:
        r.close()


_deployed: set[tuple[str, str]] = set()


def ensure_stage_deployment(pool: str) -> str:
    """Register (or update) ``flywheel-stage/<pool>`` on the Prefect server: the stage flow from this
    checkout's path, for the workers of ``pool`` (they run the code from the same path on their machine,
    e.g. the worker image's /opt/flywheel). Once per process and pool."""
    from prefect.settings import PREFECT_API_URL

    api = str(PREFECT_API_URL.value() or "")
    if (api, pool) not in _deployed:
        root = Path(__file__).resolve().parent.parent
        flywheel_stage.from_source(source=str(root), entrypoint=STAGE_ENTRYPOINT).deploy(
            name=pool, work_pool_name=pool, build=False, push=False, print_next_steps=False,
            description=f"Cycle stages on the {pool!r} work pool (cycle.pools)",
        )
        _deployed.add((api, pool))
    return f"{STAGE_FLOW}/{pool}"


def run_on_pool(cfg: FlywheelConfig, store: Any, stage: str, pool: str, key: str, args: dict[str, Any],
                correlation_id: str) -> dict[str, Any]:
    """Run ``stage`` as a flow run of ``flywheel-stage/<pool>`` and wait for it; its summary, read back from
    ``stage.completed``. A stage completed before (same key) is not run again."""
    done = completed_stage(store, key)
    if done is not None:
        return done["result"]
    from prefect.deployments import run_deployment

    name = ensure_stage_deployment(pool)
    fr = run_deployment(name, parameters={"stage": stage, "key": key, "args": args, "correlation_id": correlation_id,
                                          "pool": pool, "overrides": stage_overrides(cfg)},
                        timeout=None, poll_interval=1, as_subflow=True,
                        tags=["flywheel", f"stage:{stage}"])
    state = fr.state
    done = completed_stage(store, key)
    if state is not None and state.is_completed() and done is not None:
        return done["result"]
    kind = state.type.value if state is not None else "UNKNOWN"
    message = (state.message if state is not None else None) or "no message"
    where = f"stage {stage} on pool {pool} (flow run {fr.id})"
    if kind in ("CRASHED", "CANCELLED", "CANCELLING") or StageInfraError.__name__ in message:
        raise InfraError(f"{where} ended {kind}: {message}")
    if state is not None and state.is_completed():
        raise InfraError(f"{where} completed without recording stage.completed on {stage_stream(key)}")
    raise RuntimeError(f"{where} ended {kind}: {message}")
