"""The jitted, sharded policy update: `make_train_step(...)(state, batch, reference_params) -> (state, metrics)`.

One `jax.jit` with in/out shardings for params and optimizer state from the logical-axis rules (FSDP, tensor and
expert parallel), the state donated, micro-batches accumulated under `lax.scan`. The loss's (sum, count) form makes
the accumulated gradient exactly the full-batch gradient: each micro-batch's sum is divided by the full batch's
count (counts depend only on the mask). The MoE load-balancing loss is the one term that is not a sum over tokens;
it is averaged over micro-batches.

Float32 master weights live in the state; `ModelConfig.dtype="bfloat16"` makes the forward and backward compute in
bfloat16 (the decoder casts weights per matmul), with float32 gradients and optimizer state.

This module knows nothing about checkpoints, rollouts or where batches come from.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models
from trace_jax.train.config import LossConfig
from trace_jax.train.loss import (LossBatch, head_rows, loss_terms, objective_count, policy_logprobs,
                                  router_aux_coef)
from trace_jax.train.state import TrainState, state_shardings

_MAX_METRICS = ("ratio_max",)
_MIN_METRICS = ("ratio_min",)


def batch_sharding(mesh: Mesh, rules=None, shape=None) -> NamedSharding:
    """The sharding of a `[N, L]` batch array (or a `[N]` one: `PackedRows`' per-row slots): rows over the
    `batch` rule's mesh axes."""
    logical = P("batch") if shape is not None and len(shape) == 1 else P("batch", "length")
    return NamedSharding(mesh, models.logical_to_mesh_spec(logical, mesh, rules, shape))


def batch_shards(mesh: Mesh | None, rules=None, rows: int | None = None) -> int:
    """How many blocks the rows of a batch are split in on `mesh` (1 without one; with `rows`, 1 where the batch
    axes do not divide them, as `batch_sharding` falls back to)."""
    if mesh is None:
        return 1
    spec = models.logical_to_mesh_spec(P("batch"), mesh, rules, None if rows is None else (rows,))[0] or ()
    count = 1
    for axis in (spec,) if isinstance(spec, str) else spec:
        count *= dict(mesh.shape)[axis]
    return count


def shard_batch(batch: LossBatch, mesh: Mesh, rules=None) -> LossBatch:
    """Place every array of `batch` with rows split over the batch axes of `mesh`. Device arrays move on device;
    host arrays are taken as the whole batch, the same on every process (e.g. the warm start's)."""
    from trace_jax.train.distributed import put_replicated_value

    def place(x):
        sharding = batch_sharding(mesh, rules, x.shape)
        return jax.device_put(x, sharding) if isinstance(x, jax.Array) else put_replicated_value(x, sharding)

    return jax.tree_util.tree_map(place, batch)


def _split_micro(x, micro_batches: int):
    """[N, ...] -> [M, N/M, ...] taking every M-th row, so each device's contiguous row block feeds every
    micro-batch (a data-sharded batch stays evenly sharded within each micro-batch)."""
    n = x.shape[0]
    return jnp.swapaxes(x.reshape(n // micro_batches, micro_batches, *x.shape[1:]), 0, 1)


def _combine(stacked: dict) -> dict:
    """Per-micro-batch sums (stacked on a leading axis) -> the full batch's metric values."""
    out = {}
    for name, value in stacked.items():
        if name in _MAX_METRICS:
            out[name] = jnp.max(value)
        elif name in _MIN_METRICS:
            out[name] = jnp.min(value)
        else:
            total, count = value
            out[name] = jnp.sum(total) / jnp.maximum(jnp.sum(count), 1e-30)
    return out


class TrainStep:
    """A compiled policy update. Call it as `(state, batch, reference_params) -> (state, metrics)`.

    `state` is donated (do not use it after the call). `reference_params` is never donated and only read when
    the loss needs reference log-probs that the batch lacks (`kl_coef > 0` and `batch.reference_logprobs is
    None`); pass None otherwise. `metrics` is a dict of float32 scalars: loss, pg_loss (rl) or nll (sft),
    clip_frac_low, clip_frac_high, dual_clip_frac, ratio_mean/min/max, logprob_gap (mean |log pi - log pi_old|),
    kl (when kl_coef > 0), entropy (when computed), router_aux, grad_norm (before clipping), tokens.
    `lower(...)` lowers it for ahead-of-time compilation (memory analysis) with the same arguments.
    """

    def __init__(self, jitted, mesh, loss_config: LossConfig, rules):
        self.jitted, self.mesh, self.loss_config, self.rules = jitted, mesh, loss_config, rules

    def _context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, state: TrainState, batch: LossBatch, reference_params=None):
        batch.validate(self.loss_config, reference_params_given=reference_params is not None)
        if self.mesh is not None:
            batch = shard_batch(batch, self.mesh, self.rules)
        with self._context():
            return self.jitted(state, batch, reference_params)

    def lower(self, state, batch, reference_params=None):
        with self._context():
            return self.jitted.lower(state, batch, reference_params)


def make_train_step(model_config, loss_config: LossConfig, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, rules=None, donate: bool = True, unroll: bool = False) -> TrainStep:
    """Build the jitted update for a model, a loss and an optax optimizer (see `TrainStep` for the call).

    The loop and `trace-jax plan` both build the update here. `unroll=True` unrolls every scan of the step (the
    micro-batches here, the layers and log-prob chunks of the model: `ModelConfig.scan_unroll`), with the same
    values: only for ahead-of-time cost analysis, which counts a loop body once.
    """
    if unroll:
        model_config = model_config.replace(scan_unroll=True)
    cfg = loss_config
    micro = cfg.micro_batches
    aux_coef = router_aux_coef(model_config) if (cfg.router_aux and model_config.is_moe) else 0.0

    shards = batch_shards(mesh, rules)

    def update(state: TrainState, batch: LossBatch, reference_params):
        count = objective_count(cfg, batch.loss_mask)

        def micro_batch_grads(mb: LossBatch):
            if cfg.needs_reference and mb.reference_logprobs is None:
                if reference_params is None:
                    raise ValueError("LossConfig.kl_coef > 0 needs reference log-probs: put them in "
                                     "LossBatch.reference_logprobs or pass reference_params to the train step")
                rows, width = head_rows(mb)
                chunk = cfg.chunk_for(max(1, rows // shards), width, model_config.vocab_size)
                ref_lp = policy_logprobs(model_config, reference_params, mb.tokens, positions=mb.positions,
                                         segment_ids=mb.segment_ids, chunk_size=chunk,
                                         trained_index=mb.trained_index, packing=mb.packing)[0]
                mb = mb.replace(reference_logprobs=jax.lax.stop_gradient(ref_lp))

            def objective(params):
                objective_sum, router_aux, sums = loss_terms(model_config, cfg, params, mb, batch_shards=shards)
                return objective_sum / jnp.maximum(count, 1e-30) + aux_coef * router_aux / micro, (sums, router_aux)

            (_, (sums, router_aux)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            sums["router_aux"] = (router_aux, jnp.ones((), jnp.float32))
            return grads, sums

        if micro == 1:
            # No accumulator: a zero-filled copy of the params plus one add over it cost ~2 params-sized memory
            # passes per step (the sums below reduce over a scalar instead of a stacked axis, same values).
            grads, stacked = micro_batch_grads(batch)
        else:
            def one_micro_batch(grad_acc, mb: LossBatch):
                grads, sums = micro_batch_grads(mb)
                return jax.tree_util.tree_map(jnp.add, grad_acc, grads), sums

            zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
            micro_batches = jax.tree_util.tree_map(lambda x: _split_micro(x, micro), batch)
            grads, stacked = jax.lax.scan(one_micro_batch, zeros, micro_batches, unroll=unroll)
        metrics = _combine(stacked)
        # pg_loss is reported against the full-batch count like the loss itself
        if "pg_loss" in stacked:
            metrics["pg_loss"] = jnp.sum(stacked["pg_loss"][0]) / jnp.maximum(count, 1e-30)
        metrics["loss"] = jnp.sum(stacked["loss"][0]) / jnp.maximum(count, 1e-30) + aux_coef * metrics["router_aux"]
        metrics["tokens"] = jnp.sum(stacked["tokens"][0])
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        rng, _ = jax.random.split(state.rng)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics

    donate_argnums = (0,) if donate else ()
    if mesh is None:
        jitted = jax.jit(update, donate_argnums=donate_argnums)
    else:
        shardings = state_shardings(model_config, optimizer, mesh, rules)
        replicated = NamedSharding(mesh, P())
        jitted = jax.jit(update, in_shardings=(shardings, None, None), out_shardings=(shardings, replicated),
                         donate_argnums=donate_argnums)
    return TrainStep(jitted, mesh, cfg, rules)
