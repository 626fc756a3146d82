"""Logical-axis sharding rules: map the decoder's logical axis names to mesh axes.

Parameters carry logical names (`param_logical_axes`): embed, heads, kv_heads, head_dim, mlp, experts, vocab,
layers, norm; activations and caches use batch, length too. A *rules* sequence maps each logical name to a mesh axis,
a tuple of mesh axes or None (replicated), in the style of Flax/MaxText. `logical_to_sharding` turns a tree of
logical `PartitionSpec`s into `NamedSharding`s for a concrete mesh:

  * mesh axes that the mesh lacks (or that have size 1) are dropped, so one rule set serves every mesh;
  * a mesh axis is used at most once per array (first dimension wins);
  * when `shapes` are given, a dimension whose size is not divisible by its mesh axes is replicated instead
    (e.g. 1 kv head on a tensor axis of 2).

This module knows nothing about Hugging Face names or the decoder math.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.models.config import ModelConfig

Rules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# The train layout. Rows split over data x fsdp x expert; weights split over fsdp x expert on their embed dimension
# (FSDP over every axis that splits the batch, as MaxText's rules do): on an MoE mesh the expert axis holds whole
# experts of the expert weights and a 1/(fsdp x expert) slice of every other weight, instead of repeating
# attention, embeddings and the router on each expert shard. A dense mesh (expert = 1) is unaffected.
DEFAULT_RULES: tuple = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
)

# Every logical axis name a rule set maps (the names of `DEFAULT_RULES`, in its order).
LOGICAL_AXES: tuple[str, ...] = tuple(name for name, _ in DEFAULT_RULES)


def _rule_axes(name: str, axes):
    """One rule's mesh axes, normalised (a list -> a tuple, as gin may give it); raises ValueError naming the entry."""
    if axes is None or (isinstance(axes, str) and axes in MESH_AXES):
        return axes
    if isinstance(axes, (tuple, list)) and axes and all(isinstance(a, str) and a in MESH_AXES for a in axes) \
            and len(set(axes)) == len(axes):
        return tuple(axes)
    raise ValueError(f"rule ({name!r}, {axes!r}): the mesh axes must be one of {MESH_AXES}, a tuple of distinct ones "
                     "or None (replicated)")


def check_rule_overrides(overrides: Rules, names: Sequence[str] = LOGICAL_AXES) -> tuple:
    """`overrides` checked and normalised: a tuple of `(logical axis, mesh axes)` pairs, each a logical name of
    `names` (default `LOGICAL_AXES`) and a mesh axis, a tuple of distinct mesh axes (a list becomes a tuple, as gin
    may give it) or None. Raises ValueError naming the bad entry and the accepted names (an unknown logical or mesh
    axis, a malformed entry, a logical axis given twice)."""
    checked: dict[str, object] = {}
    for entry in overrides:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], str):
            raise ValueError(f"rule {entry!r}: expected a pair (logical axis, mesh axes), e.g. ('embed', 'fsdp')")
        name, axes = entry
        if name not in names:
            raise ValueError(f"rule ({name!r}, {axes!r}): unknown logical axis {name!r}; the logical axes are "
                             f"{', '.join(names)}")
        if name in checked:
            raise ValueError(f"rule ({name!r}, {axes!r}): logical axis {name!r} is given twice; keep one rule for it")
        checked[name] = _rule_axes(name, axes)
    return tuple(checked.items())


def merge_rules(overrides: Rules = (), base: Rules = DEFAULT_RULES) -> tuple:
    """`base` with the logical axes named in `overrides` mapped as the overrides say, in `base`'s order
    (`overrides` checked by `check_rule_overrides` against `base`'s names). `merge_rules(())` is `base`."""
    merged = dict(base)
    merged.update(check_rule_overrides(overrides, tuple(merged)))
    return tuple(merged.items())


