"""The learning stage's pure parts (flywheel.learn): the dev split, the arm choice, dev isolation."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from flywheel.learn import ArmResult, _without, choose_arm, dev_split, split_sources
from flywheel.vocab.ids import digest


class _QuietTracker:
    """The tracker of the stage's wiring tests (training and scoring replaced by recorders): aliases go
    nowhere, a run's metrics go to ``logged``."""

    def __init__(self, logged: dict | None = None) -> None:
        self.logged = {} if logged is None else logged

    def set_alias(self, *a) -> None:
        pass

    @contextlib.contextmanager
    def run(self, *a, **kw):
        yield SimpleNamespace(log_params=lambda *a, **k: None, log_metrics=lambda m, **k: self.logged.update(m))


def _task(i: int, cluster: str, *, outcome: str = "failure", split: str = "train", **md) -> dict:
    return {"task_id": f"eval:{i}", "metadata": {"cluster": cluster, "origin_outcome": outcome, "split": split, **md}}


def test_dev_split_takes_whole_clusters_deterministically_and_only_failures():
    tasks = [_task(i, f"c{i // 3}") for i in range(30)] + [_task(100 + i, f"s{i}", outcome="success") for i in range(5)]
    dev = dev_split(tasks, fraction=0.2, min_items=4, seed=0)
    assert dev == dev_split(list(reversed(tasks)), fraction=0.2, min_items=4, seed=0)  # order does not matter
    assert not any(t.startswith("eval:1") and len(t) == 8 for t in dev)  # no success (eval:100..104)
    clusters = {t["metadata"]["cluster"] for t in tasks if t["task_id"] in dev}
    # whole clusters: every member of a chosen cluster is in
    assert all(t["task_id"] in dev for t in tasks if t["metadata"]["cluster"] in clusters)
    assert 6 <= len(dev) <= 8  # ceil(0.2 * 30) = 6, rounded up to a whole cluster of 3
    assert dev != dev_split(tasks, fraction=0.2, min_items=4, seed=1) or len(clusters) == 10


def test_dev_split_respects_min_items_and_never_takes_more_than_half():
    tasks = [_task(i, f"c{i}") for i in range(10)]
    assert len(dev_split(tasks, fraction=0.01, min_items=4)) == 4
    assert len(dev_split(tasks, fraction=0.4, min_items=20)) == 5  # capped at half of 10
    assert dev_split(tasks, fraction=0.0, min_items=4) == set()
    assert dev_split([], fraction=0.2, min_items=4) == set()


def test_a_new_wave_only_adds_dev_clusters():
    """A cluster's rank is a hash of its name: clusters in an earlier wave's dev split stay there when the
    fraction is reached by the same clusters (only the cut point moves)."""
    wave1 = [_task(i, f"c{i}") for i in range(20)]
    wave2 = wave1 + [_task(100 + i, f"d{i}") for i in range(20)]
    d1, d2 = dev_split(wave1, fraction=0.2, min_items=1), dev_split(wave2, fraction=0.2, min_items=1)
    assert len(d2) == 8 and len(d1) == 4
    ranked = sorted({t["metadata"]["cluster"] for t in wave2}, key=lambda c: digest(f"dev|0|{c}"))
    assert {f"eval:{int(c[1:]) + (100 if c[0] == 'd' else 0)}" for c in ranked[:8]} == d2


def test_synthetic_variants_of_dev_tasks_never_train():
    real = [_task(1, "a"), _task(2, "b")]
    synth = [_task(10, "a", synth_batch="synth:x", seed_task="eval:1"),
             _task(11, "b", synth_batch="synth:x", seed_task="eval:2"),
             _task(12, "ab", synth_batch="synth:y", seed_task="eval:2", seed_tasks=["eval:2", "eval:1"])]
    env_real, env_synth = split_sources(real + synth + [_task(3, "h", split="heldout")])
    assert [t["task_id"] for t in env_real] == ["eval:1", "eval:2"]  # held-out dropped
    assert [t["task_id"] for t in _without(env_synth, {"eval:1"})] == ["eval:11"]
    assert [t["task_id"] for t in _without(env_real, {"eval:1"})] == ["eval:2"]


def _arm(name: str, dev: int | None, skipped: str | None = None, credit: float | None = None,
         loss: float | None = None) -> ArmResult:
    return ArmResult(name, model_version=1, dev_passed=dev, dev_items=10, skipped=skipped, dev_credit=credit,
                     dev_loss=loss)


def test_the_control_ships_unless_an_arm_beats_it_strictly_on_dev():
    assert choose_arm([_arm("control", 5), _arm("targeted", 5), _arm("rpo", 4)])[0] == "control"  # a tie: control
    name, why = choose_arm([_arm("control", 5), _arm("targeted", 6), _arm("rpo", 7)])
    assert name == "rpo" and "7/10" in why and "5/10" in why
    assert choose_arm([_arm("control", 5), _arm("targeted", 7), _arm("rpo", 7)])[0] == "targeted"  # earlier arm on a tie
    # a skipped arm never wins, whatever it recorded
    assert choose_arm([_arm("control", 3), _arm("grpo", 9, skipped="no signal")])[0] == "control"
    assert "only arm" in choose_arm([_arm("control", 3)])[1]
    with pytest.raises(ValueError, match="control"):
        choose_arm([_arm("targeted", 3)])


