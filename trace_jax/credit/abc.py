"""ABC: answer-backtracked credit (credit-spec section 3).

Each step of a trajectory (reasoning + tool call + tool response; the last step includes the answer) is judged
against a clue set recovered backwards from the verified answer. This module turns those judgements into step
rewards, SFT weights (ABC-SFT) and group-normalised, backward-accumulated advantages (ABC-GRPO). The judging itself
(matching a step's text against clues) is host code elsewhere; here everything is counts and arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.credit._checks import check_choice, check_float, check_int, check_rank, check_same_batch, compute_dtype
from trace_jax.credit.outcome import group_moments
from trace_jax.credit.trace import discount_matrix

from trace_jax.credit.config import ABC_NORMALIZE_MODES as NORMALIZE_MODES


def abc_step_rewards(n_found, n_excluded, n_rejected, answer_outcome, tool_error=None, *, base: float = 1.0,
                     w_found: float = 0.8, w_excluded: float = 0.4, w_rejected: float = 0.8, w_answer: float = 1.0,
                     w_error: float = 1.0, low: float = 0.0, high: float = 2.0):
    """Step score against the clue set.

        r_t = clip(base + w_found*n_found + w_excluded*n_excluded - w_rejected*n_rejected + w_answer*ans
                   - w_error*tool_error, low, high)
            = clip(1.0 + 0.8*n_found + 0.4*n_excluded - 0.8*n_rejected + 1.0*ans - 1.0*tool_error, 0, 2)

    `tool_error` (ours, credit-spec section 3) marks a step whose tool call failed: a scorer leaves its other counts
    0, so on its own it scores the floor `r = 0`; folded with the answer turn, the answer's +-1 still counts.

    Args (all the same shape, e.g. `[..., G, T]`; counts may exceed 1):
      n_found: correct clues discovered or verified in the step.
      n_excluded: wrong candidates correctly ruled out.
      n_rejected: correct clues wrongly rejected.
      answer_outcome: +1 correct final answer in this step, -1 wrong (or no answer at the end: the scorer's
        `no_answer`), 0 none.
      tool_error: 1 where the step's tool call failed (scored at the floor), else 0; None = no step failed.

    Returns:
      float32 step rewards of the same shape.
    """
    arrays = [jnp.asarray(a) for a in (n_found, n_excluded, n_rejected, answer_outcome)]
    if tool_error is not None:
        arrays.append(jnp.asarray(tool_error))
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"n_found, n_excluded, n_rejected, answer_outcome (and tool_error) must share one shape, "
                         f"got {shapes}")
    dtype = compute_dtype(*arrays)
    n_found, n_excluded, n_rejected, answer_outcome, *error = (a.astype(dtype) for a in arrays)
    raw = base + w_found * n_found + w_excluded * n_excluded - w_rejected * n_rejected + w_answer * answer_outcome
    if error:
        raw = raw - w_error * error[0]
    return jnp.clip(raw, low, high)


def abc_sft_weights(step_rewards, *, scale: float = 2.0, sharpness: float = 2.0, neutral: float = 1.0):
    """ABC-SFT per-step loss weight `w_t = 2 * sigmoid(2 * (r_t - 1))`.

    Range 0.238..1.762 for `r` in [0, 2]; a neutral step (`r = 1`) keeps weight 1.
    Checks: `w(0)=0.2384, w(0.6)=0.6201, w(1)=1, w(1.4)=1.3799, w(2)=1.7616`.

    Args:
      step_rewards: any shape, float.

    Returns:
      float32 weights of the same shape.
    """
    check_float("step_rewards", step_rewards)
    rewards = step_rewards.astype(compute_dtype(step_rewards))
    return scale * jax.nn.sigmoid(sharpness * (rewards - neutral))


def fold_answer_steps(n_found, n_excluded, n_rejected, answer_outcome, num_steps, num_turns):
    """Fold each trajectory's final answer turn into its last tool step (credit-spec section 3: a step is
    reasoning + tool call + tool response, and "the last step includes the answer").

    A scorer returns one count record per generated turn: the `T_g` tool turns, then (when the episode got one) the
    final turn. For a row whose steps are exactly those (`num_steps == num_turns + 1`) and that made a tool call
    (`num_turns >= 1`), the final turn's counts are added to step `T_g - 1` (so its `ans` lands there) and the row
    keeps `T_g` steps. Rows without a final turn and rows with `T_g = 0` (the answer is the only step) are
    unchanged. `step_values_to_tokens` then gives the answer turn's tokens the last step's value.

    Args:
      n_found, n_excluded, n_rejected, answer_outcome: `[N, S]` counts per step (zero past `num_steps`).
      num_steps: `[N]` int steps per row in `[0, S]`.
      num_turns: `[N]` int tool calls `T_g` per row.

    Returns:
      `(n_found, n_excluded, n_rejected, answer_outcome, num_steps)`, the counts `[N, S]` (zero past the new
      `num_steps`) and `num_steps [N]`.
    """
    arrays = [jnp.asarray(a) for a in (n_found, n_excluded, n_rejected, answer_outcome)]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 2:
        raise ValueError(f"n_found, n_excluded, n_rejected and answer_outcome must share one [N, S] shape, got "
                         f"{[a.shape for a in arrays]}")
    num_steps, num_turns = jnp.asarray(num_steps), jnp.asarray(num_turns)
    check_int("num_steps", num_steps)
    check_int("num_turns", num_turns)
    check_same_batch(counts=arrays[0], num_steps=num_steps, num_turns=num_turns)
    fold = (num_steps == num_turns + 1) & (num_turns >= 1)
    column = jnp.arange(arrays[0].shape[1])[None, :]
    last = column == (num_steps - 1)[:, None]
    previous = column == (num_steps - 2)[:, None]
    out = []
    for a in arrays:
        answer_step = jnp.sum(jnp.where(last, a, 0), axis=1, keepdims=True)
        a = jnp.where(fold[:, None] & previous, a + answer_step, a)
        out.append(jnp.where(fold[:, None] & last, 0, a))
    return (*out, jnp.where(fold, num_steps - 1, num_steps))


_BLOCK = 16


def _backward_accumulate(values, gamma: float):
    """`A_t = values_t + gamma * A_{t+1}` along the last axis of `[N, T]` (values already 0 past the end).

    Blocks of 16 steps: a small matrix product inside each block, then the block-start values are themselves
    accumulated with `gamma^16` and carried back into the blocks. Same result as the full `[T, T]` product with a
    quarter of the work at T = 64.
    """
    n, size = values.shape
    if size <= _BLOCK:
        return jnp.einsum("tu,nu->nt", discount_matrix(size, gamma, values.dtype), values)
    num_blocks = -(-size // _BLOCK)
    padded = jnp.pad(values, ((0, 0), (0, num_blocks * _BLOCK - size))).reshape(n, num_blocks, _BLOCK)
    local = jnp.einsum("tu,nbu->nbt", discount_matrix(_BLOCK, gamma, values.dtype), padded)
    block_gamma = jnp.power(jnp.asarray(gamma, values.dtype), _BLOCK)
    starts = jnp.einsum("bc,nc->nb", discount_matrix(num_blocks, block_gamma, values.dtype), local[:, :, 0])
    following = jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))  # accumulated value at the start of the next block
    tail = jnp.power(jnp.asarray(gamma, values.dtype), jnp.arange(_BLOCK, 0, -1).astype(values.dtype))
    full = local + tail[None, None, :] * following[:, :, None]
    return full.reshape(n, num_blocks * _BLOCK)[:, :size]


def grouped_abc_grpo_advantages(step_rewards, num_steps, group_id, num_groups: int, *, gamma: float = 0.25,
                                normalize: str = "joint", eps: float = 1e-6):
    """ABC-GRPO step advantages for a flat batch with a group id per trajectory.

        R_hat = (r - mean) / (std + eps)      joint: mean/std (population) over all real steps of the group;
                                              per_step: over step index t across the group's trajectories;
                                              R_hat = 0 where std <= eps (zero-variance guard, as in GRPO)
        A_t = R_hat_t + gamma * A_{t+1}       accumulated backwards within each trajectory

    Args:
      step_rewards: `[N, T]` float step rewards (`abc_step_rewards`); entries `t >= num_steps` ignored.
      num_steps: `[N]` int in `[0, T]`.
      group_id: `[N]` int in `[0, num_groups)`.
      num_groups: static number of groups.
      gamma: backward accumulation factor.
      normalize: `"joint"` (default) or `"per_step"`.
      eps: added to the std.

    Returns:
      `[N, T]` float32 advantages, 0 for `t >= num_steps`.
    """
    check_rank("step_rewards", step_rewards, 2, "[N, T]")
    check_rank("num_steps", num_steps, 1, "[N]")
    check_rank("group_id", group_id, 1, "[N]")
    check_float("step_rewards", step_rewards)
    check_int("num_steps", num_steps)
    check_int("group_id", group_id)
    check_choice("normalize", normalize, NORMALIZE_MODES)
    check_same_batch(step_rewards=step_rewards, num_steps=num_steps, group_id=group_id)
    rewards, valid = _real_steps(step_rewards, num_steps)
    mean, var, _ = group_moments(rewards, valid.astype(rewards.dtype), group_id, num_groups,
                                 per_column=normalize == "per_step")
    return _normalise_and_accumulate(rewards, valid, mean, var, gamma, eps)


def _real_steps(step_rewards, num_steps):
    """Rewards in the compute dtype with padded steps zeroed, and the `[..., T]` mask of real steps."""
    valid = jnp.arange(step_rewards.shape[-1]) < num_steps[..., None]
    return jnp.where(valid, step_rewards.astype(compute_dtype(step_rewards)), 0.0), valid


def _normalise_and_accumulate(rewards, valid, mean, var, gamma, eps):
    # Zero-variance guard, as for GRPO's outcome term: a group (or step column) whose rewards are all equal has
    # std 0, and (r - mean) / (0 + eps) would turn float rounding of the mean into advantages of order 0.1-1.
    std = jnp.sqrt(var)
    normalised = jnp.where(valid & (std > eps), (rewards - mean) / (std + eps), 0.0)
    flat = normalised.reshape(-1, normalised.shape[-1])
    return jnp.where(valid, _backward_accumulate(flat, gamma).reshape(normalised.shape), 0.0)


def abc_grpo_advantages(step_rewards, num_steps, *, gamma: float = 0.25, normalize: str = "joint",
                        eps: float = 1e-6):
    """ABC-GRPO step advantages with the group on the second-to-last axis.

    Args:
      step_rewards: `[..., G, T]` float step rewards.
      num_steps: `[..., G]` int steps per trajectory in `[0, T]`.
      gamma, normalize, eps: see `grouped_abc_grpo_advantages`.

    Returns:
      `[..., G, T]` float32 advantages.

    Check (joint): steps `{[1.8, 1.0, 2.0], [1.0, 0.2, 0.0]}` give
    `[[1.1665, 0.3381, 1.3525], [-0.355, -1.4201, -1.3525]]`.
    """
    check_rank("step_rewards", step_rewards, tuple(range(2, 8)), "[..., G, T]")
    if num_steps.shape != step_rewards.shape[:-1]:
        raise ValueError(f"num_steps{num_steps.shape} must equal step_rewards{step_rewards.shape} without its "
                         "last axis ([..., G])")
    group_size = step_rewards.shape[-2]
    if group_size == 0:
        raise ValueError(f"step_rewards{step_rewards.shape}: empty group (G = 0)")
    check_float("step_rewards", step_rewards)
    check_int("num_steps", num_steps)
    check_choice("normalize", normalize, NORMALIZE_MODES)
    # Contiguous groups: dense reductions over the group axes, much faster on CPU than segment sums.
    rewards, valid = _real_steps(step_rewards, num_steps)
    weights = valid.astype(rewards.dtype)
    axes = (-2,) if normalize == "per_step" else (-2, -1)
    counts = jnp.maximum(jnp.sum(weights, axis=axes, keepdims=True), 1.0)
    mean = jnp.sum(rewards, axis=axes, keepdims=True) / counts
    var = jnp.sum(jnp.where(valid, jnp.square(rewards - mean), 0.0), axis=axes, keepdims=True) / counts
    return _normalise_and_accumulate(rewards, valid, mean, var, gamma, eps)
