"""Exact Jaccard, the confirmation of every LSH candidate: :func:`jaccard` of two sets, :func:`pair_jaccard`
of many pairs of hashed shingle sets at once, and :class:`NearMatch` (a confirmed match)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flywheel.dedup.minhash import _SHIFT32


@dataclass(frozen=True)
class NearMatch:
    """A confirmed near-duplicate: the indexed ``key`` and the exact shingle Jaccard."""

    key: Hashable
    jaccard: float


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
