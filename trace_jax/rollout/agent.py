"""The rules of a multi-turn ReAct episode, token-in/token-out: what a turn ends in, how an observation is given
back, how a context is compacted, which key a turn samples with. `run_episodes` runs `B` prompts x `G` samples
under them on the paged, continuously batched engine (`rollout.engine`: paged KV cache, rows advancing on their
own, tools on a worker pool; docs/rollout.md), the one rollout engine of the RL loop, evaluation, the warm start and
the credit-quality report.

One turn of a row: the engine generates until the row stops (`</tool_call>`, `<|im_end|>`, eos, a stop string, the
turn's token budget, or a full context); then `end_turn` decodes the row's *generated ids* (only to read them;
history is never re-tokenised) and decides:
  * no `<tool_call>` and an `<answer>` tag          -> the episode ends: answered (or malformed_answer when the tag is
                                                       unclosed/empty);
  * the context is full                              -> context_overflow;
  * this was the final allowed turn (`max_turns` tool calls done) -> max_turns;
  * otherwise it is a tool turn: `parse_tool_call`; a valid call runs on the row's browser, anything else (malformed
    JSON, no call, two calls, truncated generation) becomes an `Error: ...` observation, and the episode continues.
`observe` then appends the observation as ids (`ChatFormat.tool_response_ids`: closes the turn, the tool turn,
opens the next generation) to the row's token list; the offset after it is the next state boundary S_k. If it does
not fit -> context_overflow.

Context management (`RolloutConfig.context_budget`, off by default): when the tool response would take a row past
the budget, the episode compacts instead (`observe`). Its next context is the prompt, a record of its search so far
and, when it fits, the latest tool response (`rollout.context`), and a new *segment* row starts at the next state.
Every segment becomes one row of the batch (`episode`, `first_turn` say where it belongs), so `tokens[:boundary]`
stays what the policy saw, row by row.

Randomness belongs to the row: turn `k` of row `r` samples its i-th token with
`fold_in(fold_in(fold_in(rng, k), row_offset + r), i)` (`row_turn_keys`), so the tokens do not depend on the KV
budget, the rows in flight, preemption or tool latencies, greedy or sampled.

Bookkeeping per token (see `batch.TrajectoryBatch`): loss mask on generated tokens, turn index = number of
observations before the turn (the final turn's index is `num_turns`), boundaries S_0..S_T. Reward: the environment's
`answer_reward` on the final turn's text (0 unless the episode ended with an answer).

Tasks are anything with `question` and `answer` (optional `aliases`, `task_id`): procedural `Task`s or external
ones. Tools: one `Browser` (forked per row, so any corpus works) or a `task -> Browser` factory.

Test hook: `logits_hook(turn_of_row, step, generated)` returns a logit bias [N, V] (see `ScriptedPolicy`); its
arguments and result are indexed by row.

This module knows nothing about the model's internals, the KV cache, credit assignment or training.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from trace_jax.envs.answers import answer_reward
from trace_jax.envs.browser import ERROR_PREFIX, Browser
from trace_jax.models.chat import TOOL_CALL_OPEN, ChatFormat, ToolCall, parse_tool_call
from trace_jax.models.config import ModelConfig
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.batch import EpisodeRecord, TrajectoryBatch
from trace_jax.rollout.context import compacted_context, render_record, search_state
from trace_jax.rollout.paged import PagedConfig
from trace_jax.train import distributed

DEFAULT_SYSTEM_PROMPT = (
    "You are a research agent. Answer the question by searching and reading documents with the browser tools. "
    "Call one tool per turn. When you know the answer, reply with <answer>your answer</answer>."
)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Episode limits and sampling.

    Attributes:
      group_size: samples G per prompt (rows of a prompt are contiguous).
      max_turns: most tool-calling turns T; after T observations one final turn is still generated (an answer, or
        the episode ends as max_turns). `TrajectoryBatch.boundaries` has T + 1 columns.
      max_context: tokens per row (the most a row's context holds, and the batch's L).
      turn_token_budget: most tokens generated in one assistant turn.
      sampling: the `SamplingConfig`.
      system_prompt: system message (None: none); tools schemas are added when `with_tools`.
      with_tools: render the browser tool schemas into the system turn.
      max_observation_chars: observations are cut to this many characters (0 = no limit).
      format_weight: passed to `answer_reward`.
      sync_every: decode steps per engine dispatch (between host checks of the stop flags).
      kv_budget_gib: KV-cache memory per chip for the engine's page pool, in GiB (None = unbounded: a pool of every
        row's `max_context`; `PagedConfig.num_pages` overrides both). Rows that do not fit wait, or are preempted
        and recomputed; the tokens do not depend on it. It must hold at least one row of `max_context` tokens.
      context_budget: context management (0 = off). When a tool response would take a row's context past this
        many tokens, the episode compacts: its next context is the prompt, a record of its search so far
        (`rollout.context`) and the latest tool response when it fits, and a new *segment* row starts (module
        doc). Must exceed `context_record_tokens + turn_token_budget` and be at most `max_context`.
      context_record_tokens: the record's token budget (its user turn, header and end included).
      paged: the engine's settings (page size, pool, slots, prefill chunk and tokens per dispatch, tool workers).
    """

    group_size: int = 1
    max_turns: int = 4
    max_context: int = 2048
    turn_token_budget: int = 256
    sampling: sampler_lib.SamplingConfig = sampler_lib.SamplingConfig()
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    with_tools: bool = True
    max_observation_chars: int = 2000
    format_weight: float = 0.0
    sync_every: int = 8
    kv_budget_gib: float | None = None
    context_budget: int = 0
    context_record_tokens: int = 256
    paged: PagedConfig = PagedConfig()

    def __post_init__(self):
        if not isinstance(self.paged, PagedConfig):
            raise ValueError(f"RolloutConfig.paged must be a PagedConfig, got {self.paged!r}")
        for name in ("group_size", "max_context", "turn_token_budget", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_turns < 0:
            raise ValueError(f"RolloutConfig.max_turns must be >= 0, got {self.max_turns!r}")
        if self.max_observation_chars < 0:
            raise ValueError("RolloutConfig.max_observation_chars must be >= 0 (0 = no limit)")
        budget = self.kv_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not 0 < budget < float("inf")):
            raise ValueError(f"RolloutConfig.kv_budget_gib must be a positive number of GiB per chip or None "
                             f"(unbounded), got {budget!r}")
        if self.context_record_tokens < 1:
            raise ValueError(f"RolloutConfig.context_record_tokens must be >= 1, got {self.context_record_tokens!r}")
        if self.context_budget and not (self.context_record_tokens + self.turn_token_budget < self.context_budget
                                        <= self.max_context):
            raise ValueError(
                f"RolloutConfig.context_budget = {self.context_budget} must be 0 (off) or leave room for the record "
                f"and one turn within the context: context_record_tokens + turn_token_budget "
                f"({self.context_record_tokens} + {self.turn_token_budget}) < context_budget <= max_context "
                f"({self.max_context}); raise it or lower context_record_tokens")

    def cut_observation(self, observation: str) -> str:
        """The observation as the policy is shown it: cut to `max_observation_chars` (then " ..." marks the cut)."""
        if self.max_observation_chars and len(observation) > self.max_observation_chars:
            return observation[:self.max_observation_chars] + " ..."
        return observation


