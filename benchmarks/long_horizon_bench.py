"""The rollout engine on issue 45's synthetic long-horizon workload, beside the dense engine it replaced.

Workload (seeded, `Workload`): tiny.gin's model (random weights) on a word tokenizer; `--rows` episodes (one task
each, group size 1) of a number of turns drawn from 1..`--turns`; every turn's length in tokens is drawn from
`--turn-tokens`: the last turn answers (`... <answer>alpha</answer><|im_end|>`), the others are tool calls
(`<tool_call>` a search whose query fills the length `</tool_call>`; a call needs at least `call_tokens(chat)`, 27
here, so a draw below that is a text turn without a call, which the engine answers at once with an error
observation). Each tool
call sleeps a latency drawn from `--latency-ms` (from the task and the call's number, so not from timing) and
returns 2-10 words. Greedy; `RolloutConfig.sync_every` and the engine's other settings are the defaults except
`tool_workers` = rows (a tool call is a wait on a remote service, not host work: with the default 4 threads the
tools, not the engine, would set the pace) and the pool (unbounded, or `--quarter` of the rows' tokens).

The policy is the test hook `agent.ScriptedPolicy(..., blocks=True)`: it forces each scripted token by a logit bias
and gives the engine a block's biases at once, so the engine decodes in its blocks of `sync_every` steps exactly
as for a free-running policy, rows stopping mid-block when their turn's stop token comes. (A hook without blocks
makes the engine decode one step a dispatch, which hides the mid-block waste; a free-running random model makes no
valid tool call, so no tool would run.) The engine never sees the scripts: it learns a turn's end from its tokens.

Reported, from the engine's `EngineStats` and the episodes:
  * useful row-steps: `useful_row_steps / row_steps` (decode batch rows x steps that generated a kept token);
  * KV positions read per generated token against the ragged minimum (`ragged_minimum`: the token at position p
    attends to p + 1 positions, computed from the batch's tokens, not the engine);
  * at a pool of 25% of the rows' tokens: preemptions, recomputed tokens and episodes lost (an episode not finished
    or not token-for-token the unbounded run's);
  * generated tokens/s and wall time (a rollout after `--warmups` warm-up rollouts; programs compiled during it).

The dense engine (`--dense TREE`: a checkout of 40610b8, the last commit with it) runs in a subprocess on that
tree. It has only the per-step hook, and with a hook it decodes one step a dispatch over its whole cache
(`[rows, max_context]`, no `attend_len`), so on the full workload it is too slow to run here; it runs on
`--dense-turns` (a shorter workload of the same draws), where its decode row-steps are counted around its
`sampler.generate` (cache rows x steps of each call). Its count follows from the episodes alone (it runs all rows
in rounds, one turn each, every call until the round's longest turn ends: `dense_row_steps`); the benchmark checks
the formula against the counted run and gives the full workload's figure from the formula, at one step a sync (its
hooked run) and at `sync_every` steps (its free-running schedule). Its wall time there is at least the sum of the
tool latencies (it runs the tools one after another).

`--smoke` (4 rows of <= 3 turns of 10-60 tokens, 1-5 ms tools, a 25% pool) checks the machinery; it is compile-bound
(about 40 s a rollout on a busy 2-core machine). Measured figures: docs/rollout.md, "Long-horizon workload".

Usage (run it on an idle machine for times; counts do not depend on the load):
  python benchmarks/long_horizon_bench.py [--rows 32] [--turns 60] [--turn-tokens 10,400] [--latency-ms 10,500]
      [--seed 0] [--warmups 1] [--quarter] [--dense /path/to/40610b8 --dense-turns 8] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--child-dense" not in sys.argv:  # the dense child imports the other tree's package (PYTHONPATH)
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "river", "city", "mayor", "flows", "through", "search", "open", "query",
         "answer", "north", "south", "page", "result"]
MAX_OBSERVATION_CHARS = 80


def pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 <= MIN <= MAX, got {text!r}")
    return low, high


class SleepyTools:
    """One task's tools: each call sleeps a latency drawn from (task, call number) and returns 2-10 words."""

    latency_ms = (10, 500)

    def __init__(self, task):
        self.task, self.calls = task, 0

    @classmethod
    def latency(cls, task_id: str, call: int) -> float:
        return random.Random(f"{task_id}/{call}").uniform(*cls.latency_ms) / 1000

    def execute(self, name, arguments):
        seconds = self.latency(self.task.task_id, self.calls)
        draw = random.Random(f"{self.task.task_id}/{self.calls}/words")
        self.calls += 1
        time.sleep(seconds)
        return " ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 10)))