def test_an_equal_dev_pass_count_is_broken_by_partial_credit_and_never_against_the_control():
    # the measured case (bench_flywheel_vs_sft, seed 0): targeted and the control both passed 6/15 on dev
    arms = [_arm("control", 6, credit=0.52), _arm("targeted", 6, credit=0.61), _arm("rpo", 4, credit=0.70)]
    name, why = choose_arm(arms)
    assert name == "targeted" and "partial credit 0.610 against 0.520" in why
    # pass counts come first: rpo's higher credit does not outrank two more passed items
    assert choose_arm(arms, tie_break="control")[0] == "control"  # the pass-count-only rule
    assert choose_arm([_arm("control", 6, credit=0.61), _arm("targeted", 6, credit=0.52)])[0] == "control"
    assert choose_arm([_arm("control", 6, credit=0.5), _arm("targeted", 6, credit=0.5)])[0] == "control"  # equal: control
    assert choose_arm([_arm("control", 6, credit=0.9), _arm("targeted", 7, credit=0.1)])[0] == "targeted"
    with pytest.raises(ValueError, match="tie_break"):
        choose_arm(arms, tie_break="coin")


def test_the_same_greedy_dev_score_is_broken_by_the_loss_on_the_dev_corrections():
    """Issue 30: in bench_flywheel_vs_sft (seed 0, commit 210e880) and the demo's cycle 2 (21bf589) the two
    2-step trials gave the same greedy dev answers -- 6/15 with partial credit 0.696889 each, 10/19 with
    0.667544 each -- and the tie shipped the control by default. The loss on the dev corrections (what the
    model puts on the right answers, never a tie in practice) now decides such a tie; only a strictly lower
    loss ships another arm, and a missing loss ships the control."""
    from flywheel.learn import needs_dev_loss

    tied = [_arm("control", 6, credit=0.696889), _arm("targeted", 6, credit=0.696889)]
    assert needs_dev_loss(tied, tie_break="partial_credit_then_loss") == ["control", "targeted"]
    assert needs_dev_loss(tied, tie_break="partial_credit") == []
    assert choose_arm(tied)[0] == "control"  # no loss scored: the control
    lower = [_arm("control", 6, credit=0.696889, loss=0.4187), _arm("targeted", 6, credit=0.696889, loss=0.4123)]
    name, why = choose_arm(lower)
    assert name == "targeted" and "0.4123 against 0.4187" in why
    assert choose_arm(lower, tie_break="partial_credit")[0] == "control"  # the rule before it
    higher = [_arm("control", 6, credit=0.7, loss=0.41), _arm("targeted", 6, credit=0.7, loss=0.45)]
    name, why = choose_arm(higher)
    assert name == "control" and "targeted 0.4500" in why
    assert choose_arm([_arm("control", 6, credit=0.7, loss=0.41), _arm("targeted", 6, credit=0.7, loss=0.41)])[0] == "control"
    # the loss never overrules the greedy score: fewer passes or less credit lose whatever the loss
    assert choose_arm([_arm("control", 6, credit=0.7, loss=0.9), _arm("targeted", 5, credit=0.9, loss=0.1)])[0] == "control"
    assert choose_arm([_arm("control", 6, credit=0.7, loss=0.9), _arm("targeted", 6, credit=0.6, loss=0.1)])[0] == "control"
    # no loss is needed when the greedy score already decides, or when nothing ties the control
    assert needs_dev_loss([_arm("control", 6, credit=0.5), _arm("targeted", 6, credit=0.6)],
                          tie_break="partial_credit_then_loss") == []
    assert needs_dev_loss([_arm("control", 6, credit=0.6), _arm("targeted", 5, credit=0.9)],
                          tie_break="partial_credit_then_loss") == []
    # three arms, two tied with the control and one below: the loss is scored for the tied ones only
    three = [_arm("control", 6, credit=0.6), _arm("targeted", 6, credit=0.6), _arm("rpo", 4, credit=0.9),
             _arm("grpo", 6, credit=0.6)]
    assert needs_dev_loss(three, tie_break="partial_credit_then_loss") == ["control", "targeted", "grpo"]


def test_dev_credit_is_one_per_passed_item_and_the_components_mean_otherwise():
    from types import SimpleNamespace as NS

    from flywheel.learn import _credit

    assert _credit(NS(passed=True, components={"values": 0.0}, infra_error=None)) == 1.0
    assert _credit(NS(passed=False, components={"parseable": 1.0, "function_names": 1.0, "values": 0.0, "required_args": 0.0},
                      infra_error=None)) == 0.5
    assert _credit(NS(passed=False, components={"parseable": 1.0}, infra_error="sandbox down")) == 0.0
    assert _credit(NS(passed=False, components={}, infra_error=None)) == 0.0


def test_config_refuses_arms_without_the_control():
    from flywheel.config import ConfigError, FlywheelConfig

    with pytest.raises((ValueError, ConfigError), match="control"):
        FlywheelConfig.model_validate({"train": {"arms": ["rpo", "targeted"]}})
    assert FlywheelConfig.model_validate({"train": {"mode": "arms", "arms": ["control", "rpo"]}}).train.arms == ["control", "rpo"]


def test_the_controls_trial_and_continuation_resume_one_plain_sft_data_stream():
    """Issue 30: the control path (first pass, trial, continuation) trains exactly the batches one plain SFT
    run of the same length would: before `skip`, the control's trial re-trained the first pass's first
    batches, so the shipped control saw a quarter of the corrections twice and the rest of the epoch never."""
    from types import SimpleNamespace

    from flywheel.train.trainer import batches

    samples = [SimpleNamespace(group_id=f"demo:{i}") for i in range(21)]  # 21 / 4 leaves a short last batch

    def ids(stream):
        return [[s.group_id for s in b] for b in stream]

    plain = ids(batches(samples, 4, 6 + 2 + 9, seed=3))
    first = ids(batches(samples, 4, 6, seed=3))
    trial = ids(batches(samples, 4, 2, seed=3, skip=6))
    cont = ids(batches(samples, 4, 9, seed=3, skip=8))
    assert first + trial + cont == plain and len(plain) == 17
    assert trial != first[:2]  # the trial goes on into the next pass instead of repeating the first batches
    assert ids(batches(samples, 4, 3, seed=3, skip=0)) == plain[:3]


