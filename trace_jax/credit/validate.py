"""Host-side validation of credit inputs: the checks that need concrete values.

Jitted credit functions only check shapes and dtypes. Before a batch goes in, host code (the CLI, the trainer,
research scripts) can call these to reject bad input with a `ValueError` that names the argument, the offending
rows and the fix. Each returns nothing and raises on the first problem.
"""

from __future__ import annotations

import numpy as np

POSITIVE_TOLERANCE = 1e-4  # mean log-probs above this are not rounding noise


def _array(name, x, rank=None):
    try:
        arr = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - anything unconvertible is a user error
        raise ValueError(f"{name}: cannot be read as an array ({exc})") from exc
    if rank is not None and arr.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {arr.shape}")
    return arr


def _rows(mask, limit=5):
    rows = np.nonzero(mask)[0]
    shown = ", ".join(str(r) for r in rows[:limit])
    return shown + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")


def validate_rewards(rewards, group_id=None):
    """Rewards `[N]` (or `[..., G]` without `group_id`) must be finite and non-empty; group ids in `[0, N)`."""
    rewards = _array("rewards", rewards)
    if rewards.size == 0 or (rewards.ndim >= 1 and rewards.shape[-1] == 0):
        raise ValueError(f"rewards{rewards.shape}: empty group; every prompt needs at least one trajectory")
    if not np.issubdtype(rewards.dtype, np.number):
        raise ValueError(f"rewards: expected numbers, got dtype {rewards.dtype}")
    bad = ~np.isfinite(rewards.astype(np.float64))
    if bad.any():
        raise ValueError(f"rewards: {int(bad.sum())} non-finite value(s) (NaN or inf); fix the verifier output")
    if group_id is not None:
        group_id = _array("group_id", group_id, rank=1)
        if rewards.ndim != 1 or group_id.shape != rewards.shape:
            raise ValueError(f"group_id{group_id.shape} must match rewards{rewards.shape} (both [N])")
        if not np.issubdtype(group_id.dtype, np.integer):
            raise ValueError(f"group_id: expected integers, got dtype {group_id.dtype}")
        if group_id.size and (group_id.min() < 0 or group_id.max() >= rewards.shape[0]):
            raise ValueError(f"group_id must lie in [0, N={rewards.shape[0]}); got range "
                             f"[{group_id.min()}, {group_id.max()}]; renumber groups 0..num_groups-1")


def validate_num_turns(num_turns, num_slots: int, name: str = "num_turns", n: int | None = None):
    """`num_turns [N]` integers within `[0, num_slots]`."""
    num_turns = _array(name, num_turns, rank=1)
    if not np.issubdtype(num_turns.dtype, np.integer):
        raise ValueError(f"{name}: expected integers, got dtype {num_turns.dtype}")
    if n is not None and num_turns.shape[0] != n:
        raise ValueError(f"{name}{num_turns.shape} does not match the batch size N={n}")
    bad = (num_turns < 0) | (num_turns > num_slots)
    if bad.any():
        raise ValueError(f"{name} must lie in [0, {num_slots}] (the padded turn axis); rows {_rows(bad)} have "
                         f"{num_turns[bad][:5].tolist()}; pad the arrays to more turns or fix the counts")
    return num_turns


def validate_trace_inputs(answer_scores, num_turns, outcome_adv=None):
    """Gold-answer scores `[N, T+1]` and turn counts `[N]` for TRACE.

    Raises if shapes disagree, `num_turns` is outside `[0, T]`, a real state's score is NaN or positive (beyond
    rounding), or `outcome_adv` is not finite. `-inf` scores are allowed (an impossible answer; see
    `trace_jax.credit.trace`). Padded states (beyond `num_turns`) may hold anything.
    """
    scores = _array("answer_scores", answer_scores, rank=2).astype(np.float64)
    if scores.shape[1] < 1:
        raise ValueError(f"answer_scores{scores.shape}: needs at least one state per trajectory")
    turns = validate_num_turns(num_turns, scores.shape[1] - 1, n=scores.shape[0])
    real = np.arange(scores.shape[1])[None, :] <= turns[:, None]
    nan = np.isnan(scores) & real
    if nan.any():
        raise ValueError(f"answer_scores: NaN in real states of rows {_rows(nan.any(axis=1))}; the reference "
                         "scorer produced NaN (check the answer tokens and the model dtype)")
    positive = (scores > POSITIVE_TOLERANCE) & real
    if positive.any():
        raise ValueError(f"answer_scores must be mean log-probs (<= 0); rows {_rows(positive.any(axis=1))} hold "
                         f"positive values such as {scores[positive][:3].tolist()}; pass log-probs, not probs "
                         "or losses")
    if outcome_adv is not None:
        adv = _array("outcome_adv", outcome_adv, rank=1).astype(np.float64)
        if adv.shape[0] != scores.shape[0]:
            raise ValueError(f"outcome_adv{adv.shape} does not match answer_scores{scores.shape} on N")
        if not np.isfinite(adv).all():
            raise ValueError("outcome_adv: non-finite values; check the rewards")


def validate_token_layout(turn_index, loss_mask, num_turns):
    """Token layout `[N, L]`: turn indices in `[-1, T_g]`, trained tokens only inside assistant turns."""
    turn_index = _array("turn_index", turn_index, rank=2)
    loss_mask = _array("loss_mask", loss_mask, rank=2)
    if turn_index.shape != loss_mask.shape:
        raise ValueError(f"turn_index{turn_index.shape} and loss_mask{loss_mask.shape} must have the same shape")
    if not np.issubdtype(turn_index.dtype, np.integer):
        raise ValueError(f"turn_index: expected integers, got dtype {turn_index.dtype}")
    turns = _array("num_turns", num_turns, rank=1)
    if turns.shape[0] != turn_index.shape[0]:
        raise ValueError(f"num_turns{turns.shape} does not match turn_index{turn_index.shape} on N")
    beyond = (turn_index > turns[:, None]) | (turn_index < -1)
    if beyond.any():
        raise ValueError(f"turn_index must lie in [-1, num_turns] (num_turns = the final-answer turn); rows "
                         f"{_rows(beyond.any(axis=1))} violate it")
    orphan = (loss_mask != 0) & (turn_index < 0)
    if orphan.any():
        raise ValueError(f"loss_mask marks tokens with turn_index -1 in rows {_rows(orphan.any(axis=1))}; every "
                         "trained token must belong to an assistant turn")


def validate_abc_inputs(step_rewards, num_steps):
    """Step rewards `[N, S]` finite on real steps, `num_steps [N]` in `[0, S]`."""
    rewards = _array("step_rewards", step_rewards, rank=2).astype(np.float64)
    steps = validate_num_turns(num_steps, rewards.shape[1], name="num_steps", n=rewards.shape[0])
    real = np.arange(rewards.shape[1])[None, :] < steps[:, None]
    bad = ~np.isfinite(rewards) & real
    if bad.any():
        raise ValueError(f"step_rewards: non-finite values in real steps of rows {_rows(bad.any(axis=1))}")


def validate_anchor_keys(anchor_keys, num_turns):
    """GiGPO anchor keys `[N, T+1]`: integers, one per state `S_0..S_{T_g}` of every trajectory."""
    keys = _array("anchor_keys", anchor_keys, rank=2)
    if not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"anchor_keys: expected integer state keys, got dtype {keys.dtype}; map hashable keys to "
                         "ints with trace_jax.credit.gigpo.anchor_key_ids")
    validate_num_turns(num_turns, keys.shape[1] - 1, n=keys.shape[0])
