"""GiGPO: group-in-group credit (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training",
arXiv 2505.10978), the third baseline of TRACE's Table 1.

Two levels of relative advantage inside one prompt's group of G trajectories:

    episode level:  A_E(tau_i) = (R_i - mean_j R_j) / std_j R_j          (the GRPO outcome advantage, section 1)
    step level:     steps that start from the same environment state (an *anchor state*) across the group form an
                    anchor group; each step's discounted return is compared inside it:
                        G_k^i = sum_{t >= k} gamma^(t-k) r_t^i = gamma^(T_i - k) * R_i   (sparse reward at the end)
                        A_S(i, k) = (G_k^i - mean_{anchor group} G) / std_{anchor group} G
    combined:       A(i, k) = A_E(tau_i) + omega * A_S(i, k)

Steps here are assistant turns `k = 0 .. T_i` (tool-call turns and the final answer turn `T_i`); step `k` starts
from state `S_k`, whose key is `anchor_keys[i, k]`. The initial state `S_0` (the prompt) is shared by every
trajectory of the group. Two keyings (`CreditConfig.gigpo_anchor`, built by `state_keys`):

    observation (default)  S_k is its *current* observation: the prompt for k = 0, tool response k for k >= 1. Steps
                           that see the same page are one anchor group however they reached it, as the paper's
                           anchor states and verl-agent's `build_step_group` (identical `anchor_obs`) define them.
    history                S_k is the whole observation history `observations[:k]`: steps group only when every
                           earlier observation was the same too (stricter; the previous keying, kept as a variant).
 Keys are compared only within a prompt group (`group_id`), so any integer labelling works
as long as equal states get equal keys. An anchor group of one (a state no other trajectory visited) and a group
whose returns are all equal get step advantage 0 (the same zero-variance guard as the outcome term).

`state_keys` (and `history_state_keys`, `observation_state_keys`) build keys on the host; everything else is
jittable.
Knows nothing about models, tokenizers or tools (observations are plain strings here).
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.credit._checks import check_choice, check_float, check_int, check_rank, check_same_batch, compute_dtype
from trace_jax.credit.config import GIGPO_ANCHORS, GIGPO_STEP_STD_MODES


def history_state_keys(observations: Sequence[str]) -> list[str]:
    """Keys of states `S_0 .. S_T` for one trajectory whose `T` tool calls returned `observations`.

    `S_k` is identified by the observation history `observations[:k]` (so `S_0`, the prompt, has the same key in
    every trajectory of a group). Two trajectories are in the same environment state after the same observations,
    whatever the assistant wrote around its calls. Keys are hex digests of the history.
    """
    digest = hashlib.sha256(b"S0")
    keys = [digest.hexdigest()]
    for observation in observations:
        text = str(observation).encode("utf-8")
        digest.update(len(text).to_bytes(8, "little") + text)  # length prefix: histories cannot collide by splitting
        keys.append(digest.hexdigest())
    return keys


def observation_state_keys(observations: Sequence[str]) -> list[str]:
    """Keys of states `S_0 .. S_T` by their current observation: `S_0` is the prompt (one key, shared by a prompt
    group), `S_k` for `k >= 1` the text of tool response `k` (equal texts, equal keys, whatever came before)."""
    keys = [hashlib.sha256(b"S0").hexdigest()]
    for observation in observations:
        keys.append(hashlib.sha256(b"observation:" + str(observation).encode("utf-8")).hexdigest())
    return keys


def state_keys(observations: Sequence[str], anchor: str = "observation") -> list[str]:
    """Keys of states `S_0 .. S_T` for one trajectory whose tool calls returned `observations`, by
    `CreditConfig.gigpo_anchor`: `"observation"` (`observation_state_keys`) or `"history"`
    (`history_state_keys`)."""
    if anchor == "observation":
        return observation_state_keys(observations)
    if anchor == "history":
        return history_state_keys(observations)
    raise ValueError(f"anchor must be one of {GIGPO_ANCHORS} (CreditConfig.gigpo_anchor), got {anchor!r}")


def anchor_key_ids(keys_per_row: Sequence[Sequence[Hashable]], num_slots: int | None = None) -> np.ndarray:
    """Host helper: hashable state keys per row -> int32 `[N, num_slots]` ids (equal keys, equal ids; -1 padding).

    Args:
      keys_per_row: for each trajectory, the keys of its states `S_0 .. S_{T_i}` (`T_i + 1` of them).
      num_slots: width of the result (default the longest row); must be `>= T_i + 1` for every row.
    """
    width = max((len(k) for k in keys_per_row), default=1) if num_slots is None else num_slots
    out = np.full((len(keys_per_row), max(width, 1)), -1, np.int32)
    ids: dict[Hashable, int] = {}
    for row, keys in enumerate(keys_per_row):
        if len(keys) > width:
            raise ValueError(f"anchor_key_ids: row {row} has {len(keys)} state keys, more than num_slots={width}")
        for col, key in enumerate(keys):
            out[row, col] = ids.setdefault(key, len(ids))
    return out


def gigpo_step_advantages(anchor_keys, num_turns, rewards, group_id, num_groups: int, *, gamma: float = 0.95,
                          step_std: str = "population", eps: float = 1e-6):
    """GiGPO's step-level advantages `A_S [N, T+1]` (see the module docstring).

    Args:
      anchor_keys: `[N, T+1]` int key of state `S_k` for steps `k = 0 .. T_i`; entries past `num_turns` ignored.
      num_turns: `[N]` int tool calls `T_i` in `[0, T]` (so `T_i + 1` steps, the last one the answer turn).
      rewards: `[N]` float final rewards `R_i`.
      group_id: `[N]` int prompt group in `[0, num_groups)`.
      num_groups: static number of groups.
      gamma: discount of the step return `G_k = gamma^(T_i - k) * R_i`.
      step_std: `"population"` divides by the anchor group's std, `"none"` only centres.
      eps: anchor groups whose return std is `<= eps` get 0.

    Returns:
      `[N, T+1]` float32, 0 for `k > T_i`.
    """
    check_rank("anchor_keys", anchor_keys, 2, "[N, T+1] state key per step")
    check_rank("num_turns", num_turns, 1, "[N]")
    check_rank("rewards", rewards, 1, "[N]")
    check_rank("group_id", group_id, 1, "[N]")
    check_int("anchor_keys", anchor_keys)
    check_int("num_turns", num_turns)
    check_int("group_id", group_id)
    check_float("rewards", rewards)
    check_choice("step_std", step_std, GIGPO_STEP_STD_MODES)
    check_same_batch(anchor_keys=anchor_keys, num_turns=num_turns, rewards=rewards, group_id=group_id)
    dtype = compute_dtype(rewards)
    n, slots = anchor_keys.shape
    step = jnp.arange(slots)
    valid = step[None, :] <= num_turns[:, None]
    steps_to_end = jnp.maximum(num_turns[:, None] - step[None, :], 0).astype(dtype)
    returns = jnp.where(valid, jnp.power(jnp.asarray(gamma, dtype), steps_to_end) * rewards.astype(dtype)[:, None],
                        0.0)

    # Anchor groups = equal (prompt group, state key) among real steps. Sort the flat steps by that pair and cut a
    # new segment wherever it changes; padded steps go to a group id past every real one, so they never mix in.
    size = n * slots
    flat_group = jnp.where(valid, group_id[:, None], num_groups).reshape(size).astype(jnp.int32)
    flat_key = jnp.where(valid, anchor_keys, 0).reshape(size).astype(jnp.int32)
    order = jnp.lexsort((flat_key, flat_group))
    sorted_group, sorted_key = flat_group[order], flat_key[order]
    starts = jnp.concatenate([jnp.ones(1, bool), (sorted_group[1:] != sorted_group[:-1])
                              | (sorted_key[1:] != sorted_key[:-1])])
    segment_sorted = jnp.cumsum(starts.astype(jnp.int32)) - 1
    segment = jnp.zeros(size, jnp.int32).at[order].set(segment_sorted)

    weight = valid.reshape(size).astype(dtype)
    flat_returns = returns.reshape(size)
    counts = jax.ops.segment_sum(weight, segment, size)
    sums = jax.ops.segment_sum(flat_returns * weight, segment, size)
    mean = (sums / jnp.maximum(counts, 1.0))[segment]
    centred = flat_returns - mean
    var = (jax.ops.segment_sum(jnp.square(centred) * weight, segment, size) / jnp.maximum(counts, 1.0))[segment]
    if step_std == "none":
        advantage = centred
    else:
        sigma = jnp.sqrt(var)
        advantage = jnp.where(sigma > eps, centred / jnp.where(sigma > eps, sigma, 1.0), 0.0)
    return jnp.where(valid, advantage.reshape(n, slots), 0.0)
