"""gin configs: every shipped file parses into validated configs, bad bindings fail naming the binding and the fix,
sweeps expand into the cartesian product of their axes."""

import shlex
from pathlib import Path

import pytest

from trace_jax.train import gin_setup
from trace_jax.train.gin_setup import ConfigError, parse, write_config
from trace_jax.train.sweep import expand, load_sweep, validate_runs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_CONFIGS = sorted(p for p in CONFIGS.glob("*.gin"))
CREDIT_CONFIGS = sorted(p for p in (CONFIGS / "credit").glob("*.gin"))
SWEEPS = sorted(p for p in (CONFIGS / "sweeps").glob("*.gin"))
PENDING = sorted(gin_setup.missing_configurables())
pending_merge = pytest.mark.skipif(
    bool(PENDING), reason=f"PENDING MERGE: {', '.join(PENDING)} come from the training core (issue 11) and the credit "
                          "helper; the files bind them, so a full parse waits for those modules on this branch")


def test_the_shipped_configs_exist():
    names = {p.name for p in RUN_CONFIGS}
    assert {"base.gin", "tiny.gin", "smollm2.gin", "qwen3_4b.gin", "qwen3_30b_a3b.gin"} <= names
    assert {"trace.gin", "grpo.gin", "gspo.gin", "trace_raw_delta.gin", "trace_linear_gap.gin", "abc_grpo.gin",
            "abc_sft.gin"} <= {p.name for p in CREDIT_CONFIGS}
    assert len(SWEEPS) >= 4


@pytest.mark.parametrize("path", [p for p in RUN_CONFIGS if p.name != "base.gin"], ids=lambda p: p.name)
def test_every_model_config_parses_apart_from_the_pending_configs(path):
    config = parse([str(path)], skip_unknown=PENDING)
    assert config.train.steps >= 1 and config.rollout.group_size >= 1 and config.eval.num_tasks >= 1


@pending_merge
@pytest.mark.parametrize("path", [p for p in RUN_CONFIGS if p.name != "base.gin"] + CREDIT_CONFIGS,
                         ids=lambda p: p.name)
def test_every_config_parses_with_every_part_of_the_project(path):
    files = [str(path)] if path.parent == CONFIGS else [str(CONFIGS / "tiny.gin"), str(path)]
    config = parse(files)
    assert config.loss is not None and config.optimizer is not None and config.credit is not None


def test_tiny_config_is_the_embedded_default_shape():
    config = parse([str(CONFIGS / "tiny.gin")], skip_unknown=PENDING)
    assert config.train.model is not None and config.train.tokenizer == "word"
    assert config.warmstart.steps > 0 and config.eval.num_tasks >= 128
    assert config.data.num_eval_tasks >= config.eval.num_tasks
    assert config.rollout.sampling.temperature == 1.0 and not config.rollout.with_tools


def test_paper_configs_hold_the_paper_settings():
    for name in ("qwen3_4b.gin", "qwen3_30b_a3b.gin"):
        config = parse([str(CONFIGS / name)], skip_unknown=PENDING)
        assert config.rollout.group_size == 8
        assert config.rollout.group_size * config.train.prompts_per_step == 128
        assert config.rollout.max_turns == 60 and config.rollout.max_context == 48 * 1024
        assert config.warmstart.steps == 0 and config.train.checkpoint
    text = (CONFIGS / "qwen3_4b.gin").read_text()
    assert "OptimizerConfig.learning_rate = 1e-6" in text and "OptimizerConfig.schedule = 'constant'" in text
    assert "LossConfig.kl_coef = 0.0" in text


def test_gin_params_override_files_in_order():
    config = parse([str(CONFIGS / "tiny.gin")], ["RolloutConfig.group_size = 4", "TrainConfig.steps = 3"],
                   skip_unknown=PENDING)
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
        parse([str(CONFIGS / "tiny.gin")], ["RolloutConfig.group_size = 0"], skip_unknown=PENDING)


def test_unparsable_value_names_the_binding():
    with pytest.raises(ConfigError, match=r"--gin_param 'TrainConfig.steps = \('"):
        parse([], ["TrainConfig.steps = ("])


def test_error_in_a_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'configs/tiny.gin'\nEnvConfig.veiw_lines = 3\n")
    with pytest.raises(ConfigError, match=r"bad.gin.*did you mean EnvConfig.view_lines"):
        parse([str(bad)], skip_unknown=PENDING)


