"""Banding: :class:`LSHIndex` (banded LSH over MinHash signatures, numpy band tables) and the choice of
bands x rows (:func:`lsh_params`, :func:`candidate_probability`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from flywheel.dedup.minhash import _MIX, _fmix64

DEFAULT_BANDS, DEFAULT_ROWS = 32, 4


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