@dataclasses.dataclass
class Rollout:
    """What `run_episodes` returns: the device batch, one `EpisodeRecord` per row, and phase timings (seconds).

    Attributes:
      rows_at_once: the engine's slots: the most rows in flight at once (fewer than the rows when
        `PagedConfig.slots` caps them).
      kv_cache_bytes: the largest bytes of the engine's page pool (k and v) on any one device, read from the arrays
        themselves.
    """

    batch: TrajectoryBatch
    episodes: list[EpisodeRecord]
    timing: dict[str, float]
    generated_tokens: int
    rows_at_once: int
    kv_cache_bytes: int


class ScriptedPolicy:
    """A logits hook that forces scripted token ids: `scripts[row][turn]` is the id list of that turn.

    Rows or turns without a script are not forced (the model samples). A large bias makes the scripted id the
    only likely one, so the loop runs exactly the scripted episode.

    A hook makes the engine decode one step a dispatch (it is called between steps), unless it has `blocks` set
    and a `block_bias`: then the engine keeps its blocks of `sync_every` steps and asks for the bias of a block's
    steps at once. `blocks=True` does that here: a forced row's next tokens are known (it follows its script; a
    row that stops is not read after), so the episodes are the same, and the engine's decode batching is the one
    a free-running policy meets (rows stopping mid-block).
    """

    def __init__(self, scripts: Sequence[Sequence[Sequence[int]]], vocab_size: int, bias: float = 1e4, *,
                 blocks: bool = False):
        self.scripts = [[list(turn) for turn in row] for row in scripts]
        self.vocab_size = vocab_size
        self.bias = bias
        self.blocks = blocks

    def block_bias(self, turn_of_row: np.ndarray, step: int, generated: list[list[int]], steps: int) -> np.ndarray:
        """float32 [steps, N, V]: the bias of the next `steps` steps, step s as `__call__` gives it after s more
        scripted tokens of each row."""
        out = np.zeros((steps, len(generated), self.vocab_size), np.float32)
        for row, ids in enumerate(generated):
            if row >= len(self.scripts) or turn_of_row[row] >= len(self.scripts[row]):
                continue
            script = self.scripts[row][turn_of_row[row]]
            if script:
                at = np.minimum(len(ids) + np.arange(steps), len(script) - 1)
                out[np.arange(steps), row, np.asarray(script)[at]] = self.bias
        return out

    def __call__(self, turn_of_row: np.ndarray, step: int, generated: list[list[int]]) -> np.ndarray:
        """float32 [N, V]: the bias of the next step (a block of one)."""
        return self.block_bias(turn_of_row, step, generated, 1)[0]