def rollout_rules(train_rules: Rules = DEFAULT_RULES) -> tuple:
    """The rollout layout (sampler, agent loop, evaluation) derived from a train layout: weights are not split over
    the batch axes (a decode step would all-gather every FSDP-sharded weight), so `embed` is replicated; heads /
    mlp / vocab / experts and the rows and KV-cache rows keep the train rules' mesh axes."""
    return tuple((name, None if name == "embed" else axes) for name, axes in train_rules)


ROLLOUT_RULES: tuple = rollout_rules(DEFAULT_RULES)


def _mesh_axes_for(name, rules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    raise KeyError(f"logical axis {name!r} has no sharding rule; add ({name!r}, <mesh axis or None>) to the rules")


def logical_to_mesh_spec(logical: P, mesh: Mesh, rules: Rules | None = None, shape=None) -> P:
    """One logical `PartitionSpec` -> a mesh `PartitionSpec` for `mesh` (see module doc for the fallbacks)."""
    rules = DEFAULT_RULES if rules is None else rules
    sizes = dict(mesh.shape)
    used: set[str] = set()
    out = []
    for dim, name in enumerate(logical):
        axes = [a for a in _mesh_axes_for(name, rules) if sizes.get(a, 1) > 1 and a not in used]
        if shape is not None and axes:
            total = 1
            for a in axes:
                total *= sizes[a]
            if shape[dim] % total:
                axes = []
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*out)


