"""flywheel's GRPO trainer against TRL's ``GRPOTrainer``: optimizer-step throughput and peak RSS, CPU.

    .venv/bin/python benchmarks/bench_vs_trl.py --quick   # 4 prompts x 2 generations x 32 tokens, 2 timed steps
    .venv/bin/python benchmarks/bench_vs_trl.py           # 8 prompts x 4 generations x 64 tokens, 3 timed steps
    options: --lora-r 16 (LoRA on all linear layers; default 0 = full fine-tuning), --prompt-style tools,
             --gradient-checkpointing, --repeats N (alternating fresh runs, pooled), --home DIR, --json OUT

Peer: ``trl.GRPOTrainer`` (trl 1.16), the trainer users would pick instead. Target (issue 9): flywheel
>= 1.5x TRL's tokens/s and <= 0.7x its peak RSS.

The same work on both sides
- Model: SmolLM2-135M-Instruct, the fp32 safetensors directory from ``ensure_base_model`` (``--model
  tiny`` for smoke tests), loaded the same way; full fine-tuning by default, or LoRA r / alpha = 2r
  on all linear layers of the blocks (``--lora-r``).
- Data: ``P`` BFCL ``simple_python`` questions rendered with ``flywheel.policy.format.render_prompt``
  (``--prompt-style question``: the question alone, ~50 tokens; ``tools``: with the function spec,
  ~330 tokens) and ``G`` completions per prompt of exactly ``C`` tokens each, sampled once from the
  model before either trainer starts (``min_new_tokens = max_new_tokens = C``; ``--completions
  random`` draws uniform token ids instead). Both trainers get the *same* token ids.
- Reward: a deterministic stand-in verifier (share of even token ids in the completion), so groups
  have reward variance; advantages ``r - mean_group`` on both sides (TRL ``scale_rewards="none"``,
  flywheel ``compute_advantages(scale="none")``) so the two step-1 gradients are the same vector.
- Optimizer step: all ``P x G`` sequences (one GRPO batch) per step, split in micro-batches of ``m``
  sequences (TRL ``per_device_train_batch_size = m``, ``gradient_accumulation_steps = PG / m``;
  flywheel ``micro_batch_tokens = m x longest sequence``, the padded size of TRL's micro-batch).
  Loss ``dapo`` (token sum / step token count), clip 0.2 / 0.28, ``beta = 0`` (no reference model),
  one inner iteration (no old-log-prob pass on either side: TRL skips it when
  ``steps_per_generation == gradient_accumulation_steps``), entropy computed on both sides, no
  importance-sampling correction, gradient clipping at 1.0, AdamW lr 1e-5 with no weight decay,
  fp32 (``bf16=False``), gradient checkpointing off on both (``--gradient-checkpointing`` turns it on
  for both; note TRL's own default is *on*).
- Not equalised, because each is a choice of the trainer under test: the AdamW implementation (TRL
  uses transformers' default ``adamw_torch_fused``; flywheel ``torch.optim.AdamW``'s default path),
  padding (TRL pads every micro-batch to the longest prompt and completion of the generation batch;
  flywheel sorts by length and pads per micro-batch) and the log-prob head (both avoid full
  ``[tokens, vocab]`` logits: TRL 1.16 patches a chunked fused LM head into the model, flywheel uses
  ``flywheel.kernels.fused_logprob``). On CPU TRL's head projects *every* position of the padded
  micro-batch, prompt and padding included (``trl/kernels/chunked_logprob.py``: only CUDA/XPU score
  the labelled positions alone), while flywheel projects completion positions only, so the gap in
  head work grows with prompt length (``--prompt-style tools``). Both use the same CPU threads.

What is timed (training phase only, generation excluded)
- flywheel: the wall time of each ``Trainer.step(samples)`` call: collating micro-batches, forward,
  loss, backward, clipping, AdamW, scheduler, zeroing gradients, statistics.
- TRL: a ``TrainerCallback`` records ``on_step_begin`` -> ``on_step_end`` of each optimizer step
  (every micro-batch's ``training_step`` = forward + loss + backward, then clipping, AdamW,
  scheduler, ``zero_grad``), minus the time spent inside ``_generate_and_score_completions``
  (subclass hook). Generation is a ``rollout_func`` that looks the pre-sampled ids up, so what is
  subtracted is the lookup, reward, padding and advantage bookkeeping that TRL does per generation
  batch. The dataloader fetch (before ``on_step_begin``) and logging (after ``on_step_end``) are
  outside the window. Collation inside flywheel's step is *not* subtracted, which can only favour TRL.
- The first ``--warmup-steps`` (1) optimizer steps of each side are run but not timed (lazy
  allocation of AdamW state, first-call overheads). Throughput = non-padding tokens per step
  (prompt + completion, identical on both sides and checked against flywheel's own count) divided by
  the *median* step time (robust to the other engineers' jobs on this shared machine); the mean is
  printed too.
- Peak RSS: each side runs in its own fresh subprocess. "train peak" is the kernel's resident
  high-water mark (``VmHWM``) reset with ``/proc/self/clear_refs`` just before the first optimizer
  step (model loaded, trainer built), read after the last; it includes the resident weights. "process
  peak" is the child's ``ru_maxrss`` over its whole life (loading included), from ``os.wait4``.
  The headline ratio uses the train peak.

Measured on the shared 2-core box, SmolLM2-135M full fine-tuning, fp32, step-1 gradient norms equal
(single runs: read throughput ratios as +-15 %):
- ``--prompt-style tools`` (real BFCL prompts with the function spec; 8 x 4 x 64, 12,608 tokens per
  step, load 1.3-1.9): 176.6 vs 100.8 tokens/s = x1.75, train peak RSS 8.60 / 13.92 GB = x0.62.
- ``--quick --prompt-style tools`` (2,816 tokens per step, load 1.8): 182.3 vs 114.3 tokens/s =
  x1.59, train peak RSS 4.93 / 7.13 GB = x0.69.
- question-only prompts (~50 tokens), ``--quick`` (650 tokens per step, load 0.7): 154.8 vs 138.8
  tokens/s = x1.12, train peak RSS 3.29 / 3.84 GB = x0.86 (before the lean layers, no-mask padding
  and fused AdamW: x0.83, x0.90; default size x0.86, x0.82). The head work TRL spends on prompt
  positions grows with prompt length; on short prompts the two trainers do nearly the same work.

Guarantees: both sides see identical token ids, rewards and advantages, the same number of
sequences and completion tokens per optimizer step, and the same loss; step-1 gradient norms are
printed side by side as evidence (they agree to float32 reduction order when the setup matches).
Not guaranteed: stable timings on a shared, loaded 2-core machine (the load average is printed
at the start and before each side); GPU figures (the H200 comparison of issue 9 is not run here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in trl 1.16

THROUGHPUT_TARGET = 1.5  # ours / TRL tokens per second, at least (issue 9)
MEMORY_TARGET = 0.7  # ours / TRL peak RSS, at most (issue 9)
SIDES = ("flywheel", "trl")


@dataclass
class BenchSpec:
    """One benchmark configuration; serialised to JSON for the child processes."""

    model: str = "smollm2-135m"
    home: str = ".flywheel"
    prompts: int = 8  # P distinct prompts per optimizer step
    generations: int = 4  # G completions per prompt (GRPO group size)
    completion_len: int = 64  # C tokens per completion, exactly
    steps: int = 3  # timed optimizer steps per side
    warmup_steps: int = 1  # untimed optimizer steps before them
    micro_batch: int = 8  # m sequences per micro-batch
    lora_r: int = 0  # 0 = full fine-tuning
    gradient_checkpointing: bool = False
    lr: float = 1e-5
    prompt_style: str = "question"  # "question" | "tools"
    completions: str = "sampled"  # "sampled" | "random"
    seed: int = 0

    def validate(self) -> None:
        n = self.prompts * self.generations
        if min(self.prompts, self.generations, self.completion_len, self.steps, self.micro_batch) < 1:
            raise ValueError(f"{self}: prompts, generations, completion_len, steps and micro_batch must be >= 1")
        if self.generations < 2:
            raise ValueError("generations must be >= 2: a GRPO group of one has no baseline")
        if n % self.micro_batch:
            raise ValueError(f"micro_batch {self.micro_batch} must divide prompts x generations = {n} "
                             "(TRL accumulates whole micro-batches)")
        if self.prompt_style not in ("question", "tools"):
            raise ValueError(f"prompt_style {self.prompt_style!r}: expected 'question' or 'tools'")
        if self.completions not in ("sampled", "random"):
            raise ValueError(f"completions {self.completions!r}: expected 'sampled' or 'random'")


@dataclass
class Rollouts:
    """The fixed training batch both trainers consume. Sequence ``i`` answers prompt ``i // G``."""

    prompt_texts: list[str]  # [P] rendered prompts (the dataset column TRL samples from)
    prompt_ids: list[list[int]]  # [P]
    completion_ids: list[list[int]]  # [P * G], each exactly completion_len tokens
    rewards: list[float]  # [P * G]
    generations: int

    @property
    def n_sequences(self) -> int:
        return len(self.completion_ids)

    def prompt_of(self, i: int) -> int:
        return i // self.generations

    @property
    def tokens_per_step(self) -> int:
        """Non-padding tokens through the model per optimizer step (prompt + completion)."""
        return sum(len(self.prompt_ids[self.prompt_of(i)]) + len(c) for i, c in enumerate(self.completion_ids))

    @property
    def completion_tokens_per_step(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @property
    def longest(self) -> int:
        return max(len(self.prompt_ids[self.prompt_of(i)]) + len(c) for i, c in enumerate(self.completion_ids))


def stand_in_reward(completion_ids: list[int]) -> float:
    """Deterministic reward in [0, 1]: the share of even token ids (a verifier stand-in with variance)."""
    return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)


