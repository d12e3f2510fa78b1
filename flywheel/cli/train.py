"""``flywheel train``: GRPO on rollout datasets, SFT on demonstrations, or ``auto`` (SFT first when
GRPO would learn nothing). Calls :mod:`flywheel.train.stage`; heavy imports stay inside the command."""

from __future__ import annotations

import json
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
    print_table,
    progress,
)
from flywheel.config import LOSS_NAMES


def register(app: typer.Typer) -> None:
    app.command("train")(train)


def _demonstrations(path: Path) -> list:
    """JSON lines: {messages, tools?, source_entity_id, split, answer_calls?: [{name, arguments}], answer_content?}."""
    from flywheel.train.demos import Demonstration  # duckdb, ~0.7 s: off the CLI's start
    from flywheel.vocab import ToolCall

    demos = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            calls = [ToolCall(c["name"], c.get("arguments", {})) for c in d.get("answer_calls") or []] or None
            demos.append(Demonstration(messages=d["messages"], tools=d.get("tools"), source_entity_id=d["source_entity_id"],
                                       split=d.get("split", "train"), answer_calls=calls,
                                       answer_content=d.get("answer_content")))
        except (KeyError, ValueError, TypeError) as e:
            raise CliError(f"{path}:{i + 1}: not a demonstration ({e})") from None
    return demos


@handle_errors
def train(
    rollouts: list[str] = typer.Option(
        [], "--rollouts", help="Rollout dataset ids (rollouts:<id>); repeatable (default: the latest published)."),
    mode: str = typer.Option(None, "--mode", help="sft | grpo | auto (default: config train.mode)."),
    loss: str = typer.Option(None, "--loss", help=" | ".join(LOSS_NAMES) + " (default: train.loss)."),
    lora_r: int = typer.Option(None, "--lora-r", help="LoRA rank; 0 = full fine-tuning."),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps (GRPO) or SFT steps."),
    base: str = typer.Option(None, "--base", help="Base: champion | challenger | model:<name>/<N> | <name>/<N> | a model spec or "
                               "local dir (default: champion, the base model before the first promotion)."),
    demos: Path = typer.Option(None, "--demos", help="Demonstrations (JSON lines) for SFT (default: the reference "
                               "answers of the train split and the regression suite, as the cycle uses)."),
    deepspeed: str = typer.Option(None, "--deepspeed", help="DeepSpeed config, e.g. infra/deepspeed/zero2.json."),
    logprob_impl: str = typer.Option(None, "--logprob-impl", help="fused | naive log-prob path (train.logprob_impl)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Train the policy and register the result as the `challenger` model version."""
    train_ov = {k: v for k, v in {"mode": mode, "loss": loss, "lora_r": lora_r, "deepspeed": deepspeed,
                                  "logprob_impl": logprob_impl}.items() if v is not None}
    cfg = load(home, config, {"train": train_ov} if train_ov else None)
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.policy.registry import ModelRefError  # ~0.2 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start
    from flywheel.train import stage  # duckdb, ~0.8 s: off the CLI's start
    from flywheel.train.demos import train_split_demonstrations  # duckdb, ~0.7 s: off the CLI's start

    chosen, why = cfg.train.mode, "requested"
    with open_store(cfg) as store:
        artifacts, tracker = open_artifacts(cfg), Tracker(cfg)
        try:
            base = stage.resolve_base(cfg, tracker, base)
        except (ModelRefError, stage.TrainStageError) as e:
            raise CliError(str(e)) from None
        if not rollouts and chosen != "sft":
            rollouts = stage.latest_rollouts(store)
            if not rollouts:
                raise CliError(f"--mode {chosen} needs rollouts and none was ever published: run `flywheel rollout` "
                               "first (or pass --rollouts ID)")
            if not as_json:
                console.print(f"[bold]rollouts[/] {rollouts[0]} (the latest published)")
        if chosen == "auto":
            chosen, why = stage.auto_mode(cfg, store, artifacts, rollouts)
        if not as_json:
            console.print(f"[bold]mode[/] {chosen}: {why}")
        total = (cfg.train.sft_steps if chosen == "sft" else cfg.train.steps) if steps is None else steps
        with progress(enabled=not as_json) as bar:
            task = bar.add_task(f"train {chosen}", total=total, rate="")

            def on_step(step: int, m: dict) -> None:
                bar.update(task, completed=step, rate=f"loss {m['loss']:.4f}  {m['tokens_per_s']:.0f} tok/s")

            if chosen == "sft":
                if demos is not None:
                    demonstrations = _demonstrations(demos)
                else:  # what the cycle trains on: the train split's reference answers
                    try:
                        demonstrations = train_split_demonstrations(cfg, store, artifacts)
                    except LookupError as e:
                        raise CliError(f"SFT needs demonstrations and there is no training environment ({e}): "
                                       "run `flywheel evals build && flywheel envs build`, or pass --demos FILE.jsonl") from None
                    if not demonstrations:
                        raise CliError(f"SFT needs demonstrations and no task of {cfg.cycle.train_env!r} has a reference "
                                       "answer: pass --demos FILE.jsonl")
                    if not as_json:
                        console.print(f"[bold]demonstrations[/] {len(demonstrations)} from the train split")
                res = stage.train_sft(cfg, store, artifacts, tracker, demonstrations, base=base, steps=steps,
                                      on_step=on_step)
            else:
                res = stage.train_grpo(cfg, store, artifacts, tracker, rollouts, base=base, steps=steps,
                                       on_step=on_step)
    info = {**res.to_dict(), "why": why}
    if as_json:
        emit_json(info)
        return
    m = res.metrics
    print_table("training summary", ["what", "value"], [
        ("run", res.run_id), ("mlflow run", res.mlflow_run_id), ("model", f"{res.model_entity} (alias challenger)"),
        ("mode", f"{res.mode} ({why})"), ("adapter", res.adapter), ("steps", res.steps),
        ("loss first -> last", f"{m.get('first_loss', float('nan')):.4f} -> {m.get('loss', float('nan')):.4f}"),
        ("reward mean", f"{m['reward_mean']:.3f}" if "reward_mean" in m else "-"),
        ("grad norm", f"{m.get('grad_norm', float('nan')):.3f}"), ("tokens/s", f"{m.get('tokens_per_s', 0):.0f}"),
    ])
