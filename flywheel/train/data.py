"""Training data: rollout Parquet -> samples -> token-budget micro-batches (padded or packed).

A :class:`TrainSample` is one prompt + completion in token ids with a per-completion-token loss mask.
GRPO samples come from rollout datasets (:func:`samples_from_rollouts`); SFT samples from rendered
demonstrations (``flywheel.train.sft``). Both go through :func:`make_micro_batches`, so the two
trainers share batching, packing and the log-prob path.

Guarantees
- Rows with ``infra_error`` set are excluded (an infrastructure failure is never a training signal),
  and counted in :class:`RolloutStats`.
- Advantages are recomputed from ``reward`` (+ DAPO's soft overlong penalty when enabled) over each
  ``group_id`` with the configured scaling, so a dataset filtered after publication (infra errors
  removed) still gets correct group statistics. The stored ``advantage`` column is not trusted.
- Overlong filtering (DAPO) zeroes the loss mask of truncated samples; they still count towards group
  statistics, as in the paper.
- A micro-batch never exceeds the token budget unless one sample alone does (it then forms its own
  micro-batch). Packing concatenates samples in one row with restarting ``position_ids`` and no
  attention mask; transformers (>= 4.53) derives a block-diagonal causal mask from such position ids,
  so packed samples do not attend to each other (a test compares packed and padded log-probs).
- Padded micro-batches are right-padded and carry *no* attention mask either: under causal
  attention a real token only attends to earlier positions, which are all real, so its hidden state is
  the same with or without the padding mask; the padding positions' own outputs are never read (their
  position ids simply continue, so transformers sees one causal sequence per row, not a packed one).
  Without a mask, SDPA runs its fused causal kernel instead of materialising [heads, T, T] attention
  weights for backward. Measured with ``benchmarks/bench_vs_trl.py --quick --prompt-style tools``
  (SmolLM2-135M, CPU, 4 x 386-token micro-batches): train peak RSS 5.25 -> 5.09 GB, step-1 gradient
  norm unchanged; a test compares against per-sequence forwards.
- Shared prefixes (``share_prefix=True``, ``train.share_prompt_prefix``): the tokens every sequence of a
  padded micro-batch starts with (an agent's system prompt and tool list, a chat template, a GRPO
  group's prompt, a preference pair's prompt) become the micro-batch's ``trunk_ids``, encoded once; the
  rows hold only what follows it, with positions continuing from the trunk, and attend to the trunk
  through its keys and values (:func:`flywheel.train.trainer.sequence_logprobs`). Under causal attention
  the trunk's hidden states are the same in every sequence, so the log-probs equal the per-sequence
  forward's and the gradient is the sum of the per-sequence gradients (to float rounding; a test checks
  both). The trunk stops before every sequence's last prompt token, so each completion token is
  predicted from a row position. The budget counts the trunk once and each row's remainder; the
  positions the rows attend over (the trunk once per row, plus the row) stay within
  ``SHARED_KV_FACTOR`` x the budget.

Not covered: truncating samples that exceed ``max_seq_len`` (they are refused with the row named).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch

from flywheel.advantages import AdvantageScale, compute_advantages, soft_overlong_penalty, zero_variance_share
from flywheel.artifacts import ArtifactStore
from flywheel.config import ObjectiveConfig
from flywheel.store import EventStore

REQUIRED_COLUMNS = (
    "group_id", "prompt_token_ids", "completion_token_ids", "sampler_logprobs", "loss_mask",
    "truncated", "reward",
)


class TrainDataError(ValueError):
    """Training data is unusable; the message names the dataset/row and the reason."""


@dataclass
class TrainSample:
    """One training sequence. ``loss_mask``/``sampler_logprobs`` align with ``completion_ids``."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[float]  # 1 = trained, 0 = not; other values weight a token (SFT decision tokens)
    advantage: float = 0.0
    sampler_logprobs: list[float] | None = None
    old_logprobs: list[float] | None = None  # filled by the trainer when the policy moved since sampling
    reward: float = 0.0
    group_id: str = ""
    truncated: bool = False
    task_id: str = ""  # the rollout's task (lets the learning stage keep its dev split out of GRPO)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def n_loss_tokens(self) -> int:
        return int(sum(1 for v in self.loss_mask if v))


