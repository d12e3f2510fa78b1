"""The shared prompt/answer format: tool prompt injection, call rendering, tool turns, round trips."""

from __future__ import annotations

import json

import pytest

from flywheel.policy.format import (
    TOOL_OUTPUT_TAG,
    build_prompt_messages,
    canonical_tool_doc,
    render_answer,
    render_prompt,
    template_supports_tool_role,
    tool_system_prompt,
    tool_turns_as_user,
)
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.toolcalls import ToolCall, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
BFCL_STYLE = {"name": "math.add", "description": "Add.", "parameters": {"type": "dict", "properties": {}}}


class FakeTokenizer:
    """Renders ChatML like SmolLM2's template; ``chat_template`` decides tool-role support."""

    def __init__(self, template: str = "{{ message['role'] }}") -> None:
        self.chat_template = template
        self.seen: list[dict] | None = None

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        self.seen = messages
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return body + "<|im_start|>assistant\n"


def test_tools_become_a_system_prompt_listing_functions_as_json():
    msgs = build_prompt_messages([{"role": "user", "content": "Weather in Paris?"}], [WEATHER, BFCL_STYLE])
    assert [m["role"] for m in msgs] == ["system", "user"]
    system = msgs[0]["content"]
    assert "[func_name1(params_name1=params_value1" in system
    listed = json.loads(system[system.index("invoke.\n") + len("invoke.\n") :].strip())
    assert [f["name"] for f in listed] == ["get_weather", "math.add"]  # OpenAI wrapper unwrapped, order kept
    assert listed[0]["parameters"]["required"] == ["city"]


def test_existing_system_prompt_is_kept_after_the_tool_prompt():
    msgs = build_prompt_messages(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}], [WEATHER]
    )
    assert len(msgs) == 2
    assert msgs[0]["content"].startswith("You are an expert in composing functions")
    assert msgs[0]["content"].endswith("\n\nYou are terse.")


def test_without_tools_messages_pass_through_and_input_is_not_mutated():
    original = [{"role": "user", "content": "hi", "extra": 1}]
    snapshot = json.dumps(original)
    assert build_prompt_messages(original, None) == [{"role": "user", "content": "hi"}]
    assert build_prompt_messages(original, []) == [{"role": "user", "content": "hi"}]
    assert json.dumps(original) == snapshot


def test_assistant_tool_calls_are_rendered_in_the_answer_format():
    msgs = build_prompt_messages(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "1", "name": "get_weather", "content": "18C"},
        ],
        [WEATHER],
    )
    assert msgs[2] == {"role": "assistant", "content": "[get_weather(city='Paris'), get_weather(city='Rome')]"}
    assert msgs[3] == {"role": "tool", "content": "18C", "name": "get_weather"}
    # what the model saw as its earlier answer parses back to the same calls
    assert parse_tool_calls(msgs[2]["content"]).calls == [
        ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome"})
    ]


def test_malformed_tool_call_arguments_stay_visible_verbatim():
    bad = {"role": "assistant", "content": None,
           "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}
    (_, msg) = build_prompt_messages([{"role": "user", "content": "x"}, bad], None)
    assert "{not json" in msg["content"]


def test_unknown_role_and_non_text_parts_are_rejected_with_the_index():
    with pytest.raises(ValueError, match=r"messages\[1\]: unknown role 'robot'"):
        build_prompt_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], None)
    with pytest.raises(ValueError, match=r"messages\[0\]: only text content parts"):
        build_prompt_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None)
    parts = build_prompt_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], None)
    assert parts[0]["content"] == "ab"


def test_render_prompt_turns_tool_turns_into_tagged_user_turns_without_template_support():
    tok = FakeTokenizer()
    assert not template_supports_tool_role(tok)
    text = render_prompt(tok, [{"role": "user", "content": "q"}, {"role": "tool", "name": "get_weather", "content": "18C"}], [WEATHER])
    assert [m["role"] for m in tok.seen] == ["system", "user", "user"]
    assert tok.seen[2]["content"] == TOOL_OUTPUT_TAG.format(name="get_weather") + "\n18C"
    assert text.endswith("<|im_start|>assistant\n")
    native = FakeTokenizer("{% if message['role'] == 'tool' %}...{% endif %}")
    assert template_supports_tool_role(native)
    render_prompt(native, [{"role": "user", "content": "q"}, {"role": "tool", "content": "18C"}], None)
    assert [m["role"] for m in native.seen] == ["user", "tool"]


