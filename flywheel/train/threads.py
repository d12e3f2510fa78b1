"""How many intra-op threads a CPU training step gets: as many as the cores other processes leave free.

Why: each op of a step that torch parallelises waits at a barrier for all its threads. On an idle
2-core machine torch's own count is right (SmolLM2-135M, bf16, the demo's 8-demonstration SFT step:
4.4 s with 2 threads, 7.7 s with 1). With one other process busy on a core, the second thread is
descheduled at every barrier and the same step took 21-27 s with 2 threads against 7.6 s with 1
(``benchmarks/bench_train_threads.py``): a CI runner, a laptop compiling, or a second flywheel job
beside the cycle made training three times slower than the one free core allows.

Unlike decoding (:mod:`flywheel.policy.threads`, steps of milliseconds, timed under each count), a
training step lasts seconds, so trying the other count would cost whole steps. :class:`TrainThreads`
measures instead what the *other* processes used during each step: the busy time of the cores this
process may run on (``/proc/stat``, the per-CPU lines of its affinity mask, steal time included)
minus this process's own CPU time, in cores. The next step gets ``round(cores - others)`` threads,
at least 1 and at most the process's own count. An idle machine keeps torch's count and pays nothing;
load that arrives or leaves is seen one step later. Where ``/proc/stat`` is missing (not Linux) the
count is left as it is.

Outputs depend on the count only through floating-point summation order (the same caveat as for
decoding). ``train.threads`` sets it: ``"auto"`` (the above), or a fixed count (0 leaves torch's).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TrainThreads", "check_train_threads", "read_cpu_busy"]

_PROC_STAT = "/proc/stat"


def check_train_threads(setting: object) -> None:
    """Refuse a ``train.threads`` value that is neither ``"auto"`` nor a count >= 0."""
    if not (setting == "auto" or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0)):
        raise ValueError(f"train threads must be 'auto' or a count >= 0 (got {setting!r})")


def read_cpu_busy(cpus: set[int] | None = None, path: str = _PROC_STAT) -> tuple[float, float] | None:
    """``(busy, total)`` clock ticks since boot summed over ``cpus`` (the per-CPU lines of ``/proc/stat``;
    all of them when ``None``). Busy is everything but idle and iowait (steal counts as busy: a
    hypervisor that takes the core stalls a barrier the same way). ``None`` where the file is missing
    or unreadable."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0.0
    seen = False
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            idx = int(name[3:])
            vals = [float(v) for v in fields[:8]]
        except ValueError:
            continue
        if cpus is not None and idx not in cpus:
            continue
        vals += [0.0] * (8 - len(vals))
        user, nice, system, idle, iowait, irq, softirq, steal = vals
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
        seen = True
    return (busy, total) if seen else None


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class TrainThreads:
    """The intra-op thread count of CPU training steps, set before each step from the load others put
    on this process's cores during the step before (see the module docstring).

    A training loop calls :meth:`before_step` and :meth:`after_step` around each step and
    :meth:`restore` when it ends. ``read_busy``, ``process_time``, ``get_threads`` and ``set_threads``
    default to ``/proc/stat``, ``time.process_time`` and torch's; tests pass fakes.
    """

    def __init__(
        self,
        setting: str | int = "auto",
        *,
        read_busy: Callable[[], tuple[float, float] | None] | None = None,
        ncpu: int | None = None,
        process_time: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.perf_counter,
        get_threads: Callable[[], int] | None = None,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        check_train_threads(setting)
        if get_threads is None or set_threads is None:
            import torch

            get_threads = get_threads or torch.get_num_threads
            set_threads = set_threads or torch.set_num_threads
        cpus = _affinity()
        self.setting = setting
        self._read = read_busy or (lambda: read_cpu_busy(cpus))
        self.ncpu = ncpu or (len(cpus) if cpus else os.cpu_count() or 1)
        self._ptime, self._clock = process_time, clock
        self._get, self._set = get_threads, set_threads
        self.original = int(self._get())  # the process's own count: the most a step gets
        self.current = self.original
        self.next = self.original if setting == "auto" else (int(setting) or self.original)
        self.steps_at: dict[int, int] = {}  # thread count -> steps run with it
        self.others_max = 0.0  # the most cores other processes kept busy during one step
        self.last_others: float | None = None  # the same, the last measured step
        self.switches = 0
        self._mark: tuple[tuple[float, float] | None, float, float] | None = None
        self._ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0

    def before_step(self) -> None:
        """Set the step's count; the process's own count comes back in :meth:`after_step`, so whatever
        runs between steps (decoding, another trainer) sees torch's count."""
        self.original = int(self._get())
        k = max(1, min(self.next, self.original)) if self.setting == "auto" else self.next
        if k != self.current:
            self.switches += 1
        self.current = k
        if k != self.original:
            self._set(k)
        self._mark = (self._read() if self.setting == "auto" else None, self._ptime(), self._clock())

    def after_step(self) -> None:
        k = self.current
        self.steps_at[k] = self.steps_at.get(k, 0) + 1
        mark, self._mark = self._mark, None
        stat1 = self._read() if mark is not None and mark[0] is not None else None
        p1, t1 = self._ptime(), self._clock()
        self.restore()
        if mark is None or stat1 is None:
            return
        stat0, p0, t0 = mark
        wall = t1 - t0
        if stat0 is None or wall <= 0:
            return
        busy_cores = (stat1[0] - stat0[0]) / self._ticks_per_s / wall
        own_cores = (p1 - p0) / wall
        self.last_others = others = max(0.0, busy_cores - own_cores)
        self.others_max = max(self.others_max, others)
        self.next = max(1, min(self.original, round(self.ncpu - others)))

    def restore(self) -> None:
        """Give the process its own thread count back (after each step, or when a step failed)."""
        if int(self._get()) != self.original:
            self._set(self.original)

    def summary(self) -> dict[str, Any]:
        return {"setting": self.setting, "cores": self.ncpu, "own_threads": self.original,
                "steps_at": dict(self.steps_at), "switches": self.switches, "others_max": round(self.others_max, 2)}
