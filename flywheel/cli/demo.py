"""``flywheel demo``: the whole flywheel, turning twice, on the embedded default (see flywheel/demo.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    progress,
    third_party_output_to,
)
from flywheel.cli.cycle import StageDisplay, _prefect_env, print_cycle_summary


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def _ui(enabled: bool) -> Any:
    from flywheel.demo import SILENT, DemoUI  # duckdb+scipy, ~2.5 s: off the CLI's start

    if not enabled:
        return SILENT

    @contextmanager
    def traffic(label: str, total: int) -> Iterator[Callable[[int, int], None]]:
        t0 = time.perf_counter()
        with progress() as bar:
            task = bar.add_task(label, total=total, rate="")

            def update(done: int, n: int) -> None:
                bar.update(task, completed=done, rate=f"{done / max(time.perf_counter() - t0, 1e-9):.2f} req/s")

            yield update

    def say(text: str) -> None:
        console.print(text.replace("[", r"\["))

    return DemoUI(say=say, traffic=traffic, cycle=lambda: StageDisplay(enabled=True))


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{x:.1%}"


_MODEL_REF = re.compile(r"\bmodel:(?=[\w.-]+/\d)")


def short_ref(text: Any) -> str:
    """``model:policy/3`` -> ``policy/3`` in the demo's tables (``--json`` keeps the full entity ids)."""
    return _MODEL_REF.sub("", str(text))


def render(res: dict[str, Any]) -> None:
    """The demo's closing tables: the two cycles, the scoreboard, lineage, timings. They fit an
    80-column terminal: short model refs, pass@1 and its interval in one column, the long text wrapped
    at spaces (see :func:`flywheel.cli.common.print_table`)."""
    for i, c in enumerate(res["cycles"], start=1):
        out.print(f"\n[bold]cycle {i}[/]")
        print_cycle_summary(c)
    board = res["scoreboard"]
    rows = []
    for r in board["rows"]:
        g = r["gate"]
        gate = "" if g is None else (
            f"{g['outcome'].replace('_', ' ')} vs {short_ref(g['against'])}: {g['wins']} wins / "
            f"{g['losses']} losses, p = {g['p_value']:.4g}" if g.get("p_value") is not None else g["outcome"])
        rows.append((short_ref(r["model"]) + ("\n(champion)" if r["champion"] else ""), short_ref(r["trained"]),
                     f"{r['passed']}/{r['items']} = {_pct(r['pass_rate'])}\n"
                     f"[{_pct(r['wilson_lo'])}, {_pct(r['wilson_hi'])}]", gate))
    print_table(f"every gated model on {board['suite']} ({board['items']} held-out items)",
                ["model", "how it was trained", "held-out pass@1 (95% Wilson)", "gate decision"], rows)
    out.print(f"champion history: {' -> '.join(f'policy/{v}' for v in board['champions'])}; "
              f"final champion {short_ref(board['final_champion'])}")
    for label, lin in board.get("lineage", {}).items():
        waves = ", ".join(f"wave {w}: {n}" for w, n in sorted(lin["by_wave"].items()))
        out.print(f"lineage of the {label.replace('_', ' ')} {short_ref(lin['model'])}: {lin['traces']} production "
                  f"traces ({waves}); `flywheel trace {lin['model']}` shows them all")
    if res.get("report"):
        out.print(f"HTML report of the last cycle: {res['report']['path']}")
    print_table("timings (s)", ["step", "seconds"], [(k, v) for k, v in res["timings"].items() if "." not in k])


@handle_errors
def demo(
    profile: str = typer.Option("cpu", "--profile", help="cpu (demo-sized, 2 cores), gpu (larger budgets, CUDA) or smoke (tiny random model)."),
    gpu: bool = typer.Option(False, "--gpu", help="Shorthand for --profile gpu."),
    seed: int = typer.Option(None, "--seed", help="Re-seed synthesis, rollouts and training (the held-out split keeps its seed)."),
    dtype: str = typer.Option(None, "--dtype", help="The policy's weights dtype instead of the profile's: auto, fast, "
                              "float32 or bfloat16 (cpu profile: fast = bf16 where the CPU computes it natively, "
                              "else float32; --dtype float32 on such a CPU runs what one without it runs)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Serve the base model as champion, replay two waves of BFCL traffic through the champion, run a
    cycle after each, and end with every gated model on the same held-out suite."""
    from flywheel import demo as d  # duckdb+scipy, ~2.5 s: off the CLI's start

    profile = "gpu" if gpu else profile
    if profile not in d.PROFILES:
        raise CliError(f"--profile must be one of {sorted(d.PROFILES)}")
    base = load(home, config)
    try:
        overrides = d.demo_overrides(profile, base.home, seed, dtype)
    except d.DemoError as e:
        raise CliError(f"--dtype: {e}") from None
    cfg = load(home, config, overrides)
    _prefect_env(cfg)
    cfg.ensure_home()
    log_path = Path(cfg.home) / "logs" / "demo.log"
    console.print(f"[bold]flywheel demo[/] ({profile} profile) in {cfg.home}; library logs go to {log_path}")
    with third_party_output_to(log_path):
        result = d.run_demo(cfg, profile, config_path=config, overrides=overrides, ui=_ui(not as_json))
    data = result.to_dict()
    data["log"] = str(log_path)
    if as_json:
        emit_json(data)
        return
    render(data)
