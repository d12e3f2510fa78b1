"""The train / held-out split: flywheel.split (on flywheel.dedup's character-5-gram engine, exact
Jaccard) vs the earlier engine (datasketch MinHash + MinHashLSH, estimated Jaccard), same requests,
same run.

Workload (what ``flywheel evals build`` does): reload N recorded placements (``add_existing``), then
place M new requests one at a time (``assign``), in order. Requests are the placement fixture of the
migration test (BFCL questions with their tool sets, near-paraphrases, three templated agents) and,
to reach the sizes of a busy production agent, variants of them (each word replaced with probability
0.3 by a word of the fixture's vocabulary: same shape, mostly a different request).

The named peer is the engine the split used before, reproduced below (``DatasketchSplit``: the same
placement rules, datasketch ``MinHash(num_perm=128, seed=1, scheme="affine32")`` over CRC-32 5-gram
hashes, ``MinHashLSH`` at J - 0.2, confirmation by ``MinHash.jaccard``). datasketch is in the ``dev``
extra for this benchmark and ``bench_dedup.py`` only.

Reported: wall seconds of both phases per engine, their ratio, and the share of new requests placed
identically (split and cluster); disagreements are pairs near the threshold (see
``tests/unit/test_split_migration.py``). Run: ``.venv/bin/python benchmarks/bench_split.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import random
import time
import zlib
from pathlib import Path

from flywheel.split import SplitIndex, deal, request_hash

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "split" / "datasketch_placements.json.gz"


class DatasketchSplit:
    """The split index before flywheel.dedup replaced its engine (the benchmark's peer)."""

    def __init__(self, heldout_fraction: float, seed: str, jaccard: float, num_perm: int = 128):
        from datasketch import MinHashLSH

        self.heldout_fraction, self.seed, self.jaccard, self.num_perm = heldout_fraction, seed, jaccard, num_perm
        self.placements: dict[str, tuple[str, str]] = {}
        self._lsh = MinHashLSH(threshold=max(0.1, jaccard - 0.2), num_perm=num_perm)
        self._sigs: dict = {}
        self._tools: dict[str, tuple[str, ...]] = {}
        self._by_hash: dict[str, str] = {}

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _perms(num_perm: int):
        from datasketch import MinHash

        return MinHash(num_perm=num_perm, seed=1, scheme="affine32").permutations

    def _sig(self, text: str):
        from datasketch import MinHash

        m = MinHash(num_perm=self.num_perm, seed=1, hashfunc=zlib.crc32, permutations=self._perms(self.num_perm),
                    scheme="affine32")
        grams = {text} if len(text) <= 5 else {text[i : i + 5] for i in range(len(text) - 4)}
        m.update_batch([g.encode() for g in grams])
        return m

    def _index(self, key, text, tools, placement, h):
        self.placements[key] = placement
        self._by_hash.setdefault(h, key)
        sig = self._sig(text)
        self._sigs[key], self._tools[key] = sig, tools
        self._lsh.insert(key, sig)

    def add_existing(self, key, text, cluster, split, tools=()):
        self._index(key, text, tools, (cluster, split), request_hash(text, tools))

    def _compatible(self, a, b):
        if not a and not b:
            return True
        return len(set(a) & set(b)) / len(set(a) | set(b)) >= 0.5

    def assign(self, key, text, tools=()):
        h = request_hash(text, tools)
        if h in self._by_hash:
            p = self.placements[self._by_hash[h]]
            self._index(key, text, tools, p, h)
            return p
        sig = self._sig(text)
        hits = sorted(((sig.jaccard(self._sigs[k]), k) for k in self._lsh.query(sig)), key=lambda x: (-x[0], x[1]))
        clusters: dict[str, str] = {}
        for j, k in hits:
            if j >= self.jaccard and self._compatible(tools, self._tools[k]):
                clusters.setdefault(*self.placements[k])
        sides = set(clusters.values())
        own = f"c-{h[:16]}"
        if not clusters:
            p = (own, deal(own, self.seed, self.heldout_fraction))
        elif len(sides - {"excluded"}) > 1 or sides == {"excluded"} or "excluded" in sides:
            p = (own, "excluded")
        else:
            side = next(iter(sides))
            p = (next(c for c, s in clusters.items() if s == side), side)
        self._index(key, text, tools, p, h)
        return p


def workload(n_recorded: int, n_new: int) -> tuple[dict, list[dict], list[dict]]:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    base = [r for r in doc["rows"] if not r["key"].startswith("bridge")]
    vocab = sorted({w for r in base for w in r["text"].split()})
    rng = random.Random(0)
    items = list(base)
    while len(items) < n_recorded + n_new:
        src = rng.choice(base)
        words = [rng.choice(vocab) if rng.random() < 0.3 else w for w in src["text"].split()]
        items.append({"key": f"v{len(items)}", "text": " ".join(words), "tool_names": src["tool_names"]})
    rng.shuffle(items)
    return doc, items[:n_recorded], items[n_recorded : n_recorded + n_new]


def run(engine: str, doc: dict, recorded: list[dict], new: list[dict], seed_placements: dict) -> tuple[dict, dict]:
    cls = SplitIndex if engine == "flywheel" else DatasketchSplit
    idx = cls(heldout_fraction=doc["heldout_fraction"], seed=doc["seed"], jaccard=doc["jaccard"])
    t0 = time.perf_counter()
    for r in recorded:
        c, s = seed_placements[r["key"]]
        idx.add_existing(r["key"], r["text"], c, s, tuple(r["tool_names"]))
    t1 = time.perf_counter()
    out = {}
    for r in new:
        p = idx.assign(r["key"], r["text"], tuple(r["tool_names"]))
        out[r["key"]] = (p.cluster, p.split) if engine == "flywheel" else p
    t2 = time.perf_counter()
    return {"reload_s": round(t1 - t0, 2), "place_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2)}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5,000 recorded + 1,000 new (default 20,000 + 5,000)")
    args = ap.parse_args()
    n_rec, n_new = (5_000, 1_000) if args.quick else (20_000, 5_000)
    doc, recorded, new = workload(n_rec, n_new)
    # Recorded placements: as one earlier build would have dealt them (the same for both engines).
    seed_idx = SplitIndex(heldout_fraction=doc["heldout_fraction"], seed=doc["seed"], jaccard=doc["jaccard"])
    seed_placements = {}
    for r in recorded:
        p = seed_idx.assign(r["key"], r["text"], tuple(r["tool_names"]))
        seed_placements[r["key"]] = (p.cluster, p.split)
    print(f"load average {os.getloadavg()[0]:.2f} (2 cores shared: compare the ratio, not the seconds)")
    print(f"{len(recorded)} recorded placements reloaded, {len(new)} new requests placed one by one")
    times, placed = {}, {}
    for engine in ("datasketch", "flywheel"):
        times[engine], placed[engine] = run(engine, doc, recorded, new, seed_placements)
        print(f"  {engine:10s} reload {times[engine]['reload_s']:7.2f} s   place {times[engine]['place_s']:7.2f} s"
              f"   total {times[engine]['total_s']:7.2f} s")
    same = sum(placed["flywheel"][k] == placed["datasketch"][k] for k in placed["flywheel"])
    ratio = times["datasketch"]["total_s"] / max(times["flywheel"]["total_s"], 1e-9)
    print(f"flywheel.split is {ratio:.2f}x datasketch's speed (total); {same}/{len(new)} new requests "
          f"({same / len(new):.1%}) placed identically")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
