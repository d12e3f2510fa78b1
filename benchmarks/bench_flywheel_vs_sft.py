"""Does the flywheel beat plain fine-tuning? Same production traffic, same process CPU-seconds of learning.

From one wave of production traffic (BFCL questions answered by SmolLM2-135M through `flywheel serve`,
exactly as the demo's wave 1; replayed once and shared by every run):

(a) **the flywheel**: one `flywheel_cycle` with the demo's cpu profile (train.mode = arms: a first SFT pass
    over every real correction, a probe that aims the synthesis, arms -- plain-SFT control, targeted
    synthesis, RPO, GRPO where groups carry signal -- chosen on a dev split, gate);
(b) **plain SFT** (the named peer): supervised fine-tuning of the base model on the same traffic's
    corrections (every train-split failure's BFCL answer; held-out ones never), for the process
    CPU-seconds (a)'s whole learning stage used (probe, synthesis, arms and dev decoding included),
    its steps sized from (a)'s measured CPU-seconds per plain-SFT step (the cheapest of its phases on the real
    corrections, so one phase slowed by other work does not shrink the peer) and capped by that budget.

Budgets: ``--budgets 1 2 4`` scales the flywheel's learning (first-pass epochs and arm steps) and so the
peer's CPU-seconds. Seeds: ``--seeds 0 1 2 3 4`` re-seed synthesis, rollouts and training (the split
keeps its seed, so every run gates on the same held-out suite). The flywheel always runs first in a
(seed, budget) pair because its measured CPU-seconds set the peer's budget; CPU-seconds, unlike wall
seconds, do not grow with a busy machine.

Both models are scored greedily with the gate's decoding on (1) the held-out suite and (2) BFCL
questions of the four development categories that no wave asked (``--unseen``, default 400 of the 720
the demo's two waves leave, in proportion per category; which questions those are changed when wave 2
grew from 70 to 140, so unseen figures before that are on another draw). Printed per run: pass rates with 95% Wilson intervals and the exact sign
test on the discordant items both ways; pooled over seeds: the summed discordant counts and a bootstrap
over items (items resampled with replacement, the same draw for every seed, so an item that repeats
across seeds is counted once per draw) giving the pooled difference's 95% interval and the share of
draws in which the flywheel is not ahead.

    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py                       # 1 seed, 1x, ~45 min on 2 cores
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --seeds 0 1 2 3 4 --budgets 1 2 4   # hours
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --quick               # smaller wave and unseen set
    # (c) too: SFT on the corrections plus the cycle's accepted synthetic tasks, same CPU-seconds
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --synth-peer
    # (a) already run: a home where the demo's wave 1 and cycle 1 ran (same seed), 1x only
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --cycle-home .flywheel --seed 0
    # two turns: the demo's cycle-2 model against plain SFT on both waves' corrections, for the CPU-seconds
    # of both learning stages (the peer's model is registered in that home)
    .venv/bin/python benchmarks/bench_flywheel_vs_sft.py --cycles-home .flywheel

Measured figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUICK_WAVE = {"simple_python": 30, "multiple": 15, "parallel": 12, "parallel_multiple": 13}
QUICK_UNSEEN = 30


def unseen_counts(total: int, start: dict[str, int]) -> dict[str, int]:
    """``total`` unseen questions over the four categories, in proportion to what each has left after
    ``start`` (the questions every wave of the demo asks come first)."""
    from flywheel.verifiers.bfcl import load_bfcl

    left = {c: max(len(load_bfcl(c)) - start.get(c, 0), 0) for c in ("simple_python", "multiple", "parallel",
                                                                      "parallel_multiple")}
    avail = sum(left.values())
    total = min(total, avail)
    out = {c: (n * total) // avail for c, n in left.items()}
    for c in sorted(left, key=lambda c: -left[c]):  # hand out the rounding remainder
        if sum(out.values()) >= total:
            break
        if out[c] < left[c]:
            out[c] += 1
    return out


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


def peer_cpu_per_step(learn: dict[str, Any]) -> tuple[float, str]:
    """Process CPU-seconds per plain-SFT step, to size the peer's steps: the cheapest of the flywheel's SFT
    phases on real corrections (first pass, the control's trial, the control's continuation, whose steps also
    carry the dev corrections).
    One phase slowed by other work on the machine (a test suite beside the first pass made it 54 CPU-s per
    step against 28 in the continuation) then does not shrink the peer's steps; its budget cap still holds.
    Returns the figure and the phase it came from."""
    phases = [("first pass", learn.get("first_pass") or {})]
    phases += [(f"{a.get('name')} trial", a) for a in learn.get("arms") or [] if a.get("name") == "control"]
    cont = learn.get("continuation") or {}
    if cont.get("arm") == "control":
        phases.append(("control continuation", cont))
    rates = [(float(p["cpu_s"]) / int(p["steps"]), name) for name, p in phases
             if p.get("steps") and p.get("cpu_s")]
    if not rates:
        raise ValueError("the learning stage recorded no SFT phase with steps and CPU-seconds: cannot size plain SFT")
    return min(rates)


def cycles_budget(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """For ``--cycles-home``: from a home's ``cycle.completed`` payloads (oldest first), the flywheel's model
    after its last turn and the plain-SFT peer's budget -- the process CPU-seconds of every cycle's learning
    stage together (the flywheel spent them all to reach that model), in steps at the cheapest plain-SFT
    rate any of those stages measured (:func:`peer_cpu_per_step`)."""
    learned = [c for c in cycles if (c.get("stages") or {}).get("learn")]
    if len(learned) < 2:
        raise ValueError(f"{len(learned)} completed cycle(s) with a learning stage there: --cycles-home needs two or "
                         "more (a home where `flywheel demo` ran, whose cpu profile turns twice)")
    learns = [c["stages"]["learn"] for c in learned]
    spent = [float(x.get("cpu_s") or 0.0) for x in learns]
    if min(spent) <= 0:
        raise ValueError(f"a learning stage recorded no CPU-seconds ({spent}): cannot size plain SFT")
    rates = [(*peer_cpu_per_step(x), i) for i, x in enumerate(learns, 1)]
    rate, source, turn = min(rates)
    budget = sum(spent)
    return {"cycles": len(learned), "learn_cpu_s": spent, "budget_cpu": budget, "cpu_per_step": rate,
            "sized_from": f"cycle {turn}: {source}", "steps": max(1, int(budget // rate)),
            "model_version": int(learns[-1]["model_version"]), "gates": [c.get("outcome") for c in learned],
            "chosen": learns[-1].get("chosen"), "why": learns[-1].get("why")}


def run_cycles_home(args: Any, cfg: Any, unseen: Any, log: Any) -> dict[str, Any]:
    """``--cycles-home``: the flywheel's model after its last turn against plain SFT of the base model on
    every wave's corrections (the home's newest train suite) for the CPU-seconds of all its learning
    stages; both scored on the newest held-out suite and the unseen questions."""
    from flywheel.artifacts import open_artifacts
    from flywheel.store import open_store
    from flywheel.tracking import Tracker
    from flywheel.train.demos import demonstrations_from_tasks
    from flywheel.versioning import load_suite

    tracker = Tracker(cfg)
    with open_store(cfg) as store:
        cycles = [e.payload for e in store.read(types=["cycle.completed"])]
        plan = cycles_budget(cycles)
        artifacts = open_artifacts(cfg)
        train_suite = load_suite(store, artifacts, "train")
        demos = demonstrations_from_tasks(train_suite.tasks)
        log(f"cycles home: plain SFT, {plan['steps']} steps on {len(demos)} corrections ({train_suite.entity_id}) "
            f"within the {plan['budget_cpu']:.0f} CPU-s of {plan['cycles']} learning stages …")
        sft, sft_cpu, sft_wall = plain_sft(cfg, store, artifacts, tracker, demos, plan["steps"], plan["budget_cpu"])
        heldout = load_suite(store, artifacts, cfg.cycle.heldout_suite)
        log(f"cycles home: scoring on {heldout.entity_id} and {len(unseen.tasks)} unseen questions …")
        res = {}
        for label, suite in (("heldout", heldout), ("unseen", unseen)):
            a = score(cfg, store, artifacts, tracker, plan["model_version"], suite)
            b = score(cfg, store, artifacts, tracker, sft.model_version, suite)
            res[label] = paired(suite, a, b)
    return {
        "seed": args.seeds[0], "budget": 1.0, "home": str(cfg.home),
        "flywheel": {"model": f"model:{cfg.cycle.model_name}/{plan['model_version']}", "learn_cpu_s": plan["budget_cpu"],
                     "cycles": plan["cycles"], "learn_cpu_s_per_cycle": plan["learn_cpu_s"], "gates": plan["gates"],
                     "chosen": plan["chosen"], "why": plan["why"]},
        "plain_sft": {"model": f"model:{cfg.cycle.model_name}/{sft.model_version}", "steps": sft.steps,
                      "planned_steps": plan["steps"], "cpu_per_step": round(plan["cpu_per_step"], 2),
                      "sized_from": plan["sized_from"], "cpu_s": round(sft_cpu, 1), "wall_s": round(sft_wall, 1),
                      "demonstrations": len(demos), "train_suite": train_suite.entity_id},
        "results": res,
    }


def _chars(d: Any) -> int:
    """A demonstration's size in characters (prompt, tools and answer): the step-cost proxy for sizing (c)."""
    return len(json.dumps([d.messages, d.tools, d.answer_content, [str(c) for c in d.answer_calls or []]], default=str))


