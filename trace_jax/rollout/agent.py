"""Batched multi-turn ReAct loop: `B` prompts x `G` samples, token-in/token-out, under a KV-cache budget.

The sampler's cache holds `S` rows at once (`budget.rows_within_budget`: all `B x G` rows when
`RolloutConfig.kv_budget_gib` is None or they fit under it). Rows wait in order for a free cache row (a *slot*):
at the start of every round the waiting rows are admitted into the free slots (`sampler.prefill_rows`: only the new
prompts run through the model, identical prompts once), so when not every row fits, rows run as others finish
(continuous batching at turn granularity).

One round = one assistant turn for every row in a slot (rows may be at different turns):

  1. `sampler.generate` until each row stops (`</tool_call>`, `<|im_end|>`, eos, the turn's token budget, or a full
     context);
  2. on the host, decode the row's *generated ids* (only to read them; history is never re-tokenised) and decide:
       * no `<tool_call>` and an `<answer>` tag          -> the episode ends: answered (or malformed_answer when
                                                           the tag is unclosed/empty);
       * the context is full                              -> context_overflow;
       * this was the final allowed turn (`max_turns` tool calls done) -> max_turns;
       * otherwise it is a tool turn: `parse_tool_call`; a valid call runs on the row's browser, anything else
         (malformed JSON, no call, two calls, truncated generation) becomes an `Error: ...` observation, and the
         episode continues;
  3. the observation is appended as ids (`ChatFormat.tool_response_ids`: closes the turn, the tool turn, opens the
     next generation) to the row's token list and to its KV cache (`sampler.append`, only the rows that called a
     tool). The offset after it is the next state boundary S_k. If it does not fit -> context_overflow.
     A row whose episode ended frees its slot.

Context management (`RolloutConfig.context_budget`, off by default): when step 3's tool response would take a row past
the budget, the episode compacts instead. Its next context is the prompt, a record of its search so far and, when it
fits, the latest tool response (`rollout.context`); the row's slot is re-prefilled with it (`sampler.prefill_rows`,
the admission path) and a new *segment* row starts at the next state. Every segment becomes one row of the batch
(`episode`, `first_turn` say where it belongs), so `tokens[:boundary]` stays what the policy saw, row by row.

Randomness belongs to the row, not to its slot or wave: turn `k` of row `r` samples with the per-row key
`fold_in(fold_in(rng, k), r)` (step `s` of the turn folds in `s`, see `sampler.generate`), so a budgeted run gives
the tokens of an unbounded one with the same `rng`, greedy or sampled.

Bookkeeping per token (see `batch.TrajectoryBatch`): loss mask on generated tokens, turn index = number of
observations before the turn (the final turn's index is `num_turns`), boundaries S_0..S_T. Reward: the environment's
`answer_reward` on the final turn's text (0 unless the episode ended with an answer).

Tasks are anything with `question` and `answer` (optional `aliases`, `task_id`): procedural `Task`s or external
ones. Tools: one `Browser` (forked per row, so any corpus works) or a `task -> Browser` factory.

Test hook: `logits_hook(turn_of_row, step, generated)` returns a logit bias [N, V] (see `ScriptedPolicy`); its
arguments and result are indexed by row, whatever slot the row runs in.

Several processes (a `mesh` over the devices of several JAX processes): each process runs this loop for its own
tasks (its rows, their tools and parsing) and the sampler's state holds every process's slots, process p's slots
being its p-th block of rows; each program is a collective over the whole mesh, so the rounds run in lock step
(`distributed.agree_any`): every process runs until no process has a row left, a process whose rows are done takes
part with no active rows and empty admissions, and its slot count is the largest any process needs
(`distributed.agree_max`). The params and the cache stay sharded over the whole mesh: spanning processes adds no
copy. The batch's arrays stay on the host there (this process's rows).

This module knows nothing about the model's internals, credit assignment or training.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from trace_jax.envs.answers import answer_reward
from trace_jax.envs.browser import ERROR_PREFIX, Browser, tool_schemas
from trace_jax.models.chat import TOOL_CALL_OPEN, ChatFormat, ToolCall, parse_tool_call
from trace_jax.models.config import ModelConfig
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.batch import EpisodeRecord, TrajectoryBatch, build_batch
from trace_jax.rollout.budget import cache_bytes_per_device, rows_within_budget
from trace_jax.rollout.context import compacted_context, render_record, search_state
from trace_jax.rollout.paged import PagedConfig
from trace_jax.train import distributed

ENGINES = ("dense", "paged")
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
      max_context: tokens per row (KV cache length and the batch's L).
      turn_token_budget: most tokens generated in one assistant turn.
      sampling: the `SamplingConfig`.
      system_prompt: system message (None: none); tools schemas are added when `with_tools`.
      with_tools: render the browser tool schemas into the system turn.
      max_observation_chars: observations are cut to this many characters (0 = no limit).
      format_weight: passed to `answer_reward`.
      sync_every: decode steps between host checks of the stop flags.
      kv_budget_gib: KV-cache memory per chip for the rollout's rows, in GiB (None = unbounded: every row of a
        call at once). Rows beyond what fits wait and are admitted as others finish (`budget.rows_within_budget`);
        the tokens do not depend on it. It must hold at least one row of `max_context` tokens.
      context_budget: context management (0 = off). When a tool response would take a row's context past this
        many tokens, the episode compacts: its next context is the prompt, a record of its search so far
        (`rollout.context`) and the latest tool response when it fits, and a new *segment* row starts (module
        doc). Must exceed `context_record_tokens + turn_token_budget` and be at most `max_context`.
      context_record_tokens: the record's token budget (its user turn, header and end included).
      engine: which engine runs the episodes: 'dense' (`run_episodes`' rounds over a dense cache) or 'paged'
        (`rollout.engine`: paged KV, rows advance on their own, tools on a worker pool); the same episodes.
      paged: the paged engine's settings (page size, pool, slots, prefill chunk, tool workers).
      append_chunk_tokens: the most tokens of a row one observation append dispatches; a longer observation (or
        the rest of a long admitted prompt) is appended in pieces of at most this many (`sampler.append`), so the
        append program's width, and its temporaries, never exceed it whatever the context (the same tokens).
        A `sampler.bucket_length` size (`sampler.check_chunk_tokens`).
      prefill_chunk_tokens: the most prompt tokens of a row one admission dispatches (`sampler.prefill_rows`); the
        rest of a longer prompt (a compacted context) is appended in `append_chunk_tokens` pieces. A
        `bucket_length` size.
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
    engine: str = "dense"
    paged: PagedConfig = PagedConfig()
    append_chunk_tokens: int = 4096
    prefill_chunk_tokens: int = 8192

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"RolloutConfig.engine must be one of {ENGINES}, got {self.engine!r}")
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
        sampler_lib.check_chunk_tokens(self.append_chunk_tokens, "RolloutConfig.append_chunk_tokens")
        sampler_lib.check_chunk_tokens(self.prefill_chunk_tokens, "RolloutConfig.prefill_chunk_tokens")
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
      rows_at_once: rows the sampler's cache held (its batch size; fewer than the rows under a KV budget; with a
        mesh over several processes, every process's rows together).
      kv_cache_bytes: the largest bytes of the sampler's cache arrays (k, v, lengths) on any one device, read
        from the arrays themselves after every admission.
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
    """

    def __init__(self, scripts: Sequence[Sequence[Sequence[int]]], vocab_size: int, bias: float = 1e4):
        self.scripts = [[list(turn) for turn in row] for row in scripts]
        self.vocab_size = vocab_size
        self.bias = bias

    def __call__(self, turn_of_row: np.ndarray, step: int, generated: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(generated), self.vocab_size), np.float32)
        for row, ids in enumerate(generated):
            if row >= len(self.scripts) or turn_of_row[row] >= len(self.scripts[row]):
                continue
            script = self.scripts[row][turn_of_row[row]]
            if script:
                out[row, script[min(len(ids), len(script) - 1)]] = self.bias
        return out


