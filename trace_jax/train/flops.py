"""FLOPs per token of a decoder config and model FLOP utilisation (MFU) against a table of peak FLOP/s.

Counted: every matmul (attention projections, MLP or the k active experts plus the router, the LM head) at 2
FLOPs per multiply-add, plus causal attention scores and values (each token attends to (S + 1) / 2 keys on
average). Training is 3x the forward (backward = 2x forward); rematerialisation is not counted, as is the MFU
convention (PaLM appendix B). Embedding lookups, norms and softmaxes are ignored.

This module knows nothing about params, losses or devices beyond the peak table and the CPU measurement.
"""

from __future__ import annotations

import time

# Dense bfloat16 peak FLOP/s per chip (vendor figures; GPUs without sparsity).
PEAK_FLOPS: dict[str, float] = {
    "tpu-v4": 275e12,
    "tpu-v5e": 197e12,
    "tpu-v5p": 459e12,
    "tpu-v6e": 918e12,
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}


def matmul_params_per_token(config) -> int:
    """Weights each token multiplies by in one forward pass (active experts only; embedding lookup excluded)."""
    d, h, k, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = d * (h + 2 * k) * dh + h * dh * d
    if config.is_moe:
        mlp = d * config.num_experts + config.num_experts_per_tok * 3 * d * config.moe_intermediate_size
    else:
        mlp = 3 * d * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp) + d * config.vocab_size


def flops_per_token(config, seq_len: int, *, training: bool = True) -> float:
    """FLOPs per token of a `seq_len`-token causal sequence: `2 * matmul params + 2 * layers * H * Dh * (S + 1)`
    for the forward, times 3 for a training step (see the module doc)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    forward = 2 * matmul_params_per_token(config)
    forward += 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * (seq_len + 1)
    return float(3 * forward if training else forward)


def measure_peak_flops(*, size: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """Measured FLOP/s of a jitted `size x size` matmul on the default device (best of `repeats`): the CPU's
    stand-in for a vendor peak."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def mfu(tokens_per_second: float, config, seq_len: int, *, chip: str | None = None, num_chips: int = 1,
        peak_flops: float | None = None) -> float:
    """Model FLOP utilisation of a training step: achieved `flops_per_token * tokens/s` over the peak of
    `num_chips` chips, the peak from `PEAK_FLOPS[chip]` or given as `peak_flops` (e.g. `measure_peak_flops()`)."""
    if peak_flops is None:
        if chip not in PEAK_FLOPS:
            raise KeyError(f"unknown chip {chip!r}; known: {sorted(PEAK_FLOPS)}, or pass peak_flops= (on CPU use "
                           "measure_peak_flops())")
        peak_flops = PEAK_FLOPS[chip]
    return tokens_per_second * flops_per_token(config, seq_len) / (peak_flops * num_chips)