def synth_peer(cfg: Any, store: Any, artifacts: Any, tracker: Any, demos: list, budget_cpu: float, sft_steps: int,
               log: Any, tag: str) -> tuple[Any, dict[str, Any] | None]:
    """(c): SFT of the base model on the corrections plus every synthetic task the cycle accepted (the
    training environment's ``synth_batch`` tasks; never a held-out or dev-derived one is lost, since
    the flywheel folds its dev items in too), for the same CPU-seconds. Synthetic prompts are longer
    (distractor tools, parallel shapes), so its steps are (b)'s scaled by the mean demonstration size
    and the CPU-second budget caps it; the cosine schedule is sized to those steps."""
    from flywheel.learn import split_sources
    from flywheel.train.demos import demonstrations_from_tasks
    from flywheel.train.stage import train_sft
    from flywheel.versioning import load_env

    env = load_env(store, artifacts, cfg.cycle.train_env)
    _, synth = split_sources(env.tasks)
    sdemos = demonstrations_from_tasks(synth)
    if not sdemos:
        log(f"{tag}: (c) skipped: the cycle accepted no synthetic task")
        return None, None
    mixed = list(demos) + sdemos
    scale = (sum(map(_chars, demos)) / len(demos)) / (sum(map(_chars, mixed)) / len(mixed))
    steps = max(1, int(sft_steps * scale))
    log(f"{tag}: (c) SFT + synthesis, {steps} steps on {len(demos)} corrections + {len(sdemos)} synthetic "
        f"within {budget_cpu:.0f} CPU-s …")
    c0, t0 = time.process_time(), time.perf_counter()
    res = train_sft(cfg, store, artifacts, tracker, mixed, base=cfg.policy.base_model, steps=steps, budget_cpu_s=budget_cpu,
                    decision_weight=1.0)
    info = {"model": f"model:{cfg.cycle.model_name}/{res.model_version}", "steps": res.steps, "planned_steps": steps,
            "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - t0, 1),
            "demonstrations": len(mixed), "synthetic": len(sdemos),
            "by_generator": dict(Counter(str((t.get("metadata") or {}).get("generator")) for t in synth))}
    return res, info


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


