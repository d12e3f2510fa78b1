"""The ``flywheel`` command line. Library code never parses the CLI; each command calls a stage
function. Heavy modules are imported inside the commands so ``flywheel --help`` stays fast."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from flywheel.cli.common import reserve_stdout_for_json

app = typer.Typer(
    name="flywheel",
    help="An open data flywheel for AI agents: production failures -> evals -> RL environments -> "
    "GRPO -> gated deployment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module adds its commands with register(app). Order = order in --help.
COMMAND_MODULES = [
    "flywheel.cli.core",
    "flywheel.cli.ingest",
    "flywheel.cli.evals",
    "flywheel.cli.synth",
    "flywheel.cli.rollout",
    "flywheel.cli.train",
    "flywheel.cli.gate",
    "flywheel.cli.cycle",
    "flywheel.cli.serve",
    "flywheel.cli.demo",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    # flywheel shows its own progress (rich); the libraries' tqdm bars would interleave with it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

    if "--json" in sys.argv[1:]:
        reserve_stdout_for_json()
    app()
