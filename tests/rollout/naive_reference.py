"""Test-only references without a KV cache: every token comes from the full model forward over the row's whole token
list so far. Slow and simple on purpose; the engine and its programs are checked against them.

  * `greedy_episodes`: `run_episodes`' episodes, greedy, one row at a time, with the episode rules (answer,
    max_turns, context overflow, tool errors, compaction, stop strings) restated step by step here.
  * `generate_without_cache`: rows decoded from their prompts for any sampling setting, with the decode
    programs' keys (row r's t-th token: `fold_in(keys[r], t)`; one key for the batch: `fold_in(key, t)`).
"""

from __future__ import annotations

import functools
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.envs.answers import answer_reward
from trace_jax.envs.browser import ERROR_PREFIX, Browser, tool_schemas
from trace_jax.models import decoder as dec
from trace_jax.models.chat import TOOL_CALL_OPEN, ToolCall, parse_tool_call
from trace_jax.rollout import agent as agent_lib
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.batch import EpisodeRecord, build_batch


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(config, params, tokens, lengths):
    """Float32 logits [B, V] at each row's last token (tokens [B, W] right-padded; causal, so padding is unseen)."""
    hidden = dec.forward_hidden(config, params, tokens)
    return dec.logits_from_hidden(config, params, hidden[jnp.arange(tokens.shape[0]), lengths - 1])


def _segment(context, first_turn):
    return {"tokens": list(context), "loss_mask": [0.0] * len(context), "turn_index": [-1] * len(context),
            "logprobs": [0.0] * len(context), "sampling_logprobs": [0.0] * len(context),
            "boundaries": [len(context)], "reward": 0.0, "status": "running", "first_turn": first_turn}


def greedy_episodes(config, params, chat, tasks, browser, rollout, *, logits_hook=None):
    """The episodes of `tasks` x `rollout.group_size` rows under greedy decoding, as `run_episodes` must give them:
    a namespace with `batch` (a `TrajectoryBatch`), `episodes` and `generated_tokens`. `rollout.sampling` is
    ignored (argmax). `logits_hook` as for `run_episodes` (called with this row's turn and its ids only)."""
    max_len = rollout.max_context
    schemas = tool_schemas() if rollout.with_tools else None
    stop_ids = set(int(i) for i in chat.assistant_stop_ids)
    stops = sampler_lib.StopStrings(chat.tokenizer, chat.assistant_stop_strings) \
        if chat.assistant_stop_strings else None
    rows = len(tasks) * rollout.group_size
    segment_rows, episode_of, episodes, generated = [], [], [], 0
    for t, task in enumerate(tasks):
        prompt = chat.prompt_ids(rollout.system_prompt, task.question, schemas)
        for _ in range(rollout.group_size):
            r = len(episodes)
            aliases = tuple(str(a) for a in (getattr(task, "aliases", ()) or ()))
            episode = EpisodeRecord(task_id=str(getattr(task, "task_id", t)), question=task.question,
                                    gold=(str(task.answer),) + aliases, clues=tuple(getattr(task, "clues", ()) or ()))
            episodes.append(episode)
            tools = browser.fork() if isinstance(browser, Browser) else browser(task)
            segments = [_segment(prompt, 0)]
            while True:
                seg = segments[-1]
                ids, logprobs = [], []
                budget = min(rollout.turn_token_budget, max_len - len(seg["tokens"]))
                reason = None
                while reason is None:
                    context = seg["tokens"] + ids
                    padded = np.zeros((1, max_len), np.int32)
                    padded[0, :len(context)] = context
                    logits = np.asarray(_last_logits(config, params, padded, np.asarray([len(context)])))[0]
                    if logits_hook is not None:
                        turn_of_row = np.zeros(rows, np.int64)
                        turn_of_row[r] = len(episode.turn_texts)
                        by_row = [[] for _ in range(rows)]
                        by_row[r] = list(ids)
                        bias = logits_hook(turn_of_row, len(ids), by_row)
                        if bias is not None:
                            logits = logits + np.asarray(bias, np.float32)[r]
                    token = int(np.argmax(logits))
                    shifted = logits.astype(np.float64) - logits.max()
                    ids.append(token)
                    logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
                    hit = stops.first_stop(ids) if stops is not None and stops.strings else None
                    if hit is not None:  # a completed stop string ends the turn; nothing after it is kept
                        del ids[hit + 1:], logprobs[hit + 1:]
                        reason = sampler_lib.STOP_STRING
                    elif token in stop_ids:
                        reason = sampler_lib.STOP_TOKEN
                    elif len(seg["tokens"]) + len(ids) >= max_len:
                        reason = sampler_lib.CONTEXT_FULL
                    elif len(ids) >= budget:
                        reason = sampler_lib.BUDGET
                generated += len(ids)
                turn = seg["first_turn"] + len(seg["boundaries"]) - 1
                seg["tokens"] += ids
                seg["loss_mask"] += [1.0] * len(ids)
                seg["turn_index"] += [turn] * len(ids)
                seg["logprobs"] += logprobs
                seg["sampling_logprobs"] += [0.0] * len(ids)
                text = chat.tokenizer.decode(ids, skip_special_tokens=False)
                episode.turn_texts.append(text)
                episode.final_text = text
                status = None
                if TOOL_CALL_OPEN not in text:
                    result = answer_reward(text, episode.gold, format_weight=rollout.format_weight)
                    if result.has_answer:
                        status = "answered" if result.well_formed else "malformed_answer"
                        seg["reward"], episode.answer = result.reward, result.answer
                if status is None and reason == sampler_lib.CONTEXT_FULL:
                    status = "context_overflow"
                elif status is None and turn >= rollout.max_turns:
                    status = "max_turns"
                if status is None:
                    call = parse_tool_call(text)
                    if isinstance(call, ToolCall):
                        observation = tools.execute(call.name, call.arguments)
                        episode.tool_calls.append((call.name, call.arguments))
                    else:
                        observation = ERROR_PREFIX + call.message
                        episode.tool_calls.append(call.message)
                    episode.num_tool_errors += observation.startswith(ERROR_PREFIX)
                    observation = rollout.cut_observation(observation)
                    episode.observations.append(observation)
                    response = chat.tool_response_ids(observation, previous_ids=ids)
                    if rollout.context_budget and len(seg["tokens"]) + len(response) > rollout.context_budget:
                        compacted = agent_lib.compact_context(chat, rollout, schemas, episode)
                        if len(compacted) < max_len:
                            segments.append(_segment(compacted, turn + 1))
                            continue
                        status = "context_overflow"
                    elif len(seg["tokens"]) + len(response) >= max_len:
                        status = "context_overflow"
                    else:
                        seg["tokens"] += response
                        seg["loss_mask"] += [0.0] * len(response)
                        seg["turn_index"] += [-1] * len(response)
                        seg["logprobs"] += [0.0] * len(response)
                        seg["sampling_logprobs"] += [0.0] * len(response)
                        seg["boundaries"].append(len(seg["tokens"]))
                        continue
                episode.status = status
                for segment in segments:
                    segment["status"], segment["reward"] = status, seg["reward"]
                    segment_rows.append(segment)
                    episode_of.append(r)
                break
    pad_id = chat.end_of_text_id if chat.end_of_text_id is not None else 0
    batch = build_batch(segment_rows, max_len=max_len, max_turns=rollout.max_turns,
                        group_id=np.asarray(episode_of) // rollout.group_size, pad_id=pad_id, episode=episode_of,
                        first_turn=[s["first_turn"] for s in segment_rows])
    return types.SimpleNamespace(batch=batch, episodes=episodes, generated_tokens=generated)


