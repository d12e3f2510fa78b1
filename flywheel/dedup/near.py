"""Near-duplicate search: :class:`NearDupIndex` (MinHash LSH proposes, exact Jaccard confirms) and
:class:`GrowingNearDupIndex` (the same for documents added one at a time between queries)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np

from flywheel.dedup.exact import NearMatch, pair_jaccard
from flywheel.dedup.lsh import DEFAULT_BANDS, DEFAULT_ROWS, LSHIndex, lsh_params
from flywheel.dedup.minhash import DEFAULT_NUM_PERM, MinHasher
from flywheel.dedup.text import DEFAULT_NGRAM


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
