"""train.threads (flywheel/train/threads.py): a CPU training step gets the cores other processes left free
during the step before, never more than torch's own count, and torch's count comes back after each step."""

from __future__ import annotations

import pytest

from flywheel.train.threads import TrainThreads, check_train_threads, read_cpu_busy

TICKS = 100.0  # clock ticks per second of the fake /proc/stat


class _Machine:
    """A fake 2-core machine: each step lasts 1 s of wall time; the process uses ``own`` cores and other
    processes ``others`` cores during it, which advance the busy ticks and the process time."""

    def __init__(self, others: float = 0.0) -> None:
        self.others = others
        self.busy = 0.0
        self.cpu = 0.0
        self.now = 0.0
        self.threads = 2
        self.sets: list[int] = []

    def run_step(self) -> None:
        # with one thread the process keeps one core busy; with two, two minus what others take from it
        own = 1.0 if self.threads == 1 else max(1.0, 2.0 - self.others)
        self.cpu += own
        self.busy += (own + self.others) * TICKS
        self.now += 1.0

    def set_threads(self, k: int) -> None:
        self.threads = k
        self.sets.append(k)

    def chooser(self, setting="auto") -> TrainThreads:
        tt = TrainThreads(setting, read_busy=lambda: (self.busy, 2 * TICKS * self.now), ncpu=2,
                          process_time=lambda: self.cpu, clock=lambda: self.now,
                          get_threads=lambda: self.threads, set_threads=self.set_threads)
        tt._ticks_per_s = TICKS
        return tt


def _steps(m: _Machine, tt: TrainThreads, n: int) -> list[int]:
    used = []
    for _ in range(n):
        tt.before_step()
        used.append(m.threads)
        m.run_step()
        tt.after_step()
        assert m.threads == 2  # torch's own count is back between steps
    return used


def test_an_idle_machine_keeps_torchs_count_and_never_switches():
    m = _Machine(others=0.0)
    tt = m.chooser()
    assert _steps(m, tt, 5) == [2, 2, 2, 2, 2]
    assert m.sets == [] and tt.switches == 0 and tt.summary()["steps_at"] == {2: 5}


def test_a_busy_core_drops_the_next_steps_to_one_thread_and_an_idle_one_brings_two_back():
    m = _Machine(others=1.0)
    tt = m.chooser()
    assert _steps(m, tt, 3) == [2, 1, 1]  # the first step shows the load; the next ones use the free core
    assert tt.last_others == pytest.approx(1.0) and tt.others_max == pytest.approx(1.0)
    m.others = 0.0  # the other process ended
    assert _steps(m, tt, 3) == [1, 2, 2]
    assert tt.summary()["steps_at"] == {2: 3, 1: 3} and tt.switches == 2


def test_a_little_load_keeps_both_threads():
    m = _Machine(others=0.3)
    assert _steps(m, m.chooser(), 3) == [2, 2, 2]


def test_a_fixed_count_is_used_as_set_and_zero_leaves_torchs():
    m = _Machine(others=1.0)
    assert _steps(m, m.chooser(1), 3) == [1, 1, 1]
    m = _Machine(others=1.0)
    assert _steps(m, m.chooser(0), 2) == [2, 2]


def test_no_proc_stat_leaves_the_count_alone():
    m = _Machine(others=1.0)
    tt = TrainThreads("auto", read_busy=lambda: None, ncpu=2, process_time=lambda: m.cpu, clock=lambda: m.now,
                      get_threads=lambda: m.threads, set_threads=m.set_threads)
    assert _steps(m, tt, 3) == [2, 2, 2] and tt.last_others is None


def test_a_failing_step_gives_torchs_count_back():
    m = _Machine(others=1.0)
    tt = m.chooser()
    _steps(m, tt, 1)
    tt.before_step()
    assert m.threads == 1
    tt.after_step()  # what Trainer.step's finally does when the step raised
    assert m.threads == 2


def test_read_cpu_busy_sums_the_affinity_cpus_and_counts_steal_as_busy(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 2 0 0\n"
                    "cpu0 1 2 3 40 5 6 7 8 0 0\n"
                    "cpu1 10 0 0 90 0 0 0 0 0 0\n"
                    "intr 12345\n")
    assert read_cpu_busy(None, str(stat)) == (1 + 2 + 3 + 6 + 7 + 8 + 10, 1 + 2 + 3 + 40 + 5 + 6 + 7 + 8 + 100)
    assert read_cpu_busy({1}, str(stat)) == (10, 100)
    assert read_cpu_busy({7}, str(stat)) is None
    assert read_cpu_busy(None, str(tmp_path / "missing")) is None


def test_the_setting_is_checked():
    check_train_threads("auto")
    check_train_threads(3)
    for bad in ("fast", -1, True, 1.5):
        with pytest.raises(ValueError, match="train threads"):
            check_train_threads(bad)


def test_the_trainer_records_the_threads_of_each_cpu_step():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flywheel.config import TrainConfig
    from flywheel.train.data import TrainSample
    from flywheel.train.trainer import Trainer, TrainerOptions

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))

    own = torch.get_num_threads()
    tr = Trainer(model(), TrainerOptions(objective="sft", lr=1e-3, total_steps=2, temperature=1.0,
                                       max_completion_len=8, train=TrainConfig(lora_r=4, threads=1)), device="cpu")
    m = tr.step([TrainSample(prompt_ids=[1, 2, 3], completion_ids=[4, 5], loss_mask=[1, 1])])
    assert m.stats["threads"] == 1.0 and tr.threads.summary()["steps_at"] == {1: 1}
    assert torch.get_num_threads() == own  # torch's count is back after the step
    auto = Trainer(model(), TrainerOptions(objective="sft", lr=1e-3, total_steps=2, temperature=1.0,
                                         max_completion_len=8, train=TrainConfig(lora_r=4)), device="cpu")
    assert auto.threads.setting == "auto"