def test_extra_demonstrations_are_each_trained_once_and_leave_the_stream_as_it_was():
    """The dev corrections and the regression repairs join a continuation through `spread`: before, they
    were added to its data, which reshuffled the stream that `skip` resumes, and each extra landed in the
    trained steps only by chance (about 84% per copy in the demo's cycle 2)."""
    from types import SimpleNamespace

    from flywheel.train.trainer import batches, spread

    samples = [SimpleNamespace(group_id=f"demo:{i}") for i in range(21)]
    extras = [SimpleNamespace(group_id=g) for g in ("dev:0", "dev:1", "dev:2", "reg:a", "reg:b", "reg:a", "reg:b")]
    plain = [[s.group_id for s in b] for b in batches(samples, 4, 17, seed=3)]
    cont = [[s.group_id for s in b] for b in spread(batches(samples, 4, 9, seed=3, skip=8), extras, 9)]
    assert [[g for g in b if g.startswith("demo:")] for b in cont] == plain[8:17]  # the stream is untouched
    added = [g for b in cont for g in b if not g.startswith("demo:")]
    assert sorted(added) == sorted(e.group_id for e in extras)  # every extra exactly once
    steps_of_a = [i for i, b in enumerate(cont) if "reg:a" in b]
    assert len(steps_of_a) == 2 and steps_of_a[0] != steps_of_a[1]  # the two copies in different steps
    assert sum(len(b) for b in spread(batches(samples, 4, 2, seed=3), extras, 2)) == 8 + 7  # more extras than steps
    with pytest.raises(ValueError):
        list(spread([], extras, 0))


def _regression_task(i: int) -> dict:
    return {"task_id": f"eval:r{i}", "metadata": {"cluster": f"r{i}", "split": "regression", "origin_outcome": "success"},
            "prompt": {"messages": [{"role": "user", "content": f"rain in city {i}?"}], "tools": []},
            "reference": {"tool_calls": [{"name": "precipitation_stats", "arguments": {"city": f"c{i}"}}]}}


def _real_tasks(n: int) -> list[dict]:
    """``n`` train-side real failures with a reference answer, one cluster each (``eval:0`` ...)."""
    return [{**_regression_task(100 + i), "task_id": f"eval:{i}",
             "metadata": {"cluster": f"c{i}", "split": "train", "origin_outcome": "failure"}} for i in range(n)]


def _synth_tasks(n: int) -> list[dict]:
    """``n`` synthetic tasks of one synthesis batch (``synth:b``)."""
    return [{**_regression_task(200 + i), "task_id": f"synth:{i}",
             "metadata": {"cluster": "c0", "split": "train", "synth_batch": "synth:b", "origin_outcome": "synthetic"}}
            for i in range(n)]


def test_synthetic_share_caps_the_synthesis_beside_the_real_corrections_keeping_each_generators_share():
    """train.synthetic_share: the accepted synthetic tasks make up at most that share of the targeted arm's
    demonstrations; the sample keeps every generator's share of what was accepted, is the same on every call,
    and keeps the tasks' order. At 1 (the default) or when they fit, every accepted task trains."""
    from flywheel.learn import cap_synthetic

    synth = [{**t, "metadata": {**t["metadata"], "generator": "parallel" if i < 15 else "mutate"}}
             for i, t in enumerate(_synth_tasks(20))]
    assert cap_synthetic(synth, 12, 1.0) == synth
    assert cap_synthetic(synth, 60, 0.25) == synth  # room for 20: all fit
    kept = cap_synthetic(synth, 12, 0.25)  # floor(12 / 3) = 4 synthetic beside 12 real: 20% -> 25% of 16
    assert len(kept) == 4 and len(kept) / (len(kept) + 12) == 0.25
    gens = [t["metadata"]["generator"] for t in kept]
    assert gens.count("parallel") == 3 and gens.count("mutate") == 1  # 15:5 accepted -> 3:1 kept
    assert kept == cap_synthetic(synth, 12, 0.25) and kept == [t for t in synth if t in kept]
    assert len(cap_synthetic(synth, 12, 0.5)) == 12  # half: as many synthetic as real
    with pytest.raises(ValueError):
        from flywheel.config.learning import TrainConfig

        TrainConfig(synthetic_share=0.0)


def test_the_regression_items_the_trial_model_fails_join_the_continuation_repeated():
    """Issue 30: the gate refuses a challenger that fails a regression item the champion passes (one such item
    refused a 12-to-4 cycle-2 challenger). The items the chosen arm's trial model fails come back, repeated,
    as demonstrations of the continuation; items it passes add nothing."""
    from flywheel.learn import regression_repair

    checked = [_regression_task(i) for i in range(5)]
    failed, demos = regression_repair(checked, ["eval:r0", "eval:r2", "eval:r3"], copies=2)
    assert failed == ["eval:r1", "eval:r4"]
    assert [d.source_entity_id for d in demos] == ["eval:r1", "eval:r4"] * 2
    assert all(d.split == "train" and d.answer_calls[0].name == "precipitation_stats" for d in demos)
    assert regression_repair(checked, [f"eval:r{i}" for i in range(5)], copies=2) == ([], [])
    assert regression_repair(checked, [], copies=0)[1] == []  # 0 copies: checked, reported, nothing added