def prepare_rollouts(spec: BenchSpec) -> Rollouts:
    """Render ``P`` BFCL prompts and sample ``G`` completions of exactly ``C`` tokens for each, once."""
    import torch

    from flywheel.policy.format import render_prompt
    from flywheel.policy.models import load_model
    from flywheel.verifiers.bfcl import load_bfcl

    spec.validate()
    torch.manual_seed(spec.seed)
    model, tok = load_model(spec.model, home=Path(spec.home))
    items = load_bfcl("simple_python", limit=spec.prompts)
    if len(items) < spec.prompts:
        raise ValueError(f"BFCL simple_python has only {len(items)} questions, {spec.prompts} requested")
    texts = [render_prompt(tok, it.question_messages, it.tools if spec.prompt_style == "tools" else None)
             for it in items]
    prompt_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    C, G = spec.completion_len, spec.generations
    if spec.completions == "random":
        g = torch.Generator().manual_seed(spec.seed)
        completions = torch.randint(10, len(tok), (spec.prompts * G, C), generator=g).tolist()
    else:
        enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")  # left padding
        with torch.no_grad():
            # min_new_tokens = max_new_tokens: every completion has exactly C tokens, so the completion
            # tokens per step are P x G x C on both sides whatever the model would have stopped at.
            out = model.generate(**enc, do_sample=True, max_new_tokens=C, min_new_tokens=C,
                                 num_return_sequences=G, pad_token_id=tok.pad_token_id)
        completions = out[:, enc["input_ids"].shape[1]:].tolist()  # [P*G, C], ordered p0g0, p0g1, ...
    if any(len(c) != C for c in completions):
        raise RuntimeError(f"sampling returned completions of lengths {sorted({len(c) for c in completions})}, "
                           f"expected exactly {C}")
    return Rollouts(texts, prompt_ids, completions, [stand_in_reward(c) for c in completions], G)


