#!/usr/bin/env bash
# Remedy for seed 2 (stop rule of issue 46): a warm start twice as long (1920 SFT steps instead of the study's 960),
# then credit-quality on it exactly as on the study's warm starts (run.sh). Resumable: skips a finished stage. Run
# from the repository root in the project's venv; ~35 minutes on an idle 2-core machine. Ran 2026-12-05
# 17:04-18:52 UTC beside other jobs (warm start 100 min, credit-quality 447 s): record in ws1920-seed2/ and the two
# logs beside it; summary in docs/results.md.
set -u
TREE=${TREE:-$(git rev-parse --show-toplevel)}
OUT=${OUT:-$TREE/docs/results/credit_quality}
RUN=${RUN:-$TREE/runs/ws1920-seed2}
cd "$TREE"
S=2
if [ ! -d "$RUN/reference/0" ]; then
  echo "warm start start $(date -u +%T)"
  PYTHONPATH=$TREE JAX_PLATFORMS=cpu python -m trace_jax.cli train --no-progress \
    --gin-file configs/study.gin --gin-file configs/credit/trace.gin \
    --gin-param "TrainConfig.steps = 0" --gin-param "WarmStartConfig.steps = 1920" \
    --gin-param "TrainConfig.seed = $S" --gin-param "DataConfig.shuffle_seed = $S" \
    --gin-param "WarmStartConfig.oracle_seed = $S" --run-dir "$RUN" > "$OUT/ws1920-seed2-train.log" 2>&1
  echo "warm start exit $? $(date -u +%T)"
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/ws1920-seed2/credit_quality.json" ]; then
  echo "credit-quality start $(date -u +%T)"
  PYTHONPATH=$TREE JAX_PLATFORMS=cpu python -m trace_jax.cli credit-quality \
    --policy "$RUN@0" \
    --gin-file configs/study.gin --gin-file configs/credit/trace.gin \
    --gin-param "TrainConfig.seed = $S" --gin-param "DataConfig.shuffle_seed = $S" \
    --gin-param "WarmStartConfig.oracle_seed = $S" \
    --seed "$S" --out-dir "$OUT/ws1920-seed2" > "$OUT/ws1920-seed2.log" 2>&1
  echo "credit-quality exit $? $(date -u +%T)"
fi
