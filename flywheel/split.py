"""Stable train / held-out split of evals by failure cluster.

A model must never be gated on a near-copy of what it trained on, so evals are split by *cluster*,
not one by one: near-identical requests share a cluster and a cluster lives on one side only.

How a failure is placed (:meth:`SplitIndex.assign`):

1. Its **request text** (:func:`request_text`) is the system and user turns of its prompt plus the
   sorted names of the offered tools, normalised (NFKC, casefolded, every run of non-alphanumerics
   collapsed to one space). Assistant and tool turns are left out: two users asking the same thing
   are the same request whatever the agent answered.
2. **Exact match**: the SHA-256 of that text (``request_hash``) equal to a placed eval's -> the same
   cluster.
3. **Near match**: MinHash (128 permutations over character 5-grams, datasketch) with LSH candidate
   search at a *lower* threshold than ``cluster_jaccard`` (recall first), then every candidate is
   confirmed by its estimated Jaccard >= ``cluster_jaccard``. Character 5-grams rather than word
   shingles because production requests are short ("Weather in Oslo?" has 3 words but 12 5-grams).
4. No match -> a **new cluster**, named ``c-<request_hash[:16]>`` after its founding member, dealt
   to held-out when ``sha256(split_seed, cluster) / 2**64 < heldout_fraction``, else train. The deal
   depends only on the cluster name and the seed, never on how many failures exist or their order.
5. Near matches on **both** sides (a request that bridges a train and a held-out cluster) -> split
   ``"excluded"``: it is in neither suite, because whichever side took it would hold a near-copy of
   the other side. It founds its own cluster; later near-copies of it are excluded too.

Guarantees
- Once placed, a failure's split and cluster never change: the placement is recorded in its
  ``eval.created`` event and :meth:`SplitIndex.add_existing` reloads it on every build.
- Within one build, failures are placed in a deterministic order (the caller sorts them), so the
  same inputs always give the same placements.
- Train and held-out never share a cluster, and no new failure joins a side whose other side it
  near-matches (rule 5).

Not guaranteed
- Near matches are estimated: two requests whose true 5-gram Jaccard is within ~0.1 of the
  threshold may or may not be joined (MinHash standard error with 128 permutations is about
  ``sqrt(J(1-J)/128)`` ~ 0.04 at J = 0.7).
- Clusters do not merge retroactively: if A and C were placed apart and a later B is close to both,
  A and C stay where they were (B is then excluded when they are on different sides).
- Semantic paraphrases with little surface overlap are not detected (no embeddings here).
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from datasketch import MinHash, MinHashLSH

#: Bump when :func:`request_text` changes. Placements already recorded keep their split regardless.
REQUEST_TEXT_VERSION = 1
NUM_PERM = 128
SHINGLE = 5
SPLITS = ("train", "heldout", "excluded")

_NON_ALNUM = re.compile(r"[\W_]+", re.UNICODE)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        return str(fn.get("name", ""))
    return ""


def normalise(text: str) -> str:
    """NFKC, casefold, non-alphanumeric runs -> one space, trimmed.

    ``"Weather in Porto, please!"`` -> ``"weather in porto please"``.
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    return _NON_ALNUM.sub(" ", text).strip()


def request_text(messages: Iterable[dict], tools: Iterable[dict] | None = None) -> str:
    """The normalised request a failure is clustered on: system + user turns, then tool names."""
    parts = [
        _content_text(m.get("content"))
        for m in messages
        if isinstance(m, dict) and m.get("role") in ("system", "user")
    ]
    names = sorted({_tool_name(t) for t in (tools or [])} - {""})
    text = normalise(" ".join(parts))
    if names:
        text += " | tools " + " ".join(normalise(n) for n in names)
    return text


def request_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def shingles(text: str, k: int = SHINGLE) -> set[str]:
    """Character k-grams of ``text``; a text shorter than ``k`` is its own single shingle."""
    if len(text) <= k:
        return {text}
    return {text[i : i + k] for i in range(len(text) - k + 1)}


def _crc32(data: bytes) -> int:
    return zlib.crc32(data)


@functools.lru_cache(maxsize=8)
def _permutations(num_perm: int) -> Any:
    # Drawing the permutation parameters costs ~0.9 ms per MinHash; they depend only on the seed.
    proto = MinHash(num_perm=num_perm, seed=1, scheme="affine32")
    return proto.permutations


