"""Per-row sampling values (`RowSampling`) in the paged engine's decode program (rows driven by
tests/rollout/paged_programs.py): traced arrays, so a new temperature compiles nothing, and a row's tokens under
per-row values and per-row keys are the tokens of its value run alone."""

import jax
import numpy as np
import pytest

from tests.rollout.paged_programs import run_rows
from trace_jax import models
from trace_jax.rollout import paged
from trace_jax.rollout import sampler as S

PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [100, 3], [44, 45, 46, 47, 48], [7]]
MAX_LEN = 64
SETTINGS = [S.SamplingConfig(temperature=0.5, top_p=0.9), S.SamplingConfig(temperature=1.3),
            S.SamplingConfig(greedy=True), S.SamplingConfig(temperature=0.9, top_p=0.7)]


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _generate(config, params, sampling, keys, budget=10):
    return run_rows(config, params, PROMPTS, max_len=MAX_LEN, keys=keys, sampling=sampling, budget=budget)[1]


def test_per_row_values_give_each_row_the_tokens_of_its_value_run_alone(model):
    config, params = model
    keys = jax.random.split(jax.random.PRNGKey(11), len(PROMPTS))
    mixed = _generate(config, params, S.RowSampling.of(SETTINGS), keys)
    for row, setting in enumerate(SETTINGS):
        alone = _generate(config, params, setting, keys)
        np.testing.assert_array_equal(mixed.tokens[row], alone.tokens[row])
        np.testing.assert_allclose(mixed.sampling_logprobs[row], alone.sampling_logprobs[row], atol=1e-5)
    assert not mixed.sampling_logprobs[2].any()  # the greedy row


def test_per_row_keys_make_a_row_independent_of_the_others(model):
    config, params = model
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(3), len(PROMPTS)))
    sampling = S.SamplingConfig(temperature=1.2)
    first = _generate(config, params, sampling, keys)
    other = keys.copy()
    other[1:] = np.asarray(jax.random.split(jax.random.PRNGKey(4), len(PROMPTS) - 1))
    second = _generate(config, params, sampling, other)
    np.testing.assert_array_equal(first.tokens[0], second.tokens[0])
    assert any(not np.array_equal(a, b) for a, b in zip(first.tokens[1:], second.tokens[1:]))


def test_an_unseen_temperature_or_top_p_compiles_no_new_decode_program(model):
    config, params = model
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(0), len(PROMPTS)))
    _generate(config, params, S.SamplingConfig(temperature=0.7, top_p=0.95), keys)
    compiled = paged.compiled_programs("paged_decode")
    for temperature, top_p in [(0.7013, 0.95), (1.9, 0.5), (0.05, 0.999)]:
        _generate(config, params, S.SamplingConfig(temperature=temperature, top_p=top_p), keys)
    assert paged.compiled_programs("paged_decode") == compiled


def test_rows_that_disagree_on_top_k_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        S.RowSampling.of([S.SamplingConfig(top_k=5), S.SamplingConfig(top_k=6)])
