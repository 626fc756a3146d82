"""Three train steps of a tiny policy on one global batch, run by every process of a (possibly multi-process) run.

`python tests/train/multihost_step.py OUT_DIR` is what each process of tests/train/test_multihost.py runs (the
`TRACE_JAX_*` variables make it join the run); `run_steps(out_dir)` is the same computation in the calling process.
Every process builds the same params and the same global batches from fixed seeds, keeps only its own rows
(`distributed.process_share`) and assembles them with `distributed.global_batch`; the train state lives on a mesh
over every process's devices (FSDP across the processes). Every process takes part in the orbax checkpoint of the
last step (OUT_DIR/checkpoints) and restores it onto the mesh again; process 0 writes OUT_DIR/result.npz: the
losses, the final params and whether the restore gave them back.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROWS, LENGTH, STEPS, MICRO = 8, 16, 3, 2


def setup():
    """The model config, optimizer and loss config the steps use (also the single-process restore target's)."""
    from trace_jax import models
    from trace_jax.train.config import LossConfig, OptimizerConfig
    from trace_jax.train.optimizer import make_optimizer

    model_config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    # lr 1e-4: Adam divides each gradient by its own running scale, so a round-off-sized gradient that two reduction
    # orders give different signs moves its element by up to 2 lr a step (measured at 1e-2: 1.2e-4 on 1 of 8192
    # elements); at 1e-4 that stays under the 1e-5 the processes are compared at, and 3 steps still move the params
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, schedule="constant", warmup_steps=0))
    return model_config, optimizer, LossConfig(micro_batches=MICRO)


def run_steps(out_dir: str | Path) -> dict:
    import jax
    import numpy as np

    from trace_jax import models
    from trace_jax.train import distributed
    from trace_jax.train.checkpoint import Checkpointer, abstract_train_state
    from trace_jax.train.config import CheckpointConfig, MeshConfig
    from trace_jax.train.state import init_train_state, state_shardings
    from trace_jax.train.step import batch_sharding, make_train_step
    from trace_jax.train.synthetic import synthetic_batch

    out_dir = Path(out_dir)
    model_config, optimizer, loss_config = setup()
    mesh = MeshConfig().make_mesh()  # fsdp over every device of every process
    params = models.init_params(model_config, jax.random.PRNGKey(0), dtype="float32")
    params = distributed.put_replicated_value(params, state_shardings(model_config, optimizer, mesh).params)
    state = init_train_state(model_config, optimizer, params, jax.random.PRNGKey(1), mesh=mesh)
    step_fn = make_train_step(model_config, loss_config, optimizer, mesh=mesh)
    share = distributed.process_share(ROWS)
    try:  # half the rows cannot cover 8 devices: the check must refuse them on every process
        distributed.check_rows_split_by_process(batch_sharding(mesh, None, (ROWS // 2, LENGTH)),
                                                (ROWS // 2, LENGTH))
        refuses_too_few_rows = jax.process_count() == 1  # one process holds every row whatever the sharding
    except ValueError:
        refuses_too_few_rows = True
    losses = []
    for step in range(STEPS):
        full = synthetic_batch(model_config.vocab_size, ROWS, LENGTH, seed=100 + step)
        local = jax.tree_util.tree_map(lambda x: np.asarray(x)[share], full)
        batch = distributed.global_batch(local, batch_sharding(mesh, None, (ROWS, LENGTH)))
        state, metrics = step_fn(state, batch, None)
        losses.append(float(metrics["loss"]))
    with Checkpointer(CheckpointConfig(directory=str(out_dir / "checkpoints"), async_save=False)) as store:
        store.save(state, {"losses": losses}, force=True)
        store.wait_until_finished()
        # the resume path of a multi-process run: every process restores its shards onto the same mesh
        restored, _ = store.restore(abstract_train_state(model_config, optimizer, mesh=mesh))
    params = jax.tree_util.tree_map(np.asarray, distributed.host_local(state.params))
    restored = jax.tree_util.tree_map(np.asarray, distributed.host_local(restored.params))
    restores_on_the_mesh = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(params),
                                                                    jax.tree_util.tree_leaves(restored)))
    if distributed.is_primary():
        flat = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(out_dir / "result.npz", losses=np.asarray(losses), restores_on_the_mesh=restores_on_the_mesh,
                 refuses_too_few_rows=refuses_too_few_rows, **flat)
    return {"losses": losses, "params": params, "processes": jax.process_count(),
            "restores_on_the_mesh": restores_on_the_mesh}


if __name__ == "__main__":
    from trace_jax.train import distributed

    distributed.initialize(distributed.DistributedConfig(initialization_timeout_s=60))
    run_steps(sys.argv[1])
