"""Expert-parallel MoE dispatch: each (token, expert) assignment travels to the shard that holds its expert by an
all-to-all over the `expert` mesh axis, runs there in a local `ragged_dot`, and comes back by a second all-to-all.

The alternative, `decoder`'s "sort" dispatch, sorts all `T*k` assignments globally and leaves the partitioning to
GSPMD, which gathers every token onto every expert shard. Here the work is explicit under `jax.shard_map`:

  per shard (tokens `t` of its own, local experts `El = E / n` where `n` = size of the `expert` axis)
    1. sort its `t*k` assignments by expert (so by destination shard, then by local expert);
    2. copy each into a send buffer `[n, C, D]` at row (destination, rank within destination); ranks >= C are
       *dropped* (counted, never silent);
    3. `all_to_all` the buffer (and the local expert id of every row) over `expert`: row block `s` of what arrives
       is what shard `s` sent here;
    4. sort the `n*C` arrived rows by local expert and run gate/up/down as `ragged_dot` over the `El` experts (a
       `mlp` dimension sharded over `tensor` gives partial sums, reduced with `psum`);
    5. `all_to_all` the results back and scatter-add `weight * result` into each assignment's token.

`jax.lax.ragged_all_to_all` would send only the occupied rows, but XLA:CPU cannot run it in jax 0.10.2
("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so the fake-device tests could not check
it; the fixed-size `all_to_all` runs everywhere and is what the tests prove.

Capacity `C` (rows per source -> destination shard pair, `ModelConfig.moe_capacity_factor`):
  * 0 (default), dropless: `C = t * min(k, El)`, the most assignments one shard's tokens can send to one shard
    (a token picks distinct experts), so nothing is ever dropped and the result equals the sort dispatch. Buffers
    are `n * C` rows: up to `n` times the `t*k` rows a balanced router needs.
  * f > 0: `C = min(dropless, ceil(f * t * k / n))`, i.e. f times a perfectly balanced share. Assignments past
    the capacity of their destination (in expert order within each source shard) contribute nothing to their
    token's output; their weighted number is returned as `dropped` (`forward_hidden(..., return_moe_dropped=True)`).

This module knows nothing about attention, caches, checkpoints or the router itself: it receives the routed
assignments (`top_e`, `top_w`) and the expert weights of one layer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trace_jax.models.config import ModelConfig
from trace_jax.models.sharding import Rules, logical_to_mesh_spec

EXPERT_AXIS = "expert"


def _active_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def expert_axis_size(mesh=None) -> int:
    """Size of the `expert` axis of `mesh` (default: the mesh set with `jax.set_mesh`); 1 when there is none."""
    mesh = _active_mesh() if mesh is None else mesh
    return 1 if mesh is None else int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def resolve_dispatch(config: ModelConfig, mesh=None) -> str:
    """"sort" or "all_to_all": the MoE dispatch `config.moe_dispatch` selects under `mesh` (default: the active one).

    "auto" is "all_to_all" when the mesh has an `expert` axis of size n > 1 that divides `num_experts`, else "sort".
    An explicit "all_to_all" without such an axis raises ValueError naming the fix.
    """
    n = expert_axis_size(mesh)
    if config.moe_dispatch == "sort":
        return "sort"
    usable = n > 1 and config.num_experts % n == 0
    if config.moe_dispatch == "auto":
        return "all_to_all" if usable else "sort"
    if not usable:
        raise ValueError(
            f"ModelConfig.moe_dispatch='all_to_all' needs a mesh set with jax.set_mesh(mesh) whose 'expert' axis has "
            f"size > 1 and divides num_experts={config.num_experts}; the active mesh has expert={n}. Set "
            f"moe_dispatch='auto' (falls back to 'sort') or use a mesh like make_mesh({{'expert': ...}})")
    return "all_to_all"


def dispatch_capacity(config: ModelConfig, tokens_per_shard: int, num_shards: int) -> int:
    """Rows `C` each shard reserves for each destination shard (see module doc); dropless when the factor is 0."""
    k = config.num_experts_per_tok
    dropless = tokens_per_shard * min(k, config.num_experts // num_shards)
    if config.moe_capacity_factor == 0:
        return max(dropless, 1)
    balanced = config.moe_capacity_factor * tokens_per_shard * k / num_shards
    return max(1, min(dropless, math.ceil(balanced)))


def _axes_of(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def _token_axes(mesh, rules) -> tuple[str, ...]:
    """Mesh axes the token dimension is split over: the `batch` rule's axes, plus `expert` if they lack it."""
    axes = list(_axes_of(logical_to_mesh_spec(P("batch"), mesh, rules)[0]))
    if EXPERT_AXIS not in axes:
        axes.append(EXPERT_AXIS)
    return tuple(axes)


def _pad_rows(x: jax.Array, multiple: int, value=0) -> jax.Array:
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=value) if pad else x


def token_sharded_top_k(probs: jax.Array, k: int, *, rules: Rules | None = None):
    """`jax.lax.top_k(probs, k)` for probs [T, E], each token shard on its own device.

    GSPMD does not partition XLA's TopK over the token dimension: it all-gathers the [T, E] router probabilities
    onto every device first. Under `shard_map` each shard ranks only its own tokens. Same values and order as
    `jax.lax.top_k`; needs an active mesh with an `expert` axis (as `expert_parallel_mlp`).
    """
    mesh = _active_mesh()
    axes = _token_axes(mesh, rules)
    sizes = dict(mesh.shape)
    T = probs.shape[0]
    spec = P(axes, None)
    top_w, top_e = jax.shard_map(lambda p: tuple(jax.lax.top_k(p, k)), mesh=mesh, in_specs=(spec,),
                                 out_specs=(spec, spec))(_pad_rows(probs, math.prod(sizes[a] for a in axes)))
    return top_w[:T], top_e[:T]


