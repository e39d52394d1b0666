"""Attention of a segment to the KV cache that reads only the cache's filled blocks (TPU and GPU).

A cached call's keys are the whole cache, ``max_model_len + response_length`` slots, however few of them a
turn has filled. ``jax.nn.dot_product_attention`` reads every slot at every decode step and, in a prefill,
holds ``[B, H, T, S]`` float32 scores: 3.4 GiB per device in the Qwen2.5-7B sampler on a v5e-8 (its buffer
assignment, seen with ``launch.compile``). ``cache_attention`` walks the cache in blocks of ``CACHE_BLOCK``
slots up to the longest row's length, in a loop whose trip count is known only when it runs, keeping a
running maximum, sum and output per query (the online softmax of Milakov & Gimelshein 2018, as in
FlashAttention's forward pass): a step reads the filled slots and holds one block's scores. The CPU keeps
its own route to the filled slots (``starpo_jax.sampler.on_filled_slots``). No gradient: the cache is only
read by the sampler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Slots per block: a decode step reads at most this many unfilled slots.
CACHE_BLOCK = 512
# The score of a masked-out slot, as ``jax.nn.dot_product_attention``'s.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def cache_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, filled: jax.Array,
                    unroll: bool = False) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V of ``q[B, T, H, d]`` over the cache's first ``filled`` slots.

    Args:
      q: queries ``[B, T, H, d]``; query head ``h`` reads kv head ``h // (H / K)``.
      keys, values: one layer's cache ``[B, K, S, d]`` (``starpo_jax.models.kv_cache.CACHE_AXES``).
      mask: boolean ``[B, 1, T, S]``; every slot at or past ``filled`` must be masked out.
      filled: int32 scalar, the slots in use (the longest row's length); blocks past it are not read.
      unroll: read every block in a Python loop (for XLA's cost analysis, which counts a loop body once).

    Returns:
      ``[B, T, H, d]`` in ``q``'s dtype. A row with every slot masked gets the mean of the values read
      (``dot_product_attention`` averages all slots); such rows are pads, whose outputs are never used.
    """
    b, t, heads, d = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    block = min(CACHE_BLOCK, slots)
    grouped = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scale = d ** -0.5

    def read(i, carry):
        top, total, out = carry
        # The last block is shifted back to end at the last slot; the slots it repeats are masked out.
        start = jnp.minimum(i * block, slots - block)
        k, v, m = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=axis)
                   for x, axis in ((keys, 2), (values, 2), (mask, 3)))
        fresh = start + jnp.arange(block) >= i * block
        scores = jnp.einsum("btkgd,bksd->bkgts", grouped, k.astype(q.dtype),
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(m[:, :, None] & fresh, scores, _MASKED)
        new_top = jnp.maximum(top, scores.max(-1))
        p = jnp.exp(scores - new_top[..., None])
        kept = jnp.exp(top - new_top)
        total = total * kept + p.sum(-1)
        out = out * kept[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p.astype(q.dtype), v.astype(q.dtype),
                                                 preferred_element_type=jnp.float32)
        return new_top, total, out

    shape = (b, kv_heads, heads // kv_heads, t)
    carry = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (d,), jnp.float32))
    if unroll:
        for i in range(-(-slots // block)):
            carry = read(i, carry)
    else:
        carry = jax.lax.fori_loop(0, (filled + block - 1) // block, read, carry)
    _, total, out = carry
    out = out / total[..., None]
    return jnp.moveaxis(out, 3, 1).reshape(b, t, heads, d).astype(q.dtype)
