"""ModelConfig validation, Hugging Face config.json conversion and presets."""

import dataclasses

import pytest

from trace_jax import models
from trace_jax.models import ConfigError, ModelConfig


@pytest.mark.parametrize("preset,expected_params", [
    ("qwen3-0.6b", 596e6), ("qwen3-1.7b", 1.72e9), ("qwen3-4b", 4.02e9), ("qwen3-8b", 8.19e9),
    ("qwen3-30b-a3b", 30.5e9), ("smollm2-135m", 134.5e6),
])
def test_presets_have_published_sizes(preset, expected_params):
    assert models.get_preset(preset).num_params() == pytest.approx(expected_params, rel=0.01)


def test_config_is_hashable_and_frozen():
    config = models.get_preset("tiny-qwen3")
    assert hash(config) == hash(models.get_preset("tiny-qwen3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 3


@pytest.mark.parametrize("change,field", [
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(dtype="int8"), "dtype"),
    (dict(remat="sometimes"), "remat"),
    (dict(rope_type="dynamic"), "rope_type"),
    (dict(rope_type="yarn", rope_scaling_factor=0.5), "rope_scaling_factor"),
    (dict(rope_type="yarn", rope_beta_fast=0.5, rope_beta_slow=1.0), "rope_beta_fast"),
    (dict(num_experts=4), "num_experts"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_invalid_fields_raise_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
        models.get_preset("tiny-qwen3", **change)


def test_moe_requires_valid_routing():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        models.get_preset("tiny-qwen3-moe", num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        models.get_preset("tiny-qwen3-moe", mlp_only_layers=(0,))


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-30b-a3b", "smollm2-135m", "tiny-llama"])
def test_hf_dict_round_trip(preset):
    config = models.get_preset(preset)
    assert ModelConfig.from_hf(config.to_hf_dict()) == config


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("extra", [{}, {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
                                   {"mscale": 1.0, "mscale_all_dim": 0.5}, {"attention_factor": 1.25}])
def test_yarn_hf_dict_round_trip_keeps_every_parameter(extra):
    hf = models.get_preset("tiny-qwen3").to_hf_dict()
    hf["rope_parameters"] = dict(YARN, rope_theta=1_000_000.0, **extra)
    config = ModelConfig.from_hf(hf)
    assert config.rope_type == "yarn"
    assert ModelConfig.from_hf(config.to_hf_dict()) == config
    written = config.to_hf_dict()["rope_parameters"]
    assert {k: written[k] for k in hf["rope_parameters"]} == hf["rope_parameters"]


def test_yarn_missing_fields_follow_transformers_defaults():
    hf = models.get_preset("tiny-qwen3", max_position_embeddings=256).to_hf_dict()
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": None, "rope_theta": 1e6, "beta_fast": None}
    config = ModelConfig.from_hf(hf)
    # original_max_position_embeddings defaults to max_position_embeddings; a null factor to their ratio (1)
    assert (config.rope_original_max_position, config.rope_scaling_factor) == (256, 1.0)
    assert (config.rope_beta_fast, config.rope_beta_slow, config.rope_truncate) == (32.0, 1.0, True)


def test_with_rope_parameters_applies_a_model_card_yarn_block():
    config = models.get_preset("qwen3-4b")
    extended = config.with_rope_parameters({"rope_type": "yarn", "factor": 1.5,
                                            "original_max_position_embeddings": 32768})
    assert (extended.rope_type, extended.rope_scaling_factor, extended.rope_original_max_position) == (
        "yarn", 1.5, 32768)
    assert extended.max_position_embeddings == 49152 and extended.rope_theta == config.rope_theta
    with pytest.raises(ConfigError, match="TrainConfig.rope_parameters.factor is missing"):
        config.with_rope_parameters({"rope_type": "yarn"}, what="TrainConfig.rope_parameters")


def test_from_hf_reads_transformers4_style_rope_fields():
    hf = models.get_preset("tiny-llama").to_hf_dict()
    hf.pop("rope_parameters")
    hf["rope_theta"] = 123.0
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024}
    config = ModelConfig.from_hf(hf)
    assert (config.rope_theta, config.rope_type, config.rope_original_max_position) == (123.0, "llama3", 1024)


@pytest.mark.parametrize("edit,match", [
    (dict(architectures=["GPT2LMHeadModel"]), "architectures.*GPT2LMHeadModel"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0}), "rope_type.*dynamic"),
    (dict(rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 64}), "factor is missing"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fastt": 8}), "unknown yarn keys.*beta_fastt"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": "2"}), "factor must be a number"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
])
def test_from_hf_errors_name_the_field(edit, match):
    hf = models.get_preset("tiny-qwen3").to_hf_dict()
    hf.update(edit)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(hf)


def test_unknown_preset_lists_available():
    with pytest.raises(KeyError, match="tiny-qwen3"):
        models.get_preset("qwen9")
