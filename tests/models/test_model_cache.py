"""KV cache: prefill + decode and ragged extends equal the full forward; cached block attention equals a mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models


def make_model(preset):
    config = models.get_preset(preset)
    return config, models.init_params(config, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def model():
    return make_model("tiny-qwen3")


def tokens_of(shape, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 512, shape))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_prefill_then_decode_equals_full_forward(preset):
    config, params = make_model(preset)
    tokens = tokens_of((2, 12))
    full = np.asarray(models.forward(config, params, tokens))
    cache = models.init_cache(config, 2, 16)
    logits, cache = models.extend(config, params, cache, tokens[:, :6], jnp.full((2,), 6), return_logits="all")
    np.testing.assert_allclose(logits, full[:, :6], atol=1e-5)
    for t in range(6, 12):
        logits, cache = models.extend(config, params, cache, tokens[:, t:t + 1], jnp.ones((2,), jnp.int32))
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [12, 12])


def test_extend_with_mixed_num_new_per_row(model):
    """Rows advance by different amounts (0 included); each row's logits match its own full forward."""
    config, params = model
    tokens = tokens_of((3, 14), 1)
    full = np.asarray(models.forward(config, params, tokens))
    cache = models.init_cache(config, 3, 14)
    lengths = [0, 0, 0]
    steps = [[3, 1, 2], [4, 0, 5], [0, 6, 1], [3, 3, 5]]
    for num_new in steps:
        block = np.zeros((3, 6), np.int32)
        for b in range(3):
            block[b, :num_new[b]] = np.asarray(tokens[b, lengths[b]:lengths[b] + num_new[b]])
        logits, cache = models.extend(config, params, cache, jnp.asarray(block), jnp.asarray(num_new),
                                      return_logits="all")
        logits = np.asarray(logits)
        for b in range(3):
            n = num_new[b]
            np.testing.assert_allclose(logits[b, :n], full[b, lengths[b]:lengths[b] + n], atol=1e-5)
            lengths[b] += n
        np.testing.assert_array_equal(cache.lengths, lengths)
    _, cache = models.extend(config, params, cache, tokens_of((3, 6), 2), jnp.asarray([0, 0, 0]),
                             return_logits="all")
    np.testing.assert_array_equal(cache.lengths, lengths)


def test_attending_to_the_first_slots_only_equals_reading_the_whole_cache(model):
    """`attend_len` >= every row's length after the call reads fewer slots and gives the same logits and cache."""
    config, params = model
    tokens = tokens_of((3, 40), 3)
    lengths = jnp.asarray([7, 19, 0])
    prompt = models.init_cache(config, 3, 128)
    _, prompt = models.extend(config, params, prompt, tokens[:, :20], lengths, return_logits="none")
    block, num_new = tokens[:, 20:24], jnp.asarray([4, 1, 3])
    whole, whole_cache = models.extend(config, params, jax.tree_util.tree_map(jnp.copy, prompt), block, num_new,
                                       return_logits="all")
    part, part_cache = models.extend(config, params, prompt, block, num_new, return_logits="all", attend_len=32)
    np.testing.assert_allclose(np.asarray(part), np.asarray(whole), atol=1e-6)
    # layer 0 writes the same keys; later layers' differ in the last bits (a shorter softmax reduction)
    np.testing.assert_allclose(np.asarray(part_cache.k), np.asarray(whole_cache.k), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(part_cache.k[0]), np.asarray(whole_cache.k[0]))
    np.testing.assert_array_equal(part_cache.lengths, whole_cache.lengths)


def test_row_with_zero_new_tokens_keeps_its_cache(model):
    config, params = model
    cache = models.init_cache(config, 2, 8)
    _, cache = models.extend(config, params, cache, tokens_of((2, 4)), jnp.asarray([4, 2]), return_logits="none")
    k_before = np.asarray(cache.k[:, 1])
    _, cache = models.extend(config, params, cache, tokens_of((2, 4), 3), jnp.asarray([3, 0]), return_logits="none")
    np.testing.assert_array_equal(np.asarray(cache.k[:, 1]), k_before)


def test_extend_donates_the_cache():
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(0))
    cache = models.init_cache(config, 1, 8)
    _, new_cache = models.extend(config, params, cache, tokens_of((1, 2)), jnp.asarray([2]))
    assert cache.k.is_deleted()
    assert not new_cache.k.is_deleted()