# -- memory ------------------------------------------------------------------------------------------


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class TrainPhaseMemory:
    """Resident-set high-water mark of this process from construction on (Linux ``clear_refs``).

    Writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS (Linux >= 4.0,
    proc(5)), so the peak read later is the peak of the phase that follows, weights included. Where
    that is unavailable the process-lifetime ``ru_maxrss`` is returned and ``reset`` is False.
    """

    def __init__(self) -> None:
        self.baseline_kb = _proc_status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False

    def peak_gb(self) -> float:
        kb = _proc_status_kb("VmHWM") if self.reset else None
        if kb is None:
            import resource

            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return kb / 2**20

    def baseline_gb(self) -> float | None:
        return None if self.baseline_kb is None else self.baseline_kb / 2**20


def _summary(side: str, spec: BenchSpec, ro: Rollouts, times: list[float], mem: TrainPhaseMemory,
             extra: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median(times)
    mean = statistics.fmean(times)
    return {
        "side": side, "step_seconds": times, "median_s_per_step": med, "mean_s_per_step": mean,
        "tokens_per_step": ro.tokens_per_step, "completion_tokens_per_step": ro.completion_tokens_per_step,
        "sequences_per_step": ro.n_sequences,
        "tokens_per_s": ro.tokens_per_step / med, "tokens_per_s_mean": ro.tokens_per_step / mean,
        "train_peak_rss_gb": mem.peak_gb(), "rss_before_train_gb": mem.baseline_gb(), "hwm_reset": mem.reset,
        "lora_r": spec.lora_r, **extra,
    }


# -- flywheel --------------------------------------------------------------------------------------


def run_flywheel(spec: BenchSpec, ro: Rollouts) -> dict[str, Any]:
    """``warmup_steps + steps`` optimizer steps of ``flywheel.train.trainer.Trainer`` on ``ro``."""
    import torch

    from flywheel.advantages import compute_advantages
    from flywheel.config import TrainConfig
    from flywheel.policy.models import load_model
    from flywheel.train.data import TrainSample
    from flywheel.train.trainer import Trainer, TrainerOptions

    torch.manual_seed(spec.seed)
    model, tok = load_model(spec.model, home=Path(spec.home))
    groups = [str(ro.prompt_of(i)) for i in range(ro.n_sequences)]
    adv = compute_advantages(torch.tensor(ro.rewards), groups, "none").tolist()
    samples = [
        TrainSample(prompt_ids=list(ro.prompt_ids[ro.prompt_of(i)]), completion_ids=list(c), loss_mask=[1] * len(c),
                    advantage=adv[i], reward=ro.rewards[i], group_id=groups[i])
        for i, c in enumerate(ro.completion_ids)
    ]
    opts = TrainerOptions(
        objective="dapo", lr=spec.lr, total_steps=spec.warmup_steps + spec.steps, pad_id=int(tok.pad_token_id),
        train=TrainConfig(warmup_steps=0, weight_decay=0.0, grad_clip=1.0, micro_batch_tokens=spec.micro_batch * ro.longest,
                          packing=False, gradient_checkpointing=spec.gradient_checkpointing, lora_r=spec.lora_r,
                          lora_alpha=max(1, 2 * spec.lora_r), logprob_impl="fused", log_entropy=True),
    )
    tr = Trainer(model, opts)
    mem = TrainPhaseMemory()
    times: list[float] = []
    first: dict[str, float] = {}
    for k in range(spec.warmup_steps + spec.steps):
        t0 = time.perf_counter()
        m = tr.step(samples)
        dt = time.perf_counter() - t0
        if m.tokens != ro.tokens_per_step:  # the numerator both sides share must be what the trainer saw
            raise RuntimeError(f"flywheel step saw {m.tokens} tokens, rollouts hold {ro.tokens_per_step}")
        if k == 0:
            first = {"grad_norm_step1": m.grad_norm, "loss_step1": m.loss}
        if k >= spec.warmup_steps:
            times.append(dt)
    opt = tr.optimizer
    return _summary("flywheel", spec, ro, times, mem, {
        **first, "optimizer": f"torch.optim.AdamW(foreach={opt.defaults.get('foreach')}, "
                              f"fused={opt.defaults.get('fused')})",
        "micro_batches": len(tr.micro_batches(samples)), "trainable_params": tr.n_trainable,
    })


# -- TRL -------------------------------------------------------------------------------------------


def run_trl(spec: BenchSpec, ro: Rollouts) -> dict[str, Any]:
    """``warmup_steps + steps`` optimizer steps of ``trl.GRPOTrainer`` on ``ro`` (generation = lookup)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flywheel.policy.models import load_model

    torch.manual_seed(spec.seed)
    model, tok = load_model(spec.model, home=Path(spec.home))
    index = {t: p for p, t in enumerate(ro.prompt_texts)}
    if len(index) != len(ro.prompt_texts):
        raise ValueError("duplicate rendered prompts: the TRL lookup needs distinct prompt texts")
    G = ro.generations

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        # TRL's sampler repeats each prompt G times ([p0, p0, p1, p1] for G = 2); the k-th occurrence
        # gets the k-th pre-sampled completion, so a step sees each (prompt, completion) pair once.
        seen: Counter[int] = Counter()
        p_ids, c_ids = [], []
        for text in prompts:
            p = index[text]
            k = seen[p]
            seen[p] += 1
            if k >= G:
                raise ValueError(f"prompt {p} requested {k + 1} times in one generation batch, only {G} completions")
            p_ids.append(list(ro.prompt_ids[p]))
            c_ids.append(list(ro.completion_ids[p * G + k]))
        return {"prompt_ids": p_ids, "completion_ids": c_ids, "logprobs": None}

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [stand_in_reward(c) for c in completion_ids]

    class TimedGRPOTrainer(GRPOTrainer):
        """Accumulates the wall time spent in generation + scoring, to subtract it from step times."""

        generation_s = 0.0

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generation_s += time.perf_counter() - t0

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: TimedGRPOTrainer | None = None
            self.times: list[float] = []
            self.logs: list[dict[str, float]] = []
            self._t0 = self._g0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._g0 = self.trainer.generation_s
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            dt = time.perf_counter() - self._t0
            self.times.append(dt - (self.trainer.generation_s - self._g0))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs and "grad_norm" in logs:
                self.logs.append(dict(logs))

    n = ro.n_sequences
    out_dir = tempfile.mkdtemp(prefix="bench-vs-trl-")
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=spec.micro_batch,
        gradient_accumulation_steps=n // spec.micro_batch, num_generations=G,
        max_completion_length=spec.completion_len, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
        scale_rewards="none", num_iterations=1, learning_rate=spec.lr, weight_decay=0.0, warmup_steps=0,
        max_grad_norm=1.0, max_steps=spec.warmup_steps + spec.steps, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=spec.gradient_checkpointing, use_cpu=True, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=spec.seed, temperature=1.0, log_completions=False,
        dataloader_num_workers=0,
    )
    peft_config = None
    if spec.lora_r > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=spec.lora_r, lora_alpha=2 * spec.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": ro.prompt_texts}),
        processing_class=tok, callbacks=[clock], peft_config=peft_config, rollout_func=rollout_func,
    )
    clock.trainer = trainer
    mem = TrainPhaseMemory()
    trainer.train()
    if len(clock.times) != spec.warmup_steps + spec.steps:
        raise RuntimeError(f"TRL ran {len(clock.times)} optimizer steps, expected {spec.warmup_steps + spec.steps}")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    first = clock.logs[0] if clock.logs else {}
    return _summary("trl", spec, ro, clock.times[spec.warmup_steps:], mem, {
        "grad_norm_step1": first.get("grad_norm"), "loss_step1": first.get("loss"),
        "optimizer": f"{type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, 'optimizer') else trainer.optimizer).__name__}"
                     f" (optim={args.optim})",
        "micro_batches": args.gradient_accumulation_steps, "trainable_params": trainable,
        "generation_s_excluded": trainer.generation_s,
    })


RUNNERS = {"flywheel": run_flywheel, "trl": run_trl}


# -- driver ----------------------------------------------------------------------------------------


def _load_rollouts(path: str) -> Rollouts:
    return Rollouts(**json.loads(Path(path).read_text()))


def _child(kind: str, spec: BenchSpec, data: str, out: str) -> None:
    if kind == "prep":
        Path(data).write_text(json.dumps(asdict(prepare_rollouts(spec))))
        return
    res = RUNNERS[kind](spec, _load_rollouts(data))
    Path(out).write_text(json.dumps(res))


def run_side(kind: str, spec: BenchSpec, data: str, out: str, timeout_s: float) -> dict[str, Any]:
    """One side in a fresh subprocess; returns its result dict plus ``process_peak_rss_gb`` (ru_maxrss)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--spec", json.dumps(asdict(spec)),
           "--data", data, "--out", out]
    log_path = out + ".log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + timeout_s
        while True:
            # wait4 reaps this child and returns its *own* rusage (RUSAGE_CHILDREN would be the maximum
            # over every child so far, which mixes the two sides).
            pid, status, rus = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise SystemExit(f"bench_vs_trl: the {kind} child exceeded {timeout_s:.0f} s and was killed "
                                 f"(log: {log_path})")
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting on a reaped pid
    if proc.returncode != 0:
        tail = "\n".join(Path(log_path).read_text().strip().splitlines()[-30:])
        raise SystemExit(f"bench_vs_trl: the {kind} child failed (exit {proc.returncode}):\n{tail}")
    res: dict[str, Any] = json.loads(Path(out).read_text()) if kind != "prep" else {}
    res["process_peak_rss_gb"] = rus.ru_maxrss / 2**20
    res["child_wall_s"] = time.perf_counter() - t0
    return res


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several fresh-process runs of one side -> one row: step times pooled, peaks the maximum."""
    row = dict(runs[0])
    if len(runs) == 1:
        return row
    times = [t for r in runs for t in r["step_seconds"]]
    med, mean = statistics.median(times), statistics.fmean(times)
    row.update(step_seconds=times, median_s_per_step=med, mean_s_per_step=mean,
               tokens_per_s=row["tokens_per_step"] / med, tokens_per_s_mean=row["tokens_per_step"] / mean,
               train_peak_rss_gb=max(r["train_peak_rss_gb"] for r in runs),
               process_peak_rss_gb=max(r["process_peak_rss_gb"] for r in runs),
               generation_s_excluded=sum(r.get("generation_s_excluded", 0.0) for r in runs))
    return row


def _fmt_load() -> str:
    try:
        a, b, c = os.getloadavg()
    except OSError:
        return "load average unavailable"
    return f"load average {a:.2f} / {b:.2f} / {c:.2f} (1/5/15 min) on {os.cpu_count()} CPUs"


def verdict(ratio: float, target: float, *, at_least: bool) -> str:
    ok = ratio >= target if at_least else ratio <= target
    return f"{'MET' if ok else 'NOT MET'} (target {'>=' if at_least else '<='} {target}x)"


def report(spec: BenchSpec, rows: dict[str, dict[str, Any]]) -> str:
    lines = []
    hdr = (f"{'side':9s} {'steps':>5s} {'seq/step':>8s} {'tok/step':>8s} {'s/step med':>10s} {'s/step mean':>11s} "
           f"{'tok/s':>8s} {'train peak RSS':>14s} {'process peak':>12s} {'grad-norm@1':>11s}")
    lines.append(hdr)
    for side in SIDES:
        r = rows[side]
        gn = r.get("grad_norm_step1")
        lines.append(
            f"{side:9s} {len(r['step_seconds']):5d} {r['sequences_per_step']:8d} {r['tokens_per_step']:8d} "
            f"{r['median_s_per_step']:10.2f} {r['mean_s_per_step']:11.2f} {r['tokens_per_s']:8.1f} "
            f"{r['train_peak_rss_gb']:11.2f} GB {r['process_peak_rss_gb']:9.2f} GB "
            f"{(f'{gn:.4f}' if gn is not None else 'n/a'):>11s}"
        )
    f, t = rows["flywheel"], rows["trl"]
    thr = f["tokens_per_s"] / t["tokens_per_s"]
    mem = f["train_peak_rss_gb"] / t["train_peak_rss_gb"]
    proc_mem = f["process_peak_rss_gb"] / t["process_peak_rss_gb"]
    lines.append(f"optimizers: flywheel {f['optimizer']}; trl {t['optimizer']}")
    lines.append(f"micro-batches per step: flywheel {f['micro_batches']}, trl {t['micro_batches']}; "
                 f"trainable parameters: flywheel {f['trainable_params']:,}, trl {t['trainable_params']:,}")
    lines.append(f"TRL generation + scoring excluded from its step times: {t['generation_s_excluded']:.2f} s in all")
    lines.append(f"throughput ours/TRL (median step): x{thr:.2f}  {verdict(thr, THROUGHPUT_TARGET, at_least=True)}; "
                 f"(mean step: x{f['tokens_per_s_mean'] / t['tokens_per_s_mean']:.2f})")
    lines.append(f"train peak RSS ours/TRL: x{mem:.2f}  {verdict(mem, MEMORY_TARGET, at_least=False)}; "
                 f"(process peak incl. loading: x{proc_mem:.2f})")
    return "\n".join(lines)


def spec_from_args(a: argparse.Namespace) -> BenchSpec:
    base = BenchSpec(prompts=4, generations=2, completion_len=32, steps=2, micro_batch=4) if a.quick else BenchSpec()
    for k in ("model", "home", "prompts", "generations", "completion_len", "steps", "warmup_steps", "micro_batch",
              "lora_r", "lr", "prompt_style", "completions", "seed"):
        v = getattr(a, k)
        if v is not None:
            setattr(base, k, v)
    base.gradient_checkpointing = bool(a.gradient_checkpointing)
    base.validate()
    return base


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2 generations x 32 tokens, 2 timed steps")
    ap.add_argument("--model", default=None, help="smollm2-135m (default), tiny, or a local HF directory")
    ap.add_argument("--home", default=None, help="flywheel home holding the converted model ($FLYWHEEL_HOME)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--generations", type=int, default=None)
    ap.add_argument("--completion-len", dest="completion_len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps per side")
    ap.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=None)
    ap.add_argument("--micro-batch", dest="micro_batch", type=int, default=None, help="sequences per micro-batch")
    ap.add_argument("--lora-r", dest="lora_r", type=int, default=None, help="LoRA rank (0 = full fine-tuning)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--prompt-style", dest="prompt_style", choices=("question", "tools"), default=None)
    ap.add_argument("--completions", choices=("sampled", "random"), default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="on for both sides (default off for both)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="fresh-process runs per side, order alternated; step times pooled (noisy machines)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--child", choices=("prep", *SIDES), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child, BenchSpec(**json.loads(a.spec)), a.data, a.out)
        return
    if a.home is None:
        a.home = os.environ.get("FLYWHEEL_HOME", ".flywheel")
    spec = spec_from_args(a)
    if a.repeats < 1:
        ap.error('--repeats must be >= 1')
    print(f"bench_vs_trl: {_fmt_load()} at start (shared machine: timings are noisy)", flush=True)
    print(f"config: {spec.model}, {'full fine-tuning' if spec.lora_r == 0 else f'LoRA r={spec.lora_r}'}, "
          f"{spec.prompts} prompts x {spec.generations} generations x {spec.completion_len} tokens "
          f"({spec.prompt_style} prompts, {spec.completions} completions), micro-batch {spec.micro_batch}, "
          f"{spec.warmup_steps} warm-up + {spec.steps} timed steps, loss dapo, fp32, gradient checkpointing "
          f"{'on' if spec.gradient_checkpointing else 'off'}", flush=True)
    from flywheel.policy.models import ensure_base_model

    ensure_base_model(spec.model, Path(spec.home))  # convert once, outside every measurement
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        data = str(Path(tmp) / "rollouts.json")
        t0 = time.perf_counter()
        run_side("prep", spec, data, str(Path(tmp) / "prep.json"), a.timeout)
        ro = _load_rollouts(data)
        print(f"rollouts: {ro.n_sequences} sequences, {ro.tokens_per_step} tokens per step "
              f"({ro.completion_tokens_per_step} completion), longest {ro.longest}; prepared in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for rep in range(a.repeats):
            # Alternate the order (A B, B A, ...) so a drift in the machine's load hits both sides alike.
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):  # one heavy child at a time
                print(f"{side} (run {rep + 1}/{a.repeats}): starting, {_fmt_load()}", flush=True)
                r = run_side(side, spec, data, str(Path(tmp) / f"{side}-{rep}.json"), a.timeout)
                runs[side].append(r)
                print(f"{side}: {r['tokens_per_s']:.1f} tok/s (median of {len(r['step_seconds'])} steps: "
                      f"{', '.join(f'{s:.2f}' for s in r['step_seconds'])} s), train peak RSS "
                      f"{r['train_peak_rss_gb']:.2f} GB, child wall {r['child_wall_s']:.0f} s", flush=True)
        rows = {side: pool_runs(runs[side]) for side in SIDES}
    print(report(spec, rows), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"spec": asdict(spec), "rows": rows, "load_at_end": os.getloadavg()},
                                           indent=1))


if __name__ == "__main__":
    main()