@dataclass
class RolloutStats:
    rows: int = 0
    used: int = 0
    infra_errors: int = 0
    truncated: int = 0
    groups: int = 0
    zero_variance_groups: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    pass_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def samples_from_rollouts(
    table: pa.Table,
    *,
    scale: AdvantageScale = "group",
    objective: ObjectiveConfig | None = None,
    max_completion_len: int | None = None,
    source: str = "rollouts",
) -> tuple[list[TrainSample], RolloutStats]:
    """Turn a rollout table (``schemas/rollouts.py``) into samples with recomputed advantages."""
    objective = objective or ObjectiveConfig()
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise TrainDataError(f"{source}: missing rollout columns {missing} (see schemas/rollouts.py)")
    stats = RolloutStats(rows=table.num_rows)
    cols = table.to_pydict()
    n = table.num_rows
    infra = cols.get("infra_error") or [None] * n
    keep = [i for i in range(n) if not infra[i]]
    stats.infra_errors = n - len(keep)
    samples: list[TrainSample] = []
    for i in keep:
        comp = [int(t) for t in cols["completion_token_ids"][i]]
        mask: list[float] = [int(v) for v in cols["loss_mask"][i]]
        lps = [float(v) for v in cols["sampler_logprobs"][i]]
        if len(mask) != len(comp) or len(lps) != len(comp):
            raise TrainDataError(
                f"{source} row {i} (group {cols['group_id'][i]}): completion_token_ids ({len(comp)}), "
                f"loss_mask ({len(mask)}) and sampler_logprobs ({len(lps)}) must have the same length"
            )
        samples.append(
            TrainSample(
                prompt_ids=[int(t) for t in cols["prompt_token_ids"][i]],
                completion_ids=comp,
                loss_mask=mask,
                sampler_logprobs=lps,
                reward=float(cols["reward"][i]),
                group_id=str(cols["group_id"][i]),
                truncated=bool(cols["truncated"][i]),
                task_id=str(cols["task_id"][i]) if "task_id" in cols else "",
            )
        )
    stats.used = len(samples)
    if not samples:
        return samples, stats
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if objective.overlong_cache > 0:
        l_max = objective.max_completion_len or max_completion_len
        if l_max is None:
            raise TrainDataError("overlong_cache > 0 needs max_completion_len (objective or rollout config)")
        lengths = torch.tensor([len(s.completion_ids) for s in samples])
        rewards = rewards + soft_overlong_penalty(lengths, l_max, objective.overlong_cache)
    groups = [s.group_id for s in samples]
    adv = compute_advantages(rewards, groups, scale)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a
        if objective.overlong_filter and s.truncated:
            s.loss_mask = [0] * len(s.loss_mask)
    stats.truncated = sum(s.truncated for s in samples)
    stats.groups = len(set(groups))
    stats.zero_variance_groups = round(zero_variance_share(rewards, groups) * stats.groups)
    raw = torch.tensor([s.reward for s in samples])
    stats.reward_mean = float(raw.mean())
    stats.reward_std = float(raw.std(unbiased=False))
    if "passed" in cols:
        stats.pass_rate = sum(bool(cols["passed"][i]) for i in keep) / len(keep)
    return samples, stats


