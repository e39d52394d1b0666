"""Rotary position embeddings (Su et al. 2021, RoFormer eq. 34) with Llama 3.1 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from starpo_jax.models.config import TransformerConfig


def inverse_frequencies(config: TransformerConfig) -> np.ndarray:
    """theta_i = base^(-2i/d) for i < d/2, rescaled by the Llama 3.1 rule when ``rope_type == "llama3"``.

    Llama 3.1 divides the frequencies whose wavelength exceeds
    ``original_max_position / low_freq_factor`` by ``factor``, keeps those shorter than
    ``original_max_position / high_freq_factor`` and interpolates linearly in between.
    """
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if config.rope_type == "default":
        return inv_freq.astype(np.float32)
    wavelength = 2 * math.pi / inv_freq
    context = config.rope_original_max_position
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    smooth = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / config.rope_factor + smooth * inv_freq
    return scaled.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x[..., T, heads, head_dim]`` by angle ``position * theta_i``.

    Uses the half-split pairing of Hugging Face checkpoints: dimension ``i`` is paired
    with ``i + d/2``. Angles are computed in float32 and the result is cast back.
    """
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
