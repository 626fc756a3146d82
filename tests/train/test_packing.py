"""Row packing in the update (`models.packing`, `LossBatch.packed`): rows laid end to end in fewer rows of the same
width give each row's log-probs as the row alone does, and the same loss, gradients and update as the padded batch."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax import models, train
from trace_jax.models.packing import (packed_row_buckets, packed_rows_bucket, padding_fraction, plan_packing,
                                      take_packed)
from trace_jax.train.loss import LossBatch, loss_terms, policy_logprobs, trained_positions

WIDTH = 48
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=2)
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _random_rows(vocab_size, rows, seed, *, with_reference=False, empty_rows=1):
    """Rows of random real lengths (a prompt, then trained tokens with holes), right-padded to WIDTH; the last
    `empty_rows` rows are empty (token mask 0), as `LossBatch.padded` appends them."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, WIDTH + 1, rows)
    lengths[rows - empty_rows:] = 0
    real = np.arange(WIDTH)[None, :] < lengths[:, None]
    tokens = np.where(real, rng.integers(0, vocab_size, (rows, WIDTH)), 0).astype(np.int32)
    # positions as the rollout gives them; a context-managed segment row starts past 0
    starts = rng.integers(0, 5, rows)
    positions = (starts[:, None] + np.arange(WIDTH)[None, :]).astype(np.int32)
    prompt = rng.integers(1, 4, rows)
    mask = real & (np.arange(WIDTH)[None, :] >= prompt[:, None]) & (rng.random((rows, WIDTH)) > 0.2)
    scale = -np.log(vocab_size)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return LossBatch(tokens=jnp.asarray(tokens), positions=jnp.asarray(positions), loss_mask=f(mask),
                     advantages=f(rng.standard_normal((rows, WIDTH)) * mask),
                     behaviour_logprobs=f((scale + 0.3 * rng.standard_normal((rows, WIDTH))) * mask),
                     reference_logprobs=(f((scale + 0.3 * rng.standard_normal((rows, WIDTH))) * mask)
                                         if with_reference else None),
                     token_mask=f(real)), lengths


# ---------------------------------------------------------------------------------------------------- the plan
def test_the_plan_places_every_row_once_within_the_budget_and_its_group():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 60, 24)
    plan = plan_packing(lengths, 64, micro_batches=2, shards=3)
    assert plan.rows == 2 * 3 * plan.rows_per_group
    flat = plan.source[plan.source >= 0]
    np.testing.assert_array_equal(np.sort(flat), np.sort(np.concatenate(
        [row * 64 + np.arange(n) for row, n in enumerate(lengths)])))  # each real token exactly once
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        micro, local = row % 2, row // 2
        shard = local // 4  # 12 rows a micro-batch in 3 blocks of 4
        packed_row = plan.slot[row] * 2 + micro
        assert plan.slot[row] // plan.rows_per_group == shard
        np.testing.assert_array_equal(plan.source[packed_row, plan.offset[row]:plan.offset[row] + n],
                                      row * 64 + np.arange(n))
        assert (plan.segment[packed_row, plan.offset[row]:plan.offset[row] + n] == row).all()


def test_the_plan_is_first_fit_decreasing_and_deterministic():
    plan = plan_packing([30, 50, 10, 20, 40], 60)
    # longest first: 50 -> bin 0, 40 -> bin 1, 30 -> bin 2, 20 -> bin 1, 10 -> bin 0
    np.testing.assert_array_equal(plan.slot, [2, 0, 0, 1, 1])
    np.testing.assert_array_equal(plan.offset, [0, 0, 50, 40, 0])
    again = plan_packing([30, 50, 10, 20, 40], 60)
    np.testing.assert_array_equal(again.source, plan.source)


def test_packed_row_counts_are_bucketed_to_at_most_sixteen_sizes_up_to_the_rows():
    assert packed_row_buckets(4) == (1, 2, 3, 4)
    sizes = packed_row_buckets(128)
    assert len(sizes) == 16 and sizes[-1] == 128 and all(s % 8 == 0 for s in sizes)
    assert packed_rows_bucket(81, 128) == 88 and packed_rows_bucket(0, 128) == 8


def test_a_row_longer_than_the_budget_or_rows_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="row 1 has 9 tokens, more than the packing budget 8"):
        plan_packing([3, 9], 8, width=10)
    with pytest.raises(ValueError, match="do not split"):
        plan_packing([3, 4, 5], 8, micro_batches=2)


def test_take_packed_reads_each_rows_places_within_its_shard_block():
    rng = np.random.default_rng(2)
    plan = plan_packing(rng.integers(1, 9, 8), 16, shards=2)
    values = rng.standard_normal((plan.rows, 16)).astype(np.float32)
    index = rng.integers(0, 8, (8, 3))
    got = take_packed(jnp.asarray(values), jnp.asarray(plan.slot), jnp.asarray(plan.offset[:, None] + index), 2)
    want = values[plan.slot[:, None], np.minimum(plan.offset[:, None] + index, 15)]  # clipped into the row
    np.testing.assert_array_equal(np.asarray(got), want)


