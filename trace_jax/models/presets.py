"""Named model presets: the published shapes of supported checkpoints plus tiny CPU test models.

`get_preset(name, **overrides)` returns a validated `ModelConfig`. The real presets copy the shapes of the
published Hugging Face `config.json` files so that ahead-of-time compilation and memory planning are faithful;
weights come from `load_pretrained`. The `tiny-*` presets train on a 2-core CPU.
"""

from __future__ import annotations

from trace_jax.models.config import ModelConfig

_QWEN3_COMMON = dict(model_type="qwen3", vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, qk_norm=True, bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(_QWEN3_COMMON, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # Tiny models for tests and the CPU default config.
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=1_000_000.0, max_position_embeddings=4096, qk_norm=True,
                       tie_word_embeddings=True),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rope_theta=1_000_000.0, max_position_embeddings=4096, qk_norm=True,
                           tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-llama": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                       tie_word_embeddings=True),
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of a named preset, with optional field overrides (e.g. `dtype="bfloat16"`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
