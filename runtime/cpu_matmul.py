"""``x @ w`` whose weight gradient XLA:CPU runs as a plain GEMM (the accelerator lowering keeps ``x @ w``).

Differentiating ``x[..., in] @ w[in, out]`` gives ``dW = x^T dy`` contracting the leading (token) axis of
both operands. XLA:CPU lays the activation gradient out transposed for it and sends the product to Eigen,
several times slower than the same GEMM in YNNPACK (`bench/README.md`, UNet and LLM profiles). ``matmul``'s
backward on the CPU transposes ``x`` into its own buffer first (an ``optimization_barrier`` keeps XLA from
folding the transpose back into the dot), so that ``dW = (x^T) dy`` is a row-major GEMM. Values are the same
products, summed in the same order per output element up to the GEMM's blocking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _gemm_grad_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _forward(x, w):
    return x @ w, (x, w)


def _backward(residuals, dy):
    x, w = residuals
    x_t = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
    dw = (x_t @ dy.reshape(-1, dy.shape[-1])).astype(w.dtype)
    return (dy @ w.T).astype(x.dtype), dw


_gemm_grad_matmul.defvjp(_forward, _backward)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x[..., in] @ w[in, out]``; lowered for the CPU, with the GEMM-shaped weight gradient above.

    ``lax.platform_dependent`` keeps only the lowered platform's branch, so TPU and GPU programs are
    ``x @ w`` and its autodiff, unchanged.
    """
    return jax.lax.platform_dependent(x, w, cpu=_gemm_grad_matmul, default=jnp.matmul)
