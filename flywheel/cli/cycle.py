"""``flywheel cycle``, ``schedule``, ``trace``, ``impact``: the flywheel as one flow, and its lineage."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from flywheel.cli.common import (
    CliError,
    ConfigOpt,
    HomeOpt,
    JsonOpt,
    console,
    emit_json,
    handle_errors,
    load,
    out,
    print_table,
)
from flywheel.config import FlywheelConfig
from flywheel.flows.cycle_env import prefect_environment
from flywheel.lineage import impact as impact_of
from flywheel.lineage import mermaid, render_tree, resolve_ref, traces_of, tree
from flywheel.schedule import ScheduleError, apply_schedule, list_deployments, serve_forever, set_paused


def register(app: typer.Typer) -> None:
    app.command("cycle")(cycle)
    app.command("schedule")(schedule)
    app.command("trace")(trace)
    app.command("impact")(impact)
    app.command("report")(report)


def _prefect_env(cfg: FlywheelConfig) -> None:
    """Embedded default: Prefect's database and results under the flywheel home. Must run before
    prefect is imported (its settings are read at import)."""
    env = prefect_environment(cfg.home)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    for k in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH"):
        if k in env:
            Path(os.environ[k]).mkdir(parents=True, exist_ok=True, mode=0o700)


class StageDisplay:
    """A live one-line-per-stage display on stderr for the cycle."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.rows: dict[str, str] = {}
        self.live = None
        self._last_key: tuple[str, str] | None = None
        self._last_print = 0.0

    def __enter__(self) -> StageDisplay:
        if self.enabled and console.is_terminal:
            from rich.live import Live

            self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(*exc)

    def _render(self):
        from rich.table import Table

        t = Table(show_header=True, header_style="bold", title="flywheel cycle", title_justify="left")
        t.add_column("stage")
        t.add_column("progress", overflow="fold")
        for k, v in self.rows.items():
            t.add_row(k, v)
        return t

    def __call__(self, stage: str, info: dict) -> None:
        status = info.get("status", "")
        if stage in ("rollouts",) and "tasks" in info:
            tps = info.get("tokens", 0) / max(info.get("elapsed_s", 1e-9), 1e-9)
            text = f"{info.get('policy', '')}: {info['tasks_done']}/{info['tasks']} tasks, {info['samples']} samples, {tps:.1f} tok/s"
        elif "step" in info:
            loss = info.get("loss")
            text = f"step {info['step']}/{info.get('total')}" + (f", loss {loss:.4f}" if isinstance(loss, float) else "")
        elif status == "failed":
            text = f"[red]failed: {info.get('error')}[/]"
        elif status == "warning":
            text = f"[bold yellow]warning:[/] {info.get('warning')}"
        else:
            text = status + "".join(f", {k} {v}" for k, v in info.items() if k not in ("status", "phase") and v is not None)
        if info.get("phase") and not text.startswith(str(info["phase"])):
            text = f"{info['phase']}: {text}"  # the learning stage's first pass, probe, arms, dev, fold-in
        self.rows[stage] = text
        if self.live is not None and console.is_terminal:
            self.live.update(self._render())
        elif self.enabled:
            # Not a terminal (CI, a log file): a line when a stage starts or ends, and at most
            # every 15 s while it runs.
            now = time.monotonic()
            key = (stage, status)
            if key != self._last_key or now - self._last_print >= 15:
                console.print(f"  {stage}: {text}")
                self._last_key, self._last_print = key, now


