"""SFT warm start teaches a tiny random model a fixed tool-call format.

Two demonstrations, rendered through the shared format (``flywheel.policy.format``), train the
``tiny`` model (random, 64-d, SmolLM2 tokenizer) through the real ``train_sft`` stage. Within the
fixed budget the loss must fall and the greedy answer must parse as a call of the demonstrated
function with the demonstrated argument; the run is registered as ``challenger``.
"""

from __future__ import annotations

import pytest
import torch

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
STEPS = 30


def greedy(model, tok, prompt: str, max_new: int = 24) -> str:
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == eot:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tok.decode(out)


@pytest.mark.slow
def test_tiny_model_learns_the_call_format(cfg, store, tmp_path_factory):
    from flywheel.policy.format import render_prompt
    from flywheel.policy.models import ensure_base_model, load_model
    from flywheel.tracking import Tracker
    from flywheel.train.demos import Demonstration
    from flywheel.train.stage import train_sft
    from flywheel.verifiers import ToolCall, parse_tool_calls

    base = str(ensure_base_model("tiny", tmp_path_factory.mktemp("models")))
    demos = [
        Demonstration(messages=[{"role": "user", "content": f"What is the weather in {c}?"}], tools=TOOLS,
                      source_entity_id=f"eval:{c.lower()}", split="train",
                      answer_calls=[ToolCall("get_weather", {"city": c})])
        for c in ("Paris", "Oslo")
    ]
    cfg.train.lora_r = 0
    cfg.train.batch_size = 2
    cfg.train.warmup_steps = 0
    tracker = Tracker(cfg)
    cfg.train.min_lr_ratio = 0.1
    res = train_sft(cfg, store, None, tracker, demos, base=base, steps=STEPS, lr=1e-2)
    assert res.metrics["loss"] < 0.25 * res.metrics["first_loss"], res.metrics
    assert set(store.read(res.run_id)[0].causation) == {"eval:paris", "eval:oslo", "model:base/tiny"}
    model, tok = load_model(str(tracker.model_dir(cfg.cycle.model_name, res.model_version)), home=cfg.home)
    text = greedy(model, tok, render_prompt(tok, demos[0].messages, TOOLS))
    parsed = parse_tool_calls(text)
    assert parsed.error is None and parsed.calls, f"greedy output does not parse: {text!r}"
    assert parsed.calls[0].name == "get_weather"
