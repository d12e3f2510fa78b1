"""Episode harnesses: run a policy on tasks and score the result. Used by rollouts and the gate.

``run_episodes(tasks, policy, params, *, context=None) -> list[list[Episode]]`` returns, per task
(outer, in task order), ``params.n`` episodes (inner, by sample index). Generation is batched
across tasks: one policy call for every task's first turn, then one call per turn for all tool-loop
episodes still running.

Harnesses
---------
- ``single_turn``: prompt -> one answer -> verify.
- ``tool_loop``: the model answers; if the answer contains tool calls (parsed with the verifiers'
  parser), the environment (:mod:`flywheel.envs.tools`) answers each from the trace's recorded
  outputs or the sandboxed Python implementation, and the model continues, until it answers
  without a call, is truncated, or reaches ``max_turns`` model turns (``context["max_turns"]``, else
  ``rollout.max_turns`` of ``context["cfg"]``, else 4).

Token accounting (what training relies on)
------------------------------------------
``prompt_token_ids`` are the first prompt's ids as the policy tokenised them. ``completion_token_ids``
are *all* tokens after it, in order: each model turn's sampled ids, then the environment's ids for
the turn boundary and the tool outputs (the chat-template text between the end of the model's turn
and the start of its next one), then the next model turn, and so on. ``loss_mask`` is 1 exactly on
model-sampled ids and 0 on environment ids; ``logprobs`` carry the sampler log-probabilities on
model ids and 0.0 on environment ids. So ``prompt_token_ids + completion_token_ids`` is exactly the
sequence the model conditioned on in its last turn, and teacher forcing it reproduces each model
turn's context.

The environment segment is found by rendering the conversation with a sentinel as the model's turn
(``render_prompt``) and taking the text after the sentinel: that is the template's turn end, the tool
turns and the next generation prompt. When the model's turn already ended with an end-of-turn token
that the segment starts with (``<|im_end|>`` in ChatML), it is not repeated. The segment is tokenised
on its own (``add_special_tokens=False``); templates that put a special token at the boundary (ChatML
does) tokenise identically in one piece or two.

Exact accounting needs a policy with ``tokenizer`` and ``generate_from_ids`` (the Hugging Face
backend). With any other policy (an HTTP server), later turns are generated from the message list;
token ids and masks are then only as good as what the backend returns, and ``Episode.exact_tokens``
is False.

Several servers
---------------
A policy with several endpoints (the OpenAI-compatible backend with a list of ``base_url`` s: it has
``endpoints`` and ``spread``) samples each *group* (the ``n`` episodes of one task, every turn) on one
server, groups spread over the servers by ``spread``; a server failure mid-group resamples the whole
group on another server, so each group comes from exactly one server and appears once.
``Episode.endpoint`` names it (None for in-process backends).

Verification
------------
``verify_task(task, trajectory, context)`` applies the task's verifier spec
(:func:`flywheel.verifiers.verify`; a ``tool_call`` spec with ``scope: "all"`` sees only the calls
made during the episode, not assistant turns inside the prompt) and one harness-level rule recorded
in ``tool_env``: ``replay: true`` executes the final answer's calls against the sandboxed
implementation and fails the episode if one raises (``runtime_exception`` evals; a sandbox that
cannot start is an ``infra_error``, never a failure; so is an episode in which a sandboxed tool
call could not run). Verification runs in a thread pool
(``context["verify_workers"]``, default 4): sandboxed verifiers spend their time in subprocesses.

``Episode.finish_reason``: ``"stop"`` (final answer), ``"length"`` (a model turn hit
``max_new_tokens`` or the model's context), or ``"max_turns"`` (still calling tools at the limit).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from flywheel.envs.tools import Observation, ToolEnv
from flywheel.policy.base import Policy, Sample, SamplingParams, coerce_params
from flywheel.policy.format import render_prompt
from flywheel.verifiers import Verdict, VerifyContext, parse_tool_calls, verify
from flywheel.vocab.records import ChatMessage, TaskRecord, ToolSpec
from flywheel.vocab.toolcalls import ToolCall

if TYPE_CHECKING:  # annotations only: the harness reads a config duck-typed and never imports it
    from flywheel.config import FlywheelConfig, SandboxConfig

#: What :func:`run_episodes`, :func:`verify_task` and :func:`verify_context` take as ``context``,
#: the one place its four shapes are named:
#:
#: - ``None``: default sandbox and judge (a :class:`VerifyContext` of defaults is built by the
#:   verifiers), ``max_turns`` 4, 4 verify workers;
#: - a ``FlywheelConfig``: its ``sandbox``, ``judge`` and ``rollout.max_turns``;
#: - a :class:`VerifyContext`: sandbox and judge as given;
#: - a dict with any of ``cfg`` (a FlywheelConfig, as above), ``verify_context`` (a VerifyContext,
#:   taking precedence over ``cfg``'s), ``max_turns``, ``verify_workers``.
#:
#: Only a ``dict`` is read by key (a config or context is read by attribute), hence ``dict`` and not
#: ``Mapping``.
HarnessContext: TypeAlias = "FlywheelConfig | VerifyContext | dict[str, Any] | None"

_SENTINEL = "\ue000flywheel-turn-boundary\ue001"
DEFAULT_MAX_TURNS = 4


@dataclass
class Episode:
    """One sampled episode of one task. See the module docstring for the token contract."""

    task_id: str
    sample_idx: int
    messages: list[ChatMessage]  # the whole conversation: prompt messages + what the episode produced
    completion_text: str  # model turns and environment segments, concatenated in order
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str
    truncated: bool
    verdict: Verdict
    gen_ms: float
    verify_ms: float
    turns: int
    tool_calls: int = 0
    observations: list[dict] = field(default_factory=list)  # {name, source, raised} per call
    exact_tokens: bool = True
    endpoint: str | None = None  # the server that sampled it (HTTP backends), else None

    @property
    def reward(self) -> float:
        return float(self.verdict.reward)

    @property
    def passed(self) -> bool:
        return bool(self.verdict.passed)


@dataclass
class _State:
    task: TaskRecord
    sample_idx: int
    history: list[ChatMessage]  # prompt + generated turns (assistant turns as raw model text)
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    gen_ms: float = 0.0
    turns: int = 0
    finish_reason: str = "stop"
    truncated: bool = False
    done: bool = False
    n_calls: int = 0
    observations: list[dict] = field(default_factory=list)
    exact: bool = True
    env: ToolEnv | None = None
    endpoint: str | None = None


# ------------------------------------------------------------------------------ context helpers
def _ctx_get(context: HarnessContext, key: str, default: object = None) -> Any:
    if isinstance(context, dict):
        return context.get(key, default)
    return getattr(context, key, default)


def _cfg(context: HarnessContext) -> FlywheelConfig | None:
    if context is not None and hasattr(context, "rollout") and hasattr(context, "sandbox"):
        return context  # type: ignore[return-value]  # a FlywheelConfig (read duck-typed: rollout, sandbox)
    return _ctx_get(context, "cfg")


def _max_turns(context: HarnessContext) -> int:
    v = None if _cfg(context) is context else _ctx_get(context, "max_turns")
    if v is None:
        v = getattr(getattr(_cfg(context), "rollout", None), "max_turns", None)
    return int(v or DEFAULT_MAX_TURNS)


def _sandbox_cfg(context: HarnessContext) -> SandboxConfig | None:
    return getattr(verify_context(context), "sandbox", None)


# ------------------------------------------------------------------------------ verification
def _calls_of(message: ChatMessage) -> list[ToolCall]:
    res = parse_tool_calls(message)
    return [] if res.error else list(res.calls)


def verify_context(context: HarnessContext) -> VerifyContext | None:
    """The :class:`flywheel.verifiers.VerifyContext` for ``context`` (see :data:`HarnessContext`)."""
    if context is None or isinstance(context, VerifyContext):
        return context
    vc = _ctx_get(context, "verify_context")
    if vc is not None:
        return vc
    cfg = _cfg(context)
    if cfg is None:
        return None
    return VerifyContext(sandbox=cfg.sandbox, judge=cfg.judge)


def verify_task(task: TaskRecord, trajectory: list[ChatMessage], context: HarnessContext = None) -> Verdict:
    """Score ``trajectory`` (the whole conversation, prompt included) for ``task``; a ``Verdict``."""
    spec = task["verifier"]
    env = task.get("tool_env") or {}
    traj = trajectory
    if spec.get("kind") == "tool_call" and spec.get("scope") == "all":
        # Only the calls of *this* episode count: assistant turns inside the prompt are history.
        start = len(task["prompt"]["messages"])
        traj = [m for m in trajectory[:start] if m.get("role") != "assistant"] + list(trajectory[start:])
    vctx = verify_context(context)
    verdict = verify(spec, traj, context=vctx)
    if not env.get("replay") or not env.get("python") or verdict.infra_error:
        return verdict
    last = next((m for m in reversed(traj) if m.get("role") == "assistant"), None)
    calls = _calls_of(last) if last else []
    if not calls:
        return verdict  # nothing to replay: the spec already judged the absence of calls
    tenv = ToolEnv({"python": env["python"]}, task["prompt"].get("tools"), getattr(vctx, "sandbox", None))
    raised = []
    for c in calls:
        obs = tenv.answer(c.name, c.arguments)
        if obs.infra_error:
            return dataclasses.replace(verdict, infra_error=f"replay sandbox: {obs.infra_error}", passed=False)
        if obs.raised:
            raised.append({"call": c.name, "error": obs.content})
    components = {**dict(verdict.components), "replay_no_raise": 0.0 if raised else 1.0}
    details = {**dict(verdict.details or {}), "replay": raised or "no call raised"}
    if raised:
        return dataclasses.replace(verdict, reward=0.0, passed=False, components=components, details=details)
    return dataclasses.replace(verdict, components=components, details=details)


# ------------------------------------------------------------------------------ the loop
def _env_segment(tokenizer: Any, history: list[ChatMessage], tools: list[ToolSpec],
                 tool_msgs: list[ChatMessage], last_model_id: int | None) -> str:
    """Template text between the end of the model's turn and the start of its next one."""
    msgs = [*history[:-1], {"role": "assistant", "content": _SENTINEL}, *tool_msgs]
    full = render_prompt(tokenizer, msgs, tools)
    at = full.rfind(_SENTINEL)
    if at < 0:  # pragma: no cover - a template that drops assistant content entirely
        raise ValueError("the chat template did not render the assistant turn; cannot account tokens")
    seg = full[at + len(_SENTINEL) :]
    if last_model_id is not None:
        tail = tokenizer.decode([last_model_id], skip_special_tokens=False)
        if tail and tail.strip() and seg.startswith(tail):
            seg = seg[len(tail) :]
    return seg


