"""The cost of going distributed: one tiny-model cycle in team mode against the embedded default, same machine.

(a) **embedded** (the named peer): the cycle in one process with the embedded default -- DuckDB file, MLflow
    on SQLite, Prefect's temporary server (its start is part of the cycle's wall time, as for a user);
(b) **team mode**, exactly as ``tests/integration/test_team_mode.py`` builds it: PostgreSQL, a real MLflow
    server whose artifact proxy is the artifact store, a real Prefect server with two process work pools,
    and ingest/evals/envs on the ``cpu`` worker, rollouts/training/gate on the ``gpu`` worker (``cycle.pools``),
    every "machine" with its own empty home in a private mount namespace. Servers and workers are started
    before the clock starts (a team runs them all the time); the cycle is timed from the gateway.

Both run the same traffic (22 BFCL questions answered in prose) with the tests' tiny-model settings, so
the cycle's own work is small and what the ratio shows is the orchestration: one flow-run process per
pooled stage (imports included), the artifact round trips through the proxy, PostgreSQL instead of a
local file.

    .venv/bin/python benchmarks/bench_team_mode.py [--json]

Measured figures: benchmarks/README.md and the README's "Team mode".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the test's cluster and server helpers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import conftest as it  # tests/integration/conftest.py: server processes, traffic, the tiny settings
    from test_team_mode import POOLS, namespaces_work, team_cluster

    from flywheel.pglocal import LocalPostgres

    if not namespaces_work():
        print("unshare --mount is not permitted here: team mode's machines cannot be isolated", file=sys.stderr)
        return 2
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    root = Path(tempfile.mkdtemp(prefix="bench-team-mode-"))
    pg = LocalPostgres.start()
    mlflow = it.start_mlflow_server(root / "mlflow")
    try:
        home = root / "embedded" / "home"
        home.parent.mkdir(parents=True)
        traffic = it.bfcl_traffic(root / "embedded" / "traffic.jsonl")
        log("embedded: one tiny cycle …")
        t0 = time.perf_counter()
        embedded, _ = it.run_cycle_subprocess(home, [str(traffic)], env=it.clean_env(), timeout_s=1500)
        embedded_s = time.perf_counter() - t0
        log("team mode: servers and workers …")
        (root / "team").mkdir()
        with team_cluster(root / "team", pg, mlflow, it) as t:
            log("team mode: one tiny cycle …")
            t0 = time.perf_counter()
            team = t["run_cycle"]({**it.TINY, "cycle": {"pools": POOLS}}, root / "team" / "gateway-cycle.log")
            team_s = time.perf_counter() - t0
    finally:
        mlflow.stop()
        pg.stop()

    stages = list(dict.fromkeys([*embedded.get("timings", {}), *team.get("timings", {})]))
    out = {
        "embedded_s": round(embedded_s, 1), "team_s": round(team_s, 1), "ratio": round(team_s / embedded_s, 2),
        "outcomes": {"embedded": embedded["outcome"], "team": team["outcome"]},
        "stages": {s: {"embedded_s": embedded.get("timings", {}).get(s), "team_s": team.get("timings", {}).get(s)}
                   for s in stages},
        "pools": POOLS,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'stage':<20}{'embedded s':>12}{'team s':>12}{'team/embedded':>15}")
    for s, v in out["stages"].items():
        e, tm = v["embedded_s"], v["team_s"]
        ratio = f"{tm / e:.2f}x" if e and tm else "-"
        print(f"{s:<20}{e if e is not None else '-':>12}{tm if tm is not None else '-':>12}{ratio:>15}")
    print(f"{'whole cycle':<20}{out['embedded_s']:>12}{out['team_s']:>12}{str(out['ratio']) + 'x':>15}")
    print(f"outcomes: embedded {embedded['outcome']}, team {team['outcome']} (tiny model: a refusal is expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
