#!/usr/bin/env bash
# Copy the powered study's finished arms from its run directory into this committed record (issue 47: "the record
# committed as it grows"): per arm metrics.jsonl (every step's and evaluation's figures), summary.json (per-task
# held-out outcomes of every evaluation), operative_config.gin and study_arm.json; and the warm start every arm of a
# seed starts from (grpo/seed<S>/reference, 3.5 MB): phase 2 and credit-quality start from it, and a session's
# machine does not keep runs/ (seeds 3 and 4's were lost that way before this copied every seed). Unfinished arms (no
# summary.json yet) are left. Then `trace-jax study configs/studies/powered_phase1.gin --results-only --dir
# docs/results/powered` regenerates results.json/.md and plots/ from the record.
set -eu
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
RUNS=${RUNS:-$(cd "$OUT/../../.." && pwd)/runs/studies/powered}  # the study's --dir: runs/ of this checkout
for arm in "$RUNS"/*/seed*; do
  [ -f "$arm/summary.json" ] || continue
  rel=${arm#"$RUNS"/}
  mkdir -p "$OUT/$rel"
  cp "$arm"/{metrics.jsonl,summary.json,operative_config.gin,study_arm.json} "$OUT/$rel/"
  # a seed whose warm start was lost and regenerated (warm_starts_regenerated/seed<S>, placed in the run directory
  # for phase 2) keeps its arm's record as it was: the regenerated policy is not the one that arm trained from
  if [ "${rel%/*}" = grpo ] && [ -d "$arm/reference" ] && [ ! -d "$OUT/warm_starts_regenerated/${rel#*/}" ]; then
    rm -rf "$OUT/$rel/reference"; cp -r "$arm/reference" "$OUT/$rel/"
  fi
  echo "copied $rel"
done
