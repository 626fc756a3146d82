"""Prefix-fork scoring equals one forward per prefix (packed and cached layouts, sharded or not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models
from trace_jax.scoring import (
    bucket_size,
    choose_layout,
    packed_length,
    score_answer_prefixes,
    validate_scoring_inputs,
)

TOL = 1e-5  # answer scores: absolute, float32
# Per-token log-probs are single values of size ~7 nats (not means); float32 reduction order across layouts and
# shardings moves them by a few ulps, so they are compared with a relative term too.
LP_TOL = dict(atol=1e-5, rtol=1e-5)


def _sharp_params(config, seed=0):
    """Random params scaled up so the answer scores differ clearly between states (a weak model is near-uniform)."""
    params = models.init_params(config, jax.random.PRNGKey(seed))
    return jax.tree_util.tree_map(lambda p: p * 6.0 if p.ndim >= 2 else p, params)


@pytest.fixture(scope="module")
def tiny():
    config = models.get_preset("tiny-qwen3")
    return config, _sharp_params(config)


def _random_batch(seed, *, n=4, length=40, slots=5, m=6):
    """Mixed lengths, a T = 0 row, answers of different lengths (template + gold + padding), padded tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, n)
    lengths[0] = length
    tokens = rng.integers(3, 512, (n, length))
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0
    num_states = rng.integers(1, slots + 1, n)
    num_states[0], num_states[1] = slots, 1
    boundaries = np.zeros((n, slots), np.int64)
    for row in range(n):
        real = np.sort(rng.integers(1, lengths[row] + 1, num_states[row]))
        boundaries[row, :num_states[row]] = real
        boundaries[row, num_states[row]:] = rng.integers(-5, 100, slots - num_states[row])  # garbage padding
    answer_tokens = rng.integers(3, 512, (n, m))
    answer_mask = np.zeros((n, m), np.int32)
    for row in range(n):
        template = int(rng.integers(0, min(3, m)))
        gold = int(rng.integers(1, m - template + 1))
        answer_mask[row, template:template + gold] = 1
        answer_tokens[row, template + gold:] = 0
    return dict(tokens=tokens, boundaries=boundaries, num_states=num_states, answer_tokens=answer_tokens,
                answer_mask=answer_mask), lengths


def _real(token_lp, lengths):
    """Token log-probs at positions whose next token is a real (unpadded) trajectory token."""
    return token_lp[np.arange(token_lp.shape[1])[None, :] < lengths[:, None] - 1]


def _score(config, params, batch, **kwargs):
    result = score_answer_prefixes(config, params, batch["tokens"], batch["boundaries"], batch["num_states"],
                                   batch["answer_tokens"], batch["answer_mask"], **kwargs)
    return np.asarray(result.answer_scores), np.asarray(result.token_logprobs)


@pytest.fixture(scope="module")
def reference(tiny):
    config, params = tiny
    batch, lengths = _random_batch(0)
    return batch, lengths, _score(config, params, batch, method="naive")


def test_naive_scores_differ_between_states_so_the_comparison_means_something(reference):
    _, _, (scores, _) = reference
    assert np.ptp(scores[0]) > 0.05


