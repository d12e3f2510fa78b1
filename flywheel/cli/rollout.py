"""``flywheel rollout``: K samples per task of an environment into a versioned Parquet dataset."""

from __future__ import annotations

import typer

from flywheel.cli.common import (
    CliError,
    ConfigOpt,
    HomeOpt,
    JsonOpt,
    emit_json,
    handle_errors,
    load,
    out,
    print_table,
    progress,
)


def register(app: typer.Typer) -> None:
    app.command("rollout")(rollout)


@handle_errors
def rollout(
    env: str = typer.Option(None, "--env", help="Environment name or name@version (default: the training env)."),
    group_size: int = typer.Option(None, "--group-size", "-k", help="Samples per task (rollout.group_size)."),
    policy: str = typer.Option("champion", "--policy",
                               help="champion | challenger | model:<name>/<v> | a model dir or spec | an http(s) URL."),
    max_tasks: int = typer.Option(None, "--max-tasks", help="Sample at most this many tasks (a stable subset)."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Tokens per model turn (rollout.max_new_tokens)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Sample K episodes per task from the policy, score them, publish the group dataset."""
    import time
    import uuid

    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.rollouts import RolloutError, run_rollouts  # duckdb, ~0.6 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

    overrides = {"rollout": {k: v for k, v in {"max_new_tokens": max_new_tokens}.items() if v is not None}}
    cfg = load(home, config, overrides)
    correlation_id = f"rollout-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    artifacts = open_artifacts(cfg)
    with open_store(cfg) as store, progress(enabled=not as_json) as bar:
        task = bar.add_task("rollout", total=None, rate="")

        def report(p: dict) -> None:
            tps = p["tokens"] / max(p["elapsed_s"], 1e-9)
            bar.update(task, completed=p["tasks_done"], total=p["tasks"],
                       rate=f"{p['samples']} samples, {tps:,.1f} tok/s")

        try:
            s = run_rollouts(cfg, store, artifacts, Tracker(cfg), env=env, policy=policy, group_size=group_size,
                             max_tasks=max_tasks, correlation_id=correlation_id, progress=report)
        except RolloutError as e:
            raise CliError(str(e)) from None
    d = s.to_dict()
    if as_json:
        emit_json(d)
        return
    st = s.stats
    print_table(
        f"rollouts {s.rollout_id}" + (" (already published: reused)" if s.reused else ""),
        ["env", "policy", "tasks", "samples", "mean reward", "pass@1", "pass@K", "zero-var groups", "tokens", "tok/s"],
        [(s.env_id, s.policy, s.tasks, s.samples, f"{st.get('mean_reward', 0):.3f}", f"{st.get('pass_at_1', 0):.3f}",
          f"{st.get('pass_at_k', 0):.3f}", f"{st.get('zero_variance_share', 0):.0%}", st.get("tokens"),
          f"{st.get('tokens_per_s', 0):.1f}")],
    )
    if len(st.get("endpoints") or {}) > 1:
        out.print("served by " + ", ".join(f"{u} ({n} groups)" for u, n in st["endpoints"].items()))
    if not s.published:
        raise CliError(f"nothing published: {s.reason}")
