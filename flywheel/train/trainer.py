"""The policy trainer: GRPO-family and SFT optimizer steps over token-budget micro-batches.

One :class:`Trainer` owns a model (full fine-tuning or a peft LoRA adapter), AdamW, a linear
warm-up + cosine schedule, gradient clipping, optional gradient checkpointing, bf16 autocast (on CUDA,
and on a CPU for a bf16 base model), and optionally a DeepSpeed engine. :meth:`Trainer.step` runs one
optimizer step over a batch of :class:`~flywheel.train.data.TrainSample` with gradient accumulation
across micro-batches; the loss
variant decides the normalisation (``flywheel.train.losses``), and the trainer supplies the global
token/sequence counts (summed across data-parallel ranks) so split-invariant variants really are.

Log-probs (old, reference and current) go through ``flywheel.kernels.fused_logprob`` by default:
the backbone produces last hidden states, only completion positions are kept, and the fused kernel
computes ``log softmax(h W^T / T)[target]`` without materialising ``[tokens, vocab]`` logits.
``logprob_impl="naive"`` uses the full-logits reference (for A/B checks and the benchmark).
Under ZeRO-3 the lm_head weight is partitioned, so it is gathered
(``deepspeed.zero.GatheredParameters``) around each micro-batch's forward *and* backward.

Multi-iteration GRPO (``rollout -> N optimizer steps -> refresh the sampler -> rollout``) is driven by
the training stage (:func:`flywheel.train.stage.train_grpo` with ``iterations``); the rollout stage
plugs in through :class:`RolloutCallback`.

Guarantees
- Gradient accumulation reproduces the full-batch gradient for ``grpo``, ``dr_grpo``, ``dapo``,
  ``gspo``, ``cispo`` and SFT (global normalisers); ``bnpo`` is the mean of micro-batch means by design.
- LoRA training leaves every base weight bit-identical (tested).
- With ``beta > 0`` and LoRA the reference policy is the base model with the adapter disabled (no
  second copy); with full fine-tuning a frozen copy is kept.

Not guaranteed
- Bitwise reproducibility across devices or DeepSpeed stages (reduction order differs).
- MFU is an estimate: ``6 * parameters * tokens / time / peak bf16 FLOP/s`` (Kaplan et al. 2020),
  reported on CUDA for known GPUs only; it ignores attention FLOPs and LoRA's cheaper backward.
- The ZeRO-3 lm_head gather is exercised only on multi-GPU runs; CI tests ZeRO-1 on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pyarrow as pa
import torch

from flywheel.config import LossName, TrainConfig
from flywheel.kernels import fused_logprob
from flywheel.kernels.fused_layers import patch_for_training
from flywheel.kernels.fused_lora import patch_lora_for_training
from flywheel.policy.kv_cache import supports_preallocated
from flywheel.train.data import MicroBatch, TrainSample, make_micro_batches
from flywheel.train.losses import LossInputs, PreferenceInputs, compute_loss, rpo_loss, sft_loss
from flywheel.train.threads import TrainThreads

LogprobImpl = Literal["fused", "naive"]
#: What a run optimises: a GRPO-family loss (``[train] loss``), SFT's cross-entropy, or RPO/DPO on
#: preference pairs (:meth:`Trainer.preference_step`).
Objective = LossName | Literal["sft", "rpo"]

# Dense bf16 peak FLOP/s by GPU name substring (vendor datasheets), for the MFU estimate.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40": 181e12, "L4": 121e12, "A10": 125e12}


class RolloutCallback(Protocol):
    """Produce a rollout table (``schemas/rollouts.py``) by sampling from ``policy``.

    Called once per GRPO iteration with the *current* trained model (a
    ``transformers`` model, possibly a ``peft.PeftModel``; unwrapped from DeepSpeed), already in
    eval mode. The callback refreshes its sampler from it: the HF backend samples in process from
    this very object; an HTTP backend (vLLM) saves the adapter (``policy.save_pretrained(dir)``) and
    hot-loads it through the server's LoRA endpoint before sampling. It must not modify the weights.
    The trainer switches the model back to train mode afterwards.
    """

    def __call__(self, policy: Any) -> pa.Table: ...


# -- model plumbing --------------------------------------------------------------------------------


def unwrap(model: Any) -> Any:
    """DeepSpeed engine / DDP / peft wrappers -> the ``*ForCausalLM`` module (LoRA layers included)."""
    m = model
    for _ in range(4):
        if hasattr(m, "module") and not hasattr(m, "get_output_embeddings"):
            m = m.module  # DeepSpeedEngine, DistributedDataParallel
        elif hasattr(m, "get_base_model"):
            m = m.get_base_model()  # PeftModel: the base model carries the injected LoRA layers
        else:
            break
    return m


def backbone_and_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder stack (returns last hidden states) and the output projection of a causal LM."""
    lm = unwrap(model)
    head = lm.get_output_embeddings()
    backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
    if backbone is None or head is None:
        raise TypeError(f"{type(lm).__name__}: cannot find the decoder and lm_head of this model")
    return backbone, head


def _is_zero3(model: Any) -> bool:
    return bool(getattr(model, "zero_optimization_stage", lambda: 0)() == 3)