def category_of(task: dict) -> str | None:
    """The BFCL category of an unseen-suite task (its cluster is ``unseen-<category>_<n>``), else None."""
    cluster = str((task.get("metadata") or {}).get("cluster") or "")
    return cluster[len("unseen-"):].rsplit("_", 1)[0] if cluster.startswith("unseen-") else None


def paired(suite: Any, a: dict[str, bool], b: dict[str, bool]) -> dict[str, Any]:
    """One suite's result for a run: :func:`compare` of ``a`` (the flywheel) and ``b`` (the peer), with the
    per-item verdicts :func:`pooled` needs and, for the unseen suite, passes per BFCL category
    (``by_category``: category -> [flywheel passed, peer passed, items]) -- where a lift or a loss sits."""
    ids = sorted(set(a) & set(b))
    out = {"suite": suite.entity_id, **compare(a, b), "per_item": {i: (a[i], b[i]) for i in ids}}
    cats = {t["task_id"]: category_of(t) for t in suite.tasks}
    if any(cats.get(i) for i in ids):
        by: dict[str, list[int]] = {}
        for i in ids:
            row = by.setdefault(cats.get(i) or "?", [0, 0, 0])
            row[0] += a[i]
            row[1] += b[i]
            row[2] += 1
        out["by_category"] = dict(sorted(by.items()))
    return out


