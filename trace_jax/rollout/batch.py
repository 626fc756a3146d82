"""`TrajectoryBatch`: the device-side record of a batch of agent episodes, and its host-side companion.

Shapes (static for a given rollout config): `N` = rows, `L` = the rollout's `max_context`, `T` = `max_turns`
(tool-calling turns; one more final turn is always allowed, so `T + 1` states). A row is one *segment* of an
episode: without context management (`RolloutConfig.context_budget = 0`, the default) every episode is one row and
`N` = prompts x samples; with it, an episode that compacted its context is several contiguous rows, one per stretch
of context the policy saw (docs/rollout.md, "Context management").

  tokens            int32   [N, L]   prompt, generated and observation ids, padded with `pad_id` after `lengths`
  positions         int32   [N, L]   RoPE positions (0..L-1: rows are never left-padded)
  loss_mask         float32 [N, L]   1 on tokens the policy generated (each turn's text, its stop token, the final
                                     answer's `<|im_end|>`); 0 on prompt, observation, template and padding tokens
  turn_index        int32   [N, L]   on generated tokens the state k their turn started from (k-th tool response
                                     seen so far); the final turn has index `num_turns`; -1 elsewhere
  boundaries        int32   [N, T+1] offset of state S_k: S_0 = end of the prompt (after `<|im_start|>assistant\\n`),
                                     S_k = start of the generation following observation k; states k > num_turns are
                                     padded with the row's last real boundary (always a valid offset). In a segment
                                     row column j is the episode's state `first_turn + j`
  num_turns         int32   [N]      tool calls answered by an observation in the row (`T_g` of the credit API for
                                     a one-row episode; the row has `num_turns + 1` states)
  group_id          int32   [N]      prompt index (rows of one prompt are contiguous: row = prompt * G + sample)
  reward            float32 [N]      `answer_reward` of the final turn's text against the gold answer and aliases
                                     (the episode's, on every row of it)
  sampler_logprobs  float32 [N, L]   raw-model log-probs (temperature 1, unfiltered) of generated tokens; 0 elsewhere
  sampling_logprobs float32 [N, L]   log-probs under the distribution actually sampled from (tempered/filtered)
  lengths           int32   [N]      tokens in each row
  status            int32   [N]      `STATUSES` code of how the episode ended
  episode           int32   [N]      the episode of each row, in [0, E): an episode's rows are contiguous, in order
  first_turn        int32   [N]      the episode's index of the row's first state (0 for a first segment); the
                                     row's `turn_index` values are the episode's turns, `first_turn..first_turn +
                                     num_turns`

`tokens[n, :boundaries[n, k]]` is exactly the context the policy saw at state k (`first_turn[n] + k` of its
episode), so the scorer takes `(tokens, boundaries, num_states)` as they are. When every episode is one row, the
credit API takes `(turn_index, loss_mask, num_turns, group_id, reward)` as they are; with segments the credit is
computed once per episode and broadcast onto the rows (`trace_jax.credit.segments`; `episode_view` here).

Host-side metadata (answer text, status names, per-turn texts) lives in `EpisodeRecord`s next to the batch, not
inside it: strings as static pytree data would make every jitted consumer recompile on every batch.

This module knows nothing about models, tokenizers or tools.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# How an episode ended.
STATUSES = ("running", "answered", "malformed_answer", "max_turns", "context_overflow")
STATUS_CODES = {name: code for code, name in enumerate(STATUSES)}


@struct.dataclass
class TrajectoryBatch:
    """A batch of finished episodes as fixed-shape arrays (see the module doc for every field)."""

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    turn_index: jax.Array
    boundaries: jax.Array
    num_turns: jax.Array
    group_id: jax.Array
    reward: jax.Array
    sampler_logprobs: jax.Array
    sampling_logprobs: jax.Array
    lengths: jax.Array
    status: jax.Array
    episode: jax.Array
    first_turn: jax.Array

    @property
    def num_states(self) -> jax.Array:
        """int32 [N]: real states per row (`num_turns + 1`), the scorer's `num_states`."""
        return self.num_turns + 1

    @property
    def segmented(self) -> bool:
        """Whether some episode spans several rows (host check: reads `first_turn`)."""
        return bool(np.asarray(self.first_turn).any())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def credit_inputs(self, **extra):
        """`trace_jax.credit.CreditInputs` from this batch (pass `answer_scores=...` etc. as keywords)."""
        from trace_jax.credit import CreditInputs

        return CreditInputs(rewards=self.reward, group_id=self.group_id, loss_mask=self.loss_mask,
                            turn_index=self.turn_index, num_turns=self.num_turns, **extra)