def signature(text: str, num_perm: int = NUM_PERM) -> MinHash:
    """MinHash of the 5-gram set of ``text``. Deterministic across processes and runs.

    Shingles are hashed with CRC-32 (C speed; 32 bits is datasketch's default width too) rather
    than datasketch's SHA-1 default: ~3x faster per shingle. Signatures are never stored (placements
    are), so the hash can change without moving any recorded split.
    """
    m = MinHash(num_perm=num_perm, seed=1, hashfunc=_crc32, permutations=_permutations(num_perm),
                scheme="affine32")
    m.update_batch([s.encode() for s in shingles(text)])
    return m


def deal(cluster: str, seed: str, heldout_fraction: float) -> str:
    """Train or held-out for a *new* cluster: a salted hash, uniform in [0, 1)."""
    u = int(hashlib.sha256(f"{seed}\x1f{cluster}".encode()).hexdigest()[:16], 16) / 2**64
    return "heldout" if u < heldout_fraction else "train"


@dataclass(frozen=True)
class Placement:
    """Where one failure landed. ``new`` is false when it came from the store (never re-dealt)."""

    key: str
    cluster: str
    split: str
    request_hash: str
    new: bool
    matched: tuple[str, ...] = ()  # clusters it near-matched (several only for bridges)


@dataclass
class SplitIndex:
    """Placements of every eval known so far; assigns new failures.

    ``add_existing`` every recorded placement first (from ``eval.created`` events), then ``assign``
    new failures in a deterministic order.
    """

    heldout_fraction: float
    seed: str
    jaccard: float
    num_perm: int = NUM_PERM
    placements: dict[str, Placement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.jaccard <= 1.0:
            raise ValueError(f"cluster jaccard must be in (0, 1], got {self.jaccard}")
        # Candidate search below the acceptance threshold: LSH banding misses true pairs near its
        # threshold (the S-curve), so search at J - 0.2 and confirm each candidate exactly.
        self._lsh = MinHashLSH(threshold=max(0.1, self.jaccard - 0.2), num_perm=self.num_perm)
        self._sigs: dict[str, MinHash] = {}
        self._by_hash: dict[str, str] = {}  # request_hash -> key of its first placement

    def _index(self, key: str, text: str, placement: Placement) -> None:
        self.placements[key] = placement
        self._by_hash.setdefault(placement.request_hash, key)
        sig = signature(text, self.num_perm)
        self._sigs[key] = sig
        self._lsh.insert(key, sig)

    def add_existing(self, key: str, text: str, cluster: str, split: str) -> Placement:
        """Record a placement made by an earlier build. It is never changed."""
        if split not in SPLITS:
            raise ValueError(f"{key}: recorded split {split!r} is not one of {SPLITS}")
        if key in self.placements:
            return self.placements[key]
        p = Placement(key, cluster, split, request_hash(text), new=False)
        self._index(key, text, p)
        return p

    def near(self, text: str) -> list[tuple[float, str]]:
        """Placed keys whose estimated Jaccard with ``text`` is >= the threshold, best first."""
        if not self._sigs:
            return []
        sig = signature(text, self.num_perm)
        hits = []
        for key in self._lsh.query(sig):
            j = sig.jaccard(self._sigs[key])
            if j >= self.jaccard:
                hits.append((j, key))
        hits.sort(key=lambda h: (-h[0], h[1]))
        return hits

    def assign(self, key: str, text: str) -> Placement:
        """Place ``key`` (a failure id) whose request text is ``text``; idempotent per key."""
        if key in self.placements:
            return self.placements[key]
        h = request_hash(text)
        if h in self._by_hash:
            twin = self.placements[self._by_hash[h]]
            p = Placement(key, twin.cluster, twin.split, h, new=True, matched=(twin.cluster,))
            self._index(key, text, p)
            return p
        hits = self.near(text)
        clusters: dict[str, str] = {}
        for _, k in hits:  # best first: the first cluster seen is the closest one
            clusters.setdefault(self.placements[k].cluster, self.placements[k].split)
        sides = set(clusters.values())
        if not clusters:
            cluster = f"c-{h[:16]}"
            p = Placement(key, cluster, deal(cluster, self.seed, self.heldout_fraction), h, new=True)
        elif len(sides - {"excluded"}) > 1 or sides == {"excluded"}:
            # Bridges train and held-out (or is a near-copy of a bridge): belongs to neither.
            p = Placement(key, f"c-{h[:16]}", "excluded", h, new=True, matched=tuple(clusters))
        else:
            side = next(iter(sides - {"excluded"}))
            cluster = next(c for c, s in clusters.items() if s == side)
            if "excluded" in sides:  # also near a bridge: stay out of both suites
                p = Placement(key, f"c-{h[:16]}", "excluded", h, new=True, matched=tuple(clusters))
            else:
                p = Placement(key, cluster, side, h, new=True, matched=tuple(clusters))
        self._index(key, text, p)
        return p