def test_the_regression_check_is_on_by_default_and_refuses_nonsense():
    from flywheel.config import FlywheelConfig

    t = FlywheelConfig.model_validate({}).train
    assert t.regression_repair == 2 and t.regression_check_items == 64
    with pytest.raises(ValueError):
        FlywheelConfig.model_validate({"train": {"regression_repair": -1}})
    with pytest.raises(ValueError):
        FlywheelConfig.model_validate({"train": {"regression_check_items": 0}})


def test_the_stage_checks_the_chosen_trial_on_the_regression_suite_and_repairs_in_the_continuation(cfg, store, monkeypatch):
    """The wiring of the check through run_learning, with training and decoding replaced by recorders: the
    continuation's demonstrations hold the failed regression item twice more, the items passed once (the
    replay every phase has), and learning.decided records the check."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control"], 0
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.dev_min_items, cfg.train.batch_size = 1, 2, 2, 4
    real = [{**_regression_task(100 + i), "task_id": f"eval:{i}",
             "metadata": {"cluster": f"c{i}", "split": "train", "origin_outcome": "failure"}} for i in range(12)]
    regression = [_regression_task(i) for i in range(4)]
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=real))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=regression))
    trained: list[list[str]] = []
    extras: list[list[str]] = []

    def fake_sft(cfg, store, artifacts, tracker, demos, *, steps, keep_optimizer_state=False, extra_demonstrations=(),
                 **kw):
        trained.append([d.source_entity_id for d in demos])
        extras.append([d.source_entity_id for d in extra_demonstrations])
        v = len(trained) + 1
        return SimpleNamespace(model_entity=f"model:policy/{v}", model_version=v, run_id=f"run:{v}", mlflow_run_id=None,
                               steps=steps, metrics={}, history=[], optimizer_state={} if keep_optimizer_state else None)

    def fake_score(cfg, tracker, version, tasks):
        passed = [t["task_id"] for t in tasks if t["task_id"] != "eval:r1"]
        return len(passed), passed, 0.5

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_dev_score", fake_score)
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, trial, cont = trained
    assert first == trial == cont  # the data stream itself is the same in every phase: plain SFT's
    assert cont.count("eval:r1") == 1 and extras[:2] == [[], []]
    # the continuation adds the dev corrections and the failed item twice, each trained once (spread)
    dev_ids = [t["task_id"] for t in real if t["task_id"] not in cont]
    assert extras[2] == dev_ids + ["eval:r1", "eval:r1"] and len(dev_ids) >= 2
    assert r.regression == {**r.regression, "items": 4, "passed": 3, "failed": ["eval:r1"], "copies": 2,
                            "demonstrations": 2, "model_entity": "model:policy/3"}
    assert r.continuation["detail"]["regression_repair"] == 2
    (ev,) = store.read(stream=r.learn_id, types="learning.decided")
    assert ev.payload["regression"]["failed"] == ["eval:r1"]


def test_the_stage_scores_the_dev_loss_of_tied_trials_only_and_ships_the_lower(cfg, store, monkeypatch):
    """The wiring through run_learning, training and scoring replaced by recorders: two trials with the same
    greedy dev score get their dev loss scored (nothing else does), the lower one continues and ships, and
    learning.decided and the MLflow metrics carry the losses."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted"], 0
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.dev_min_items, cfg.train.batch_size = 1, 2, 2, 4
    real, synth = _real_tasks(12), _synth_tasks(4)
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=real + synth))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=[]))
    bases: list[str] = []

    def fake_sft(cfg, store, artifacts, tracker, demos, *, steps, base=None, keep_optimizer_state=False, **kw):
        bases.append(base)
        v = len(bases) + 1
        return SimpleNamespace(model_entity=f"model:policy/{v}", model_version=v, run_id=f"run:{v}", mlflow_run_id=None,
                               steps=steps, metrics={}, history=[], optimizer_state={} if keep_optimizer_state else None)

    scored_loss: list[int] = []

    def fake_loss(cfg, tracker, version, tasks):
        scored_loss.append(version)
        return {3: 0.52, 4: 0.47}[version]  # v3 the control's trial, v4 the targeted trial

    logged: dict = {}

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_dev_score", lambda cfg, tracker, version, tasks: (1, [tasks[0]["task_id"]], 0.6))
    monkeypatch.setattr(learn, "_dev_loss", fake_loss)
    r = learn.run_learning(cfg, store, None, _QuietTracker(logged), base="tiny")
    assert sorted(scored_loss) == [3, 4]
    assert r.chosen == "targeted" and "0.4700 against 0.5200" in r.why
    assert bases[-1] == "model:policy/4"  # the continuation starts from the targeted trial
    (ev,) = store.read(stream=r.learn_id, types="learning.decided")
    assert {a["name"]: a["dev_loss"] for a in ev.payload["arms"]} == {"control": 0.52, "targeted": 0.47}
    assert logged["targeted.dev_loss"] == 0.47
    # a clear greedy decision scores no loss at all
    scored_loss.clear()
    bases.clear()
    monkeypatch.setattr(learn, "_dev_score", lambda cfg, tracker, version, tasks: (1 if version == 3 else 0, [], 0.6))
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert scored_loss == [] and r.chosen == "control"


