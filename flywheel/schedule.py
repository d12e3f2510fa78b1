"""Scheduling ``flywheel_cycle`` on a Prefect server (nightly retraining).

Two ways to run the scheduled flow runs, both documented in ``infra/README.md``:

1. **Served runner** (default): ``flywheel schedule --cron "0 2 * * *"`` registers the deployment
   ``flywheel-cycle/<name>`` with its cron schedule on the server (``RunnerDeployment.apply``);
   ``flywheel schedule --cron ... --serve`` (or ``prefect``'s ``flow.serve``) runs a long-lived process
   that picks up and executes the scheduled runs on this machine.
2. **Work pool**: ``--work-pool flywheel-cpu`` deploys the same entrypoint
   (``flows/cycle.py:flywheel_cycle``) to a work pool; a ``prefect worker start --pool ...`` process
   (``infra/compose.yaml``) executes runs. ``prefect.yaml`` in the repository root declares the same
   deployments for ``prefect deploy``.

Re-applying with the same name updates the schedule in place (one deployment, never a duplicate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig

FLOW_NAME = "flywheel-cycle"
ENTRYPOINT = "flows/cycle.py:flywheel_cycle"


class ScheduleError(RuntimeError):
    pass


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _cron(cron: str, timezone: str) -> Any:
    from prefect.schedules import Cron

    try:
        from croniter import croniter  # prefect depends on it

        if not croniter.is_valid(cron):
            raise ScheduleError(f"not a valid cron expression: {cron!r}")
    except ImportError:  # pragma: no cover - prefect's own validation below still applies
        pass
    try:
        return Cron(cron, timezone=timezone)
    except Exception as e:  # noqa: BLE001 - prefect raises pydantic/value errors
        raise ScheduleError(f"invalid schedule {cron!r} ({timezone}): {e}") from None


def apply_schedule(cfg: FlywheelConfig, *, cron: str, timezone: str = "UTC", name: str = "nightly",
                   work_pool: str | None = None, config_path: str | None = None) -> dict[str, Any]:
    """Create or update the deployment ``flywheel-cycle/<name>`` with a cron schedule."""
    from flywheel.flows.cycle import flywheel_cycle  # prefect: heavy, and its settings are read at import

    params = {"config_path": config_path, "overrides": {"home": str(cfg.home)}}
    schedule = _cron(cron, timezone)
    try:
        if work_pool:
            dep_id = flywheel_cycle.from_source(source=str(_repo_root()), entrypoint=ENTRYPOINT).deploy(
                name=name, work_pool_name=work_pool, schedules=[schedule], parameters=params,
                build=False, push=False, print_next_steps=False,
            )
        else:
            dep = flywheel_cycle.to_deployment(name=name, schedules=[schedule], parameters=params,
                                               description="Nightly flywheel cycle (flywheel schedule)")
            dep_id = dep.apply()
    except ScheduleError:
        raise
    except Exception as e:  # noqa: BLE001 - connection errors, server refusals: one clear line
        raise ScheduleError(f"could not register the deployment on the Prefect server: {e}") from None
    return {"deployment": f"{FLOW_NAME}/{name}", "id": str(dep_id), "cron": cron, "timezone": timezone,
            "work_pool": work_pool or "(served runner)"}


def list_deployments() -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        deps = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])))
    out = []
    for d in deps:
        scheds = []
        for s in d.schedules or []:
            sch = s.schedule
            scheds.append(f"{getattr(sch, 'cron', sch)} {getattr(sch, 'timezone', '')}".strip())
        out.append({"name": d.name, "id": str(d.id), "schedules": scheds, "paused": bool(d.paused),
                    "work_pool": d.work_pool_name or "(served runner)"})
    return out


def set_paused(name: str, *, paused: bool) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
        except Exception as e:  # noqa: BLE001 - ObjectNotFound and friends
            raise ScheduleError(f"no deployment {FLOW_NAME}/{name} on the server: {e}") from None
        if paused:
            client.pause_deployment(dep.id)
        else:
            client.resume_deployment(dep.id)
        dep = client.read_deployment(dep.id)
    return {"deployment": f"{FLOW_NAME}/{name}", "id": str(dep.id), "paused": bool(dep.paused)}


def serve_forever(cfg: FlywheelConfig, *, cron: str, timezone: str, name: str, config_path: str | None) -> None:  # pragma: no cover
    """Run scheduled flow runs in this process (blocks)."""
    from flywheel.flows.cycle import flywheel_cycle  # prefect: heavy, and its settings are read at import

    flywheel_cycle.serve(name=name, schedules=[_cron(cron, timezone)],
                         parameters={"config_path": config_path, "overrides": {"home": str(cfg.home)}})