@pytest.mark.parametrize("method", ["fork", "cached"])
def test_fork_layouts_equal_naive_on_mixed_batch(tiny, reference, method):
    config, params = tiny
    batch, lengths, (naive_scores, naive_lp) = reference
    scores, token_lp = _score(config, params, batch, method=method)
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(_real(token_lp, lengths), _real(naive_lp, lengths), **LP_TOL)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_fork_layouts_equal_naive_on_more_random_batches(tiny, seed):
    config, params = tiny
    batch, _ = _random_batch(seed)
    naive_scores, _ = _score(config, params, batch, method="naive")
    for method in ("fork", "cached"):
        scores, _ = _score(config, params, batch, method=method)
        np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_padded_states_score_zero_and_padding_values_do_not_matter(tiny, reference):
    config, params = tiny
    batch, _, (naive_scores, _) = reference
    states = np.arange(batch["boundaries"].shape[1])[None, :]
    assert np.all(naive_scores[states >= batch["num_states"][:, None]] == 0)
    changed = dict(batch, boundaries=np.where(states >= batch["num_states"][:, None], 3, batch["boundaries"]))
    scores, _ = _score(config, params, changed, method="fork")
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_tokens_at_and_after_the_last_boundary_do_not_change_earlier_states(tiny, reference):
    config, params = tiny
    batch, _, (naive_scores, _) = reference
    tokens = batch["tokens"].copy()
    row = 0
    last = batch["boundaries"][row, batch["num_states"][row] - 1]
    tokens[row, last:] = 7
    scores, _ = _score(config, params, dict(batch, tokens=tokens), method="fork")
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_first_answer_token_scored_without_template(tiny):
    """The first answer token is predicted by the trajectory itself (hidden state at b_k - 1)."""
    config, params = tiny
    batch, _ = _random_batch(1)
    batch["answer_mask"][:] = [1, 1, 1, 0, 0, 0]
    naive_scores, _ = _score(config, params, batch, method="naive")
    scores, _ = _score(config, params, batch, method="fork")
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_single_token_answer_needs_no_copies(tiny):
    config, params = tiny
    batch, _ = _random_batch(2, m=1)
    batch["answer_mask"][:] = 1
    naive_scores, _ = _score(config, params, batch, method="naive")
    for method in ("fork", "cached"):
        scores, _ = _score(config, params, batch, method=method)
        np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_shared_answer_given_as_one_row_broadcasts(tiny):
    config, params = tiny
    batch, _ = _random_batch(3)
    row_mask = np.array([0, 1, 1, 0, 0, 0])
    shared = dict(batch, answer_tokens=batch["answer_tokens"][0], answer_mask=row_mask)
    full = dict(batch, answer_tokens=np.tile(batch["answer_tokens"][0], (4, 1)), answer_mask=np.tile(row_mask, (4, 1)))
    np.testing.assert_allclose(_score(config, params, shared)[0], _score(config, params, full)[0], atol=TOL, rtol=0)


def test_llama_gqa_model_fork_equals_naive():
    config = models.get_preset("tiny-llama")  # one kv head, tied embeddings, different rope
    params = _sharp_params(config, seed=1)
    batch, _ = _random_batch(4)
    naive_scores, _ = _score(config, params, batch, method="naive")
    for method in ("fork", "cached"):
        scores, _ = _score(config, params, batch, method=method)
        np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


@pytest.mark.parametrize("method", ["fork", "cached"])
def test_sharded_over_eight_devices_equals_naive(tiny, reference, method):
    assert jax.device_count() == 8
    config, params = tiny
    batch, lengths, (naive_scores, naive_lp) = reference
    mesh = models.make_mesh({"data": 8})
    scores, token_lp = _score(config, params, batch, method=method, mesh=mesh)
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(_real(token_lp, lengths), _real(naive_lp, lengths), **LP_TOL)


def test_sharded_data_and_tensor_mesh_equals_naive(tiny, reference):
    config, params = tiny
    batch, _, (naive_scores, _) = reference
    mesh = models.make_mesh({"data": 4, "tensor": 2})
    scores, _ = _score(config, params, batch, method="fork", mesh=mesh)
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


