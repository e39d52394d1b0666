"""Query-chunked attention with a FlashAttention-2 backward (Dao 2023, Alg. 1-2), for XLA:CPU and TPU.

``jax.nn.dot_product_attention``'s XLA path materialises all ``B x H x L_q x L_k`` scores and probabilities,
keeps them for the backward and (on the CPU) transposes them there: at SDXL's 64 x 64 level that is 10.7 GB
per attention call for 16 images on a TPU. ``chunked_attention`` keeps only the output and each row's
log-sum-exp, and its backward recomputes each chunk's probabilities in the keys x queries orientation, where
every product is a plain matmul (dQ is computed transposed). Products take the inputs' dtype (bf16 on the MXU)
and accumulate in float32; the softmax is float32 throughout. The UNet (``tdd_jax.models.attention``) selects
it when lowering for the CPU or a TPU, the decoder (``starpo_jax.models.transformer``) for the CPU, through
``lax.platform_dependent``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Scores per query chunk on the CPU: B * H * chunk * L_k floats (2 MiB), about one core's L2 cache.
CPU_CHUNK_SCORES = 2**19
# Fewest query rows per chunk, so that large batches do not loop over single rows.
MIN_CHUNK = 16
# On a TPU: scores per chunk (128 MiB in float32, small next to 16 GB of HBM) and at least the MXU's 128 rows.
TPU_CHUNK_SCORES = 2**25
TPU_MIN_CHUNK = 128


def query_chunk(batch: int, heads: int, q_len: int, k_len: int, target: int = CPU_CHUNK_SCORES,
                minimum: int = MIN_CHUNK) -> int:
    """The largest divisor of ``q_len`` not above ``max(minimum, target / (batch * heads * k_len))``."""
    limit = max(minimum, target // (batch * heads * k_len))
    return max(c for c in range(1, q_len + 1) if q_len % c == 0 and c <= limit)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """(B, L, H, d) -> (L / chunk, B, H, chunk, d)."""
    b, l, h, d = x.shape
    return x.reshape(b, l // chunk, chunk, h, d).transpose(1, 0, 3, 2, 4)


def _unchunk(x: jax.Array) -> jax.Array:
    """(L / chunk, B, H, chunk, d) -> (B, L, H, d)."""
    n, b, h, c, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, d)


def _mask_chunks(mask: jax.Array | None, chunk: int) -> jax.Array | None:
    """Boolean ``[B or 1, H or 1, L_q, L_k]`` -> ``(L_q / chunk, B or 1, H or 1, chunk, L_k)``."""
    if mask is None:
        return None
    b, h, l, s = mask.shape
    return jnp.moveaxis(mask.reshape(b, h, l // chunk, chunk, s), 2, 0)


def _masked(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Masked-out scores set to ``dot_product_attention``'s large negative (a fully masked row is uniform)."""
    return scores if mask is None else jnp.where(mask, scores, -0.7 * jnp.finfo(scores.dtype).max)


def _matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum`` in the dtype of ``b`` (``a`` cast to it), accumulated in float32."""
    return jnp.einsum(spec, a.astype(b.dtype), b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, chunk: int,
                      unroll: bool = False) -> jax.Array:
    """softmax(Q K^T / sqrt(d)) V on (B, L, H, d), ``chunk`` query rows at a time; the output in ``q``'s dtype.

    ``mask`` (boolean, broadcastable to ``[B, H, L_q, L_k]`` with all four axes present, or ``None``) keeps
    the scores where it is true, as ``jax.nn.dot_product_attention(..., mask=mask)``. ``unroll`` unrolls the
    loops over chunks (for XLA's cost analysis, which counts a loop body once).
    """
    return _chunked_forward(q, k, v, mask, chunk, unroll)[0]


def _chunked_forward(q, k, v, mask, chunk, unroll):
    scale = q.shape[-1] ** -0.5
    k_t, vh = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)

    def one(_, xs):
        qc, mc = xs
        s = _masked(_matmul("bhqd,bhdk->bhqk", qc, k_t) * scale, mc)
        m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
        p = jnp.exp(s - m)
        total = p.sum(-1, keepdims=True)
        out = (_matmul("bhqk,bhkd->bhqd", p, vh) / total).astype(q.dtype)
        return None, (out, (m[..., 0], jnp.log(total)[..., 0]))

    # The log-sum-exp is kept as (max, log of the sum): in a fully masked row the max is -0.7 * float max,
    # to which adding the log of the sum would round away.
    _, (out, lse) = jax.lax.scan(one, None, (_chunks(q, chunk), _mask_chunks(mask, chunk)), unroll=unroll)
    return _unchunk(out), (q, k, v, mask, out, lse)


def _chunked_backward(chunk, unroll, residuals, grad):
    q, k, v, mask, out, lse = residuals
    scale = q.shape[-1] ** -0.5
    kh, vh, k_t = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)
    grad = _chunks(grad.astype(q.dtype), chunk)
    delta = jnp.sum(grad.astype(jnp.float32) * out.astype(jnp.float32), -1)  # rowsum(dO * O) = rowsum(P * dP)

    def body(carry, xs):  # in the transposed domain (keys x queries), dQ transposed too
        dk, dv = carry
        qc, qc_t, gc, gc_t, (max_c, log_sum_c), delta_c, mc = xs
        mask_t = None if mc is None else jnp.swapaxes(mc, -1, -2)
        s_t = _masked(_matmul("bhkd,bhdq->bhkq", kh, qc_t) * scale, mask_t)
        p_t = jnp.exp(s_t - max_c[..., None, :] - log_sum_c[..., None, :])
        dv = dv + _matmul("bhkq,bhqd->bhkd", p_t, gc)
        ds_t = p_t * (_matmul("bhkd,bhdq->bhkq", vh, gc_t) - delta_c[..., None, :]) * scale
        if mask_t is not None:  # a masked score is a constant: no gradient (matters only in fully masked rows)
            ds_t = jnp.where(mask_t, ds_t, 0.0)
        dk = dk + _matmul("bhkq,bhqd->bhkd", ds_t, qc)
        return (dk, dv), _matmul("bhdk,bhkq->bhdq", k_t, ds_t.astype(k.dtype)).astype(q.dtype)  # dQ^T: a plain matmul

    q = _chunks(q, chunk)
    xs = (q, jnp.swapaxes(q, -1, -2), grad, jnp.swapaxes(grad, -1, -2), lse, delta, _mask_chunks(mask, chunk))
    zeros = (jnp.zeros(kh.shape, jnp.float32), jnp.zeros(vh.shape, jnp.float32))
    (dk, dv), dq_t = jax.lax.scan(body, zeros, xs, unroll=unroll)
    return (_unchunk(jnp.swapaxes(dq_t, -1, -2)), dk.astype(k.dtype).transpose(0, 2, 1, 3),
            dv.astype(v.dtype).transpose(0, 2, 1, 3), None)


chunked_attention.defvjp(_chunked_forward, _chunked_backward)