def print_cycle_summary(result: dict) -> None:
    st = result.get("stages", {})
    rows = []
    if st.get("sandbox"):
        sb = st["sandbox"]
        rows.append(("sandbox", f"{sb.get('mode')}, cgroup {str(sb.get('cgroup', '')).split(':')[0]}: {sb.get('verdicts')}"))
    if "ingest" in st:
        i = st["ingest"]
        rows.append(("ingest", f"{i.get('read')} read, {i.get('ingested')} ingested, {i.get('quarantined')} quarantined, "
                               f"{i.get('new_failures')} new failures"))
    rows.append(("new failures", str(st.get("new_failures"))))
    if "evals" in st:
        rows.append(("evals", f"{st['evals'].get('splits')}"))
        h = st["evals"].get("heldout") or {}
        if h:
            rows.append(("held-out suite", f"{h.get('items')} items: {h.get('failures')} failures (fix rate), "
                                           f"{h.get('successes')} successes (keep rate)"))
        for w in st["evals"].get("warnings") or []:
            rows.append(("[bold yellow]warning[/]", w))
    if "synth" in st:
        c = st["synth"].get("counts") or st["synth"].get("funnel") or {}
        rows.append(("synth", ", ".join(f"{k} {v}" for k, v in c.items())))
    for key in ("rollouts", "rollouts_after_sft"):
        if key in st:
            s = st[key].get("stats") or {}
            rows.append((key, f"{st[key].get('policy')}: pass@1 {s.get('pass_at_1', 0):.2f}, pass@K {s.get('pass_at_k', 0):.2f}, "
                              f"zero-variance groups {s.get('zero_variance_share', 0):.0%}"))
    if "train_mode" in st:
        rows.append(("train mode", f"{st['train_mode']['mode']} ({st['train_mode']['why']})"))
    if "learn" in st:
        ln = st["learn"]
        arms = ", ".join(f"{a['name']} " + (f"{a['dev_passed']}/{a['dev_items']}" if a.get("dev_passed") is not None
                                             else "skipped") for a in ln.get("arms") or [])
        rows.append(("learn", f"{ln.get('chosen')} shipped as {ln.get('model_entity')} (dev: {arms}); {ln.get('why')}"))
    for key in ("sft", "grpo"):
        if key in st:
            s = st[key]
            rows.append((key, s.get("skipped") or f"{s.get('model_entity')} after {s.get('steps')} steps, loss {s.get('metrics', {}).get('loss')}"))
    if "gate" in st:
        g = st["gate"]
        outcome = g.get("outcome") or ("passed" if g.get("passed") else "refused")
        p = (g.get("numbers") or {}).get("p_value")
        head = outcome.replace("_", " ").upper() + (f" (p = {p:.4g})" if isinstance(p, float) else "")
        rows.append(("gate", head + (": " + "; ".join(g.get("reasons") or []) if g.get("reasons") else "")))
    rows.append(("outcome", f"{result.get('outcome')}: {result.get('reason')}"))
    rows.append(("wall time", f"{result.get('wall_s')} s"))
    published = result.get("published") or {}
    if published.get("report"):
        rows.append(("report", str(published["report"])))
    if published.get("summary"):
        rows.append(("Prefect artifacts", f"{published['summary']}, {published.get('stages')}"))
    print_table(f"cycle {result.get('cycle')}", ["stage", "result"], rows)
    from flywheel.cycle import sandbox_warning  # ~0.1 s: off the CLI's start

    warning = sandbox_warning(result)
    if warning:
        from rich.panel import Panel

        console.print(Panel(warning, title="WARNING: reward integrity", border_style="bold red"), soft_wrap=False)


