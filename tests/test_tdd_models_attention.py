"""The CPU's query-chunked attention against ``jax.nn.dot_product_attention``, and the platform split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import SingleDeviceSharding

from runtime import aot
from runtime.chunked_attention import chunked_attention, query_chunk
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


def test_the_cpu_lowering_is_chunked_below_the_tpus_chunk():
    # 1 x 8 x 1024 x 1024 scores: the CPU gets the chunked loops; for a TPU (at least 128-row chunks of 2**25
    # scores) they are one chunk, so it gets the whole dot_product_attention
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


def test_bfloat16_chunked_attention_is_float32_attention_within_bfloat16_rounding():
    q, k, v = (jnp.asarray(t, jnp.bfloat16) for t in _inputs(lq=256, lk=256, h=2, d=16))
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    out = chunked_attention(q, k, v, None, 64)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), jax.nn.dot_product_attention(*f32), atol=2e-2)
    grads = jax.grad(_loss(lambda *a: chunked_attention(*a, None, 64).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(_loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(*f32)
    for got, ref in zip(grads, want):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.abs(ref).max())
        np.testing.assert_allclose(got.astype(jnp.float32) / scale, ref / scale, atol=3e-2)


@pytest.fixture(scope="module")
def tpu_device():
    return aot.describe_slice("v5e:2x4").devices[0]


def _tpu_compiled(device, attend, length=4096, heads=8, unroll=False):
    x = jax.ShapeDtypeStruct((1, length, heads * 64), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    fn = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, heads, unroll).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    return jax.jit(fn).trace(x, x, x).lower(lowering_platforms=("tpu",)).compile()


def test_the_tpu_lowering_attends_in_chunks_without_holding_the_scores(tpu_device):
    # 8 heads x 4,096^2 float32 scores are 512 MiB: the whole dot_product_attention holds them (and the
    # probabilities) for the backward, the TPU's 1,024-row chunks one chunk's at a time
    scores = 8 * 4096**2 * 4
    whole = _tpu_compiled(tpu_device, lambda q, k, v, h, _: _whole_heads(q, k, v, h))
    chunked = _tpu_compiled(tpu_device, lambda q, k, v, h, unroll: multi_head_attention(q, k, v, h, unroll=unroll))
    assert whole.memory_analysis().temp_size_in_bytes >= scores
    assert chunked.memory_analysis().temp_size_in_bytes < scores / 2
    # unrolled for the cost analysis, every chunk is counted: QK^T and PV forward, then QK^T again, dV, dP, dK
    # and dQ backward, 7 matmuls of 2 * 8 * 4,096^2 * 64 FLOPs (the softmax's few more)
    unrolled = _tpu_compiled(tpu_device, lambda q, k, v, h, unroll: multi_head_attention(q, k, v, h, unroll=True))
    matmuls = 7 * 2 * 8 * 4096**2 * 64
    assert matmuls <= unrolled.cost_analysis()["flops"] < 1.2 * matmuls
    assert chunked.cost_analysis()["flops"] < matmuls / 2  # the loop's body counted once


def _whole_heads(q, k, v, heads):
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, -1)
    return jax.nn.dot_product_attention(split(q), split(k), split(v)).reshape(q.shape)