def test_synthesis_in_stream_ships_the_first_pass_continued_on_real_and_synthetic_without_trials(cfg, store, monkeypatch):
    """train.synthesis_in = stream: no dev split (every real correction trains in the first pass), no trials
    and no dev decoding; after the probe the first-pass model continues on real + synthetic for
    arm_steps + continue_steps steps of the same schedule and optimizer, with the regression repairs, and
    that model ships. Without an accepted synthetic task the same steps are the control's stream."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted", "rpo"], 8
    cfg.train.synthesis_in = "stream"
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.dev_min_items, cfg.train.batch_size = 2, 3, 2, 4
    real, synth = _real_tasks(12), _synth_tasks(4)
    regression = [_regression_task(i) for i in range(3)]
    env_tasks = real + synth
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=env_tasks))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=regression))
    calls: list[dict] = []

    def fake_sft(cfg, store, artifacts, tracker, demos, *, steps, base=None, keep_optimizer_state=False,
                 extra_demonstrations=(), schedule=None, optimizer_state=None, **kw):
        calls.append({"ids": [d.source_entity_id for d in demos], "steps": steps, "base": base, "schedule": schedule,
                      "resumed": optimizer_state, "extra": [d.source_entity_id for d in extra_demonstrations]})
        v = len(calls) + 1
        return SimpleNamespace(model_entity=f"model:policy/{v}", model_version=v, run_id=f"run:{v}", mlflow_run_id=None,
                               steps=steps, metrics={}, history=[],
                               optimizer_state={"from": v} if keep_optimizer_state else None)

    scored: list[tuple[int, list[str]]] = []

    def fake_score(cfg, tracker, version, tasks):
        scored.append((version, [t["task_id"] for t in tasks]))
        passed = [t["task_id"] for t in tasks if t["task_id"] != "eval:r1"]
        return len(passed), passed, 0.5

    probed: list[int] = []

    def fake_probe(cfg, tracker, version, train_real, synthesize, say):
        probed.append(len(train_real))
        return {"tasks": 8, "counts": {"wrong_value": 3}, "plan": {"schema_values": 4}}

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_dev_score", fake_score)
    monkeypatch.setattr(learn, "_probe_and_synthesize", fake_probe)
    monkeypatch.setattr("flywheel.rollouts.run_rollouts", lambda *a, **k: pytest.fail("stream mode samples no rollouts"))
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, shipped = calls  # two trainings: the first pass and the stream, nothing else
    real_ids = [t["task_id"] for t in real]
    assert set(real_ids) <= set(first["ids"]) and not any(i.startswith("synth:") for i in first["ids"])
    assert probed == [12]  # the probe sees every real correction: none is held out for dev
    fp_steps = first["steps"]
    assert first["schedule"] == (0, fp_steps + 5)
    assert shipped["base"] == "model:policy/2" and shipped["steps"] == 5
    assert sorted(shipped["ids"]) == sorted(first["ids"] + ["synth:b"] * 4)  # synthetic demos name their batch
    assert shipped["schedule"] == (fp_steps, fp_steps + 5) and shipped["resumed"] == {"from": 2}
    assert shipped["extra"] == ["eval:r1", "eval:r1"]  # the first-pass model failed it: repaired in the stream
    # one decoding pass only: the first-pass model on the regression items; no dev items are decoded
    assert [(v, sorted(ids)) for v, ids in scored] == [(2, ["eval:r0", "eval:r1", "eval:r2"])]
    assert r.chosen == "targeted" and r.model_version == 3 and r.continuation is None and r.fold_in is None
    assert [a.name for a in r.arms] == ["targeted"] and r.arms[0].detail["synthetic"] == 4
    assert r.dev["items"] == 0 and "synthesis_in = stream" in r.why and r.schedule["synthesis_in"] == "stream"
    (ev,) = store.read(stream=r.learn_id, types="learning.decided")
    assert ev.payload["chosen"] == "targeted" and ev.payload["regression"]["failed"] == ["eval:r1"]
    # no synthetic task accepted: the same steps of the control's stream ship
    calls.clear()
    env_tasks = list(real)
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, shipped = calls
    assert r.chosen == "control" and shipped["steps"] == 5 and sorted(shipped["ids"]) == sorted(first["ids"])
    assert "no synthetic task was accepted" in r.why
    # the default keeps trials and the dev split
    calls.clear()
    cfg.train.synthesis_in, cfg.train.arms = "trial", ["control", "targeted"]
    env_tasks = real + synth
    monkeypatch.setattr(learn, "_dev_loss", lambda cfg, tracker, version, tasks: 0.5)
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert len(calls) == 4 and r.dev["items"] >= 2 and [a.name for a in r.arms] == ["control", "targeted"]


def test_stream_real_tail_ends_the_stream_on_the_real_corrections_alone_in_the_same_schedule(cfg, store, monkeypatch):
    """train.stream_real_tail: the stream's last steps continue plain SFT's data stream (no synthetic task) from
    the mixed steps' model, with their optimizer state and the same schedule; that model ships, its steps and
    tokens counted with the mixed ones. At 0 the stream is mixed to the end (one training)."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted"], 8
    cfg.train.synthesis_in, cfg.train.stream_real_tail = "stream", 0.4
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.batch_size = 2, 3, 4
    real, synth = _real_tasks(12), _synth_tasks(4)
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=real + synth))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=[]))
    calls: list[dict] = []

    def fake_sft(cfg, store, artifacts, tracker, demos, *, steps, base=None, keep_optimizer_state=False,
                 schedule=None, optimizer_state=None, start_step=0, **kw):
        calls.append({"ids": [d.source_entity_id for d in demos], "steps": steps, "base": base, "schedule": schedule,
                      "resumed": optimizer_state, "start": start_step})
        v = len(calls) + 1
        return SimpleNamespace(model_entity=f"model:policy/{v}", model_version=v, run_id=f"run:{v}", mlflow_run_id=None,
                               steps=steps, metrics={}, history=[{"tokens": 10 * steps}],
                               optimizer_state={"from": v} if keep_optimizer_state else None)

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_probe_and_synthesize",
                        lambda *a: {"tasks": 8, "counts": {"wrong_value": 3}, "plan": {"schema_values": 4}})
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, mixed, tail = calls
    fp = first["steps"]
    assert mixed["steps"] == 3 and any(i.startswith("synth:") for i in mixed["ids"])
    assert mixed["schedule"] == (fp, fp + 5) and mixed["resumed"] == {"from": 2}
    assert tail["steps"] == 2 and tail["base"] == "model:policy/3" and tail["start"] == fp
    assert not any(i.startswith("synth:") for i in tail["ids"]) and sorted(tail["ids"]) == sorted(first["ids"])
    assert tail["schedule"] == (fp + 3, fp + 5) and tail["resumed"] == {"from": 3}
    (arm,) = r.arms
    assert r.model_version == 4 and arm.name == "targeted" and arm.steps == 5 and arm.tokens == 50
    assert arm.detail["real_tail"]["steps"] == 2 and arm.detail["real_tail"]["mixed_model_entity"] == "model:policy/3"
    assert "the last 2 steps on the real corrections alone" in r.why
    calls.clear()
    cfg.train.stream_real_tail = 0.0
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert len(calls) == 2 and calls[1]["steps"] == 5 and "real_tail" not in r.arms[0].detail
    # a synthetic_share that leaves no synthetic task (floor(0.05 / 0.95 x 12) = 0): not the first pass's batches
    # again from step 0, but the control's stream, continued where the first pass stopped
    calls.clear()
    cfg.train.synthetic_share = 0.05
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, shipped = calls
    assert r.chosen == "control" and shipped["start"] == first["steps"] and shipped["steps"] == 5
    assert not any(i.startswith("synth:") for i in shipped["ids"])
    assert "synthetic_share = 0.05 leaves none of the 4 accepted synthetic tasks" in r.why


