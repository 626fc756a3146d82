"""Batched multi-turn ReAct loop: `B` prompts x `G` samples in lockstep, token-in/token-out.

One round = one assistant turn for every running row:

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

Bookkeeping per token (see `batch.TrajectoryBatch`): loss mask on generated tokens, turn index = number of
observations before the turn (the final turn's index is `num_turns`), boundaries S_0..S_T. Reward: the environment's
`answer_reward` on the final turn's text (0 unless the episode ended with an answer).

Tasks are anything with `question` and `answer` (optional `aliases`, `task_id`): procedural `Task`s or external
ones. Tools: one `Browser` (forked per row, so any corpus works) or a `task -> Browser` factory.

Test hook: `logits_hook(turn_of_row, step, generated)` returns a logit bias [N, V] (see `ScriptedPolicy`).

This module knows nothing about the model's internals, credit assignment or training.
"""

from __future__ import annotations

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

    def __post_init__(self):
        for name in ("group_size", "max_context", "turn_token_budget", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_turns < 0:
            raise ValueError(f"RolloutConfig.max_turns must be >= 0, got {self.max_turns!r}")
        if self.max_observation_chars < 0:
            raise ValueError("RolloutConfig.max_observation_chars must be >= 0 (0 = no limit)")

    def cut_observation(self, observation: str) -> str:
        """The observation as the policy is shown it: cut to `max_observation_chars` (then " ..." marks the cut)."""
        if self.max_observation_chars and len(observation) > self.max_observation_chars:
            return observation[:self.max_observation_chars] + " ..."
        return observation


@dataclasses.dataclass
class Rollout:
    """What `run_episodes` returns: the device batch, one `EpisodeRecord` per row, and phase timings (seconds)."""

    batch: TrajectoryBatch
    episodes: list[EpisodeRecord]
    timing: dict[str, float]
    generated_tokens: int


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


def run_episodes(config: ModelConfig, params, chat: ChatFormat, tasks: Sequence[Any],
                 browser: Browser | Callable[[Any], Browser], rollout: RolloutConfig, rng: jax.Array, *,
                 mesh=None, rules=None,
                 logits_hook: Callable[[np.ndarray, int, list], np.ndarray | None] | None = None) -> Rollout:
    """Run `len(tasks) x rollout.group_size` episodes in lockstep and pack them into a `TrajectoryBatch`.

    Args:
      config, params: the policy (params already placed/sharded on `mesh` when one is given).
      chat: the `ChatFormat` of the policy's tokenizer.
      tasks: objects with `question`, `answer` (and optional `aliases`, `task_id`).
      browser: a `Browser` (each row gets `browser.fork()`) or a factory `task -> Browser`.
      rollout: limits and sampling.
      rng: PRNG key; turn k samples with `fold_in(rng, k)`.
      mesh, rules: shard rows (and kv heads) of the sampler state on this mesh.
      logits_hook: test hook (see `ScriptedPolicy`).

    Raises:
      ValueError: a prompt does not fit in `max_context` (the message gives the length).
    """
    start = time.perf_counter()
    timing = {"prefill": 0.0, "generate": 0.0, "env": 0.0, "agent_host": 0.0, "append": 0.0, "pack": 0.0}
    group = rollout.group_size
    n = len(tasks) * group
    max_len = rollout.max_context
    tokenizer = chat.tokenizer
    stop_strings = (sampler_lib.StopStrings(tokenizer, chat.assistant_stop_strings)
                    if chat.assistant_stop_strings else None)
    schemas = tool_schemas() if rollout.with_tools else None

    rows: list[dict] = []
    episodes: list[EpisodeRecord] = []
    browsers: list[Browser] = []
    for t, task in enumerate(tasks):
        prompt = chat.prompt_ids(rollout.system_prompt, task.question, schemas)
        if len(prompt) >= max_len:
            raise ValueError(f"task {t}: the prompt has {len(prompt)} tokens but max_context={max_len}; raise "
                             "RolloutConfig.max_context or shorten the system prompt")
        for _ in range(group):
            rows.append({"tokens": list(prompt), "loss_mask": [0.0] * len(prompt), "turn_index": [-1] * len(prompt),
                         "logprobs": [0.0] * len(prompt), "sampling_logprobs": [0.0] * len(prompt),
                         "boundaries": [len(prompt)], "reward": 0.0, "status": "running"})
            episodes.append(EpisodeRecord(task_id=str(getattr(task, "task_id", t)), question=task.question,
                                          gold=_gold(task), clues=tuple(getattr(task, "clues", ()) or ())))
            browsers.append(browser.fork() if isinstance(browser, Browser) else browser(task))

    t0 = time.perf_counter()
    state = sampler_lib.init_state(config, n, max_len, mesh=mesh, rules=rules)
    # The G samples of a prompt share one prefill (one pass per prompt, keys/values copied to its G rows).
    state = sampler_lib.prefill_groups(config, params, state, [r["tokens"] for r in rows[::group]], group)
    jax.block_until_ready(state.logits)
    timing["prefill"] += time.perf_counter() - t0

    generated_tokens = 0
    turn = 0
    running = np.ones(n, bool)
    while running.any():
        turn_of_row = np.full(n, turn, np.int64)
        hook = None if logits_hook is None else (lambda step, gen: logits_hook(turn_of_row, step, gen))
        budget = np.asarray([min(rollout.turn_token_budget, max_len - len(r["tokens"])) for r in rows], np.int32)
        t0 = time.perf_counter()
        state, gen = sampler_lib.generate(
            config, params, state, rng=jax.random.fold_in(rng, turn), active=running, max_new_tokens=budget,
            stop_ids=chat.assistant_stop_ids, sampling=rollout.sampling, stop_strings=stop_strings,
            logits_hook=hook, sync_every=rollout.sync_every)
        timing["generate"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        env_time = 0.0
        appends: list[list[int]] = [[] for _ in range(n)]
        for r in np.nonzero(running)[0]:
            row, episode = rows[r], episodes[r]
            ids = gen.tokens[r]
            generated_tokens += len(ids)
            tool_turn = len(row["boundaries"]) - 1
            row["tokens"] += ids.tolist()
            row["loss_mask"] += [1.0] * len(ids)
            row["turn_index"] += [tool_turn] * len(ids)
            row["logprobs"] += gen.logprobs[r].tolist()
            row["sampling_logprobs"] += gen.sampling_logprobs[r].tolist()
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
                if gen.stop_reason[r] == sampler_lib.CONTEXT_FULL:
                    row["status"] = "context_overflow"
                elif tool_turn >= rollout.max_turns:
                    row["status"] = "max_turns"
            if row["status"] != "running":
                episode.status = row["status"]
                running[r] = False
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
            if len(row["tokens"]) + len(response) >= max_len:  # no room for the observation and one more token
                row["status"] = episode.status = "context_overflow"
                running[r] = False
                continue
            row["tokens"] += response
            row["loss_mask"] += [0.0] * len(response)
            row["turn_index"] += [-1] * len(response)
            row["logprobs"] += [0.0] * len(response)
            row["sampling_logprobs"] += [0.0] * len(response)
            row["boundaries"].append(len(row["tokens"]))
            appends[r] = response
        timing["env"] += env_time
        timing["agent_host"] += time.perf_counter() - t0 - env_time

        t0 = time.perf_counter()
        if running.any():
            state = sampler_lib.append(config, params, state, appends)
        timing["append"] += time.perf_counter() - t0
        turn += 1

    t0 = time.perf_counter()
    pad_id = chat.end_of_text_id if chat.end_of_text_id is not None else 0
    batch = build_batch(rows, max_len=max_len, max_turns=rollout.max_turns,
                        group_id=np.repeat(np.arange(len(tasks)), group), pad_id=pad_id)
    timing["pack"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - start
    return Rollout(batch=batch, episodes=episodes, timing=timing, generated_tokens=generated_tokens)
