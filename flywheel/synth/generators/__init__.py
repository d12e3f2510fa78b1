"""Synthetic-task generators: variants of training seeds, each a :class:`Candidate` for the funnel
(:mod:`flywheel.synth.funnel`).

Generators (pluggable: :data:`GENERATORS`; each records ``metadata.generator`` and
``metadata.generator_params`` on every task it makes, and what it did in ``metadata.synth_detail``)
----------------------------------------------------------------------------------------------------
- ``mutate`` (schema-driven mutation, deterministic per seed): picks arguments of the reference
  answer whose value the user request states *exactly once* (a number, an enum member, a string,
  a date or a time; a value stated twice or shared by two arguments is ambiguous and left alone),
  draws a new value inside the argument's JSON Schema (enum members, ``minimum``/``maximum``, the
  original's magnitude and decimals, the date/time format; strings from the values other training
  seeds use for a parameter of the same name, then a small built-in vocabulary by parameter name),
  rewrites that span of the request in the original's style (thousands separators, decimals), and
  sets the reference and the expected answer to the new value. Never uses held-out values: the
  pool is built from training seeds only.
- ``distractor`` (BFCL ``multiple`` style): adds 1..``max_distractors`` tools from the pool of every
  training seed's tools, the most *plausible* first (largest word overlap of name + description
  with the task's own tools), at seeded positions; the expected answer is unchanged, so calling a
  distractor fails.
- ``parallel`` (BFCL ``parallel`` / ``parallel_multiple`` style): joins the request with a second
  one -- a mutation of itself (same function, other values) or another seed with compatible tools --
  into one request whose answer is both calls, order-insensitive.
- ``paraphrase`` (optional; needs a policy): asks any chat model through the policy interface to
  reword the request, keeping the reference. The output must keep every value the request stated
  (else the candidate is invalid); a paraphrase too close to its seed is caught as a near-duplicate.

Targeted generators (aimed by :mod:`flywheel.synth.probe`; each makes a variant only where it applies)
----------------------------------------------------------------------------------------------------
- ``schema_values``: re-asks a seed with a new value for an argument whose parameter *states a
  format* -- a string ``enum`` (another member), a date format in the description (``yyyy-mm-dd``,
  ``MM-DD-YYYY``, ISO 8601, ``format: date``: the request says the new date in words, the reference
  writes it in that format), "City, State" / "City, Country" (the request names a well-known city,
  usually alone as BFCL's requests do; the reference writes "City, ST" when the description's example
  abbreviates, and the verifier accepts the abbreviation and the full state name), quoted example
  values in the description (another one, never the stated default). The request must state the
  seed's value in exactly one place; no variant where nothing states a format.
- ``masked_names``: neutral function and/or parameter names (``fn_3fa2``, ``a_1c9``) in the tools,
  their ``required`` lists and descriptions, the request (identifier-like names only) and the
  reference, so a memorised name fails and the descriptions must be read.
- ``irrelevance``: the seed's request with the tools it needs removed and unrelated ones added; the
  expected answer is no call (``expected: []``, reference ``{"content": NO_CALL_ANSWER}``).

:func:`generate_planned` makes a given number of variants per generator (a probe's plan) instead of
``per_seed`` variants of every seed.

Modules: :mod:`~flywheel.synth.generators.base` (:class:`Candidate`, :class:`GenContext`,
:class:`Generator`, the helpers every generator shares), one module per generator (``mutate``,
``distractor``, ``parallel``, ``paraphrase``, ``schema_values``, ``masked_names``, ``irrelevance``),
and :mod:`~flywheel.synth.generators.registry` (:data:`GENERATORS`, :func:`make_generators`,
:func:`generate_candidates`, :func:`generate_planned`). This package re-exports their public names.

Not guaranteed: that a swapped enum or example value still fits every other word of the request
("remove the columns" with ``operation='add'``): the funnel checks the answer, not the prose.
"""

from __future__ import annotations

from flywheel.synth.generators.base import Candidate, GenContext, Generator, Progress, build_context
from flywheel.synth.generators.distractor import DistractorGenerator
from flywheel.synth.generators.irrelevance import NO_CALL_ANSWER, IrrelevanceGenerator
from flywheel.synth.generators.masked_names import MaskedNamesGenerator
from flywheel.synth.generators.mutate import VOCAB, MutateGenerator, mutate_task
from flywheel.synth.generators.parallel import ParallelGenerator
from flywheel.synth.generators.paraphrase import PARAPHRASE_SYSTEM, ParaphraseGenerator
from flywheel.synth.generators.registry import (
    GENERATORS,
    generate_candidates,
    generate_planned,
    make_generators,
)
from flywheel.synth.generators.schema_values import (
    CITY_COUNTRIES,
    CITY_STATES,
    SCHEMA_FORMATS,
    SchemaValuesGenerator,
)

__all__ = [
    "CITY_COUNTRIES",
    "CITY_STATES",
    "GENERATORS",
    "NO_CALL_ANSWER",
    "PARAPHRASE_SYSTEM",
    "SCHEMA_FORMATS",
    "VOCAB",
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
    "SchemaValuesGenerator",
    "build_context",
    "generate_candidates",
    "generate_planned",
    "make_generators",
    "mutate_task",
]
