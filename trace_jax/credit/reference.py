"""Straightforward float64 numpy loops that restate credit-spec.md (and GiGPO's paper) line by line.

They are the reference that tests compare the jitted functions against on random inputs, and the baseline of
`benchmarks/credit_bench.py`. Slow on purpose: one Python iteration per trajectory, turn and window element.
"""

from __future__ import annotations

import math

import numpy as np


def outcome_advantages_ref(rewards, std="population", eps=1e-6):
    """rewards `[G]` -> `[G]`."""
    rewards = [float(r) for r in rewards]
    g = len(rewards)
    mu = sum(rewards) / g
    centred = [r - mu for r in rewards]
    if std == "none":
        return np.array(centred)
    ddof = 1 if std == "sample" else 0
    if g - ddof <= 0:
        return np.zeros(g)
    sigma = math.sqrt(sum(c * c for c in centred) / (g - ddof))
    return np.array([c / sigma if sigma > eps else 0.0 for c in centred])


def td_deltas_ref(scores, num_turns, form="log_ratio", eps=0.1, min_score=-1e4):
    """scores `[>= T_g + 1]` of one trajectory -> `[T_g]`."""
    l = [min(max(float(s), min_score), 0.0) for s in scores[: num_turns + 1]]
    out = []
    for k in range(num_turns):
        d_k, d_next = -l[k] + eps, -l[k + 1] + eps
        if form == "log_ratio":
            out.append(math.log(d_k / d_next))
        elif form == "linear_gap":
            out.append((l[k + 1] - l[k]) / d_k)
        else:
            out.append(l[k + 1] - l[k])
    return np.array(out)


def trace_values_ref(scores, num_turns, eps=0.1, min_score=-1e4):
    l = [min(max(float(s), min_score), 0.0) for s in scores[: num_turns + 1]]
    return np.array([math.log((-l[0] + eps) / (-lk + eps)) for lk in l])


def lookahead_credit_ref(deltas, num_turns, outcome_adv, horizon=3, gamma=0.8, terminal_fill=2.0):
    """deltas `[>= T_g]` of one trajectory -> `r [T_g]`."""
    t = num_turns
    out = []
    for k in range(t):
        if horizon >= 1:
            h = min(k + horizon - 1, t - 1)
            num = sum(gamma ** (u - k) * float(deltas[u]) for u in range(k, h + 1))
            den = sum(gamma ** (u - k) for u in range(k, h + 1))
            c = num / den
        else:
            h, c = k, 0.0
        fill = terminal_fill * gamma ** (t - k) * float(outcome_adv) if h == t - 1 else 0.0
        out.append(c + fill)
    return np.array(out)


def token_advantages_ref(turn_index, loss_mask, turn_credit, outcome_adv, num_turns, alpha_out=1.0, alpha_turn=0.2):
    """One trajectory: turn_index `[L]`, loss_mask `[L]`, turn_credit `[>= T_g]` -> `[L]`."""
    out = np.zeros(len(turn_index))
    for j, (k, m) in enumerate(zip(turn_index, loss_mask)):
        if not m or k < 0 or k > num_turns:
            continue
        out[j] = alpha_out * outcome_adv + (alpha_turn * turn_credit[k] if k < num_turns else 0.0)
    return out


def abc_step_reward_ref(n_found, n_excluded, n_rejected, ans):
    return min(max(1.0 + 0.8 * n_found + 0.4 * n_excluded - 0.8 * n_rejected + 1.0 * ans, 0.0), 2.0)


def abc_grpo_advantages_ref(step_rewards, num_steps, gamma=0.25, normalize="joint", eps=1e-6):
    """One group: step_rewards `[G][S]`, num_steps `[G]` -> list of `[num_steps[g]]` arrays."""
    g = len(num_steps)
    steps = [[float(x) for x in step_rewards[i][: num_steps[i]]] for i in range(g)]
    if normalize == "joint":
        flat = [x for row in steps for x in row]
        mean = sum(flat) / max(len(flat), 1)
        std = math.sqrt(sum((x - mean) ** 2 for x in flat) / max(len(flat), 1))
        normed = [[(x - mean) / (std + eps) if std > eps else 0.0 for x in row] for row in steps]
    else:
        normed = [[0.0] * len(row) for row in steps]
        for t in range(max(num_steps, default=0)):
            column = [steps[i][t] for i in range(g) if t < num_steps[i]]
            mean = sum(column) / len(column)
            std = math.sqrt(sum((x - mean) ** 2 for x in column) / len(column))
            for i in range(g):
                if t < num_steps[i]:
                    normed[i][t] = (steps[i][t] - mean) / (std + eps) if std > eps else 0.0
    out = []
    for row in normed:
        acc, adv = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            acc = row[t] + gamma * acc
            adv[t] = acc
        out.append(np.array(adv))
    return out


