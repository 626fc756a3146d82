#!/bin/bash
# The step-time rerun of docs/results.md ("Time"): GRPO and TRACE log-ratio of every study seed, from the study
# record's warm-started policies (TrainConfig.init_from), each arm in its own process, one after another on an
# idle machine (pair order alternates by seed), with held-out evaluation only before and after RL.
# Run from the repository root with trace-jax installed; writes runs/steptime/. A finished arm is skipped.
set -u
export JAX_PLATFORMS=cpu
mkdir -p runs/steptime
run() {  # method credit-gin seed
  local dir=runs/steptime/$1/seed$3
  [ -f "$dir/summary.json" ] && return
  echo "START $1 seed$3 $(date '+%F %T')" >> runs/steptime/log
  trace-jax train --no-progress --gin-file configs/study.gin --gin-file "configs/credit/$2.gin" \
    --gin-param "TrainConfig.seed = $3" --gin-param "DataConfig.shuffle_seed = $3" \
    --gin-param "WarmStartConfig.oracle_seed = $3" \
    --gin-param "TrainConfig.init_from = 'docs/results/study/grpo/seed$3'" \
    --gin-param "EvalConfig.every_steps = 0" --run-dir "$dir" >> runs/steptime/train.log 2>&1
  echo "END $1 seed$3 rc=$? $(date '+%F %T')" >> runs/steptime/log
}
run grpo grpo 0; run trace_log_ratio trace 0
run trace_log_ratio trace 1; run grpo grpo 1
run grpo grpo 2; run trace_log_ratio trace 2
