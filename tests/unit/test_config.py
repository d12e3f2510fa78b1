"""Configuration: precedence defaults < flywheel.toml < environment < overrides; clear rejections."""

from __future__ import annotations

import pytest

from flywheel.config import ConfigError, FlywheelConfig, load_config


def write(tmp_path, text):
    p = tmp_path / "flywheel.toml"
    p.write_text(text)
    return p


def test_defaults_resolve_paths_under_home(tmp_path):
    cfg = load_config(environ={"FLYWHEEL_HOME": str(tmp_path / "h")})
    assert cfg.home == (tmp_path / "h").absolute()
    assert cfg.warehouse == cfg.home / "warehouse.duckdb"
    assert cfg.mlflow_tracking_uri == f"sqlite:///{cfg.home / 'mlflow.db'}"
    assert cfg.mlflow_artifact_root == cfg.home / "mlartifacts"
    assert cfg.gate.min_pass_rate == FlywheelConfig().gate.min_pass_rate


def test_precedence_defaults_toml_env_overrides(tmp_path):
    p = write(tmp_path, "[gate]\nmin_pass_rate = 0.2\nconfidence = 0.9\n[rollout]\ngroup_size = 6\n")
    env = {"FLYWHEEL_HOME": str(tmp_path), "FLYWHEEL_GATE__MIN_PASS_RATE": "0.5"}
    cfg = load_config(p, environ=env)
    assert (cfg.gate.min_pass_rate, cfg.gate.confidence, cfg.rollout.group_size) == (0.5, 0.9, 6)
    cfg = load_config(p, environ=env, overrides={"gate": {"min_pass_rate": 0.7}, "rollout": {"group_size": None}})
    assert (cfg.gate.min_pass_rate, cfg.gate.confidence, cfg.rollout.group_size) == (0.7, 0.9, 6)
    assert load_config(p, environ={"FLYWHEEL_HOME": str(tmp_path)}).gate.min_pass_rate == 0.2


def test_toml_found_through_env_and_mlflow_uri_env(tmp_path):
    p = write(tmp_path, "[train]\nsteps = 3\n")
    cfg = load_config(environ={"FLYWHEEL_CONFIG": str(p), "MLFLOW_TRACKING_URI": "http://mlflow:5000",
                               "FLYWHEEL_HOME": str(tmp_path)})
    assert cfg.train.steps == 3 and cfg.mlflow_tracking_uri == "http://mlflow:5000"


@pytest.mark.parametrize(
    "toml,env,needle",
    [
        ("[gate]\nmin_pass_rat = 0.5\n", {}, "gate.min_pass_rat: unknown key"),
        ("[gaet]\nx = 1\n", {}, "gaet: unknown key"),
        ("[gate]\nmin_pass_rate = 1.5\n", {}, "gate.min_pass_rate: Input should be less than or equal to 1"),
        ("", {"FLYWHEEL_GATE__CONFIDENCE": "high"}, "gate.confidence"),
        ("", {"FLYWHEEL_ROLLOUT__GROUP_SIZE": "0"}, "rollout.group_size: Input should be greater than or equal to 1"),
        ("", {"FLYWHEEL_NOPE__X": "1"}, "nope: unknown key"),
        ("[ingest]\nredaction_rules = [{name = 'x', pattern = '(' }]\n", {}, "not a valid regular expression"),
    ],
)
def test_unknown_keys_and_bad_values_are_rejected_naming_key_and_reason(tmp_path, toml, env, needle):
    p = write(tmp_path, toml)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={"FLYWHEEL_HOME": str(tmp_path), **env})
    assert needle in str(e.value)


def test_bad_override_names_cli_flags_as_source(tmp_path):
    with pytest.raises(ConfigError, match=r"CLI flags(.|\n)*train.lr"):
        load_config(environ={"FLYWHEEL_HOME": str(tmp_path)}, overrides={"train": {"lr": -1}})


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[gate\n"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_ensure_home_is_private(tmp_path):
    cfg = load_config(environ={"FLYWHEEL_HOME": str(tmp_path / "h")})
    cfg.ensure_home()
    assert (cfg.home.stat().st_mode & 0o777) == 0o700


def test_objective_temperature_follows_rollout_and_refuses_a_contradiction(tmp_path):
    """Finding: rollout.temperature and train.objective.temperature must agree and nothing checked it."""
    from flywheel.config import objective_temperature

    env = {"FLYWHEEL_HOME": str(tmp_path)}
    cfg = load_config(environ=env, overrides={"rollout": {"temperature": 0.7}})
    assert cfg.train.objective.temperature is None and objective_temperature(cfg) == 0.7
    same = load_config(environ=env, overrides={"rollout": {"temperature": 0.7}, "train": {"objective": {"temperature": 0.7}}})
    assert objective_temperature(same) == 0.7
    with pytest.raises(ConfigError, match=r"train.objective.temperature = 0.9 differs from rollout.temperature = 0.7"):
        load_config(environ=env, overrides={"rollout": {"temperature": 0.7}, "train": {"objective": {"temperature": 0.9}}})


def test_nested_sections_and_trainer_knobs_come_from_toml_and_env(tmp_path):
    """Finding: trainer options (packing, logprob_impl, weight_decay, ...) were settable only through
    setattr overrides; they are [train] fields now, layered like every other field (pydantic-settings)."""
    p = write(tmp_path, "[train]\npacking = true\nweight_decay = 0.01\n[train.objective]\neps_high = 0.3\n")
    cfg = load_config(p, environ={"FLYWHEEL_HOME": str(tmp_path), "FLYWHEEL_TRAIN__LOGPROB_IMPL": "naive",
                                  "FLYWHEEL_TRAIN__OBJECTIVE__BETA": "0.05", "FLYWHEEL_ROLLOUT__MAX_TASKS": "null",
                                  "FLYWHEEL_SYNTH__GENERATORS": '["mutate"]', "FLYWHEEL_HOME_X": "ignored"})
    t = cfg.train
    assert (t.packing, t.weight_decay, t.logprob_impl, t.objective.eps_high, t.objective.beta) == (
        True, 0.01, "naive", 0.3, 0.05)
    assert cfg.rollout.max_tasks is None and cfg.synth.generators == ["mutate"]
    with pytest.raises(ConfigError, match="train.logprob_impl"):
        load_config(environ={"FLYWHEEL_HOME": str(tmp_path), "FLYWHEEL_TRAIN__LOGPROB_IMPL": "fast"})
    with pytest.raises(ConfigError, match="betas"):
        load_config(environ={"FLYWHEEL_HOME": str(tmp_path)}, overrides={"train": {"betas": [0.9, 1.5]}})


def test_loss_names_are_defined_once():
    import typing

    from flywheel.config import LOSS_NAMES, TrainConfig
    from flywheel.train.losses import LOSSES

    assert tuple(LOSSES) == LOSS_NAMES == typing.get_args(TrainConfig.model_fields["loss"].annotation)


def test_config_names_must_keep_references_unambiguous(tmp_path):
    with pytest.raises(ConfigError, match="cycle.heldout_suite"):
        load_config(environ={"FLYWHEEL_HOME": str(tmp_path)}, overrides={"cycle": {"heldout_suite": "held@out"}})
