"""Attention to the KV cache in blocks of filled slots, against a NumPy softmax; its TPU lowering's memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from runtime import aot
from starpo_jax.models import cache_attention as module
from starpo_jax.models.cache_attention import cache_attention
from starpo_jax.models.kv_cache import attention_mask, cache_key_mask, segment_positions

B, T, KV, GROUPS, D, S = 3, 3, 2, 2, 8, 10


def _case(before):
    """Random queries and cache, and the mask of a left-padded 3-token segment appended after ``before``."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, KV * GROUPS, D)).astype(np.float32)
    keys, values = (rng.normal(size=(B, KV, S, D)).astype(np.float32) for _ in range(2))
    segment = np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1]], bool)
    lengths = np.asarray(before) + segment.sum(1)
    mask = attention_mask(segment_positions(jnp.asarray(segment), jnp.asarray(before)),
                          *cache_key_mask(jnp.asarray(lengths), S))
    return q, keys, values, np.asarray(mask), segment, int(lengths.max())


def _softmax_attention(q, keys, values, mask):
    """Per row, query and head: softmax over the slots the mask keeps, in float64."""
    out = np.zeros(q.shape)
    for b, t, h in np.ndindex(*q.shape[:3]):
        kept = mask[b, 0, t]
        scores = keys[b, h // GROUPS, kept] @ q[b, t, h] / np.sqrt(D)
        weights = np.exp(scores - scores.max())
        out[b, t, h] = weights / weights.sum() @ values[b, h // GROUPS, kept]
    return out


@pytest.mark.parametrize("before", [[3, 0, 5], [7, 0, 5]])
@pytest.mark.parametrize("unroll", [False, True])
def test_cache_attention_is_the_softmax_over_the_kept_slots(monkeypatch, before, unroll):
    # 4-slot blocks over 10 slots: 0-3, 4-7 and the last shifted back to 6-9 (its slots 6 and 7 not counted
    # twice); rows filled to 6 read the first two blocks, a row filled to 10 all three
    monkeypatch.setattr(module, "CACHE_BLOCK", 4)
    q, keys, values, mask, segment, filled = _case(before)
    if not unroll and filled <= 8:  # the slots past the blocks read are never touched
        keys[:, :, 8:], values[:, :, 8:] = np.nan, np.nan
    got = np.asarray(cache_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask),
                                     jnp.int32(filled), unroll))
    want = _softmax_attention(q, keys, values, mask)
    np.testing.assert_allclose(got[segment], want[segment], rtol=1e-5, atol=1e-6)


def test_the_tpu_lowering_holds_one_block_of_scores():
    # a 512-token prefill of 8 heads over an 8,192-slot cache: 128 MiB of float32 scores for
    # dot_product_attention, 8 MiB per 512-slot block here
    device = aot.describe_slice("v5e:2x4").devices[0]
    sds = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    q, cache, mask = sds((1, 512, 8, 128)), sds((1, 2, 8192, 128)), sds((1, 1, 512, 8192), bool)
    scores = 8 * 512 * 8192 * 4

    def compiled(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile().memory_analysis()

    whole = compiled(lambda q, k, v, m: jax.nn.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                                                     mask=m), q, cache, cache, mask)
    blocked = compiled(cache_attention, q, cache, cache, mask, sds((), jnp.int32))
    assert whole.temp_size_in_bytes >= scores
    assert blocked.temp_size_in_bytes < scores / 4
