"""The KV cache of prompt prefixes kept across generate calls (``policy.prefix_cache_mb``, hf backend).

Agents send the same long system prompt and tool list with every request, and each turn of a
conversation repeats every turn before it. Within one generate call the part every prompt shares is
already encoded once (:mod:`flywheel.policy.hf`); this cache carries it *across* calls: requests that
reach ``flywheel serve`` one at a time, the next turn of a conversation, the next chunk of the gate's
suite. It keeps the keys and values of recently encoded prompt prefixes, and for a new prompt returns
those of its longest common prefix with any of them, cropped to that length; only the rest is encoded.

Why it is exact: a causal model's keys and values at position ``i`` depend only on tokens ``0..i``
and the weights. So entries are tagged with the weights they were computed with, and a tag that no
longer matches never hits:
- :meth:`PrefixKVCache.sync` empties the cache when the model object changes, when any parameter was
  written in place, re-allocated or cast (each parameter's version counter, storage and dtype: an
  optimizer step, ``copy_``, ``model.to(dtype)``), or when the policy says its weights changed (``HFPolicy`` bumps a counter on every adapter load, unload,
  merge and weight copy);
- each entry also carries the adapter it was computed with and whether that adapter was merged, so
  the views of one model (``flywheel serve``'s runtime adapters) keep their own entries side by side.
Encoded alone or as part of a longer prompt, a prefix's values differ by floating-point summation
order only (as with the in-call sharing): greedy answers are those of encoding every prompt whole
(tests/unit/test_prefix_cache.py).

Only models whose cache is one plain full-attention layer per block (Llama, Qwen, SmolLM2, Mistral
without a sliding window, ...): a sliding-window layer drops old tokens and cannot be cropped, so such
models run without this cache (:meth:`PrefixKVCache.store` turns it off on first sight).

Memory: at most ``max_bytes`` of keys and values (SmolLM2-135M in float32: 46 KB per token, so the
default 256 MB holds ~5,700 tokens). A prefix of a stored entry is not stored again; an entry that a
new one extends is replaced by it; past the budget the least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: A reused prefix shorter than this is not worth a lookup (the in-call sharing uses the same floor).
MIN_REUSE_TOKENS = 16


@dataclass
class _Entry:
    tag: tuple[Any, ...]  # (adapter, merged) the keys and values were computed with
    tokens: Any  # int64 tensor [L]
    kv: list[tuple[Any, Any]]  # per layer: keys and values [1, kv_heads, L, head_dim]
    nbytes: int


class PrefixKVCache:
    """Keys and values of prompt prefixes, reused across generate calls (see the module docstring).

    Not thread-safe on its own: ``HFPolicy`` calls it under the model's lock.
    """

    def __init__(self, max_bytes: int, *, min_tokens: int = MIN_REUSE_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes (got {max_bytes})")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.enabled = max_bytes > 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._state: tuple[Any, ...] | None = None
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.tokens_reused = 0  # prompt tokens not encoded thanks to a hit, since the cache was made
        self.clears = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        if self._entries:
            self.clears += 1
        self._entries.clear()
        self.bytes = 0

    def sync(self, model: Any, weights_epoch: int) -> None:
        """Empty the cache if ``model``'s weights may differ from those its entries were computed with."""
        # Each parameter's storage, dtype and in-place version: a step, a copy_, a cast or a replaced tensor
        # changes one of them (writes through ``.data`` do not bump the version: HFPolicy bumps the epoch)
        params = hash(tuple((p.data_ptr(), p.dtype, int(getattr(p, "_version", 0))) for p in model.parameters()))
        state = (id(model), weights_epoch, params)
        if state != self._state:
            self.clear()
            self._state = state

    def lookup(self, tokens: list[int], limit: int, tag: tuple[Any, ...]) -> tuple[int, list[tuple[Any, Any]]] | None:
        """The longest common prefix (at most ``limit`` tokens, at least ``min_tokens``) of ``tokens``
        with an entry computed under ``tag``: its length and per-layer ``(keys, values)`` views cropped
        to it. ``None`` when no entry shares enough."""
        import torch

        if not self.enabled or not self._entries or limit < self.min_tokens:
            return None
        self.lookups += 1
        want = torch.tensor(tokens[:limit], dtype=torch.long)
        best, best_len = -1, 0
        for key, e in self._entries.items():
            if e.tag != tag:
                continue
            m = min(int(e.tokens.numel()), int(want.numel()))
            if m <= best_len:
                continue
            diff = torch.nonzero(e.tokens[:m] != want[:m])
            n = int(diff[0, 0]) if diff.numel() else m
            if n > best_len:
                best, best_len = key, n
        if best < 0 or best_len < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.tokens_reused += best_len
        kv = self._entries[best].kv
        return best_len, [(k[:, :, :best_len], v[:, :, :best_len]) for k, v in kv]

    def store(self, tokens: list[int], cache: Any, tag: tuple[Any, ...]) -> bool:
        """Keep ``cache`` (a batch-1 cache of exactly ``tokens``) for later calls. Returns whether it was
        stored: not when the cache is off or not croppable, when ``tokens`` is short, already covered by
        an entry, or larger than the whole budget."""
        import torch

        from flywheel.policy.kv_cache import is_croppable_plain

        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        layers = getattr(cache, "layers", None)
        if not layers or not all(is_croppable_plain(layer) for layer in layers):
            self.enabled = False  # sliding windows or another cache kind: a crop would be wrong
            self.clear()
            return False
        kv = [(layer.keys, layer.values) for layer in layers]
        if any(k is None or k.shape[0] != 1 or k.shape[-2] != len(tokens) for k, _ in kv):
            raise ValueError(f"prefix cache: expected a batch-1 cache of {len(tokens)} tokens")
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return False  # before anything is evicted for it
        new = torch.tensor(tokens, dtype=torch.long)
        for key, e in list(self._entries.items()):
            if e.tag != tag:
                continue
            n_old = int(e.tokens.numel())
            if n_old >= len(tokens) and torch.equal(e.tokens[: len(tokens)], new):
                self._entries.move_to_end(key)
                return False  # covered: a stored entry starts with these tokens
            if n_old < len(tokens) and torch.equal(new[:n_old], e.tokens):
                self.bytes -= e.nbytes  # extended by the new entry
                del self._entries[key]
        while self._entries and self.bytes + nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
        # Own copies: the caller's cache goes on decoding (a preallocated layer writes into the buffer its
        # views point at) and may hold room for far more positions than these.
        kv = [(k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format))
              for k, v in kv]
        self._entries[self._next_id] = _Entry(tag=tag, tokens=new, kv=kv, nbytes=nbytes)
        self._next_id += 1
        self.bytes += nbytes
        return True

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.bytes, "lookups": self.lookups, "hits": self.hits,
                "tokens_reused": self.tokens_reused, "clears": self.clears}
