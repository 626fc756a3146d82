"""`TrainState` (step, params, optimizer state, RNG key) and its shardings derived from the logical-axis rules.

Optimizer-state leaves that mirror a parameter (Adam's moments) take that parameter's sharding, so FSDP, tensor
and expert parallelism shard the optimizer state exactly like the weights; scalars (counts) are replicated.

This module knows nothing about losses, batches or checkpoint files.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models


@struct.dataclass
class TrainState:
    """Everything a training step updates and a checkpoint restores.

    step: int32 []; params: the policy's float32 master weights (params pytree); opt_state: the optax state;
    rng: uint32 [2] raw PRNG key, split once per step.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def _path_key(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _mirror_param_shardings(tree, params, param_shardings, replicated):
    """A sharding for each leaf of `tree`: the parameter's whose path is a suffix of the leaf's path and whose
    shape matches, else `replicated`."""
    by_path = {}
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                      jax.tree_util.tree_leaves(param_shardings)):
        by_path[_path_key(path)] = (tuple(leaf.shape), sharding)

    def pick(path, leaf):
        key = _path_key(path)
        for start in range(len(key)):
            hit = by_path.get(key[start:])
            if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def state_shardings(model_config, optimizer: optax.GradientTransformation, mesh: Mesh, rules=None) -> TrainState:
    """A `TrainState` whose leaves are the `NamedSharding`s of the real state on `mesh` under `rules`."""
    shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0)))
    params_sh = models.param_shardings(model_config, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt_shapes = jax.eval_shape(optimizer.init, shapes)
    return TrainState(step=replicated, params=params_sh,
                      opt_state=_mirror_param_shardings(opt_shapes, shapes, params_sh, replicated),
                      rng=replicated)


def init_train_state(model_config, optimizer: optax.GradientTransformation, params, rng, *, mesh: Mesh | None = None,
                     rules=None) -> TrainState:
    """A fresh `TrainState` at step 0 from `params` (copied: the train step donates its state, and the caller's
    arrays, e.g. the frozen reference, must stay valid) and `rng` (a raw uint32 [2] key, e.g. `PRNGKey(seed)`).

    With `mesh`, every leaf is placed with `state_shardings`; the master weights are cast to float32.
    """
    rng = jnp.asarray(rng)
    if rng.dtype != jnp.uint32 or rng.shape != (2,):
        raise ValueError(f"rng must be a raw uint32[2] key such as jax.random.PRNGKey(seed), got "
                         f"{rng.dtype}{list(rng.shape)}")

    def build(p, key):
        p = jax.tree_util.tree_map(lambda x: jnp.array(x, dtype=jnp.float32, copy=True), p)
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p), rng=key)

    out_shardings = None if mesh is None else state_shardings(model_config, optimizer, mesh, rules)
    return jax.jit(build, out_shardings=out_shardings)(params, rng)


def copy_params(params):
    """A copy of a params tree with fresh buffers (e.g. the frozen reference taken from the initial policy)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
