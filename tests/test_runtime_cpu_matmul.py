"""``runtime.cpu_matmul.contract``: the values and gradients of ``dot_general``; only the CPU's lowering changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.cpu_matmul import contract


def _dot(x, w, n_in):
    return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))


def _loss(fn, n_in):  # non-linear in the output, so that every weight-gradient entry gets its own weight
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w, n_in)) * jnp.arange(w.shape[-1]))


@pytest.mark.parametrize("x_shape, w_shape", [((2, 5, 3), (3, 7)),      # narrow x: dW = (x^T) dy
                                              ((2, 5, 7), (7, 3)),      # narrow dy: dW = ((dy^T) x)^T
                                              ((4, 2, 3), (2, 3, 5))])  # two contracted axes (heads x head_dim)
def test_values_and_gradients_equal_dot_general(x_shape, w_shape):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=x_shape).astype(np.float32), rng.normal(size=w_shape).astype(np.float32)
    n_in = len(w_shape) - 1
    np.testing.assert_allclose(jax.jit(contract, static_argnums=2)(x, w, n_in), _dot(x, w, n_in), rtol=1e-6, atol=1e-6)
    got = jax.jit(jax.grad(_loss(contract, n_in), argnums=(0, 1)))(x, w)
    want = jax.grad(_loss(_dot, n_in), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_only_the_cpu_lowering_changes():
    """Layers scanned as in the decoder: a TPU lowering has the same FLOPs and bytes as plain ``dot_general``."""
    x, w = jax.ShapeDtypeStruct((2, 64, 32), jnp.float32), jax.ShapeDtypeStruct((3, 32, 32), jnp.float32)

    def lowered(platform, fn):
        def loss(x, w):
            h, _ = jax.lax.scan(lambda h, layer: (h + jnp.sin(fn(h, layer, 1)), None), x, w)
            return jnp.sum(h)
        return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(lowering_platforms=(platform,))

    assert "optimization_barrier" in lowered("cpu", contract).as_text()
    tpu = lowered("tpu", contract)
    assert "optimization_barrier" not in tpu.as_text()
    want = lowered("tpu", _dot).cost_analysis()
    assert {k: tpu.cost_analysis()[k] for k in ("flops", "bytes accessed")} == {
        k: want[k] for k in ("flops", "bytes accessed")}