def _add_model_turn(st: _State, sample: Sample) -> None:
    if st.endpoint is None:
        st.endpoint = (getattr(sample, "extra", None) or {}).get("endpoint")
    st.completion_ids.extend(sample.completion_token_ids)
    lp = list(sample.logprobs) if sample.logprobs else [0.0] * len(sample.completion_token_ids)
    if len(lp) != len(sample.completion_token_ids):
        lp = (lp + [0.0] * len(sample.completion_token_ids))[: len(sample.completion_token_ids)]
        st.exact = False
    st.logprobs.extend(lp)
    st.mask.extend([1] * len(sample.completion_token_ids))
    st.text_parts.append(sample.text)
    st.gen_ms += float(sample.gen_ms or 0.0)
    st.turns += 1
    st.history.append({"role": "assistant", "content": sample.text})


def _step_env(st: _State, sample: Sample, max_turns: int, tokenizer: Any, ctx_limit: int | None,
              max_new: int) -> None:
    """After a model turn: decide whether the episode ends; else answer its calls."""
    if sample.truncated or sample.finish_reason == "length":
        st.finish_reason, st.truncated, st.done = "length", True, True
        return
    parsed = parse_tool_calls(sample.text)
    if parsed.error or not parsed.calls:
        st.finish_reason, st.done = "stop", True
        return
    if st.turns >= max_turns:
        st.finish_reason, st.done = "max_turns", True
        return
    tool_msgs = []
    for i, call in enumerate(parsed.calls):
        obs: Observation = st.env.answer(call.name, call.arguments)
        st.n_calls += 1
        st.observations.append({"name": call.name, "source": obs.source, "raised": obs.raised,
                                "infra_error": obs.infra_error})
        tool_msgs.append({"role": "tool", "tool_call_id": f"call_{st.turns}_{i}", "name": call.name,
                          "content": obs.content})
    if tokenizer is not None:
        last_id = sample.completion_token_ids[-1] if sample.completion_token_ids else None
        seg = _env_segment(tokenizer, st.history, st.task["prompt"].get("tools") or [], tool_msgs, last_id)
        ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
        st.completion_ids.extend(ids)
        st.logprobs.extend([0.0] * len(ids))
        st.mask.extend([0] * len(ids))
        st.text_parts.append(seg)
    else:
        st.exact = False
        st.text_parts.append("".join(f"\n[tool output: {m['name']}]\n{m['content']}\n" for m in tool_msgs))
    st.history.extend(tool_msgs)
    if ctx_limit is not None and len(st.prompt_ids) + len(st.completion_ids) + max_new > ctx_limit:
        st.finish_reason, st.truncated, st.done = "length", True, True


