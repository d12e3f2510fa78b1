"""flywheel.policy.threads: the decode loop's thread count is chosen by timing its steps."""

from __future__ import annotations

import pytest

from flywheel.policy.threads import DecodeThreads, thread_candidates


class FakeTorch:
    """A process thread count and a clock in which a step costs what ``cost[threads]`` says."""

    def __init__(self, threads: int, cost: dict[int, float]) -> None:
        self.threads = threads
        self.cost = dict(cost)
        self.now = 0.0
        self.sets: list[int] = []

    def set(self, k: int) -> None:
        self.sets.append(k)
        self.threads = k

    def chooser(self, setting: str | int = "auto", **kw) -> DecodeThreads:
        dt = DecodeThreads(setting, get_threads=lambda: self.threads, set_threads=self.set, clock=lambda: self.now, **kw)
        dt.start()
        return dt

    def steps(self, dt: DecodeThreads, n: int) -> list[int]:
        """Run ``n`` decode steps; the thread count each one ran with."""
        used = []
        for _ in range(n):
            dt.before_step()
            used.append(self.threads)
            self.now += self.cost[self.threads]
            dt.after_step()
        return used


def test_candidates_are_the_process_count_its_half_and_one():
    assert thread_candidates(2) == [2, 1]
    assert thread_candidates(16) == [16, 8, 1]
    assert thread_candidates(3) == [3, 1]
    assert thread_candidates(1) == [1]


def test_a_busy_machine_gets_one_thread_and_an_idle_one_gets_them_all_back():
    # busy: a descheduled second thread makes each step wait (the measured 10x), so 1 thread wins
    t = FakeTorch(2, {2: 0.60, 1: 0.06})
    dt = t.chooser(trial_steps=3, reprobe_every=10)
    used = t.steps(dt, 6 + 10)
    assert used[:6] == [2, 2, 2, 1, 1, 1]  # the probe: 3 steps at each candidate
    assert used[6:] == [1] * 10  # then the winner until the next probe
    assert dt.choices == [1]
    # the load goes away: the next probe measures it and 2 threads come back
    t.cost = {2: 0.03, 1: 0.05}
    used = t.steps(dt, 6 + 4)
    assert used == [2, 2, 2, 1, 1, 1, 2, 2, 2, 2]
    assert dt.choices == [1, 2]
    assert dt.steps_at == {2: 3 + 3 + 4, 1: 3 + 10 + 3}
    dt.restore()
    assert t.threads == 2


def test_the_median_decides_so_one_preempted_step_does_not():
    t = FakeTorch(2, {2: 0.03, 1: 0.05})
    dt = t.chooser(trial_steps=3)
    dt.before_step()
    t.now += 5.0  # one step of the 2-thread trial hit a scheduler stall
    dt.after_step()
    t.steps(dt, 5)
    assert dt.choices == [2]


def test_restore_gives_the_process_its_own_count_back_mid_probe():
    t = FakeTorch(2, {2: 0.6, 1: 0.06})
    dt = t.chooser(trial_steps=3)
    t.steps(dt, 4)  # now in the 1-thread part of the probe
    assert t.threads == 1
    dt.restore()
    assert t.threads == 2


def test_a_fixed_count_is_used_without_measuring_and_zero_leaves_torch_alone():
    t = FakeTorch(2, {2: 0.6, 1: 0.06})
    dt = t.chooser(1)
    assert not dt.measuring
    assert t.steps(dt, 5) == [1] * 5
    assert dt.choices == [] and t.sets == [1]
    dt.restore()
    assert t.threads == 2
    t2 = FakeTorch(4, {4: 0.1})
    dt2 = t2.chooser(0)
    assert t2.steps(dt2, 3) == [4, 4, 4] and t2.sets == []


