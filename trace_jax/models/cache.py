"""Key/value cache for incremental decoding, and cached-prefix block attention for prefix-fork scoring.

A `KVCache` holds, for every layer, the keys and values of each row's tokens so far, and `lengths [B]`: row b's
tokens occupy cache slots 0..lengths[b]-1, and slot i holds the token at RoPE position i (positions equal slot
indices; rows are never left-padded).

  * `extend` appends a variable number of new tokens per row (prefill = extend an empty cache; decode = n=1;
    tool responses = extend only some rows). It is jitted with the cache donated: do not reuse the old cache.
  * `prefill` runs full rows once and returns their hidden states together with a cache of exactly those rows
    (the causal self-attention path of `forward`, so memory stays linear in length for long inputs).
  * `attend_cached_block` runs a block of queries against a prefilled cache with a per-query key limit and an
    in-block boolean mask, without writing to the cache: the attention API's tiled kernel skips cached keys
    beyond each query tile's limit (memory O(tile), work about sum of the key limits).

Both use the decoder's layer pieces and know nothing about sampling or scoring policy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from trace_jax.models import attention as attention_api
from trace_jax.models import decoder as dec
from trace_jax.models.packing import take_rows
from trace_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """k, v: [layers, B, max_len, kv_heads, head_dim]; lengths: int32 [B] (filled slots per row)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, *, dtype=None) -> KVCache:
    """An empty cache (zeros, lengths 0) in `dtype` (default: config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))


def write_rows(cache: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """`cache [layers, B, T, K, Dh]` with row b's new entries `new[:, b, i]` written at slot `slots[b, i]`
    (`slots [B, n]`; a slot >= T is dropped).

    One scatter whose row dimension is a *batching* dimension of both the cache and the slots: row b's entries
    can only land in row b, so a cache whose rows are split over the mesh is written shard by shard. A scatter
    indexed by explicit row numbers (`cache.at[:, arange(B)[:, None], slots]`) does not say so, and the partitioner
    gathered every row's new keys/values onto every device first: a prefill of B rows of W tokens held all B rows'
    keys/values on each device.
    """
    dnums = jax.lax.ScatterDimensionNumbers(update_window_dims=(0, 3, 4), inserted_window_dims=(2,),
                                            scatter_dims_to_operand_dims=(2,), operand_batching_dims=(1,),
                                            scatter_indices_batching_dims=(0,))
    return jax.lax.scatter(cache, slots[:, :, None], new.astype(cache.dtype), dnums,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


@functools.partial(jax.jit, static_argnums=0)
def prefill(config: ModelConfig, params: dict, tokens: jax.Array, *, positions=None,
            segment_ids=None) -> tuple[jax.Array, KVCache]:
    """One causal pass over full rows `tokens [B, S]`.

    Returns `(hidden [B, S, D], cache)`: the final-normed hidden states (score them in chunks with
    `hidden_logprobs`) and a `KVCache` with `max_len = S` and `lengths = S` for every row, ready for
    `attend_cached_block`. Padding at the end of a row is harmless to earlier tokens (causality).
    `positions`, `segment_ids` [B, S]: packed rows (`models.packing`), as in `forward_hidden`.
    """
    dec._check_tokens(tokens)
    hidden, (keys, values) = dec._forward_hidden(config, params, tokens, positions, segment_ids, None,
                                                 return_kv=True)
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    return hidden, KVCache(k=keys, v=values, lengths=lengths)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_logits", "attend_len"), donate_argnums=2)
def extend(config: ModelConfig, params: dict, cache: KVCache, tokens: jax.Array, num_new: jax.Array, *,
           return_logits: str = "last", attend_len: int | None = None):
    """Append each row's first `num_new[b]` tokens to the cache and run them through the model.

    Args:
      cache: donated; rows' new tokens go to slots / positions `cache.lengths[b] + i`, i < num_new[b].
      tokens: int [B, n]; entries at i >= num_new[b] are ignored (any value).
      num_new: int [B] in [0, n]; rows with 0 keep their cache and length unchanged.
      return_logits: "last" -> float32 [B, V] logits of each row's last new token (rows with num_new == 0 get
        meaningless values); "all" -> float32 [B, n, V] (only i < num_new[b] meaningful); "hidden" -> the
        final-normed hidden states [B, n, D] (score them in chunks with `hidden_logprobs`, e.g. a long prefill
        whose own token log-probs are needed); "none" -> None.

    Each new token attends to its row's cached tokens and the row's earlier new tokens (causal). Tokens that
    would land at or beyond `max_len` are dropped silently: check capacity on the host.
    `attend_len` (static): read only the first `attend_len` cache slots for attention, which must hold every
    row's cached tokens (`lengths <= attend_len`, the caller's promise; the sampler passes a bucket above the
    longest row). The cost of a decode step grows with the slots it reads (a 16-row step of the tiny default
    policy: 1.3 ms at 128 slots, 6.6 ms at 512), so a short row in a long cache need not pay for the whole cache.
    Returns (logits, new_cache) with new_cache.lengths = lengths + num_new.
    """
    if return_logits not in ("last", "all", "hidden", "none"):
        raise ValueError(f"return_logits must be 'last', 'all', 'hidden' or 'none', got {return_logits!r}")
    B, n = tokens.shape
    T = cache.max_len
    num_new = num_new.astype(jnp.int32)
    offsets = jnp.arange(n, dtype=jnp.int32)
    positions = cache.lengths[:, None] + offsets[None, :]  # [B, n]
    stored = (offsets[None, :] < num_new[:, None]) & (positions < T)  # [B, n]: new tokens that get a cache slot
    write_slot = jnp.where(stored, positions, T)  # T = out of range -> dropped

    # Each new token sees its row's cached tokens (one key range) and the row's stored new tokens up to itself
    # (the attention's block keys). The cache is read-only inside the layer loop and written once after it:
    # writing it per layer made every decode step copy the whole cache.
    read = T if attend_len is None else min(attend_len, T)
    cached = attention_api.KeyRanges(key_end=jnp.broadcast_to(jnp.minimum(cache.lengths, read)[:, None], (B, n)))
    in_block = (offsets[:, None] >= offsets[None, :])[None] & stored[:, None, :]  # [B, n, n]

    def layer(h, xs):
        lp, k_layer, v_layer = xs

        def attend(q, k, v):
            out = dec.attend(config, q, k_layer.astype(q.dtype), v_layer.astype(q.dtype), cached,
                             block=(k, v, in_block))
            return out, (k.astype(cache.k.dtype), v.astype(cache.v.dtype))

        h, kv, _ = dec.decoder_layer(config, lp, h, positions, attend)
        return h, kv

    k_read, v_read = (cache.k, cache.v) if read == T else (cache.k[:, :, :read], cache.v[:, :, :read])
    h, (k_new, v_new) = jax.lax.scan(layer, dec.embed_tokens(config, params, tokens),
                                     (params["layers"], k_read, v_read), unroll=config.scan_unroll)
    new_cache = KVCache(k=write_rows(cache.k, k_new, write_slot), v=write_rows(cache.v, v_new, write_slot),
                        lengths=cache.lengths + num_new)
    if return_logits == "none":
        return None, new_cache
    if return_logits == "hidden":
        return dec.final_norm(config, params, h), new_cache
    if return_logits == "last":
        h = h[jnp.arange(B), jnp.clip(num_new - 1, 0, n - 1)]
    logits = dec.logits_from_hidden(config, params, dec.final_norm(config, params, h))
    return logits, new_cache


@functools.partial(jax.jit, static_argnums=0, static_argnames=("block_band", "cache_shards"))
def attend_cached_block(config: ModelConfig, params: dict, cache: KVCache, tokens: jax.Array,
                        positions: jax.Array, key_limit: jax.Array, block_mask: jax.Array, *,
                        block_band: int | None = None, key_start=None, cache_rows=None,
                        cache_shards: int = 1) -> jax.Array:
    """Final-normed hidden states [B, Q, D] of a query block run against a prefilled cache (cache not modified).

    Args:
      cache: prefilled keys/values (e.g. a trajectory after `extend`).
      tokens: int [B, Q]; the block (e.g. all answer copies of one trajectory, concatenated).
      positions: int [B, Q]; RoPE positions of the block tokens (copy k of an answer starts at b_k).
      key_limit: int [B, Q]; query q sees cached slots j < key_limit[b, q].
      block_mask: bool [B, Q, Q]; query q sees block token q' where block_mask[b, q, q'] (pass causality and
        copy boundaries explicitly; it is not added for you).
      block_band: optional static promise that `block_mask[b, q, q']` is False whenever `|q - q'| >= block_band`
        (e.g. answer copies of width w: band w); each query tile then scores only the block tokens near it.
      key_start: optional int [B, Q]; query q sees cached slots j >= key_start[b, q] only (a row packed after
        others: its first slot).
      cache_rows: optional int [B], the cache row that block row b reads (the cache holds packed rows,
        `models.packing`; counted over `cache_shards` contiguous blocks of rows, gathered per block: each layer
        reads its own rows' keys and values, one layer at a time).

    Attention is the one attention API (`attention.attention`) with the cache as the main keys
    (`KeyRanges(key_end=key_limit)`) and the block's own keys as its `block` keys: on the tiled kernel each query
    tile walks the cached key tiles only up to its largest `key_limit`, so the work is about `sum_q key_limit[q]`
    scores (plus the in-block part) and memory is O(tile) per step, linear in the cache length. Keep `key_limit`
    non-decreasing along the block (e.g. copies ordered by boundary) for the most skipping. Differentiable.

    Compute log-probs from the result with `hidden_logprobs` (chunked; no [B, Q, V] float32 tensor).
    """
    block_mask = block_mask.astype(bool)
    cached = attention_api.KeyRanges(key_end=key_limit.astype(jnp.int32),
                                     key_start=None if key_start is None else key_start.astype(jnp.int32))

    def layer(h, xs):
        lp, k_cache, v_cache = xs
        if cache_rows is not None:
            k_cache, v_cache = (take_rows(c, cache_rows, cache_shards) for c in (k_cache, v_cache))

        def attend(q, k, v):
            return dec.attend(config, q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), cached,
                              block=(k, v, block_mask), block_band=block_band), None

        return dec.decoder_layer(config, lp, h, positions, attend)[0], None

    h, _ = jax.lax.scan(dec.remat_wrap(config, layer), dec.embed_tokens(config, params, tokens),
                        (params["layers"], cache.k, cache.v), unroll=config.scan_unroll)
    return dec.final_norm(config, params, h)
