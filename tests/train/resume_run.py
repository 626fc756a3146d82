"""A small training run for the kill/resume tests: resumes from its checkpoint directory when one exists.

Usage: python resume_run.py RUN_DIR STEPS [PAUSE_SECONDS]
Prints "step N" after each step's checkpoint call and writes RUN_DIR/final.npz (params, opt state, rng, step)
when it reaches STEPS. The batch of step s is `synthetic_batch(seed=host_state["next_batch"])`, so a resumed run
must restore the host state to see the same data.
"""

import os
import sys
import time

import jax
import numpy as np

from trace_jax import models, train
from trace_jax.train.checkpoint import Checkpointer, PreemptionGuard, abstract_train_state
from trace_jax.train.synthetic import synthetic_batch


def main(run_dir: str, steps: int, pause: float) -> int:
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=2, schedule="cosine",
                                                           total_steps=20))
    step_fn = train.make_train_step(config, train.LossConfig(micro_batches=2), optimizer)
    checkpoint_config = train.CheckpointConfig(directory=os.path.join(run_dir, "ckpt"), every_steps=1, keep_last=2)
    with PreemptionGuard() as guard, Checkpointer(checkpoint_config, guard=guard) as checkpointer:
        if checkpointer.latest_step() is not None:
            state, host = checkpointer.restore(abstract_train_state(config, optimizer))
            print(f"resumed {int(state.step)}", flush=True)
        else:
            params = models.init_params(config, jax.random.PRNGKey(0))
            state, host = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(1)), {"next_batch": 0}
        while int(state.step) < steps:
            batch = synthetic_batch(config.vocab_size, 4, 16, seed=1000 + host["next_batch"])
            state, _ = step_fn(state, batch, None)
            host = {"next_batch": host["next_batch"] + 1}
            checkpointer.maybe_save(state, host)
            print(f"step {int(state.step)}", flush=True)
            if checkpointer.stop_requested:
                print(f"stopped by {guard.signal_name} at {int(state.step)}", flush=True)
                return 0
            time.sleep(pause)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    np.savez(os.path.join(run_dir, "final.npz"), **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0))