@handle_errors
def cycle(
    traces: list[Path] = typer.Argument(None, help="Trace files to ingest (default: everything in <home>/inbox)."),
    force: bool = typer.Option(False, "--force", help="Run the learning stages even with no new failures."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run one flywheel cycle now (Prefect ephemeral mode, or the server in PREFECT_API_URL)."""
    cfg = load(home, config)
    _prefect_env(cfg)
    from flywheel.flows.cycle import run_cycle  # prefect: heavy, its settings read at import

    with StageDisplay(enabled=not as_json) as display:
        result = run_cycle(cfg, traces=[str(p) for p in traces] if traces else None, config_path=config,
                           force=force, on_progress=display)
    if as_json:
        emit_json(result)
    else:
        print_cycle_summary(result)


@handle_errors
def schedule(
    cron: str = typer.Option(None, "--cron", help='Cron expression, e.g. "0 2 * * *" (nightly at 02:00).'),
    timezone: str = typer.Option("UTC", "--timezone", help="IANA timezone of the cron schedule."),
    name: str = typer.Option("nightly", "--name", help="Deployment name."),
    work_pool: str = typer.Option(None, "--work-pool", help="Deploy to this work pool instead of a served runner."),
    list_: bool = typer.Option(False, "--list", help="List the deployments of flywheel-cycle."),
    pause: bool = typer.Option(False, "--pause", help="Pause the deployment's schedule."),
    resume: bool = typer.Option(False, "--resume", help="Resume the deployment's schedule."),
    serve: bool = typer.Option(False, "--serve", help="Also run the scheduled flow runs in this process (flow.serve)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Create/update, list, pause or resume the scheduled deployment of flywheel_cycle on a Prefect server."""
    cfg = load(home, config)
    if not os.environ.get("PREFECT_API_URL"):
        raise CliError("schedules live on a Prefect server: start one (`prefect server start`) and set PREFECT_API_URL")
    chosen = [x for x in (cron is not None, list_, pause, resume) if x]
    if len(chosen) != 1:
        raise CliError("choose exactly one of --cron, --list, --pause, --resume")
    try:
        if list_:
            data = list_deployments()
            if as_json:
                emit_json(data)
            else:
                print_table("flywheel-cycle deployments", ["name", "schedules", "paused", "work pool", "id"],
                            [(d["name"], ", ".join(d["schedules"]), d["paused"], d["work_pool"], d["id"]) for d in data])
            return
        if pause or resume:
            data = set_paused(name, paused=pause)
        else:
            data = apply_schedule(cfg, cron=cron, timezone=timezone, name=name, work_pool=work_pool,
                                  config_path=config)
    except ScheduleError as e:
        raise CliError(str(e)) from None
    if as_json:
        emit_json(data)
    else:
        print_table("schedule", ["field", "value"], sorted(data.items()))
    if serve and cron is not None:
        out.print(f"serving {name}: scheduled runs execute in this process (Ctrl-C to stop)")
        serve_forever(cfg, cron=cron, timezone=timezone, name=name, config_path=config)


@handle_errors
def trace(
    ref: str = typer.Argument(..., help="champion | challenger | model:policy/7 | policy/7 | any entity id."),
    fmt: str = typer.Option("tree", "--format", help="tree | mermaid."),
    max_children: int = typer.Option(20, "--max-children", help="Show at most this many causes per node (tree)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Trace a model back to what made it: run -> rollouts -> envs -> synth/evals -> failures -> traces."""
    import sys

    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as store:
        root = resolve_ref(store, Tracker(cfg), ref, cfg.cycle.model_name)
        if as_json:
            emit_json({"root": root, "tree": tree(store, root).to_dict(), "traces": traces_of(store, root)})
            return
        if fmt == "mermaid":
            sys.stdout.write(mermaid(store, root))  # unwrapped: it is pasted into docs
            return
        if fmt != "tree":
            raise CliError("--format must be tree or mermaid")
        out.print(render_tree(tree(store, root, max_children=max_children)))
        traces = traces_of(store, root)
    print_table(f"{len(traces)} production traces behind {root}", ["trace", "timestamp", "failure kinds"],
                [(t["trace"], t["timestamp"], ", ".join(t["failure_kinds"] or []) or t["status"]) for t in traces[:50]])


@handle_errors
def impact(
    ref: str = typer.Argument(..., help="trace:<id> (or any entity id)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Every eval, dataset, model and deployment that descends from a trace."""
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as store:
        root = resolve_ref(store, None, ref, cfg.cycle.model_name)
        data = impact_of(store, root)
    if as_json:
        emit_json({"root": root, "impact": data})
        return
    order = ["failure", "eval", "suite", "env", "synth", "rollouts", "run", "model", "gate", "deploy", "cycle"]
    rows = [(k, len(data[k]), ", ".join(data[k][:6]) + (" …" if len(data[k]) > 6 else ""))
            for k in sorted(data, key=lambda k: order.index(k) if k in order else 99)]
    print_table(f"impact of {root}", ["kind", "count", "entities"], rows)


@handle_errors
def report(
    cycle_id: str = typer.Option(None, "--cycle", help="Cycle id (default: the last completed cycle)."),
    open_: bool = typer.Option(False, "--open", help="Print a file:// URL to open in a browser."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write one self-contained HTML page for a cycle: failures, training, pass rates with CIs, gate, lineage."""
    from flywheel.report import ReportError, build_report  # scipy, ~2.4 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as store:
        try:
            res = build_report(cfg, store, Tracker(cfg), cycle=cycle_id)
        except ReportError as e:
            raise CliError(str(e)) from None
    if as_json:
        emit_json(res)
        return
    out.print(f"report of {res['cycle']} ({res['outcome']}): {res['path']}")
    if open_:
        out.print(Path(res["path"]).absolute().as_uri())