@dataclass
class MicroBatch:
    """Model inputs of a micro-batch plus the per-sequence completion layout.

    The model sees ``input_ids [R, T]`` (R rows; with packing several sequences share a row). The
    hidden state at flat position ``flat_pos[k]`` predicts ``targets[k]``, the k-th completion token of
    the micro-batch, which lands at ``[seq_row[k], seq_col[k]]`` of the ``[S, C]`` per-sequence tensors
    the losses consume (S sequences, C = longest completion).
    """

    input_ids: torch.Tensor  # [R, T] int64
    attention_mask: torch.Tensor | None  # always None: right padding + causal attention, or packed rows
    # whose restarting position_ids carry the boundaries (module docstring)
    position_ids: torch.Tensor  # [R, T] int64
    flat_pos: torch.Tensor  # [N] int64 index into the flattened [R*T] hidden states
    targets: torch.Tensor  # [N] int64 completion token ids
    seq_row: torch.Tensor  # [N] int64 sequence index in [0, S)
    seq_col: torch.Tensor  # [N] int64 completion position in [0, C)
    mask: torch.Tensor  # [S, C] float32 loss mask
    advantages: torch.Tensor  # [S] float32
    sampler_logp: torch.Tensor | None  # [S, C] float32
    old_logp: torch.Tensor | None  # [S, C] float32
    samples: list[TrainSample] = field(default_factory=list)
    n_real: int = 0  # tokens of the samples (prompt + completion), padding excluded
    trunk_ids: torch.Tensor | None = None  # [1, L] int64: the prefix every row continues (encoded once), or None

    @property
    def n_encoded(self) -> int:
        """Token positions the model runs over, padding included (the trunk once)."""
        trunk = 0 if self.trunk_ids is None else int(self.trunk_ids.shape[1])
        return trunk + int(self.input_ids.numel())

    @property
    def n_computed(self) -> int:
        """The samples' tokens the model runs over, padding excluded: a shared trunk counts once."""
        trunk = 0 if self.trunk_ids is None else int(self.trunk_ids.shape[1])
        return self.n_real - trunk * (len(self.samples) - 1)

    @property
    def n_tokens(self) -> int:
        return self.n_real

    def to(self, device: torch.device | str) -> MicroBatch:
        def mv(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device, non_blocking=True)

        return MicroBatch(
            mv(self.input_ids), mv(self.attention_mask), mv(self.position_ids), mv(self.flat_pos),
            mv(self.targets), mv(self.seq_row), mv(self.seq_col), mv(self.mask), mv(self.advantages),
            mv(self.sampler_logp), mv(self.old_logp), self.samples, self.n_real, mv(self.trunk_ids),
        )

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N]`` per-completion-token values -> ``[S, C]`` (zeros elsewhere), differentiably."""
        out = flat.new_zeros(self.mask.shape)
        return out.index_put((self.seq_row, self.seq_col), flat)


#: With a shared trunk, a micro-batch's rows may attend over at most this many times ``token_budget``
#: key/value positions in all (each row's trunk copy plus its own tokens): the activations stay within the
#: budget, the repeated keys and values (and the attention over them) within a small multiple of it.
SHARED_KV_FACTOR = 4


def common_prefix_len(samples: Sequence[TrainSample]) -> int:
    """Tokens every sample starts with, stopping before the shortest prompt's last token (the trunk of
    :func:`make_micro_batches` with ``share_prefix``: every completion token stays predicted from a row)."""
    if not samples:
        return 0
    first = samples[0].prompt_ids
    n = min(len(s.prompt_ids) for s in samples) - 1  # prompts are never empty (make_micro_batches refuses them)
    for s in samples[1:]:
        k = 0
        while k < n and s.prompt_ids[k] == first[k]:
            k += 1
        n = k
    return n


def _group(samples: Sequence[TrainSample], budget: int, packing: bool, shared: int = 0) -> list[list[TrainSample]]:
    # Longest first: padded rows of similar length waste the least budget (first-fit decreasing).
    # `shared` tokens of every sample are the trunk, counted once per micro-batch (share_prefix).
    order = sorted(samples, key=len, reverse=True)
    groups: list[list[TrainSample]] = []
    if packing:
        loads: list[int] = []
        for s in order:
            for g, load in enumerate(loads):
                if load + len(s) <= budget:
                    groups[g].append(s)
                    loads[g] += len(s)
                    break
            else:
                groups.append([s])
                loads.append(len(s))
        return groups
    cur: list[TrainSample] = []
    for s in order:
        # Sorted by decreasing length, so the first sample of `cur` sets the padded width.
        width = (len(cur[0]) if cur else len(s)) - shared
        n = len(cur) + 1
        # With a trunk, every row still attends over the trunk's keys and values, repeated per row: bound
        # those positions too (SHARED_KV_FACTOR x the budget), or a long shared system prompt with short
        # answers would pack rows until the repeated keys and values dwarf the budget.
        if cur and (shared + n * width > budget or (shared and n * (shared + width) > SHARED_KV_FACTOR * budget)):
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    return groups


def make_micro_batches(
    samples: Sequence[TrainSample],
    *,
    token_budget: int,
    packing: bool = False,
    pad_id: int = 0,
    max_seq_len: int | None = None,
    share_prefix: bool = False,
    min_shared: int = 8,
) -> list[MicroBatch]:
    """Split ``samples`` into micro-batches of at most ``token_budget`` tokens (padded or packed).

    ``share_prefix`` (padded micro-batches only): the tokens a micro-batch's sequences all start with,
    when at least ``min_shared``, are its ``trunk_ids``, encoded once (module docstring)."""
    for i, s in enumerate(samples):
        if not s.completion_ids:
            raise TrainDataError(f"sample {i} (group {s.group_id!r}) has an empty completion")
        if not s.prompt_ids:
            raise TrainDataError(f"sample {i} (group {s.group_id!r}) has an empty prompt: nothing predicts "
                                 "its first completion token")
        if max_seq_len is not None and len(s) > max_seq_len:
            raise TrainDataError(f"sample {i} (group {s.group_id!r}) has {len(s)} tokens > max_seq_len {max_seq_len}")
    share = share_prefix and not packing
    shared = common_prefix_len(samples) if share else 0
    groups = _group(samples, token_budget, packing, shared if shared >= min_shared else 0)
    out = []
    for g in groups:
        trunk = common_prefix_len(g) if share else 0
        out.append(_collate(g, packing=packing, pad_id=pad_id, trunk=trunk if trunk >= min_shared else 0))
    return out


def _collate(group: list[TrainSample], *, packing: bool, pad_id: int, trunk: int = 0) -> MicroBatch:
    S = len(group)
    C = max(len(s.completion_ids) for s in group)
    rows = [[s] for s in group] if not packing else [group]
    L = trunk  # tokens every row's sequence starts with, encoded once in trunk_ids (padded rows only)
    T = max(sum(len(s) for s in row) for row in rows) - L
    R = len(rows)
    ids = torch.full((R, T), pad_id, dtype=torch.int64)
    # Padded rows: positions run on through the padding (one causal sequence per row, see the module
    # docstring); packed rows restart them at every sample.
    pos = torch.arange(T, dtype=torch.int64).repeat(R, 1) if not packing else torch.zeros((R, T), dtype=torch.int64)
    flat_pos, targets, seq_row, seq_col = [], [], [], []
    mask = torch.zeros((S, C), dtype=torch.float32)
    sampler = torch.zeros((S, C), dtype=torch.float32)
    old = torch.zeros((S, C), dtype=torch.float32)
    have_sampler = all(s.sampler_logprobs is not None for s in group)
    have_old = all(s.old_logprobs is not None for s in group)
    k = 0
    if L:
        pos += L
    for r, row in enumerate(rows):
        off = 0
        for s in row:
            toks = (s.prompt_ids + s.completion_ids)[L:]
            n, p = len(toks), len(s.prompt_ids) - L
            ids[r, off : off + n] = torch.tensor(toks)
            pos[r, off : off + n] = torch.arange(L, L + n)
            c = len(s.completion_ids)
            # Hidden state at (row) position p-1+j predicts completion token j (p >= 1: the trunk stops
            # before every prompt's last token).
            flat_pos.extend(range(r * T + off + p - 1, r * T + off + p - 1 + c))
            targets.extend(s.completion_ids)
            seq_row.extend([k] * c)
            seq_col.extend(range(c))
            mask[k, :c] = torch.tensor(s.loss_mask, dtype=torch.float32)
            if have_sampler:
                sampler[k, :c] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
            if have_old:
                old[k, :c] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            off += n
            k += 1
    return MicroBatch(
        input_ids=ids,
        attention_mask=None,
        position_ids=pos,
        flat_pos=torch.tensor(flat_pos, dtype=torch.int64),
        targets=torch.tensor(targets, dtype=torch.int64),
        seq_row=torch.tensor(seq_row, dtype=torch.int64),
        seq_col=torch.tensor(seq_col, dtype=torch.int64),
        mask=mask,
        advantages=torch.tensor([s.advantage for s in group], dtype=torch.float32),
        sampler_logp=sampler if have_sampler else None,
        old_logp=old if have_old else None,
        samples=list(group),
        n_real=sum(len(s) for s in group),
        trunk_ids=torch.tensor([group[0].prompt_ids[:L]], dtype=torch.int64) if L else None,
    )


def load_rollout_tables(store: EventStore, artifacts: ArtifactStore, rollout_ids: Sequence[str]) -> list[tuple[str, pa.Table, dict]]:
    """Resolve ``rollouts:<id>`` entities to their Parquet tables (hash-verified by the store).

    Returns ``(entity_id, table, payload)`` per id; raises :class:`TrainDataError` naming the id when
    it was never published or its artifact is missing.
    """
    out = []
    for rid in rollout_ids:
        eid = rid if rid.startswith("rollouts:") else f"rollouts:{rid}"
        ent = store.entity(eid)
        if ent is None or ent["last_type"] != "rollouts.published":
            raise TrainDataError(f"{eid}: no rollouts.published event in the store")
        payload = ent["state"]
        art = payload.get("artifact") or {}
        if not art.get("sha256"):
            raise TrainDataError(f"{eid}: the rollouts.published payload names no artifact sha256")
        table = artifacts.read_table(art["sha256"])
        if art.get("rows") is not None and table.num_rows != int(art["rows"]):
            raise TrainDataError(f"{eid}: artifact has {table.num_rows} rows, the event says {art['rows']}")
        out.append((eid, table, payload))
    return out