@dataclasses.dataclass
class EpisodeRecord:
    """Host-side metadata of one row.

    Attributes:
      task_id, question, gold: the task (gold = answer and aliases).
      status: a `STATUSES` name.
      answer: the extracted final answer (None if none).
      final_text: decoded text of the last generated turn.
      turn_texts: decoded text of every generated turn.
      tool_calls: per tool turn, `(name, arguments)` or the parse error message.
      observations: per tool turn, the observation text given back.
      num_tool_errors: error observations (unparseable calls and tool errors).
      clues: the task's gold clue chain (`tasks.Clue` records; empty for tasks without one), for ABC's step scorer.
    """

    task_id: str
    question: str
    gold: tuple[str, ...]
    status: str = "running"
    answer: str | None = None
    final_text: str = ""
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    tool_calls: list[Any] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    num_tool_errors: int = 0
    clues: tuple = ()

    @property
    def state_keys(self) -> list[str]:
        """GiGPO's anchor-state key of every turn: turn `k` starts from state `S_k`, identified by the observation
        history `observations[:k]` (`credit.history_state_keys`); `S_0`, the prompt, is shared by a prompt's group."""
        from trace_jax.credit.gigpo import history_state_keys

        return history_state_keys(self.observations)


def anchor_keys(episodes: list[EpisodeRecord], num_slots: int) -> np.ndarray:
    """int32 `[N, num_slots]` anchor-state ids of every turn (`CreditInputs.anchor_keys` for `gigpo`); pass
    `num_slots = max_turns + 1`, the batch's `boundaries` width. Keys past a row's last state are ignored."""
    from trace_jax.credit.gigpo import anchor_key_ids

    return anchor_key_ids([episode.state_keys[:num_slots] for episode in episodes], num_slots)


@dataclasses.dataclass(frozen=True)
class EpisodeView:
    """Host arrays (numpy) that map a batch's rows back to its `E` episodes.

    Attributes:
      last_row: int [E] each episode's last row (its final turn, outcome and group live there).
      num_turns: int [E] the episode's tool calls answered by an observation (`T_g`), across its rows.
      reward, group_id, status: [E] the episode's.
      episode: int [N] each row's episode; first_turn: int [N] its first state's index in the episode.
    """

    last_row: np.ndarray
    num_turns: np.ndarray
    reward: np.ndarray
    group_id: np.ndarray
    status: np.ndarray
    episode: np.ndarray
    first_turn: np.ndarray

    @property
    def num_episodes(self) -> int:
        return len(self.last_row)


def episode_view(batch: TrajectoryBatch) -> EpisodeView:
    """The `EpisodeView` of `batch` (host side). Raises ValueError when an episode's rows are not contiguous and in
    order or its first row does not start at state 0."""
    episode = np.asarray(batch.episode)
    first_turn = np.asarray(batch.first_turn)
    num_turns = np.asarray(batch.num_turns)
    n = len(episode)
    if n and (episode[0] != 0 or (np.diff(episode) < 0).any() or (np.diff(episode) > 1).any()):
        raise ValueError(f"TrajectoryBatch.episode must number episodes 0, 1, ... with each episode's rows "
                         f"contiguous, got {episode.tolist()}")
    starts = np.r_[True, episode[1:] != episode[:-1]] if n else np.zeros(0, bool)
    expected = np.where(starts, 0, np.r_[0, first_turn[:-1] + num_turns[:-1] + 1][:n])
    if (first_turn != expected).any():
        raise ValueError(f"TrajectoryBatch.first_turn must be 0 on an episode's first row and continue its previous "
                         f"row's states on the next (first_turn + num_turns + 1), got {first_turn.tolist()}")
    last_row = np.r_[np.nonzero(starts)[0][1:] - 1, n - 1] if n else np.zeros(0, np.int64)
    return EpisodeView(last_row=last_row, num_turns=first_turn[last_row] + num_turns[last_row],
                       reward=np.asarray(batch.reward)[last_row], group_id=np.asarray(batch.group_id)[last_row],
                       status=np.asarray(batch.status)[last_row], episode=episode, first_turn=first_turn)