def error_observation(message: str) -> str:
    """The observation given back for a tool call that could not be run (same prefix as the browser's errors)."""
    return ERROR_PREFIX + message


def _gold(task) -> tuple[str, ...]:
    aliases = tuple(getattr(task, "aliases", ()) or ())
    return (str(task.answer),) + tuple(str(a) for a in aliases)


# Turn `turn` of row `row` samples with `fold_in(fold_in(rng, turn), row)`: its draws depend on the row's identity
# and turn, never on the slot it runs in or on the rows batched with it. One program for every slot's key.
def _fold_row_keys(rng, rows, turns):
    return jax.vmap(lambda row, turn: jax.random.fold_in(jax.random.fold_in(rng, turn), row))(rows, turns)


_row_keys = jax.jit(_fold_row_keys)


def _row_hook(logits_hook, slot_row: np.ndarray, episodes: list[EpisodeRecord], n: int):
    """The sampler's slot-indexed hook `(step, generated) -> bias [S, V]` around a row-indexed `logits_hook`."""
    slot_row = slot_row.copy()
    turn_of_row = np.asarray([len(e.turn_texts) for e in episodes], np.int64)

    def hook(step: int, generated: list) -> np.ndarray | None:
        if not n:  # no rows of its own (a process taking part in the others' rounds)
            return None
        by_row: list[list[int]] = [[] for _ in range(n)]
        for s, r in enumerate(slot_row):
            if r >= 0:
                by_row[r] = generated[s]
        bias = logits_hook(turn_of_row, step, by_row)
        if bias is None:
            return None
        bias = np.asarray(bias, np.float32)
        return np.where((slot_row >= 0)[:, None], bias[np.maximum(slot_row, 0)], 0.0).astype(np.float32)

    return hook