def test_the_cycle_report_shows_the_regression_check_and_what_it_failed():
    from flywheel.report import learning_table

    learn = {"chosen": "control", "why": "tie", "first_pass": {"steps": 3}, "arms": [{"name": "control", "steps": 1}],
             "regression": {"items": 4, "passed": 3, "failed": ["eval:r1"], "copies": 2, "cpu_s": 1.5}}
    html = learning_table(learn)
    assert "regression check" in html and "3/4" in html and "eval:r1" in html
    assert "regression check" not in learning_table({**learn, "regression": None})
    skipped = learning_table({**learn, "regression": {"skipped": "train.continue_steps = 0: no continuation"}})
    assert "not run: train.continue_steps = 0" in skipped
    blended = learning_table({**learn, "blend": {"weight": 0.5, "trained": "model:policy/5", "champion": "model:policy/3",
                                                 "model_entity": "model:policy/6", "cpu_s": 0.4}})
    assert "blend with the champion" in blended and "model:policy/3 + 0.5 x (model:policy/5" in blended
    assert "model:policy/6" in blended and "blend with the champion" not in html
    no_blend = learning_table({**learn, "blend": {"weight": 0.5, "skipped": "the champion tiny is a base model"}})
    assert "not run: the champion tiny is a base model" in no_blend


def test_the_scoreboard_says_which_first_pass_demonstrations_were_replayed_successes():
    """Cycle 2's first pass replays the regression suite with the corrections; the demo's table called all
    121 "corrections" when 14 were the champion's replayed successes."""
    from flywheel.demo import _trained_how

    learn = {"model_version": 9, "chosen": "control", "first_pass": {"steps": 16, "demonstrations": 121},
             "dev": {"replay": 14}, "arms": [{"name": "control", "steps": 2, "dev_passed": 10, "dev_items": 19}],
             "continuation": {"steps": 16}, "regression": {"failed": ["eval:a", "eval:b", "eval:c"]}}
    text = _trained_how({"stages": {"learn": learn}}, 9, "policy")
    assert "121 demonstrations, 14 of them replayed successes" in text and "3 regression items repeated" in text
    assert "(16 steps, 81 corrections)" in _trained_how(
        {"stages": {"learn": {**learn, "first_pass": {"steps": 16, "demonstrations": 81}, "dev": {"replay": 0}}}}, 9, "policy")
    # train.synthesis_in = stream: one continued stream, no trial, no dev score
    stream = {"model_version": 3, "chosen": "targeted", "first_pass": {"steps": 12, "demonstrations": 96},
              "dev": {"replay": 0, "items": 0}, "continuation": None, "regression": {"failed": ["eval:a"]},
              "arms": [{"name": "targeted", "steps": 18, "dev_items": 0, "detail": {"phase": "stream", "synthetic": 72}}]}
    assert _trained_how({"stages": {"learn": stream}}, 3, "policy") == (
        "SFT pass (12 steps, 96 corrections) + 18 more, 72 synthetic tasks joined, 1 regression items repeated")
    # train.first_pass_seen < 1: the first pass says how many of the champion's corrections it rehearsed
    seen = {**stream, "first_pass": {"steps": 9, "demonstrations": 68, "seen_by_base": 96, "seen_replayed": 24},
            "dev": {"replay": 14, "items": 0}}
    assert _trained_how({"stages": {"learn": seen}}, 3, "policy").startswith(
        "SFT pass (9 steps, 68 demonstrations, 14 of them replayed successes, 24 of 96 earlier corrections) + 18 more")
    # train.champion_blend < 1: the shipped version is the blend with the champion
    blended = {**stream, "blend": {"weight": 0.5, "model_entity": "model:policy/3"}}
    assert _trained_how({"stages": {"learn": blended}}, 3, "policy").endswith(
        "1 regression items repeated, blended 0.5 with the champion")


