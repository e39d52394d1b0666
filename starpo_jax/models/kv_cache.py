"""A key/value cache with per-row lengths, so several turns append to one cache.

Row ``b`` holds its tokens compactly in slots ``0 .. lengths[b] - 1``; the slot of a
token is also its 0-based position id (RAGEN HEAD: ``max(cumsum(mask) - 1, 0)``).
A new left-padded segment is written at ``lengths[b]`` onwards, pads dropped, so the
cache after several appends equals the cache of their concatenation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from runtime.mesh import logical_sharding
from starpo_jax.models.config import TransformerConfig

# Slots next to ``head_dim``: a ``[slots, head_dim]`` tile is what the TPU compiler lays out natively; with
# the few kv heads as the second-minor axis it re-laid the whole cache out in a copy (two cache-sized
# temporaries in the 7B sampler, seen with ``launch.compile``).
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


class KVCache(NamedTuple):
    """Keys and values ``[layers, batch, kv_heads, max_length, head_dim]`` and ``lengths[batch]``."""

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]


def cache_shape(config: TransformerConfig, batch: int, max_length: int) -> tuple[int, ...]:
    """The shape of the keys (and values) of a cache (``CACHE_AXES``)."""
    return config.num_layers, batch, config.num_kv_heads, max_length, config.head_dim


def init_cache(config: TransformerConfig, batch: int, max_length: int, dtype=None, mesh: Mesh | None = None) -> KVCache:
    """An empty cache (all lengths 0) in the compute dtype unless ``dtype`` is given.

    With ``mesh``, each array is created directly on its ``cache_shardings`` sharding.
    """
    shape = cache_shape(config, batch, max_length)
    dtype = config.compute_dtype if dtype is None else dtype
    kv, lengths = (None, None) if mesh is None else _shardings(shape, mesh)
    return KVCache(jnp.zeros(shape, dtype, device=kv), jnp.zeros(shape, dtype, device=kv),
                   jnp.zeros((batch,), jnp.int32, device=lengths))


def _shardings(shape: tuple[int, ...], mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    return logical_sharding(CACHE_AXES, shape, mesh), logical_sharding(("batch",), shape[1:2], mesh)


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """Batch over the data axes, kv heads over ``tensor``; lengths follow the batch."""
    kv, lengths = _shardings(cache.keys.shape, mesh)
    return KVCache(kv, kv, lengths)


def segment_positions(mask: jax.Array, lengths: jax.Array) -> jax.Array:
    """0-based position ids of a left-padded segment ``mask[B, T]`` appended after ``lengths[B]`` tokens.

    Pads get the position of the token before them (0 at the start); they are never attended to.
    """
    count = jnp.cumsum(mask.astype(jnp.int32), axis=-1)
    return jnp.maximum(lengths[:, None] + count - 1, 0)


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Causal mask ``[B, 1, T, S]``: query at position p sees valid keys at positions <= p."""
    causal = key_positions[:, None, :] <= query_positions[:, :, None]
    return (causal & key_valid[:, None, :])[:, None]


def write(layer_cache: jax.Array, new: jax.Array, positions: jax.Array, mask: jax.Array,
          layer: jax.Array | None = None) -> jax.Array:
    """Writes ``new[B, T, K, D]`` into ``layer_cache[B, K, S, D]`` at slot = position; pads are dropped.

    One decode token (``T == 1``) is written with a select over the slots, which XLA
    fuses and updates in place; a longer segment is scattered. With ``layer``, ``layer_cache`` is the stacked
    ``[L, B, K, S, D]`` cache and the segment is scattered into layer ``layer`` of it.
    """
    slots = jnp.where(mask.astype(bool), positions, layer_cache.shape[-2])
    new = new.astype(layer_cache.dtype)
    rows = jnp.arange(new.shape[0])[:, None]
    if layer is not None:
        return layer_cache.at[layer, rows, :, slots].set(new, mode="drop")
    if new.shape[1] == 1:
        hit = jnp.arange(layer_cache.shape[2])[None, :] == slots
        return jnp.where(hit[:, None, :, None], jnp.swapaxes(new, 1, 2), layer_cache)
    return layer_cache.at[rows, :, slots].set(new, mode="drop")


def cache_key_mask(lengths: jax.Array, max_length: int) -> tuple[jax.Array, jax.Array]:
    """Positions and validity ``[B, S]`` of the cache slots once ``lengths`` tokens are stored."""
    slots = jnp.broadcast_to(jnp.arange(max_length, dtype=jnp.int32), (lengths.shape[0], max_length))
    return slots, slots < lengths[:, None]
