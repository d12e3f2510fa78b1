"""The ONE prompt/answer format shared by rollouts, SFT, the gate and ``flywheel serve``.

Training and serving must never disagree on the text a model sees, so every path that turns a
conversation into tokens goes through :func:`render_prompt`, and every path that turns a wanted
answer into training text goes through :func:`render_answer`.

The format is the one the Berkeley Function Calling Leaderboard uses for models *without* native
tool support ("prompting" mode, ``bfcl_eval/constants/default_prompts.py``): a system prompt lists
the functions as JSON and asks for answers of the form ``[func_name(param=value, ...)]``. SmolLM2's
chat template has no tool support at all, and the same text works for every model, so we always
use it rather than a template's native ``tools=`` rendering.

Conversions (all deterministic, no information dropped):
- with tools, the tool prompt becomes the system message; an existing system message is appended
  after it (as BFCL does); without tools, messages pass through unchanged;
- an assistant turn carrying OpenAI ``tool_calls`` becomes the text :func:`render_answer` would
  produce (so earlier turns of a multi-turn loop look exactly like what the model emits);
- ``tool`` turns are kept for templates that know the role; for templates that do not (detected by
  the template never mentioning ``"tool"``, e.g. SmolLM2), :func:`render_prompt` renders them as
  user turns whose content starts with ``[tool output: <name>]``
  (see :func:`tool_turns_as_user`);
- the tool list is written in a canonical key order (:func:`canonical_tool_doc`), not in the order its
  JSON objects happen to arrive in. JSON objects are unordered, and the stores are not order-preserving:
  events, suites and training data are canonical JSON with sorted keys, so a tool schema served as
  ``{"name", "description", "parameters": {"type", "properties": {"location", "hours"}}}`` comes back
  from a suite as ``{"description", "name", "parameters": {"properties": {"hours", "location"}, ...}}``.
  Rendered as stored, the gate, the rollouts and SFT saw another prompt than production did (a demo's
  champion passed 15 of 30 of its production successes rendered from the suite, 28 of 30 as served).

Not covered: images and other non-text content parts (text parts are concatenated, others are
rejected with a ``ValueError``).
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.vocab.messages import require_text
from flywheel.vocab.toolcalls import ToolCall, format_tool_calls, parse_tool_calls
from flywheel.vocab.tools import function_doc

TOOL_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose.\n"
    "If none of the functions can be used, point it out. If the given question lacks the parameters "
    "required by the function, also point it out.\n"
    "You should only return the function calls in your response.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n{functions}\n"
)

TOOL_OUTPUT_TAG = "[tool output: {name}]"


# Keys a function doc or a JSON-schema node lists first, in this order; any other key follows, sorted.
_KEY_ORDER = {k: i for i, k in enumerate(("name", "type", "description", "parameters", "enum", "items",
                                          "properties", "required", "default"))}


def _canonical_node(node: Any) -> Any:
    if isinstance(node, list):
        return [_canonical_node(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key in sorted(node, key=lambda k: (_KEY_ORDER.get(k, len(_KEY_ORDER)), k)):
        value = node[key]
        if key == "properties" and isinstance(value, dict):
            # Parameter names: the required ones in the order ``required`` lists them (a list keeps its
            # order through every store), then the others sorted.
            req = node.get("required")
            listed = req if isinstance(req, list) else []
            first = list(dict.fromkeys(r for r in listed if isinstance(r, str) and r in value))
            names = first + sorted(n for n in value if n not in first)
            out[key] = {n: _canonical_node(value[n]) for n in names}
        else:
            out[key] = _canonical_node(value)
    return out


def canonical_tool_doc(tool: Any) -> dict[str, Any]:
    """:func:`~flywheel.vocab.tools.function_doc` with its keys in one canonical order, whatever order
    they arrived in: ``name``, ``description``, ``parameters``; in every schema node ``type``,
    ``description``, ``enum``, ``items``, ``properties``, ``required``, ``default``, then the other keys
    sorted; properties with the required ones first (in ``required``'s order), then the rest sorted.
    Values are untouched (lists keep their order)."""
    return _canonical_node(function_doc(tool))  # type: ignore[no-any-return]


def tool_system_prompt(tools: list[dict]) -> str:
    """The system prompt listing ``tools`` (OpenAI or BFCL specs) as JSON: the tools in the given order,
    each in :func:`canonical_tool_doc`'s key order, so a schema renders the same whichever store it
    came through."""
    docs = [canonical_tool_doc(t) for t in tools]
    return TOOL_SYSTEM_PROMPT.format(functions=json.dumps(docs, ensure_ascii=False))


def _assistant_text(msg: dict, where: str) -> str:
    content = require_text(msg.get("content"), where)
    if not msg.get("tool_calls"):
        return content
    parsed = parse_tool_calls({"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]})
    if not parsed.error and parsed.calls:
        try:
            return render_answer(parsed.calls, content or None)
        except ValueError:  # a name or key that is not a Python identifier has no pythonic form
            pass
    # A malformed call from a production trace: keep it visible verbatim rather than invent a
    # well-formed one (the model must not learn that broken calls looked fine).
    raw = json.dumps(msg["tool_calls"], ensure_ascii=False)
    return f"{content}\n{raw}" if content else raw


def build_prompt_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages as the model sees them: tool prompt injected, calls rendered as text.

    Returns new dicts with only ``role`` and ``content`` (plus ``name`` on tool turns); the input
    is not modified. Raises ``ValueError`` naming the message index on an unknown role.
    """
    out: list[dict] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        where = f"messages[{i}]"
        if role in ("system", "user"):
            out.append({"role": role, "content": require_text(msg.get("content"), where)})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg, where)})
        elif role == "tool":
            turn = {"role": "tool", "content": require_text(msg.get("content"), where)}
            if msg.get("name"):
                turn["name"] = str(msg["name"])
            out.append(turn)
        else:
            raise ValueError(f"{where}: unknown role {role!r} (expected system, user, assistant or tool)")
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_supports_tool_role(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template mentions a ``tool`` role at all (SmolLM2's does not)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(str(v) for v in template.values())
    return "'tool'" in template or '"tool"' in template


def tool_turns_as_user(messages: list[dict]) -> list[dict]:
    """``tool`` turns -> user turns tagged ``[tool output: <name>]`` (for templates without tools)."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            tag = TOOL_OUTPUT_TAG.format(name=m.get("name") or "tool")
            out.append({"role": "user", "content": f"{tag}\n{m.get('content') or ''}"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    return out


def template_messages(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """:func:`build_prompt_messages`, plus the tool-turn conversion when the template lacks tools."""
    msgs = build_prompt_messages(messages, tools)
    if not template_supports_tool_role(tokenizer):
        msgs = tool_turns_as_user(msgs)
    return msgs


def render_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text (chat template applied, generation prompt appended).

    Tokenise it with ``add_special_tokens=False``: the template already contains them.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    msgs = template_messages(tokenizer, messages, tools)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):  # pragma: no cover - guards a transformers API change
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def render_answer(tool_calls: list[ToolCall] | None = None, content: str | None = None) -> str:
    """The assistant text for an answer: ``[fn(a=1, b='x')]`` for calls, ``content`` otherwise.

    With both, the content comes first and the calls follow on their own line. Calls are rendered
    by :func:`flywheel.verifiers.format_tool_calls`, the inverse of the verifiers' parser, so an
    SFT target always parses back to the same calls.
    """
    if tool_calls:
        calls = format_tool_calls(tool_calls)
        return f"{content.strip()}\n{calls}" if content and content.strip() else calls
    if content is None:
        raise ValueError("render_answer needs tool_calls or content")
    return content