def error_observation(message: str) -> str:
    """The observation given back for a tool call that could not be run (same prefix as the browser's errors)."""
    return ERROR_PREFIX + message


def _gold(task) -> tuple[str, ...]:
    aliases = tuple(getattr(task, "aliases", ()) or ())
    return (str(task.answer),) + tuple(str(a) for a in aliases)


# Turn `turn` of row `row` samples with `fold_in(fold_in(rng, turn), row)`: its draws depend on the row's identity
# and turn, never on the slot it runs in or on the rows batched with it. One program for every row's key.
def _fold_row_keys(rng, rows, turns):
    return jax.vmap(lambda row, turn: jax.random.fold_in(jax.random.fold_in(rng, turn), row))(rows, turns)


_row_keys = jax.jit(_fold_row_keys)


def row_turn_keys(rng: jax.Array, rows, turns) -> jax.Array:
    """uint32 [N, 2]: the key of turn `turns[i]` of row `rows[i]`, `fold_in(fold_in(rng, turn), row)` (the turn's
    step s then folds in s)."""
    return _row_keys(rng, np.asarray(rows, np.int32), np.asarray(turns, np.int32))


def new_segment(context: list[int], *, first_turn: int) -> dict:
    """A row's bookkeeping dict (tokens, masks, log-probs, boundaries, status) starting from `context` (a prompt or
    a compacted context) as its state `S_{first_turn}`."""
    return {"tokens": list(context), "loss_mask": [0.0] * len(context), "turn_index": [-1] * len(context),
            "logprobs": [0.0] * len(context), "sampling_logprobs": [0.0] * len(context),
            "boundaries": [len(context)], "reward": 0.0, "status": "running", "first_turn": first_turn}


def task_episode(task, index: int) -> EpisodeRecord:
    """The empty `EpisodeRecord` of `task` (the `index`-th task: its id when the task has none)."""
    return EpisodeRecord(task_id=str(getattr(task, "task_id", index)), question=task.question, gold=_gold(task),
                         clues=tuple(getattr(task, "clues", ()) or ()))


def compact_context(chat: ChatFormat, rollout: RolloutConfig, schemas, episode: EpisodeRecord) -> list[int]:
    """The compacted context of `episode` after its latest observation: prompt, record and, when the whole fits
    `context_budget`, that observation (`context.compacted_context`)."""
    record = render_record(search_state(episode.question, episode.tool_calls, episode.observations),
                           rollout.context_record_tokens, lambda text: len(chat.user_ids(text)))
    with_latest = compacted_context(chat, rollout.system_prompt, episode.question, schemas, record,
                                    episode.observations[-1])
    if len(with_latest) <= rollout.context_budget:
        return with_latest
    return compacted_context(chat, rollout.system_prompt, episode.question, schemas, record, None)


def end_turn(chat: ChatFormat, rollout: RolloutConfig, segment: dict, episode: EpisodeRecord, ids: list[int],
             logprobs: list[float], sampling_logprobs: list[float], stop_reason: int) -> ToolCall | str | None:
    """Record an assistant turn (its generated `ids`, their log-probs, why it stopped: a `sampler` stop reason) in
    the row's current segment and its episode, and apply the end-of-turn rule (module doc).

    Returns None when the episode ended (`segment["status"]` and `episode.status` say how: answered,
    malformed_answer, context_overflow or max_turns); else the turn's tool call, recorded in `episode.tool_calls`:
    a `ToolCall` to run, or the observation of a call that could not be parsed (`error_observation`). Either way
    the caller gives its observation to `observe`.
    """
    tool_turn = segment["first_turn"] + len(segment["boundaries"]) - 1  # the episode's turn, across segments
    segment["tokens"] += ids
    segment["loss_mask"] += [1.0] * len(ids)
    segment["turn_index"] += [tool_turn] * len(ids)
    segment["logprobs"] += list(logprobs)
    segment["sampling_logprobs"] += list(sampling_logprobs)
    text = chat.tokenizer.decode(ids, skip_special_tokens=False)
    episode.turn_texts.append(text)
    episode.final_text = text
    if TOOL_CALL_OPEN not in text:
        result = answer_reward(text, episode.gold, format_weight=rollout.format_weight)
        if result.has_answer:
            segment["status"] = "answered" if result.well_formed else "malformed_answer"
            segment["reward"] = result.reward
            episode.answer = result.answer
    if segment["status"] == "running":
        if stop_reason == sampler_lib.CONTEXT_FULL:
            segment["status"] = "context_overflow"
        elif tool_turn >= rollout.max_turns:
            segment["status"] = "max_turns"
    if segment["status"] != "running":
        episode.status = segment["status"]
        return None
    call = parse_tool_call(text)
    if isinstance(call, ToolCall):
        episode.tool_calls.append((call.name, call.arguments))
        return call
    episode.tool_calls.append(call.message)
    return error_observation(call.message)


