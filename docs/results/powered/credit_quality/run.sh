#!/usr/bin/env bash
# `trace-jax credit-quality` on the powered study's warm starts of seeds 0-2 (issue 47, docs/results.md, "The
# protocol": the favoured alpha_turn of phase 2's second TRACE arm comes from these reports, before phase 2 starts).
# Each seed's warm start is its GRPO arm's step 0 (runs/studies/powered/grpo/seed<S>, the policy every arm of the
# seed starts from, acting as its own frozen reference, as the arms' TRACE reference is). Run from the repository
# root of the study's pinned checkout (TREE, default this one) in the project's venv; a finished seed is skipped and
# a seed whose warm start is not there yet is left for later. Then:
#   trace-jax credit-quality --favoured-from docs/results/powered/credit_quality/seed{0,1,2}
set -u
TREE=${TREE:-$(git rev-parse --show-toplevel)}
RUNS=${RUNS:-/work/main/runs/studies/powered}
OUT=${OUT:-/work/main/docs/results/powered/credit_quality}
cd "$TREE"
for S in 0 1 2; do
  if [ -f "$OUT/seed$S/credit_quality.json" ]; then echo "seed $S done"; continue; fi
  if [ ! -d "$RUNS/grpo/seed$S/reference/0" ]; then echo "seed $S: no warm start yet"; continue; fi
  echo "seed $S start $(date -u +%T)"
  mkdir -p "$OUT/seed$S"
  PYTHONPATH=$TREE JAX_PLATFORMS=cpu python -m trace_jax.cli credit-quality \
    --policy "$RUNS/grpo/seed$S@0" \
    --gin-file configs/powered.gin --gin-file configs/credit/trace.gin \
    --gin-param "TrainConfig.seed = $S" --gin-param "DataConfig.shuffle_seed = $S" \
    --gin-param "WarmStartConfig.oracle_seed = $S" \
    --seed "$S" --out-dir "$OUT/seed$S" > "$OUT/seed$S/log.txt" 2>&1
  echo "seed $S exit $? $(date -u +%T)"
done