def _ctx_limit(policy: Policy) -> int | None:
    cfg = getattr(getattr(policy, "model", None), "config", None)
    v = getattr(cfg, "max_position_embeddings", None)
    return int(v) if isinstance(v, int) else None


def _turn_params(params: SamplingParams, turn: int) -> SamplingParams:
    seed = None if params.seed is None else int(params.seed) + 7919 * turn
    return dataclasses.replace(params, n=1, seed=seed)


def run_episodes(tasks: Sequence[TaskRecord], policy: Policy, params: SamplingParams | int | None, *,
                 context: HarnessContext = None) -> list[list[Episode]]:
    """Sample ``params.n`` episodes per task, run each through its harness and verify it.

    ``tasks``: task records (:class:`flywheel.vocab.records.EvalTask`). ``params``: what
    :func:`flywheel.policy.base.coerce_params` takes (``None`` -> defaults, an int -> ``n``).
    ``context``: one of the four shapes of :data:`HarnessContext` (``None``, a ``FlywheelConfig``, a
    ``VerifyContext``, or a dict with any of ``cfg``, ``verify_context``, ``max_turns``,
    ``verify_workers``). The verifiers get a ``VerifyContext`` built from it.
    """
    params = coerce_params(params)
    if not tasks:
        return []
    for t in tasks:
        if t.get("harness") not in ("single_turn", "tool_loop"):
            raise ValueError(f"task {t.get('task_id')}: unknown harness {t.get('harness')!r}")
    max_turns = _max_turns(context)
    sandbox_cfg = _sandbox_cfg(context)
    spread = getattr(policy, "spread", None)
    if callable(spread) and len(getattr(policy, "endpoints", None) or ()) > 1:
        # Several servers: each group (task) is sampled whole on one of them, and moves whole to
        # another if that one fails mid-group (the policy's spread); verification runs below, once.
        rows = spread(tasks, lambda t, pol: _sample([t], pol, params, max_turns, sandbox_cfg)[0],
                      describe=lambda t: f"the group of task {t.get('task_id')}")
    else:
        rows = _sample(tasks, policy, params, max_turns, sandbox_cfg)
    return _verify(rows, context)


