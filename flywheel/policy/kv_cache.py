"""A decode loop's KV cache that writes each step in place instead of copying the whole cache.

transformers' ``DynamicLayer`` grows by ``torch.cat``: every decode step copies every layer's keys
and values to append one position. For a batch of ``B`` rows at ``L`` positions that is
``2 x layers x B x kv_heads x L x head_dim`` numbers read and written per step, on top of the
weights the step reads: for SmolLM2-135M in float32 (46 KB of keys and values per position), a 64-row
chunk of the gate's suite at ~450 positions copies 1.3 GB per step, more than twice its 540 MB of
weights. Measured (``benchmarks/bench_kv_cache.py``, 2-core AMD EPYC without AVX-512, fp32, greedy, 96 new
tokens): 64 BFCL prompts in one call 363 s with ``DynamicCache``, 224 s written in place (x1.62); an
8-prompt batch x1.02 (its cache is an eighth as wide).

:class:`PreallocatedLayer` keeps each layer's keys and values in buffers with room for the generation
(the prompt's width plus ``max_new_tokens``, at most 256 of them: ``flywheel.policy.hf.KV_HEADROOM``)
and writes each step's position in place; attention reads views of the filled part. Rows are still dropped from the
batch when they finish (``batch_select_indices``: one copy per finishing event, not per step) and a
prompt's cache is still fanned out to its samples (``batch_repeat_interleave``, once). Past the
capacity a buffer doubles, so a wrong estimate costs a copy, never a wrong answer.

Values are those of ``DynamicLayer`` bit for bit: the same numbers reach the same attention kernel
(``tests/unit/test_kv_cache.py`` pins greedy answers and log-probabilities against it).

Only for models whose own cache is one plain ``DynamicLayer`` per block (:func:`supports_preallocated`):
sliding-window and linear-attention layers keep transformers' own classes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in buffers of ``capacity`` positions, written in place.

    ``self.keys`` / ``self.values`` are always views of the filled part (``[B, kv_heads, length, head_dim]``),
    so everything that reads a ``DynamicLayer`` reads this one alike.
    """

    def __init__(self, capacity: int = 0, max_capacity: int | None = None) -> None:
        super().__init__()
        self.capacity = max(int(capacity), 0)
        # growth stops at the longest the generation can get (prompt + every new token allowed)
        self.max_capacity = max_capacity
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def _views(self) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        old = 0 if self._kbuf is None else self._kbuf.shape[-2]
        cap = max(need, self.capacity, 2 * old)
        if self.max_capacity is not None:
            cap = max(need, min(cap, self.max_capacity))
        b = key_states.shape[0]
        kbuf = key_states.new_empty((b, key_states.shape[1], cap, key_states.shape[-1]))
        vbuf = value_states.new_empty((b, value_states.shape[1], cap, value_states.shape[-1]))
        if self._len:
            assert self._kbuf is not None and self._vbuf is not None
            kbuf[:, :, : self._len].copy_(self._kbuf[:, :, : self._len])
            vbuf[:, :, : self._len].copy_(self._vbuf[:, :, : self._len])
        self._kbuf, self._vbuf = kbuf, vbuf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.device, self.dtype = key_states.device, key_states.dtype
            self.is_initialized = True
        if self._kbuf is not None and key_states.shape[0] != self._kbuf.shape[0]:
            raise ValueError(f"kv cache: {key_states.shape[0]} rows given to a cache of {self._kbuf.shape[0]}")
        end = self._len + key_states.shape[-2]
        if self._kbuf is None or end > self._kbuf.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[:, :, self._len : end].copy_(key_states)
        self._vbuf[:, :, self._len : end].copy_(value_states)
        self._len = end
        self._views()
        return self._kbuf[:, :, :end], self._vbuf[:, :, :end]  # the views just set as keys / values

    def get_seq_length(self) -> int:
        return self._len

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (got {tokens_to_remove})")
        if tokens_to_remove and self._kbuf is not None:
            self._len = max(self._len + tokens_to_remove, 0)
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._kbuf is not None and repeats != 1:
            self._kbuf = self._kbuf.repeat_interleave(repeats, dim=0)
            self._vbuf = self._vbuf.repeat_interleave(repeats, dim=0)  # type: ignore[union-attr]
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._kbuf is not None:
            self._kbuf = self._kbuf.index_select(0, indices.to(self._kbuf.device))
            self._vbuf = self._vbuf.index_select(0, indices.to(self._kbuf.device))  # type: ignore[union-attr]
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


def supports_preallocated(model: Any) -> bool:
    """Whether ``model``'s own cache would be plain ``DynamicLayer`` s only (full attention everywhere).
    Builds the empty cache transformers would (layer objects, no tensors: microseconds)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # an unusual config: keep transformers' own cache
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def preallocated_cache(capacity: int, max_capacity: int | None = None) -> DynamicCache:
    """An empty cache whose layers (created as the model reaches them) hold ``capacity`` positions each,
    growing up to ``max_capacity`` (or past it, by exactly what an update needs)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(  # type: ignore[assignment]
        PreallocatedLayer, capacity, max_capacity)
    return cache


def is_croppable_plain(layer: Any) -> bool:
    """A full-attention layer whose prefix can be cropped and reused (not a sliding window)."""
    return type(layer) in (DynamicLayer, PreallocatedLayer)
