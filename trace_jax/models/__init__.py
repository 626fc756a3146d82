"""Decoder models: Qwen3 (dense, MoE) and Llama-family configs, params, forward, KV cache and HF checkpoints.

Public API (see docs/models.md):
  ModelConfig, get_preset, init_params, load_pretrained, save_pretrained,
  forward, forward_hidden, token_logprobs, hidden_logprobs,
  KVCache, init_cache, extend, prefill, attend_cached_block,
  param_logical_axes, param_shapes, logical_to_sharding, param_shardings, shard_params, constrain, make_mesh,
  DEFAULT_RULES, ROLLOUT_RULES, LOGICAL_AXES, check_rule_overrides, merge_rules, rollout_rules, placed_on,
  reshard_program, in_layout, cast_program.

Tokenizer, chat format, GGUF conversion and row packing (`models.packing`: several rows end to end in one, by
segment ids) live in sibling modules and are imported from there directly.
"""

from trace_jax.models.alignment import to_next_token_aligned, to_token_aligned  # noqa: F401
from trace_jax.models.cache import KVCache, attend_cached_block, extend, init_cache, prefill
from trace_jax.models.checkpoint_io import CheckpointError, load_pretrained, save_pretrained
from trace_jax.models.config import ConfigError, ModelConfig
from trace_jax.models.decoder import (
    build_attention_mask,
    forward,
    forward_hidden,
    hidden_logprobs,
    init_params,
    logits_from_hidden,
    param_logical_axes,
    param_shapes,
    token_logprobs,
)
from trace_jax.models.presets import PRESETS, get_preset, preset_names
from trace_jax.models.sharding import (
    DEFAULT_RULES,
    LOGICAL_AXES,
    ROLLOUT_RULES,
    cache_logical_axes,
    cast_program,
    check_rule_overrides,
    constrain,
    in_layout,
    logical_to_mesh_spec,
    logical_to_sharding,
    make_mesh,
    merge_rules,
    param_shardings,
    placed_on,
    reshard_program,
    rollout_rules,
    shard_params,
)

__all__ = [
    "CheckpointError", "ConfigError", "DEFAULT_RULES", "KVCache", "LOGICAL_AXES", "ModelConfig", "PRESETS",
    "ROLLOUT_RULES", "attend_cached_block", "build_attention_mask", "cache_logical_axes", "cast_program",
    "check_rule_overrides",
    "constrain", "extend", "forward", "forward_hidden", "get_preset", "hidden_logprobs", "init_cache", "init_params",
    "load_pretrained", "logical_to_mesh_spec", "logical_to_sharding", "logits_from_hidden", "make_mesh",
    "merge_rules", "param_logical_axes", "param_shapes", "param_shardings", "placed_on", "prefill", "preset_names",
    "reshard_program", "in_layout", "rollout_rules", "save_pretrained", "shard_params", "token_logprobs",
]
