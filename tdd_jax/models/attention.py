"""Multi-head attention as in diffusers' ``Attention`` (to_q, to_k, to_v, to_out.0)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from runtime.chunked_attention import TPU_CHUNK_SCORES, TPU_MIN_CHUNK, chunked_attention, query_chunk
from tdd_jax.models.layers import Linear


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array, num_heads: int, *,
                         is_causal: bool = False, unroll: bool = False) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V per head (Vaswani et al. 2017, eq. 1); (B, L, H*d) in and out.

    Long non-causal attention runs in query chunks (``chunked_attention``) when lowered for the CPU (float32,
    chunks sized for its caches) or a TPU (the inputs' dtype, chunks sized for HBM; ``unroll`` unrolls them
    for XLA's cost analysis); a GPU gets ``jax.nn.dot_product_attention`` whole (``lax.platform_dependent``
    keeps only the lowered platform's branch).
    """
    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], num_heads, t.shape[2] // num_heads)

    q, k, v = heads(q), heads(k), heads(v)
    whole = functools.partial(jax.nn.dot_product_attention, is_causal=is_causal)
    if is_causal:
        return whole(q, k, v).reshape(*q.shape[:2], -1)
    sizes = q.shape[0], num_heads, q.shape[1], k.shape[1]
    cpu_chunk, tpu_chunk = query_chunk(*sizes), query_chunk(*sizes, TPU_CHUNK_SCORES, TPU_MIN_CHUNK)

    def cpu(q, k, v):  # float32 throughout, as dot_product_attention's softmax
        f32 = [t.astype(jnp.float32) for t in (q, k, v)]
        return chunked_attention(*f32, None, cpu_chunk).astype(q.dtype)

    def tpu(q, k, v):
        return chunked_attention(q, k, v, None, tpu_chunk, unroll)

    if cpu_chunk == tpu_chunk == q.shape[1]:
        out = whole(q, k, v)
    else:
        out = jax.lax.platform_dependent(q, k, v, cpu=cpu if cpu_chunk < q.shape[1] else whole,
                                         tpu=tpu if tpu_chunk < q.shape[1] else whole, default=whole)
    return out.reshape(out.shape[0], out.shape[1], -1)


class Attention(nnx.Module):
    """Self-attention, or cross-attention when ``context_dim`` is given; ``unroll`` as ``multi_head_attention``'s."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, context_dim: int | None = None,
                 qkv_bias: bool = False, unroll: bool = False, dtype=jnp.float32, rngs: nnx.Rngs | None):
        inner = num_heads * head_dim
        context_dim = dim if context_dim is None else context_dim
        self.to_q = Linear(dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_k = Linear(context_dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_v = Linear(context_dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_out = Linear(inner, dim, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.num_heads, self.unroll = num_heads, unroll

    def __call__(self, x: jax.Array, context: jax.Array | None = None, lora_scale: float = 1.0) -> jax.Array:
        context = x if context is None else context
        q = self.to_q(x, lora_scale)
        k = self.to_k(context, lora_scale)
        v = self.to_v(context, lora_scale)
        return self.to_out(multi_head_attention(q, k, v, self.num_heads, unroll=self.unroll), lora_scale)