@pytest.mark.parametrize("method", ["fork", "cached"])
def test_moe_reference_on_an_expert_mesh_equals_one_device_and_dispatches_by_all_to_all(method):
    """The reference scoring runs under its mesh (`fork_scores_program`), so a MoE reference on a mesh with an
    `expert` axis takes the expert-parallel all-to-all, with the scores and log-probs of one device."""
    from trace_jax.scoring import fork

    config = models.get_preset("tiny-qwen3-moe")
    params = _sharp_params(config)
    batch, lengths = _random_batch(1)
    mesh = models.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    scores, token_lp = _score(config, models.shard_params(params, config, mesh), batch, method=method, mesh=mesh)
    one_scores, one_lp = _score(config, params, batch, method=method)
    # sums of ~7 nats through tensor- and expert-sharded reductions, in float32: a few ulp apart (1.0e-5 at 7.44
    # was seen once the suite compiled its LLVM modules unsplit), so relative as well as absolute
    np.testing.assert_allclose(scores, one_scores, atol=TOL, rtol=4e-6)
    np.testing.assert_allclose(_real(token_lp, lengths), _real(one_lp, lengths), **LP_TOL)
    pn, pl, ps, pm = fork.padded_shape(4, 40, 5, 6, mesh=mesh)
    row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=fork.row_sharding(mesh, len(shape)))  # noqa
    program = fork.fork_scores_program(config, layout="cached" if method == "cached" else "packed", mesh=mesh)
    lowered = program.lower(models.shard_params(params, config, mesh), row((pn, pl), jnp.int32),
                            row((pn, ps), jnp.int32), row((pn, ps), jnp.bool_), row((pn, pm), jnp.int32),
                            row((pn, pm), jnp.int32))
    assert "all_to_all" in lowered.as_text()


def test_auto_layout_switches_to_cached_for_long_inputs(tiny, reference):
    assert choose_layout(1024, 17, 8, packed_max_len=4096) == "packed"
    assert choose_layout(8192, 17, 8, packed_max_len=4096) == "cached"
    assert packed_length(1024, 17, 8) == 1024 + 17 * 7
    # the defaults: packed only for a small pass (a short row and few tokens in all), as measured by
    # benchmarks/scoring_layout_bench.py
    assert choose_layout(256, 3, 5, rows=4) == "packed"  # 4 x 268 tokens
    assert choose_layout(256, 3, 5, rows=64) == "cached"  # 64 x 268 tokens: the embedded default's step
    assert choose_layout(384, 3, 5, rows=1) == "cached"  # 396 tokens in one row
    config, params = tiny
    batch, _, (naive_scores, _) = reference
    scores, _ = _score(config, params, batch, method="fork", packed_max_len=8)  # forces the cached layout
    np.testing.assert_allclose(scores, naive_scores, atol=TOL, rtol=0)


def test_token_logprobs_match_the_model_and_are_zero_beyond_lengths(tiny, reference):
    config, params = tiny
    batch, lengths, (_, naive_lp) = reference
    direct = np.asarray(models.token_logprobs(config, params, jnp.asarray(batch["tokens"])))
    np.testing.assert_allclose(_real(naive_lp, lengths), _real(direct, lengths), **LP_TOL)
    result = score_answer_prefixes(config, params, batch["tokens"], batch["boundaries"], batch["num_states"],
                                   batch["answer_tokens"], batch["answer_mask"], lengths=lengths)
    token_lp = np.asarray(result.token_logprobs)
    beyond = np.arange(token_lp.shape[1])[None, :] >= lengths[:, None] - 1
    assert np.all(token_lp[beyond] == 0)
    np.testing.assert_allclose(token_lp[~beyond], direct[~beyond], **LP_TOL)


def test_bucket_sizes_are_powers_of_two_or_three_quarters():
    assert [bucket_size(n, 1) for n in (1, 2, 3, 5, 7, 9, 13, 17)] == [1, 2, 3, 6, 8, 12, 16, 24]
    assert bucket_size(100, 16) == 128 and bucket_size(90, 16) == 96 and bucket_size(3, 16) == 16


@pytest.mark.parametrize("change, message", [
    (dict(boundaries=np.array([[0, 2]])), "must be in \\[1, 8\\]"),
    (dict(boundaries=np.array([[5, 2]])), "decrease"),
    (dict(num_states=np.array([3])), "num_states must be in"),
    (dict(answer_mask=np.array([[0, 0]])), "score no token"),
    (dict(tokens=np.zeros((1, 8), np.float32)), "tokens must be an integer array"),
])
def test_invalid_inputs_raise_naming_the_input(change, message):
    good = dict(tokens=np.ones((1, 8), np.int32), boundaries=np.array([[2, 5]]), num_states=np.array([2]),
                answer_tokens=np.array([[4, 5]]), answer_mask=np.array([[0, 1]]))
    good.update(change)
    with pytest.raises(ValueError, match=message):
        validate_scoring_inputs(**good)