def _recording_sft(calls: list[dict], *, first_version: int):
    """A ``train_sft`` stand-in that records the demonstrations of each call and registers versions from
    ``first_version`` on (the in-memory optimizer state names the version it came from)."""
    from types import SimpleNamespace

    def fake_sft(cfg, store, artifacts, tracker, demos, *, steps, base=None, keep_optimizer_state=False, **kw):
        calls.append({"ids": [d.source_entity_id for d in demos], "steps": steps})
        v = len(calls) + first_version - 1
        return SimpleNamespace(model_entity=f"model:policy/{v}", model_version=v, run_id=f"run:{v}", mlflow_run_id=None,
                               steps=steps, metrics={}, history=[], optimizer_state={"from": v} if keep_optimizer_state else None)

    return fake_sft


def test_probe_holdout_keeps_the_probes_tasks_out_of_the_first_pass_and_trains_them_in_the_stream(cfg, store, monkeypatch):
    """train.probe_holdout: the tasks the probe decodes sit out the first pass, so it counts errors on
    requests the model has not trained on (what unseen requests are); the stream trains every real
    correction; more than half of the tasks are never held out; off, nothing changes."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted"], 4
    cfg.train.synthesis_in, cfg.train.probe_holdout = "stream", True
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.batch_size = 2, 3, 4
    real, synth = _real_tasks(12), _synth_tasks(4)
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=real + synth))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=[]))
    calls: list[dict] = []

    fake_sft = _recording_sft(calls, first_version=2)

    probed: list[list[str]] = []

    def fake_probe(cfg, tracker, version, train_real, synthesize, say):
        probed.append([t["task_id"] for t in learn._probe_tasks(cfg.train, train_real)])
        return {"tasks": 4, "counts": {"wrong_value": 1}, "plan": {"schema_values": 4}}

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_probe_and_synthesize", fake_probe)
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    first, shipped = calls
    (held,) = probed
    assert len(held) == 4 and not set(held) & set(first["ids"])  # the probe decodes what the first pass never saw
    assert sorted(first["ids"]) == sorted(t["task_id"] for t in real if t["task_id"] not in held)
    assert first["steps"] == 2  # 8 demonstrations / batch 4
    assert set(held) <= set(shipped["ids"]) and {t["task_id"] for t in real} <= set(shipped["ids"])
    assert r.first_pass["demonstrations"] == 8 and r.first_pass["probe_held_out"] == 4
    # more than half of the tasks: nothing is held out
    calls.clear()
    cfg.train.probe_tasks = 7
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert len(calls[0]["ids"]) == 12 and "probe_held_out" not in r.first_pass
    # off (the default): the first pass trains every real correction
    calls.clear()
    cfg.train.probe_tasks, cfg.train.probe_holdout = 4, False
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert len(calls[0]["ids"]) == 12 and r.first_pass["demonstrations"] == 12


def test_first_pass_seen_rehearses_a_sample_of_what_the_base_trained_on_and_trains_the_new_corrections(cfg, store, monkeypatch):
    """train.first_pass_seen: cycle 2's first pass spent 18 steps over wave 1's corrections, which the
    champion had trained on (loss 0.05), and wave 2's new ones. Below 1, only a seeded share of the corrections
    in the base's lineage rejoins the first pass, every new one trains, and the stream trains them all; a
    base with no lineage (cycle 1) and the default 1.0 train every correction first."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning
    from flywheel.store import NewEvent

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted"], 4
    cfg.train.synthesis_in, cfg.train.first_pass_seen = "stream", 0.25
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.batch_size = 2, 3, 4
    real, synth = _real_tasks(12), _synth_tasks(4)
    seen = [t["task_id"] for t in real[:8]]  # wave 1's corrections: the champion trained on them
    store.append("run:r1", NewEvent("training.completed", {"steps": 3}, seen))
    store.append("model:policy/2", NewEvent("model.registered", {"version": 2}, ["run:r1"]))
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=real + synth))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=[]))
    calls: list[dict] = []

    fake_sft = _recording_sft(calls, first_version=3)  # model:policy/2 is the base

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_probe_and_synthesize", lambda *a: {"tasks": 4, "counts": {}, "plan": {"mutate": 4}})
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="model:policy/2")
    first, shipped = calls
    new = [t["task_id"] for t in real[8:]]
    rehearsed = set(first["ids"]) & set(seen)
    assert set(new) <= set(first["ids"]) and len(rehearsed) == 2 and len(first["ids"]) == 6  # ceil(0.25 x 8) + 4 new
    assert first["steps"] == 2  # 6 demonstrations / batch 4
    assert {t["task_id"] for t in real} <= set(shipped["ids"])  # every correction joins the stream
    assert r.first_pass["seen_by_base"] == 8 and r.first_pass["seen_replayed"] == 2
    # the sample is seeded: the same seed rehearses the same corrections
    calls.clear()
    learn.run_learning(cfg, store, None, _QuietTracker(), base="model:policy/2")
    assert set(calls[0]["ids"]) & set(seen) == rehearsed
    # a base with no lineage (the cycle-1 base model) and the default share: every correction trains first
    for base, share in (("tiny", 0.25), ("model:policy/2", 1.0)):
        calls.clear()
        cfg.train.first_pass_seen = share
        r = learn.run_learning(cfg, store, None, _QuietTracker(), base=base)
        assert len(calls[0]["ids"]) == 12 and "seen_by_base" not in r.first_pass
    # nothing new and a share of 0: the first pass is never empty, it trains every correction
    calls.clear()
    cfg.train.first_pass_seen = 0.0
    store.append("run:r2", NewEvent("training.completed", {"steps": 3}, [t["task_id"] for t in real]))
    store.append("model:policy/9", NewEvent("model.registered", {"version": 9}, ["run:r2"]))
    learn.run_learning(cfg, store, None, _QuietTracker(), base="model:policy/9")
    assert len(calls[0]["ids"]) == 12


