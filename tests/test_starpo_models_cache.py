"""The KV cache (appending left-padded segments equals one forward over their concatenation) and bf16 compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache, segment_positions
from starpo_jax.models.transformer import CausalLM, attend
from starpo_hf_fixtures import numpy_initialised

CONFIG = TransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, model_type="qwen3", qk_norm=True, attention_bias=False)


@pytest.fixture(scope="module")
def forward():
    graphdef, params = numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    apply = jax.jit(lambda p, tokens, mask, cache: nnx.merge(graphdef, p)(tokens, mask, cache))
    return lambda tokens, mask, cache=None: apply(params, tokens, mask, cache)


def test_segment_positions_hand_worked():
    mask = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]])
    np.testing.assert_array_equal(segment_positions(mask, jnp.array([0, 0, 0])), [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 1]])
    np.testing.assert_array_equal(segment_positions(mask, jnp.array([5, 2, 1])), [[4, 4, 5, 6], [2, 3, 4, 5], [0, 1, 1, 2]])


def test_three_appended_segments_equal_one_forward(forward):
    rng = np.random.default_rng(0)
    row_lengths = [[4, 2, 3], [1, 4, 2], [3, 3, 0]]  # segment s, row b
    segments = []
    for lengths in row_lengths:
        tokens = rng.integers(1, CONFIG.vocab_size, (3, 4)).astype(np.int32)
        mask = np.zeros((3, 4), np.int32)
        for row, n in enumerate(lengths):
            mask[row, 4 - n:] = 1
        segments.append((tokens, mask))
    cache = init_cache(CONFIG, 3, 16)
    cached = []
    for tokens, mask in segments:
        logits, cache = forward(tokens, mask, cache)
        cached.append(np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 9, 5])

    width = 9
    full_tokens = np.zeros((3, width), np.int32)
    full_mask = np.zeros((3, width), np.int32)
    expected = [[] for _ in range(3)]
    for row in range(3):
        valid = np.concatenate([t[row][m[row].astype(bool)] for t, m in segments])
        full_tokens[row, width - len(valid):] = valid
        full_mask[row, width - len(valid):] = 1
        for s, (_, m) in enumerate(segments):
            expected[row].extend(cached[s][row][m[row].astype(bool)])
    full_logits, _ = forward(full_tokens, full_mask)
    full_logits = np.asarray(full_logits)
    for row in range(3):
        got = full_logits[row][full_mask[row].astype(bool)]
        np.testing.assert_allclose(np.stack(expected[row]), got, atol=1e-5, rtol=0)


def test_bfloat16_compute_stays_close_to_float32():
    """bf16 activations (fp32 parameters): logits within a few bf16 ulps of the fp32 ones."""
    graphdef32, params = numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    graphdef16, _ = numpy_initialised(lambda: CausalLM(bf16, rngs=nnx.Rngs(0)))
    tokens = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
    mask = np.ones_like(tokens)
    run = jax.jit(lambda g, p: nnx.merge(g, p)(tokens, mask)[0], static_argnums=0)
    exact, approx = np.asarray(run(graphdef32, params)), np.asarray(run(graphdef16, params))
    assert approx.dtype == np.float32
    scale = np.abs(exact).max()
    assert 0 < np.abs(approx - exact).max() < 0.05 * scale


def test_query_chunked_attention_equals_full_attention_with_gradients():
    """``attention_chunk`` (blocks of 3 queries over 8 left-padded tokens, one block padded): the same logits
    and parameter gradients as attending all queries at once."""
    graphdef, params = numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    chunked, _ = numpy_initialised(lambda: CausalLM(dataclasses.replace(CONFIG, attention_chunk=3),
                                                    rngs=nnx.Rngs(0)))
    tokens = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    weights = np.random.default_rng(1).normal(size=(2, 8, CONFIG.vocab_size)).astype(np.float32)

    def loss(g, p):
        logits = nnx.merge(g, p)(tokens, mask)[0]
        return jnp.sum(jnp.where(mask[..., None] > 0, logits * weights, 0.0)), logits

    run = jax.jit(jax.grad(loss, argnums=1, has_aux=True), static_argnums=0)
    (grads, logits), (grads_c, logits_c) = run(graphdef, params), run(chunked, params)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits_c)[valid], np.asarray(logits)[valid], atol=1e-5, rtol=0)
    # float32 sums over tokens in two different orders (blocked dot_product_attention vs the CPU attention,
    # weight gradients as GEMMs; gradients up to ~7): the worst element sat at 0.9 of 1e-5 before the GEMMs
    for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=3e-5)


def test_only_the_cpu_lowering_uses_the_cpu_attention():
    """``attend`` without ``chunk``: the CPU lowering runs ``runtime.cpu_attention`` (loops), a TPU lowering keeps
    ``dot_product_attention`` with the same FLOPs and bytes."""
    q = jax.ShapeDtypeStruct((2, 64, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 8), jnp.float32)
    mask = jax.ShapeDtypeStruct((2, 1, 64, 64), jnp.bool_)

    def lowered(platform, fn):
        grad = jax.grad(lambda q, k, v, m: jnp.sum(fn(q, k, v, m) ** 2), argnums=(0, 1, 2))
        return jax.jit(grad).trace(q, kv, kv, mask).lower(lowering_platforms=(platform,))

    whole = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)  # noqa: E731
    assert "stablehlo.while" in lowered("cpu", attend).as_text()
    tpu = lowered("tpu", attend)
    assert "stablehlo.while" not in tpu.as_text()
    want = lowered("tpu", whole).cost_analysis()
    assert {k: tpu.cost_analysis()[k] for k in ("flops", "bytes accessed")} == {
        k: want[k] for k in ("flops", "bytes accessed")}
