"""Hugging Face transformers backend: batched sampling with exact sampler log-probabilities.

Why a hand-written decode loop instead of ``model.generate``:
- ``generate(num_return_sequences=n)`` expands the prompt batch *before* the prefill, so every
  prompt is encoded n times. Here each prompt is encoded once and its KV cache is repeated n times
  (``DynamicCache.batch_repeat_interleave``): for 8 samples of a 500-token BFCL prompt that is 1
  prefill instead of 8.
- Finished rows are dropped from the batch (``batch_select_indices``), so a batch is only as wide
  as its live samples; ``generate`` keeps computing padded rows until the longest one ends.
- The log-probability of each chosen token is taken from the exact distribution it was drawn
  from (float32, temperature-scaled, top-p renormalised), not re-derived afterwards.
- Each sample has its own random stream (seeded from ``(seed, prompt index, sample index)``), so a
  sample does not change when other prompts join or leave the batch, and no global RNG is touched.

Sampler log-probabilities (``Sample.logprobs``):
- ``temperature > 0``: ``log softmax(logits / T)`` restricted to the top-p nucleus and renormalised
  over it, i.e. the log-probability under the distribution actually sampled from.
- ``temperature == 0`` (greedy, the argmax is taken): the log-probability under the untempered
  model distribution ``log softmax(logits)``; a point mass would carry no information.

Batching: prompts are sorted by length and cut into chunks of at most ``max_batch_rows`` rows
(prompts x n), left-padded; results come back in the caller's order. The prompt prefix every prompt of
a chunk shares (at least :data:`PREFIX_MIN_TOKENS` tokens: an agent's system prompt and tool list sent
with every request, the tool instructions of the BFCL format) is encoded once and its KV cache repeated
to the rows; each row's own tail is left-padded after it (``[prefix | pad | tail]``, the padding masked,
positions counting real tokens only). ``flywheel serve`` merges concurrent requests into one call, the
gate and rollouts pass whole suites, so each batch pays for the shared part once. Across calls, the
keys and values of recent prompt prefixes are kept (``policy.prefix_cache_mb``,
:mod:`flywheel.policy.prefix_cache`): a request that arrives alone, the next turn of a conversation or
the next chunk of a suite encodes only what its longest common prefix with an earlier prompt does not
cover.

Not guaranteed: bit-identical samples across devices, dtypes, or batch shapes (padding changes the
floating-point summation order by ~1e-6 in fp32, which can flip a near-tie); thread-parallel
generation (calls on one model are serialised by a lock).
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.policy.base import PromptTooLongError, Sample, SamplingParams, coerce_params, per_prompt_tools
from flywheel.policy.format import render_prompt
from flywheel.policy.models import ModelLoadError, attach_adapter, load_model
from flywheel.policy.prefix_cache import PrefixKVCache
from flywheel.policy.threads import DecodeThreads, check_decode_threads

if TYPE_CHECKING:
    from flywheel.config import PolicyConfig

# End-of-turn tokens of common chat templates; any that exist in the vocabulary stop a sample.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive row indices over seeds


@dataclass
class _Shared:
    """State shared by a policy and its adapter views: one model, one lock."""

    model: Any
    tokenizer: Any
    device: Any
    lock: threading.RLock = field(default_factory=threading.RLock)
    decode: DecodeThreads | None = None  # the decode loop's thread chooser, kept across calls (policy.decode_threads)
    prefix_cache: PrefixKVCache | None = None  # prompt prefixes' keys and values across calls (policy.prefix_cache_mb)
    weights_epoch: int = 0  # bumped on every adapter load/unload/merge and weight copy: the prefix cache's entries expire


#: A shared prompt prefix shorter than this is encoded with each row (one more model call is not worth it).
PREFIX_MIN_TOKENS = 16

#: New-token positions the decode loop's keys and values get room for up front (flywheel.policy.kv_cache).
KV_HEADROOM = 256

#: ``policy.prefix_cache_mb``'s default: the keys and values of ~5,700 prompt tokens of SmolLM2-135M in float32.
PREFIX_CACHE_MB = 256


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each prompt at least one token of its own (the row's
    last prompt token must be computed in its own row to give that row's first logits)."""
    if not prompts:
        return 0
    first = prompts[0]
    n = min(len(x) for x in prompts) - 1
    k = 0
    while k < n and all(x[k] == first[k] for x in prompts):
        k += 1
    return max(k, 0)