def plain_sft(cfg: Any, store: Any, artifacts: Any, tracker: Any, demos: list, steps: int,
              budget_cpu: float) -> tuple[Any, float, float]:
    """(b): SFT of the base model on ``demos`` for ``steps`` within ``budget_cpu`` process CPU-seconds;
    returns the run's result, its CPU-seconds and its wall seconds. Plain: every answer token weighs the
    same (``decision_weight = 1``), whatever ``--set train.decision_weight`` gives the flywheel."""
    from flywheel.train.stage import train_sft

    c0, t0 = time.process_time(), time.perf_counter()
    sft = train_sft(cfg, store, artifacts, tracker, demos, base=cfg.policy.base_model, steps=steps,
                    budget_cpu_s=budget_cpu, decision_weight=1.0)
    return sft, time.process_time() - c0, time.perf_counter() - t0


def pooled(runs: list[dict[str, Any]], label: str, draws: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Pooled over runs: summed discordant counts, the exact sign test on them, and a bootstrap over items
    (one resample of the item ids per draw, applied to every run, so a repeated item counts once per draw)."""
    import numpy as np

    from flywheel.stats import sign_test

    per = [r["results"][label] for r in runs]
    wins, losses = sum(p["flywheel_only"] for p in per), sum(p["sft_only"] for p in per)
    ids = sorted(set.intersection(*(set(p["per_item"]) for p in per))) if per else []
    if not ids:
        return {"wins": wins, "losses": losses}
    a = np.array([[p["per_item"][i][0] for i in ids] for p in per], dtype=float)  # runs x items
    b = np.array([[p["per_item"][i][1] for i in ids] for p in per], dtype=float)
    rng = np.random.default_rng(seed)
    diffs = np.empty(draws)
    for k in range(draws):
        j = rng.integers(0, len(ids), len(ids))
        diffs[k] = (a[:, j] - b[:, j]).mean()
    return {"runs": len(per), "items": len(ids), "wins": wins, "losses": losses,
            "diff": float((a - b).mean()), "ci": [float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))],
            "p_bootstrap_not_ahead": float((diffs <= 0).mean()), "p_sign_flywheel_better": sign_test(wins, losses),
            "p_sign_sft_better": sign_test(losses, wins)}


def _setting(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` of ``--set``: the value as JSON when it parses, else the string itself."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not (sep and dot and section and key):
        raise ValueError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.synthesis_in=stream")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return section, key, value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller wave and fewer unseen questions")
    ap.add_argument("--workdir", "--home", dest="workdir", help="keep the runs' homes here (default: a temporary directory)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--seed", type=int, help="one seed (same as --seeds N)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0], help="multiples of the cpu profile's learning")
    ap.add_argument("--unseen", type=int, default=400, help="unseen BFCL questions to score on")
    ap.add_argument("--cycle-home", help="reuse (a): a home where wave 1 and cycle 1 already ran (its last "
                    "cycle.completed event gives the stages); 1x and --seed must match that run")
    ap.add_argument("--cycles-home", help="a home where two or more cycles ran (`flywheel demo`'s): its last cycle's "
                    "model against plain SFT of the base model on every wave's corrections, for the CPU-seconds of "
                    "all its learning stages together (the peer's model is registered in that home, as with "
                    "--cycle-home)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the whole result, per-item verdicts included, to this JSON file")
    ap.add_argument("--max-new-tokens", type=int,
                    help="decoding limit of the gate, the probe, the dev split, rollouts and the scoring (default: the "
                    "cpu profile's 96, which cuts 28 of the 400 unseen questions' reference answers short; 128 cuts 9. "
                    "Until the profile's wave 2 grew to 140 questions it was 48, which cut 115 of the 400 then unseen)")
    ap.add_argument("--synth-peer", action="store_true",
                    help="(c) also: SFT of the base model on the same corrections plus every synthetic task the "
                    "flywheel's cycle accepted, for the same CPU-seconds: does the flywheel's synthesis help at all?")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for the flywheel's cycle on top of the cpu profile's, e.g. "
                    "--set train.synthesis_in=stream (VALUE is read as JSON, else as a string); repeatable")
    args = ap.parse_args()
    try:
        settings = [_setting(x) for x in args.settings]
    except ValueError as e:
        ap.error(str(e))
    if args.json:  # stdout carries the one JSON document; DeepSpeed's banner and other prints go to stderr
        from flywheel.cli.common import reserve_stdout_for_json

        reserve_stdout_for_json()
    if args.seed is not None:
        args.seeds = [args.seed]

    import shutil

    from flywheel.flows.cycle_env import prefect_environment

    from flywheel import demo as d

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-flywheel-vs-sft-"))
    base_home = Path(args.cycle_home).resolve() if args.cycle_home else work / "wave1"
    if args.cycle_home and not (base_home / "warehouse.duckdb").is_file():
        ap.error(f"--cycle-home {base_home}: no warehouse.duckdb there")
    if args.cycles_home:
        if args.cycle_home or args.budgets != [1.0] or len(args.seeds) != 1 or args.synth_peer or args.settings:
            ap.error("--cycles-home compares what already ran: one seed, 1x, no --cycle-home, --synth-peer or --set")
        base_home = Path(args.cycles_home).resolve()
        if not (base_home / "warehouse.duckdb").is_file():
            ap.error(f"--cycles-home {base_home}: no warehouse.duckdb there")
    for k, v in prefect_environment(base_home).items():  # the embedded default, before prefect is imported
        os.environ.setdefault(k, v)
    from flywheel.flows.cycle import run_cycle

    from flywheel.artifacts import open_artifacts
    from flywheel.config import load_config
    from flywheel.store import open_store
    from flywheel.tracking import Tracker
    from flywheel.train.demos import demonstrations_from_tasks
    from flywheel.versioning import load_suite

    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    waves = d.PROFILES["cpu"]["waves"]
    wave = QUICK_WAVE if args.quick else waves[0]
    asked = {c: sum(w.get(c, 0) for w in waves) for c in waves[0]}
    unseen_n = unseen_counts(QUICK_UNSEEN if args.quick else args.unseen, asked)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t_start = time.perf_counter()

    # wave 1 once: the base model answers greedily, so every run learns from the same traffic
    ov0 = d.demo_overrides("cpu", base_home)
    cfg0 = load_config(environ=environ, overrides=ov0)
    if not (args.cycle_home or args.cycles_home) and not ((base_home / "inbox").is_dir() and any((base_home / "inbox").iterdir())):
        cfg0.ensure_home()
        with open_store(cfg0) as store:
            open_artifacts(cfg0)
            d.ensure_champion(cfg0, store, Tracker(cfg0))
        items = d.traffic_items(wave)
        log(f"traffic: {len(items)} BFCL questions through the served base model …")
        d.run_wave(cfg0, "cpu", 1, items, config_path=None, overrides=ov0, ui=d.SILENT)
    unseen = unseen_suite(asked, unseen_n)

    runs: list[dict[str, Any]] = []
    if args.cycles_home:
        ov = d.demo_overrides("cpu", base_home, args.seeds[0])
        if args.max_new_tokens:
            ov["gate"]["max_new_tokens"] = ov["rollout"]["max_new_tokens"] = args.max_new_tokens
        try:
            runs.append(run_cycles_home(args, load_config(environ=environ, overrides=ov), unseen, log))
        except ValueError as e:
            ap.error(f"--cycles-home {args.cycles_home}: {e}")
    for seed in args.seeds if not args.cycles_home else []:
        for factor in args.budgets:
            if args.cycle_home:
                home = base_home
            else:
                home = work / f"seed-{seed}-x{factor:g}"
                if home.exists():
                    shutil.rmtree(home)
            ov = d.demo_overrides("cpu", home, seed)
            ov["train"]["first_pass_epochs"] = ov["train"]["first_pass_epochs"] * factor
            ov["train"]["arm_steps"] = max(1, round(ov["train"]["arm_steps"] * factor))
            ov["train"]["continue_steps"] = round(ov["train"].get("continue_steps", 0) * factor)
            for section, key, value in settings:
                ov.setdefault(section, {})[key] = value
            if args.max_new_tokens:
                ov["gate"]["max_new_tokens"] = ov["rollout"]["max_new_tokens"] = args.max_new_tokens
            cfg = load_config(environ=environ, overrides=ov)
            tracker = Tracker(cfg)
            if args.cycle_home:
                with open_store(cfg) as store:
                    done = store.read(types=["cycle.completed"], limit=1, newest_first=True)
                    first_cycle = store.read(types=["cycle.completed"], limit=1)
                if not done:
                    ap.error(f"--cycle-home {home}: no completed cycle there")
                result = first_cycle[0].payload  # cycle 1: the one that learned from wave 1 only
                log(f"seed {seed} x{factor:g}: (a) reusing {first_cycle[0].stream} ({result['outcome']})")
            else:
                cfg.ensure_home()
                shutil.copytree(base_home / "models", home / "models")
                shutil.copytree(base_home / "inbox", home / "inbox")
                with open_store(cfg) as store:
                    open_artifacts(cfg)
                    d.ensure_champion(cfg, store, tracker)
                log(f"seed {seed} x{factor:g}: (a) the flywheel, one cycle …")
                result = run_cycle(cfg, overrides=ov)
            st = result["stages"]
            learn = st.get("learn") or {}
            if not learn:
                ap.error("the cycle ran no learning stage (train.mode = arms): nothing to compare")
            flywheel_version = int(learn["model_version"])
            budget_cpu = float(learn.get("cpu_s") or 0.0)
            cpu_per_step, step_source = peer_cpu_per_step(learn)
            sft_steps = max(1, int(budget_cpu // cpu_per_step))
            with open_store(cfg) as store:
                artifacts = open_artifacts(cfg)
                train_suite = load_suite(store, artifacts, "train")
                demos = demonstrations_from_tasks(train_suite.tasks)
                log(f"seed {seed} x{factor:g}: (b) plain SFT, {sft_steps} steps within {budget_cpu:.0f} CPU-s …")
                sft, sft_cpu, sft_wall = plain_sft(cfg, store, artifacts, tracker, demos, sft_steps, budget_cpu)
                mix = mix_info = None
                if args.synth_peer:
                    mix, mix_info = synth_peer(cfg, store, artifacts, tracker, demos, budget_cpu, sft_steps, log,
                                               f"seed {seed} x{factor:g}")
                log(f"seed {seed} x{factor:g}: scoring on the held-out suite and {len(unseen.tasks)} unseen questions …")
                heldout = load_suite(store, artifacts, cfg.cycle.heldout_suite)
                res, mix_res = {}, {}
                for label, suite in (("heldout", heldout), ("unseen", unseen)):
                    a = score(cfg, store, artifacts, tracker, flywheel_version, suite)
                    b = score(cfg, store, artifacts, tracker, sft.model_version, suite)
                    res[label] = paired(suite, a, b)
                    if mix is not None:
                        c = score(cfg, store, artifacts, tracker, mix.model_version, suite)
                        mix_res[label] = {"vs_sft": compare(c, b), "vs_flywheel": compare(c, a),
                                          "per_item": {i: (a[i], b[i], c[i]) for i in sorted(set(a) & set(b) & set(c))}}
            runs.append({
                "seed": seed, "budget": factor, "home": str(home),
                "flywheel": {"model": f"model:{cfg.cycle.model_name}/{flywheel_version}", "learn_cpu_s": budget_cpu,
                             "learn_wall_s": learn.get("wall_s"), "chosen": learn.get("chosen"), "why": learn.get("why"),
                             "arms": [{k: a.get(k) for k in ("name", "steps", "tokens", "cpu_s", "dev_passed", "dev_items",
                                                               "skipped")} for a in learn.get("arms") or []],
                             "probe": (learn.get("probe") or {}).get("counts"), "gate": (st.get("gate") or {}).get("outcome")},
                "plain_sft": {"model": f"model:{cfg.cycle.model_name}/{sft.model_version}", "steps": sft.steps,
                              "planned_steps": sft_steps, "cpu_per_step": round(cpu_per_step, 2), "sized_from": step_source,
                              "cpu_s": round(sft_cpu, 1), "wall_s": round(sft_wall, 1), "demonstrations": len(demos)},
                "results": res,
            })
            if mix_info is not None:
                runs[-1]["synth_sft"] = {**mix_info, "results": mix_res}
    out = {"load_average": os.getloadavg(), "seeds": args.seeds, "budgets": args.budgets, "unseen": unseen_n, "settings": args.settings,
           "max_new_tokens": args.max_new_tokens or d.PROFILES["cpu"]["config"]["gate"]["max_new_tokens"],
           "runs": runs, "pooled": {}, "total_s": round(time.perf_counter() - t_start, 1), "workdir": str(work)}
    for factor in args.budgets:
        rs = [r for r in runs if r["budget"] == factor]
        out["pooled"][f"x{factor:g}"] = {label: pooled(rs, label) for label in ("heldout", "unseen")}
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=str))
        tmp.replace(args.out)
    if args.json:
        for r in runs:
            for v in [*r["results"].values(), *(r.get("synth_sft") or {}).get("results", {}).values()]:
                v.pop("per_item", None)
        from flywheel.cli.common import emit_json

        emit_json(out)
        return 0
    la = out["load_average"]
    print(f"flywheel vs plain SFT (same process CPU-seconds): seeds {args.seeds}, budgets {args.budgets} "
          f"(load average {la[0]:.1f} on {os.cpu_count()} cores)")
    for r in runs:
        f, p = r["flywheel"], r["plain_sft"]
        cut = (f" of {p['planned_steps']} planned: the CPU budget stopped it before its schedule decayed"
               if p.get("planned_steps") and p["steps"] < p["planned_steps"] else "")
        turns = (f"after {f['cycles']} cycles, gates {' / '.join(map(str, f['gates']))}; " if f.get("cycles") else "")
        print(f"  seed {r['seed']} x{r['budget']:g}: flywheel {f['model']} ({turns}{f['chosen']} shipped; learning "
              f"{f['learn_cpu_s']:.0f} CPU-s)  vs  plain SFT {p['model']} ({p['steps']} steps{cut}, {p['cpu_s']:.0f} "
              f"CPU-s, {p['demonstrations']} corrections)")
        for label, x in r["results"].items():
            fa, fb = x["flywheel_wilson"], x["sft_wilson"]
            print(f"    {label:8s} ({x['items']} items): flywheel {x['flywheel_passed']}/{x['items']} = "
                  f"{x['flywheel_rate']:.1%} [{fa[0]:.1%}, {fa[1]:.1%}]  vs  SFT {x['sft_passed']}/{x['items']} = "
                  f"{x['sft_rate']:.1%} [{fb[0]:.1%}, {fb[1]:.1%}]; discordant {x['flywheel_only']} / {x['sft_only']}, "
                  f"p(flywheel better) = {x['p_flywheel_better']:.3g}, p(SFT better) = {x['p_sft_better']:.3g}")
            if x.get("by_category"):
                print("      by category (flywheel / SFT / items): " + ", ".join(
                    f"{c} {v[0]} / {v[1]} / {v[2]}" for c, v in x["by_category"].items()))
        m = r.get("synth_sft")
        if m:
            print(f"    (c) SFT + the flywheel's synthesis {m['model']} ({m['steps']} steps, {m['cpu_s']:.0f} CPU-s, "
                  f"{m['demonstrations']} demonstrations of which {m['synthetic']} synthetic)")
            for label, x in m["results"].items():
                for peer, key in (("plain SFT", "vs_sft"), ("the flywheel", "vs_flywheel")):
                    v = x[key]
                    print(f"      {label:8s}: (c) {v['flywheel_passed']}/{v['items']} = {v['flywheel_rate']:.1%} vs "
                          f"{peer} {v['sft_passed']}/{v['items']}; discordant {v['flywheel_only']} / {v['sft_only']}, "
                          f"p((c) better) = {v['p_flywheel_better']:.3g}, p({peer} better) = {v['p_sft_better']:.3g}")
    for key, by_label in out["pooled"].items():
        for label, pl in by_label.items():
            if "diff" in pl:
                print(f"  pooled {key} {label}: {pl['runs']} runs x {pl['items']} items, flywheel - SFT "
                      f"{pl['diff']:+.1%} [{pl['ci'][0]:+.1%}, {pl['ci'][1]:+.1%}] (item bootstrap), discordant "
                      f"{pl['wins']} / {pl['losses']}, p(not ahead) = {pl['p_bootstrap_not_ahead']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
