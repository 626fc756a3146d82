"""FLOPs per token and MFU estimates."""

import pytest

from trace_jax import models
from trace_jax.train import flops


def test_dense_training_flops_approach_six_times_the_parameters_for_short_sequences():
    for name in ("qwen3-4b", "smollm2-135m", "qwen3-0.6b"):
        config = models.get_preset(name)  # tied embeddings: the LM head is the embedding, counted once
        assert flops.flops_per_token(config, 1) / (6 * config.num_params()) == pytest.approx(1.0, rel=1e-3)


def test_flops_of_a_small_config_counted_by_hand():
    config = models.get_preset("tiny-qwen3")  # D=64, H=4, K=2, Dh=16, F=128, V=512, 2 layers
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128
    forward = 2 * (2 * per_layer + 64 * 512) + 2 * 2 * 4 * 16 * (100 + 1)
    assert flops.flops_per_token(config, 100, training=False) == forward
    assert flops.flops_per_token(config, 100) == 3 * forward


def test_moe_counts_only_the_active_experts_and_the_router():
    config = models.get_preset("tiny-qwen3-moe")  # E=4, k=2, Fe=32
    dense_equivalent = config.replace(model_type="qwen3", num_experts=0, num_experts_per_tok=0,
                                      moe_intermediate_size=0, intermediate_size=2 * 32)
    router = 2 * config.num_hidden_layers * config.hidden_size * config.num_experts
    assert (flops.flops_per_token(config, 64, training=False)
            == flops.flops_per_token(dense_equivalent, 64, training=False) + router)


def test_mfu_divides_achieved_by_peak_flops():
    config = models.get_preset("qwen3-4b")
    achieved = 1000 * flops.flops_per_token(config, 2048)
    assert flops.mfu(1000, config, 2048, chip="tpu-v5e", num_chips=16) == pytest.approx(achieved / (16 * 197e12))
    assert flops.mfu(1000, config, 2048, peak_flops=achieved) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="measure_peak_flops"):
        flops.mfu(1000, config, 2048, chip="tpu-v9")


def test_measured_cpu_peak_is_a_positive_rate():
    assert flops.measure_peak_flops(size=128, repeats=2) > 1e6