def should_merge(merge: str, dtype: Any) -> bool:
    """``policy.merge_adapters`` for weights of ``dtype``: always, never, or auto (float32 only)."""
    import torch

    if merge not in ("auto", "always", "never"):
        raise ValueError(f"merge must be auto, always or never (got {merge!r})")
    return merge == "always" or (merge == "auto" and dtype == torch.float32)


class HFPolicy:
    """A policy backed by an in-process transformers causal LM (CPU or CUDA).

    ``adapter``: name of the LoRA adapter this policy samples with (``None`` = the base weights,
    adapters disabled). Views created with :meth:`adapter_view` share the model and its lock.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: Any = None,
        name: str = "policy",
        version: str = "0",
        adapter: str | None = None,
        max_batch_rows: int = 64,
        decode_threads: str | int = "auto",
        prefix_cache_mb: int = PREFIX_CACHE_MB,
        _shared: _Shared | None = None,
    ) -> None:
        if _shared is None:
            if device is None:
                device = next(model.parameters()).device
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            _shared = _Shared(model=model, tokenizer=tokenizer, device=device,
                              prefix_cache=PrefixKVCache(int(prefix_cache_mb) << 20))
        self._shared = _shared
        self.name = name
        self.version = version
        self.adapter = adapter
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1 (got {max_batch_rows})")
        self.max_batch_rows = max_batch_rows
        self._eos_ids = self._end_ids()
        # Encode the prompt prefix a batch's rows share once, and reuse the prefixes of earlier calls
        # (policy.prefix_cache_mb; see _generate_chunk); a switch for A/B checks that turns off both.
        self.prefix_sharing = True
        # Decode-loop keys and values written in place instead of re-concatenated every step
        # (flywheel.policy.kv_cache); a switch for A/B checks.
        self.preallocate_kv = True
        self.prefix_tokens_saved = 0  # prompt tokens not encoded thanks to it, since this policy was made
        # Intra-op threads of decode steps (policy.decode_threads): "auto" times the steps under the
        # process's count and 1 and keeps the faster (flywheel.policy.threads), or a fixed count.
        check_decode_threads(decode_threads)
        self.decode_threads: str | int = decode_threads
        self.decode_thread_steps: dict[int, int] = {}  # thread count -> decode steps run with it, summed

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, policy: PolicyConfig, spec: str, home: Path, **kw: Any) -> HFPolicy:
        """:meth:`from_spec` with the ``[policy]`` section's device, dtype, adapter merging and decode
        threads, so every loader (gate, serve, rollouts, evaluate, synth) runs the model alike."""
        return cls.from_spec(spec, home, device=policy.device, dtype=policy.dtype, merge=policy.merge_adapters,
                             decode_threads=policy.decode_threads, prefix_cache_mb=policy.prefix_cache_mb, **kw)

    @classmethod
    def from_spec(
        cls,
        spec: str,
        home: Path,
        adapter: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        name: str | None = None,
        version: str | None = None,
        max_batch_rows: int = 64,
        merge: str = "never",
        decode_threads: str | int = "auto",
        prefix_cache_mb: int = PREFIX_CACHE_MB,
    ) -> HFPolicy:
        """Load ``spec`` with :func:`flywheel.policy.models.load_model` and wrap it.

        ``name`` defaults to the spec; ``version`` to ``"base"`` or ``"adapter:<dir name>"``.
        ``merge`` (``policy.merge_adapters``: auto / always / never): fold the adapter into the base
        weights after loading (:meth:`merge_adapter`); ``auto`` folds only float32 weights.
        """
        model, tok = load_model(spec, home=Path(home), device=device, dtype=dtype, adapter=adapter)
        policy = cls(
            model,
            tok,
            name=name or str(spec),
            version=version or ("base" if adapter is None else f"adapter:{Path(adapter).name}"),
            adapter="default" if adapter is not None else None,
            max_batch_rows=max_batch_rows,
            decode_threads=decode_threads,
            prefix_cache_mb=prefix_cache_mb,
        )
        if adapter is not None and should_merge(merge, next(model.parameters()).dtype):
            policy.merge_adapter()
        return policy

    @property
    def model(self) -> Any:
        return self._shared.model

    @property
    def tokenizer(self) -> Any:
        return self._shared.tokenizer

    @property
    def device(self) -> Any:
        return self._shared.device

    def _end_ids(self) -> set[int]:
        tok = self.tokenizer
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        vocab = tok.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return ids

    # ------------------------------------------------------------------ adapters and weights
    def load_adapter(self, path: str | Path, name: str = "default", *, activate: bool = True) -> None:
        """Load (or reload) the peft LoRA adapter at ``path`` as ``name``. With ``activate`` this
        policy samples with it from the next call on; other views keep their own adapter.

        A load that fails raises :class:`ModelLoadError` and leaves the model as it was, except that
        a reloaded ``name`` is gone (load under a new name to keep the old one until the new one is
        in, as ``flywheel serve`` does)."""
        with self._shared.lock:
            self._shared.weights_epoch += 1
            self._shared.model = attach_adapter(self._shared.model, path, name=name)
            self._shared.model.eval()
            self._shared.model.to(self.device)
            if activate:
                self.adapter = name

    def adapter_view(self, name: str, *, version: str | None = None) -> HFPolicy:
        """A policy sharing this model that samples with the loaded adapter ``name``."""
        if name not in self.adapter_names():
            raise ModelLoadError(f"adapter {name!r} is not loaded (loaded: {sorted(self.adapter_names())})")
        return HFPolicy(
            None, None, name=name, version=version or f"adapter:{name}", adapter=name,
            max_batch_rows=self.max_batch_rows, decode_threads=self.decode_threads, _shared=self._shared,
        )

    def merge_adapter(self) -> None:
        """Fold this policy's active LoRA adapter into the base weights (``W <- W + s * B @ A``).

        A merged LoRA layer runs its base layer alone, so a forward costs what the base model's does:
        measured on a 2-core CPU without native bf16 (SmolLM2-135M, fp32), the gate's greedy answers
        with the adapter unmerged took about twice the base model's time per item (issue 32). In
        float32 the fold is exact to fp32 rounding (tests/unit/test_policy_merge.py: identical greedy
        answers); in bf16 it rounds ``W + s*BA`` to bf16 and changes answers, which is why
        ``policy.merge_adapters = "auto"`` folds only float32 weights.

        The adapter stays loaded (peft's ``merge_adapter``, not ``merge_and_unload``): switching to
        another adapter or to the base (``adapter=None``) un-merges first, as peft does, so views and
        ``flywheel serve``'s runtime adapters keep their meaning (each applies to the base alone).
        """
        import torch

        with self._shared.lock, torch.no_grad():
            model = self.model
            if self.adapter is None or self.adapter not in (getattr(model, "peft_config", None) or {}):
                raise ModelLoadError(f"policy {self.name!r}: no active adapter to merge")
            if getattr(model, "active_adapter", None) != self.adapter:
                model.set_adapter(self.adapter)
            self._shared.weights_epoch += 1
            model.merge_adapter()

    @property
    def merged(self) -> bool:
        """Whether the active adapter is folded into the base weights (see :meth:`merge_adapter`)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        return any(getattr(m, "merged", False) for m in self.model.modules() if isinstance(m, BaseTunerLayer))

    def adapter_names(self) -> set[str]:
        return set(getattr(self.model, "peft_config", {}) or {})

    def unload_adapter(self, name: str) -> None:
        """Remove adapter ``name``; views that used it fail with ``ModelLoadError`` afterwards."""
        with self._shared.lock:
            if name not in self.adapter_names():
                raise ModelLoadError(f"adapter {name!r} is not loaded")
            self._shared.weights_epoch += 1
            model = self._shared.model
            if len(model.peft_config) == 1:
                # the last adapter: strip the LoRA layers entirely so the base runs at full speed
                self._shared.model = model.unload()
            else:
                model.delete_adapter(name)
            if self.adapter == name:
                self.adapter = None

    def set_weights_from(self, source: Any) -> None:
        """Copy weights from an in-process training model (refresh between training iterations).

        A plain model: every parameter/buffer is copied by name (strict: a missing or extra key
        raises), cast to this policy's dtype and device. A peft model: its active adapter's
        weights are copied into this policy's adapter ``"default"`` (created from the source's
        LoRA config if absent) and this policy samples with it.
        """
        import torch
        from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

        with self._shared.lock, torch.no_grad():
            self._shared.weights_epoch += 1
            if isinstance(source, PeftModel):
                src_name = source.active_adapter
                cfg = copy.deepcopy(source.peft_config[src_name])
                cfg.inference_mode = True
                model = self._shared.model
                if not isinstance(model, PeftModel):
                    model = PeftModel(model, cfg, adapter_name="default")
                elif "default" not in model.peft_config:
                    model.add_adapter("default", cfg)
                if self.merged:  # new adapter weights must not land beside a folded copy of the old ones
                    model.unmerge_adapter()
                state = get_peft_model_state_dict(source, adapter_name=src_name)
                result = set_peft_model_state_dict(model, state, adapter_name="default")
                unexpected = getattr(result, "unexpected_keys", [])
                if unexpected:
                    raise ModelLoadError(f"set_weights_from: adapter keys not in this model: {unexpected[:5]}")
                model.set_adapter("default")
                model.to(self.device)
                model.eval()
                self._shared.model = model
                self.adapter = "default"
                return
            target = self._shared.model
            if isinstance(target, PeftModel):
                target = target.get_base_model()
            src = source.state_dict()
            dst = target.state_dict()
            missing = sorted(set(dst) - set(src))
            extra = sorted(set(src) - set(dst))
            if missing or extra:
                raise ModelLoadError(
                    f"set_weights_from: state dicts differ (missing {missing[:5]}, unexpected {extra[:5]})"
                )
            for k, v in dst.items():
                v.copy_(src[k].to(device=v.device, dtype=v.dtype))

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[list[dict]],
        params: SamplingParams | int | None = None,
        *,
        tools: list[list[dict]] | list[dict] | None = None,
    ) -> list[list[Sample]]:
        """Sample ``params.n`` completions for each chat prompt (see module docstring)."""
        p = coerce_params(params)
        per_tools = per_prompt_tools(tools, len(prompts))
        texts = [render_prompt(self.tokenizer, m, t) for m, t in zip(prompts, per_tools, strict=True)]
        return self.generate_from_text(texts, p)

    def generate_from_text(self, prompt_texts: list[str], params: SamplingParams | int | None = None
                           ) -> list[list[Sample]]:
        """Sample from already-rendered prompt texts (tokenised without adding special tokens)."""
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
        return self.generate_from_ids(ids, params)

    def generate_from_ids(self, prompt_token_ids: list[list[int]], params: SamplingParams | int | None = None
                          ) -> list[list[Sample]]:
        """Sample from token ids (continuing a multi-turn loop exactly where it stands)."""
        import torch

        p = coerce_params(params)
        if not prompt_token_ids:
            return []
        max_pos = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        for i, ids in enumerate(prompt_token_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= max_pos:
                raise PromptTooLongError(i, len(ids), max_pos)
        base_seed = p.seed if p.seed is not None else secrets.randbits(62)  # leaves torch's RNG alone
        order = sorted(range(len(prompt_token_ids)), key=lambda i: len(prompt_token_ids[i]))
        per_chunk = max(1, self.max_batch_rows // p.n)
        results: list[list[Sample] | None] = [None] * len(prompt_token_ids)
        t0 = time.perf_counter()
        with self._shared.lock, torch.inference_mode(), self._adapter_context():
            pc = self._shared.prefix_cache
            reuse = None
            if self.prefix_sharing and pc is not None and pc.enabled:
                pc.sync(self.model, self._shared.weights_epoch)
                names = getattr(self.model, "peft_config", None) or {}
                reuse = (pc, (self.adapter if names else None, self.merged if names else False))
            for start in range(0, len(order), per_chunk):
                idx = order[start : start + per_chunk]
                chunk = self._generate_chunk([prompt_token_ids[i] for i in idx], idx, p, base_seed, t0, max_pos,
                                             reuse)
                for i, samples in zip(idx, chunk, strict=True):
                    results[i] = samples
        return results  # type: ignore[return-value]

    def _adapter_context(self) -> Any:
        import contextlib

        model = self.model
        names = getattr(model, "peft_config", None) or {}
        if self.adapter is None:
            return model.disable_adapter() if names else contextlib.nullcontext()
        if self.adapter not in names:
            raise ModelLoadError(f"policy {self.name!r}: adapter {self.adapter!r} is no longer loaded")
        if getattr(model, "active_adapter", None) != self.adapter:
            # peft's set_adapter un-merges a merged adapter, even the one already active: only switch.
            model.set_adapter(self.adapter)
        return contextlib.nullcontext()

    def _generate_chunk(
        self, prompts: list[list[int]], prompt_idx: list[int], p: SamplingParams, base_seed: int,
        t0: float, max_pos: int, reuse: tuple[PrefixKVCache, tuple[Any, ...]] | None = None,
    ) -> list[list[Sample]]:
        import torch
        from transformers.cache_utils import DynamicCache

        from flywheel.policy.kv_cache import preallocated_cache, supports_preallocated

        dev = self.device
        pad = int(self.tokenizer.pad_token_id)
        n_p, n = len(prompts), p.n
        # The part every prompt of the chunk shares, less each prompt's last token. With the cross-call
        # cache (``reuse``) a lone prompt's whole part before its last token counts: the next turn of its
        # conversation, or the next request with the same system prompt and tools, starts with it.
        shared = shared_prefix_len(prompts) if self.prefix_sharing and (n_p > 1 or reuse is not None) else 0
        if shared < PREFIX_MIN_TOKENS:
            shared = 0
        tails = [ids[shared:] for ids in prompts]
        width = max(len(x) for x in tails)
        # Keys and values written in place, with room for the whole generation (flywheel.policy.kv_cache);
        # None: the model makes its own (sliding windows, linear attention, or policy.preallocate_kv off).
        # Room for up to KV_HEADROOM new tokens: a request may allow thousands and stop after twenty, and the
        # buffers are rows x positions x 46 KB for SmolLM2-135M in fp32. A longer answer doubles them once.
        capacity = shared + width + min(p.max_new_tokens, KV_HEADROOM)
        longest = shared + width + p.max_new_tokens
        new_cache = ((lambda: preallocated_cache(capacity, longest))
                     if self.preallocate_kv and supports_preallocated(self.model) else None)
        prefix_cache = None
        done = 0  # prompt tokens of the chunk's first prompt that came from an earlier call's prefix cache
        if shared:
            # The prompt part every row shares (an agent's system prompt and tool list; the demo's tool
            # instructions) is encoded once and its KV cache fanned out to the rows; what an earlier call
            # encoded of it already comes from the prefix cache.
            hit = reuse[0].lookup(prompts[0], shared, reuse[1]) if reuse is not None else None
            if new_cache is not None:
                prefix_cache = new_cache()
            if hit is not None:
                done, kv = hit
                if prefix_cache is None:
                    prefix_cache = DynamicCache()
                for layer_idx, (k, v) in enumerate(kv):
                    prefix_cache.update(k, v, layer_idx)
            if done < shared:
                out = self.model(input_ids=torch.tensor([prompts[0][done:shared]], dtype=torch.long, device=dev),
                                 use_cache=True, logits_to_keep=1,
                                 **({"cache": prefix_cache} if prefix_cache is not None else {}))
                prefix_cache = out.cache
                if reuse is not None:
                    reuse[0].store(prompts[0][:shared], prefix_cache, reuse[1])
            assert prefix_cache is not None
            if n_p > 1:
                prefix_cache.batch_repeat_interleave(n_p)
            self.prefix_tokens_saved += shared * (n_p - 1) + done
        elif new_cache is not None:
            prefix_cache = new_cache()
        input_ids = torch.full((n_p, width), pad, dtype=torch.long)
        attn = torch.zeros((n_p, shared + width), dtype=torch.long)
        attn[:, :shared] = 1
        for r, ids in enumerate(tails):  # left padding of the tails: every row's last prompt token is aligned
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attn[r, shared + width - len(ids) :] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        # [prefix | pad | tail]: the padding sits between the shared prefix and each row's tail, masked;
        # positions count only real tokens, so every row sees the same positions as without sharing.
        positions = ((attn.cumsum(-1) - 1).clamp(min=0))[:, shared:]
        out = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=1,
            **({"cache": prefix_cache} if prefix_cache is not None else {}),
        )
        cache = out.cache
        logits = out.logits[:, -1, :].float()
        last_pos = positions[:, -1]
        if n > 1:  # encode once, then fan the cache out to n rows per prompt: [a,b] -> [a,a,b,b]
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attn = attn.repeat_interleave(n, dim=0)
            last_pos = last_pos.repeat_interleave(n, dim=0)
        rows = n_p * n
        gens = []
        for r in range(rows):
            g = torch.Generator(device="cpu")
            g.manual_seed((base_seed + _GOLDEN * (prompt_idx[r // n] * n + r % n + 1)) % (1 << 63))
            gens.append(g)
        limits = [min(p.max_new_tokens, max_pos - len(prompts[r // n])) for r in range(rows)]
        toks: list[list[int]] = [[] for _ in range(rows)]
        lps: list[list[float]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        stop_at: list[int | None] = [None] * rows
        scanners = [_StopScanner(self.tokenizer, p.stop) for _ in range(rows)] if p.stop else None
        done_ms = [0.0] * rows
        active = list(range(rows))  # original row ids of the live batch rows, in batch order
        eos = torch.tensor(sorted(self._eos_ids), dtype=torch.long, device=dev)
        setting = self.decode_threads if torch.device(dev).type == "cpu" else 0  # device may be given as a string
        threads = self._shared.decode
        if threads is None or threads.setting != setting:
            threads = self._shared.decode = DecodeThreads(setting)
        threads.start(rows)
        try:
            while True:
                threads.before_step()
                u = torch.tensor([torch.rand(1, generator=gens[r]).item() for r in active], dtype=torch.float32)
                chosen, chosen_lp = _sample(logits, p, u.to(logits.device))
                is_eos = torch.isin(chosen, eos).tolist()
                chosen_l, lp_l = chosen.tolist(), chosen_lp.tolist()
                keep: list[int] = []
                for b, r in enumerate(active):
                    toks[r].append(chosen_l[b])
                    lps[r].append(lp_l[b])
                    if is_eos[b]:
                        finish[r] = "stop"
                    elif scanners is not None and (cut := scanners[r].push(toks[r])) is not None:
                        finish[r], stop_at[r] = "stop", cut
                    elif len(toks[r]) >= limits[r]:
                        finish[r] = "length"
                    if finish[r] is None:
                        keep.append(b)
                    else:
                        done_ms[r] = (time.perf_counter() - t0) * 1000.0
                if not keep:
                    break
                next_tokens = chosen[keep] if len(keep) < len(active) else chosen
                if len(keep) < len(active):  # drop finished rows from cache and masks
                    sel = torch.tensor(keep, dtype=torch.long, device=dev)
                    cache.batch_select_indices(sel)
                    attn, last_pos = attn[sel], last_pos[sel]
                    active = [active[b] for b in keep]
                attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
                last_pos = last_pos + 1
                out = self.model(
                    input_ids=next_tokens[:, None], attention_mask=attn, position_ids=last_pos[:, None],
                    cache=cache, use_cache=True,
                )
                cache = out.cache
                logits = out.logits[:, -1, :].float()
                threads.after_step()
        finally:
            threads.restore()
            for k, v in threads.loop_steps_at.items():
                self.decode_thread_steps[k] = self.decode_thread_steps.get(k, 0) + v
        samples: list[list[Sample]] = []
        for j, ids in enumerate(prompts):
            group = []
            for k in range(n):
                r = j * n + k
                if scanners is not None and stop_at[r] is not None:
                    text = scanners[r].text()[: stop_at[r]]
                else:
                    text = self.tokenizer.decode(toks[r], skip_special_tokens=True)
                group.append(
                    Sample(
                        text=text, prompt_token_ids=list(ids), completion_token_ids=toks[r], logprobs=lps[r],
                        finish_reason=finish[r], truncated=finish[r] == "length", gen_ms=done_ms[r],  # type: ignore[arg-type]
                        # prompt tokens this prompt did not encode itself (OpenAI's usage.prompt_tokens_details.
                        # cached_tokens): what an earlier call left in the prefix cache, or for the chunk's other
                        # prompts the shared part the first one encoded
                        extra={"cached_prompt_tokens": done if j == 0 else shared},
                    )
                )
            samples.append(group)
        return samples



class _StopScanner:
    """Finds stop strings in a growing completion, looking only at its tail.

    Each step decodes only the tokens since the last complete character, with the tokens before
    them as context (the prefix/read offsets of vLLM's incremental detokenizer), and searches
    only the new text plus the ``len(longest stop) - 1`` characters before it: a stop string that
    was not there one step ago must end in the new text. So the work per step does not grow with
    the completion's length (rescanning the whole text for every stop string every step was
    quadratic in the length, times the number of stop strings).

    ``push`` returns the character index in :meth:`text` where the earliest stop string starts.
    Not covered: a completion that decodes to U+FFFD on purpose delays the check until the next
    character completes (the same heuristic as vLLM's: U+FFFD usually means a partial UTF-8 byte
    sequence).
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._decode = tokenizer.decode
        self._stops = stops
        self._keep = max(len(x) for x in stops) - 1
        self._pieces: list[str] = []
        self._tail = ""
        self._len = 0
        self._prefix = 0  # first token of the context decoded with the new tokens
        self._read = 0  # first token not yet turned into text

    def push(self, toks: list[int]) -> int | None:
        before = self._decode(toks[self._prefix : self._read], skip_special_tokens=True)
        after = self._decode(toks[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None  # a special token or an incomplete character: nothing new to search
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(toks)
        window = self._tail + new
        offset = self._len - len(self._tail)
        self._pieces.append(new)
        self._len += len(new)
        self._tail = window[max(0, len(window) - self._keep) :] if self._keep else ""
        hits = [i for x in self._stops if (i := window.find(x)) >= 0]
        return offset + min(hits) if hits else None

    def text(self) -> str:
        return "".join(self._pieces)


def _sample(logits: Any, p: SamplingParams, u: Any) -> tuple[Any, Any]:
    """Draw one token per row by inverse-CDF sampling with the given uniforms ``u`` (shape [B]).

    Returns ``(tokens [B] long, logprobs [B] float32)``; see the module docstring for which
    distribution the log-probabilities refer to.
    """
    import torch

    if p.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept):
        # mass *before* a token < top_p  <=>  token is inside the nucleus
        outside = (probs.cumsum(dim=-1) - probs) >= p.top_p
        sorted_lp = sorted_lp.masked_fill(outside, float("-inf"))
        sorted_lp = sorted_lp - torch.logsumexp(sorted_lp, dim=-1, keepdim=True)
        cdf = sorted_lp.exp().cumsum(dim=-1)
        j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)
        return order.gather(1, j)[:, 0], sorted_lp.gather(1, j)[:, 0]
    cdf = logp.exp().cumsum(dim=-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)
    return tok[:, 0], logp.gather(1, tok)[:, 0]
