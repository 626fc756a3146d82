#!/usr/bin/env bash
# Copy the powered study's finished arms from its run directory into this committed record (issue 47: "the record
# committed as it grows"): per arm metrics.jsonl (every step's and evaluation's figures), summary.json (per-task
# held-out outcomes of every evaluation), operative_config.gin and study_arm.json; and the warm start every arm of a
# seed starts from (grpo/seed<S>/reference, 3.5 MB): phase 2 and credit-quality start from it, and a session's
# machine does not keep runs/ (seeds 3 and 4's were lost that way before this copied every seed). Unfinished arms (no
# summary.json yet) are left. Then `trace-jax study configs/studies/powered_phase2.gin --results-only --dir
# docs/results/powered` regenerates results.json/.md and plots/ from the record (phase 2's file: it holds phase 1's
# methods too, and the gate; phase 2 started 2026-12-06).
# The ABC miniature (configs/studies/powered_abc.gin) uses the same script with its own directories and both of its
# warm-starting methods: OUT=docs/results/powered_abc RUNS=runs/studies/powered_abc WARM_STARTS="grpo sft" bash
# docs/results/powered/sync.sh
set -eu
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
RUNS=${RUNS:-$(cd "$OUT/../../.." && pwd)/runs/studies/powered}  # the study's --dir: runs/ of this checkout
WARM_STARTS=${WARM_STARTS:-grpo}  # the methods whose arms warm-start (the others start from grpo's policy)
for arm in "$RUNS"/*/seed*; do
  [ -f "$arm/summary.json" ] || continue
  rel=${arm#"$RUNS"/}
  mkdir -p "$OUT/$rel"
  cp "$arm"/{metrics.jsonl,summary.json,operative_config.gin,study_arm.json} "$OUT/$rel/"
  # a seed whose warm start was lost and regenerated (warm_starts_regenerated/seed<S>, placed in the run directory
  # for phase 2) keeps its arm's record as it was: the regenerated policy is not the one that arm trained from
  case " $WARM_STARTS " in *" ${rel%/*} "*) warm=1 ;; *) warm=0 ;; esac
  if [ $warm = 1 ] && [ -d "$arm/reference" ] && [ ! -d "$OUT/warm_starts_regenerated/${rel#*/}" ]; then
    rm -rf "$OUT/$rel/reference"; cp -r "$arm/reference" "$OUT/$rel/"
  fi
  echo "copied $rel"
done