@contextlib.contextmanager
def gathered_head(model: Any) -> Iterator[None]:
    """Under ZeRO-3, materialise the full lm_head weight (read-only) for the fused kernel."""
    if not _is_zero3(model):
        yield
        return
    import deepspeed

    _, head = backbone_and_head(model)
    params = [p for p in head.parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def _logprob_fn(impl: LogprobImpl) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    if impl == "fused":
        return fused_logprob.fused_logprobs
    if impl == "naive":
        return fused_logprob.naive_logprobs
    raise ValueError(f"unknown logprob_impl {impl!r}: expected 'fused' or 'naive'")


def sequence_logprobs(
    model: Any,
    mb: MicroBatch,
    *,
    temperature: float = 1.0,
    impl: LogprobImpl = "fused",
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each completion token: ``([S, C], [S, C] | None)`` float32.

    Runs the backbone once, keeps the hidden states that predict completion tokens, and calls the
    (fused) log-prob function with the lm_head weight. Differentiable when grad is enabled.

    A micro-batch with ``trunk_ids`` (``train.share_prompt_prefix``) runs the shared prefix once into a KV
    cache, repeats its keys and values for every row, and runs the rows on top of it: the same values as
    one forward per sequence, and backward sums each row's gradient through the trunk's keys and values
    into the one trunk pass (flywheel.train.data, "Shared prefixes").
    """
    backbone, head = backbone_and_head(model)
    if mb.trunk_ids is not None:
        trunk = int(mb.trunk_ids.shape[1])
        cache = backbone(input_ids=mb.trunk_ids, use_cache=True).cache
        if cache is not None:
            cache.batch_repeat_interleave(int(mb.input_ids.shape[0]))  # autograd sums the copies' gradients
            out = backbone(input_ids=mb.input_ids, position_ids=mb.position_ids, cache=cache, use_cache=True)
        if cache is None or cache.get_seq_length() != trunk + int(mb.input_ids.shape[1]):
            # e.g. activation checkpointing switched on behind the trainer's back: transformers then drops
            # the cache with a warning, and the rows would have run without the trunk
            raise RuntimeError("shared-prefix micro-batch: the rows did not run on the trunk's keys and values "
                               "(a model that drops its KV cache in training?); set train.share_prompt_prefix = false")
    else:
        out = backbone(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
        )
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.flat_pos)
    fn = _logprob_fn(impl)
    with gathered_head(model):
        logp, ent = fn(
            h, head.weight, mb.targets, bias=getattr(head, "bias", None), temperature=temperature,
            compute_entropy=compute_entropy,
        )
    return mb.scatter(logp), (mb.scatter(ent) if ent is not None else None)


def answer_only_logprobs(
    model: Any,
    mb: MicroBatch,
    *,
    temperature: float = 1.0,
    impl: LogprobImpl = "fused",
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs` with the prompt encoded once without a graph (``train.prompt_grad =
    "answer_only"``): the same values, a cheaper and different gradient.

    Per sequence, the prompt but its last token runs under ``no_grad`` into a KV cache; then the last
    prompt token and the completion (but its last token) run with grad on top of that cache, and their
    hidden states predict the completion tokens. The forward values equal the full pass's to fp32
    rounding (tests/unit/test_trainer_answer_only.py). The gradient differs by design: it reaches the
    trainable weights only through the completion positions (the prompt's keys and values are constants
    of the step), so what the model learns is how to answer a prompt as it already encodes it, not how to
    encode it differently.

    Why: in an agent's requests the prompt is most of the tokens (the demo's BFCL prompts ~330 tokens
    for ~22 answer tokens) and the loss sits on the answer alone; a LoRA forward + backward costs about
    4 x params FLOPs per token, a forward without a graph 2 x, so the step costs about half (measured
    figures: benchmarks/README.md, bench_cpu_limits.py). Sequences run one at a time (batch 1): the
    prompt GEMMs are still [~330, 576] x [576, 1536] and the answer part is a small share of the FLOPs.
    """
    backbone, head = backbone_and_head(model)
    dev = mb.targets.device
    hidden = []
    for s in mb.samples:
        p, c = s.prompt_ids, s.completion_ids
        cache = None
        if len(p) > 1:
            with torch.no_grad():
                out = backbone(input_ids=torch.tensor([p[:-1]], device=dev), use_cache=True)
            cache = out.cache
        inp = torch.tensor([[p[-1], *c[:-1]]], device=dev)
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(c), device=dev).unsqueeze(0)
        out = backbone(input_ids=inp, position_ids=pos, cache=cache, use_cache=cache is not None)
        h = out[0] if isinstance(out, tuple) else out.last_hidden_state
        hidden.append(h[0])
    h = torch.cat(hidden)  # [N, H], completion tokens in micro-batch order (as mb.targets)
    fn = _logprob_fn(impl)
    with gathered_head(model):
        logp, ent = fn(
            h, head.weight, mb.targets, bias=getattr(head, "bias", None), temperature=temperature,
            compute_entropy=compute_entropy,
        )
    return mb.scatter(logp), (mb.scatter(ent) if ent is not None else None)


def _shares_prefix_exactly(backbone: Any) -> bool:
    """Whether a trunk run once and rows run on its cache equal one forward per sequence for this model: a
    plain full-attention cache (no sliding window, no linear attention) and a RoPE whose frequencies do not
    depend on the longest position in the call (``dynamic`` and ``longrope`` pick theirs per call, so the
    trunk's keys and the rows' could be rotated with different ones)."""
    if not supports_preallocated(backbone):
        return False
    config = getattr(backbone, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"))


def _transformer_blocks(model: Any) -> tuple[str, torch.nn.ModuleList]:
    """``model``'s list of transformer blocks (``model.config.num_hidden_layers`` of them) and its attribute
    name (``layers`` in Llama-family models), the ``layers_pattern`` peft matches block indices by."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError("train.lora_layers: the model's config names no num_hidden_layers")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and name:
            return name.rsplit(".", 1)[-1], module
    raise ValueError(f"train.lora_layers: no list of {n} transformer blocks found in {type(model).__name__}")


def apply_lora(
    model: Any, *, r: int, alpha: int, dropout: float = 0.0, target_modules: str | list[str] = "all-linear",
    layers: int | None = None,
) -> Any:
    """Wrap ``model`` in a trainable peft LoRA adapter (base weights frozen). ``r = 0``: unchanged.

    ``all-linear`` adapts every linear layer of the blocks except the output layer (peft's rule),
    the QLoRA recipe (Dettmers et al. 2023), which matches full fine-tuning better than q/v only.

    ``layers`` (``train.lora_layers``): adapt only the top ``layers`` transformer blocks (None, or at
    least ``model.config.num_hidden_layers``: every block, and the same adapter config as before the
    option existed). Why: with the base weights frozen and gradient checkpointing off, autograd records
    nothing below the lowest adapted block (neither weights nor inputs there need a gradient), so the
    backward through the lower blocks is not computed at all. Nothing here, nor in peft's wrapping, makes
    the input embeddings require grad (peft's ``enable_input_require_grads`` runs only when the model
    already has gradient checkpointing on at wrap time; the trainer turns it on afterwards and uses
    non-reentrant checkpointing, which needs no input grads). The partial adapter saves its own
    ``layers_to_transform`` and ``layers_pattern``, so loading it (peft's ``from_pretrained``, the gate,
    ``serve``, merging) rebuilds the same layers. peft refuses ``layers_to_transform`` with a string
    ``target_modules``, so ``all-linear`` is expanded here to the names of the linear layers inside
    the blocks. A model that is already a ``PeftModel`` keeps its adapter's own layers, in float32.
    """
    if r <= 0:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if layers is not None and layers < 1:
        raise ValueError(f"lora layers must be >= 1 (None: every block), got {layers}")
    if isinstance(model, PeftModel):
        for n, p in model.named_parameters():
            trainable = "lora_" in n
            if trainable and p.dtype != torch.float32:
                # An adapter loaded for inference has the base's dtype. Trained as bf16 weights, AdamW's
                # updates below half a bf16 step (lr x ~1 against weights of ~1e-2: the cosine's second
                # half) round away: every phase continued from a registered adapter (the learning stage's
                # stream, trials and continuations, cycle 2 from the champion) learned less than a fresh
                # adapter's float32 first pass.
                p.data = p.data.float()
            p.requires_grad_(trainable)
        return model
    extra: dict[str, Any] = {}
    if layers is not None:
        pattern, blocks = _transformer_blocks(model)
        n_blocks = len(blocks)
        if layers < n_blocks:
            if target_modules == "all-linear":
                from transformers.pytorch_utils import Conv1D

                target_modules = sorted({name.rsplit(".", 1)[-1] for name, mod in blocks.named_modules()
                                         if isinstance(mod, torch.nn.Linear | Conv1D)})
            extra = {"layers_to_transform": list(range(n_blocks - layers, n_blocks)), "layers_pattern": pattern}
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM",
                     **extra)
    return get_peft_model(model, cfg)


# auto: the narrowest MLP whose elementwise work repays the first compile (module docstring of fused_layers)
COMPILE_MIN_MLP_WIDTH = 1024


def compile_lean_layers(setting: str, model: Any, device: torch.device) -> bool:
    """Whether the lean layers run compiled (``train.compile_lean_layers``)."""
    if setting != "auto":
        return setting == "on"
    width = getattr(getattr(model, "config", None), "intermediate_size", None)
    return device.type == "cpu" and isinstance(width, int) and width >= COMPILE_MIN_MLP_WIDTH


def cosine_with_warmup(step: int, *, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``.

    ``step`` counts optimizer steps already taken (0 for the first update), as ``LambdaLR`` passes it.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def load_deepspeed_config(path: str | os.PathLike[str], *, grad_clip: float, bf16: bool) -> dict[str, Any]:
    """Read a DeepSpeed JSON config and fill the values the trainer owns.

    ``"auto"`` fields are replaced (as the HF integration does): micro-batch size 1 and gradient
    accumulation 1 (the trainer accumulates token-budget micro-batches itself and marks the boundary
    with ``set_gradient_accumulation_boundary``), ``gradient_clipping`` from the config, bf16 on CUDA.
    """
    cfg = json.loads(Path(path).read_text())

    def fill(key: str, value: Any) -> None:
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value

    fill("train_micro_batch_size_per_gpu", 1)
    fill("gradient_accumulation_steps", 1)
    fill("gradient_clipping", grad_clip)
    cfg.pop("train_batch_size", None) if cfg.get("train_batch_size") == "auto" else None
    bf = cfg.setdefault("bf16", {})
    if bf.get("enabled", "auto") == "auto":
        bf["enabled"] = bf16
    return cfg


def _dist_sum(values: list[float]) -> list[float]:
    """Sum across data-parallel ranks (no-op without an initialised process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


# -- the trainer -------------------------------------------------------------------------------------


@functools.cache
def _libc_malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def _malloc_trim() -> None:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``).

    Why: on CPU the activations of a step are freed by the end of it, but glibc keeps most of that
    memory in its arenas (its mmap threshold adapts upward once large blocks are freed), and the
    fragments it keeps make the resident high-water mark creep up step after step. Measured on
    SmolLM2-135M full fine-tuning, CPU: peak RSS over three steps 5.29 GB without, 4.91 GB with, at a
    cost of ~1 ms per call. (A fixed small mmap threshold cuts deeper, to 4.2 GB, but made steps ~20 %
    slower: every large tensor then costs fresh, zeroed pages.)

    The call itself is cheap; what it releases is not: glibc hands back every free page of its arenas
    (``madvise``), so the next step takes a page fault and a zeroed page for each of them again. With
    LoRA on SmolLM2-135M in fp32 (the demo's SFT step on a 2-core EPYC) that was ~0.8M faults and ~3.5
    system CPU-seconds per step, the step x1.05-1.3 slower than without, for the same peak RSS (5.5-5.9 GB;
    benchmarks/bench_release_memory.py): so ``train.release_memory = "auto"`` trims after each step for full
    fine-tuning only.
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def make_adamw(params: list[torch.nn.Parameter], **kw: Any) -> torch.optim.AdamW:
    """torch's AdamW on its fused kernel where the parameters allow it (floating point, one device type
    among cpu/cuda), else its default (foreach) path.

    Why: the foreach path materialises temporaries the size of the parameters in every step (the
    square-root and update lists), and the fused kernel updates each parameter in place in one pass.
    Measured on this 2-core machine, SmolLM2-135M full fine-tuning in fp32: ~0.85 s less per optimizer
    step and a lower resident peak. (TRL's default, transformers' ``adamw_torch_fused``, is the same
    kernel.)
    """
    devices = {p.device.type for p in params}
    if len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params):
        try:
            return torch.optim.AdamW(params, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):  # a dtype or build without the fused kernel
            pass
    return torch.optim.AdamW(params, **kw)


@dataclass(frozen=True)
class TrainerOptions:
    """One :class:`Trainer` run: what the stage decides per run, and ``train``, the ``[train]``
    section (:class:`flywheel.config.TrainConfig`) that holds every knob of the trainer (optimizer,
    schedule shape, LoRA, micro-batching, log-prob path, loss knobs in ``train.objective``).

    Per run: the objective (a GRPO-family loss or ``"sft"``), the peak ``lr``, the schedule length
    ``total_steps``, the log-prob ``temperature`` (the sampler's for GRPO, 1.0 for SFT:
    :func:`flywheel.config.objective_temperature`), the completion budget ``max_completion_len`` of
    ``dr_grpo`` and the overlong penalty, the tokenizer's ``pad_id``, and ``schedule_offset``.
    """

    objective: Objective = "dapo"
    lr: float = 1e-5
    total_steps: int = 8
    temperature: float = 1.0
    max_completion_len: int | None = None
    pad_id: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    #: Optimizer steps of the same schedule taken by earlier runs: a phase that continues another one (the
    #: learning stage's ``train.schedule = "one_run"``) starts its learning rate where that one stopped, and
    #: ``total_steps`` is then the whole run's length, not this phase's.
    schedule_offset: int = 0


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens through the model (prompt + completion, no padding)
    loss_tokens: int  # tokens with loss
    seconds: float
    tokens_per_s: float
    stats: dict[str, float] = field(default_factory=dict)  # clip_frac, kl, entropy, reward_mean, ...

    def flat(self) -> dict[str, float]:
        d = {k: float(v) for k, v in self.__dict__.items() if k != "stats"}
        d.update({k: float(v) for k, v in self.stats.items()})
        return d


@dataclass
class PreferenceSample:
    """One preference pair in tokens: the chosen and the rejected answer to one prompt (two
    :class:`~flywheel.train.data.TrainSample` with the same ``prompt_ids``), and the reference policy's
    sequence log-probs of each (``None`` until :meth:`Trainer.preference_reference` fills them).
    ``group_id`` names the pair, so :func:`batches` shuffles pairs whole."""

    chosen: TrainSample
    rejected: TrainSample
    ref_chosen: float | None = None
    ref_rejected: float | None = None
    group_id: str = ""

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


class Trainer:
    """Owns model, optimizer, schedule (and DeepSpeed engine). One :meth:`step` = one optimizer update."""

    def __init__(self, model: Any, options: TrainerOptions, *, device: str | torch.device = "cpu",
                 optimizer_state: dict[str, Any] | None = None):
        """``optimizer_state``: an :meth:`optimizer_state` of an earlier trainer over the same trainable
        parameters (same adapter), loaded into the new optimizer, so a phase that continues another one
        keeps AdamW's moments instead of restarting them (a restart makes the next steps move every
        weight by about the learning rate, whatever its gradient). Refused with DeepSpeed."""
        self.opt = options
        t = self.train = options.train
        self.device = torch.device(device)
        self.use_cuda = self.device.type == "cuda"
        # train.threads: a CPU step's intra-op threads follow the cores other processes leave free
        # (flywheel/train/threads.py); None on CUDA
        self.threads = None if self.use_cuda else TrainThreads(getattr(t, "threads", "auto"))
        # The base weights' dtype, before LoRA adds float32 adapters (decides CPU autocast).
        self.base_dtype = next(model.parameters()).dtype
        model = apply_lora(model, r=t.lora_r, alpha=t.lora_alpha, layers=t.lora_layers)
        self.is_lora = t.lora_r > 0
        if t.gradient_checkpointing:
            # Non-reentrant checkpointing needs no input grads (LoRA freezes the embeddings). transformers'
            # gradient_checkpointing_enable hooks the input embeddings to require grad anyway (for reentrant
            # checkpointing); that hook would make autograd record every block, also those below a partial
            # adapter (train.lora_layers) and block 0's input grads with every block adapted: removed.
            unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(unwrap(model), "disable_input_require_grads"):
                unwrap(model).disable_input_require_grads()
            cfg = getattr(unwrap(model), "config", None)
            if cfg is not None:
                cfg.use_cache = False
        model.to(self.device)
        self.ref_model = None
        if options.objective != "sft" and t.objective.beta > 0 and not self.is_lora:
            self.ref_model = copy.deepcopy(unwrap(model)).eval().requires_grad_(False)
        self.lean_layers: dict[str, int] = {}
        self._plain_cache = _shares_prefix_exactly(backbone_and_head(model)[0])
        self.compiled_layers = False
        if t.lean_layers:
            self.compiled_layers = compile_lean_layers(t.compile_lean_layers, unwrap(model), self.device)
            self.lean_layers = patch_for_training(unwrap(model), compiled=self.compiled_layers)
        # train.release_memory: malloc_trim after each CPU step (see _malloc_trim for when it pays)
        rm = t.release_memory
        self.trim_each_step = not self.use_cuda and (rm is True or (rm == "auto" and not self.is_lora))
        # train.fused_lora: every adapted linear as GEMMs only (flywheel/kernels/fused_lora.py)
        self.fused_lora_layers = patch_lora_for_training(unwrap(model)) if t.fused_lora and self.is_lora else 0
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters (LoRA found no target modules?)")
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_trainable = sum(p.numel() for p in params)
        optimizer = make_adamw(params, lr=options.lr, betas=t.betas, weight_decay=t.weight_decay)
        if optimizer_state is not None:
            if t.deepspeed:
                raise ValueError("optimizer_state: resuming an optimizer is not supported with DeepSpeed")
            try:
                # A copy: torch's load_state_dict keeps the given tensors when dtype and device match, and the
                # fused step updates them in place -- two arms resumed from one state would share its moments.
                optimizer.load_state_dict(copy.deepcopy(optimizer_state))
                for p in params:  # load_state_dict checks counts only: a different adapter must not slip through
                    avg = optimizer.state.get(p, {}).get("exp_avg")
                    if avg is not None and tuple(avg.shape) != tuple(p.shape):
                        raise ValueError(f"a saved moment of shape {tuple(avg.shape)} for a parameter of shape {tuple(p.shape)}")
            except (ValueError, KeyError, RuntimeError) as e:
                raise ValueError(f"optimizer_state does not fit this model's trainable parameters: {e}") from e
            for g in optimizer.param_groups:  # this phase's options set the learning rate, not the saved state
                g["lr"] = options.lr
                g.pop("initial_lr", None)
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: cosine_with_warmup(
                s + options.schedule_offset, warmup=t.warmup_steps, total=options.total_steps, min_ratio=t.min_lr_ratio
            ),
        )
        self.engine = None
        if t.deepspeed:
            import deepspeed

            ds_cfg = load_deepspeed_config(t.deepspeed, grad_clip=t.grad_clip, bf16=self.use_cuda)
            # torch's AdamW, not DeepSpeed's: the fused C++ op costs a ~30 s build on first use (FACTS.md).
            self.engine, optimizer, _, sched = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=sched, config=ds_cfg
            )
            model = self.engine
        self.model = model
        self.optimizer = optimizer
        self.scheduler = sched
        self.step_count = 0
        self.model.train()

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def policy(self) -> Any:
        """The trained model without the DeepSpeed wrapper (a PeftModel with LoRA)."""
        return self.engine.module if self.engine is not None else self.model

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA, and on a CPU when the base weights are bf16 (``policy.dtype``
        "fast" on a CPU with native bf16); a no-op for an fp32 model on a CPU.

        With LoRA, the adapter's float32 weights are the optimizer's master copy and autocast runs
        their matmuls in bf16. peft's own input cast (``x`` to the adapter's float32 before each
        adapter) is switched off inside, so activations stay bf16: measured on this 2-core CPU with
        SmolLM2-135M, a forward + backward over 3 x 680 tokens took 5.3 s without autocast (bf16 base,
        float32 adapters, an activation copy per adapted layer) and 4.7 s with it.
        """
        if self.use_cuda:
            device_type = "cuda"
        elif self.base_dtype == torch.bfloat16:
            device_type = "cpu"
        else:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
        if self.is_lora and not self.train.gradient_checkpointing:  # recomputed forwards run outside
            from peft.helpers import disable_input_dtype_casting  # peft is imported with the adapter

            stack.enter_context(disable_input_dtype_casting(unwrap(self.policy)))
        return stack

    def _logprobs(self, model: Any, mb: MicroBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = sequence_logprobs
        if self.train.prompt_grad == "answer_only" and not self.train.gradient_checkpointing and self.engine is None:
            fn = answer_only_logprobs  # the KV cache it builds is refused under checkpointing
        with self._autocast():
            return fn(
                model, mb, temperature=self.opt.temperature, impl=self.train.logprob_impl,
                compute_entropy=entropy,
            )

    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.opt.objective == "sft" or self.train.objective.beta == 0:
            return None
        with torch.no_grad():
            if self.ref_model is not None:
                return self._logprobs(self.ref_model, mb, False)[0]
            with self.policy.disable_adapter():  # LoRA: the base model is the reference
                return self._logprobs(self.policy, mb, False)[0]

    def micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        return make_micro_batches(
            samples, token_budget=self.train.micro_batch_tokens, packing=self.train.packing, pad_id=self.opt.pad_id,
            share_prefix=self.shares_prefix,
        )

    @property
    def shares_prefix(self) -> bool:
        """Whether micro-batches encode their shared prompt prefix once (``train.share_prompt_prefix``)."""
        setting = self.train.share_prompt_prefix
        if setting is False or (setting == "auto" and self.use_cuda):
            return False  # auto: CPU training (measured there); CUDA's masked attention is not measured yet
        # The trunk's KV cache is refused under activation checkpointing (as answer_only's is), DeepSpeed's
        # engine is not tested with two backbone calls per micro-batch, and a sliding-window, linear-attention
        # or dynamic-RoPE model's cache is not the plain keys and values the rows need.
        return (not self.train.gradient_checkpointing and self.engine is None and self._plain_cache
                and not getattr(unwrap(self.model), "is_activation_checkpointing", False))

    @torch.no_grad()
    def compute_old_logprobs(self, samples: Sequence[TrainSample]) -> None:
        """Fill ``sample.old_logprobs`` with the current policy's log-probs (before any update on them).

        Needed when several optimizer steps use one rollout set: from the second step on, the policy
        that produced the data is no longer the one being trained, and the ratio must compare to it.
        """
        was_training = self.model.training
        self.model.eval()
        for mb in self.micro_batches(samples):
            mb = mb.to(self.device)
            logp, _ = self._logprobs(self.model, mb, False)
            for k, s in enumerate(mb.samples):
                s.old_logprobs = logp[k, : len(s.completion_ids)].float().cpu().tolist()
        self.model.train(was_training)

    # -- one optimizer step ----------------------------------------------------------------------
    def step(self, samples: Sequence[TrainSample]) -> StepMetrics:
        """One optimizer update over ``samples`` (gradient accumulation across micro-batches)."""
        if not samples:
            raise ValueError("Trainer.step: empty batch")
        if self.threads is None:
            return self._step(samples)
        self.threads.before_step()  # train.threads: the cores other processes leave free
        try:
            return self._step(samples)
        finally:
            self.threads.after_step()

    def _step(self, samples: Sequence[TrainSample]) -> StepMetrics:
        t0 = time.perf_counter()
        mbs = self.micro_batches(samples)
        n_tok, n_seq = _dist_sum([float(sum(s.n_loss_tokens for s in samples)), float(len(samples))])
        world = _world_size()
        self.model.train()
        total_loss = 0.0
        agg: dict[str, float] = {}
        agg_w = 0.0
        tokens = computed = 0
        for i, mb in enumerate(mbs):
            mb = mb.to(self.device)
            tokens += mb.n_tokens
            computed += mb.n_computed
            if self.engine is not None:
                self.engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            ref = self._ref_logprobs(mb)
            with gathered_head(self.model):
                logp, ent = self._logprobs(self.model, mb, self.train.log_entropy)
                inp = LossInputs(
                    logp=logp, mask=mb.mask, advantages=mb.advantages, old_logp=mb.old_logp, ref_logp=ref,
                    sampler_logp=mb.sampler_logp, entropy=ent.detach() if ent is not None else None,
                    num_tokens=n_tok, num_sequences=int(n_seq), num_micro_batches=len(mbs),
                    max_completion_len=self.opt.max_completion_len, dp_world_size=world,
                )
                out = sft_loss(inp) if self.opt.objective == "sft" else compute_loss(
                    self.opt.objective, inp, self.train.objective
                )
                if self.engine is not None:
                    # Our losses are already normalised over the whole step: no 1/GAS scaling.
                    self.engine.backward(out.loss, scale_wrt_gas=False)
                else:
                    out.loss.backward()
            total_loss += float(out.loss.detach())
            for k, v in out.stats.items():
                agg[k] = agg.get(k, 0.0) + v * out.tokens
            agg_w += out.tokens
        lr = float(self.scheduler.get_last_lr()[0])
        if self.engine is not None:
            self.engine.step()  # clips (gradient_clipping), steps optimizer and scheduler, zeroes grads
            gn = self.engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else float("nan")
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if self.use_cuda:
            torch.cuda.synchronize()
        elif self.trim_each_step:
            _malloc_trim()
        dt = time.perf_counter() - t0
        stats = {k: v / max(agg_w, 1.0) for k, v in agg.items()}
        if self.threads is not None:
            stats["threads"] = float(self.threads.current)
        rewards = torch.tensor([s.reward for s in samples])
        if self.opt.objective != "sft":
            stats["reward_mean"] = float(rewards.mean())
            stats["reward_std"] = float(rewards.std(unbiased=False))
        if self.use_cuda:
            name = torch.cuda.get_device_name(self.device)
            peak = next((v for k, v in _PEAK_BF16.items() if k in name), None)
            if peak:
                # the tokens the model ran over (a shared trunk once)
                stats["mfu"] = 6.0 * self.n_params * computed / dt / peak
        return StepMetrics(
            step=self.step_count, loss=total_loss, lr=lr, grad_norm=grad_norm, tokens=tokens,
            loss_tokens=int(sum(s.n_loss_tokens for s in samples)), seconds=dt, tokens_per_s=tokens / dt,
            stats=stats,
        )

    # -- preference pairs (DPO / RPO) ---------------------------------------------------------------
    def _pair_chunks(self, pairs: Sequence[PreferenceSample]) -> list[list[PreferenceSample]]:
        """Consecutive pairs in chunks of at most ``micro_batch_tokens`` real tokens (a longer pair is
        its own chunk). A pair's two answers are always in one chunk: the DPO term couples them, so
        both log-probs must be in one graph when it is backpropagated."""
        budget = self.train.micro_batch_tokens
        chunks: list[list[PreferenceSample]] = []
        cur: list[PreferenceSample] = []
        load = 0
        for p in pairs:
            if cur and load + len(p) > budget:
                chunks.append(cur)
                cur, load = [], 0
            cur.append(p)
            load += len(p)
        if cur:
            chunks.append(cur)
        return chunks

    def _pair_logps(
        self, model: Any, pairs: Sequence[PreferenceSample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(chosen [P], rejected [P], chosen answer tokens [P], tokens through the model)``: sequence
        log-probs summed over each answer's loss-masked tokens, through the trainer's micro-batching and
        log-prob path (a chunk's sequences may span several padded micro-batches; their graphs are all
        kept until the caller's backward)."""
        seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
        sums: dict[int, torch.Tensor] = {}
        tokens = 0
        for mb in self.micro_batches(seqs):
            mb = mb.to(self.device)
            tokens += mb.n_tokens
            logp, _ = self._logprobs(model, mb, False)
            per_seq = (logp.float() * mb.mask).sum(-1)  # [S]
            for k, s in enumerate(mb.samples):
                sums[id(s)] = per_seq[k]
        chosen = torch.stack([sums[id(p.chosen)] for p in pairs])
        rejected = torch.stack([sums[id(p.rejected)] for p in pairs])
        n_chosen = torch.tensor([float(p.chosen.n_loss_tokens) for p in pairs], device=chosen.device)
        return chosen, rejected, n_chosen, tokens

    @torch.no_grad()
    def preference_reference(self, pairs: Sequence[PreferenceSample]) -> None:
        """Fill ``ref_chosen``/``ref_rejected`` with the current weights' sequence log-probs (eval mode).

        Called once before the first update, so the DPO reference is the starting policy without a
        second model in memory (with LoRA the same holds for a run continuing a trained adapter, which
        ``disable_adapter`` would not give)."""
        was_training = self.model.training
        self.model.eval()
        for chunk in self._pair_chunks(pairs):
            c, r, _, _ = self._pair_logps(self.model, chunk)
            for p, a, b in zip(chunk, c.tolist(), r.tolist(), strict=True):
                p.ref_chosen, p.ref_rejected = float(a), float(b)
        self.model.train(was_training)

    def preference_step(self, pairs: Sequence[PreferenceSample], *, beta: float = 0.1, alpha: float = 1.0) -> StepMetrics:
        """One optimizer update of :func:`flywheel.train.losses.rpo_loss` (``alpha = 0``: DPO) over ``pairs``.

        Gradient accumulation across pair chunks (:meth:`_pair_chunks`) with the step's global pair
        count as normaliser, so the split does not change the gradient; clipping, optimizer, schedule
        and DeepSpeed as in :meth:`step`. The pairs must carry reference log-probs
        (:meth:`preference_reference`)."""
        if not pairs:
            raise ValueError("Trainer.preference_step: empty batch")
        missing = [p.group_id for p in pairs if p.ref_chosen is None or p.ref_rejected is None]
        if missing:
            raise ValueError(f"Trainer.preference_step: pairs {missing[:5]} have no reference log-probs; "
                             "call preference_reference(pairs) before the first update")
        t0 = time.perf_counter()
        chunks = self._pair_chunks(pairs)
        (n_pairs,) = _dist_sum([float(len(pairs))])
        world = _world_size()
        self.model.train()
        total_loss = 0.0
        agg: dict[str, float] = {}
        agg_w = 0.0
        tokens = 0
        for i, chunk in enumerate(chunks):
            if self.engine is not None:
                self.engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
            with gathered_head(self.model):
                c, r, n_c, tok = self._pair_logps(self.model, chunk)
                tokens += tok
                ref = torch.tensor([[p.ref_chosen, p.ref_rejected] for p in chunk], dtype=torch.float32,
                                   device=c.device)
                out = rpo_loss(PreferenceInputs(
                    chosen_logp=c, rejected_logp=r, ref_chosen_logp=ref[:, 0], ref_rejected_logp=ref[:, 1],
                    chosen_tokens=n_c, num_pairs=int(n_pairs), dp_world_size=world,
                ), beta=beta, alpha=alpha)
                if self.engine is not None:
                    self.engine.backward(out.loss, scale_wrt_gas=False)
                else:
                    out.loss.backward()
            total_loss += float(out.loss.detach())
            for k, v in out.stats.items():
                agg[k] = agg.get(k, 0.0) + v * out.pairs
            agg_w += out.pairs
        lr, grad_norm = self._optimizer_update()
        dt = time.perf_counter() - t0
        stats = {k: v / max(agg_w, 1.0) for k, v in agg.items()}
        stats["pairs"] = float(len(pairs))
        return StepMetrics(
            step=self.step_count, loss=total_loss, lr=lr, grad_norm=grad_norm, tokens=tokens,
            loss_tokens=int(sum(p.chosen.n_loss_tokens + p.rejected.n_loss_tokens for p in pairs)), seconds=dt,
            tokens_per_s=tokens / dt, stats=stats,
        )

    def _optimizer_update(self) -> tuple[float, float]:
        """Clip, step the optimizer and the schedule, zero the gradients: ``(lr used, grad norm)``.
        (The tail of :meth:`step`, which keeps its own copy.)"""
        lr = float(self.scheduler.get_last_lr()[0])
        if self.engine is not None:
            self.engine.step()
            gn = self.engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else float("nan")
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if self.use_cuda:
            torch.cuda.synchronize()
        elif self.trim_each_step:
            _malloc_trim()
        return lr, grad_norm

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the optimizer's state (AdamW's moments and step counts), detached from this trainer,
        for a later :class:`Trainer` that continues the same run (``optimizer_state=``)."""
        if self.engine is not None:
            raise ValueError("optimizer_state: not supported with DeepSpeed")
        return copy.deepcopy(self.optimizer.state_dict())

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Save the adapter (LoRA: ``adapter_config.json`` + ``adapter_model.safetensors``) or the full model."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(out))
        return out


def batches(samples: Sequence[TrainSample], batch_size: int, steps: int, *, seed: int = 0,
            skip: int = 0) -> Iterator[list[TrainSample]]:
    """``steps`` batches of ``batch_size`` samples: shuffled passes over the data, whole groups kept.

    Groups (same ``group_id``) stay together so each step sees complete GRPO groups; a pass is
    reshuffled with a seeded generator, so runs are reproducible. ``skip``: the first ``skip`` batches
    of the same stream are drawn and dropped, so a run that resumes another one on the same data goes
    on where it stopped instead of repeating its first batches.
    """
    if skip > 0:
        stream = batches(samples, batch_size, skip + steps, seed=seed)
        for i, b in enumerate(stream):
            if i >= skip:
                yield b
        return
    by_group: dict[str, list[TrainSample]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    groups = list(by_group.values())
    if not groups:
        return
    g = torch.Generator().manual_seed(seed)
    produced = 0
    while produced < steps:
        order = torch.randperm(len(groups), generator=g).tolist()
        cur: list[TrainSample] = []
        for gi in order:
            cur.extend(groups[gi])
            if len(cur) >= batch_size:
                yield cur
                produced += 1
                cur = []
                if produced >= steps:
                    return
        if cur:
            yield cur
            produced += 1


def spread(stream: Iterator[list[TrainSample]] | Sequence[list[TrainSample]], extras: Sequence[TrainSample],
           steps: int) -> Iterator[list[TrainSample]]:
    """``stream``'s batches with ``extras`` added round-robin over its first ``steps`` batches: batch ``i``
    gets ``extras[i], extras[i + steps], ...``. Every extra is trained exactly once when the stream yields
    ``steps`` batches, the stream's own batches stay what they were (a resumed data stream keeps its
    order), and an item listed twice with others between (``[a, b, a, b]``) lands in two different steps
    when there are at least as many steps as entries between the copies."""
    if steps < 1:
        raise ValueError(f"spread: steps must be >= 1, got {steps}")
    for i, b in enumerate(stream):
        yield list(b) + list(extras[i::steps]) if i < steps else list(b)

