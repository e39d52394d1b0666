"""``x @ w`` whose weight gradient XLA:CPU runs as a plain GEMM (the accelerator lowering keeps ``dot_general``).

Differentiating ``x[..., in] @ w[in, out]`` gives ``dW = x^T dy`` contracting the leading (token) axis of
both operands. XLA:CPU lays the activation gradient out transposed for it and sends the product to Eigen,
several times slower than the same GEMM in YNNPACK (``bench/README.md``, UNet and LLM profiles). On the CPU,
``contract``'s backward transposes the narrower of ``x`` and ``dy`` into its own buffer first (an
``optimization_barrier`` keeps XLA from folding the transposes back into the dot), so that ``dW = (x^T) dy``
(or ``((dy^T) x)^T``, the small transpose of the product done apart) is a row-major GEMM. The values are the
same sums of products (up to the GEMM's blocking order).
"""

from __future__ import annotations

import functools
import math

import jax


def _dot(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))


def contract(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """``x``'s trailing ``n_in`` axes contracted with ``w``'s leading ``n_in`` axes (``x @ w`` for ``n_in=1``).

    The forward is ``dot_general`` everywhere. The backward lowered for the CPU forms the GEMM-shaped weight
    gradient above; lowered for any other platform it is ``dot_general``'s own (``lax.platform_dependent``
    keeps only the lowered platform's branch), so TPU and GPU programs are unchanged.
    """
    return _contract(x, w, n_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _contract(x, w, n_in):
    return _dot(x, w, n_in)


def _forward(x, w, n_in):
    return _dot(x, w, n_in), (x, w)  # what dot_general's own linearisation keeps


def _backward(n_in, residuals, dy):
    return jax.lax.platform_dependent(*residuals, dy, cpu=functools.partial(_gemm_grads, n_in=n_in),
                                      default=functools.partial(_autodiff_grads, n_in=n_in))


_contract.defvjp(_forward, _backward)


def _autodiff_grads(x, w, dy, n_in):
    return jax.vjp(functools.partial(_dot, n_in=n_in), x, w)[1](dy)


def _gemm_grads(x, w, dy, n_in):
    w2 = w.reshape(math.prod(w.shape[:n_in]), -1)
    x2, dy2 = x.reshape(-1, w2.shape[0]), dy.reshape(-1, w2.shape[1])
    if x2.shape[1] <= dy2.shape[1]:  # transpose the narrower activation: dW = (x^T) dy or ((dy^T) x)^T
        dw = jax.lax.optimization_barrier(x2.T) @ dy2
    else:
        dw = jax.lax.optimization_barrier(jax.lax.optimization_barrier(dy2.T) @ x2).T
    return (dy2 @ w2.T).reshape(x.shape).astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)
