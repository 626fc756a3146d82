"""Shape and dtype checks run at the entry of every credit function.

They look only at static shapes and dtypes, so they work inside `jax.jit` as well as eagerly and cost nothing
at run time. Value checks (NaN, positive log-probs, out-of-range turn counts) need concrete arrays and live in
`trace_jax.credit.validate`.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_rank(name: str, x, rank: int | tuple[int, ...], expected: str) -> None:
    ranks = (rank,) if isinstance(rank, int) else rank
    if jnp.ndim(x) not in ranks:
        raise ValueError(f"{name}: expected {expected}, got an array of shape {jnp.shape(x)}")


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got dtype {jnp.result_type(x)}; cast it first")


def check_int(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name}: expected an integer array, got dtype {jnp.result_type(x)}")


def check_same_batch(**arrays) -> None:
    """All arrays share their leading (batch) dimension N."""
    if len({jnp.shape(a)[0] for a in arrays.values()}) != 1:
        detail = ", ".join(f"{name}{tuple(jnp.shape(a))}" for name, a in arrays.items())
        raise ValueError(f"{detail} disagree on N (the leading batch dimension)")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {sorted(choices)}")


def compute_dtype(*arrays):
    """float32 for float16/bfloat16/float32 inputs; float64 only when given float64 (and x64 is on)."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)
