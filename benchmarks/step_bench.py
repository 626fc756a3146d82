"""RL step time of TRACE vs GRPO on the same batch (issue 13): TRACE / GRPO <= 1.10 on the tiny config is the target.

One rollout batch of the embedded default (`configs/tiny.gin`: prompts_per_step x G rows, a freshly initialised
tiny policy, no warm start) is collected once; then, from the same initial train state, each contender runs what
follows the rollout in `RLPipeline`:

  grpo         credit (no reference scoring) + the update
  trace        one-pass prefix-fork reference scoring + credit + the update
  trace-naive  the same with naive scoring (one forward per state), for contrast

Calls are interleaved round-robin, in an order that rotates every round, best of `--repeats` after one warm-up
call each (compilation excluded). The rollout is timed in the same rounds, since a full step = rollout + the rest;
the table gives both the ratio of the post-rollout part and of the full step, and the phase breakdown (scoring,
credit, update) of each contender; and GRPO's full step plus TRACE's own work (its scoring and credit), since
both run the same update.

    .venv/bin/python benchmarks/step_bench.py                  # tiny.gin's batch (8 prompts x 8 samples)
    .venv/bin/python benchmarks/step_bench.py --prompts 2 --group 4 --repeats 2    # a quick smoke run
    # the study config (6 prompts x 8 samples, 10 turns), from a study arm's warm-started policy:
    .venv/bin/python benchmarks/step_bench.py --config configs/study.gin --init_from runs/study/grpo/seed0

`--init_from RUN_DIR` starts from that run's initial policy (after its warm start: `reference/` step 0, what
`TrainConfig.init_from` reads), the policy and reference a study arm starts RL from; without it the policy is freshly
initialised, whose episodes (random tokens up to the turn budget) are not the ones the loop times on a warm-started
config. The loop's own figure is `median_step_seconds` / `step_time_ratio_to_grpo` in a study's `results.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trace_jax.credit.config import CreditConfig  # noqa: E402
from trace_jax.rl.gin_setup import parse  # noqa: E402
from trace_jax.rl.loop import build_environment  # noqa: E402
from trace_jax.rl.pipeline import RLPipeline  # noqa: E402
from trace_jax.train.checkpoint import Checkpointer  # noqa: E402
from trace_jax.train.config import CheckpointConfig  # noqa: E402
from trace_jax.train.optimizer import make_optimizer  # noqa: E402
from trace_jax.train.state import init_train_state  # noqa: E402
from trace_jax.train.step import make_train_step  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", "--gin-file", "--gin_file", dest="gin_file", default="configs/tiny.gin",
                        help="the run's gin file, e.g. configs/study.gin (default configs/tiny.gin)")
    parser.add_argument("--gin-param", "--gin_param", action="append", default=[],
                        help="an extra binding (repeatable)")
    parser.add_argument("--init-from", "--init_from", default="", help="a run directory whose initial policy "
                        "(reference/ step 0, after its warm start) is the policy and reference (default: a fresh init)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the config's)")
    parser.add_argument("--group", type=int, default=None, help="samples per prompt (default: the config's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    params = list(args.gin_param)
    if args.prompts:
        params.append(f"TrainConfig.prompts_per_step = {args.prompts}")
    if args.group:
        params.append(f"RolloutConfig.group_size = {args.group}")
    config = parse([args.gin_file], params)
    environment = build_environment(config, tempfile.mkdtemp(prefix="step_bench_"))
    prompts = config.train.prompts_per_step
    optimizer = make_optimizer(config.optimizer)
    train_step = make_train_step(environment.model_config, config.loss, optimizer)
    trace = dataclasses.replace(config.credit, estimator="trace")
    contenders = {
        "grpo": RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout,
                           CreditConfig(estimator="grpo"), config.loss, config.update, optimizer,
                           train_step=train_step),
        "trace": RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout, trace,
                            config.loss, config.update, optimizer, train_step=train_step),
        "trace-naive": RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout,
                                  trace, config.loss, dataclasses.replace(config.update, scoring="naive"), optimizer,
                                  train_step=train_step),
    }
    tasks = environment.train_tasks[:prompts]
    reference = environment.params
    if args.init_from:
        directory = os.path.join(args.init_from, "reference")
        if not os.path.isdir(directory):
            parser.error(f"--init_from {args.init_from}: no reference/ directory there; give the run directory of a "
                         "`trace-jax train` run (a study arm, e.g. runs/study/grpo/seed0)")
        with Checkpointer(CheckpointConfig(directory=directory, async_save=False)) as store:
            reference = store.restore_params(0)
        print(f"policy and reference: the initial policy of {args.init_from}")
    elif config.warmstart.steps:
        print(f"note: {args.gin_file} warm-starts before RL; this batch comes from a fresh policy. Pass --init_from "
              "<a run directory of this config> to time the loop's episodes")
    key = jax.random.PRNGKey(0)
    rollout = contenders["grpo"].collect(reference, tasks, key)
    lengths = np.asarray(rollout.batch.lengths)
    print(f"batch: {prompts} prompts x {config.rollout.group_size} samples = {len(lengths)} rows, lengths "
          f"{lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), turns/episode "
          f"{np.mean([len(e.turn_texts) for e in rollout.episodes]):.2f}; load average {os.getloadavg()[0]:.1f}")

    def run_rollout():
        start = time.perf_counter()
        result = contenders["grpo"].collect(reference, tasks, key)
        jax.block_until_ready(result.batch.tokens)
        return {"rollout": time.perf_counter() - start}

    def run(name):
        pipeline = contenders[name]
        state = init_train_state(environment.model_config, optimizer, reference, jax.random.PRNGKey(1))
        jax.block_until_ready(state.params)
        prepared = pipeline.prepare(rollout, reference, num_prompts=prompts)
        start = time.perf_counter()
        state, _ = pipeline.update(state, prepared, reference)
        jax.block_until_ready(state.params)
        return {**prepared.timing, "update": time.perf_counter() - start}

    fns = {"rollout": run_rollout, **{name: (lambda n=name: run(n)) for name in contenders}}
    for fn in fns.values():  # warm-up: compiles
        fn()
    best: dict[str, dict[str, float]] = {}
    items = list(fns.items())
    for repeat in range(args.repeats):
        # the order rotates every round: whoever runs right after the rollout was measured slower (up to 18%)
        for label, fn in items[repeat % len(items):] + items[:repeat % len(items)]:
            phases = fn()
            if label not in best or sum(phases.values()) < sum(best[label].values()):
                best[label] = phases
    rollout_s = best["rollout"]["rollout"]
    total = {name: sum(best[name].values()) for name in contenders}
    print(f"\nbest of {args.repeats} interleaved rounds (seconds)")
    print(f"{'':12s} {'scoring':>8s} {'credit':>8s} {'update':>8s} {'after rollout':>14s} {'full step':>10s} "
          f"{'/ grpo (after rollout)':>23s} {'/ grpo (full step)':>19s}")
    for name in contenders:
        b = best[name]
        print(f"{name:12s} {b['scoring']:8.3f} {b['credit']:8.3f} {b['update']:8.3f} {total[name]:14.3f} "
              f"{total[name] + rollout_s:10.3f} {total[name] / total['grpo']:23.3f} "
              f"{(total[name] + rollout_s) / (total['grpo'] + rollout_s):19.3f}")
    print(f"{'rollout':12s} {rollout_s:8.3f} (the same for every contender)")
    extra = best["trace"]["scoring"] + best["trace"]["credit"] - best["grpo"]["credit"]
    print(f"\nTRACE's own work (scoring + credit beyond GRPO's) over GRPO's full step: "
          f"{(total['grpo'] + rollout_s + extra) / (total['grpo'] + rollout_s):.3f} (the updates are the same "
          f"program on the same shapes; their measured difference is noise)")
    print(f"TRACE / GRPO full step: {(total['trace'] + rollout_s) / (total['grpo'] + rollout_s):.3f} "
          f"(target <= 1.10); naive-scoring TRACE / GRPO: "
          f"{(total['trace-naive'] + rollout_s) / (total['grpo'] + rollout_s):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
