"""The generators by name (:data:`GENERATORS`, :func:`make_generators`) and the two ways a batch asks
them for variants: :func:`generate_candidates` (``per_seed`` variants of every seed) and
:func:`generate_planned` (a number of variants per generator, a probe's plan)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from flywheel.policy.base import Policy
from flywheel.synth.generators.base import Candidate, Generator, Progress, build_context
from flywheel.synth.generators.distractor import DistractorGenerator
from flywheel.synth.generators.enumeration import EnumerationGenerator
from flywheel.synth.generators.irrelevance import IrrelevanceGenerator
from flywheel.synth.generators.masked_names import MaskedNamesGenerator
from flywheel.synth.generators.mutate import MutateGenerator
from flywheel.synth.generators.parallel import ParallelGenerator
from flywheel.synth.generators.paraphrase import ParaphraseGenerator
from flywheel.synth.generators.schema_values import SchemaValuesGenerator
from flywheel.synth.generators.unused_tool import UnusedToolGenerator
from flywheel.vocab.ids import json_id

GENERATORS: dict[str, type[Generator]] = {
    "mutate": MutateGenerator,
    "distractor": DistractorGenerator,
    "parallel": ParallelGenerator,
    "enumeration": EnumerationGenerator,
    "paraphrase": ParaphraseGenerator,
    "schema_values": SchemaValuesGenerator,
    "masked_names": MaskedNamesGenerator,
    "irrelevance": IrrelevanceGenerator,
    "unused_tool": UnusedToolGenerator,
}


def make_generators(names: Sequence[str], params: dict[str, dict] | None = None) -> list[Generator]:
    """Instantiate generators by name (``params`` per name override the defaults)."""
    out = []
    for n in names:
        if n not in GENERATORS:
            raise ValueError(f"unknown synth generator {n!r}; known: {sorted(GENERATORS)}")
        out.append(GENERATORS[n](**(params or {}).get(n, {})))
    return out


def generate_candidates(seeds: list[dict], generators: list[Generator], per_seed: int, *, seed: int = 0,
                        policy: Policy | None = None, context_seeds: list[dict] | None = None,
                        progress: Progress | None = None) -> tuple[list[Candidate], int]:
    """Variants of every seed: variant ``k`` of a seed comes from ``generators[k % len]``.

    Returns (candidates in a deterministic order, number of slots no generator could fill).
    Deterministic: the same seeds, generators, ``per_seed`` and ``seed`` give the same candidates
    (paraphrase: with a policy that is deterministic under its sampling seed).
    """
    ctx = build_context(context_seeds if context_seeds is not None else seeds, policy=policy, seed=seed)
    per_gen: dict[int, list[tuple[dict, int, random.Random]]] = {i: [] for i in range(len(generators))}
    order: list[tuple[int, int]] = []
    for s in seeds:
        content = json_id({k: s.get(k) for k in ("prompt", "verifier", "reference")})
        for k in range(per_seed):
            gi = k % len(generators)
            g = generators[gi]
            rng = random.Random(int(json_id([seed, g.name, g.params, s["task_id"], content, k]), 16))
            order.append((gi, len(per_gen[gi])))
            per_gen[gi].append((s, k, rng))
    results: dict[int, list[Candidate | None]] = {}
    done = 0
    for gi, g in enumerate(generators):
        results[gi] = g.generate(per_gen[gi], ctx) if per_gen[gi] else []
        done += len(per_gen[gi])
        if progress:
            progress("generate", done, len(order))
    out, na = [], 0
    for gi, j in order:
        c = results[gi][j]
        if c is None:
            na += 1
        else:
            out.append(c)
    return out, na


def generate_planned(seeds: list[dict], generators: list[Generator], counts: dict[str, int], *, seed: int = 0,
                     policy: Policy | None = None, context_seeds: list[dict] | None = None,
                     progress: Progress | None = None) -> tuple[list[Candidate], int]:
    """Variants by plan: generator ``g`` makes ``counts[g.name]`` variants, spread round-robin over
    the seeds it applies to (from an offset hashed from the batch seed and the generator, so small
    plans do not all start on the same seeds); the ``j``-th pass over the seeds is variant ``k = j``
    of each, with the same per-variant randomness as :func:`generate_candidates` gives variant ``k``.

    Returns (candidates, generator by generator in the order given, then slot order; number of
    slots that produced nothing: no applicable seed, or the generator found nothing to vary).
    Deterministic like :func:`generate_candidates`.
    """
    ctx = build_context(context_seeds if context_seeds is not None else seeds, policy=policy, seed=seed)
    out: list[Candidate] = []
    na = 0
    total = sum(max(0, int(counts.get(g.name, 0))) for g in generators)
    done = 0
    for g in generators:
        n = max(0, int(counts.get(g.name, 0)))
        if n == 0:
            continue
        eligible = [s for s in seeds if g.applicable(s)]
        if not eligible:
            na += n
            done += n
            continue
        offset = int(json_id([seed, "plan", g.name, g.params], 8), 16) % len(eligible)
        items = []
        for j in range(n):
            s = eligible[(offset + j) % len(eligible)]
            k = j // len(eligible)
            content = json_id({key: s.get(key) for key in ("prompt", "verifier", "reference")})
            rng = random.Random(int(json_id([seed, g.name, g.params, s["task_id"], content, k]), 16))
            items.append((s, k, rng))
        got = g.generate(items, ctx)
        na += sum(1 for c in got if c is None)
        out += [c for c in got if c is not None]
        done += n
        if progress:
            progress("generate", done, total)
    return out, na
