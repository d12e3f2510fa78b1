"""Does the flywheel beat plain fine-tuning? Same production traffic, same CPU wall-clock budget.

From one wave of production traffic (BFCL questions answered by SmolLM2-135M through `flywheel serve`,
exactly as the demo's wave 1):

(a) **the flywheel**: one `flywheel_cycle` with the demo's cpu profile -- failure-targeted evals,
    synthetic variants, SFT warm start on the corrections, GRPO on the SFT model's own rollouts,
    gate;
(b) **plain SFT** (the named peer): supervised fine-tuning of the base model on the same traffic's
    corrections (the train-split failures' BFCL answers; the held-out ones are never trained on),
    with as many steps as fit in the wall-clock seconds (a) spent learning (synth + rollouts + SFT +
    GRPO), at (a)'s measured seconds per SFT step.

Both models are then scored, greedy pass@1 with the gate's decoding, on (1) the same held-out suite
version and (2) BFCL questions of the development categories that neither saw (the questions after
the wave's). Printed: pass rates with 95% Wilson intervals, and the exact one-sided sign test on the
paired items in each direction.

    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py            # ~30-40 min on 2 cores
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --quick    # smaller wave, fewer unseen questions
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --json
    # (a) already run: a home where the demo's wave 1 and cycle 1 ran, e.g. one that
    # `benchmarks/demo_seeds.py --workdir W` keeps (W/seed-0); same --seed as that run
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --cycle-home W/seed-0 --seed 0

Measured figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
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

QUICK_WAVE = {"simple_python": 30, "multiple": 15, "parallel": 12, "parallel_multiple": 13}
UNSEEN = {"simple_python": 40, "multiple": 20, "parallel": 20, "parallel_multiple": 20}
QUICK_UNSEEN = {"simple_python": 15, "multiple": 5, "parallel": 5, "parallel_multiple": 5}


def unseen_suite(offsets: dict[str, int], counts: dict[str, int]) -> Any:
    """BFCL questions after the wave's, compiled exactly as the evals stage compiles a failure with
    its correction (so the same verifier scores them)."""
    from flywheel.envs.testing import failure_payload
    from flywheel.evals import CompileSkip, compile_failure
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl
    from flywheel.versioning import Suite, suite_version_hash

    tasks = []
    for cat, n in counts.items():
        start = offsets.get(cat, 0)
        for it in load_bfcl(cat)[start : start + n]:
            f = failure_payload(it.question_messages, it.tools, {"role": "assistant", "content": "-"}, ["no_tool_call"],
                                correction={"tool_calls": bfcl_answer_to_expected(it.possible_answer)}, source="bfcl",
                                trace_id=f"trace:bfcl-unseen-{it.id}")
            try:
                task = compile_failure(f)
            except CompileSkip:
                continue
            task["metadata"].update(split="unseen", cluster=f"unseen-{it.id}", origin_outcome="failure")
            tasks.append(task)
    vh = suite_version_hash("bfcl-unseen", tasks)
    return Suite("suite:bfcl-unseen@1", "bfcl-unseen", 1, vh, sorted(tasks, key=lambda t: t["task_id"]))


def score(cfg: Any, store: Any, artifacts: Any, tracker: Any, version: int, suite: Any) -> dict[str, bool]:
    from flywheel.evaluate import ModelRef, evaluate_model

    ev = evaluate_model(cfg, store, artifacts, tracker, ModelRef.registered(cfg.cycle.model_name, version), suite)
    return {r["task_id"]: bool(r["passed"]) for r in ev.scorable()}


def compare(a: dict[str, bool], b: dict[str, bool]) -> dict[str, Any]:
    from flywheel.stats import sign_test, wilson

    ids = sorted(set(a) & set(b))
    wins = sum(a[i] and not b[i] for i in ids)
    losses = sum(b[i] and not a[i] for i in ids)
    ka, kb, n = sum(a[i] for i in ids), sum(b[i] for i in ids), len(ids)
    return {
        "items": n, "flywheel_passed": ka, "sft_passed": kb,
        "flywheel_rate": ka / n if n else None, "sft_rate": kb / n if n else None,
        "flywheel_wilson": wilson(ka, n), "sft_wilson": wilson(kb, n),
        "flywheel_only": wins, "sft_only": losses,
        "p_flywheel_better": sign_test(wins, losses), "p_sft_better": sign_test(losses, wins),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller wave and fewer unseen questions")
    ap.add_argument("--home", help="keep the run's home here (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cycle-home", help="reuse (a): a home where wave 1 and cycle 1 already ran (its last "
                    "cycle.completed event gives the stages and timings); --seed must be that run's seed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from flywheel.flows.cycle_env import prefect_environment

    from flywheel import demo as d

    if args.cycle_home:
        home = Path(args.cycle_home).resolve()
        if not (home / "warehouse.duckdb").is_file():
            ap.error(f"--cycle-home {home}: no warehouse.duckdb there")
    else:
        home = Path(args.home or tempfile.mkdtemp(prefix="bench-flywheel-vs-sft-")) / "home"
    for k, v in prefect_environment(home).items():  # the embedded default, before prefect is imported
        os.environ.setdefault(k, v)
    from flywheel.flows.cycle import run_cycle

    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.store import open_store
    from flywheel.tracking import Tracker
    from flywheel.train.demos import demonstrations_from_tasks
    from flywheel.train.stage import train_sft
    from flywheel.versioning import load_suite

    overrides = d.demo_overrides("cpu", home, args.seed)
    cfg = load_config(environ={k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}, overrides=overrides)
    cfg.ensure_home()
    wave = QUICK_WAVE if args.quick else d.PROFILES["cpu"]["waves"][0]
    unseen_counts = QUICK_UNSEEN if args.quick else UNSEEN
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t_start = time.perf_counter()

    tracker = Tracker(cfg)
    with open_store(cfg) as store:
        open_artifacts(cfg)
        base_version, _ = d.ensure_champion(cfg, store, tracker)
    items = d.traffic_items(wave)
    if args.cycle_home:
        with open_store(cfg) as store:
            done = store.read(types=["cycle.completed"], limit=1, newest_first=True)
        if not done:
            ap.error(f"--cycle-home {home}: no completed cycle there")
        result = done[0].payload
        cycle_s = float(result["wall_s"])
        log(f"(a) the flywheel: reusing {done[0].stream} ({result['outcome']}, {cycle_s:.0f} s) in {home}")
    else:
        log(f"traffic: {len(items)} BFCL questions through the served base model …")
        d.run_wave(cfg, "cpu", 1, items, config_path=None, overrides=overrides, ui=d.SILENT)

        log("(a) the flywheel: one cycle …")
        t0 = time.perf_counter()
        result = run_cycle(cfg, overrides=overrides)
        cycle_s = time.perf_counter() - t0
    tm = result.get("timings") or {}
    learning_s = sum(tm.get(k, 0.0) for k in ("synth", "rollouts", "train-sft", "rollouts-after-sft", "train-grpo"))
    st = result["stages"]
    flywheel_version = (st.get("grpo") or {}).get("model_version") or st["sft"]["model_version"]
    sec_per_step = tm["train-sft"] / max(1, st["sft"]["steps"])
    sft_steps = max(1, int(learning_s // sec_per_step))

    log(f"(b) plain SFT of the base model: {sft_steps} steps in the same {learning_s:.0f} s …")
    with open_store(cfg) as store:
        artifacts = open_artifacts(cfg)
        train_suite = load_suite(store, artifacts, "train")
        demos = demonstrations_from_tasks(train_suite.tasks)
        t0 = time.perf_counter()
        sft = train_sft(cfg, store, artifacts, tracker, demos, base=f"model:{cfg.cycle.model_name}/{base_version}",
                        steps=sft_steps)
        sft_s = time.perf_counter() - t0

        log("scoring both on the held-out suite and on unseen BFCL questions …")
        heldout = load_suite(store, artifacts, cfg.cycle.heldout_suite)
        unseen = unseen_suite({c: n for c, n in wave.items()}, unseen_counts)
        res = {}
        for label, suite in (("heldout", heldout), ("unseen", unseen)):
            a = score(cfg, store, artifacts, tracker, flywheel_version, suite)
            b = score(cfg, store, artifacts, tracker, sft.model_version, suite)
            res[label] = {"suite": suite.entity_id, **compare(a, b)}

    out = {
        "load_average": os.getloadavg(), "traffic": len(items), "seed": args.seed,
        "flywheel": {"model": f"model:{cfg.cycle.model_name}/{flywheel_version}", "cycle_s": round(cycle_s, 1),
                     "learning_s": round(learning_s, 1), "timings": tm, "gate": st.get("gate", {}).get("outcome")},
        "plain_sft": {"model": f"model:{cfg.cycle.model_name}/{sft.model_version}", "steps": sft_steps,
                      "wall_s": round(sft_s, 1), "demonstrations": len(demos)},
        "results": res, "total_s": round(time.perf_counter() - t_start, 1), "home": str(home),
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    la = out["load_average"]
    print(f"flywheel vs plain SFT: {len(items)} production questions, seed {args.seed} "
          f"(load average {la[0]:.1f} on {os.cpu_count()} cores)")
    print(f"  (a) flywheel  : {out['flywheel']['model']}, learning {learning_s:.0f} s of a {cycle_s:.0f} s cycle "
          f"(SFT {st['sft']['steps']} steps + synth + GRPO), gate {out['flywheel']['gate']}")
    print(f"  (b) plain SFT : {out['plain_sft']['model']}, {sft_steps} steps on {len(demos)} corrections in {sft_s:.0f} s")
    for label, r in res.items():
        fa, fb = r["flywheel_wilson"], r["sft_wilson"]
        print(f"  {label:8s} ({r['items']} items, {r['suite']}): flywheel {r['flywheel_passed']}/{r['items']} = "
              f"{r['flywheel_rate']:.1%} [{fa[0]:.1%}, {fa[1]:.1%}]  vs  plain SFT {r['sft_passed']}/{r['items']} = "
              f"{r['sft_rate']:.1%} [{fb[0]:.1%}, {fb[1]:.1%}]")
        print(f"           discordant: flywheel only {r['flywheel_only']}, SFT only {r['sft_only']}; exact sign test "
              f"p(flywheel better) = {r['p_flywheel_better']:.4g}, p(SFT better) = {r['p_sft_better']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
