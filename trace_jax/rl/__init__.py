"""The RL application: runs of a tool-using agent trained on the device core of `trace_jax.train`.

Modules (imported where used, so `trace-jax --help` stays fast; see docs/running.md):
  gin_setup            RunConfig and its concerns (TrainConfig, DataConfig, EnvConfig), `parse`, `write_config`
  pipeline             RLPipeline: one RL step (rollout, reference scoring, credit, update); UpdateConfig
  loop                 `train(run_config, run_dir)`, `evaluate_run`, `Placement` (the run's mesh and layouts)
  warmstart            the SFT warm start on oracle trajectories; WarmStartConfig
  evaluate             held-out evaluation; EvalConfig
  abc_scoring          the ABC step scorer inside the RL step; ABCScorerConfig
  credit_diagnostics   per-step credit diagnostics against the oracle's progress
  metrics              the run directory's record (metrics.jsonl, TensorBoard, plots, summary)
  sweep, study         sweeps and methods x seeds studies of runs
  cli                  `trace-jax train | eval | sweep`

`trace_jax.train` (losses, the sharded update, state, optimizer, checkpoints) knows nothing of this package.
"""
