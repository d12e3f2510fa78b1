"""MinHash: hashed shingle sets of a corpus (word n-grams or character k-grams) and their signatures.

:class:`MinHasher` and the vectorised hashing under it (see the :mod:`flywheel.dedup` docstring,
"Hashing"): token hashes (BLAKE2b, cached per distinct token), n-gram hashes (Murmur3's finaliser
folded to 32 bits), and affine permutations min-reduced per document.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Literal

import numpy as np

from flywheel.dedup.text import _TOKEN, DEFAULT_NGRAM, _canon_token, _fold

DEFAULT_NUM_PERM = 128

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
        """(values, offsets): each text's sorted unique shingle hashes (see :func:`flywheel.dedup.exact.jaccard`)."""
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
