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
- the **tool names** (:func:`normalised_tool_names`) are a separate feature: two requests can share a
  cluster only if their offered tool-name sets overlap (Jaccard >= :data:`TOOL_JACCARD`), or neither
  offers tools. The same question put to two different agents is two requests.

How a request is placed (:meth:`SplitIndex.assign`):

1. **Exact match**: the SHA-256 of the text and the sorted tool names (``request_hash``) equal to a
   placed request's -> the same cluster.
2. **Near match**: the project's near-duplicate engine (:class:`flywheel.dedup.GrowingNearDupIndex`,
   in character mode: MinHash, 128 permutations over character 5-grams, banded LSH) proposes
   candidates, and every candidate is confirmed by the **exact** Jaccard of the two 5-gram sets
   >= ``cluster_jaccard`` and by its tool names. Character 5-grams rather than word shingles because
   production requests are short ("Weather in Oslo?" has 3 words but 12 5-grams).
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
- Candidates come from LSH (32 bands of 4 rows): a pair at exactly the threshold (J = 0.7) is proposed
  with probability 1 - (1 - 0.7**4)**32 = 0.9998, at J = 0.8 with 1 - 1e-9; a missed pair is treated
  as not near. Shingles are 32-bit hashes: a collision (probability ~2**-32 per pair of distinct
  5-grams) can only raise a Jaccard.
- Placements recorded before the engine confirmed candidates by the exact Jaccard (the earlier
  engine used datasketch's *estimate*, standard error ~0.04 at J = 0.7) keep their side; only new
  requests are placed by the exact rule (``tests/unit/test_split_migration.py`` lists what changed).
- Clusters do not merge retroactively: if A and C were placed apart and a later B is close to both,
  A and C stay where they were (B is then excluded when they are on different sides).
- Semantic paraphrases with little surface overlap are not detected (no embeddings here), and
  requests that differ only in their system prompt (a per-user templated system prompt) are treated
  as one request: over-clustering, which can only shrink the held-out side, never leak into it.
- The held-out share is ``heldout_fraction`` in expectation over clusters; a handful of large
  clusters makes it lumpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from flywheel.dedup import GrowingNearDupIndex
from flywheel.vocab.ids import digest, short_id
from flywheel.vocab.kinds import SPLITS
from flywheel.vocab.messages import request_content_text
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




def request_text(messages: Iterable[dict], tools: Iterable[dict] | None = None) -> str:
    """The normalised text a request is clustered on: its user turns (see the module docstring).

    ``tools`` is accepted for symmetry with :func:`request_hash` callers and ignored: tool names are
    a separate feature (:func:`normalised_tool_names`), never part of the shingled text.
    """
    msgs = [m for m in messages if isinstance(m, dict)]
    user = [request_content_text(m.get("content")) for m in msgs if m.get("role") == "user"]
    text = normalise(" ".join(user))
    if not text:  # a request with no user text: its system text is all that varies
        text = normalise(" ".join(request_content_text(m.get("content")) for m in msgs if m.get("role") == "system"))
    return text


def normalised_tool_names(tools: Iterable[dict] | None) -> tuple[str, ...]:
    """The request's tool feature: the offered tools' names, normalised like the text (:data:`normalise`),
    deduplicated and sorted (not :func:`flywheel.vocab.tools.tool_names`, the names as offered)."""
    return tuple(sorted({normalise(tool_name(t)) for t in (tools or [])} - {""}))


def request_key(messages: Iterable[dict], tools: Iterable[dict] | None = None) -> tuple[str, tuple[str, ...]]:
    """``(request_text, normalised_tool_names)``: what :meth:`SplitIndex.assign` places."""
    msgs = list(messages)
    return request_text(msgs), normalised_tool_names(tools)


def request_hash(text: str, tools: tuple[str, ...] = ()) -> str:
    """SHA-256 of the request text and its tool names (exact-duplicate key)."""
    body = text if not tools else text + "\x1f" + "\x1f".join(tools)
    return digest(body)


def _tools_compatible(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    if not a and not b:
        return True
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) >= TOOL_JACCARD


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
        # Placing requests one by one stays linear: the recorded placements are indexed in bulk, the
        # requests placed since one by one (GrowingNearDupIndex's two tiers).
        self._near_index = GrowingNearDupIndex(self.jaccard, num_perm=self.num_perm, shingle="char", k=SHINGLE)
        self._tools: dict[str, tuple[str, ...]] = {}
        self._by_hash: dict[str, str] = {}  # request_hash -> key of its first placement

    def _index(self, key: str, text: str, tools: tuple[str, ...], placement: Placement, *, bulk: bool,
               hashed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.placements[key] = placement
        self._by_hash.setdefault(placement.request_hash, key)
        self._tools[key] = tools
        self._near_index.add(key, text, bulk=bulk, hashed=hashed)

    def add_existing(self, key: str, text: str, cluster: str, split: str, tools: tuple[str, ...] = ()) -> Placement:
        """Record a placement made by an earlier build. It is never changed."""
        if split not in SPLITS:
            raise ValueError(f"{key}: recorded split {split!r} is not one of {SPLITS}")
        if key in self.placements:
            return self.placements[key]
        p = Placement(key, cluster, split, request_hash(text, tools), new=False)
        self._index(key, text, tools, p, bulk=True)
        return p

    def near(self, text: str, tools: tuple[str, ...] = ()) -> list[tuple[float, str]]:
        """Placed keys whose exact 5-gram Jaccard with ``text`` is >= the threshold and whose tool
        names are compatible (:data:`TOOL_JACCARD`), best first (ties by key)."""
        return self._near(self._near_index.hash(text), tools)

    def _near(self, hashed: tuple[np.ndarray, np.ndarray, np.ndarray], tools: tuple[str, ...]) -> list[tuple[float, str]]:
        hits = [(m.jaccard, m.key) for m in self._near_index.query_hashed(hashed)
                if _tools_compatible(tools, self._tools[m.key])]
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
            self._index(key, text, tools, p, bulk=False)
            return p
        hashed = self._near_index.hash(text)
        hits = self._near(hashed, tools)
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
        self._index(key, text, tools, p, bulk=False, hashed=hashed)
        return p
