"""Paged engine against the dense engine, side by side in one run, on a synthetic long-horizon workload.

Workload (issue 45): the tiny model (`tiny-qwen3`, random weights, the word tokenizer), `--rows` episodes of up to
`--turns` tool turns; each turn is a scripted tool call (`agent.ScriptedPolicy`) whose length is drawn from
`--turn-tokens` (min,max), and each tool call sleeps a latency drawn from `--latency-ms` (min,max) and returns a
few words. Both engines run the same episodes (the tokens are checked equal) from the same key.

Reported per engine (best of `--repeats` for time; the counts are the same every repeat):
  * generated tokens/s (wall, compile excluded by a warm-up run);
  * useful row-step fraction: decode row-steps that produced a kept token / decode row-steps run (the dense
    engine's row-steps are its slots x steps of every `generate` call, read by wrapping `sampler.generate`);
  * KV positions read per generated token (paged: its work items, against the ragged minimum: the mean position of
    the generated tokens; dense: slots x attended bucket per step is not recorded, so only the paged figure);
  * under a pool of 25% of the rows' total tokens (`--quarter`): preemptions and episodes lost (must be 0).

A logits hook makes both engines dispatch one decode step at a time (`sync_every` is 1 with a hook), so this measures
scheduling (round barriers, serial tools, batch-max reads), not the per-dispatch batching of free-running decode.

`--config FILE --init-from RUN_DIR` measures instead the loop's own rollout: one step's episodes of that config
(`prompts_per_step x group_size`, e.g. 6 x 8 = 48 on configs/study.gin) from the policy a run started RL from
(its `reference/` step 0, as benchmarks/step_bench.py reads it), collected by `RLPipeline.collect` with
`RolloutConfig.engine` 'dense' and 'paged' (everything else as the config says: its sampling, its tools), the same key,
interleaved, best of `--repeats` after a warm-up; generated tokens/s per engine and their ratio (issue 45: >= 2x).

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
from trace_jax.rollout import agent as agent_lib  # noqa: E402
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


def run_dense(config, params, chat, tasks, rollout, hook):
    row_steps = [0]
    generate = agent_lib.sampler_lib.generate

    def counting(config_, params_, state, **kwargs):
        state, gen = generate(config_, params_, state, **kwargs)
        row_steps[0] += state.cache.batch_size * gen.steps
        return state, gen

    agent_lib.sampler_lib.generate = counting
    try:
        start = time.perf_counter()
        result = agent_lib.run_episodes(config, params, chat, tasks, SleepyTools, rollout, jax.random.PRNGKey(0),
                                        logits_hook=hook)
        seconds = time.perf_counter() - start
    finally:
        agent_lib.sampler_lib.generate = generate
    return result, seconds, row_steps[0]


def run_paged(config, params, chat, tasks, rollout, hook, paged):
    start = time.perf_counter()
    result = engine_lib.run_paged_episodes(config, params, chat, tasks, SleepyTools, rollout, jax.random.PRNGKey(0),
                                           paged=paged, logits_hook=hook)
    return result, time.perf_counter() - start


def study(args) -> None:
    """The loop's rollout on a config (see the module docstring), dense against paged."""
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
    optimizer = make_optimizer(config.optimizer)
    pipelines = {engine: RLPipeline(environment.model_config, environment.chat, environment.browser,
                                    dataclasses.replace(config.rollout, engine=engine), CreditConfig(estimator="grpo"),
                                    config.loss, config.update, optimizer)
                 for engine in ("dense", "paged")}
    key = jax.random.PRNGKey(args.seed)

    def collect(engine):
        start = time.perf_counter()
        result = pipelines[engine].collect(params, tasks, key)
        jax.block_until_ready(result.batch.tokens)
        return result, time.perf_counter() - start

    results = {engine: collect(engine)[0] for engine in pipelines}  # warm-up: compiles
    for _ in range(2):  # the paged engine's shapes follow tool timing: warm up until nothing new compiles
        before = compiles()
        results["paged"] = collect("paged")[0]
        if compiles() == before:
            break
    seconds = {engine: [] for engine in pipelines}
    before = compiles()
    for repeat in range(args.repeats):
        for engine in (("dense", "paged") if repeat % 2 == 0 else ("paged", "dense")):
            results[engine], s = collect(engine)
            seconds[engine].append(s)
    dense, paged = results["dense"], results["paged"]
    same = all(np.array_equal(np.asarray(getattr(dense.batch, f)), np.asarray(getattr(paged.batch, f)))
               for f in ("tokens", "lengths"))
    tokens = dense.generated_tokens
    lengths = np.asarray(dense.batch.lengths)
    print(f"{args.config}{' from ' + args.init_from if args.init_from else ' (fresh policy)'}: {len(lengths)} rows, "
          f"lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), "
          f"{np.mean([len(e.turn_texts) for e in dense.episodes]):.2f} turns an episode, {tokens} generated tokens; "
          f"same episodes: {same}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'engine':8} {'best s':>8} {'all runs (s)':>30} {'tokens/s':>10}")
    for engine in pipelines:
        runs = " ".join(f"{s:.2f}" for s in seconds[engine])
        print(f"{engine:8} {min(seconds[engine]):8.2f} {runs:>30} {tokens / min(seconds[engine]):10.1f}")
    stats = paged.stats
    print(f"paged / dense tokens/s: {min(seconds['dense']) / min(seconds['paged']):.2f}x; paged useful row-steps "
          f"{stats.useful_row_steps / max(stats.row_steps, 1):.1%}, preemptions {stats.preemptions}; paged programs "
          f"compiled during the timed runs: {compiles() - before}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=pair, default=(10, 400))
    parser.add_argument("--latency-ms", type=pair, default=(10, 500))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quarter", action="store_true", help="also run the paged engine on a 25%% pool")
    parser.add_argument("--smoke", action="store_true", help="4 rows, 2 turns of 10-30 tokens, 1-5 ms tools")
    parser.add_argument("--config", default="", help="measure the loop's rollout on this gin file instead")
    parser.add_argument("--gin-param", action="append", default=[], help="an extra binding with --config")
    parser.add_argument("--init-from", default="", help="with --config: the run directory whose initial policy "
                        "(reference/ step 0) runs the episodes (default: a fresh policy)")
    parser.add_argument("--seed", type=int, default=0, help="with --config: the rollout key")
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

    run_dense(config, params, chat, tasks, rollout, hook)  # warm-up: compile
    # The paged engine's shapes (decode rows, pages read) follow the tool latencies: warm up until a run compiles
    # nothing new, and report any compile that still lands in a timed run.
    for _ in range(4):
        before = compiles()
        run_paged(config, params, chat, tasks, rollout, hook, paged)
        if compiles() == before:
            break
    before = compiles()
    dense_s, paged_s = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same load
        dense, seconds, dense_row_steps = run_dense(config, params, chat, tasks, rollout, hook)
        dense_s.append(seconds)
        result, seconds = run_paged(config, params, chat, tasks, rollout, hook, paged)
        paged_s.append(seconds)
    timed_compiles = compiles() - before
    same = all(np.array_equal(getattr(dense.batch, f), getattr(result.batch, f)) for f in ("tokens", "status"))
    tokens = dense.generated_tokens
    stats = result.stats
    print(f"workload: {args.rows} rows, <= {args.turns} turns of {args.turn_tokens} tokens, tools "
          f"{args.latency_ms} ms; {tokens} generated tokens; same episodes: {same}")
    print(f"{'engine':8} {'tokens/s':>10} {'useful row-steps':>17} {'KV read / token':>16}")
    print(f"{'dense':8} {tokens / min(dense_s):10.1f} {tokens / max(dense_row_steps, 1):17.1%} {'-':>16}")
    print(f"{'paged':8} {tokens / min(paged_s):10.1f} {stats.useful_row_steps / max(stats.row_steps, 1):17.1%} "
          f"{stats.kv_positions_read / max(tokens, 1):16.1f}")
    # the ragged minimum: a token generated at position p reads the p positions before it, no more
    mask = np.asarray(dense.batch.loss_mask) == 1
    minimum = float(np.asarray(dense.batch.positions)[mask].mean())
    ratio = stats.kv_positions_read / max(tokens, 1) / minimum
    print(f"ragged minimum KV read / token: {minimum:.1f} (paged reads {ratio:.2f}x)")
    print(f"paged / dense tokens/s: {min(dense_s) / min(paged_s):.2f}x (paged programs compiled during the timed "
          f"runs: {timed_compiles})")
    if args.quarter:
        total = int(np.asarray(dense.batch.lengths).sum())
        pages = max(total // 4 // args.page_size, -(-rollout.max_context // args.page_size))
        small, _ = run_paged(config, params, chat, tasks, rollout, hook, dataclasses.replace(paged, num_pages=pages))
        lost = sum(e.status == "running" for e in small.episodes)
        same = np.array_equal(small.batch.tokens, dense.batch.tokens)
        print(f"pool of {pages} pages ({pages * args.page_size} of {total} tokens): {small.stats.preemptions} "
              f"preemptions, {lost} episodes lost, same episodes: {same}")


if __name__ == "__main__":
    main()