def generate_without_cache(config, params, prompts: Sequence[Sequence[int]], *, rng, max_new_tokens,
                           stop_ids: Sequence[int], sampling=sampler_lib.SamplingConfig(),
                           max_len: int | None = None) -> types.SimpleNamespace:
    """Rows decoded from `prompts` until each stops (a stop id, then a full row of `max_len`, then its budget:
    `max_new_tokens`, an int or one per row), without a cache: every step runs the full forward over each row's
    whole sequence and draws with `sampler.sample_from_logits`. Step t is keyed `fold_in(rng, t)`, row by row for
    per-row keys ([B, 2]): the key of a row's t-th token in `paged.decode_program`. Returns per row `tokens`,
    `logprobs`, `sampling_logprobs` (lists of [n_r] arrays), `stop_reason` [B] (`sampler.STOP_REASONS`) and
    `steps`."""
    batch = len(prompts)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,))
    width = max_len or sampler_lib.bucket_length(int(lengths.max()) + int(budget.max()))
    buffer = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        dec.check_token_ids(config, np.asarray(prompt, np.int64), f"prompt {row}")
        buffer[row, :len(prompt)] = prompt
    active = budget > 0
    stops = set(int(s) for s in stop_ids)
    reason = np.zeros(batch, np.int32)
    out_tokens, out_lp, out_slp = ([[] for _ in range(batch)] for _ in range(3))
    rng = jnp.asarray(rng)
    per_row = rng.ndim == 2
    step = 0
    while active.any():
        logits = _last_logits(config, params, jnp.asarray(buffer), jnp.asarray(lengths))
        keys = jax.vmap(lambda key: jax.random.fold_in(key, step))(rng) if per_row else jax.random.fold_in(rng, step)
        tokens, lp, slp = (np.asarray(x) for x in sampler_lib.sample_from_logits(logits, keys, sampling))
        step += 1
        for row in np.nonzero(active)[0]:
            out_tokens[row].append(int(tokens[row]))
            out_lp[row].append(float(lp[row]))
            out_slp[row].append(float(slp[row]))
            buffer[row, lengths[row]] = tokens[row]
            lengths[row] += 1
            if int(tokens[row]) in stops:
                active[row], reason[row] = False, sampler_lib.STOP_TOKEN
            elif lengths[row] >= width:
                active[row], reason[row] = False, sampler_lib.CONTEXT_FULL
            elif len(out_tokens[row]) >= budget[row]:
                active[row], reason[row] = False, sampler_lib.BUDGET
    return types.SimpleNamespace(tokens=[np.asarray(t, np.int32) for t in out_tokens],
                                 logprobs=[np.asarray(t, np.float32) for t in out_lp],
                                 sampling_logprobs=[np.asarray(t, np.float32) for t in out_slp],
                                 stop_reason=reason, steps=step)
