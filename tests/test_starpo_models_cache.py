"""The KV cache (appending left-padded segments equals one forward over their concatenation) and bf16 compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache, segment_positions, write
from starpo_jax.models.transformer import CausalLM
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


@pytest.mark.parametrize("width", [1, 3])
def test_a_segment_scattered_into_the_stacked_cache_equals_the_layers_own_write(width):
    """The CPU decoder writes into layer 1 of the stacked ``[L, B, K, S, D]`` cache; the other layers and the
    other slots stay as they were; pads (the mask's zeros) are dropped."""
    rng = np.random.default_rng(0)
    stacked = jnp.asarray(rng.normal(size=(3, 2, 2, 8, 4)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(2, width, 2, 4)), jnp.float32)
    mask = jnp.asarray([[1] * width, [0] + [1] * (width - 1)], jnp.int32)
    positions = segment_positions(mask, jnp.asarray([2, 5]))
    got = write(stacked, new, positions, mask, jnp.int32(1))
    want = np.asarray(stacked).copy()
    for b in range(2):
        for t in range(width):
            if mask[b, t]:
                want[1, b, :, int(positions[b, t])] = new[b, t]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], write(stacked[1], new, positions, mask))


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


def test_only_the_cpu_lowering_uses_the_cpu_attention(monkeypatch):
    """The decoder's gradient through its scanned layers: the CPU lowering runs ``runtime.chunked_attention``, a TPU
    lowering costs the same FLOPs and bytes as a decoder that has no CPU branch at all (the switch sits around
    the layer loop: inside it, its index became a per-layer residual and the TPU program kept both branches)."""
    graphdef, params = numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)

    def lowered(platform):
        loss = lambda p, t: jnp.sum(nnx.merge(graphdef, p)(t, jnp.ones_like(t))[0] ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss)).trace(params, tokens).lower(lowering_platforms=(platform,))

    kernel = 'loc("_cpu_attention"'  # the CPU kernel's frame in the lowered program's locations
    assert kernel in lowered("cpu").as_text(debug_info=True)
    tpu = lowered("tpu").cost_analysis()
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, default, **_: default(*args))
    cpu_free = lowered("tpu")
    assert kernel not in cpu_free.as_text(debug_info=True)
    want = cpu_free.cost_analysis()
    assert {k: tpu[k] for k in ("flops", "bytes accessed")} == {k: want[k] for k in ("flops", "bytes accessed")}
