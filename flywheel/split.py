"""Stable train / held-out split of production traffic by request cluster.

A model must never be gated on a near-copy of what it trained on, so traffic is split by *cluster*,
not item by item: near-identical requests share a cluster and a cluster lives on one side only.
Failures and successes are placed by the same index, so a held-out cluster holds both: the held-out
suite measures the fix rate (failures) and the keep rate (successes) of a challenger.

What a request is clustered on: **what varies between an agent's requests**, not what they share.
A production agent sends the same long system prompt and tool list with every request; clustered on
that text, every request of the agent looks alike (a 1,400-character system prompt and 68 distinct
travel questions made one cluster, hence an empty held-out suite). So:

- the **text** (:func:`request_text`) is the user turns only, normalised (NFKC, casefolded, every
  run of non-alphanumerics collapsed to one space); the system prompt and the assistant and tool
  turns are left out. A request with no user text falls back to its system text;
- the **tool names** (:func:`tool_names`) are a separate feature: two requests can share a cluster
  only if their offered tool-name sets overlap (Jaccard >= :data:`TOOL_JACCARD`), or neither offers
  tools. The same question put to two different agents is two requests.

How a request is placed (:meth:`SplitIndex.assign`):

1. **Exact match**: the SHA-256 of the text and the sorted tool names (``request_hash``) equal to a
   placed request's -> the same cluster.
2. **Near match**: MinHash (128 permutations over character 5-grams, datasketch) with LSH candidate
   search at a *lower* threshold than ``cluster_jaccard`` (recall first), then every candidate is
   confirmed by its estimated Jaccard >= ``cluster_jaccard`` and by its tool names. Character
   5-grams rather than word shingles because production requests are short ("Weather in Oslo?" has
   3 words but 12 5-grams).
3. No match -> a **new cluster**, named ``c-<request_hash[:16]>`` after its founding member, dealt
   to held-out when ``sha256(split_seed, cluster) / 2**64 < heldout_fraction``, else train. The deal
   depends only on the cluster name and the seed, never on how much traffic exists or its order.
4. Near matches on **both** sides (a request that bridges a train and a held-out cluster) -> split
   ``"excluded"``: it is in neither suite, because whichever side took it would hold a near-copy of
   the other side. It founds its own cluster; later near-copies of it are excluded too.

Guarantees
- Once placed, a request's split and cluster never change: the placement is recorded in its
  ``eval.created`` event and :meth:`SplitIndex.add_existing` reloads it on every build (placements
  recorded under an earlier :data:`REQUEST_TEXT_VERSION` keep their side; only new requests are
  compared with the current text).
- Within one build, requests are placed in a deterministic order (the caller sorts them), so the
  same inputs always give the same placements.
- Train and held-out never share a cluster, and no new request joins a side whose other side it
  near-matches (rule 4).

Not guaranteed
- Near matches are estimated: two requests whose true 5-gram Jaccard is within ~0.1 of the
  threshold may or may not be joined (MinHash standard error with 128 permutations is about
  ``sqrt(J(1-J)/128)`` ~ 0.04 at J = 0.7).
- Clusters do not merge retroactively: if A and C were placed apart and a later B is close to both,
  A and C stay where they were (B is then excluded when they are on different sides).
- Semantic paraphrases with little surface overlap are not detected (no embeddings here), and
  requests that differ only in their system prompt (a per-user templated system prompt) are treated
  as one request: over-clustering, which can only shrink the held-out side, never leak into it.
- The held-out share is ``heldout_fraction`` in expectation over clusters; a handful of large
  clusters makes it lumpy.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from datasketch import MinHash, MinHashLSH

from flywheel.vocab.ids import digest, short_id
from flywheel.vocab.kinds import SPLITS
from flywheel.vocab.messages import text_of
from flywheel.vocab.text import request_words
from flywheel.vocab.tools import tool_name

#: Bump when :func:`request_text` changes. Placements already recorded keep their split regardless.
#: 1: system + user turns + tool names in one text; 2: user turns only, tool names a separate feature.
REQUEST_TEXT_VERSION = 2
NUM_PERM = 128
SHINGLE = 5
#: Two requests can share a cluster only when their tool-name sets overlap at least this much
#: (Jaccard), or neither offers tools: the same words put to a different agent are another request.
TOOL_JACCARD = 0.5

#: NFKC, casefold, non-alphanumeric runs -> one space (:func:`flywheel.vocab.text.request_words`).
normalise = request_words


def _content_text(content: Any) -> str:
    # Frozen by the request hashes in eval.created events: parts joined with " ", and the text of
    # every object part as a string (a part without text adds "", a number adds "5").
    return text_of(content, sep=" ", nonstring_text="stringify")


def request_text(messages: Iterable[dict], tools: Iterable[dict] | None = None) -> str:
    """The normalised text a request is clustered on: its user turns (see the module docstring).

    ``tools`` is accepted for symmetry with :func:`request_hash` callers and ignored: tool names are
    a separate feature (:func:`tool_names`), never part of the shingled text.
    """
    msgs = [m for m in messages if isinstance(m, dict)]
    user = [_content_text(m.get("content")) for m in msgs if m.get("role") == "user"]
    text = normalise(" ".join(user))
    if not text:  # a request with no user text: its system text is all that varies
        text = normalise(" ".join(_content_text(m.get("content")) for m in msgs if m.get("role") == "system"))
    return text


def tool_names(tools: Iterable[dict] | None) -> tuple[str, ...]:
    """Sorted, normalised names of the offered tools."""
    return tuple(sorted({normalise(tool_name(t)) for t in (tools or [])} - {""}))


def request_key(messages: Iterable[dict], tools: Iterable[dict] | None = None) -> tuple[str, tuple[str, ...]]:
    """``(request_text, tool_names)``: what :meth:`SplitIndex.assign` places."""
    msgs = list(messages)
    return request_text(msgs), tool_names(tools)


def request_hash(text: str, tools: tuple[str, ...] = ()) -> str:
    """SHA-256 of the request text and its tool names (exact-duplicate key)."""
    body = text if not tools else text + "\x1f" + "\x1f".join(tools)
    return digest(body)


def _tools_compatible(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    if not a and not b:
        return True
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) >= TOOL_JACCARD


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
    u = int(short_id(f"{seed}\x1f{cluster}"), 16) / 2**64
    return "heldout" if u < heldout_fraction else "train"


@dataclass(frozen=True)
class Placement:
    """Where one request landed. ``new`` is false when it came from the store (never re-dealt)."""

    key: str
    cluster: str
    split: str
    request_hash: str
    new: bool
    matched: tuple[str, ...] = ()  # clusters it near-matched (several only for bridges)


@dataclass
class SplitIndex:
    """Placements of every request known so far; assigns new ones.

    ``add_existing`` every recorded placement first (from ``eval.created`` events), then ``assign``
    new requests (failures and successes alike) in a deterministic order.
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
        self._tools: dict[str, tuple[str, ...]] = {}
        self._by_hash: dict[str, str] = {}  # request_hash -> key of its first placement

    def _index(self, key: str, text: str, tools: tuple[str, ...], placement: Placement) -> None:
        self.placements[key] = placement
        self._by_hash.setdefault(placement.request_hash, key)
        sig = signature(text, self.num_perm)
        self._sigs[key] = sig
        self._tools[key] = tools
        self._lsh.insert(key, sig)

    def add_existing(self, key: str, text: str, cluster: str, split: str, tools: tuple[str, ...] = ()) -> Placement:
        """Record a placement made by an earlier build. It is never changed."""
        if split not in SPLITS:
            raise ValueError(f"{key}: recorded split {split!r} is not one of {SPLITS}")
        if key in self.placements:
            return self.placements[key]
        p = Placement(key, cluster, split, request_hash(text, tools), new=False)
        self._index(key, text, tools, p)
        return p

    def near(self, text: str, tools: tuple[str, ...] = ()) -> list[tuple[float, str]]:
        """Placed keys whose estimated Jaccard with ``text`` is >= the threshold and whose tool names
        are compatible (:data:`TOOL_JACCARD`), best first."""
        if not self._sigs:
            return []
        sig = signature(text, self.num_perm)
        hits = []
        for key in self._lsh.query(sig):
            j = sig.jaccard(self._sigs[key])
            if j >= self.jaccard and _tools_compatible(tools, self._tools[key]):
                hits.append((j, key))
        hits.sort(key=lambda h: (-h[0], h[1]))
        return hits

    def assign(self, key: str, text: str, tools: tuple[str, ...] = ()) -> Placement:
        """Place ``key`` (a failure or trace id) whose request is ``text`` offering ``tools``
        (:func:`request_key`); idempotent per key."""
        if key in self.placements:
            return self.placements[key]
        h = request_hash(text, tools)
        if h in self._by_hash:
            twin = self.placements[self._by_hash[h]]
            p = Placement(key, twin.cluster, twin.split, h, new=True, matched=(twin.cluster,))
            self._index(key, text, tools, p)
            return p
        hits = self.near(text, tools)
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
        self._index(key, text, tools, p)
        return p