def observe(chat: ChatFormat, rollout: RolloutConfig, schemas, segment: dict, episode: EpisodeRecord,
            observation: str, turn_ids: list[int]) -> dict | None:
    """Give the observation of the tool call that ended turn `turn_ids` to the row (module doc): count a tool
    error, cut it (`cut_observation`), record it, and append its response ids to `segment`, or compact the context
    when they would pass `context_budget`.

    Returns the segment the episode goes on in: `segment` itself (the response appended, a new state boundary
    after it), a new segment (`new_segment` of the compacted context, at the next turn; the caller keeps `segment`
    as a finished one), or None when the episode ended as context_overflow (statuses set): the response, or the
    compacted context, leaves no room for one more token in `max_context`.
    """
    if observation.startswith(ERROR_PREFIX):
        episode.num_tool_errors += 1
    observation = rollout.cut_observation(observation)
    episode.observations.append(observation)
    response = chat.tool_response_ids(observation, previous_ids=list(turn_ids))
    if rollout.context_budget and len(segment["tokens"]) + len(response) > rollout.context_budget:
        context = compact_context(chat, rollout, schemas, episode)
        if len(context) < rollout.max_context:
            return new_segment(context, first_turn=segment["first_turn"] + len(segment["boundaries"]))
    elif len(segment["tokens"]) + len(response) < rollout.max_context:
        segment["tokens"] += response
        segment["loss_mask"] += [0.0] * len(response)
        segment["turn_index"] += [-1] * len(response)
        segment["logprobs"] += [0.0] * len(response)
        segment["sampling_logprobs"] += [0.0] * len(response)
        segment["boundaries"].append(len(segment["tokens"]))
        return segment
    segment["status"] = episode.status = "context_overflow"
    return None


def batch_placement(mesh, rules):
    """Where `build_batch` puts the batch's arrays: on one device without a mesh; on a mesh of this process, rows
    over its batch axes where they divide (the layout its consumers, scoring and the update, read rows in), never
    whole on one device; on a mesh over several processes, on the host (this process's rows, which the loop
    assembles into the global update batch itself)."""
    if mesh is None:
        return None
    if distributed.spans_processes(mesh):
        return np.asarray
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trace_jax.models.sharding import logical_to_mesh_spec

    def place(x):
        spec = logical_to_mesh_spec(P("batch", *([None] * (x.ndim - 1))), mesh, rules)
        sharding = sampler_lib.divisible_shardings(x, NamedSharding(mesh, spec))
        return jax.device_put(x, sharding)

    return place


def run_episodes(config: ModelConfig, params, chat: ChatFormat, tasks: Sequence[Any],
                 browser: Browser | Callable[[Any], Browser], rollout: RolloutConfig, rng: jax.Array, *,
                 mesh=None, rules=None, row_offset: int = 0,
                 logits_hook: Callable[[np.ndarray, int, list], np.ndarray | None] | None = None) -> Rollout:
    """Run `len(tasks) x rollout.group_size` episodes on the paged engine (`engine.run_paged_episodes`, with
    `rollout.paged`) and pack them into a `TrajectoryBatch` (the module doc). Returns its `PagedRollout` (a
    `Rollout` with the engine's statistics).

    Args:
      config, params: the policy (params already placed/sharded on `mesh` when one is given).
      chat: the `ChatFormat` of the policy's tokenizer.
      tasks: objects with `question`, `answer` (and optional `aliases`, `task_id`).
      browser: a `Browser` (each row gets `browser.fork()`) or a factory `task -> Browser`.
      rollout: limits and sampling.
      rng: PRNG key; turn k of row r samples with `fold_in(fold_in(rng, k), row_offset + r)`.
      mesh, rules: shard the page pool (pages over the batch axes, kv heads over `tensor`) on this mesh.
      row_offset: the key index of the first row: a caller that runs one batch of rows as several calls (chunks,
        processes) passes each call the index of its first row and gets the draws of the whole batch.
      logits_hook: test hook (see `ScriptedPolicy`).

    Raises:
      ValueError: a prompt does not fit in `max_context` (the message gives the length), or the KV budget holds
        no row.
    """
    from trace_jax.rollout.engine import run_paged_episodes  # the engine imports this module (its rules)

    return run_paged_episodes(config, params, chat, tasks, browser, rollout, rng, mesh=mesh, rules=rules,
                              row_offset=row_offset, logits_hook=logits_hook)
