"""Training core: losses, the sharded jitted policy update, optimizer, checkpoints and FLOPs/MFU estimates.

Public API (see docs/training.md):
  LossConfig, OptimizerConfig, MeshConfig, CheckpointConfig, TrainConfigError   (config.py)
  LossBatch, policy_logprobs, importance_ratio, clipped_surrogate, kl_penalty, aggregate, sft_loss (loss.py)
  make_optimizer, make_schedule                                                  (optimizer.py)
  TrainState, init_train_state, state_shardings, copy_params                    (state.py)
  make_train_step, TrainStep, shard_batch                                        (step.py)
  Checkpointer, PreemptionGuard, abstract_train_state, export_pretrained         (checkpoint.py)
  flops_per_token, mfu, measure_peak_flops, PEAK_FLOPS                           (flops.py)
  synthetic_batch                                                                (synthetic.py)

The RL application (`trace_jax.rl`: the run config, pipeline, loop, `trace-jax train`) and `trace_jax.plan` build on
this package; it imports nothing from them, nor from rollouts, environments, scoring or data
(`tests/train/test_core_imports.py`).
"""

from trace_jax.train.checkpoint import Checkpointer, PreemptionGuard, abstract_train_state, export_pretrained
from trace_jax.train.config import CheckpointConfig, LossConfig, MeshConfig, OptimizerConfig, TrainConfigError
from trace_jax.train.loss import (
    LossBatch,
    aggregate,
    clipped_surrogate,
    importance_ratio,
    kl_penalty,
    policy_logprobs,
    sft_loss,
)
from trace_jax.train.flops import PEAK_FLOPS, flops_per_token, measure_peak_flops, mfu
from trace_jax.train.optimizer import make_optimizer, make_schedule
from trace_jax.train.state import TrainState, copy_params, init_train_state, state_shardings
from trace_jax.train.step import TrainStep, make_train_step, shard_batch
from trace_jax.train.synthetic import synthetic_batch

__all__ = [
    "PEAK_FLOPS", "CheckpointConfig", "Checkpointer", "PreemptionGuard", "abstract_train_state", "export_pretrained",
    "flops_per_token", "measure_peak_flops", "mfu", "synthetic_batch", "LossBatch", "LossConfig", "MeshConfig", "OptimizerConfig", "TrainConfigError",
    "TrainState", "TrainStep", "aggregate", "clipped_surrogate", "copy_params", "importance_ratio",
    "init_train_state", "kl_penalty", "make_optimizer", "make_schedule", "make_train_step", "policy_logprobs",
    "sft_loss", "shard_batch", "state_shardings",
]