def expert_parallel_mlp(config: ModelConfig, moe: dict, xt: jax.Array, top_e: jax.Array, top_w: jax.Array,
                        token_weight: jax.Array, *, rules: Rules | None = None):
    """Routed experts of one layer with all-to-all dispatch over the active mesh's `expert` axis.

    Args:
      moe: one layer's expert weights: gate_proj, up_proj [E, D, Fe], down_proj [E, Fe, D] (the router is unused).
      xt: [T, D] tokens (compute dtype); top_e: int [T, k] chosen experts; top_w: [T, k] their combine weights
        (compute dtype); token_weight: float32 [T], the weight of each token in the `dropped` count (0 = padding).
      rules: logical sharding rules (default `DEFAULT_RULES`): tokens go over the `batch` mesh axes plus `expert`,
        expert weights over `expert` (experts) and the `mlp` axes; `embed` is gathered inside.

    Returns `(out [T, D], dropped)`: out = sum over each token's kept assignments of weight * expert(x), and
    dropped, a float32 scalar, the token-weighted number of assignments the capacity dropped (0 when dropless).
    """
    mesh = _active_mesh()
    n = expert_axis_size(mesh)
    E, k = config.num_experts, config.num_experts_per_tok
    if mesh is None or n <= 1 or E % n:
        raise ValueError(f"expert_parallel_mlp needs jax.set_mesh(mesh) with an 'expert' axis dividing "
                         f"num_experts={E}; got expert={n}")
    El = E // n
    T, D = xt.shape
    sizes = dict(mesh.shape)

    token_axes = _token_axes(mesh, rules)
    token_shards = math.prod(sizes[a] for a in token_axes)
    weight_spec = logical_to_mesh_spec(P("experts", "embed", "mlp"), mesh, rules,
                                       shape=moe["gate_proj"].shape)
    if _axes_of(weight_spec[0]) != (EXPERT_AXIS,):
        raise ValueError(f"expert-parallel dispatch needs the sharding rule ('experts', 'expert'); the rules map "
                         f"experts to {weight_spec[0]!r}")
    # The hidden dim of the experts is gathered; a sharded mlp dim stays sharded and its partial sums are reduced.
    mlp_axes = tuple(a for a in _axes_of(weight_spec[2]) if a not in token_axes)
    mlp_entry = None if not mlp_axes else mlp_axes[0] if len(mlp_axes) == 1 else mlp_axes
    up_spec = P(EXPERT_AXIS, None, mlp_entry)
    down_spec = P(EXPERT_AXIS, mlp_entry, None)

    # Pad the token count to a multiple of the shard count; padded assignments name expert E (never sent).
    xt, top_w, token_weight = (_pad_rows(a, token_shards) for a in (xt, top_w, token_weight))
    top_e = _pad_rows(top_e, token_shards, value=E)
    t = xt.shape[0] // token_shards
    C = dispatch_capacity(config, t, n)
    cdt = xt.dtype

    def local(x, experts, weights, tok_w, gate_w, up_w, down_w):
        flat_e = experts.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)  # by destination shard, then by local expert; padding last
        e_sorted = flat_e[order]
        token_of = order // k
        dest = e_sorted // El  # n for padding
        per_dest = jnp.bincount(dest, length=n + 1)
        rank = jnp.arange(t * k) - (jnp.cumsum(per_dest) - per_dest)[dest]
        sent = (e_sorted < E) & (rank < C)
        slot = jnp.where(sent, dest * C + rank, n * C)  # n * C is out of bounds: dropped by the scatters below
        send_x = jnp.zeros((n * C, D), cdt).at[slot].set(x[token_of], mode="drop")
        send_e = jnp.full((n * C,), El, jnp.int32).at[slot].set((e_sorted % El).astype(jnp.int32), mode="drop")
        recv_x = jax.lax.all_to_all(send_x.reshape(n, C, D), EXPERT_AXIS, 0, 0).reshape(n * C, D)
        recv_e = jax.lax.all_to_all(send_e.reshape(n, C), EXPERT_AXIS, 0, 0).reshape(n * C)

        local_order = jnp.argsort(recv_e, stable=True)  # empty rows (id El) last, outside every group
        group_sizes = jnp.bincount(recv_e, length=El).astype(jnp.int32)
        xs = recv_x[local_order]
        gate = jax.lax.ragged_dot(xs, gate_w.astype(cdt), group_sizes)
        up = jax.lax.ragged_dot(xs, up_w.astype(cdt), group_sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_w.astype(cdt), group_sizes)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        y = jnp.zeros_like(y).at[local_order].set(y)
        back = jax.lax.all_to_all(y.reshape(n, C, D), EXPERT_AXIS, 0, 0).reshape(n * C, D)

        y_assign = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)
        w_sorted = weights.reshape(-1)[order]
        out = jnp.zeros((t, D), cdt).at[token_of].add(y_assign * w_sorted[:, None])
        dropped = jnp.sum(jnp.where((e_sorted < E) & ~sent, tok_w[token_of], 0.0))
        return out, jax.lax.psum(dropped, token_axes)

    rows = P(token_axes, None)
    out, dropped = jax.shard_map(
        local, mesh=mesh, in_specs=(rows, rows, rows, P(token_axes), up_spec, up_spec, down_spec),
        out_specs=(rows, P()),
    )(xt, top_e.astype(jnp.int32), top_w, token_weight.astype(jnp.float32), moe["gate_proj"], moe["up_proj"],
      moe["down_proj"])
    return out[:T], dropped
