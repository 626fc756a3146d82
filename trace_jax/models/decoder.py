"""The decoder: pure functions from a params pytree and token ids to hidden states, logits and log-probs.

One implementation covers Qwen3 dense (per-head q/k RMSNorm), Qwen3-MoE (top-k routed experts, dropless
dispatch by sorting tokens by expert and `jax.lax.ragged_dot`, or by all-to-all over an `expert` mesh axis:
`expert_parallel`) and the Llama family (SmolLM2, Llama 3), with default, llama3 or YaRN rope scaling
(`rope_tables`). Layers are stacked along a leading `layers` axis and run under `lax.scan`, so compile time
does not grow with depth.

Params pytree (shapes; `L` = layers, see `ModelConfig` for the other letters):

    embed            [V, D]
    final_norm       [D]
    lm_head          [D, V]            (absent when tie_word_embeddings: logits use embed.T)
    layers/input_norm, layers/post_attn_norm          [L, D]
    layers/attn/q_proj [L, D, H, Dh]   k_proj, v_proj [L, D, K, Dh]   o_proj [L, H, Dh, D]
    layers/attn/q_norm, k_norm [L, Dh] (qk_norm only)   q_bias [L, H, Dh], k_bias, v_bias [L, K, Dh], o_bias [L, D]
                                       (attention_bias)
    layers/mlp/gate_proj, up_proj [L, D, F]   down_proj [L, F, D]                     (dense)
    layers/moe/router [L, D, E]   gate_proj, up_proj [L, E, D, Fe]   down_proj [L, E, Fe, D]   (MoE)

`param_logical_axes(config)` gives the same tree with a `PartitionSpec` of logical axis names per leaf.

Attention semantics (shared by `forward`, `forward_hidden`, `token_logprobs`):
  * query i may attend to key j iff j <= i (causality on the *sequence index*, not on `positions`),
    and, when `segment_ids` is given, segment_ids[b, i] == segment_ids[b, j],
    and, when `attention_mask` is given, attention_mask[b, i, j] (a boolean [B, S, S]; True = may attend) or,
    for a [B, S] mask, attention_mask[b, j] (key validity, Hugging Face style).
    All conditions are ANDed.
  * `positions [B, S]` only drive RoPE; the default is 0..S-1 for every row. Packers must pass positions that
    restart per segment.
  * A query with no visible key gets a uniform average (finite, never NaN); its output is meaningless.

Under `jax.set_mesh(mesh)` the residual stream is constrained to the logical axes (batch, length, embed) via
`sharding.constrain` (batch over data/fsdp/expert by the default rules); without a mesh that is a no-op.

This module knows nothing about checkpoints or caches (see `checkpoint_io`, `cache`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trace_jax.models import attention as attention_api
from trace_jax.models import expert_parallel
from trace_jax.models.config import ModelConfig
from trace_jax.models.sharding import constrain

_RESIDUAL_AXES = ("batch", "length", "embed")

_NEG_INF = -1e30  # finite, so fully masked rows give a uniform average instead of NaN


# ---------------------------------------------------------------------------------------------------- params
def param_shapes(config: ModelConfig) -> dict:
    """Shapes of every parameter (same tree as `init_params`)."""
    c = config
    L, D, H, K, Dh = c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn = {"q_proj": (L, D, H, Dh), "k_proj": (L, D, K, Dh), "v_proj": (L, D, K, Dh), "o_proj": (L, H, Dh, D)}
    if c.qk_norm:
        attn.update(q_norm=(L, Dh), k_norm=(L, Dh))
    if c.attention_bias:
        attn.update(q_bias=(L, H, Dh), k_bias=(L, K, Dh), v_bias=(L, K, Dh), o_bias=(L, D))
    layers = {"input_norm": (L, D), "post_attn_norm": (L, D), "attn": attn}
    if c.is_moe:
        E, Fe = c.num_experts, c.moe_intermediate_size
        layers["moe"] = {"router": (L, D, E), "gate_proj": (L, E, D, Fe), "up_proj": (L, E, D, Fe),
                         "down_proj": (L, E, Fe, D)}
    else:
        F = c.intermediate_size
        layers["mlp"] = {"gate_proj": (L, D, F), "up_proj": (L, D, F), "down_proj": (L, F, D)}
    shapes = {"embed": (c.vocab_size, D), "final_norm": (D,), "layers": layers}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, c.vocab_size)
    return shapes


_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "input_norm": ("layers", "norm"),
    "post_attn_norm": ("layers", "norm"),
    "q_proj": ("layers", "embed", "heads", "head_dim"),
    "k_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "v_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "o_proj": ("layers", "heads", "head_dim", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "q_bias": ("layers", "heads", "head_dim"),
    "k_bias": ("layers", "kv_heads", "head_dim"),
    "v_bias": ("layers", "kv_heads", "head_dim"),
    "o_bias": ("layers", "norm"),
    "mlp/gate_proj": ("layers", "embed", "mlp"),
    "mlp/up_proj": ("layers", "embed", "mlp"),
    "mlp/down_proj": ("layers", "mlp", "embed"),
    "moe/router": ("layers", "embed", None),
    "moe/gate_proj": ("layers", "experts", "embed", "mlp"),
    "moe/up_proj": ("layers", "experts", "embed", "mlp"),
    "moe/down_proj": ("layers", "experts", "mlp", "embed"),
}


def param_logical_axes(config: ModelConfig) -> dict:
    """Same tree as the params, each leaf a `PartitionSpec` of logical axis names (or None = replicated dim).

    Names: layers, embed, heads, kv_heads, head_dim, mlp, experts, vocab, norm. Map them to mesh axes with
    `trace_jax.models.sharding.logical_to_sharding`.
    """
    def axes(path, _shape):
        keys = [k.key for k in path]
        name = keys[-1]
        if len(keys) >= 2 and keys[-2] in ("mlp", "moe"):
            name = f"{keys[-2]}/{name}"
        return P(*_AXES[name])

    return jax.tree_util.tree_map_with_path(axes, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def init_params(config: ModelConfig, rng: jax.Array, *, dtype=None) -> dict:
    """Random params (normal(0, 0.02) matrices, unit norms, zero biases) in `dtype` (default config.param_dtype).

    One jitted computation (wrap in `jax.jit(..., out_shardings=param_shardings(...))` to create them sharded).
    """
    return _init_params_jit(config, rng, jnp.dtype(dtype or config.param_dtype).name)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params_jit(config: ModelConfig, rng: jax.Array, dtype: str) -> dict:
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(rng, len(leaves))
    out = []
    for (path, shape), key in zip(leaves, keys):
        name = path[-1].key
        if name.endswith("norm"):
            out.append(jnp.ones(shape, dtype))
        elif name.endswith("bias"):
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------------- pieces
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in float32, result in x.dtype (Hugging Face order of operations)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, float]:
    """`(inv_freq [Dh/2] float32, attention_scaling)` of the config's rotary embedding, as transformers computes
    them (`modeling_rope_utils`): "default", "llama3" (frequency bands) or "yarn" (`_compute_yarn_parameters`:
    frequencies blended between interpolated `1/(factor * theta^(2i/Dh))` and original by a linear ramp over the
    dimensions whose wavelengths fall between `beta_fast` and `beta_slow` rotations in the original context;
    cos/sin scaled by `attention_scaling`, YaRN's `0.1 ln(factor) + 1` unless given). Scaling is 1.0 otherwise.
    """
    dh = config.head_dim
    inv = (1.0 / (config.rope_theta ** (np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / dh)))
    inv = inv.astype(np.float32)
    if config.rope_type == "llama3":
        factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old = config.rope_original_max_position
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif config.rope_type == "yarn":
        return _yarn_tables(config)
    return inv, 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_tables(config: ModelConfig) -> tuple[np.ndarray, float]:
    # Step by step as transformers' `_compute_yarn_parameters` (float32 arrays, float64 scalars), so logits agree.
    dh, base, factor = config.head_dim, config.rope_theta, config.rope_scaling_factor
    if config.rope_attention_factor:
        scaling = config.rope_attention_factor
    elif config.rope_mscale and config.rope_mscale_all_dim:
        scaling = _yarn_mscale(factor, config.rope_mscale) / _yarn_mscale(factor, config.rope_mscale_all_dim)
    else:
        scaling = _yarn_mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in the original context
        return dh * math.log(config.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dh - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dh // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, dh, 2).astype(np.float32) / np.float32(dh))).astype(np.float32)
    inv_extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inv_interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv = inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation
    return inv.astype(np.float32), float(scaling)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scaling: float = 1.0) -> jax.Array:
    """Rotary embedding (rotate-half layout). x: [B, S, N, Dh]; positions: [B, S] int; `scaling` multiplies cos and
    sin in float32 before the cast (YaRN's attention factor, `rope_tables`)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, S, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scaling != 1.0:
        cos, sin = cos * np.float32(scaling), sin * np.float32(scaling)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _project_qkv(config: ModelConfig, attn: dict, x: jax.Array, positions: jax.Array):
    """x [B, S, D] (normed) -> q [B, S, H, Dh], k, v [B, S, K, Dh] with q/k norm and RoPE applied."""
    cdt = x.dtype
    q = jnp.einsum("bsd,dhk->bshk", x, attn["q_proj"].astype(cdt))
    k = jnp.einsum("bsd,dhk->bshk", x, attn["k_proj"].astype(cdt))
    v = jnp.einsum("bsd,dhk->bshk", x, attn["v_proj"].astype(cdt))
    if config.attention_bias:
        q, k, v = q + attn["q_bias"].astype(cdt), k + attn["k_bias"].astype(cdt), v + attn["v_bias"].astype(cdt)
    if config.qk_norm:
        q = rms_norm(q, attn["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, attn["k_norm"], config.rms_norm_eps)
    inv_freq, scaling = rope_tables(config)
    return apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling), v


def attend(config: ModelConfig, q, k, v, mask, *, self_attention: bool = False, segment_ids=None, block=None,
           block_band: int | None = None):
    """`attention.attention` with the config's implementation and tiles (see docs/models.md for which path runs).

    Query tiles: `attention_q_block`, else `attention_query_chunk`, else automatic by head width; key tiles:
    `attention_k_block`. A dense (user-mask) path is query-chunked by `attention_query_chunk`, or automatically in
    blocks of `AUTO_CHUNK` rows past `AUTO_CHUNK_ABOVE` queries, so its scores never need [B, H, S, S].
    `block` / `block_band`: more keys under a boolean mask in the same softmax (see `attention.attention`).
    """
    Q = q.shape[1]
    chunk = config.attention_query_chunk or (AUTO_CHUNK if Q > AUTO_CHUNK_ABOVE else 0)
    return attention_api.attention(q, k, v, mask, impl=config.attention_impl,
                                   q_block=config.attention_q_block or config.attention_query_chunk,
                                   k_block=config.attention_k_block, query_chunk=chunk,
                                   self_attention=self_attention, segment_ids=segment_ids, block=block,
                                   block_band=block_band)


# A user-supplied [B, S, S] mask takes the dense path; past this many queries it runs in query blocks.
AUTO_CHUNK_ABOVE = 2048
AUTO_CHUNK = 512


def _attn_output(attn: dict, o: jax.Array) -> jax.Array:
    out = jnp.einsum("bshk,hkd->bsd", o, attn["o_proj"].astype(o.dtype))
    return out + attn["o_bias"].astype(o.dtype) if "o_bias" in attn else out


def _dense_mlp(mlp: dict, x: jax.Array) -> jax.Array:
    cdt = x.dtype
    gate = jnp.einsum("bsd,df->bsf", x, mlp["gate_proj"].astype(cdt))
    up = jnp.einsum("bsd,df->bsf", x, mlp["up_proj"].astype(cdt))
    return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, mlp["down_proj"].astype(cdt))


def _moe_mlp(config: ModelConfig, moe: dict, x: jax.Array, token_weight: jax.Array | None = None):
    """Top-k routed experts: route every token, then dispatch by `config.moe_dispatch` (resolved under the mesh).

    "sort" (dropless): sort the (token, slot) pairs by expert and run `ragged_dot` per expert group, partitioned by
    GSPMD. "all_to_all": `expert_parallel.expert_parallel_mlp`, tokens exchanged over the `expert` mesh axis.
    Routing and its statistics are computed here, once, whichever dispatch runs.

    x: [B, S, D] (normed); token_weight: optional float32 [B, S], 1 for tokens counted in the router statistics and
    0 for padding. Returns `(out [B, S, D], router_stats)` with `router_stats = (counts [E], prob_sum [E],
    dropped [])`, float32: per expert, the weighted number of top-k assignments and the weighted sum of router
    probabilities (the pieces of Hugging Face's `load_balancing_loss_func`, summed over layers by the caller), and
    the weighted number of assignments a capacity-bounded dispatch dropped (0 when dropless).
    """
    cdt = x.dtype
    B, S, D = x.shape
    k, E = config.num_experts_per_tok, config.num_experts
    xt = x.reshape(B * S, D)
    router_logits = xt @ moe["router"].astype(cdt)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    expert_parallel_dispatch = expert_parallel.resolve_dispatch(config) == "all_to_all"
    if expert_parallel_dispatch:  # GSPMD would gather every token's probs for the top-k
        top_w, top_e = expert_parallel.token_sharded_top_k(probs, k)
    else:
        top_w, top_e = jax.lax.top_k(probs, k)  # [T, k]
    weight = jnp.ones((B * S,), jnp.float32) if token_weight is None else token_weight.reshape(B * S)
    counts = jnp.zeros((E,), jnp.float32).at[top_e.reshape(-1)].add(jnp.repeat(weight, k))
    prob_sum = jnp.sum(probs * weight[:, None], axis=0)
    if config.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(cdt)
    if expert_parallel_dispatch:
        out, dropped = expert_parallel.expert_parallel_mlp(config, moe, xt, top_e, top_w, weight)
        return out.reshape(B, S, D), (counts, prob_sum, dropped)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = xt[token_of]
    gate = jax.lax.ragged_dot(xs, moe["gate_proj"].astype(cdt), group_sizes)
    up = jax.lax.ragged_dot(xs, moe["up_proj"].astype(cdt), group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, moe["down_proj"].astype(cdt), group_sizes)
    out = out * top_w.reshape(-1)[order][:, None]
    out = jnp.zeros_like(xt).at[token_of].add(out).reshape(B, S, D)
    return out, (counts, prob_sum, jnp.zeros((), jnp.float32))


def mlp_block(config: ModelConfig, layer: dict, x: jax.Array, token_weight: jax.Array | None = None):
    """The feed-forward half of one layer (dense SwiGLU or routed experts); x is already normed.

    Returns `(out [B, S, D], router_stats)`; router_stats is `(counts [E], prob_sum [E], dropped [])` for MoE (see
    `_moe_mlp`) and None for dense layers.
    """
    if config.is_moe:
        return _moe_mlp(config, layer["moe"], x, token_weight)
    return _dense_mlp(layer["mlp"], x), None


def decoder_layer(config: ModelConfig, layer: dict, h: jax.Array, positions: jax.Array, attend, *,
                  token_weight: jax.Array | None = None):
    """One pre-norm decoder layer, the single body behind `forward`, `cache.extend` and `attend_cached_block`.

    Args:
      layer: one layer's params (a slice of `params["layers"]`).
      h: residual stream [B, S, D]; positions: int [B, S] (RoPE).
      attend: `(q [B, S, H, Dh], k [B, S, K, Dh], v) -> (out [B, S, H, Dh], extra)`; the caller's attention over
        whatever keys it owns (its own tokens, a cache it writes k/v into, ...). `extra` is passed through.
      token_weight: optional float32 [B, S] weights of the router statistics (0 = padding).

    Returns `(h [B, S, D], extra, router_stats)`; the residual stream is sharding-constrained here, once.
    """
    x = rms_norm(h, layer["input_norm"], config.rms_norm_eps)
    q, k, v = _project_qkv(config, layer["attn"], x, positions)
    o, extra = attend(q, k, v)
    h = h + _attn_output(layer["attn"], o)
    x = rms_norm(h, layer["post_attn_norm"], config.rms_norm_eps)
    out, router_stats = mlp_block(config, layer, x, token_weight)
    return constrain(h + out, _RESIDUAL_AXES), extra, router_stats


def router_aux_loss(config: ModelConfig, router_stats, num_tokens: jax.Array) -> jax.Array:
    """Load-balancing loss from per-layer router statistics, as transformers' Qwen3-MoE `load_balancing_loss_func`.

    router_stats: `(counts [L, E], prob_sum [L, E], ...)` from `mlp_block`; num_tokens: the (weighted) token count of
    one layer. With N = L * num_tokens, f_e = sum_l counts[l, e] / N and P_e = sum_l prob_sum[l, e] / N, the loss
    is `E * sum_e f_e * P_e` (before `router_aux_loss_coef`). Float32 scalar; 0.0 for dense models.
    """
    if not config.is_moe:
        return jnp.zeros((), jnp.float32)
    counts, prob_sum = router_stats[:2]
    total = jnp.maximum(counts.shape[0] * num_tokens.astype(jnp.float32), 1.0)
    return config.num_experts * jnp.sum((jnp.sum(counts, 0) / total) * (jnp.sum(prob_sum, 0) / total))


def remat_wrap(config: ModelConfig, fn):
    """Apply the configured rematerialisation policy to a scan body."""
    if config.remat == "none":
        return fn
    policy = {
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.dots_saveable,
        "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[config.remat]
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def embed_tokens(config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] int -> [B, S, D] in the compute dtype. Ids outside [0, vocab_size) give NaN rows (no check
    is possible under jit; host code checks with `check_token_ids`)."""
    return jnp.take(params["embed"], tokens, axis=0).astype(jnp.dtype(config.dtype))


def final_norm(config: ModelConfig, params: dict, h: jax.Array) -> jax.Array:
    return rms_norm(h, params["final_norm"], config.rms_norm_eps)


def unembed_matrix(config: ModelConfig, params: dict) -> jax.Array:
    """The [D, V] output projection (embed.T when tied)."""
    return params["embed"].T if config.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(config: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] (final-normed) -> float32 logits [..., V]."""
    # A tied head contracts with embed [V, D] directly: spelling it as `embed.T` made XLA write a transposed
    # [D, V] copy of the whole table on every call (about 4% of a SmolLM2 training step on CPU).
    if config.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", hidden, params["embed"].astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params["lm_head"].astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------- forward
def attention_mask_rows(tokens_shape, segment_ids=None, attention_mask=None):
    """A function `(q_start, q_len) -> bool [B, q_len, S]`: rows of the mask implied by causality, segment ids and
    an optional user mask (see module doc); q_start may be traced."""
    B, S = tokens_shape
    if attention_mask is not None:
        attention_mask = jnp.asarray(attention_mask).astype(bool)

    def rows(q_start, q_len):
        q_idx = q_start + jnp.arange(q_len)
        mask = jnp.broadcast_to(q_idx[:, None] >= jnp.arange(S)[None, :], (B, q_len, S))
        if segment_ids is not None:
            q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, q_start, q_len, axis=1)
            mask = mask & (q_seg[:, :, None] == segment_ids[:, None, :])
        if attention_mask is not None:
            if attention_mask.ndim == 2:
                mask = mask & attention_mask[:, None, :]
            else:
                mask = mask & jax.lax.dynamic_slice_in_dim(attention_mask, q_start, q_len, axis=1)
        return mask

    return rows


def build_attention_mask(tokens_shape, segment_ids=None, attention_mask=None) -> jax.Array:
    """The boolean [B, S, S] mask implied by causality, segment ids and an optional user mask (see module doc)."""
    return attention_mask_rows(tokens_shape, segment_ids, attention_mask)(0, tokens_shape[1])


def self_attention_mask(tokens_shape, segment_ids=None, attention_mask=None):
    """The mask of self-attention over [B, S] tokens: a `KeyRanges` (causal, segments, a [B, S] key-validity mask),
    or, for a user [B, S, S] mask, a row function for the dense path (see `attention_mask_rows`)."""
    B, S = tokens_shape
    if attention_mask is not None and jnp.ndim(attention_mask) == 3:
        return attention_mask_rows(tokens_shape, segment_ids, attention_mask)
    return attention_api.causal_ranges(B, S, segment_ids=segment_ids, key_valid=attention_mask)


def router_token_weight(tokens_shape, segment_ids=None, attention_mask=None):
    """float32 [B, S]: 1 for tokens counted in the router statistics, 0 for padding; None when all count.

    Padding is what the masks say it is: `attention_mask [B, S]` False (Hugging Face's convention), a
    `[B, S, S]` mask whose diagonal is False (a token that may not see itself), or a negative segment id.
    """
    weight = None
    if attention_mask is not None:
        mask = jnp.asarray(attention_mask).astype(bool)
        weight = mask if mask.ndim == 2 else jnp.diagonal(mask, axis1=1, axis2=2)
    if segment_ids is not None:
        real = segment_ids >= 0
        weight = real if weight is None else weight & real
    return None if weight is None else weight.astype(jnp.float32)


def _forward_hidden(config, params, tokens, positions, segment_ids, attention_mask, *, return_kv=False,
                    return_router_stats=False, token_mask=None):
    """Final-normed hidden [B, S, D]; with `return_kv`, also every layer's keys and values
    `([layers, B, S, K, Dh], [layers, B, S, K, Dh])` (what a KV cache of these tokens holds); with
    `return_router_stats`, also `(router_stats, num_tokens)` for `router_aux_loss`. `token_mask [B, S]` (0 =
    padding) only narrows which tokens the router statistics count."""
    B, S = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    mask = self_attention_mask((B, S), segment_ids, attention_mask)
    token_weight = router_token_weight((B, S), segment_ids, attention_mask) if config.is_moe else None
    if config.is_moe and token_mask is not None:
        real = (jnp.asarray(token_mask) != 0).astype(jnp.float32)
        token_weight = real if token_weight is None else token_weight * real

    def self_attend(q, k, v):
        out = attend(config, q, k, v, mask, self_attention=attention_mask is None, segment_ids=segment_ids)
        return out, ((k, v) if return_kv else None)

    def layer(h, lp):
        h, kv, stats = decoder_layer(config, lp, h, positions, self_attend, token_weight=token_weight)
        return h, (kv, stats)

    h = constrain(embed_tokens(config, params, tokens), _RESIDUAL_AXES)
    h, (kv, stats) = jax.lax.scan(remat_wrap(config, layer), h, params["layers"], unroll=config.scan_unroll)
    out = (final_norm(config, params, h),)
    if return_kv:
        out += (kv,)
    if return_router_stats:
        num_tokens = jnp.asarray(B * S, jnp.float32) if token_weight is None else jnp.sum(token_weight)
        out += ((stats, num_tokens),)
    return out if len(out) > 1 else out[0]


def check_token_ids(config: ModelConfig, tokens, name: str = "tokens") -> None:
    """Host check: raise ValueError unless every id in `tokens` (any int array or nested list) is in
    [0, vocab_size). The jitted functions cannot check values: an out-of-range id there gives NaN embeddings
    (`jnp.take` fills missing rows with NaN), so host code calls this before handing tokens to the device."""
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= config.vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} holds token id {int(ids[where])} at index {where}, outside [0, vocab_size="
                         f"{config.vocab_size}); check the tokenizer matches the model config")


def _check_tokens(tokens, name="tokens"):
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be [batch, seq] integers, got shape {tokens.shape}")


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_router_loss", "return_moe_dropped"))
def forward_hidden(config: ModelConfig, params: dict, tokens: jax.Array, *, positions=None, segment_ids=None,
                   attention_mask=None, return_router_loss: bool = False, return_moe_dropped: bool = False,
                   token_mask=None):
    """Final-normed hidden states [B, S, D] (compute dtype) for tokens [B, S]; masking as in the module doc.

    With `return_router_loss=True` returns `(hidden, router_aux_loss)`: the float32 load-balancing loss of
    transformers' Qwen3-MoE (`aux_loss`, before `config.router_aux_loss_coef`; see `router_aux_loss`), counting
    only real tokens (`router_token_weight`, and where given `token_mask [B, S]` nonzero: a trainer's right
    padding, which attention needs no mask for since no real token looks past it); 0.0 for dense models.
    Differentiable. `token_mask` changes nothing else.
    With `return_moe_dropped=True` a float32 scalar is appended: the number of real-token expert assignments that
    the capacity of the all_to_all dispatch dropped, summed over layers (0.0 when dropless or dense).
    """
    _check_tokens(tokens)
    if not (return_router_loss or return_moe_dropped):
        return _forward_hidden(config, params, tokens, positions, segment_ids, attention_mask)
    hidden, (stats, num_tokens) = _forward_hidden(config, params, tokens, positions, segment_ids, attention_mask,
                                                  return_router_stats=True, token_mask=token_mask)
    out = (hidden,)
    if return_router_loss:
        out += (router_aux_loss(config, stats, num_tokens),)
    if return_moe_dropped:
        out += (jnp.sum(stats[2]) if config.is_moe else jnp.zeros((), jnp.float32),)
    return out


@functools.partial(jax.jit, static_argnums=0)
def forward(config: ModelConfig, params: dict, tokens: jax.Array, *, positions=None, segment_ids=None,
            attention_mask=None) -> jax.Array:
    """Float32 logits [B, S, V] for tokens [B, S]. Materialises the full logits: use `token_logprobs` for training."""
    _check_tokens(tokens)
    hidden = _forward_hidden(config, params, tokens, positions, segment_ids, attention_mask)
    return logits_from_hidden(config, params, hidden)


# ---------------------------------------------------------------------------------------------------- log-probs
def hidden_logprobs(config: ModelConfig, params: dict, hidden: jax.Array, targets: jax.Array, *,
                    chunk_size: int = 256, with_entropy: bool = False):
    """log p(targets[b, t]) under logits computed from final-normed hidden [B, S, D]; returns float32 [B, S].

    With `with_entropy=True` returns `(logp, entropy)`, both float32 [B, S], where `entropy[b, t] =
    -sum_v p_v log p_v` of the full distribution predicted at position t (the same distribution `logp[b, t]`
    reads its target from), computed in the same chunks as `logsumexp(z) - sum_v softmax(z)_v z_v`.

    Runs over sequence chunks of `chunk_size` positions under `lax.scan` with rematerialisation, so at most
    float32 [B, chunk_size, V] logits exist at once (forward and backward). Log-softmax is in float32. When one
    chunk covers the whole sequence there is nothing to bound, so its logits are kept for the backward pass
    instead of recomputed (the same peak memory, one [B, S, D] x [D, V] matmul less).
    """
    B, S, D = hidden.shape
    c = max(1, min(chunk_size, S))
    n = -(-S // c)
    pad = n * c - S
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = jnp.moveaxis(hidden.reshape(B, n, c, D), 1, 0)
    ts = jnp.moveaxis(targets.reshape(B, n, c), 1, 0)

    def chunk(h, t):
        logits = logits_from_hidden(config, params, h)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if not with_entropy:
            return picked - lse
        # sum_v p_v z_v with p = softmax(z): no [B, c, V] log-prob tensor beyond the logits themselves
        expected_logit = jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)
        return picked - lse, lse - expected_logit

    if n > 1:
        chunk = jax.checkpoint(chunk)
    _, out = jax.lax.scan(lambda carry, ht: (carry, chunk(*ht)), None, (hs, ts), unroll=config.scan_unroll)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n * c)[:, :S]  # noqa: E731
    return jax.tree_util.tree_map(unchunk, out)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("chunk_size", "with_entropy"))