def test_padding_fraction_of_the_papers_length_mix_falls_when_packed():
    # 128 rows, uniform 8K-48K tokens, padded to 48K: the issue's ~42% of linear FLOPs on padding
    lengths = np.random.default_rng(0).integers(8192, 49153, 128)
    padded = padding_fraction(lengths, 49152)
    plan = plan_packing(lengths, 49152)
    packed = 1.0 - lengths.sum() / (plan.rows * 49152)
    assert 0.38 < padded < 0.46 and packed < 0.2


# ---------------------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("indexed", [False, True], ids=["every-position", "trained-index"])
def test_packed_logprobs_and_entropies_equal_each_row_alone(model, indexed):
    config, params = model
    batch, lengths = _random_rows(config.vocab_size, 6, seed=3)
    if indexed:
        batch = batch.replace(trained_index=jnp.asarray(trained_positions(batch.loss_mask, multiple=8)))
    packed = batch.packed()
    assert packed.packing.tokens.shape[0] < 6
    lp, ent, _ = policy_logprobs(config, params, packed.tokens, chunk_size=16, with_entropy=True,
                                 trained_index=packed.trained_index, packing=packed.packing)
    lp, ent = np.asarray(lp), np.asarray(ent)
    mask = np.asarray(batch.loss_mask) > 0
    for row, n in enumerate(lengths):
        if n == 0:
            assert not lp[row].any()
            continue
        alone_lp, alone_ent, _ = policy_logprobs(config, params, batch.tokens[row:row + 1, :n],
                                                 positions=batch.positions[row:row + 1, :n], chunk_size=16,
                                                 with_entropy=True)
        where = mask[row, :n] if indexed else np.ones(n, bool)
        np.testing.assert_allclose(lp[row, :n][where], np.asarray(alone_lp)[0][where], atol=TOL, rtol=TOL)
        np.testing.assert_allclose(ent[row, :n][where], np.asarray(alone_ent)[0][where], atol=TOL, rtol=TOL)
        assert not lp[row, n:].any()


LOSSES = [
    train.LossConfig(),
    train.LossConfig(aggregation="seq-mean-token-sum", entropy_coef=0.01, kl_coef=0.1),
    train.LossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean", eps_low=3e-4, eps_high=4e-4),
    train.LossConfig(mode="sft"),
]
IDS = ["grpo", "entropy+kl", "gspo", "sft"]


@pytest.mark.parametrize("loss_config", LOSSES, ids=IDS)
def test_packed_loss_and_gradients_equal_the_padded_batchs(model, loss_config):
    config, params = model
    batch, _ = _random_rows(config.vocab_size, 6, seed=4, with_reference=loss_config.kl_coef > 0)
    packed = batch.packed()

    def loss(p, b):
        objective, _, sums = loss_terms(config, loss_config, p, b)
        return objective, sums

    (a, sums_a), grads_a = jax.value_and_grad(loss, has_aux=True)(params, batch)
    (b, sums_b), grads_b = jax.value_and_grad(loss, has_aux=True)(params, packed)
    np.testing.assert_allclose(float(b), float(a), atol=TOL, rtol=TOL)
    for name in sums_a:
        np.testing.assert_allclose(np.asarray(sums_b[name]), np.asarray(sums_a[name]), atol=TOL, rtol=TOL,
                                   err_msg=name)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads_a), jax.tree_util.tree_leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=TOL, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("indexed", [False, True], ids=["every-position", "trained-index"])
def test_a_packed_train_step_with_micro_batches_and_a_reference_equals_the_padded_one(model, indexed):
    config, params = model
    loss_config = train.LossConfig(micro_batches=2, kl_coef=0.05)
    batch, _ = _random_rows(config.vocab_size, 8, seed=5, empty_rows=2)
    if indexed:
        batch = batch.replace(trained_index=jnp.asarray(trained_positions(batch.loss_mask, multiple=8)))
    reference = jax.tree_util.tree_map(lambda p: p * 1.1, params)
    results = []
    for b in (batch, batch.packed(micro_batches=2)):
        optimizer = optax.adamw(1e-2)
        state = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(1))
        step = train.make_train_step(config, loss_config, optimizer, donate=False)
        new_state, metrics = step(state, b, reference)
        results.append((new_state.params, {k: float(v) for k, v in metrics.items()}))
    for name, value in results[0][1].items():
        np.testing.assert_allclose(results[1][1][name], value, rtol=TOL, atol=TOL, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(results[0][0]),
                            jax.tree_util.tree_leaves(results[1][0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=TOL, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_a_packed_batch_refuses_padding_and_a_second_kind_of_packing(model):
    config, _ = model
    batch, _ = _random_rows(config.vocab_size, 4, seed=6)
    with pytest.raises(ValueError, match="pad it before packing"):
        batch.packed().padded(8, WIDTH)
    with pytest.raises(ValueError, match="already has segment_ids"):
        batch.replace(segment_ids=jnp.zeros((4, WIDTH), jnp.int32)).packed()
    with pytest.raises(ValueError, match="not divisible by LossConfig.micro_batches=2"):
        batch.packed(rows_per_group=3).validate(train.LossConfig(micro_batches=2))
