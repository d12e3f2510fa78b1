"""SFT warm start: demonstrations -> rendered (prompt, answer) token samples, held-out data refused.

When the policy never succeeds (every GRPO group scores the same), group advantages are all zero and
GRPO learns nothing; a short supervised phase on demonstrations teaches the answer format first. Demonstrations come from the flywheel itself: corrections of train-split failures,
reference answers of accepted synthetic tasks, successful production traces. The evals stage builds
them; this module renders and trains on them.

Rendering goes through ``flywheel.policy.format`` — the ONE format shared with rollouts and serving:
``prompt = render_prompt(tokenizer, messages, tools)`` and
``target = render_answer(calls, content) + <end-of-turn>``, where the end-of-turn string is read off
the tokenizer's own chat template (``<|im_end|>`` for SmolLM2), so a trained model stops where the
server expects it to.

Guarantees
- Held-out demonstrations are refused before training (:func:`flywheel.train.demos.check_demonstrations`,
  by split and by lineage).
- Loss only on answer tokens: the prompt (system, tools, user and tool-observation turns) has no
  loss mask; the end-of-turn token is part of the answer (the model must learn to stop).

Not covered: near-duplicate detection of held-out prompts (the synth stage decontaminates with
MinHash before anything becomes a demonstration); multi-turn demonstrations with several assistant
turns (only the final answer is trained; earlier assistant turns are part of the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flywheel.policy.format import render_answer, render_prompt
from flywheel.train.data import TrainSample
from flywheel.train.demos import Demonstration


def end_of_turn(tokenizer: Any) -> str:
    """The text the chat template puts after an assistant message's content (e.g. ``<|im_end|>``)."""
    marker = "\u2063FLYWHEEL\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    tail = text.split(marker, 1)[1] if marker in text else ""
    eot = tail.strip()
    if eot:
        # Keep only the first special-looking token; templates may append a newline or a BOS.
        return eot.split()[0]
    if tokenizer.eos_token:
        return tokenizer.eos_token
    raise ValueError("cannot determine the end-of-turn token: the chat template adds nothing after "
                     "an assistant message and the tokenizer has no eos_token")


def render_demonstration(tokenizer: Any, demo: Demonstration, eot: str | None = None) -> tuple[str, str]:
    """``(prompt_text, target_text)`` of a demonstration, through the shared format."""
    prompt = render_prompt(tokenizer, demo.messages, demo.tools)
    target = render_answer(demo.answer_calls or None, demo.answer_content) + (eot or end_of_turn(tokenizer))
    return prompt, target


def decision_token_weights(tokenizer: Any, demo: Demonstration, target: str, weight: float) -> list[float]:
    """Per-token loss weights of ``target`` (:func:`render_demonstration`'s, tokenised without special
    tokens): ``weight`` on the tokens where the answer's structure is decided, 1.0 elsewhere.

    Decided: the answer's first token (a call or prose), and in the calls each function name, argument
    name, and the character after each argument value and each call (another one, or no more), the spans of
    :func:`flywheel.vocab.toolcalls.tool_call_decisions`. A token that overlaps a span carries its weight.
    The tokenizer must give character offsets (a "fast" tokenizer)."""
    from flywheel.vocab.toolcalls import tool_call_decisions

    enc = tokenizer(target, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    spans: list[tuple[int, int]] = []
    if demo.answer_calls:
        calls_text, decided = tool_call_decisions(list(demo.answer_calls))
        start = target.rfind(calls_text)
        if start < 0:
            raise ValueError(f"demonstration from {demo.source_entity_id}: its calls are not in its rendered answer")
        spans = [(start + a, start + b) for a, b, _ in decided]
    out = [1.0] * len(offsets)
    for t, (a, b) in enumerate(offsets):
        if t == 0 or any(a < e and s < b for s, e in spans):
            out[t] = weight
    return out


def demonstration_samples(
    tokenizer: Any, demos: Sequence[Demonstration], *, max_seq_len: int | None = None,
    decision_weight: float = 1.0,
) -> list[TrainSample]:
    """Tokenised SFT samples: loss mask 1 on every answer token (end-of-turn included), 0 on the prompt.
    ``decision_weight`` != 1 weights the tokens that decide the answer's structure
    (:func:`decision_token_weights`; the loss stays normalised by the count of answer tokens).

    Each sample is its own group (``<source>#<index>``): :func:`flywheel.train.trainer.batches` keeps a
    group whole in one batch, and demonstrations share a source when they come from one synthesis batch
    (``synth:<id>``, every variant of it) or repeat an item, so grouping by source put a whole synthesis
    batch into one oversized step and no synthetic example into the others."""
    eot = end_of_turn(tokenizer)
    out = []
    for i, d in enumerate(demos):
        prompt, target = render_demonstration(tokenizer, d, eot)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(target, add_special_tokens=False)["input_ids"]
        if max_seq_len is not None and len(p) + len(c) > max_seq_len:
            raise ValueError(
                f"demonstration {i} from {d.source_entity_id}: {len(p) + len(c)} tokens > max_seq_len {max_seq_len}"
            )
        mask: list[float] = [1.0] * len(c)
        if decision_weight != 1.0:
            mask = decision_token_weights(tokenizer, d, target, decision_weight)
            if len(mask) != len(c):
                raise ValueError(f"demonstration {i} from {d.source_entity_id}: the answer tokenises differently "
                                 "with character offsets")
        out.append(
            TrainSample(prompt_ids=list(p), completion_ids=list(c), loss_mask=mask, group_id=f"{d.source_entity_id}#{i}")
        )
    return out


def mean_answer_nll(model: Any, samples: Sequence[TrainSample], *, device: Any = "cpu") -> float:
    """Mean negative log-likelihood, in nats per loss token, of the samples' answers under ``model``
    (teacher-forced, no gradient): the SFT loss on data the model did not train on.

    The learning stage scores arms on the dev corrections with it when their greedy answers on the dev
    split tie (``train.dev_tie_break = "partial_credit_then_loss"``). One sequence at a time, unpadded, and
    only the logits that predict answer tokens are computed (``logits_to_keep``)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i, s in enumerate(samples):
            if not s.prompt_ids or not s.completion_ids:
                raise ValueError(f"sample {i} (group {s.group_id!r}) needs a prompt and an answer to be scored")
            c = len(s.completion_ids)
            ids = torch.tensor([[*s.prompt_ids, *s.completion_ids]], dtype=torch.long, device=device)
            logits = model(input_ids=ids, logits_to_keep=c + 1).logits[0, :-1].float()  # rows predicting the answer
            target = ids[0, -c:]
            nll = -torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
            mask = torch.tensor(s.loss_mask, dtype=torch.bool, device=nll.device)
            total += float(nll[mask].sum())
            count += int(mask.sum())
    if count == 0:
        raise ValueError("mean_answer_nll: no loss token in the samples")
    return total / count
