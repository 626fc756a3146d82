"""trace-jax: turn-level credit (TRACE, ABC) for RL of long-horizon tool-using LLM agents, in JAX.

Subpackages (see docs/design.md for the data flow):
  credit   pure functions: outcome advantages, TRACE, ABC, GSPO, token broadcast, estimator registry
  models   Flax Qwen3 / Llama decoders, HF safetensors import/export, tokenizers and chat format
  scoring  one-pass prefix-fork answer scoring for the TRACE reference
  rollout  the paged rollout engine, the sampling rules and the multi-turn agent loop
  envs     browser tools over an offline corpus, procedural multi-hop tasks, answer checking
  data     dataset builders and loaders
  train    mesh, sharding, loss, train step and loop
"""

__version__ = "0.1.0"