def test_the_choice_carries_over_to_the_next_loop_and_a_changed_count_measures_afresh():
    t = FakeTorch(2, {2: 0.6, 1: 0.06})
    dt = t.chooser(trial_steps=2, reprobe_every=50)
    t.steps(dt, 4)
    dt.restore()
    assert t.threads == 2 and dt.choices == [1]
    dt.start()  # the next request: no new probe, straight to the winner
    assert t.steps(dt, 3) == [1, 1, 1]
    assert dt.loop_steps_at == {1: 3}
    dt.restore()
    t.threads = 4  # the process's count changed (torch.set_num_threads elsewhere): measure again
    t.cost = {4: 0.01, 2: 0.02, 1: 0.04}
    dt.start()
    assert dt.candidates == [4, 2, 1]
    assert t.steps(dt, 7) == [4, 4, 2, 2, 1, 1, 4]
    assert dt.choices == [1, 4]


def test_steps_before_start_are_refused():
    dt = DecodeThreads("auto", get_threads=lambda: 2, set_threads=lambda k: None)
    with pytest.raises(RuntimeError, match="before start"):
        dt.before_step()


def test_a_one_core_process_never_measures():
    t = FakeTorch(1, {1: 0.05})
    dt = t.chooser("auto")
    assert dt.candidates == [1] and not dt.measuring
    assert t.steps(dt, 200) == [1] * 200 and t.sets == []


@pytest.mark.parametrize("bad", ["fast", -1, 1.5, True, None])
def test_a_bad_setting_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="decode threads must be 'auto' or a count"):
        DecodeThreads(bad, get_threads=lambda: 2, set_threads=lambda k: None)


def test_the_interval_doubles_while_the_winner_holds_and_a_stall_measures_at_once():
    t = FakeTorch(2, {2: 0.03, 1: 0.05})
    dt = t.chooser(trial_steps=1, reprobe_every=4, max_reprobe_every=8)
    # probe (2 steps), 4 at the winner, probe, 8 (doubled), probe, then 5 of 8 (capped)
    used = t.steps(dt, 2 + 4 + 2 + 8 + 2 + 5)
    assert used == [2, 1] + [2] * 4 + [2, 1] + [2] * 8 + [2, 1] + [2] * 5
    assert dt.choices == [2, 2, 2]
    # load arrives: the next step takes 10x the winner's probe time, so the probe runs on the step after
    t.cost = {2: 0.30, 1: 0.05}
    assert t.steps(dt, 1 + 2 + 3) == [2] + [2, 1] + [1, 1, 1]
    assert dt.choices == [2, 2, 2, 1]
    assert dt._interval == 4  # a new winner starts the interval over


def test_a_count_only_slightly_faster_than_the_process_s_own_is_not_worth_switching_to():
    t = FakeTorch(2, {2: 0.050, 1: 0.047})  # 6% faster: within the 10% margin
    dt = t.chooser(trial_steps=2)
    t.steps(dt, 4)
    assert dt.choices == [2]
    t2 = FakeTorch(2, {2: 0.050, 1: 0.040})  # 20% faster: worth it
    dt2 = t2.chooser(trial_steps=2)
    t2.steps(dt2, 4)
    assert dt2.choices == [1]


def test_a_new_batch_width_is_probed_once_and_its_own_time_is_the_stall_reference():
    t = FakeTorch(2, {2: 0.03, 1: 0.05})
    dt = t.chooser(trial_steps=1, reprobe_every=100)  # started with 1 row
    t.steps(dt, 2 + 3)
    dt.restore()
    dt.start(rows=8)  # never measured at 8 rows: probe it
    t.cost = {2: 0.09, 1: 0.15}
    assert t.steps(dt, 2 + 2) == [2, 1, 2, 2]
    dt.restore()
    dt.start(rows=1)  # 1 row is known: no probe
    assert t.steps(dt, 1) == [2]
    # load arrives at 1 row: 0.09 s is 3x the 1-row reference (0.03) though below the 8-row one
    t.cost = {2: 0.095, 1: 0.05}
    assert t.steps(dt, 1 + 2 + 1) == [2, 2, 1, 1]
    assert dt.choices[-1] == 1
