"""The README's "Using it" commands, run in order as written, as subprocesses of the real CLI on a
tiny model against a fresh FLYWHEEL_HOME: init -> ingest -> evals/envs build -> synth -> rollout ->
train -> gate -> (promote) -> trace.

The command list is parsed from the README's code block, so the test breaks when the README and the
CLI drift. Only example arguments are substituted (the traces files, the example trace id); the
commands that need a server or an external service are skipped by the named list ``SKIP``, each
with its reason. Every command runs with ``--json`` and must print exactly one JSON document.
"""

from __future__ import annotations

import gzip
import json
import re
import shlex
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow

# Commands not run here, and why (matched on the words after `flywheel`, before any option).
SKIP: dict[tuple[str, ...], str] = {
    ("collect",): "starts an OTLP/HTTP receiver that runs until stopped (tests/unit/test_collect.py)",
    ("ingest", "--from"): "reads an MLflow tracking server (tests/integration/test_mlflow_tracing_ingest.py)",
    ("serve",): "starts a server that runs until stopped (tests/integration/test_serve*.py)",
    ("cycle",): "runs every stage again as one Prefect flow (tests/integration/test_cycle.py)",
    ("schedule",): "needs a Prefect server (tests/integration/test_schedule.py)",
    ("lineage",): "listed without the entity id it needs (tests/unit/test_lineage_cli.py)",
    ("warehouse",): "a command group; `warehouse migrate` needs PostgreSQL (tests/unit/test_store_migrate.py)",
    ("report",): "reports a cycle; this walk runs the stages by hand (tests/integration/test_report.py)",
}
# Gate exit codes as documented (flywheel/cli/gate.py): outcome -> exit code.
GATE_EXIT = {"passed": 0, "refused": 3, "insufficient_evidence": 4}
# The tiny-model settings of tests/integration/test_cycle.py, as a flywheel.toml.
TINY_TOML = """
[policy]
base_model = "tiny"
device = "cpu"
dtype = "float32"
[rollout]
max_new_tokens = 12
max_tasks = 6
[train]
steps = 1
sft_steps = 2
batch_size = 4
lora_r = 4
micro_batch_tokens = 2048
[synth]
per_seed = 0
[gate]
bootstrap_samples = 200
max_new_tokens = 12
require_decontaminated = false
"""


def readme_commands(readme: str) -> list[list[str]]:
    """The argv (after ``flywheel``) of every command in the "Using it" code block, in order:
    comments dropped, ``a && b`` and ``a / b`` (the README's "or") split into their commands."""
    section = readme.split("## Using it", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: no ```bash block under 'Using it'"
    out = []
    for line in block.group(1).splitlines():
        line = re.sub(r"\s{2,}#.*$", "", line).strip()
        if not line:
            continue
        for part in re.split(r"\s+(?:&&|/)\s+", line):
            words = shlex.split(part)
            if words[0] == "flywheel":
                words = words[1:]
            out.append(words)
    return out


def skip_reason(argv: list[str]) -> str | None:
    for key, why in SKIP.items():
        if tuple(argv[: len(key)]) == key:
            return why
    return None


@pytest.fixture
def walk(tmp_path, it):
    work = tmp_path / "work"
    work.mkdir()
    (work / "flywheel.toml").write_text(TINY_TOML)
    traffic = it.bfcl_traffic(tmp_path / "traffic.jsonl")
    with open(traffic, "rb") as src, gzip.open(work / "traces.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copyfile(it.ROOT / "tests" / "fixtures" / "traces" / "otel.jsonl", work / "otel.jsonl")
    env = it.clean_env(FLYWHEEL_HOME=str(tmp_path / "home"))
    flywheel = str(it.VENV_BIN / "flywheel")

    def run(argv: list[str]) -> tuple[int, object, str]:
        p = subprocess.run([flywheel, *argv, "--json"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=1800)
        try:
            doc = json.loads(p.stdout)
        except ValueError:
            doc = None
        return p.returncode, doc, f"$ flywheel {shlex.join(argv)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"

    return run


def test_readme_parse_splits_the_summary_lines():
    cmds = readme_commands("## Using it\n\n```bash\nflywheel evals build && flywheel envs build   # x\n"
                           "flywheel promote 3 / flywheel rollback   # y\nflywheel status / events\n```\n")
    assert cmds == [["evals", "build"], ["envs", "build"], ["promote", "3"], ["rollback"], ["status"], ["events"]]


def test_readme_commands_run_in_order_on_a_tiny_model(walk, it):
    cmds = readme_commands((it.ROOT / "README.md").read_text())
    names = [c[0] for c in cmds]
    for stage in ("init", "ingest", "evals", "envs", "synth", "rollout", "train", "gate", "promote", "trace"):
        assert stage in names, f"README 'Using it' lists no `flywheel {stage}`"
    ran: list[str] = []
    gate_outcome = None
    for argv in cmds:
        if skip_reason(argv):
            continue
        if argv[0] in ("promote", "rollback") and gate_outcome != "passed":
            continue  # a promotion needs a passing gate; a rollback needs a promotion
        if argv[0] == "impact":  # the README's example trace id -> one that was ingested
            rc, events, log = walk(["events", "--type", "trace.ingested", "--limit", "1"])
            assert rc == 0 and events, log
            argv = [argv[0], events[0]["stream"], *argv[2:]]
        rc, doc, log = walk(argv)
        ran.append(argv[0])
        assert doc is not None, f"not one JSON document on stdout:\n{log}"
        if argv[0] == "gate":
            # A tiny held-out suite cannot decide: insufficient evidence is the expected outcome, but
            # whatever the outcome, the exit code is the documented one.
            gate_outcome = doc["outcome"]
            assert rc == GATE_EXIT[gate_outcome], log
            assert doc["challenger_version"] == 2, log  # init registered the base model as version 1
            continue
        assert rc == 0, log
        if argv[0] == "init":
            assert doc["champion"]["model"] == "model:policy/1", log
        if argv[0] == "train":
            assert doc["model_entity"] == "model:policy/2" and doc["mode"] in ("sft", "grpo"), log
        if argv[0] == "trace":
            assert doc["root"] == ("model:policy/2" if gate_outcome == "passed" else "model:policy/1"), log
    for stage in ("init", "ingest", "evals", "envs", "synth", "rollout", "train", "gate", "trace"):
        assert stage in ran, stage