def test_tool_turns_as_user_names_unknown_tools_generically():
    assert tool_turns_as_user([{"role": "tool", "content": None}]) == [{"role": "user", "content": "[tool output: tool]\n"}]


def test_render_prompt_with_the_real_smollm2_template(tmp_path_factory):
    from transformers import AutoTokenizer

    from flywheel.policy.models import ensure_tokenizer
    from flywheel.policy.testing import session_tiny_home

    tok = AutoTokenizer.from_pretrained(str(ensure_tokenizer(session_tiny_home(tmp_path_factory))))
    text = render_prompt(tok, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    assert text.startswith("<|im_start|>system\nYou are an expert in composing functions")
    assert '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="must not be empty"):
        render_prompt(tok, [], None)


def test_render_answer_round_trips_through_the_shared_parser():
    calls = [ToolCall("math.add", {"a": 1, "b": 2.5}), ToolCall("get_weather", {"city": "O'Hare", "units": ["c", None]})]
    text = render_answer(calls)
    assert text.startswith("[math.add(a=1, b=2.5), get_weather(")
    assert parse_tool_calls(text).calls == calls
    assert render_answer(content="Paris.") == "Paris."
    assert render_answer(calls[:1], content="Sure.") == "Sure.\n[math.add(a=1, b=2.5)]"
    with pytest.raises(ValueError, match="needs tool_calls or content"):
        render_answer()


# A tool as a client sends it: keys in the author's order, an optional parameter between required ones.
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "Temperature now and for the next hours.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City, Country"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit."},
                "hours": {"type": "integer", "description": "Hours ahead."},
            },
            "required": ["location", "hours"],
        },
    },
}


def test_the_tool_prompt_does_not_depend_on_the_key_order_a_store_returns():
    # Events, suites and training data are canonical JSON (sorted keys): a schema comes back from them as
    # {"description", "name", "parameters": {"properties": {"hours", "location", "unit"}, ...}}. The gate
    # and SFT render the stored task, `serve` the request: both must see the same prompt.
    stored = json.loads(canonical_json(FORECAST))
    assert list(stored["function"]) == ["description", "name", "parameters"]  # what the store does
    msgs = [{"role": "user", "content": "Temperature in Seattle for 3 hours?"}]
    served = render_prompt(FakeTokenizer(), msgs, [FORECAST])
    assert render_prompt(FakeTokenizer(), msgs, [stored]) == served
    # Reversed orders at every level render the same text too.
    def rev(x):
        return {k: rev(x[k]) for k in reversed(list(x))} if isinstance(x, dict) else x
    assert tool_system_prompt([rev(FORECAST)]) == tool_system_prompt([FORECAST])


def test_canonical_tool_doc_lists_required_parameters_first_and_keeps_values():
    doc = canonical_tool_doc(json.loads(canonical_json(FORECAST)))
    assert list(doc) == ["name", "description", "parameters"]
    params = doc["parameters"]
    assert list(params) == ["type", "properties", "required"]
    assert list(params["properties"]) == ["location", "hours", "unit"]  # required in their order, then the rest
    assert list(params["properties"]["unit"]) == ["type", "description", "enum"]
    assert params["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]  # lists keep their order
    assert params["required"] == ["location", "hours"]
    # Unknown keys follow the known ones, sorted; a property named like a schema key is still a name.
    odd = {"name": "f", "x-b": 1, "x-a": 2, "parameters": {"type": "object", "properties": {
        "type": {"type": "string"}, "description": {"type": "string"}}, "required": ["type"]}}
    out = canonical_tool_doc(odd)
    assert list(out) == ["name", "parameters", "x-a", "x-b"]
    assert list(out["parameters"]["properties"]) == ["type", "description"]
