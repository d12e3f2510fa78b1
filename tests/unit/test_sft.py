"""SFT: loss masking (hand-built), held-out demonstrations refused (split and lineage), rendering."""

from __future__ import annotations

import pytest
import torch

from flywheel.train.data import TrainSample, make_micro_batches
from flywheel.train.demos import Demonstration, HeldOutDemonstrationError, check_demonstrations
from flywheel.train.losses import LossInputs, sft_loss
from flywheel.train.trainer import sequence_logprobs


def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    ))


def test_gradients_flow_only_from_answer_tokens():
    # Hand-built: prompt [1, 5, 6, 7] (4 tokens), answer [9, 10, 2] of which the trainer sees all three
    # as completion; loss mask [1, 1, 1]. The hidden state at position t predicts token t+1, so only
    # positions 3, 4, 5 (predicting 9, 10, 2) may receive gradient from the loss; positions 0..2
    # predict prompt tokens and position 6 predicts nothing.
    model = tiny_lm()
    s = TrainSample(prompt_ids=[1, 5, 6, 7], completion_ids=[9, 10, 2], loss_mask=[1, 1, 1])
    (mb,) = make_micro_batches([s], token_budget=64)
    captured = {}

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["h"] = out

    hook = model.model.norm.register_forward_hook(keep)  # the final norm's output = last hidden states
    logp, _ = sequence_logprobs(model, mb)
    hook.remove()
    out = sft_loss(LossInputs(logp=logp, mask=mb.mask, advantages=torch.zeros(1)))
    out.loss.backward()
    g = captured["h"].grad[0].abs().sum(-1)  # [T]
    assert (g[[0, 1, 2, 6]] == 0).all()
    assert (g[[3, 4, 5]] > 0).all()
    # The loss is the mean NLL of exactly the three answer tokens.
    full = torch.log_softmax(model(input_ids=mb.input_ids).logits[0].float(), -1)
    expected = -(full[3, 9] + full[4, 10] + full[5, 2]) / 3
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_masked_answer_token_gets_no_gradient():
    # A tool-observation token inside the completion (mask 0) must not be trained on either.
    model = tiny_lm()
    s = TrainSample(prompt_ids=[1, 5], completion_ids=[9, 11, 10], loss_mask=[1, 0, 1])
    (mb,) = make_micro_batches([s], token_budget=64)
    logp, _ = sequence_logprobs(model, mb)
    logp.retain_grad()
    sft_loss(LossInputs(logp=logp, mask=mb.mask, advantages=torch.zeros(1))).loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.0, -0.5])


def demo(split="train", source="eval:e1"):
    return Demonstration(messages=[{"role": "user", "content": "weather in Paris?"}], tools=None,
                         source_entity_id=source, split=split, answer_content="sunny")


def test_heldout_demonstration_is_refused():
    with pytest.raises(HeldOutDemonstrationError, match="eval:planted.*held-out"):
        check_demonstrations([demo(), demo("heldout", "eval:planted")])
    check_demonstrations([demo()])  # train split passes


def test_heldout_ancestor_is_caught_through_lineage(store):
    # A synthetic task labelled "train" but derived from a held-out eval: lineage catches it.
    from flywheel.store import NewEvent

    store.append("eval:h1", NewEvent("eval.created", {"entity_id": "eval:h1", "split": "heldout"}, ["failure:f1"]))
    store.append("synth:s1", NewEvent("synth.batch_accepted", {"entity_id": "synth:s1"}, ["eval:h1"]))
    store.append("eval:t1", NewEvent("eval.created", {"entity_id": "eval:t1", "split": "train"}, ["failure:f2"]))
    check_demonstrations([demo(source="eval:t1")], store)
    with pytest.raises(HeldOutDemonstrationError, match="synth:s1 descends from held-out eval eval:h1"):
        check_demonstrations([demo(source="eval:t1"), demo(source="synth:s1")], store)


def test_train_sft_refuses_heldout_before_loading_anything(cfg, store):
    from flywheel.tracking import Tracker
    from flywheel.train.stage import train_sft

    with pytest.raises(HeldOutDemonstrationError):
        train_sft(cfg, store, None, Tracker(cfg), [demo("heldout", "eval:planted")], base="/nonexistent")
    assert store.read("run:*") == []


def test_demonstrations_of_one_synthesis_batch_are_spread_over_the_steps_not_one_oversized_batch(tmp_path):
    """Issue 30: every synthetic task of a batch names the same source (``synth:<id>``), and `batches` keeps
    a group whole. With the source as the group, a whole synthesis batch landed in one step (12 + filler
    sequences where the step should hold 4) and the other steps of the targeted arm saw no synthetic example."""
    from transformers import AutoTokenizer

    from flywheel.policy.models import ensure_base_model
    from flywheel.train.sft import demonstration_samples
    from flywheel.train.trainer import batches

    tok = AutoTokenizer.from_pretrained(str(ensure_base_model("tiny", tmp_path / "models")))
    real = [demo(source=f"eval:e{i}") for i in range(4)]
    synth = [demo(source="synth:one-batch") for _ in range(12)]
    samples = demonstration_samples(tok, real + synth)
    assert len({s.group_id for s in samples}) == 16
    steps = list(batches(samples, 4, 8, seed=0))
    assert [len(b) for b in steps] == [4] * 8
    per_step = [sum(s.group_id.startswith("synth:") for s in b) for b in steps]
    assert sum(per_step[:4]) == 12 and sum(x > 0 for x in per_step) >= 4  # one pass: every variant once, spread