def build_batch(rows: list[dict], *, max_len: int, max_turns: int, group_id, pad_id: int = 0, episode=None,
                first_turn=None, placement=None) -> TrajectoryBatch:
    """Pack per-row host lists into a `TrajectoryBatch` of shape [N, max_len] / [N, max_turns + 1].

    Each row dict holds lists `tokens`, `loss_mask`, `turn_index`, `logprobs`, `sampling_logprobs` (one entry per
    token), `boundaries` (1..max_turns+1 offsets), and scalars `reward`, `status` (a name). `episode` and
    `first_turn` ([N]) place segment rows in their episodes; None: one row per episode (`arange(N)`, zeros).
    `placement`: a function `host array -> array` that puts each field where its consumer reads it (the rollout's
    rows over the mesh's batch axes, or `np.asarray` to keep them on the host); None: the default device.
    """
    n = len(rows)
    tokens = np.full((n, max_len), pad_id, np.int32)
    loss_mask = np.zeros((n, max_len), np.float32)
    turn_index = np.full((n, max_len), -1, np.int32)
    logprobs = np.zeros((n, max_len), np.float32)
    sampling_lp = np.zeros((n, max_len), np.float32)
    boundaries = np.zeros((n, max_turns + 1), np.int32)
    num_turns = np.zeros(n, np.int32)
    lengths = np.zeros(n, np.int32)
    reward = np.zeros(n, np.float32)
    status = np.zeros(n, np.int32)
    for i, row in enumerate(rows):
        length = len(row["tokens"])
        if length > max_len:
            raise ValueError(f"row {i} has {length} tokens, more than max_len={max_len}")
        if not 1 <= len(row["boundaries"]) <= max_turns + 1:
            raise ValueError(f"row {i} has {len(row['boundaries'])} boundaries; expected 1..{max_turns + 1}")
        tokens[i, :length] = row["tokens"]
        loss_mask[i, :length] = row["loss_mask"]
        turn_index[i, :length] = row["turn_index"]
        logprobs[i, :length] = row["logprobs"]
        sampling_lp[i, :length] = row["sampling_logprobs"]
        b = list(row["boundaries"])
        boundaries[i] = b + [b[-1]] * (max_turns + 1 - len(b))
        num_turns[i] = len(b) - 1
        lengths[i] = length
        reward[i] = row["reward"]
        status[i] = STATUS_CODES[row["status"]]
    positions = np.broadcast_to(np.arange(max_len, dtype=np.int32), (n, max_len))
    put = jnp.asarray if placement is None else (lambda x: placement(np.ascontiguousarray(x)))
    return TrajectoryBatch(
        tokens=put(tokens), positions=put(positions), loss_mask=put(loss_mask),
        turn_index=put(turn_index), boundaries=put(boundaries), num_turns=put(num_turns),
        group_id=put(np.asarray(group_id, np.int32)), reward=put(reward),
        sampler_logprobs=put(logprobs), sampling_logprobs=put(sampling_lp),
        lengths=put(lengths), status=put(status),
        episode=put(np.arange(n, dtype=np.int32) if episode is None else np.asarray(episode, np.int32)),
        first_turn=put(np.zeros(n, np.int32) if first_turn is None else np.asarray(first_turn, np.int32)))
