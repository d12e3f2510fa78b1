"""How many intra-op threads a decode step gets: chosen by timing the steps, not assumed.

Why: a decode step runs a few hundred small ops (one token per row through every layer), and
each op that torch parallelises waits at a barrier for all its threads. On an idle machine torch's
own count is right (2-core host, SmolLM2-135M fp32: batch 1 decodes 17.6 tokens/s with 2 threads,
16.6 with 1; a 16-row batch 92 vs 64). On a busy one (a CI runner, a laptop compiling, a second
flywheel job) the other thread is descheduled and every barrier waits for a scheduler time slice:
with one other process spinning on a core, batch 1 decoded 6.1 tokens/s with 2 threads and 15.3
with 1, and with a 2-thread benchmark beside it 1.4 against 16 (``benchmarks/bench_decode_threads.py``).
Training steps lose as much (:mod:`flywheel.train.threads` chooses their count another way).

:class:`DecodeThreads` times the steps of a decode loop under each candidate thread count (the
process's count and 1, plus half of it on larger machines) for a few steps each, keeps the fastest
(the median of its trial steps; another count must beat the process's own by ``margin``, 10%, so an
idle machine keeps torch's), and measures again after ``reprobe_every`` steps -- an interval
that doubles, up to ``max_reprobe_every``, while the same count keeps winning, so an idle machine
pays for the probe rarely -- or at once when a step takes ``stall_factor`` times the winner's probe
time (load arrived). One chooser lives with each loaded model, across generate calls (a server's
short requests would otherwise each pay for a probe); the caller starts it, brackets each step
with :meth:`~DecodeThreads.before_step` / :meth:`~DecodeThreads.after_step` and calls
:meth:`~DecodeThreads.restore` when the loop ends (the process's own thread count comes back).

Outputs do not depend on the choice beyond floating-point summation order (the same caveat as
batch shape: a near-tie can flip; the benchmark checks greedy answers identical). Not covered:
other threads of the same process running torch ops meanwhile see the changed count
(``torch.set_num_threads`` is process-wide); the policy lock serialises generation, and the cycle
does not train while it generates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DecodeThreads", "check_decode_threads", "thread_candidates"]


def check_decode_threads(setting: object) -> None:
    """Refuse a ``policy.decode_threads`` value that is neither ``"auto"`` nor a count >= 0."""
    if not (setting == "auto" or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0)):
        raise ValueError(f"decode threads must be 'auto' or a count >= 0 (got {setting!r})")


def thread_candidates(n: int) -> list[int]:
    """``[n, n // 2, 1]`` without repeats, largest first (``[2, 1]`` on a 2-core machine)."""
    out: list[int] = []
    for k in (n, n // 2, 1):
        if k >= 1 and k not in out:
            out.append(k)
    return out


class DecodeThreads:
    """Chooser of the intra-op thread count of decode steps, kept per model across calls (see the
    module docstring), so a server's many short requests do not each pay for a fresh probe.

    ``setting``: ``"auto"`` (measure) or a fixed count (no measuring; 0 means "leave torch's own").
    A decode loop calls :meth:`start`, then :meth:`before_step` / :meth:`after_step` around each
    step, then :meth:`restore`. ``get_threads`` / ``set_threads`` default to torch's; tests pass fakes.
    """

    def __init__(
        self,
        setting: str | int = "auto",
        *,
        trial_steps: int = 3,
        reprobe_every: int = 64,
        max_reprobe_every: int = 512,
        stall_factor: float = 3.0,
        margin: float = 0.10,
        get_threads: Callable[[], int] | None = None,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_decode_threads(setting)
        if trial_steps < 1 or reprobe_every < 1:
            raise ValueError(f"trial_steps and reprobe_every must be >= 1 (got {trial_steps}, {reprobe_every})")
        if get_threads is None or set_threads is None:
            import torch

            get_threads = get_threads or torch.get_num_threads
            set_threads = set_threads or torch.set_num_threads
        self.setting = setting
        self._get, self._set, self._clock = get_threads, set_threads, clock
        self.trial_steps = trial_steps
        self.reprobe_every = reprobe_every
        self.max_reprobe_every = max(max_reprobe_every, reprobe_every)
        self.stall_factor = stall_factor
        self.margin = margin  # another count must beat the process's own by this share to be chosen
        self._interval = reprobe_every  # steps until the next probe: doubles while the same count keeps winning
        self._refs: dict[int, float] = {}  # batch width -> the winner's median step time in its last probe
        self._rows = 1  # the current loop's batch width when it started
        self._probe_rows = 1
        self.original: int | None = None  # the process's own count when the current loop started
        self.candidates: list[int] = []
        self.current: int | None = None
        self.best: int | None = None  # the last probe's winner
        self.steps_at: dict[int, int] = {}  # thread count -> decode steps run with it, all loops
        self.loop_steps_at: dict[int, int] = {}  # the same, the current loop only
        self.choices: list[int] = []  # each probe's winner, in order
        self._times: dict[int, list[float]] = {}
        self._queue: list[int] = []  # the steps still to run in the current probe, one entry per step
        self._exploit_left = 0
        self._t0: float | None = None

    @property
    def measuring(self) -> bool:
        return len(self.candidates) > 1

    def start(self, rows: int = 1) -> None:
        """A decode loop of ``rows`` rows begins. The candidates follow the process's thread count;
        when it changed since the last loop (or on the first), the choice is measured afresh, and a
        batch width never measured before is probed too (step times differ by width, so the stall
        check compares like with like)."""
        n = int(self._get())
        self.current = n
        self.loop_steps_at = {}
        self._rows = rows
        if n != self.original:
            self.original = n
            self.candidates = thread_candidates(n) if self.setting == "auto" else [int(self.setting) or n]
            self.best = None
            self._refs = {}
            self._start_probe()
        elif self.measuring and not self._queue and rows not in self._refs:
            self._start_probe()

    def _start_probe(self) -> None:
        self._probe_rows = self._rows
        self._times = {k: [] for k in self.candidates}
        self._queue = [k for k in self.candidates for _ in range(self.trial_steps)] if self.measuring else []

    def _use(self, k: int) -> None:
        if k != self.current:
            self._set(k)
            self.current = k

    def before_step(self) -> None:
        if self.original is None:
            raise RuntimeError("DecodeThreads.before_step before start()")
        if self._queue:
            self._use(self._queue[0])
        else:
            self._use(self.best if self.best is not None else self.candidates[0])
        self._t0 = self._clock()

    def after_step(self) -> None:
        now = self._clock()
        dt = now - (self._t0 if self._t0 is not None else now)
        self._t0 = None
        k = int(self.current)  # type: ignore[arg-type]
        self.steps_at[k] = self.steps_at.get(k, 0) + 1
        self.loop_steps_at[k] = self.loop_steps_at.get(k, 0) + 1
        if not self.measuring:
            return
        if self._queue:
            self._times[self._queue.pop(0)].append(dt)
            if not self._queue:  # probe done: the fastest median wins; ties go to the larger count
                med = {c: statistics.median(self._times[c]) for c in self.candidates}
                best = min(self.candidates, key=lambda c: (med[c], -c))
                if med[best] > (1.0 - self.margin) * med[self.candidates[0]]:
                    best = self.candidates[0]  # not clearly faster: keep the process's own count
                same = best == self.best
                self._interval = min(2 * self._interval, self.max_reprobe_every) if same else self.reprobe_every
                self.best = best
                self._refs[self._probe_rows] = med[best]
                self.choices.append(best)
                self._use(best)
                self._exploit_left = self._interval
            return
        self._exploit_left -= 1
        # a step far slower than the winner's probe said: load arrived (or a much wider batch): measure now
        ref = self._refs.get(self._rows)
        stalled = ref is not None and dt > self.stall_factor * ref
        if self._exploit_left <= 0 or stalled:
            self._start_probe()

    def restore(self) -> None:
        """Give the process its own thread count back (the loop ended, or failed)."""
        if self.original is not None:
            self._use(self.original)

    def summary(self) -> dict[str, Any]:
        return {"setting": self.setting, "candidates": list(self.candidates), "steps_at": dict(self.steps_at),
                "choices": list(self.choices)}
