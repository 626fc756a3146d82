"""One RL step's rollout of configs/study.gin (48 episodes from the first study's seed-0 warm start) timed from a
given checkout, so the removed dense engine (its last commit: 40610b8) and this one can be compared side by side,
alternating processes:

    git worktree add --detach /tmp/dense 40610b8
    for round in 1 2; do
      JAX_PLATFORMS=cpu python benchmarks/rollout_checkout_bench.py /tmp/dense dense 2 1
      JAX_PLATFORMS=cpu python benchmarks/rollout_checkout_bench.py . default 2 10
    done

Arguments: TREE ENGINE (dense: `RolloutConfig.engine = 'dense'`, which only checkouts before the removal have;
default: the checkout's own) REPEATS WARMUPS (most warm-up rollouts; they stop at the first that compiles nothing
new). Prints one RESULT line: each timed run's seconds, the best, the generated tokens and how many paged programs
compiled inside the timed runs. Run it on an idle machine.
"""
import dataclasses, sys, tempfile, time
tree, engine, repeats, warmups = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree)
import os; os.chdir(tree)
import jax
from trace_jax.credit.config import CreditConfig
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import build_environment
from trace_jax.rl.pipeline import RLPipeline
from trace_jax.train.checkpoint import Checkpointer
from trace_jax.train.config import CheckpointConfig
from trace_jax.train.optimizer import make_optimizer
from trace_jax.rollout import paged as paged_lib
config = parse(["configs/study.gin"], [])
rollout = dataclasses.replace(config.rollout, engine="dense") if engine == "dense" else config.rollout
env = build_environment(config, tempfile.mkdtemp())
with Checkpointer(CheckpointConfig(directory="docs/results/study/grpo/seed0/reference", async_save=False)) as s:
    params = s.restore_params(0)
tasks = env.train_tasks[:config.train.prompts_per_step]
p = RLPipeline(env.model_config, env.chat, env.browser, rollout, CreditConfig(estimator="grpo"), config.loss,
               config.update, make_optimizer(config.optimizer))
def compiles():
    return sum(paged_lib.compiled_programs(k) for k in ("paged_prefill", "paged_decode"))
def run():
    t0 = time.perf_counter(); r = p.collect(params, tasks, jax.random.PRNGKey(0)); jax.block_until_ready(r.batch.tokens)
    return r, time.perf_counter() - t0
for _ in range(warmups):
    c = compiles(); r, _ = run()
    if compiles() == c: break
c = compiles(); times = [run()[1] for _ in range(repeats)]
print(f"RESULT {engine} {tree}: runs {' '.join(f'{t:.2f}' for t in times)} best {min(times):.2f} s, "
      f"{r.generated_tokens} tokens, compiles in timed runs {compiles() - c}", flush=True)