def test_attend_cached_block_equals_forward_with_equivalent_mask(model):
    """Prefix-fork layout: trajectory of L tokens in the cache, answer copies (m tokens each) as one block.

    Copy k starts at position b_k, sees trajectory keys < b_k and its own earlier tokens. Reference: a packed
    sequence [trajectory, copy_0, copy_1, ...] with the same rule as a boolean mask.
    """
    config, params = model
    L, m, boundaries = 10, 3, [2, 6, 10]
    trajectory = tokens_of((1, L), 4)
    answer = tokens_of((1, m), 5)
    cache = models.init_cache(config, 1, 12)
    _, cache = models.extend(config, params, cache, trajectory, jnp.asarray([L]), return_logits="none")

    Q = m * len(boundaries)
    block = jnp.tile(answer, (1, len(boundaries)))
    copy_of = np.repeat(np.arange(len(boundaries)), m)
    offset = np.tile(np.arange(m), len(boundaries))
    positions = np.asarray(boundaries)[copy_of] + offset
    key_limit = np.asarray(boundaries)[copy_of]
    block_mask = (copy_of[:, None] == copy_of[None, :]) & (offset[:, None] >= offset[None, :])
    hidden = models.attend_cached_block(config, params, cache, block, jnp.asarray(positions[None]),
                                        jnp.asarray(key_limit[None]), jnp.asarray(block_mask[None]))

    packed = jnp.concatenate([trajectory, block], axis=1)
    S = L + Q
    mask = np.zeros((S, S), bool)
    mask[:L, :L] = np.tril(np.ones((L, L), bool))
    mask[L:, :L] = np.arange(L)[None, :] < key_limit[:, None]
    mask[L:, L:] = block_mask
    packed_positions = np.concatenate([np.arange(L), positions])
    ref = models.forward_hidden(config, params, packed, positions=jnp.asarray(packed_positions[None]),
                                attention_mask=jnp.asarray(mask[None]))
    np.testing.assert_allclose(hidden, np.asarray(ref)[:, L:], atol=1e-5)

    # And the answer log-probs computed from the block hidden states match the naive per-state forward.
    targets = jnp.asarray(np.tile(np.asarray(answer)[0, 1:].tolist() + [0], len(boundaries))[None])
    lp = np.asarray(models.hidden_logprobs(config, params, hidden, targets, chunk_size=4))
    # Naive: one right-padded row per state, [trajectory[:b_k], answer, padding].
    naive_rows = np.zeros((len(boundaries), L + m), np.int32)
    for k, b in enumerate(boundaries):
        naive_rows[k, :b + m] = np.concatenate([np.asarray(trajectory)[0, :b], np.asarray(answer)[0]])
    naive = np.asarray(models.token_logprobs(config, params, jnp.asarray(naive_rows)))
    for k, b in enumerate(boundaries):
        np.testing.assert_allclose(lp[0, k * m:k * m + m - 1], naive[k, b:b + m - 1], atol=1e-5)


def test_extend_hidden_and_query_chunked_paths_match(model):
    """return_logits="hidden" gives forward_hidden's states; attention_query_chunk changes no result."""
    config, params = model
    chunked = config.replace(attention_query_chunk=4)
    tokens = tokens_of((2, 8), 6)
    reference = np.asarray(models.forward_hidden(config, params, tokens))
    for cfg in (config, chunked):
        cache = models.init_cache(cfg, 2, 12)
        hidden, cache = models.extend(cfg, params, cache, tokens, jnp.asarray([8, 8]), return_logits="hidden")
        np.testing.assert_allclose(np.asarray(hidden), reference, atol=1e-5)
    block = tokens_of((2, 4), 7)
    positions = jnp.asarray([[3, 4, 5, 6], [8, 9, 10, 11]])
    key_limit = jnp.asarray([[3, 3, 3, 3], [8, 8, 8, 8]])
    block_mask = jnp.asarray(np.tril(np.ones((4, 4), bool))[None].repeat(2, 0))
    outs = [np.asarray(models.attend_cached_block(cfg, params, cache, block, positions, key_limit, block_mask))
            for cfg in (config, chunked)]
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5)


def test_prefill_returns_forward_hidden_and_the_cache_extend_would_build(model):
    config, params = model
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 12), 0, config.vocab_size)
    hidden, cache = models.prefill(config, params, tokens)
    np.testing.assert_allclose(hidden, models.forward_hidden(config, params, tokens), atol=1e-5)
    _, extended = models.extend(config, params, models.init_cache(config, 2, 12), tokens, jnp.array([12, 12]),
                                return_logits="none")
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    np.testing.assert_allclose(cache.k, extended.k, atol=1e-5)
    np.testing.assert_allclose(cache.v, extended.v, atol=1e-5)


def test_long_self_attention_switches_to_bounded_memory():
    """Long causal prefill is tiled (the tiled kernel): temp memory grows about linearly, not with S^2."""
    from trace_jax.models import decoder

    config = models.get_preset("tiny-qwen3")
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))

    def temp_bytes(length):
        tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
        compiled = jax.jit(lambda p, t: models.prefill(config, p, t)).lower(params, tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = 2 * decoder.AUTO_CHUNK_ABOVE, 4 * decoder.AUTO_CHUNK_ABOVE
    assert temp_bytes(long) < 2.6 * temp_bytes(short)  # quadratic would be ~4x


def test_write_rows_puts_each_rows_entries_at_its_slots_and_drops_slots_past_the_end():
    """Against a loop over rows and entries on fresh random values; slots >= T (a full row's overflow) are dropped."""
    from trace_jax.models.cache import write_rows

    rng = np.random.RandomState(3)
    layers, rows, slots_total, n, heads, dim = 2, 3, 8, 4, 2, 5
    cache = rng.normal(size=(layers, rows, slots_total, heads, dim)).astype(np.float32)
    new = rng.normal(size=(layers, rows, n, heads, dim)).astype(np.float32)
    starts = np.asarray([0, 3, 6])  # row 2's last two entries fall past slot 7
    slots = (starts[:, None] + np.arange(n)[None, :]).astype(np.int32)
    want = cache.copy()
    for row in range(rows):
        for i in range(n):
            if slots[row, i] < slots_total:
                want[:, row, slots[row, i]] = new[:, row, i]
    got = jax.jit(write_rows)(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(got), want)
