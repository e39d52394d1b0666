"""The CPU's query-chunked attention against ``jax.nn.dot_product_attention``, and the platform split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.cpu_attention import chunked_attention, query_chunk
from tdd_jax.models.attention import multi_head_attention


def _inputs(b=2, lq=64, lk=48, h=2, d=4):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(b, lq, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, lk, h, d)).astype(np.float32) for _ in range(2))
    return q, k, v


def _loss(attend):  # a non-linear function of the output, so that dK and dV see every row's weight
    return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)) * jnp.arange(q.shape[-1]))


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_attention_matches_dot_product_attention(chunk):
    q, k, v = _inputs()
    want = jax.nn.dot_product_attention(q, k, v)
    np.testing.assert_allclose(chunked_attention(q, k, v, None, chunk), want, rtol=1e-5, atol=1e-6)
    grads = jax.grad(_loss(lambda *a: chunked_attention(*a, None, chunk)), argnums=(0, 1, 2))(q, k, v)
    want_grads = jax.grad(_loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_masked_chunked_attention_matches_dot_product_attention():
    q, k, v = _inputs(lq=32, lk=32)
    mask = np.tril(np.ones((32, 32), bool))[None, None] & np.ones((2, 1, 1, 1), bool)
    mask[1, :, :, :5] = False  # left padding of row 1: its first 5 queries see no key at all (uniform weights)
    attend = {"ours": lambda *a: chunked_attention(*a, jnp.asarray(mask), 8),
              "reference": lambda *a: jax.nn.dot_product_attention(*a, mask=jnp.asarray(mask))}
    np.testing.assert_allclose(attend["ours"](q, k, v), attend["reference"](q, k, v), rtol=1e-5, atol=1e-6)
    grads = {name: jax.grad(_loss(fn), argnums=(0, 1, 2))(q, k, v) for name, fn in attend.items()}
    for got, ref in zip(grads["ours"], grads["reference"]):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_query_chunk():
    assert query_chunk(2, 8, 1024, 1024) == 32  # 2 x 8 x 32 x 1024 = 2**19 scores
    assert query_chunk(2, 8, 1024, 77) == 256  # largest divisor of 1024 below 425
    assert query_chunk(64, 8, 4096, 4096) == 16  # never below MIN_CHUNK rows
    assert query_chunk(1, 1, 77, 77) == 77  # short sequences stay whole


def _lowered(platform, attend=lambda q, k, v: multi_head_attention(q, k, v, 8)):
    x = jax.ShapeDtypeStruct((1, 1024, 64), jnp.float32)
    fn = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2))
    return jax.jit(fn).trace(x, x, x).lower(lowering_platforms=(platform,))


def _whole(q, k, v):
    heads = lambda t: t.reshape(1, 1024, 8, 8)
    return jax.nn.dot_product_attention(heads(q), heads(k), heads(v)).reshape(1, 1024, 64)


def test_only_the_cpu_lowering_is_chunked():
    # 1 x 8 x 1024 x 1024 scores: the CPU gets the chunked loops, the TPU the whole dot_product_attention
    assert "stablehlo.while" in _lowered("cpu").as_text()
    tpu = _lowered("tpu")
    assert "stablehlo.while" not in tpu.as_text()
    want = _lowered("tpu", _whole).cost_analysis()
    assert {k: tpu.cost_analysis()[k] for k in ("flops", "bytes accessed")} == {
        k: want[k] for k in ("flops", "bytes accessed")}
    # and the values agree with the unchunked call on this machine (query chunks of 64 rows)
    q, k, v = (np.random.default_rng(i).normal(size=(1, 1024, 64)).astype(np.float32) for i in range(3))
    want = jax.nn.dot_product_attention(*(t.reshape(1, 1024, 8, 8) for t in (q, k, v))).reshape(1, 1024, 64)
    np.testing.assert_allclose(jax.jit(lambda *a: multi_head_attention(*a, 8))(q, k, v), want, rtol=1e-5, atol=1e-6)