def trace_batch_ref(answer_scores, num_turns, rewards, group_size, *, form="log_ratio", eps=0.1, horizon=3, gamma=0.8,
                    terminal_fill=2.0):
    """Whole batch, groups of `group_size` consecutive trajectories: -> turn credit `[N, T]` (0-padded)."""
    answer_scores = np.asarray(answer_scores)
    n, t_max = answer_scores.shape[0], answer_scores.shape[1] - 1
    outcome = np.concatenate([outcome_advantages_ref(rewards[i:i + group_size])
                              for i in range(0, n, group_size)])
    credit = np.zeros((n, t_max))
    for i in range(n):
        t = int(num_turns[i])
        deltas = td_deltas_ref(answer_scores[i], t, form=form, eps=eps)
        credit[i, :t] = lookahead_credit_ref(deltas, t, outcome[i], horizon, gamma, terminal_fill)
    return credit


def gigpo_ref(rewards, group_ids, state_keys, num_turns, gamma=0.95, omega=1.0, step_std="population", std="population",
              eps=1e-6):
    """GiGPO from the paper's definitions, whole batch: -> per-turn advantages, a list of `[T_i + 1]` arrays.

    `state_keys[i][k]` is the key of the state step `k` of trajectory `i` starts from (`k = 0..T_i`). Step `k`'s
    return is `sum_{t >= k} gamma^(t-k) r_t` with `r_t = 0` except `r_{T_i} = R_i`. An anchor group is every step of
    the same prompt group whose state key is equal.
    """
    n = len(rewards)
    episode = np.zeros(n)
    for g in set(group_ids):
        members = [i for i in range(n) if group_ids[i] == g]
        episode[members] = outcome_advantages_ref([rewards[i] for i in members], std=std, eps=eps)
    returns = {}
    for i in range(n):
        t_i = int(num_turns[i])
        step_rewards = [0.0] * t_i + [float(rewards[i])]
        for k in range(t_i + 1):
            returns[(i, k)] = sum(gamma ** (t - k) * step_rewards[t] for t in range(k, t_i + 1))
    out = []
    for i in range(n):
        row = []
        for k in range(int(num_turns[i]) + 1):
            anchor = [returns[(j, u)] for j in range(n) if group_ids[j] == group_ids[i]
                      for u in range(int(num_turns[j]) + 1) if state_keys[j][u] == state_keys[i][k]]
            mean = sum(anchor) / len(anchor)
            centred = returns[(i, k)] - mean
            if step_std == "none":
                step = centred
            else:
                sigma = math.sqrt(sum((x - mean) ** 2 for x in anchor) / len(anchor))
                step = centred / sigma if sigma > eps else 0.0
            row.append(episode[i] + omega * step)
        out.append(np.array(row))
    return out


def gigpo_current_observation_ref(rewards, group_ids, observations, num_turns, **options):
    """GiGPO with anchor states compared by their current observation, from raw text: step `k` of trajectory `i`
    starts from the prompt (k = 0) or from tool response `observations[i][k - 1]`; two steps of one group share an
    anchor when those are equal. -> per-turn advantages, a list of `[T_i + 1]` arrays (see `gigpo_ref`)."""
    current = [[("prompt",)] + [("observation", str(o)) for o in observations[i][: int(num_turns[i])]]
               for i in range(len(rewards))]
    return gigpo_ref(rewards, group_ids, current, num_turns, **options)


def grpo_scaled_ref(turn_index, loss_mask, answer_scores, num_turns, rewards, group_size, *, alpha_out=1.0,
                    alpha_turn=0.2, **trace_options):
    """`grpo_scaled`, whole batch: GRPO's outcome advantage on every trained token, times TRACE's mean |A| over
    GRPO's mean |A| on the trained tokens (1 when GRPO's is 0). -> `[N, L]`."""
    turn_index, loss_mask = np.asarray(turn_index), np.asarray(loss_mask)
    n = turn_index.shape[0]
    outcome = np.concatenate([outcome_advantages_ref(rewards[i:i + group_size]) for i in range(0, n, group_size)])
    credit = trace_batch_ref(answer_scores, num_turns, rewards, group_size, **trace_options)
    trace = np.stack([token_advantages_ref(turn_index[i], loss_mask[i], credit[i], outcome[i], int(num_turns[i]),
                                           alpha_out=alpha_out, alpha_turn=alpha_turn) for i in range(n)])
    grpo = np.where(loss_mask != 0, outcome[:, None], 0.0)
    trained = loss_mask != 0
    trace_size, grpo_size = np.abs(trace[trained]).mean(), np.abs(grpo[trained]).mean()
    return grpo * (trace_size / grpo_size if grpo_size > 0 else 1.0)
