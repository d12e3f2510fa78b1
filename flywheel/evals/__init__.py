"""Failures -> evals -> suites.

- :mod:`flywheel.evals.compiler`: one production failure (or successful trace) -> one verifiable eval
  task, with the verifier its failure kind calls for (the table is in that module).
- :mod:`flywheel.evals.stage`: :func:`build_evals`, the stage that compiles everything ingested, deals
  the train / held-out split by request cluster and versions the suites (events and guarantees there).
"""

from __future__ import annotations

from flywheel.evals.compiler import (
    COMPILER_VERSION,
    CompileSkip,
    compile_failure,
    compile_success,
    eval_id,
    reference_from_correction,
    trace_correction,
)
from flywheel.evals.stage import ConcurrencyError, EvalsSummary, build_evals

__all__ = [
    "COMPILER_VERSION",
    "CompileSkip",
    "ConcurrencyError",
    "EvalsSummary",
    "build_evals",
    "compile_failure",
    "compile_success",
    "eval_id",
    "reference_from_correction",
    "trace_correction",
]
