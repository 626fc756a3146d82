"""The optax optimizer of the policy update, built from `OptimizerConfig`: clip -> AdamW with a warmup schedule.

This module knows nothing about models, losses or meshes (weight decay skips leaves whose path names a norm or
a bias, which is a naming convention of the params tree, not knowledge of the model).
"""

from __future__ import annotations

import jax
import optax

from trace_jax.train.config import OptimizerConfig


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """step -> learning rate: linear warmup from 0 to `learning_rate`, then constant, cosine or linear decay."""
    peak, warmup = config.learning_rate, config.warmup_steps
    end = peak * config.end_lr_ratio
    if config.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, config.total_steps - warmup, alpha=config.end_lr_ratio)
    else:
        decay = optax.linear_schedule(peak, end, config.total_steps - warmup)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params):
    """True on the leaves weight decay applies to: everything except norms and biases."""
    def keep(path, _leaf):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any("norm" in n or "bias" in n for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """`clip_by_global_norm(clip_norm)` (when set) followed by AdamW on `make_schedule(config)`."""
    adamw = optax.adamw(make_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=decay_mask)
    if config.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)
