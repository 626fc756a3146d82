"""gin configs: every shipped file parses into validated configs, bad bindings fail naming the binding and the fix,
sweeps expand into the cartesian product of their axes."""

import shlex
from pathlib import Path

import pytest

from trace_jax.rl.gin_setup import ConfigError, parse, write_config
from trace_jax.rl.sweep import expand, load_sweep, validate_runs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_CONFIGS = sorted(p for p in CONFIGS.glob("*.gin"))
CREDIT_CONFIGS = sorted(p for p in (CONFIGS / "credit").glob("*.gin"))
SWEEPS = sorted(p for p in (CONFIGS / "sweeps").glob("*.gin"))


def test_the_shipped_configs_exist():
    names = {p.name for p in RUN_CONFIGS}
    assert {"base.gin", "tiny.gin", "smollm2.gin", "qwen3_4b.gin", "qwen3_30b_a3b.gin"} <= names
    assert {"trace.gin", "grpo.gin", "gspo.gin", "trace_raw_delta.gin", "trace_linear_gap.gin", "abc_grpo.gin",
            "abc_sft_online.gin"} <= {p.name for p in CREDIT_CONFIGS}
    assert len(SWEEPS) >= 4


@pytest.mark.parametrize("path", [p for p in RUN_CONFIGS if p.name != "base.gin"] + CREDIT_CONFIGS,
                         ids=lambda p: p.name)
def test_every_config_parses_with_every_part_of_the_project(path):
    files = [str(path)] if path.parent == CONFIGS else [str(CONFIGS / "tiny.gin"), str(path)]
    config = parse(files)
    assert config.loss is not None and config.optimizer is not None and config.credit is not None


def test_tiny_config_is_the_embedded_default_shape():
    config = parse([str(CONFIGS / "tiny.gin")])
    assert config.train.model is not None and config.train.tokenizer == "word"
    assert config.warmstart.steps > 0 and config.eval.num_tasks >= 128
    assert config.data.num_eval_tasks >= config.eval.num_tasks
    assert config.rollout.sampling.temperature == 1.0 and not config.rollout.with_tools


def test_paper_configs_hold_the_paper_settings():
    for name in ("qwen3_4b.gin", "qwen3_30b_a3b.gin"):
        config = parse([str(CONFIGS / name)])
        assert config.rollout.group_size == 8
        assert config.rollout.group_size * config.train.prompts_per_step == 128
        assert config.rollout.max_turns == 60 and config.rollout.max_context == 48 * 1024
        assert config.warmstart.steps == 0 and config.train.checkpoint
        assert config.optimizer.learning_rate == 1e-6 and config.optimizer.schedule == "constant"
        assert config.optimizer.warmup_steps == 0 and config.loss.kl_coef == 0.0
        assert config.rollout.with_tools and config.rollout.sampling.temperature == 1.0


def test_gin_params_override_files_in_order():
    config = parse([str(CONFIGS / "tiny.gin")], ["RolloutConfig.group_size = 4", "TrainConfig.steps = 3"],)
    assert config.rollout.group_size == 4 and config.train.steps == 3


def test_misspelt_field_names_the_binding_and_the_closest_field():
    with pytest.raises(ConfigError, match=r"RolloutConfig has no field 'group_sise'.*did you mean "
                                          r"RolloutConfig.group_size"):
        parse([], ["RolloutConfig.group_sise = 4"])


def test_misspelt_config_name_suggests_the_closest_config():
    with pytest.raises(ConfigError, match=r"unknown config 'RoloutConfig'.*did you mean RolloutConfig"):
        parse([], ["RoloutConfig.group_size = 4"])


def test_invalid_value_names_the_config_its_rule_and_the_binding():
    with pytest.raises(ConfigError, match=r"invalid RolloutConfig: RolloutConfig.group_size must be >= 1.*"
                                          r"RolloutConfig.group_size = 0"):
        parse([str(CONFIGS / "tiny.gin")], ["RolloutConfig.group_size = 0"])


def test_unparsable_value_names_the_binding():
    with pytest.raises(ConfigError, match=r"--gin-param 'TrainConfig.steps = \('"):
        parse([], ["TrainConfig.steps = ("])


def test_error_in_a_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'configs/tiny.gin'\nEnvConfig.veiw_lines = 3\n")
    with pytest.raises(ConfigError, match=r"bad.gin.*did you mean EnvConfig.view_lines"):
        parse([str(bad)])


def test_missing_file_lists_the_shipped_configs():
    with pytest.raises(ConfigError, match=r"'nope.gin' not found.*tiny.gin"):
        parse(["nope.gin"])


def test_policy_source_must_be_exactly_one():
    with pytest.raises(ConfigError, match="exactly one policy source"):
        parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.checkpoint = '/tmp/x'"])


def test_operative_config_is_written_to_the_run_directory(tmp_path):
    parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.steps = 7"])
    config_path, operative_path = write_config(tmp_path)
    assert "TrainConfig.steps = 7" in config_path.read_text()
    operative = operative_path.read_text()
    assert "TrainConfig.steps = 7" in operative and "model_preset.hidden_size" in operative


def test_a_2x2_sweep_expands_into_4_named_runs_with_launch_commands():
    sweep = load_sweep(str(CONFIGS / "sweeps" / "horizon_alpha.gin"))
    runs = expand(sweep, runs_root="runs/sweeps")
    assert sweep.num_runs == 4 and len(runs) == 4
    assert [r.name for r in runs] == ["horizon=1,alpha_turn=0.1", "horizon=1,alpha_turn=0.2",
                                      "horizon=3,alpha_turn=0.1", "horizon=3,alpha_turn=0.2"]
    assert len({r.run_dir for r in runs}) == 4
    assert runs[1].gin_params == ("TrainConfig.steps = 20", "CreditConfig.horizon = 1", "CreditConfig.alpha_turn = 0.2")
    argv = shlex.split(runs[1].command())
    assert argv[:4] == ["python", "-m", "trace_jax.cli", "train"]
    assert argv[argv.index("--gin-file") + 1] == "configs/tiny.gin"
    assert "CreditConfig.alpha_turn = 0.2" in argv and argv[-1] == "runs/sweeps/horizon_alpha/horizon=1,alpha_turn=0.2"


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_shipped_sweep_loads_and_its_runs_parse(path):
    runs = expand(load_sweep(str(path)))
    assert len(runs) >= 2
    validate_runs(runs)


def test_sweep_axis_with_a_bad_binding_fails_before_any_run(tmp_path):
    path = tmp_path / "bad_sweep.gin"
    path.write_text("sweep.name = 'bad'\nsweep.base = ['configs/tiny.gin']\n"
                    "sweep.axes = {'RolloutConfig.group_sise': [2, 4]}\n")
    with pytest.raises(ConfigError, match=r"sweep run 'group_sise=2'.*did you mean RolloutConfig.group_size"):
        validate_runs(expand(load_sweep(str(path))))


def test_malformed_sweep_file_says_what_is_expected(tmp_path):
    path = tmp_path / "bad_sweep.gin"
    path.write_text("sweep.name = 'bad'\nsweep.base = ['configs/tiny.gin']\nsweep.axes = {}\n")
    with pytest.raises(ConfigError, match="sweep.axes is empty"):
        load_sweep(str(path))