def logical_to_sharding(axes_tree, mesh: Mesh, rules: Rules | None = None, *, shapes=None):
    """A tree of logical `PartitionSpec`s -> the same tree of `NamedSharding`s on `mesh`.

    `shapes`: optional matching tree of shape tuples (or arrays / ShapeDtypeStructs) enabling the
    divisibility fallback.
    """
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    if shapes is None:
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, logical_to_mesh_spec(s, mesh, rules)),
                                      axes_tree, is_leaf=is_spec)
    shape_leaves = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple) or hasattr(x, "shape"))
    spec_leaves, treedef = jax.tree_util.tree_flatten(axes_tree, is_leaf=is_spec)
    if len(shape_leaves) != len(spec_leaves):
        raise ValueError(f"axes tree has {len(spec_leaves)} leaves but shapes tree has {len(shape_leaves)}")
    out = [NamedSharding(mesh, logical_to_mesh_spec(s, mesh, rules, getattr(sh, "shape", sh)))
           for s, sh in zip(spec_leaves, shape_leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def constrain(x: jax.Array, logical: tuple, rules: Rules | None = None) -> jax.Array:
    """Sharding constraint on an activation by logical names, under the mesh set with `jax.set_mesh(mesh)`.

    A no-op when no mesh is set (single device, or callers that shard only the inputs and let XLA propagate).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_mesh_spec(P(*logical), mesh, rules, shape=x.shape)
    return jax.lax.with_sharding_constraint(x, spec)


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Rules | None = None):
    """`NamedSharding` for every parameter of `config` on `mesh`."""
    from trace_jax.models.decoder import param_logical_axes, param_shapes

    return logical_to_sharding(param_logical_axes(config), mesh, rules, shapes=param_shapes(config))


def shard_params(params, config: ModelConfig, mesh: Mesh, rules: Rules | None = None):
    """Place an existing params tree on `mesh` according to the rules."""
    return jax.device_put(params, param_shardings(config, mesh, rules))


def reshard_program(shardings):
    """The program that moves a params tree on device to the layout `shardings` (a matching pytree of
    `NamedSharding`s): `program(tree) -> tree` with `out_shardings=shardings`, the collectives the compiler picks
    (all-gathers from the train layout to the rollout layout), never through host memory. Nothing is donated: the
    train state keeps its params. One program object per target layout: the loop (`in_layout`, the policy's train
    -> rollout reshard) and `trace-jax plan` call the same one."""
    leaves, treedef = jax.tree_util.tree_flatten(shardings)
    if not all(isinstance(s, NamedSharding) for s in leaves):
        raise TypeError("reshard_program takes a pytree of NamedShardings (e.g. models.param_shardings(config, "
                        f"mesh, ROLLOUT_RULES)); got leaves of types {sorted({type(s).__name__ for s in leaves})}")
    return _reshard_jit(treedef, tuple(leaves))


def in_layout(tree, shardings):
    """`tree` (arrays on a mesh) in the layout `shardings` (a matching pytree of `NamedSharding`s on the same mesh),
    moved on device, never through host memory: one `reshard_program` of the leaves not already in their layout;
    nothing runs when every leaf is. A collective over the mesh (with several processes, every one calls it)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    moving = [i for i, (x, t) in enumerate(zip(leaves, targets))
              if not (isinstance(x.sharding, NamedSharding) and x.sharding.is_equivalent_to(t, x.ndim))]
    if moving:
        moved = reshard_program([targets[i] for i in moving])([leaves[i] for i in moving])
        for i, x in zip(moving, moved):
            leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


class PlacementProgram:
    """A jitted program that places a params tree (`reshard_program`, `cast_program`): `program(tree)`, and
    `program.lower(tree)` for ahead-of-time compilation; `jitted` is the jitted function. Its `out_shardings` name
    the devices, so it needs no mesh context."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, tree):
        return self.jitted(tree)

    def lower(self, tree):
        return self.jitted.lower(tree)


def _reshard(tree):
    return tree


@functools.lru_cache(maxsize=64)
def _reshard_jit(treedef, leaves: tuple):
    return PlacementProgram(jax.jit(_reshard, out_shardings=jax.tree_util.tree_unflatten(treedef, list(leaves))))


def cast_program(dtype, shardings):
    """The program that casts a params tree to `dtype` on device, into fresh buffers in the layout `shardings` (a
    matching pytree of `NamedSharding`s): `program(tree) -> tree`. Nothing is donated (a cast copy never aliases
    the arrays it was made from, which the update donates). One program object per (dtype, layout): the loop's
    rollout copy and frozen reference (`loop.Placement`) and `trace-jax plan` call the same one."""
    leaves, treedef = jax.tree_util.tree_flatten(shardings)
    if not all(isinstance(s, NamedSharding) for s in leaves):
        raise TypeError("cast_program takes a pytree of NamedShardings (e.g. models.param_shardings(config, mesh, "
                        f"rules)); got leaves of types {sorted({type(s).__name__ for s in leaves})}")
    import jax.numpy as jnp

    return _cast_jit(jnp.dtype(dtype), treedef, tuple(leaves))


@functools.lru_cache(maxsize=64)
def _cast_jit(dtype, treedef, leaves: tuple):
    def cast(tree):
        return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)

    return PlacementProgram(jax.jit(cast, out_shardings=jax.tree_util.tree_unflatten(treedef, list(leaves))))


def placed_on(tree, mesh: Mesh) -> bool:
    """Whether every array of `tree` is already placed on `mesh` (a `NamedSharding` over its devices), so a program
    on `mesh` can read it as it is (e.g. the frozen reference in its own layout) instead of re-placing it."""
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(
        isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
        and x.sharding.mesh.devices.shape == mesh.devices.shape
        and (x.sharding.mesh.devices == mesh.devices).all() for x in leaves)


def cache_logical_axes() -> dict:
    """Logical axes of a `KVCache` (k, v: [layers, batch, length, kv_heads, head_dim]; lengths: [batch])."""
    kv = P("layers", "batch", "length", "kv_heads", "head_dim")
    return {"k": kv, "v": kv, "lengths": P("batch")}


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
    """A mesh with named axes, e.g. `make_mesh({"data": 2, "fsdp": 2, "tensor": 2})` over 8 devices."""
    import numpy as np

    devices = jax.devices() if devices is None else devices
    n = 1
    for v in shape.values():
        n *= v
    if n != len(devices):
        raise ValueError(f"mesh shape {shape} needs {n} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(tuple(shape.values())), tuple(shape))