def _segment(context: list[int], *, first_turn: int) -> dict:
    """A new segment row: `context` (a prompt or a compacted context) as its first state, `S_{first_turn}`."""
    return {"tokens": list(context), "loss_mask": [0.0] * len(context), "turn_index": [-1] * len(context),
            "logprobs": [0.0] * len(context), "sampling_logprobs": [0.0] * len(context),
            "boundaries": [len(context)], "reward": 0.0, "status": "running", "first_turn": first_turn}


def _compact(chat: ChatFormat, rollout: RolloutConfig, schemas, episode: EpisodeRecord) -> list[int]:
    """The compacted context of `episode` after its latest observation: prompt, record and, when the whole fits
    `context_budget`, that observation (`context.compacted_context`)."""
    record = render_record(search_state(episode.question, episode.tool_calls, episode.observations),
                           rollout.context_record_tokens, lambda text: len(chat.user_ids(text)))
    with_latest = compacted_context(chat, rollout.system_prompt, episode.question, schemas, record,
                                    episode.observations[-1])
    if len(with_latest) <= rollout.context_budget:
        return with_latest
    return compacted_context(chat, rollout.system_prompt, episode.question, schemas, record, None)


def run_episodes(config: ModelConfig, params, chat: ChatFormat, tasks: Sequence[Any],
                 browser: Browser | Callable[[Any], Browser], rollout: RolloutConfig, rng: jax.Array, *,
                 mesh=None, rules=None, row_offset: int = 0,
                 logits_hook: Callable[[np.ndarray, int, list], np.ndarray | None] | None = None) -> Rollout:
    """Run `len(tasks) x rollout.group_size` episodes and pack them into a `TrajectoryBatch`: all at once, or under
    `rollout.kv_budget_gib` as many at once as fit, the others admitted as rows finish (the module doc).

    Args:
      config, params: the policy (params already placed/sharded on `mesh` when one is given).
      chat: the `ChatFormat` of the policy's tokenizer.
      tasks: objects with `question`, `answer` (and optional `aliases`, `task_id`).
      browser: a `Browser` (each row gets `browser.fork()`) or a factory `task -> Browser`.
      rollout: limits and sampling.
      rng: PRNG key; turn k of row r samples with `fold_in(fold_in(rng, k), row_offset + r)`.
      mesh, rules: shard rows (and kv heads) of the sampler state on this mesh. A mesh over several processes:
        every process calls this with its own tasks (any number, none included), and the sampler's programs run
        over the whole mesh on every process's rows together (module doc).
      row_offset: the key index of the first row: a caller that runs one batch of rows as several calls (chunks,
        processes) passes each call the index of its first row and gets the draws of the whole batch.
      logits_hook: test hook (see `ScriptedPolicy`).

    Raises:
      ValueError: a prompt does not fit in `max_context` (the message gives the length), or the KV budget holds
        no row.
    """
    if rollout.engine == "paged":  # the one dispatch between the engines
        from trace_jax.rollout.engine import run_paged_episodes  # it imports this module

        return run_paged_episodes(config, params, chat, tasks, browser, rollout, rng, mesh=mesh, rules=rules,
                                  row_offset=row_offset, logits_hook=logits_hook)
    start = time.perf_counter()
    timing = {"prefill": 0.0, "generate": 0.0, "env": 0.0, "agent_host": 0.0, "append": 0.0, "pack": 0.0}
    group = rollout.group_size
    n = len(tasks) * group
    max_len = rollout.max_context
    tokenizer = chat.tokenizer
    stop_strings = (sampler_lib.StopStrings(tokenizer, chat.assistant_stop_strings)
                    if chat.assistant_stop_strings else None)
    schemas = tool_schemas() if rollout.with_tools else None

    rows: list[dict] = []  # each episode's current segment
    finished_segments: list[list[dict]] = []  # each episode's segments before a compaction
    episodes: list[EpisodeRecord] = []
    browsers: list[Browser] = []
    for t, task in enumerate(tasks):
        prompt = chat.prompt_ids(rollout.system_prompt, task.question, schemas)
        if len(prompt) >= max_len:
            raise ValueError(f"task {t}: the prompt has {len(prompt)} tokens but max_context={max_len}; raise "
                             "RolloutConfig.max_context or shorten the system prompt")
        needed = len(prompt) + rollout.context_record_tokens + rollout.turn_token_budget
        if rollout.context_budget and needed > rollout.context_budget:
            raise ValueError(f"task {t}: a compacted context needs the prompt ({len(prompt)} tokens), the record "
                             f"(RolloutConfig.context_record_tokens = {rollout.context_record_tokens}) and one turn "
                             f"(turn_token_budget = {rollout.turn_token_budget}): {needed} tokens, more than "
                             f"RolloutConfig.context_budget = {rollout.context_budget}; raise context_budget")
        for _ in range(group):
            rows.append(_segment(prompt, first_turn=0))
            finished_segments.append([])
            episodes.append(EpisodeRecord(task_id=str(getattr(task, "task_id", t)), question=task.question,
                                          gold=_gold(task), clues=tuple(getattr(task, "clues", ()) or ())))
            browsers.append(browser.fork() if isinstance(browser, Browser) else browser(task))

    # On a mesh over several processes the sampler's state holds every process's slots (process p's are its p-th
    # block) and each program is a collective: every process runs the rounds below until no process has a row
    # left, with empty admissions and no active rows once its own rows are done (module doc).
    processes = jax.process_count() if distributed.spans_processes(mesh) else 1
    most = distributed.agree_max(n) if processes > 1 else n
    slots = max(1, rows_within_budget(config, rollout, mesh=mesh, rows=max(most * processes, 1),
                                      rules=rules) // processes)
    state = sampler_lib.init_state(config, slots * processes, max_len, mesh=mesh, rules=rules)
    # every dispatch at most a chunk wide (RolloutConfig): the widths `rl.programs` lists, whatever the context
    chunks = dict(chunk_tokens=rollout.prefill_chunk_tokens, append_chunk_tokens=rollout.append_chunk_tokens)
    slot_row = np.full(slots, -1, np.int64)  # the row each of this process's cache rows (slots) holds; -1 = free
    waiting = collections.deque(range(n))
    kv_cache_bytes = 0
    generated_tokens = 0
    while distributed.agree_any(bool(waiting) or (slot_row >= 0).any()):
        free = np.nonzero(slot_row < 0)[0][:len(waiting)]
        if distributed.agree_any(len(free) > 0):
            # Admission: the G samples of a prompt admitted together share one prefill (identical prompts run once).
            admitted = [waiting.popleft() for _ in free]
            t0 = time.perf_counter()
            state = sampler_lib.prefill_rows(config, params, state, free.tolist(),
                                             [rows[r]["tokens"] for r in admitted], **chunks)
            jax.block_until_ready(state.logits)
            timing["prefill"] += time.perf_counter() - t0
            slot_row[free] = admitted
            kv_cache_bytes = max(kv_cache_bytes, cache_bytes_per_device(state.cache))

        running = slot_row >= 0
        held = np.where(running, slot_row, 0)
        # (a process with no rows of its own, taking part in the others' rounds, has nothing to read: zeros)
        turn_of_slot = np.asarray([len(episodes[r].turn_texts) if n else 0 for r in held], np.int32)
        keys = _row_keys(rng, (held + row_offset).astype(np.int32), turn_of_slot)
        hook = None if logits_hook is None else _row_hook(logits_hook, slot_row, episodes, n)
        budget = np.asarray([min(rollout.turn_token_budget, max_len - len(rows[r]["tokens"])) if n else 0
                             for r in held], np.int32)
        t0 = time.perf_counter()
        state, gen = sampler_lib.generate(
            config, params, state, rng=keys, active=running, max_new_tokens=budget,
            stop_ids=chat.assistant_stop_ids, sampling=rollout.sampling, stop_strings=stop_strings,
            logits_hook=hook, sync_every=rollout.sync_every)
        timing["generate"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        env_time = 0.0
        appends: list[list[int]] = [[] for _ in range(slots)]
        refills: dict[int, list[int]] = {}  # slot -> the compacted context it is prefilled with
        for s in np.nonzero(running)[0]:
            r = slot_row[s]
            row, episode = rows[r], episodes[r]
            ids = gen.tokens[s]
            generated_tokens += len(ids)
            tool_turn = row["first_turn"] + len(row["boundaries"]) - 1  # the episode's turn, across segments
            row["tokens"] += ids.tolist()
            row["loss_mask"] += [1.0] * len(ids)
            row["turn_index"] += [tool_turn] * len(ids)
            row["logprobs"] += gen.logprobs[s].tolist()
            row["sampling_logprobs"] += gen.sampling_logprobs[s].tolist()
            text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
            episode.turn_texts.append(text)
            episode.final_text = text

            if TOOL_CALL_OPEN not in text:
                result = answer_reward(text, episode.gold, format_weight=rollout.format_weight)
                if result.has_answer:
                    row["status"] = "answered" if result.well_formed else "malformed_answer"
                    row["reward"] = result.reward
                    episode.answer = result.answer
            if row["status"] == "running":
                if gen.stop_reason[s] == sampler_lib.CONTEXT_FULL:
                    row["status"] = "context_overflow"
                elif tool_turn >= rollout.max_turns:
                    row["status"] = "max_turns"
            if row["status"] != "running":
                episode.status = row["status"]
                slot_row[s] = -1
                continue

            call = parse_tool_call(text)
            e0 = time.perf_counter()
            if isinstance(call, ToolCall):
                observation = browsers[r].execute(call.name, call.arguments)
                episode.tool_calls.append((call.name, call.arguments))
            else:
                observation = error_observation(call.message)
                episode.tool_calls.append(call.message)
            env_time += time.perf_counter() - e0
            if observation.startswith(ERROR_PREFIX):
                episode.num_tool_errors += 1
            observation = rollout.cut_observation(observation)
            episode.observations.append(observation)
            response = chat.tool_response_ids(observation, previous_ids=ids.tolist())
            if rollout.context_budget and len(row["tokens"]) + len(response) > rollout.context_budget:
                context = _compact(chat, rollout, schemas, episode)
                if len(context) >= max_len:
                    row["status"] = episode.status = "context_overflow"
                    slot_row[s] = -1
                    continue
                finished_segments[r].append(row)
                rows[r] = _segment(context, first_turn=tool_turn + 1)
                refills[s] = context
                continue
            if len(row["tokens"]) + len(response) >= max_len:  # no room for the observation and one more token
                row["status"] = episode.status = "context_overflow"
                slot_row[s] = -1
                continue
            append_observation(row, response)
            appends[s] = response
        timing["env"] += env_time
        timing["agent_host"] += time.perf_counter() - t0 - env_time

        if distributed.agree_any(bool(refills)):  # compacted rows start over in their slot, through admission
            t0 = time.perf_counter()
            state = sampler_lib.prefill_rows(config, params, state, list(refills), list(refills.values()), **chunks)
            timing["prefill"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        state = sampler_lib.append(config, params, state, appends, chunk_tokens=rollout.append_chunk_tokens)
        timing["append"] += time.perf_counter() - t0

    t0 = time.perf_counter()
    pad_id = chat.end_of_text_id if chat.end_of_text_id is not None else 0
    segment_rows, episode_of, first_turn = [], [], []
    for r, last in enumerate(rows):
        for segment in finished_segments[r] + [last]:
            segment["status"], segment["reward"] = last["status"], last["reward"]  # the episode's outcome
            segment_rows.append(segment)
            episode_of.append(r)
            first_turn.append(segment["first_turn"])
    batch = build_batch(segment_rows, max_len=max_len, max_turns=rollout.max_turns,
                        group_id=np.asarray(episode_of) // group, pad_id=pad_id, episode=episode_of,
                        first_turn=first_turn, placement=_batch_placement(mesh, rules))
    timing["pack"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - start
    return Rollout(batch=batch, episodes=episodes, timing=timing, generated_tokens=generated_tokens,
                   rows_at_once=slots * processes, kv_cache_bytes=kv_cache_bytes)


def _batch_placement(mesh, rules):
    """Where `build_batch` puts the batch's arrays: on one device without a mesh (as always); on a mesh of this
    process, rows over its batch axes where they divide (the layout its consumers, scoring and the update, read
    rows in), never whole on one device; on a mesh over several processes, on the host (this process's rows,
    which the loop assembles into the global update batch itself)."""
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


# ---------------------------------------------------------------------------------------------------- for engines
# The rules above as public pieces, for the paged engine (`rollout.engine`), which must give the same episodes.
def row_turn_keys(rng: jax.Array, rows, turns) -> jax.Array:
    """uint32 [N, 2]: the key of turn `turns[i]` of row `rows[i]`, `fold_in(fold_in(rng, turn), row)`: the keys
    `run_episodes` samples with (its step s then folds in s)."""
    return _row_keys(rng, np.asarray(rows, np.int32), np.asarray(turns, np.int32))


def append_observation(segment: dict, response: list[int]) -> None:
    """Append a tool response's ids to a row's bookkeeping dict (`new_segment`): untrained, outside every turn,
    zero log-probs, and a new state boundary after it; both engines record an observation this way."""
    segment["tokens"] += response
    segment["loss_mask"] += [0.0] * len(response)
    segment["turn_index"] += [-1] * len(response)
    segment["logprobs"] += [0.0] * len(response)
    segment["sampling_logprobs"] += [0.0] * len(response)
    segment["boundaries"].append(len(segment["tokens"]))


def new_segment(context: list[int], *, first_turn: int) -> dict:
    """A row's bookkeeping dict (tokens, masks, log-probs, boundaries, status) starting from `context` as its state
    `S_{first_turn}`, as `run_episodes` keeps it."""
    return _segment(context, first_turn=first_turn)


def task_episode(task, index: int) -> EpisodeRecord:
    """The empty `EpisodeRecord` of `task` (the `index`-th task: its id when the task has none)."""
    return EpisodeRecord(task_id=str(getattr(task, "task_id", index)), question=task.question, gold=_gold(task),
                         clues=tuple(getattr(task, "clues", ()) or ()))


def compact_context(chat: ChatFormat, rollout: RolloutConfig, schemas, episode: EpisodeRecord) -> list[int]:
    """The compacted context of `episode` after its latest observation (context management, module doc)."""
    return _compact(chat, rollout, schemas, episode)