def token_logprobs(config: ModelConfig, params: dict, tokens: jax.Array, *, targets=None, positions=None,
                   segment_ids=None, attention_mask=None, chunk_size: int = 256, with_entropy: bool = False):
    """Per-token log-probs [B, S] (float32): result[b, t] = log p(targets[b, t] | tokens[b, :t+1]).

    Default targets are tokens shifted left by one; the last position (which has no next token) is then 0.0.
    This is the *next-token* alignment; `trace_jax.models.alignment.to_token_aligned` converts it to the
    project's token-aligned convention (index t holds log p(tokens[t] | tokens[:t])).
    With explicit `targets [B, S]` every position is scored. With `with_entropy=True` returns `(logp, entropy)`:
    the entropy of the distribution predicted at each position, same alignment (last position 0.0 with default
    targets). Never materialises float32 [B, S, V] (see `hidden_logprobs`). Masking arguments as in `forward`.
    """
    _check_tokens(tokens)
    hidden = _forward_hidden(config, params, tokens, positions, segment_ids, attention_mask)
    if targets is None:
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        out = hidden_logprobs(config, params, hidden, shifted, chunk_size=chunk_size, with_entropy=with_entropy)
        return jax.tree_util.tree_map(lambda x: x.at[:, -1].set(0.0), out)
    return hidden_logprobs(config, params, hidden, targets, chunk_size=chunk_size, with_entropy=with_entropy)