def test_the_dev_loss_is_the_sft_loss_of_the_answers_per_loss_token():
    """mean_answer_nll (the learning stage's dev loss) is the trainer's own teacher-forced log-likelihood of
    the answer tokens, masked tokens left out, averaged per loss token over the samples -- and it drops
    when the model is trained toward those answers."""
    from flywheel.train.sft import mean_answer_nll

    model = tiny_lm().eval()
    samples = [TrainSample(prompt_ids=[1, 5, 6, 7], completion_ids=[9, 10, 2], loss_mask=[1, 1, 1]),
               TrainSample(prompt_ids=[3], completion_ids=[4, 8, 11, 2], loss_mask=[1, 0, 1, 1])]
    with torch.no_grad():
        (mb,) = make_micro_batches(samples, token_budget=64)
        logp, _ = sequence_logprobs(model, mb)
    mask = torch.zeros_like(logp)
    for k, s in enumerate(mb.samples):
        mask[k, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=logp.dtype)
    expected = float(-(logp * mask).sum() / mask.sum())
    got = mean_answer_nll(model, samples)
    assert got == pytest.approx(expected, rel=1e-5) and got > 0
    # the per-token mean, not a mean of per-sample means (the two samples have 3 and 3 loss tokens here, so
    # check with an unequal pair too)
    one = mean_answer_nll(model, samples[:1])
    two = mean_answer_nll(model, samples[1:])
    longer = [samples[0], samples[0], samples[1]]
    assert mean_answer_nll(model, longer) == pytest.approx((2 * 3 * one + 3 * two) / 9, rel=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        (mb,) = make_micro_batches(samples, token_budget=64)
        lp, _ = sequence_logprobs(model, mb)
        (-(lp * mask).sum() / mask.sum()).backward()
        opt.step()
    assert mean_answer_nll(model, samples) < got
    with pytest.raises(ValueError, match="loss token"):
        mean_answer_nll(model, [TrainSample(prompt_ids=[1], completion_ids=[2], loss_mask=[0])])


def test_decision_weight_lands_on_the_tokens_that_decide_the_answers_structure(tmp_path):
    """Issue 30: the shipped model's unseen errors are mostly structural -- an extra call after the right one,
    an extra argument, the wrong function. ``decision_weight`` weights the tokens where those are decided:
    the first answer token, function and argument names, and the character after each value and each call.
    Copied values and the rest of the punctuation keep weight 1; 1.0 is plain SFT, bit for bit."""
    from transformers import AutoTokenizer

    from flywheel.policy.models import ensure_base_model
    from flywheel.train.sft import demonstration_samples
    from flywheel.vocab.toolcalls import ToolCall

    tok = AutoTokenizer.from_pretrained(str(ensure_base_model("tiny", tmp_path / "models")))
    calls = [ToolCall(name="get_weather", arguments={"city": "Tel Aviv, Israel", "unit": "celsius"})]
    d = Demonstration(messages=[{"role": "user", "content": "weather in Tel Aviv?"}], tools=None,
                      source_entity_id="eval:e1", split="train", answer_calls=calls)
    (plain,) = demonstration_samples(tok, [d])
    (weighted,) = demonstration_samples(tok, [d], decision_weight=3.0)
    assert plain.completion_ids == weighted.completion_ids and set(plain.loss_mask) == {1.0}
    pieces = [tok.decode([t]) for t in weighted.completion_ids]
    heavy = "".join(p for p, w in zip(pieces, weighted.loss_mask, strict=True) if w == 3.0)
    light = "".join(p for p, w in zip(pieces, weighted.loss_mask, strict=True) if w == 1.0)
    assert set(weighted.loss_mask) == {1.0, 3.0}
    for decided in ("get_weather", "city", "unit"):
        assert decided in heavy and decided not in light
    for copied in ("Tel", "Aviv", "Israel", "celsius"):
        assert copied in light and copied not in heavy
    assert weighted.loss_mask[0] == 3.0  # a call or prose
    # after the last argument's value `)`, after the call `]`: both decided; the end-of-turn follows `]`
    assert heavy.rstrip().endswith(")]") or heavy.rstrip().endswith("]")
    assert weighted.loss_mask[-1] == 1.0  # the end-of-turn itself is forced by `]`, not decided


def test_a_weighted_answer_token_gets_its_weight_of_the_gradient_normalised_by_the_token_count():
    # decision_weight's contract with the trainer: a loss-mask value other than 0/1 weights that token's
    # NLL, and the step still divides by the count of answer tokens (3 here), not by the weights' sum.
    model = tiny_lm()
    s = TrainSample(prompt_ids=[1, 5], completion_ids=[9, 11, 10], loss_mask=[3.0, 1.0, 1.0])
    (mb,) = make_micro_batches([s], token_budget=64)
    logp, _ = sequence_logprobs(model, mb)
    logp.retain_grad()
    sft_loss(LossInputs(logp=logp, mask=mb.mask, advantages=torch.zeros(1), num_tokens=s.n_loss_tokens)).loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1 / 3, -1 / 3])
