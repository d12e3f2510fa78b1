"""How often does the demo's first cycle promote, and with ``--cycles 2`` its second? The cpu profile's
cycles, run with several seeds.

The demo's wave 1 does not depend on the seed (the base model answers greedily), so it is replayed
once; every seed then runs cycle 1 (synthesis, SFT warm start, GRPO, gate) on a copy of that home
with `synth.seed`, `rollout.seed` and `train.seed` set to the seed, exactly as `flywheel demo --seed N`
does. Printed per seed: the challenger's held-out pass rate against the base model's, the gate's
outcome with its p-value, and the wall time. A refused run is reported like any other.

``--cycles 2`` goes on as the demo does: wave 2 (the profile's second wave, the questions after wave 1's)
through whichever model is champion after cycle 1, then cycle 2 against it (issue 30's target: cycle 2
promotes in >= 3 of 5 seeds). Wave 2 depends on the seed, since the champion that answers it does.

    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2 3 4       # ~12 min per seed on 2 idle cores
    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 --cycles 2   # ~30 min per seed
    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 --json

Measured figures: the README's quick start and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--workdir", help="keep the homes here (default: a temporary directory)")
    ap.add_argument("--cycles", type=int, choices=(1, 2), default=1, help="2: also wave 2 and cycle 2, as the demo")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # stdout carries the one JSON document; DeepSpeed's banner and other prints go to stderr
        from flywheel.cli.common import reserve_stdout_for_json

        reserve_stdout_for_json()

    from flywheel.flows.cycle_env import prefect_environment

    from flywheel import demo as d

    work = Path(args.workdir or tempfile.mkdtemp(prefix="demo-seeds-"))
    base_home = work / "wave1"
    for k, v in prefect_environment(base_home).items():
        os.environ.setdefault(k, v)
    from flywheel.flows.cycle import run_cycle

    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.store import open_store
    from flywheel.tracking import Tracker

    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    # Wave 1, once: the base model as champion, answering the profile's first wave through `flywheel serve`.
    ov0 = d.demo_overrides(args.profile, base_home)
    cfg0 = load_config(environ=environ, overrides=ov0)
    if not (base_home / "inbox").is_dir() or not any((base_home / "inbox").iterdir()):
        cfg0.ensure_home()
        with open_store(cfg0) as store:
            open_artifacts(cfg0)
            d.ensure_champion(cfg0, store, Tracker(cfg0))
        items = d.traffic_items(d.PROFILES[args.profile]["waves"][0])
        log(f"wave 1: {len(items)} questions through the served base model …")
        d.run_wave(cfg0, args.profile, 1, items, config_path=None, overrides=ov0, ui=d.SILENT)

    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        home = work / f"seed-{seed}"
        if home.exists():
            shutil.rmtree(home)
        ov = d.demo_overrides(args.profile, home, seed)
        cfg = load_config(environ=environ, overrides=ov)
        cfg.ensure_home()
        # A fresh home with the same converted base model and wave 1's log in its inbox.
        shutil.copytree(base_home / "models", home / "models")
        shutil.copytree(base_home / "inbox", home / "inbox")
        with open_store(cfg) as store:
            open_artifacts(cfg)
            d.ensure_champion(cfg, store, Tracker(cfg))
        waves = d.PROFILES[args.profile]["waves"]
        for c in range(1, args.cycles + 1):
            if c == 2:  # wave 2 through the champion cycle 1 left, the questions after wave 1's
                items = d.traffic_items(waves[1], offsets=dict(waves[0]))
                log(f"seed {seed}: wave 2, {len(items)} questions through the champion …")
                d.run_wave(cfg, args.profile, 2, items, config_path=None, overrides=ov, ui=d.SILENT)
            log(f"seed {seed}: cycle {c} …")
            t0 = time.perf_counter()
            result = run_cycle(cfg, overrides=ov)
            rows.append(_row(seed, c, result, time.perf_counter() - t0))
    out: dict[str, Any] = {"profile": args.profile, "cycles": args.cycles, "load_average": os.getloadavg(),
                           "runs": rows, "workdir": str(work)}
    for c in range(1, args.cycles + 1):
        out[f"cycle{c}_promoted"] = sum(r["outcome"] == "promoted" for r in rows if r["cycle"] == c)
    out["promoted"] = out["cycle1_promoted"]
    if args.json:
        from flywheel.cli.common import emit_json

        emit_json(out)
        return 0
    la = os.getloadavg()
    print(f"demo cycles 1-{args.cycles}, {args.profile} profile, {len(args.seeds)} seeds (load average {la[0]:.1f} on "
          f"{os.cpu_count()} cores)")
    for r in rows:
        if r["paired_items"] is None:
            print(f"  seed {r['seed']} cycle {r['cycle']}: {r['outcome']}, no gate numbers ({r['wall_s']:.0f} s)")
            continue
        lift = (r["challenger_rate"] or 0) - (r["champion_rate"] or 0)
        print(f"  seed {r['seed']} cycle {r['cycle']}: challenger {r['challenger_passed']}/{r['paired_items']} = "
              f"{r['challenger_rate']:.1%} vs champion {r['champion_passed']}/{r['paired_items']} ({lift:+.1%}); "
              f"{r['wins']} wins / {r['losses']} losses, p = {r['p_value']:.3g}; {r['outcome']} ({r['wall_s']:.0f} s)")
    for c in range(1, args.cycles + 1):
        print(f"  cycle {c} promoted in {out[f'cycle{c}_promoted']} of {len(args.seeds)} seeds")
    return 0


def _row(seed: int, cycle: int, result: dict[str, Any], wall: float) -> dict[str, Any]:
    """One cycle's gate figures: the challenger against the champion it was gated against."""
    gate = (result.get("stages") or {}).get("gate") or {}
    n = gate.get("numbers") or {}
    return {
        "seed": seed, "cycle": cycle, "outcome": result.get("outcome"), "gate": gate.get("outcome"),
        "champion": n.get("champion"), "challenger": n.get("challenger"),
        "paired_items": n.get("paired_items"), "challenger_passed": n.get("challenger_passed"),
        "champion_passed": n.get("champion_passed"), "challenger_rate": n.get("challenger_pass_rate"),
        "champion_rate": n.get("champion_pass_rate"), "wins": n.get("wins"), "losses": n.get("losses"),
        "p_value": n.get("p_value"), "wall_s": round(wall, 1), "timings": result.get("timings"),
    }


if __name__ == "__main__":
    sys.exit(main())
