"""Request batching for a policy served to concurrent clients.

``flywheel serve`` gets one chat request per HTTP call, but a CPU or GPU decodes eight prompts in one
batch almost as fast as one (measured with SmolLM2-135M on 2 CPU cores: 8 prompts x 48 tokens batched
took ~3x the time of one, not 8x). :class:`BatchingPolicy` merges the ``generate`` calls that arrive
while a batch is running (or within ``window_s`` of each other) into one call of the wrapped policy.

Gathering the traffic's width. Clients whose requests shared a batch get their replies together and
send their next requests a few milliseconds apart. Started by the first of them, the next batch used to
leave the rest behind, and they ran as a second, narrow batch, while the first group's next requests
queued behind *it*: the demo's eight clients settled into alternating batches of 6 and 2 (35 batches for
140 questions instead of 18; on a CPU a narrow batch reads every weight per step all the same, though its
prefill and attention are smaller: ``benchmarks/bench_serve_batching.py`` measured x1.09 for 32 questions
through the real server). So each merged call first waits, at most ``gather_s``, until as many
prompts are pending as were in flight at once during the previous call (the traffic's current width,
at most ``max_prompts``); a lone client has a width of 1 and waits for nothing, and a width that shrinks
costs at most two waits of ``gather_s`` (the first narrow call still measures the wide traffic's tail).

Guarantees
- Only calls with identical sampling parameters are merged, and only when the result cannot depend
  on the batch: greedy decoding (``temperature == 0``), or sampling without a seed. A seeded sampling
  call runs alone, so ``seed`` keeps its reproducibility promise.
- No caller waits for batches that are not its own: the caller that runs the merged calls (the
  *leader*) hands that job to the oldest waiting caller as soon as its own result is in. (It used to
  lead until nobody was waiting, so under steady traffic its own reply never came: a 140-question
  replay timed out after 15 minutes on one request.)
- Results are returned to each caller in its own prompt order. When a merged call raises, each
  caller of that batch is run again on its own, so one bad request (a prompt longer than the
  model's context) fails only itself; a batch of one gets its exception at once.
- At most ``max_prompts`` prompts per merged call (memory is bounded by what the wrapped policy gets).
- With ``weak=True`` the batcher holds its policy by a weak reference, so a cache of batchers keyed
  by policy (``flywheel serve``) does not keep a replaced model alive; callers hold the policy for
  as long as they call ``generate``.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from flywheel.policy.base import coerce_params, per_prompt_tools


@dataclass
class _Pending:
    prompts: list[list[dict]]
    tools: list[list[dict]]
    params: Any
    done: threading.Event = field(default_factory=threading.Event)
    # set when this caller's result is in, or when it must take over as leader (``lead``)
    wake: threading.Event = field(default_factory=threading.Event)
    lead: bool = False
    result: Any = None
    error: BaseException | None = None

    def finish(self) -> None:
        self.done.set()
        self.wake.set()


class BatchingPolicy:
    """Wraps a policy; ``generate`` may be called from many threads at once."""

    def __init__(self, policy: Any, *, max_prompts: int = 16, window_s: float = 0.02, gather_s: float = 0.5,
                 weak: bool = False):
        self._policy = weakref.ref(policy) if weak else (lambda: policy)
        self.max_prompts = max_prompts
        self.window_s = window_s
        self.gather_s = gather_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a caller queued: a gathering leader re-checks
        self._pending: list[_Pending] = []
        self._leader = False
        self._in_flight = 0  # prompts of the merging callers inside generate
        self._peak = 0  # the most in flight at once since the last merged call started
        self._width = 0  # the width to gather before a call: the peak during the previous call (0: no call yet)
        self.calls = 0  # merged calls made to the wrapped policy (for tests and stats)
        self.batch_sizes: list[int] = []  # prompts per merged call, in order (for tests and stats)
        self.gather_timeouts = 0  # merged calls that waited the whole gather_s for the width (stats, tests)

    @property
    def policy(self) -> Any:
        policy = self._policy()
        if policy is None:
            raise RuntimeError("the policy of this batcher was freed (weak=True and no caller holds it)")
        return policy

    def __getattr__(self, name: str) -> Any:  # name, version, tokenizer, adapters ... of the wrapped policy
        if name.startswith("_"):  # not set yet (copy, pickle): never recurse through self.policy
            raise AttributeError(name)
        return getattr(self.policy, name)

    @staticmethod
    def _mergeable(params: Any) -> bool:
        return getattr(params, "temperature", 1.0) == 0.0 or getattr(params, "seed", None) is None

    def generate(self, prompts: list[list[dict]], params: Any = None, *, tools: Any = None) -> list[list[Any]]:
        params = coerce_params(params)
        tools_pp = per_prompt_tools(tools, len(prompts))
        if not self._mergeable(params):
            return self.policy.generate(prompts, params, tools=tools_pp)
        me = _Pending(list(prompts), tools_pp, params)
        with self._lock:
            self._pending.append(me)
            self._in_flight += len(me.prompts)
            self._peak = max(self._peak, self._in_flight)
            self._cond.notify_all()
            if not self._leader:
                self._leader = me.lead = True
                fresh = True
            else:
                fresh = False
        try:
            if fresh and not self._width:
                time.sleep(self.window_s)  # no width measured yet: let concurrent callers join the first batch
            while not me.done.is_set():
                if me.lead:
                    self._lead(me)
                    break
                me.wake.wait()
        finally:
            with self._lock:
                self._in_flight -= len(me.prompts)
        if me.error is not None:
            raise me.error
        return me.result

    def _gather(self) -> None:
        """Wait (lock held, at most ``gather_s``) until the prompts pending reach the traffic's width."""
        target = min(self._width, self.max_prompts)
        deadline = time.monotonic() + self.gather_s
        while sum(len(p.prompts) for p in self._pending) < target:
            left = deadline - time.monotonic()
            if left <= 0:
                self.gather_timeouts += 1
                break
            self._cond.wait(left)

    def _lead(self, me: _Pending) -> None:
        """Run merged calls, oldest caller first, until ``me`` has its result; then hand the lead to
        the oldest caller still waiting (or give it up)."""
        while not me.done.is_set():
            with self._lock:
                self._gather()
                first = self._pending[0]
                batch, rest, n = [], [], 0
                for p in self._pending:
                    if p.params == first.params and n + len(p.prompts) <= max(self.max_prompts, len(first.prompts)):
                        batch.append(p)
                        n += len(p.prompts)
                    else:
                        rest.append(p)
                self._pending = rest
                self._width = max(self._peak, n)  # how wide the traffic got while the previous call ran
                self._peak = self._in_flight
                self.batch_sizes.append(n)
            prompts = [q for p in batch for q in p.prompts]
            tools = [t for p in batch for t in p.tools]
            try:
                self.calls += 1
                out = self.policy.generate(prompts, first.params, tools=tools)
                i = 0
                for p in batch:
                    p.result = out[i : i + len(p.prompts)]
                    i += len(p.prompts)
            except Exception as e:
                if len(batch) == 1:
                    batch[0].error = e
                else:
                    self._run_alone(batch)
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, SystemExit: every caller stops
                for p in batch:
                    p.error = e
            for p in batch:
                p.finish()
        with self._lock:
            if self._pending:
                nxt = self._pending[0]  # the oldest waiting caller: its request goes in the next batch
                nxt.lead = True
                nxt.wake.set()
            else:
                self._leader = False

    def _run_alone(self, batch: list[_Pending]) -> None:
        """Each caller of a failed merged call, on its own: the error lands where it belongs."""
        for p in batch:
            try:
                self.calls += 1
                p.result = self.policy.generate(p.prompts, p.params, tools=p.tools)
            except Exception as e:
                p.error = e
