"""The rollout engine on a synthetic long-horizon workload, or on a config's own rollout.

Workload (issue 45): the tiny model (`tiny-qwen3`, random weights, the word tokenizer), `--rows` episodes of up to
`--turns` tool turns; each turn is a scripted tool call (`agent.ScriptedPolicy`) whose length is drawn from
`--turn-tokens` (min,max), and each tool call sleeps a latency drawn from `--latency-ms` (min,max) and returns a
few words.

Reported (best of `--repeats` for time; the counts are the same every repeat):
  * generated tokens/s (wall, compile excluded by warm-up runs);
  * useful row-step fraction: decode row-steps that produced a kept token / decode row-steps run;
  * KV positions read per generated token (the engine's work items), against the ragged minimum (the mean position
    of the generated tokens);
  * under a pool of 25% of the rows' total tokens (`--quarter`): preemptions, episodes lost (must be 0) and whether
    the episodes are the unbounded run's.

A logits hook makes the engine dispatch one decode step at a time (`sync_every` is 1 with a hook), so this measures
scheduling (tools beside decode, ragged reads), not the per-dispatch batching of free-running decode.

`--config FILE --init-from RUN_DIR` measures instead the loop's own rollout: one step's episodes of that config
(`prompts_per_step x group_size`, e.g. 6 x 8 = 48 on configs/study.gin) from the policy a run started RL from (its
`reference/` step 0, as benchmarks/step_bench.py reads it), collected by `RLPipeline.collect`, best of `--repeats`
after a warm-up. The dense engine this was compared against (issue 45: >= 2x its tokens/s) was removed; its side of
the comparison runs from the commits before its removal (`git log -- benchmarks/paged_engine_bench.py`).

Do not quote figures from a loaded machine: run it on an idle one. `--smoke` runs a few rows of short turns.

Usage:
  python benchmarks/paged_engine_bench.py [--rows 16] [--turns 8] [--turn-tokens 10,400] [--latency-ms 10,500]
                                          [--repeats 3] [--quarter] [--smoke]
  python benchmarks/paged_engine_bench.py --config configs/study.gin --init-from docs/results/study/grpo/seed0
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_jax import models  # noqa: E402
from trace_jax.models.chat import ChatFormat  # noqa: E402
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer  # noqa: E402
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy  # noqa: E402
from trace_jax.rollout import engine as engine_lib  # noqa: E402
from trace_jax.rollout import paged as paged_lib  # noqa: E402
from trace_jax.rollout.paged import PagedConfig  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "river", "city", "mayor", "flows", "through", "search", "open", "query",
         "answer", "north", "south", "page", "result"]


def pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 <= MIN <= MAX, got {text!r}")
    return low, high


class SleepyTools:
    """One task's tools: each call sleeps a drawn latency and returns a few words (drawn from the call's number)."""

    latency_ms = (10, 500)

    def __init__(self, task):
        self.task, self.calls = task, 0

    def execute(self, name, arguments):
        draw = random.Random(f"{self.task.task_id}/{self.calls}")
        self.calls += 1
        time.sleep(draw.uniform(*self.latency_ms) / 1000)
        return " ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 10)))


def workload(args, chat):
    draw = random.Random(0)
    tasks = [types.SimpleNamespace(task_id=f"t{i}", question=" ".join(draw.choice(WORDS) for _ in range(8)),
                                   answer="alpha") for i in range(args.rows)]
    scripts = []
    for _ in tasks:
        turns = []
        for _ in range(draw.randint(1, args.turns)):
            words = max(1, draw.randint(*args.turn_tokens) - 12)  # the call's JSON and tags take ~12 tokens
            query = " ".join(draw.choice(WORDS) for _ in range(words))
            turns.append(chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": query}}]))
        turns.append(chat.assistant_content_ids("<answer>alpha</answer>") + [chat.im_end_id])
        scripts.append(turns)
    context = 64 + (args.turns + 1) * (args.turn_tokens[1] + 48)
    rollout = RolloutConfig(max_turns=args.turns, max_context=context, turn_token_budget=args.turn_tokens[1] + 8,
                            max_observation_chars=80, system_prompt="Use tools.", with_tools=False,
                            sampling=SamplingConfig(greedy=True))
    return tasks, scripts, rollout


def compiles() -> int:
    return sum(paged_lib.compiled_programs(kind) for kind in ("paged_prefill", "paged_decode"))


def run_paged(config, params, chat, tasks, rollout, hook, paged):
    start = time.perf_counter()
    result = engine_lib.run_paged_episodes(config, params, chat, tasks, SleepyTools, rollout, jax.random.PRNGKey(0),
                                           paged=paged, logits_hook=hook)
    return result, time.perf_counter() - start


def study(args) -> None:
    """The loop's rollout on a config (see the module docstring)."""
    from trace_jax.credit.config import CreditConfig
    from trace_jax.rl.gin_setup import parse
    from trace_jax.rl.loop import build_environment
    from trace_jax.rl.pipeline import RLPipeline
    from trace_jax.train.checkpoint import Checkpointer
    from trace_jax.train.config import CheckpointConfig
    from trace_jax.train.optimizer import make_optimizer

    config = parse([args.config], list(args.gin_param))
    environment = build_environment(config, tempfile.mkdtemp(prefix="paged_bench_"))
    params = environment.params
    if args.init_from:
        with Checkpointer(CheckpointConfig(directory=str(Path(args.init_from) / "reference"),
                                           async_save=False)) as store:
            params = store.restore_params(0)
    tasks = environment.train_tasks[:config.train.prompts_per_step]
    pipeline = RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout,
                          CreditConfig(estimator="grpo"), config.loss, config.update, make_optimizer(config.optimizer))
    key = jax.random.PRNGKey(args.seed)

    def collect():
        start = time.perf_counter()
        result = pipeline.collect(params, tasks, key)
        jax.block_until_ready(result.batch.tokens)
        return result, time.perf_counter() - start

    for _ in range(args.warmups):  # the engine's shapes follow tool timing: warm up until nothing new compiles
        before = compiles()
        result, _ = collect()
        if compiles() == before:
            break
    before = compiles()
    seconds = []
    for _ in range(args.repeats):
        result, s = collect()
        seconds.append(s)
    tokens = result.generated_tokens
    lengths = np.asarray(result.batch.lengths)
    print(f"{args.config}{' from ' + args.init_from if args.init_from else ' (fresh policy)'}: {len(lengths)} rows, "
          f"lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), "
          f"{np.mean([len(e.turn_texts) for e in result.episodes]):.2f} turns an episode, {tokens} generated tokens; "
          f"load average {os.getloadavg()[0]:.1f}")
    stats = result.stats
    useful = stats.useful_row_steps / max(stats.row_steps, 1)
    print(f"best {min(seconds):.2f} s (runs: {' '.join(f'{s:.2f}' for s in seconds)}), "
          f"{tokens / min(seconds):.1f} tokens/s; useful row-steps {useful:.1%}, preemptions {stats.preemptions}; "
          f"programs compiled during the timed runs: {compiles() - before}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=pair, default=(10, 400))
    parser.add_argument("--latency-ms", type=pair, default=(10, 500))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quarter", action="store_true", help="also run the engine on a 25%% pool")
    parser.add_argument("--smoke", action="store_true", help="4 rows, 2 turns of 10-30 tokens, 1-5 ms tools")
    parser.add_argument("--config", default="", help="measure the loop's rollout on this gin file instead")
    parser.add_argument("--gin-param", action="append", default=[], help="an extra binding with --config")
    parser.add_argument("--init-from", default="", help="with --config: the run directory whose initial policy "
                        "(reference/ step 0) runs the episodes (default: a fresh policy)")
    parser.add_argument("--seed", type=int, default=0, help="with --config: the rollout key")
    parser.add_argument("--warmups", type=int, default=3, help="with --config: most warm-up rollouts (they stop at "
                        "the first that compiles nothing new)")
    args = parser.parse_args(argv)
    if args.config:
        return study(args)
    if args.smoke:
        args.rows, args.turns, args.turn_tokens, args.latency_ms, args.repeats = 4, 2, (10, 30), (1, 5), 1
        args.quarter = True
    SleepyTools.latency_ms = args.latency_ms

    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, Path(tempfile.mkdtemp())))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    tasks, scripts, rollout = workload(args, chat)
    hook = ScriptedPolicy(scripts, config.vocab_size)
    paged = PagedConfig(page_size=args.page_size)

    # The engine's shapes (decode rows, pages read) follow the tool latencies: warm up until a run compiles
    # nothing new, and report any compile that still lands in a timed run.
    for _ in range(5):
        before = compiles()
        run_paged(config, params, chat, tasks, rollout, hook, paged)
        if compiles() == before:
            break
    before = compiles()
    paged_s = []
    for _ in range(args.repeats):
        result, seconds = run_paged(config, params, chat, tasks, rollout, hook, paged)
        paged_s.append(seconds)
    timed_compiles = compiles() - before
    tokens = result.generated_tokens
    stats = result.stats
    print(f"workload: {args.rows} rows, <= {args.turns} turns of {args.turn_tokens} tokens, tools "
          f"{args.latency_ms} ms; {tokens} generated tokens")
    print(f"{'tokens/s':>10} {'useful row-steps':>17} {'KV read / token':>16}")
    print(f"{tokens / min(paged_s):10.1f} {stats.useful_row_steps / max(stats.row_steps, 1):17.1%} "
          f"{stats.kv_positions_read / max(tokens, 1):16.1f}")
    # the ragged minimum: a token generated at position p reads the p positions before it, no more
    mask = np.asarray(result.batch.loss_mask) == 1
    minimum = float(np.asarray(result.batch.positions)[mask].mean())
    ratio = stats.kv_positions_read / max(tokens, 1) / minimum
    print(f"ragged minimum KV read / token: {minimum:.1f} (the engine reads {ratio:.2f}x); programs compiled during "
          f"the timed runs: {timed_compiles}")
    if args.quarter:
        total = int(np.asarray(result.batch.lengths).sum())
        pages = max(total // 4 // args.page_size, -(-rollout.max_context // args.page_size))
        small, _ = run_paged(config, params, chat, tasks, rollout, hook, dataclasses.replace(paged, num_pages=pages))
        lost = sum(e.status == "running" for e in small.episodes)
        same = np.array_equal(small.batch.tokens, result.batch.tokens)
        print(f"pool of {pages} pages ({pages * args.page_size} of {total} tokens): {small.stats.preemptions} "
              f"preemptions, {lost} episodes lost, same episodes: {same}")


if __name__ == "__main__":
    main()