def _sample(tasks: Sequence[TaskRecord], policy: Policy, params: SamplingParams, max_turns: int,
            sandbox_cfg: SandboxConfig | None) -> list[list[_State]]:
    """Generate every task's ``params.n`` episodes (all turns) with ``policy``; not yet verified."""
    tokenizer = getattr(policy, "tokenizer", None)
    from_ids = callable(getattr(policy, "generate_from_ids", None)) and tokenizer is not None
    ctx_limit = _ctx_limit(policy)

    first = policy.generate(
        [t["prompt"]["messages"] for t in tasks], params, tools=[t["prompt"].get("tools") or [] for t in tasks]
    )
    states: list[list[_State]] = []
    for t, samples in zip(tasks, first, strict=True):
        if len(samples) != params.n:
            raise RuntimeError(f"policy returned {len(samples)} samples for task {t['task_id']}, expected {params.n}")
        row = []
        for j, s in enumerate(samples):
            st = _State(task=t, sample_idx=j, history=[dict(m) for m in t["prompt"]["messages"]],
                        prompt_ids=list(s.prompt_token_ids), exact=from_ids)
            _add_model_turn(st, s)
            if t["harness"] == "tool_loop":
                # ToolEnv declares the spec a dict; mypy refuses the ToolEnvSpec TypedDict there
                st.env = ToolEnv(t.get("tool_env"), t["prompt"].get("tools"), sandbox_cfg)  # type: ignore[arg-type]
                _step_env(st, s, max_turns, tokenizer, ctx_limit, params.max_new_tokens)
            else:
                st.done = True
                st.finish_reason = "length" if (s.truncated or s.finish_reason == "length") else "stop"
                st.truncated = st.finish_reason == "length"
            row.append(st)
        states.append(row)

    turn = 1
    while True:
        live = [st for row in states for st in row if not st.done]
        if not live:
            break
        turn += 1
        p = _turn_params(params, turn)
        if from_ids:
            # not part of Policy: the Hugging Face backend's, and from_ids says this one has it
            out = policy.generate_from_ids(  # type: ignore[attr-defined]
                [st.prompt_ids + st.completion_ids for st in live], p)
        else:
            out = policy.generate([st.history for st in live], p,
                                  tools=[st.task["prompt"].get("tools") or [] for st in live])
        for st, samples in zip(live, out, strict=True):
            s = samples[0]
            _add_model_turn(st, s)
            _step_env(st, s, max_turns, tokenizer, ctx_limit, params.max_new_tokens)
    return states