@dataclasses.dataclass
class Workload:
    """The seeded episodes: `tasks`, each row's turns' token ids (`scripts`), the rollout settings."""

    tasks: list
    scripts: list  # [row][turn] -> ids
    rollout: object
    lengths: list  # [row][turn] -> tokens of the turn (the draws)

    @property
    def turns(self) -> list[int]:
        return [len(row) for row in self.scripts]


def build_workload(chat, rows: int, turns: int, turn_tokens: tuple[int, int], seed: int, *, rollout_cls,
                   sampling_cls, turn_limit: int | None = None, **rollout_fields) -> Workload:
    """`rows` episodes of 1..`turns` turns of `turn_tokens` tokens each (see the module doc). `turn_limit` keeps the
    first turns of each episode only (the dense engine's shorter workload: the same draws, the last kept turn then
    answers)."""
    draw = random.Random(seed)
    tasks, scripts, lengths = [], [], []
    for r in range(rows):
        tasks.append(types.SimpleNamespace(task_id=f"t{r}", question=" ".join(draw.choice(WORDS) for _ in range(8)),
                                           answer="alpha"))
        count = draw.randint(1, turns)
        wanted = [draw.randint(*turn_tokens) for _ in range(count)]
        if turn_limit is not None:
            wanted = wanted[:turn_limit]
        row = []
        for k, length in enumerate(wanted):
            row.append(_answer(chat, length) if k == len(wanted) - 1 else _call(chat, length, draw))
        scripts.append(row)
        lengths.append([len(ids) for ids in row])
    prompt = max(len(chat.prompt_ids("Use tools.", t.question, None)) for t in tasks)
    observation = len(chat.tool_response_ids("x" * MAX_OBSERVATION_CHARS, previous_ids=[chat.im_end_id])) + 8
    longest = max(prompt + sum(row) + (len(row) - 1) * observation for row in lengths)
    rollout = rollout_cls(max_turns=max(len(row) for row in scripts) - 1, max_context=-(-(longest + 1) // 16) * 16,
                          turn_token_budget=max(max(row) for row in lengths),
                          max_observation_chars=MAX_OBSERVATION_CHARS, system_prompt="Use tools.", with_tools=False,
                          sampling=sampling_cls(greedy=True), **rollout_fields)
    return Workload(tasks=tasks, scripts=scripts, rollout=rollout, lengths=lengths)


def _words(draw, count: int) -> str:
    return " ".join(draw.choice(WORDS) for _ in range(count))


def _search(chat, query: str) -> list[int]:
    return chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": query}}])


def call_tokens(chat) -> int:
    """The tokens of the shortest search call (a one-word query; each further word is one token)."""
    return len(_search(chat, WORDS[0]))


def _call(chat, length: int, draw) -> list[int]:
    """A turn of exactly `length` tokens: a search call (its query one token a word) or, below `call_tokens`, text
    ending with `<|im_end|>` (no call: an error observation follows)."""
    shortest = call_tokens(chat)
    if length < shortest:
        ids = chat.assistant_content_ids(_words(draw, length - 1)) + [chat.im_end_id]
    else:
        ids = _search(chat, _words(draw, length - shortest + 1))
    return _exactly(ids, length)


def _answer(chat, length: int) -> list[int]:
    """The answering turn of `length` tokens: words, then `<answer>alpha</answer><|im_end|>`."""
    pad = max(1, length - 5)  # pad words, a space, the answer's 3 tokens, <|im_end|>
    return _exactly(chat.assistant_content_ids(" ".join(["north"] * pad) + " <answer>alpha</answer>")
                    + [chat.im_end_id], max(length, 6))


def _exactly(ids: list[int], length: int) -> list[int]:
    if len(ids) != length:
        raise AssertionError(f"a turn of {length} tokens came out as {len(ids)}: the tokenizer is not the word "
                             "tokenizer this workload counts with")
    return ids


def ragged_minimum(loss_mask: np.ndarray) -> int:
    """KV positions the generated tokens must read at least: the token at position p attends to p + 1 positions
    (the p before it and its own), summed over every position where `loss_mask` is 1."""
    rows, positions = np.nonzero(np.asarray(loss_mask) == 1)
    return int((positions + 1).sum())


def ragged_minimum_from_turns(boundaries: np.ndarray, num_turns: np.ndarray, turn_lengths: list[list[int]]) -> int:
    """The same sum from the turn structure: turn k of a row starts at its boundary `S_k` and has the row's k-th
    turn length; its i-th token sits at `S_k + i`."""
    total = 0
    for row, lengths in enumerate(turn_lengths):
        for k, length in enumerate(lengths[:int(num_turns[row]) + 1]):
            start = int(boundaries[row, k])
            total += length * (start + 1) + length * (length - 1) // 2
    return total


def dense_row_steps(turn_lengths: list[list[int]], slots: int, sync: int) -> int:
    """The dense engine's decode row-steps on these episodes (40610b8's `run_episodes` with every row admitted at
    once): round k runs turn k of every row that has one, its `generate` call decodes all `slots` cache rows until
    the round's longest turn stops, checking every `sync` steps."""
    total, k = 0, 0
    while True:
        longest = max((row[k] for row in turn_lengths if len(row) > k), default=0)
        if not longest:
            return total
        total += slots * -(-longest // sync) * sync
        k += 1


def episode_key(batch, episodes, row: int) -> tuple:
    length = int(np.asarray(batch.lengths)[row])
    return (episodes[row].status, tuple(np.asarray(batch.tokens)[row, :length].tolist()))


# ---------------------------------------------------------------------------------------------------- runs
def setup(args, tree_configs: Path):
    from trace_jax import models
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
    from trace_jax.rl.gin_setup import parse

    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, Path(tempfile.mkdtemp(prefix="long_horizon_"))))
    chat = ChatFormat(tokenizer)
    config = parse([str(tree_configs / "tiny.gin")], []).train.model.replace(vocab_size=len(tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    return chat, config, params


def run_engine(args, *, episodes: bool = False) -> dict:
    """This tree's engine: warm-up(s), the timed unbounded rollout, then the 25% pool (`args.quarter`); with
    `episodes`, each row's status and tokens too."""
    from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy
    from trace_jax.rollout import engine as engine_lib
    from trace_jax.rollout import paged as paged_lib
    from trace_jax.rollout.paged import PagedConfig

    chat, config, params = setup(args, ROOT / "configs")
    work = build_workload(chat, args.rows, args.turns, args.turn_tokens, args.seed, rollout_cls=RolloutConfig,
                          sampling_cls=SamplingConfig, turn_limit=args.turn_limit)
    hook = ScriptedPolicy(work.scripts, config.vocab_size, blocks=True)
    paged = PagedConfig(tool_workers=args.rows)

    def compiles():
        return sum(paged_lib.compiled_programs(k) for k in ("paged_prefill", "paged_decode"))

    decoding = []  # the decoding rows of each decode dispatch (the engine's `decode_rows` argument)
    decode_rows = engine_lib.decode_rows

    def recording_decode_rows(n, slots, shards=1):
        decoding.append(n)
        return decode_rows(n, slots, shards)

    def run(pool):
        decoding.clear()
        start = time.perf_counter()
        engine_lib.decode_rows = recording_decode_rows
        try:
            out = engine_lib.run_paged_episodes(config, params, chat, work.tasks, SleepyTools, work.rollout,
                                                jax.random.PRNGKey(0), paged=pool, logits_hook=hook)
        finally:
            engine_lib.decode_rows = decode_rows
        seconds = time.perf_counter() - start
        print(f"  (a rollout of {args.rows} rows with a pool of {pool.num_pages or 'every row'} pages: "
              f"{seconds:.1f} s)", file=sys.stderr, flush=True)
        return out, seconds

    for _ in range(args.warmups):
        before = compiles()
        run(paged)
        if compiles() == before:
            break
    before = compiles()
    result, seconds = run(paged)
    timed_compiles = compiles() - before
    batch, stats = result.batch, result.stats
    if len(decoding) != stats.decode_dispatches:
        raise AssertionError(f"{len(decoding)} decode batches recorded for {stats.decode_dispatches} dispatches")
    steps = work.rollout.sync_every
    mask = np.asarray(batch.loss_mask)
    minimum = ragged_minimum(mask)
    check = ragged_minimum_from_turns(np.asarray(batch.boundaries), np.asarray(batch.num_turns), work.lengths)
    if check != minimum or int(mask.sum()) != sum(map(sum, work.lengths)):
        raise AssertionError(f"the episodes are not the workload's: ragged minimum {minimum} vs {check}")
    out = {"rows": args.rows, "turns": work.turns, "generated": result.generated_tokens, "seconds": seconds,
           "compiles_in_timed_run": timed_compiles, "max_context": work.rollout.max_context,
           "sync_every": work.rollout.sync_every, "page_size": paged.page_size,
           "row_steps": stats.row_steps, "useful_row_steps": stats.useful_row_steps,
           "decode_dispatches": stats.decode_dispatches, "kv_read": stats.kv_positions_read,
           # the same dispatches padded as before (powers of two), and not padded at all
           "row_steps_powers_of_two": steps * sum(1 << (n - 1).bit_length() for n in decoding),
           "row_steps_unpadded": steps * sum(decoding),
           "ragged_minimum": minimum, "tool_seconds": sum(SleepyTools.latency(t.task_id, c) for t, n in zip(
               work.tasks, work.turns) for c in range(n - 1)),
           "dense_row_steps_sync1": dense_row_steps(work.lengths, args.rows, 1),
           "dense_row_steps_sync": dense_row_steps(work.lengths, args.rows, work.rollout.sync_every),
           "statuses": sorted({e.status for e in result.episodes})}
    if episodes:
        out["episodes"] = [[status, list(tokens)] for status, tokens in (
            episode_key(batch, result.episodes, r) for r in range(args.rows))]
    if args.quarter:
        total = int(np.asarray(batch.lengths).sum())
        pages = max(total // 4 // paged.page_size, paged_lib.pages_for(work.rollout.max_context, paged.page_size))
        small, small_seconds = run(dataclasses.replace(paged, num_pages=pages))
        same = [episode_key(small.batch, small.episodes, r) == episode_key(batch, result.episodes, r)
                for r in range(args.rows)]
        logprobs = np.abs(np.asarray(small.batch.sampler_logprobs) - np.asarray(batch.sampler_logprobs)).max()
        out["quarter"] = {"pages": pages, "tokens": pages * paged.page_size, "total_tokens": total,
                          "seconds": small_seconds, "preemptions": small.stats.preemptions,
                          "preemptions_mid_turn": small.stats.preemptions_mid_turn,
                          "recomputed_tokens": small.stats.recomputed_tokens,
                          "max_pages_held": small.stats.max_pages_held,
                          "useful_row_steps": small.stats.useful_row_steps, "row_steps": small.stats.row_steps,
                          "lost": sum(not s for s in same), "logprob_gap": float(logprobs)}
    return out


def run_dense_child(args) -> dict:
    """In the dense tree (PYTHONPATH): its `run_episodes` with `engine = 'dense'` and the per-step hook, decode
    row-steps counted around `sampler.generate`."""
    from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes
    from trace_jax.rollout import sampler as sampler_lib

    tree = Path(sys.modules["trace_jax"].__file__).resolve().parents[1]
    chat, config, params = setup(args, tree / "configs")
    work = build_workload(chat, args.rows, args.turns, args.turn_tokens, args.seed, rollout_cls=RolloutConfig,
                          sampling_cls=SamplingConfig, turn_limit=args.turn_limit, engine="dense")
    counted = {"row_steps": 0, "calls": 0}
    generate = sampler_lib.generate

    def counting_generate(config_, params_, state, **kwargs):
        rows = state.cache.batch_size
        state, gen = generate(config_, params_, state, **kwargs)
        counted["row_steps"] += rows * gen.steps
        counted["calls"] += 1
        return state, gen

    sampler_lib.generate = counting_generate
    hook = ScriptedPolicy(work.scripts, config.vocab_size)
    start = time.perf_counter()
    result = run_episodes(config, params, chat, work.tasks, SleepyTools, work.rollout, jax.random.PRNGKey(0),
                          logits_hook=hook)
    seconds = time.perf_counter() - start
    keys = [episode_key(result.batch, result.episodes, r) for r in range(args.rows)]
    return {"tree": str(tree), "generated": result.generated_tokens, "seconds": seconds, **counted,
            "formula_row_steps": dense_row_steps(work.lengths, args.rows, 1),
            "episodes": [[status, list(tokens)] for status, tokens in keys]}


def dense(args, tree: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child-dense", "--rows", str(args.rows), "--turns",
               str(args.turns), "--turn-tokens", ",".join(map(str, args.turn_tokens)), "--latency-ms",
               ",".join(map(str, SleepyTools.latency_ms)), "--seed", str(args.seed), "--turn-limit",
               str(args.dense_turns)]
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("CHILD ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the dense run in {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("CHILD "):])


def report(full: dict, short: dict | None, dense_run: dict | None) -> None:
    tokens = full["generated"]
    print(f"workload: {full['rows']} rows, {sum(full['turns'])} turns ({min(full['turns'])}..{max(full['turns'])} an "
          f"episode), {tokens} generated tokens, max_context {full['max_context']}, sync_every {full['sync_every']}, "
          f"tools {full['tool_seconds']:.1f} s in all; load average {os.getloadavg()[0]:.1f}")
    print(f"  engine: {full['seconds']:.1f} s, {tokens / full['seconds']:.0f} tokens/s "
          f"({full['compiles_in_timed_run']} programs compiled during it), {full['decode_dispatches']} decode "
          f"dispatches; useful row-steps {full['useful_row_steps'] / full['row_steps']:.1%} "
          f"({full['useful_row_steps']} of {full['row_steps']}); the same decode batches padded to powers of two "
          f"{full['useful_row_steps'] / full['row_steps_powers_of_two']:.1%}, unpadded "
          f"{full['useful_row_steps'] / full['row_steps_unpadded']:.1%}")
    print(f"  KV positions read per generated token {full['kv_read'] / tokens:.1f}, ragged minimum "
          f"{full['ragged_minimum'] / tokens:.1f}: {full['kv_read'] / full['ragged_minimum']:.3f}x")
    print(f"  dense engine (formula on these episodes): useful row-steps {tokens / full['dense_row_steps_sync1']:.1%} "
          f"hooked (1 step a sync), {tokens / full['dense_row_steps_sync']:.1%} free-running "
          f"(sync_every {full['sync_every']}); its wall time >= {full['tool_seconds']:.1f} s (tools in series)")
    if "quarter" in full:
        q = full["quarter"]
        print(f"  pool of {q['pages']} pages ({q['tokens']} of {q['total_tokens']} tokens, "
              f"{q['tokens'] / q['total_tokens']:.0%}; at least one row of max_context): {q['seconds']:.1f} s, "
              f"{q['preemptions']} preemptions ({q['preemptions_mid_turn']} mid-turn), {q['recomputed_tokens']} "
              f"tokens recomputed, {q['max_pages_held']} pages held at most, useful row-steps "
              f"{q['useful_row_steps'] / q['row_steps']:.1%}; episodes lost {q['lost']} of {full['rows']} "
              f"(log-prob gap {q['logprob_gap']:.1e})")
    if short and dense_run:
        counted = dense_run["row_steps"]
        same = sum(1 for a, b in zip(dense_run["episodes"], short["episodes"]) if a == b)
        print(f"shorter workload (<= {max(short['turns'])} turns an episode, the same draws): "
              f"{short['generated']} generated tokens")
        print(f"  dense engine ({dense_run['tree']}): {dense_run['seconds']:.1f} s, "
              f"{dense_run['generated'] / dense_run['seconds']:.0f} tokens/s; useful row-steps "
              f"{dense_run['generated'] / counted:.1%} ({dense_run['generated']} of {counted} counted; the formula "
              f"gives {dense_run['formula_row_steps']}); episodes equal to the engine's: {same} of "
              f"{len(short['episodes'])}")
        print(f"  engine: {short['seconds']:.1f} s, {short['generated'] / short['seconds']:.0f} tokens/s; useful "
              f"row-steps {short['useful_row_steps'] / short['row_steps']:.1%}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--turn-tokens", type=pair, default=(10, 400))
    parser.add_argument("--latency-ms", type=pair, default=(10, 500))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmups", type=int, default=1, help="most warm-up rollouts (stop at the first that "
                        "compiles nothing new)")
    parser.add_argument("--quarter", action="store_true", help="also run a pool of 25%% of the rows' tokens")
    parser.add_argument("--dense", default="", help="a checkout of 40610b8: run its dense engine too")
    parser.add_argument("--dense-turns", type=int, default=8, help="the dense run keeps this many turns an episode")
    parser.add_argument("--turn-limit", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-dense", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--smoke", action="store_true", help="4 rows of <= 3 turns of 10-60 tokens, 1-5 ms tools")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.turns, args.turn_tokens, args.latency_ms, args.warmups = 4, 3, (10, 60), (1, 5), 0
        args.quarter, args.dense_turns = True, 2
    SleepyTools.latency_ms = args.latency_ms
    if args.child_dense:
        print("CHILD " + json.dumps(run_dense_child(args)), flush=True)
        return None
    full = run_engine(args)
    short = dense_run = None
    if args.dense:
        dense_run = dense(args, args.dense)
        short = run_engine(argparse.Namespace(**{**vars(args), "quarter": False, "turn_limit": args.dense_turns,
                                                 "warmups": 0}), episodes=True)
    report(full, short, dense_run)
    if args.json:
        Path(args.json).write_text(json.dumps({"full": full, "short": short, "dense": dense_run}, indent=1))
    return full


if __name__ == "__main__":
    main()
