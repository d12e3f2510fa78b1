"""Evals and environments: ``flywheel evals build``, ``flywheel envs build|list|show``."""

from __future__ import annotations

from collections import Counter

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
)

evals_app = typer.Typer(help="Compile production failures into evals, split them, version the suites.",
                        no_args_is_help=True)
envs_app = typer.Typer(help="Versioned RL environments built from the eval suites.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(evals_app, name="evals")
    app.add_typer(envs_app, name="envs")


@evals_app.command("build")
@handle_errors
def evals_build(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """One eval per distinct failure (verifier from its kind), regression evals from successful
    traces, the stable train/held-out split, and new suite versions. Re-running appends nothing."""
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.evals import build_evals  # duckdb, ~0.7 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        summary = build_evals(cfg, s, open_artifacts(cfg))
    data = summary.to_dict()
    if as_json:
        emit_json(data)
        return
    kinds = sorted(set(data["created"]) | set(data["updated"]))
    print_table(
        f"evals: {sum(data['created'].values())} created, {sum(data['updated'].values())} updated, "
        f"{data['unchanged']} unchanged",
        ["verifier", "created", "updated"],
        [(k, data["created"].get(k, 0), data["updated"].get(k, 0)) for k in kinds],
    )
    if data["created_by_failure_kind"]:
        print_table("created by failure kind", ["kind", "evals"], sorted(data["created_by_failure_kind"].items()))
    print_table("splits", ["split", "evals"], sorted(data["splits"].items()))
    print_table("suites", ["suite", "members", "new version"],
                [(x["suite"], x["members"], "yes" if x["new_version"] else "no") for x in data["suites"]])
    if data["skipped"]:
        print_table("skipped", ["reason", "count"], sorted(data["skipped_by_reason"].items()))
    if data["heldout"]:
        h = data["heldout"]
        out.print(f"held-out suite: {h['items']} items ({h['failures']} production failures for the fix rate, "
                  f"{h['successes']} successes for the keep rate) in {h['clusters']} clusters")
    if data.get("evals_with_tools_without_schema"):
        out.print(f"{data['evals_with_tools_without_schema']} eval(s) call tools the traces recorded without a schema: "
                  "their verifiers check names and argument objects only (weak); set [ingest] tool_registry to "
                  "supply the schemas")
    if data["excluded_from_gate"]:
        out.print(f"{data['excluded_from_gate']} non-deterministic evals kept out of the gate suites "
                  "(set [evals] include_llm_judge_in_gate = true to include them)")
    for w in data["warnings"]:
        out.print(f"[bold yellow]warning:[/] {w}")


@envs_app.command("build")
@handle_errors
def envs_build(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Version the training environment from the latest train suite (plus synth tasks)."""
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.envs.build import build_envs  # duckdb, ~1 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        summary = build_envs(cfg, s, open_artifacts(cfg))
    data = summary.to_dict()
    if as_json:
        emit_json(data)
        return
    print_table("environments", ["env", "tasks", "synth tasks", "suites", "new version"],
                [(e["env"], e["tasks"], e["synth_tasks"], ", ".join(e["suites"]), "yes" if e["new_version"] else "no")
                 for e in data["envs"]])
    if data["skipped"]:
        print_table("skipped", ["reason", "count"], sorted(data["skipped_by_reason"].items()))


@envs_app.command("list")
@handle_errors
def envs_list(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Every environment with its latest version."""
    from flywheel.envs.build import list_envs  # duckdb, ~1 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        envs = list_envs(s)
    rows = [
        {"env": e["entity_id"], "name": e["name"], "version": e["version"], "tasks": e["tasks"],
         "harness": e.get("harness_kinds", {}), "suites": e.get("suites", []),
         "synth_batches": len(e.get("synth_batches", [])), "version_hash": e["version_hash"]}
        for e in envs
    ]
    if as_json:
        emit_json(rows)
        return
    print_table("environments", ["env", "tasks", "harness", "suites", "synth batches", "version hash"],
                [(r["env"], r["tasks"], ", ".join(f"{k}={v}" for k, v in sorted(r["harness"].items())),
                  ", ".join(r["suites"]), r["synth_batches"], r["version_hash"][:12]) for r in rows])


@envs_app.command("show")
@handle_errors
def envs_show(
    env: str = typer.Argument(..., help="Environment: NAME (latest), NAME@N or env:NAME@N."),
    tasks: int = typer.Option(10, "--tasks", help="How many tasks to list (table output)."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """One environment version: config, task counts by harness/verifier/split, and its tasks."""
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.versioning import load_env  # duckdb, ~0.4 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        try:
            e = load_env(s, open_artifacts(cfg), env)
        except (LookupError, ValueError) as err:
            raise CliError(str(err)) from None
    by_kind = Counter(t["verifier"]["kind"] for t in e.tasks)
    by_harness = Counter(t["harness"] for t in e.tasks)
    by_split = Counter((t.get("metadata") or {}).get("split") or "synth" for t in e.tasks)
    data = {
        "env": e.entity_id, "name": e.name, "version": e.version, "version_hash": e.version_hash,
        "harness": e.harness, "verifier_config": e.verifier_config, "suites": e.suites,
        "synth_batches": e.synth_batches, "artifact": e.artifact, "tasks": len(e.tasks),
        "by_verifier": dict(by_kind), "by_harness": dict(by_harness), "by_split": dict(by_split),
    }
    if as_json:
        data["task_records"] = e.tasks
        emit_json(data)
        return
    print_table(e.entity_id, ["field", "value"], [
        ("version hash", e.version_hash), ("tasks", len(e.tasks)), ("max turns", e.harness.get("max_turns")),
        ("suites", ", ".join(e.suites)), ("synth batches", len(e.synth_batches)),
        ("by verifier", ", ".join(f"{k}={v}" for k, v in sorted(by_kind.items()))),
        ("by harness", ", ".join(f"{k}={v}" for k, v in sorted(by_harness.items()))),
    ])
    print_table(f"first {min(tasks, len(e.tasks))} tasks", ["task", "harness", "verifier", "tools", "request"], [
        (t["task_id"], t["harness"], t["verifier"]["kind"], ", ".join((t.get("metadata") or {}).get("tools", [])),
         _request(t)[:70]) for t in e.tasks[:tasks]
    ])


def _request(task: dict) -> str:
    for m in reversed(task["prompt"]["messages"]):
        if m.get("role") == "user":
            c = m.get("content")
            return c if isinstance(c, str) else str(c)
    return ""
