"""BatchingPolicy: concurrent generate calls merged into one batched call, only when safe."""

from __future__ import annotations

import threading
import time

import pytest

from flywheel.policy.base import Sample, SamplingParams
from flywheel.policy.batching import BatchingPolicy


class Echo:
    """Answers each prompt with its own user text; records the batch sizes it was called with."""

    name, version = "echo", "0"

    def __init__(self, delay: float = 0.05, fail_on: str | None = None, hold_first: bool = False):
        self.batches: list[int] = []
        self.delay, self.fail_on = delay, fail_on
        self.lock = threading.Lock()
        # With ``hold_first`` the first call waits for ``release``: callers arriving meanwhile queue,
        # however slowly this machine starts their threads.
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def generate(self, prompts, params=None, *, tools=None):
        with self.lock:  # like HFPolicy: one generation at a time
            self.batches.append(len(prompts))
            assert self.release.wait(60), "the test never released the first call"
            time.sleep(self.delay)
            if self.fail_on and any(p[-1]["content"] == self.fail_on for p in prompts):
                raise ValueError("prompt too long")
            return [[Sample(text=p[-1]["content"], prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                            finish_reason="stop", truncated=False, gen_ms=1.0)] * params.n for p in prompts]


def _call_concurrently(policy, texts, params, *, release_when=None, release=None):
    """Call ``policy`` from one thread per text. ``release_when()``: a condition on the batcher's
    progress, polled until true (generous deadline), then the event ``release`` is set."""
    out, errors = {}, {}

    def run(t):
        try:
            out[t] = policy.generate([[{"role": "user", "content": t}]], params)[0][0].text
        except Exception as e:  # noqa: BLE001
            errors[t] = e

    threads = [threading.Thread(target=run, args=(t,)) for t in texts]
    for th in threads:
        th.start()
    if release_when is not None:
        deadline = time.monotonic() + 60
        while not release_when():
            assert time.monotonic() < deadline, "the callers never queued"
            time.sleep(0.005)
        release.set()
    for th in threads:
        th.join(60)
    return out, errors


def test_concurrent_greedy_calls_are_merged_and_answered_in_order():
    inner = Echo(hold_first=True)
    b = BatchingPolicy(inner, max_prompts=8, window_s=0.05)
    texts = [f"q{i}" for i in range(8)]
    # The first call is held until every other caller has queued behind it (their threads may start
    # late on a busy machine: waiting on the queue, not on a clock, makes the merge certain).
    out, errors = _call_concurrently(b, texts, SamplingParams(temperature=0.0, max_new_tokens=4),
                                     release=inner.release,
                                     release_when=lambda: inner.batches and inner.batches[0] + len(b._pending) == 8)
    assert not errors and out == {t: t for t in texts}  # every caller got its own answer
    assert sum(inner.batches) == 8 and len(inner.batches) <= 2  # the queued callers shared one call
    assert max(inner.batches) <= 8


def test_seeded_sampling_is_never_merged():
    inner = Echo()
    b = BatchingPolicy(inner, window_s=0.05)
    out, _ = _call_concurrently(b, ["a", "b", "c"], SamplingParams(temperature=1.0, seed=7))
    assert out == {"a": "a", "b": "b", "c": "c"}
    assert inner.batches == [1, 1, 1]  # a seed's reproducibility must not depend on the batch


def test_max_prompts_bounds_each_merged_call():
    inner = Echo()
    b = BatchingPolicy(inner, max_prompts=3, window_s=0.05)
    _call_concurrently(b, [f"q{i}" for i in range(7)], SamplingParams(temperature=0.0))
    assert sum(inner.batches) == 7 and max(inner.batches) <= 3


def test_an_error_reaches_only_its_own_caller_and_the_batcher_recovers():
    inner = Echo(fail_on="bad")
    b = BatchingPolicy(inner, window_s=0.1)
    out, errors = _call_concurrently(b, ["bad", "ok"], SamplingParams(temperature=0.0))
    assert list(errors) == ["bad"] and isinstance(errors["bad"], ValueError)
    assert out == {"ok": "ok"}  # merged or not, the good request is answered
    assert b.generate([[{"role": "user", "content": "later"}]], SamplingParams(temperature=0.0))[0][0].text == "later"


def test_wrapped_attributes_pass_through():
    b = BatchingPolicy(Echo())
    assert b.name == "echo" and b.version == "0"
    with pytest.raises(AttributeError):
        _ = b.no_such_attribute


def test_a_weak_batcher_does_not_keep_its_policy_alive():
    import gc
    import weakref

    inner = Echo(delay=0.0)
    b = BatchingPolicy(inner, weak=True)
    assert b.generate([[{"role": "user", "content": "x"}]], SamplingParams(temperature=0.0))[0][0].text == "x"
    ref = weakref.ref(inner)
    del inner
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match="freed"):
        b.generate([[{"role": "user", "content": "x"}]], SamplingParams(temperature=0.0))