def _verify(states: list[list[_State]], context: HarnessContext) -> list[list[Episode]]:
    """Score every sampled episode (a thread pool, see the module docstring) into :class:`Episode` s."""
    flat = [st for row in states for st in row]
    workers = int((_ctx_get(context, "verify_workers", 4) if isinstance(context, dict) else 4) or 1)

    def score(st: _State) -> tuple[Verdict, float]:
        t0 = time.perf_counter()
        v = verify_task(st.task, st.history, context)
        env_errors = [o["infra_error"] for o in st.observations if o.get("infra_error")]
        if env_errors and v.infra_error is None:
            # The model saw a broken environment, not the task: its reward means nothing.
            v = dataclasses.replace(v, infra_error=f"tool environment: {env_errors[0]}", passed=False, reward=0.0)
        return v, (time.perf_counter() - t0) * 1000.0

    if workers > 1 and len(flat) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(flat))) as pool:
            verdicts = list(pool.map(score, flat))
    else:
        verdicts = [score(st) for st in flat]

    it = iter(verdicts)
    result: list[list[Episode]] = []
    for row in states:
        eps = []
        for st in row:
            verdict, vms = next(it)
            eps.append(
                Episode(
                    task_id=st.task["task_id"],
                    sample_idx=st.sample_idx,
                    messages=st.history,
                    completion_text="".join(st.text_parts),
                    prompt_token_ids=st.prompt_ids,
                    completion_token_ids=st.completion_ids,
                    logprobs=st.logprobs,
                    loss_mask=st.mask,
                    finish_reason=st.finish_reason,
                    truncated=st.truncated,
                    verdict=verdict,
                    gen_ms=st.gen_ms,
                    verify_ms=vms,
                    turns=st.turns,
                    tool_calls=st.n_calls,
                    observations=st.observations,
                    exact_tokens=st.exact,
                    endpoint=st.endpoint,
                )
            )
        result.append(eps)
    return result
