"""Synthetic tasks: widen each training eval into verified, deduplicated, decontaminated variants.

A handful of production failures is too few to train on. :func:`run_synth` takes the training
environment's eval tasks as *seeds*, asks each generator for variants, and keeps only those that
pass every gate of the funnel::

    generated -> valid -> solvable -> unique -> uncontaminated -> accepted

- :mod:`flywheel.synth.generators`: the pluggable generators (:data:`GENERATORS`: mutate,
  distractor, parallel, paraphrase, and the targeted schema_values, masked_names, irrelevance),
  :func:`generate_candidates` (``per_seed`` variants of every seed) and :func:`generate_planned`
  (a number of variants per generator);
- :mod:`flywheel.synth.probe`: the probe that aims the synthesis (error kinds of a policy's greedy
  answers, :func:`plan_generators` from their counts);
- :mod:`flywheel.synth.funnel`: the gates (validation with the Great Expectations suite,
  solvability, exact/near/semantic dedup, held-out decontamination, difficulty) and
  :class:`Rejection`;
- :mod:`flywheel.synth.stage`: :func:`run_synth` (one batch -> a new environment version and one
  recorded event), :func:`reattest_batches`, the batch id;
- :mod:`flywheel.synth.keys`: the task id, the tool menu and answer keys the dedup compares, the
  seed selection, the bounds every task respects.

Not guaranteed: that a mutated request reads naturally (values are swapped in place); that a
string drawn from the pool fits every nuance of the request ("Paris" where the seed said "Berlin's
Mitte"); detection of paraphrases with little word overlap unless the semantic check is enabled.
"""

from __future__ import annotations

from flywheel.synth.funnel import (
    FUNNEL,
    Rejection,
    check_solvable,
    decontaminate,
    dedup_candidates,
    measure_difficulty,
    validate_candidates,
)
from flywheel.synth.generators import (
    GENERATORS,
    Candidate,
    DistractorGenerator,
    GenContext,
    Generator,
    IrrelevanceGenerator,
    MaskedNamesGenerator,
    MutateGenerator,
    ParallelGenerator,
    ParaphraseGenerator,
    Progress,
    SchemaValuesGenerator,
    build_context,
    generate_candidates,
    generate_planned,
    make_generators,
    mutate_task,
)
from flywheel.synth.keys import LIMITS, SYNTH_VERSION, answer_key, seed_tasks, synth_task_id, tool_key
from flywheel.synth.stage import SynthSummary, batch_id, reattest_batches, run_synth

__all__ = [
    "FUNNEL",
    "GENERATORS",
    "LIMITS",
    "SYNTH_VERSION",
    "Candidate",
    "DistractorGenerator",
    "GenContext",
    "Generator",
    "IrrelevanceGenerator",
    "MaskedNamesGenerator",
    "MutateGenerator",
    "ParallelGenerator",
    "ParaphraseGenerator",
    "Progress",
    "Rejection",
    "SchemaValuesGenerator",
    "SynthSummary",
    "answer_key",
    "batch_id",
    "build_context",
    "check_solvable",
    "decontaminate",
    "dedup_candidates",
    "generate_candidates",
    "generate_planned",
    "make_generators",
    "measure_difficulty",
    "mutate_task",
    "reattest_batches",
    "run_synth",
    "seed_tasks",
    "synth_task_id",
    "tool_key",
    "validate_candidates",
]