def test_the_learning_stage_ships_the_blend_below_one_and_the_trained_model_at_one(cfg, store, monkeypatch):
    """run_learning with train.champion_blend = 0.5 from a registered champion: the stream's model is blended
    with the champion and the blend ships, recorded in learning.decided; at 1 nothing is blended; from a base
    model (cycle 1) the record says why not and the trained model ships."""
    from types import SimpleNamespace

    import flywheel.learn as learn
    import flywheel.train.blend as blend
    import flywheel.train.stage as stage
    import flywheel.versioning as versioning

    cfg.train.mode, cfg.train.arms, cfg.train.probe_tasks = "arms", ["control", "targeted"], 8
    cfg.train.synthesis_in, cfg.train.regression_repair = "stream", 0
    cfg.train.arm_steps, cfg.train.continue_steps, cfg.train.batch_size = 2, 3, 4
    env_tasks = _real_tasks(12) + _synth_tasks(4)
    monkeypatch.setattr(versioning, "load_env", lambda *a: SimpleNamespace(tasks=env_tasks))
    monkeypatch.setattr(versioning, "load_suite", lambda *a: SimpleNamespace(tasks=[]))
    calls: list[dict] = []
    fake_sft = _recording_sft(calls, first_version=11)
    blended: list[dict] = []

    def fake_blend(cfg, store, tracker, *, trained, champion, weight, correlation_id=None):
        blended.append({"trained": trained, "champion": champion, "weight": weight})
        return (SimpleNamespace(model_version=99, model_entity="model:policy/99"),
                {"weight": weight, "trained": trained, "champion": champion, "model_entity": "model:policy/99",
                 "run_id": "run:blend"})

    monkeypatch.setattr(stage, "train_sft", fake_sft)
    monkeypatch.setattr(learn, "_probe_and_synthesize", lambda *a: {"tasks": 8, "counts": {}, "plan": {}})
    monkeypatch.setattr(learn, "_seen_corrections", lambda *a, **k: (set(), set()))
    real_blend = blend.blend_with_champion
    monkeypatch.setattr(blend, "blend_with_champion", fake_blend)
    cfg.train.champion_blend = 0.5
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="model:policy/3")
    assert blended == [{"trained": "model:policy/12", "champion": "model:policy/3", "weight": 0.5}]
    assert r.model_version == 99 and r.model_entity == "model:policy/99" and r.blend["run_id"] == "run:blend"
    (ev,) = store.read(stream=r.learn_id, types="learning.decided")
    assert ev.payload["model"] == "model:policy/99" and ev.payload["blend"]["weight"] == 0.5
    assert "run:blend" in ev.causation and "model:policy/99" in ev.causation

    blended.clear()
    cfg.train.champion_blend = 1.0
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="model:policy/3")
    assert blended == [] and r.blend is None and r.model_entity == f"model:policy/{len(calls) + 10}"

    monkeypatch.setattr(blend, "blend_with_champion", real_blend)  # a base-model champion has no adapter to blend
    cfg.train.champion_blend = 0.5
    r = learn.run_learning(cfg, store, None, _QuietTracker(), base="tiny")
    assert r.model_entity == f"model:policy/{len(calls) + 10}" and "base model" in r.blend["skipped"]


def test_the_probe_plans_only_the_generators_the_user_configured(cfg, monkeypatch):
    """synth.generators is the user's list of generators; the probe-aimed plan used every generator it knows
    whatever that list said, so a list without `parallel` still got parallel variants when the probe counted
    missing calls. The plan keeps to the list (in the planner's order), and a list with none the probe can
    plan is refused with the reason."""
    import flywheel.learn as learn
    from flywheel.policy import registry
    from flywheel.synth import probe

    counts = dict.fromkeys(probe.ERROR_KINDS, 0) | {"missing_call": 5, "wrong_value": 3}
    report = probe.ProbeReport(total=8, scored=8, passed=0, failed=8, counts=counts, all_counts=dict(counts),
                               per_task={}, shares={})
    monkeypatch.setattr(registry, "load_policy_for_version", lambda *a, **k: object())
    monkeypatch.setattr(probe, "run_probe", lambda policy, tasks, **k: report)
    cfg.synth.per_seed = 2
    plans: list[dict] = []
    tasks = _real_tasks(10)

    cfg.synth.generators = ["mutate", "schema_values", "parallel"]
    learn._probe_and_synthesize(cfg, None, 1, tasks, lambda plan: plans.append(plan) or {}, lambda *a: None)
    assert plans[-1]["parallel"] > 0 and set(plans[-1]) == {"schema_values", "parallel", "mutate"}

    cfg.synth.generators = ["mutate", "schema_values", "paraphrase"]  # no parallel: its weight goes to nobody
    info = learn._probe_and_synthesize(cfg, None, 1, tasks, lambda plan: plans.append(plan) or {}, lambda *a: None)
    assert set(plans[-1]) == {"schema_values", "mutate"} and sum(plans[-1].values()) == 20
    assert info["plan"] == plans[-1]

    cfg.synth.generators = ["paraphrase", "enumeration"]
    with pytest.raises(ValueError, match="names none of the generators the probe can plan"):
        learn._probe_and_synthesize(cfg, None, 1, tasks, lambda plan: {}, lambda *a: None)
