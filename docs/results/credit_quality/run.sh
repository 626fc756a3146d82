#!/usr/bin/env bash
# `trace-jax credit-quality` on the three study seeds' warm starts (docs/results/study/grpo/seed*/reference, step 0),
# as recorded here (issue 46). Run from the repository root in the project's venv; it ran from a snapshot checkout of
# the commit that merged credit-quality (71be4fd), about 10 minutes a seed on the 2-core host. A finished seed is
# skipped, so a stopped run continues.
set -u
TREE=${TREE:-$(git rev-parse --show-toplevel)}
OUT=${OUT:-$TREE/docs/results/credit_quality}
cd "$TREE"
for S in 0 1 2; do
  if [ -f "$OUT/seed$S/credit_quality.json" ]; then echo "seed $S done"; continue; fi
  echo "seed $S start $(date -u +%T)"
  mkdir -p "$OUT/seed$S"
  PYTHONPATH=$TREE JAX_PLATFORMS=cpu python -m trace_jax.cli credit-quality \
    --policy "docs/results/study/grpo/seed$S@0" \
    --gin-file configs/study.gin --gin-file configs/credit/trace.gin \
    --gin-param "TrainConfig.seed = $S" --gin-param "DataConfig.shuffle_seed = $S" \
    --gin-param "WarmStartConfig.oracle_seed = $S" \
    --seed "$S" --out-dir "$OUT/seed$S" > "$OUT/seed$S/log.txt" 2>&1
  echo "seed $S exit $? $(date -u +%T)"
done
