"""Masked batch statistics shared by advantages, filtering and losses (verl ``torch_functional``).

Masks are float or bool arrays of the same shape as the values; 1 marks a real
position. All functions are jittable and never index with booleans.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


def masked_sum(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Sum of ``values`` over the positions where ``mask`` is set."""
    return jnp.sum(values * mask, axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """verl ``masked_mean``: ``sum(values * mask) / (sum(mask) + 1e-8)``; 0 for an empty mask."""
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + MEAN_EPS)


def masked_var(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Bessel-corrected variance over all masked positions (verl ``masked_var(unbiased=True)``).

    Decision 22 keeps the ``n / (n - 1)`` correction; with fewer than two masked
    positions (where verl raises) the correction factor is taken as 1.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean(jnp.square(values - mean), mask)
    count = jnp.sum(mask)
    return variance * count / jnp.maximum(count - 1.0, 1.0)


def masked_whiten(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``(values - mean_m) * rsqrt(var_m + 1e-8)`` with masked mean and unbiased masked variance."""
    values = jnp.asarray(values, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    return (values - masked_mean(values, mask)) * jax.lax.rsqrt(masked_var(values, mask) + WHITEN_EPS)