def test_missing_file_lists_the_shipped_configs():
    with pytest.raises(ConfigError, match=r"'nope.gin' not found.*tiny.gin"):
        parse(["nope.gin"])


def test_policy_source_must_be_exactly_one():
    with pytest.raises(ConfigError, match="exactly one policy source"):
        parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.checkpoint = '/tmp/x'"], skip_unknown=PENDING)


def test_operative_config_is_written_to_the_run_directory(tmp_path):
    parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.steps = 7"], skip_unknown=PENDING)
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
    assert argv[argv.index("--gin_file") + 1] == "configs/tiny.gin"
    assert "CreditConfig.alpha_turn = 0.2" in argv and argv[-1] == "runs/sweeps/horizon_alpha/horizon=1,alpha_turn=0.2"


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_shipped_sweep_loads_and_its_runs_parse(path):
    runs = expand(load_sweep(str(path)))
    assert len(runs) >= 2
    validate_runs(runs, skip_unknown=PENDING)


def test_sweep_axis_with_a_bad_binding_fails_before_any_run(tmp_path):
    path = tmp_path / "bad_sweep.gin"
    path.write_text("sweep.name = 'bad'\nsweep.base = ['configs/tiny.gin']\n"
                    "sweep.axes = {'RolloutConfig.group_sise': [2, 4]}\n")
    with pytest.raises(ConfigError, match=r"sweep run 'group_sise=2'.*did you mean RolloutConfig.group_size"):
        validate_runs(expand(load_sweep(str(path))), skip_unknown=PENDING)


def test_malformed_sweep_file_says_what_is_expected(tmp_path):
    path = tmp_path / "bad_sweep.gin"
    path.write_text("sweep.name = 'bad'\nsweep.base = ['configs/tiny.gin']\nsweep.axes = {}\n")
    with pytest.raises(ConfigError, match="sweep.axes is empty"):
        load_sweep(str(path))


CONTRACT_STANDINS = '''
import dataclasses, sys, types, warnings
warnings.simplefilter("error")  # no binding may be skipped: the stand-ins cover every pending config
def standin(name, fields):
    return dataclasses.make_dataclass(name, [(f, object, None) for f in fields], frozen=True)
train_config = types.ModuleType("trace_jax.train.config")
train_config.LossConfig = standin("LossConfig", ["eps_low", "eps_high", "dual_clip", "ratio_level", "aggregation",
    "kl_estimator", "kl_coef", "kl_clamp", "entropy_coef", "micro_batches", "mode"])
train_config.OptimizerConfig = standin("OptimizerConfig", ["learning_rate", "schedule", "warmup_steps",
    "weight_decay", "clip_norm", "b1", "b2", "eps"])
train_config.MeshConfig = standin("MeshConfig", ["data", "fsdp", "tensor", "expert"])
train_config.CheckpointConfig = standin("CheckpointConfig", ["directory", "every_steps", "keep_last", "async_save"])
credit_config = types.ModuleType("trace_jax.credit.config")
credit_config.CreditConfig = standin("CreditConfig", ["estimator", "alpha_out", "alpha_turn", "horizon", "gamma",
    "lambda_term", "eps", "form"])
sys.modules["trace_jax.train.config"] = train_config
sys.modules["trace_jax.credit.config"] = credit_config
from trace_jax.train.gin_setup import parse, missing_configurables
assert not missing_configurables()
'''


@pytest.mark.skipif(not PENDING, reason="every config class is on this branch: the full-parse test above covers it")
@pytest.mark.slow  # a subprocess importing jax, ~10 s
def test_config_files_bind_only_the_contract_fields_of_the_pending_configs():
    """Until the training core and the credit helper land: parse every file against stand-ins that have exactly
    the field names of their agreed contract, so a binding outside the contract shows up now, not at merge."""
    import subprocess
    import sys

    files = [str(p) for p in RUN_CONFIGS if p.name != "base.gin"]
    credit_files = [str(p) for p in CREDIT_CONFIGS]
    script = CONTRACT_STANDINS + (
        f"for f in {files!r}:\n    c = parse([f]); assert c.loss is not None and c.credit is not None, f\n"
        f"for f in {credit_files!r}:\n    parse([{str(CONFIGS / 'tiny.gin')!r}, f])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
