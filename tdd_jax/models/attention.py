"""Multi-head attention as in diffusers' ``Attention`` (to_q, to_k, to_v, to_out.0)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tdd_jax.models.layers import Linear

# Scores per query chunk on the CPU: B * H * chunk * L_k floats (2 MiB), about one core's L2 cache.
CPU_CHUNK_SCORES = 2**19
# Fewest query rows per chunk, so that large batches do not loop over single rows.
MIN_CHUNK = 16


def query_chunk(batch: int, heads: int, q_len: int, k_len: int, target: int = CPU_CHUNK_SCORES) -> int:
    """The largest divisor of ``q_len`` not above ``max(MIN_CHUNK, target / (batch * heads * k_len))``."""
    limit = max(MIN_CHUNK, target // (batch * heads * k_len))
    return max(c for c in range(1, q_len + 1) if q_len % c == 0 and c <= limit)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """(B, L, H, d) -> (L / chunk, B, H, chunk, d)."""
    b, l, h, d = x.shape
    return x.reshape(b, l // chunk, chunk, h, d).transpose(1, 0, 3, 2, 4)


def _unchunk(x: jax.Array) -> jax.Array:
    """(L / chunk, B, H, chunk, d) -> (B, L, H, d)."""
    n, b, h, c, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V on (B, L, H, d), ``chunk`` query rows at a time (Dao 2023, Alg. 1-2).

    The forward keeps only the output and each row's log-sum-exp; the backward recomputes each
    chunk's probabilities from them and accumulates dK and dV over the chunks. XLA:CPU otherwise
    materialises all B x H x L_q x L_k scores and probabilities (and transposes them for the
    backward), which then run from main memory instead of cache.
    """
    return _chunked_forward(q, k, v, chunk)[0]


def _chunked_forward(q, k, v, chunk):
    scale = q.shape[-1] ** -0.5
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def one(qc):
        s = jnp.einsum("bhqd,bhkd->bhqk", qc, kh) * scale
        m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
        p = jnp.exp(s - m)
        total = p.sum(-1, keepdims=True)
        return jnp.einsum("bhqk,bhkd->bhqd", p, vh) / total, (m + jnp.log(total))[..., 0]

    out, lse = jax.lax.map(one, _chunks(q, chunk))
    return _unchunk(out), (q, k, v, out, lse)


def _chunked_backward(chunk, residuals, grad):
    q, k, v, out, lse = residuals
    scale = q.shape[-1] ** -0.5
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    grad = _chunks(grad, chunk)
    delta = jnp.sum(grad * out, -1)  # rowsum(dO * O) = rowsum(P * dP)

    def body(carry, xs):  # in the transposed domain (keys x queries): every product but dQ's is a plain matmul
        dk, dv = carry
        qc, gc, lse_c, delta_c = xs
        p_t = jnp.exp(jnp.einsum("bhkd,bhqd->bhkq", kh, qc) * scale - lse_c[..., None, :])
        dv = dv + jnp.einsum("bhkq,bhqd->bhkd", p_t, gc)
        ds_t = p_t * (jnp.einsum("bhkd,bhqd->bhkq", vh, gc) - delta_c[..., None, :]) * scale
        dk = dk + jnp.einsum("bhkq,bhqd->bhkd", ds_t, qc)
        return (dk, dv), jnp.einsum("bhkq,bhkd->bhqd", ds_t, kh)

    (dk, dv), dq = jax.lax.scan(body, (jnp.zeros_like(kh), jnp.zeros_like(vh)), (_chunks(q, chunk), grad, lse, delta))
    return _unchunk(dq), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


chunked_attention.defvjp(_chunked_forward, _chunked_backward)


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array, num_heads: int, *,
                         is_causal: bool = False) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V per head (Vaswani et al. 2017, eq. 1); (B, L, H*d) in and out.

    Lowered for the CPU, long non-causal attention runs in query chunks (``chunked_attention``); every other
    platform gets ``jax.nn.dot_product_attention`` whole (``lax.platform_dependent`` keeps only the lowered
    platform's branch, so an accelerator program is unchanged).
    """
    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], num_heads, t.shape[2] // num_heads)

    q, k, v = heads(q), heads(k), heads(v)
    chunk = query_chunk(q.shape[0], num_heads, q.shape[1], k.shape[1])
    if is_causal or chunk == q.shape[1]:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)
    else:
        def cpu(q, k, v):  # float32 throughout, as dot_product_attention's softmax
            f32 = [t.astype(jnp.float32) for t in (q, k, v)]
            return chunked_attention(*f32, chunk).astype(q.dtype)

        out = jax.lax.platform_dependent(q, k, v, cpu=cpu, default=jax.nn.dot_product_attention)
    return out.reshape(out.shape[0], out.shape[1], -1)


class Attention(nnx.Module):
    """Self-attention, or cross-attention when ``context_dim`` is given."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, context_dim: int | None = None,
                 qkv_bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs | None):
        inner = num_heads * head_dim
        context_dim = dim if context_dim is None else context_dim
        self.to_q = Linear(dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_k = Linear(context_dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_v = Linear(context_dim, inner, use_bias=qkv_bias, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_out = Linear(inner, dim, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.num_heads = num_heads

    def __call__(self, x: jax.Array, context: jax.Array | None = None, lora_scale: float = 1.0) -> jax.Array:
        context = x if context is None else context
        q = self.to_q(x, lora_scale)
        k = self.to_k(context, lora_scale)
        v = self.to_v(context, lora_scale)
        return self.to_out(multi_head_attention(q, k, v, self.num_heads), lora_scale)
