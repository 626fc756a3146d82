"""Policy-update losses as pure functions over padded, token-aligned arrays (rlax style; shapes in docstrings).

`LossBatch` is what the train step consumes. All its `[N, L]` arrays are **token-aligned** (the project's one
convention, `trace_jax.models.alignment`): index t describes token t, e.g. `behaviour_logprobs[n, t] =
log pi_old(tokens[n, t] | tokens[n, :t])`, and index 0 is never trained.

    tokens              int32   [N, L]  prompt, generated and observation ids (padded)
    positions           int32   [N, L]  RoPE positions
    loss_mask           float32 [N, L]  1 on policy-generated tokens (the tokens the loss trains), else 0
    advantages          float32 [N, L]  per-token advantage (rl) or per-token weight (sft: ABC-SFT step weights,
                                        1 for plain SFT)
    behaviour_logprobs  float32 [N, L]  old-policy log-probs of token t: the sampler's `sampler_logprobs`, or with
                                        `LossConfig.tis` the trainer's recomputation of pi_old; unused in sft mode
    sampler_logprobs    float32 [N, L]  optional: the sampler's log-probs of token t, for the TIS weights
                                        (`LossConfig.tis`); None without TIS
    reference_logprobs  float32 [N, L]  frozen reference's log-probs of token t, for the KL term; None when
                                        `kl_coef == 0` (the train step then leaves the reference unused)
    segment_ids         int32   [N, L]  optional packing ids (tokens attend within their segment)
    token_mask          float32 [N, L]  optional: 1 on real tokens (prompt, generated, observation), 0 on the
                                        right padding; None = every token is real. Only the MoE load-balancing
                                        loss reads it (padding must not count as routed tokens)
    trained_index       int32   [N, K]  optional: each row's trained positions (`loss_mask > 0`) in increasing
                                        order, then 0s (`trained_positions` builds it; K >= every row's count).
                                        With it the LM head runs on those K positions per row instead of all L:
                                        an agent trajectory is mostly prompt and observation tokens, which the
                                        loss never reads. None = the head runs everywhere. Same loss either way
    packing             PackedRows      optional: the rows packed end to end into fewer rows of the same width
                                        (`LossBatch.packed`, `models.packing`): the model runs on those, and its
                                        log-probs are read back at the rows above. None = the rows as they are.
                                        Same loss either way

Formulas (per trained token, `r` the importance ratio, `A` the advantage):

    r_t       = exp(log pi(y_t) - log pi_old(y_t))                              ratio_level="token"
    r_t       = s_i = exp(mean_{t in i} (log pi(y_t) - log pi_old(y_t)))        ratio_level="sequence" (GSPO)
    pg_t      = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    pg_t      = min(pg_t, -c A)  where A < 0                                    dual_clip=c
    pg_t      = w_t pg_t,  w_t = min(pi_old(y_t) / pi_sampler(y_t), C)           tis="token", C = tis_cap
              = w_i pg_t,  w_i = min(prod_{t in i} pi_old / pi_sampler, C)       tis="sequence"
    kl_t      = k1: log pi - log pi_ref;  k2: (log pi - log pi_ref)^2 / 2;
                k3: exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1;        then clipped to [-clamp, clamp]
    loss_t    = pg_t + kl_coef * kl_t - entropy_coef * H_t                     mode="rl"
    loss_t    = -w_t log pi(y_t)                                                mode="sft" (w = `advantages`)

GSPO (credit-spec section 4) is `ratio_level="sequence"` with `aggregation="seq-mean-token-mean"`: its advantage is
constant over a row, so the row's per-token terms are equal and the row mean is the one term per sequence,
`max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))`; every sequence weighs the same whatever its length.

`aggregate` turns per-token values into `(sum, count)` so that summing sums and counts over micro-batches or data
shards and dividing once gives exactly the full-batch loss (and gradient: counts never depend on params).

This module knows nothing about optimizers, meshes, checkpoints or where batches come from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from trace_jax import models
from trace_jax.credit.gspo import gspo_sequence_ratio
from trace_jax.models.alignment import to_token_aligned
from trace_jax.models.packing import PackedRows, plan_packing, take_packed, unpack_token_values
from trace_jax.train.config import AGGREGATIONS, KL_ESTIMATORS, TIS_LEVELS, LossConfig

# Qwen3-MoE's published default, used when the model config does not carry its own coefficient.
_DEFAULT_ROUTER_AUX_COEF = 0.001


@struct.dataclass
class LossBatch:
    """One policy-update batch; every array `[N, L]` and token-aligned (see the module doc)."""

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    behaviour_logprobs: jax.Array
    reference_logprobs: jax.Array | None = None
    sampler_logprobs: jax.Array | None = None
    segment_ids: jax.Array | None = None
    token_mask: jax.Array | None = None
    trained_index: jax.Array | None = None
    packing: PackedRows | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def head_width(self) -> int:
        """Positions per row the LM head runs on: K with `trained_index`, else L."""
        return int((self.tokens if self.trained_index is None else self.trained_index).shape[1])

    def padded(self, rows: int, length: int, head_width: int | None = None) -> "LossBatch":
        """This batch with untrained zeros appended up to `[rows, length]` and its `trained_index` up to
        `[rows, head_width]` (None: as it is), so that every step of a run feeds the jitted update one shape.

        Appended rows and columns have loss mask 0 and token mask 0 (a batch without a token mask gets one: 1 on
        its own tokens), so they add nothing to any aggregation's sum nor to the token- and sequence-mean counts
        ("constant" divides by rows x L by definition); appended index entries are 0, the padding marker. Real
        tokens never attend to appended columns (causal attention, padding on the right).
        """
        n, width = self.shape
        if self.packing is not None:
            raise ValueError("LossBatch.padded: the batch is packed; pad it before packing (`LossBatch.packed`)")
        k = None if self.trained_index is None else int(self.trained_index.shape[1])
        head_width = k if head_width is None else head_width
        if rows < n or length < width:
            raise ValueError(f"LossBatch.padded: the batch is [{n}, {width}], larger than rows={rows}, "
                             f"length={length}; padding only grows a batch")
        if (k is None) != (head_width is None) or (k is not None and not k <= head_width <= length):
            raise ValueError(f"LossBatch.padded: head_width={head_width} must be given exactly when the batch has a "
                             f"trained_index (its width {k}) and lie between that width and length={length}")
        batch = self
        if self.token_mask is None and (rows, length) != (n, width):
            batch = batch.replace(token_mask=jnp.ones((n, width), jnp.float32))

        def pad(x, columns):
            if x is None:
                return None
            return jnp.pad(x, ((0, rows - x.shape[0]), (0, columns - x.shape[1])))

        fields = {name: pad(getattr(batch, name), length) for name in (
            "tokens", "positions", "loss_mask", "advantages", "behaviour_logprobs", "reference_logprobs",
            "sampler_logprobs", "segment_ids", "token_mask")}
        return batch.replace(**fields, trained_index=pad(batch.trained_index, head_width))

    def real_lengths(self) -> np.ndarray:
        """Host: int32 [N], each row's real tokens (its `token_mask`, right-padded; L for every row without one)."""
        n, width = self.shape
        if self.token_mask is None:
            return np.full((n,), width, np.int32)
        return np.asarray(jnp.sum(jnp.asarray(self.token_mask) > 0, axis=1), np.int32)

    def packed(self, *, micro_batches: int = 1, shards: int = 1, rows_per_group: int | None = None) -> "LossBatch":
        """This batch with its rows packed (`models.packing.plan_packing`): rows of `token_mask`'s real tokens
        laid end to end in rows of the batch's own width L (every row fits one), within the groups the train step
        splits rows into (`micro_batches` as `LossConfig.micro_batches`; `shards`, the mesh's batch shards), the
        packed-row count per group rounded by `packed_rows_bucket` (or `rows_per_group`). Host side: reads the
        tokens, positions and token mask. The loss, its gradient and the metrics are those of the batch unpacked."""
        if self.segment_ids is not None:
            raise ValueError("LossBatch.packed: the batch already has segment_ids (it is packed by its maker); "
                             "leave UpdateConfig.packing off for it")
        if self.packing is not None:
            return self
        width = self.shape[1]
        plan = plan_packing(self.real_lengths(), width, micro_batches=micro_batches, shards=shards,
                            rows_per_group=rows_per_group)
        return self.replace(packing=PackedRows.build(np.asarray(self.tokens), np.asarray(self.positions), plan))

    def validate(self, loss_config: LossConfig | None = None, *, reference_params_given: bool = False) -> None:
        """Host-side check of shapes and of what the loss config needs; raises ValueError naming the field."""
        shape = self.shape
        if len(shape) != 2:
            raise ValueError(f"LossBatch.tokens must be [N, L], got shape {shape}")
        for name in ("positions", "loss_mask", "advantages", "behaviour_logprobs", "reference_logprobs",
                     "sampler_logprobs", "segment_ids", "token_mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"LossBatch.{name} has shape {tuple(value.shape)}, expected {shape} like tokens")
        if self.packing is not None:
            packed = tuple(self.packing.tokens.shape)
            if len(packed) != 2 or packed[1] != shape[1] or tuple(self.packing.slot.shape) != (shape[0],):
                raise ValueError(f"LossBatch.packing has packed rows {packed} and {tuple(self.packing.slot.shape)} "
                                 f"row slots, expected [P, {shape[1]}] and [{shape[0]}]: build it with "
                                 "LossBatch.packed()")
            if self.segment_ids is not None:
                raise ValueError("LossBatch has both segment_ids and packing: pack a batch one way")
        if (self.packing is not None and loss_config is not None
                and self.packing.tokens.shape[0] % loss_config.micro_batches):
            raise ValueError(f"LossBatch.packing has {self.packing.tokens.shape[0]} packed rows, not divisible by "
                             f"LossConfig.micro_batches={loss_config.micro_batches}: pack with micro_batches set")
        if self.trained_index is not None:
            index_shape = tuple(self.trained_index.shape)
            if len(index_shape) != 2 or index_shape[0] != shape[0] or index_shape[1] > shape[1]:
                raise ValueError(f"LossBatch.trained_index has shape {index_shape}, expected [N, K] with N = "
                                 f"{shape[0]} rows and K <= L = {shape[1]} (build it with trained_positions(loss_mask))")
        if (loss_config is not None and loss_config.needs_reference and self.reference_logprobs is None
                and not reference_params_given):
            raise ValueError(f"LossBatch.reference_logprobs is None but LossConfig.kl_coef={loss_config.kl_coef} "
                             "> 0 needs reference log-probs: fill them, pass reference_params to the train step, "
                             "or set kl_coef=0")
        if loss_config is not None and loss_config.needs_sampler_logprobs and self.sampler_logprobs is None:
            raise ValueError(f"LossBatch.sampler_logprobs is None but LossConfig.tis={loss_config.tis!r} weighs each "
                             "token by pi_old / pi_sampler: fill them with the sampler's log-probs (and "
                             "behaviour_logprobs with the trainer's), or set LossConfig.tis = None")
        if loss_config is not None and shape[0] % loss_config.micro_batches:
            raise ValueError(f"LossBatch has {shape[0]} rows, not divisible by LossConfig.micro_batches="
                             f"{loss_config.micro_batches}")


def length_bucket(longest: int, multiple: int, max_len: int) -> int:
    """The padded length for a batch whose longest row has `longest` tokens: rounded up to `multiple`, at most
    `max_len` (the one bucketing rule of the train step's inputs, so jit sees few shapes)."""
    return int(min(max_len, -(-max(longest, 1) // multiple) * multiple))


def trained_positions(loss_mask, multiple: int = 64, *, head_width: int | None = None) -> np.ndarray:
    """Host side: `LossBatch.trained_index` for a `loss_mask [N, L]`: int32 `[N, K]`, row n's positions with
    `loss_mask > 0` in increasing order, then 0s. K = `head_width` when given (a run's fixed width, so the update
    compiles once; a row with more trained tokens raises ValueError), else the largest row count rounded up to
    `multiple` (at most L). Position 0 is never trained, so 0 marks the padding."""
    mask = np.asarray(loss_mask) > 0
    rows, length = mask.shape
    if mask[:, 0].any():
        raise ValueError("loss_mask[:, 0] is nonzero: token 0 has no prediction and is never trained")
    counts = mask.sum(axis=1)
    most = int(counts.max(initial=0))
    if head_width is not None and not most <= head_width <= length:
        raise ValueError(f"trained_positions: head_width={head_width} must hold the most trained tokens of a row "
                         f"({most}) and be at most the length L={length}")
    k = length_bucket(most, multiple, length) if head_width is None else head_width
    order = np.argsort(~mask, axis=1, kind="stable")[:, :k]  # trained positions first, in order
    return np.where(np.arange(k)[None, :] < counts[:, None], order, 0).astype(np.int32)


def real_token_mask(lengths, width: int):
    """float32 `[N, width]`: 1 on each row's first `lengths[n]` tokens, 0 on the right padding after them (the
    `LossBatch.token_mask` of rows padded on the right)."""
    return (jnp.arange(width)[None, :] < jnp.asarray(lengths)[:, None]).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------------- log-probs
def _policy_hidden(model_config, params, tokens, positions, segment_ids, with_router_loss: bool, token_mask=None):
    """Final-normed hidden [N, L, D] and the MoE router load-balancing loss (float32 scalar, 0 for dense) over the
    real tokens (`token_mask`, None = all)."""
    if with_router_loss and model_config.is_moe:
        return models.forward_hidden(model_config, params, tokens, positions=positions, segment_ids=segment_ids,
                                     return_router_loss=True, token_mask=token_mask)
    hidden = models.forward_hidden(model_config, params, tokens, positions=positions, segment_ids=segment_ids)
    return hidden, jnp.zeros((), jnp.float32)


def policy_logprobs(model_config, params, tokens, *, positions=None, segment_ids=None, chunk_size: int = 256,
                    with_entropy: bool = False, with_router_loss: bool = False, token_mask=None,
                    trained_index=None, packing: PackedRows | None = None):
    """Token-aligned log-probs of `tokens [N, L]` under `params`, computed in sequence chunks.

    Returns `(logp, entropy, router_aux)`: `logp [N, L]` float32 with `logp[n, t] = log pi(tokens[n, t] |
    tokens[n, :t])` and `logp[n, 0] = 0`; `entropy [N, L]` float32, the entropy of the distribution token t was
    drawn from (same alignment), or None without `with_entropy`; `router_aux` the MoE load-balancing loss before
    its coefficient (0 for dense models or without `with_router_loss`), counting only tokens where the optional
    `token_mask [N, L]` is nonzero.

    With `trained_index [N, K]` (see `LossBatch`) the LM head runs only at those positions: `logp` and `entropy`
    hold the same values there and 0 at every other position.

    With `packing` (`LossBatch.packed`) the model runs on the packed rows instead of `tokens` (whose values it then
    reads only as the targets at `trained_index`); the results are read back at the rows, the same values on each
    row's real tokens and 0 past them (`positions`, `segment_ids` and `token_mask` are then unused: the packed
    rows carry their own, and their padding is what the router statistics leave out).
    """
    if packing is not None:
        hidden, router_aux = _policy_hidden(model_config, params, packing.tokens, packing.positions,
                                            packing.segment_ids, with_router_loss)
    else:
        hidden, router_aux = _policy_hidden(model_config, params, tokens, positions, segment_ids, with_router_loss,
                                            token_mask)
    if trained_index is not None:
        index = trained_index.astype(jnp.int32)
        # token t is predicted from the hidden state at t - 1; padding entries (0) read position 0, then drop out
        before = jnp.maximum(index - 1, 0)
        if packing is None:
            picked_hidden = jnp.take_along_axis(hidden, before[..., None], axis=1)
        else:
            picked_hidden = take_packed(hidden, packing.slot, packing.offset[:, None] + before, packing.shards)
        out = models.hidden_logprobs(model_config, params, picked_hidden, jnp.take_along_axis(tokens, index, axis=1),
                                     chunk_size=chunk_size, with_entropy=with_entropy)
        rows = jnp.arange(tokens.shape[0])[:, None]

        def scatter(values):  # [N, K] -> token-aligned [N, L], 0 off the trained positions
            return jnp.zeros(tokens.shape, jnp.float32).at[rows, index].add(jnp.where(index > 0, values, 0.0))

        if with_entropy:
            return scatter(out[0]), scatter(out[1]), router_aux
        return scatter(out), None, router_aux
    source = tokens if packing is None else packing.tokens
    targets = jnp.concatenate([source[:, 1:], jnp.zeros_like(source[:, :1])], axis=1)
    out = models.hidden_logprobs(model_config, params, hidden, targets, chunk_size=chunk_size,
                                 with_entropy=with_entropy)
    if packing is None:
        align = to_token_aligned
    else:  # next-token-aligned at the packed token before; a segment's last token predicts nothing of its row
        def align(values):
            return unpack_token_values(values, packing, tokens.shape[1], shift=-1)
    if with_entropy:
        logp, entropy = out
        return align(logp), align(entropy), router_aux
    return align(out), None, router_aux


def head_rows(batch: "LossBatch") -> tuple[int, int]:
    """(rows, positions per row) the LM head runs on for `batch`: its trained_index, else every position of the
    packed rows (with packing) or of the rows."""
    if batch.trained_index is not None:
        return batch.tokens.shape[0], batch.head_width
    tokens = batch.tokens if batch.packing is None else batch.packing.tokens
    return tokens.shape[0], tokens.shape[1]


# ---------------------------------------------------------------------------------------------------- terms
class SurrogateStats(NamedTuple):
    """Per-token diagnostics of `clipped_surrogate`, all `[N, L]` float32 and 0 off the mask."""

    ratio: jax.Array  # the importance ratio used (token or broadcast sequence ratio)
    clipped_low: jax.Array  # 1 where r < 1 - eps_low and A < 0: the lower clip binds (no gradient)
    clipped_high: jax.Array  # 1 where r > 1 + eps_high and A > 0: the upper clip binds (no gradient)
    dual_clipped: jax.Array  # 1 where A < 0 and the dual clip -c A binds


def importance_ratio(logp, behaviour_logp, mask, ratio_level: str = "token"):
    """`[N, L]` importance ratios: per token, or GSPO's per-sequence ratio broadcast over the row's tokens.

    Off-mask entries are 1 (their log-ratio is zeroed before the exp, so padding never overflows).
    """
    if ratio_level == "token":
        return jnp.exp(jnp.where(mask != 0, logp - behaviour_logp, 0.0))
    if ratio_level == "sequence":
        seq = gspo_sequence_ratio(logp, behaviour_logp, mask)
        return jnp.broadcast_to(seq[:, None], logp.shape)
    raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")


def clipped_surrogate(logp, behaviour_logp, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
                      dual_clip: float | None = None, ratio_level: str = "token"):
    """Per-token clipped policy-gradient loss (to minimise) and its clip diagnostics.

    Args:
      logp: `[N, L]` current-policy log-probs of the sampled tokens (token-aligned).
      behaviour_logp: `[N, L]` behaviour-policy log-probs of the same tokens.
      advantages: `[N, L]` per-token advantages.
      mask: `[N, L]` 1 on trained tokens.

    Returns:
      `(loss [N, L], SurrogateStats)`; loss is 0 off the mask.
    """
    mask = mask.astype(jnp.float32)
    ratio = importance_ratio(logp, behaviour_logp, mask, ratio_level)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    negative = advantages < 0
    dual = jnp.zeros_like(mask)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (negative & (loss > cap)).astype(jnp.float32) * mask
        loss = jnp.where(negative, jnp.minimum(loss, cap), loss)
    stats = SurrogateStats(
        ratio=ratio * mask,
        clipped_low=((ratio < 1.0 - eps_low) & negative).astype(jnp.float32) * mask,
        clipped_high=((ratio > 1.0 + eps_high) & (advantages > 0)).astype(jnp.float32) * mask,
        dual_clipped=dual,
    )
    return loss * mask, stats


def tis_weights(trainer_logp, sampler_logp, mask, level: str = "token", cap: float = 2.0):
    """Truncated importance weights of the sampler/trainer mismatch, `[N, L]` float32, and where the cap binds.

    token:     w_t = min(exp(log pi_old(y_t) - log pi_sampler(y_t)), cap)
    sequence:  w_i = min(exp(sum_{t in i} (log pi_old(y_t) - log pi_sampler(y_t))), cap), broadcast over row i

    Computed in log space (`exp(min(log_ratio, log cap))`), so a large mismatch never overflows. Off the mask the
    weight is 0 (token) or the row's weight times 0 (sequence): both are 0 off the mask.

    Args:
      trainer_logp: `[N, L]` the trainer's log-probs of the sampled tokens under the behaviour params.
      sampler_logp: `[N, L]` the sampler's log-probs of the same tokens.
      mask: `[N, L]` 1 on trained tokens.

    Returns:
      `(weights [N, L], capped [N, L])`, both float32 and 0 off the mask; `capped` is 1 where the cap binds.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"tis level must be one of {TIS_LEVELS}, got {level!r}")
    m = (mask != 0)
    log_ratio = jnp.where(m, trainer_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=1, keepdims=True), log_ratio.shape)
    log_cap = float(np.log(cap))
    weights = jnp.exp(jnp.minimum(log_ratio, log_cap))
    capped = (log_ratio > log_cap) & m
    return jnp.where(m, weights, 0.0), capped.astype(jnp.float32)


def kl_penalty(logp, reference_logp, estimator: str = "k3", clamp: float | None = 10.0):
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi; `[N, L]` float32.

    k1 = log pi - log pi_ref (unbiased, high variance, can be negative); k2 = (log pi - log pi_ref)^2 / 2;
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, >= 0). Clipped to [-clamp, clamp].
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = logp - reference_logp
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * jnp.square(log_ratio)
    else:
        kl = jnp.exp(-log_ratio) + log_ratio - 1.0
    return kl if clamp is None else jnp.clip(kl, -clamp, clamp)


def aggregate(per_token, mask, mode: str = "token-mean", constant_normaliser: int | None = None):
    """Per-token values `[N, L]` -> `(sum, count)`, float32 scalars; the loss is `sum / count`.

    token-mean:           sum_{n,t} m x / sum_{n,t} m
    seq-mean-token-mean:  sum_n (sum_t m x / sum_t m) / #rows with a trained token
    seq-mean-token-sum:   sum_{n,t} m x / #rows with a trained token
    constant (Dr.GRPO):   sum_{n,t} m x / (N * C), C = constant_normaliser or L

    Sums and counts add over disjoint row sets, so micro-batches and data shards reproduce the full batch.
    """
    m = mask.astype(jnp.float32)
    x = per_token.astype(jnp.float32) * m
    row_tokens = jnp.sum(m, axis=1)
    rows = jnp.sum((row_tokens > 0).astype(jnp.float32))
    if mode == "token-mean":
        return jnp.sum(x), jnp.sum(row_tokens)
    if mode == "seq-mean-token-mean":
        return jnp.sum(jnp.sum(x, axis=1) / jnp.maximum(row_tokens, 1.0)), rows
    if mode == "seq-mean-token-sum":
        return jnp.sum(x), rows
    if mode == "constant":
        normaliser = x.shape[1] if constant_normaliser is None else constant_normaliser
        return jnp.sum(x), jnp.asarray(x.shape[0] * normaliser, jnp.float32)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def sft_loss(logp, weights, mask):
    """Weighted negative log-likelihood per token, `-w_t log pi(y_t)` on the mask; `[N, L]`."""
    return -weights * logp * mask.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------------- the batch loss
def router_aux_coef(model_config) -> float:
    """The model's load-balancing coefficient (`router_aux_loss_coef`, Qwen3-MoE default 0.001 when absent)."""
    return float(getattr(model_config, "router_aux_loss_coef", _DEFAULT_ROUTER_AUX_COEF))


def objective_from_logprobs(loss_config: LossConfig, logp, entropy, batch: LossBatch):
    """The batch objective's numerator and its metrics from token-aligned policy log-probs.

    Args:
      logp: `[N, L]` float32 current-policy log-probs (token-aligned, as `policy_logprobs` returns).
      entropy: `[N, L]` float32 predicted-distribution entropies, or None (then no entropy bonus or metric).
      batch: the `LossBatch` (its `tokens` are not read here).

    Returns:
      `(objective_sum, sums)`: the loss is `objective_sum / objective_count(...)`; `sums` maps metric names to
      `(sum, count)` float32 pairs, except `ratio_max` / `ratio_min` (plain max / min over trained tokens).
    """
    cfg = loss_config
    mask = batch.loss_mask.astype(jnp.float32)
    tokens = jnp.sum(mask)
    sums = {"tokens": (tokens, jnp.ones((), jnp.float32))}
    if cfg.mode == "sft":
        per_token = sft_loss(logp, batch.advantages, mask)
        sums["nll"] = (jnp.sum(-logp * mask), tokens)
    else:
        per_token, stats = clipped_surrogate(logp, batch.behaviour_logprobs, batch.advantages, mask,
                                             eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                                             ratio_level=cfg.ratio_level)
        if cfg.tis is not None:
            weights, capped = tis_weights(batch.behaviour_logprobs, batch.sampler_logprobs, mask, cfg.tis,
                                          cfg.tis_cap)
            per_token = per_token * weights
            sums["tis_weight_mean"] = (jnp.sum(weights), tokens)
            sums["tis_capped_frac"] = (jnp.sum(capped), tokens)
        sums["pg_loss"] = aggregate(per_token, mask, cfg.aggregation, cfg.constant_normaliser)
        sums["clip_frac_low"] = (jnp.sum(stats.clipped_low), tokens)
        sums["clip_frac_high"] = (jnp.sum(stats.clipped_high), tokens)
        sums["dual_clip_frac"] = (jnp.sum(stats.dual_clipped), tokens)
        sums["ratio_mean"] = (jnp.sum(stats.ratio), tokens)
        sums["ratio_max"] = jnp.max(jnp.where(mask > 0, stats.ratio, -jnp.inf))
        sums["ratio_min"] = jnp.min(jnp.where(mask > 0, stats.ratio, jnp.inf))
        # the sampler/trainer mismatch on the same tokens (style item 8: log the gap)
        sums["logprob_gap"] = (jnp.sum(jnp.abs(logp - batch.behaviour_logprobs) * mask), tokens)
        if cfg.kl_coef > 0:
            kl = kl_penalty(logp, batch.reference_logprobs, cfg.kl_estimator, cfg.kl_clamp)
            per_token = per_token + cfg.kl_coef * kl * mask
            sums["kl"] = (jnp.sum(kl * mask), tokens)
    if entropy is not None:
        sums["entropy"] = (jnp.sum(entropy * mask), tokens)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy * mask
    objective_sum, count = aggregate(per_token, mask, cfg.aggregation, cfg.constant_normaliser)
    sums["loss"] = (objective_sum, count)
    return objective_sum, sums


def loss_terms(model_config, loss_config: LossConfig, params, batch: LossBatch, *, batch_shards: int = 1):
    """`objective_from_logprobs` on the policy's own log-probs: returns `(objective_sum, router_aux, sums)`.

    `batch_shards`: how many devices the rows are split over (sizes the automatic log-softmax chunk).

    The loss is `objective_sum / objective_count(...) + router_aux_coef(model_config) * router_aux`.
    """
    cfg = loss_config
    rows, width = head_rows(batch)
    logp, entropy, router_aux = policy_logprobs(
        model_config, params, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids,
        chunk_size=cfg.chunk_for(max(1, rows // batch_shards), width, model_config.vocab_size),
        with_entropy=cfg.needs_entropy,
        with_router_loss=cfg.router_aux and model_config.is_moe, token_mask=batch.token_mask,
        trained_index=batch.trained_index, packing=batch.packing)
    objective_sum, sums = objective_from_logprobs(cfg, logp, entropy, batch)
    return objective_sum, router_aux, sums


def batch_logprobs(model_config, loss_config: LossConfig, params, batch: LossBatch, *, batch_shards: int = 1):
    """`[N, L]` float32 log-probs of the batch's tokens under `params`, on its trained positions (`trained_index`)
    or everywhere: what the trainer computes for the loss, without gradients (the pipeline's recomputation of
    pi_old for `LossConfig.tis`)."""
    rows, width = head_rows(batch)
    logp, _, _ = policy_logprobs(
        model_config, params, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids,
        chunk_size=loss_config.chunk_for(max(1, rows // batch_shards), width, model_config.vocab_size),
        trained_index=batch.trained_index, packing=batch.packing)
    return jax.lax.stop_gradient(logp)


def objective_count(loss_config: LossConfig, loss_mask):
    """The denominator of the batch loss (depends only on the mask and the aggregation mode)."""
    return aggregate(jnp.zeros_like(loss_mask, dtype=jnp.float32), loss_mask, loss_config.aggregation,
                     loss_config.constant_normaliser)[1]