class Gated:
    """A policy whose every generate call blocks until the test opens its gate: the test decides
    when each merged call ends, so nothing here depends on timing."""

    name, version = "gated", "0"

    def __init__(self):
        self.started: list[list[str]] = []
        self.gates: list[threading.Event] = []
        self.cond = threading.Condition()

    def generate(self, prompts, params=None, *, tools=None):
        gate = threading.Event()
        with self.cond:
            self.started.append([p[-1]["content"] for p in prompts])
            self.gates.append(gate)
            self.cond.notify_all()
        gate.wait(60)
        return [[Sample(text=p[-1]["content"], prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                        finish_reason="stop", truncated=False, gen_ms=1.0)] for p in prompts]

    def wait_started(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, timeout=60), f"call {n} never started"


def test_the_leader_gets_its_reply_without_waiting_for_other_callers_batches():
    """Under steady traffic the caller that ran the merged calls kept running them until nobody was
    waiting, so its own reply never came (a 140-question replay timed out on one request)."""
    inner = Gated()
    b = BatchingPolicy(inner, max_prompts=8, window_s=0.0)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    got: dict[str, str] = {}

    def ask(t):
        got[t] = b.generate([[{"role": "user", "content": t}]], params)[0][0].text

    a = threading.Thread(target=ask, args=("a",))
    a.start()
    inner.wait_started(1)  # a leads; its call runs
    others = [threading.Thread(target=ask, args=(t,)) for t in ("b", "c")]
    for th in others:
        th.start()
    deadline = time.monotonic() + 60
    while len(b._pending) < 2 and time.monotonic() < deadline:  # b and c are queued behind a's call
        time.sleep(0.01)
    inner.gates[0].set()  # a's call ends
    inner.wait_started(2)  # the next merged call (b, c) runs and stays open ...
    a.join(60)
    assert not a.is_alive() and got["a"] == "a"  # ... yet a has its reply
    assert sorted(inner.started[1]) == ["b", "c"]
    inner.gates[1].set()
    for th in others:
        th.join(60)
    assert got == {"a": "a", "b": "b", "c": "c"} and not b._leader


def _clients(b, n_clients, calls, *, think_s, seed=0):
    """``n_clients`` threads, each making ``calls`` greedy calls one after another with a random pause
    (up to ``think_s``) between a reply and its next request: production clients behind one server."""
    import random

    errors = []

    def run(c):
        rng = random.Random(seed * 1000 + c)
        for k in range(calls):
            try:
                got = b.generate([[{"role": "user", "content": f"c{c}-{k}"}]], SamplingParams(temperature=0.0))
                assert got[0][0].text == f"c{c}-{k}"
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            time.sleep(rng.uniform(0, think_s))

    threads = [threading.Thread(target=run, args=(c,)) for c in range(n_clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]


def test_clients_whose_replies_came_together_share_the_next_batch():
    """The demo's eight clients used to settle into alternating batches of 6 and 2: the callers that came
    back a few milliseconds late missed the next batch and ran as their own. Now each call first gathers
    as many prompts as were in flight during the previous one."""
    inner = Echo(delay=0.15)
    # gather_s generous: the wait ends when the eighth caller arrives, however slow a busy machine is
    b = BatchingPolicy(inner, max_prompts=8, window_s=0.05, gather_s=30.0)
    _clients(b, 8, 4, think_s=0.08)  # pauses up to 80 ms: four times the first batch's 20-50 ms window
    assert sum(b.batch_sizes) == 32
    assert len(b.batch_sizes) <= 5, b.batch_sizes  # 4 full batches; at most one split, healed at once
    assert b.batch_sizes.count(8) >= 3, b.batch_sizes
    assert inner.batches == b.batch_sizes


def test_a_lone_client_waits_for_nobody_and_a_shrinking_width_costs_at_most_two_waits():
    inner = Echo(delay=0.02)
    b = BatchingPolicy(inner, max_prompts=8, window_s=0.05, gather_s=0.2)
    _clients(b, 1, 5, think_s=0.0)
    assert b.gather_timeouts == 0 and b.batch_sizes == [1] * 5  # a width of 1 is always already there
    _clients(b, 4, 2, think_s=0.0)  # four clients at once: the width grows
    assert max(b.batch_sizes) >= 2
    before = b.gather_timeouts
    # back to one client: the width is measured over the previous call, which began while the wide traffic
    # was still in flight, so the first two calls may wait; the third knows the width is 1
    _clients(b, 1, 3, think_s=0.0)
    assert b.gather_timeouts - before <= 2, b.batch_sizes
