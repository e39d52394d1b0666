"""The compiled sampler: log-probs agree with a teacher-forced forward, turns continue one cache, rows stop alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.models.config import TransformerConfig
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_batch, shard_state
from starpo_jax.models.kv_cache import cache_shardings, init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax import sampler as sampler_module
from starpo_jax.models import cache_attention as cache_attention_module
from starpo_jax.sampler import SamplerConfig, choose, filter_logits, make_sampler
from starpo_jax.tokenizer import stop_string_automaton
from starpo_hf_fixtures import numpy_initialised

CONFIG = TransformerConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, model_type="qwen2", attention_bias=True)
STOP_ID = 7
PIECES = ["a" if i % 3 == 0 else "b" if i % 3 == 1 else "c" for i in range(CONFIG.vocab_size)]
STOP_STRING = "ab"
BATCH, WIDTH, NEW, SLOTS = 6, 5, 10, 40


def left_padded(rng, lengths):
    tokens = np.zeros((len(lengths), WIDTH), np.int32)
    mask = np.zeros((len(lengths), WIDTH), np.int32)
    for row, n in enumerate(lengths):
        tokens[row, WIDTH - n:] = rng.integers(8, CONFIG.vocab_size, n)
        mask[row, WIDTH - n:] = 1
    return tokens, mask


@pytest.fixture(scope="module")
def setup():
    graphdef, params = numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(3)))
    stop = stop_string_automaton(PIECES, [STOP_STRING], CONFIG.vocab_size)
    config = SamplerConfig(max_new_tokens=NEW, temperature=0.8, stop_ids=(STOP_ID,), pad_id=0)
    sampler = make_sampler(graphdef, config, stop)
    forward = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, m)[0])
    rng = np.random.default_rng(0)
    cache = init_cache(CONFIG, BATCH, SLOTS)
    active = jnp.array([True, True, True, True, True, False])
    turns = []
    for turn in range(2):
        tokens, mask = left_padded(rng, [5, 3, 1, 4, 2, 2] if turn == 0 else [2, 5, 3, 1, 4, 0])
        out = sampler(params, tokens, mask, cache, jax.random.key(turn), active)
        cache = out.cache
        turns.append((tokens, mask, out))
    return params, forward, turns, cache, sampler


def test_rows_stop_at_stop_id_or_stop_string_and_pad_after(setup):
    _, _, turns, _, _ = setup
    stopped_by = set()
    for _, _, out in turns:
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        assert lengths[-1] == 0 and (tokens[-1] == 0).all(), "inactive row must not generate"
        for row in range(BATCH - 1):
            n = lengths[row]
            assert 1 <= n <= NEW
            text = "".join(PIECES[t] for t in tokens[row, :n])
            assert STOP_ID not in tokens[row, :n - 1] and STOP_STRING not in text[:-1] or n == 1
            if n < NEW:
                assert tokens[row, n - 1] == STOP_ID or text.endswith(STOP_STRING)
                stopped_by.add("id" if tokens[row, n - 1] == STOP_ID else "string")
            assert (tokens[row, n:] == 0).all() and (np.asarray(out.log_probs)[row, n:] == 0).all()
    assert stopped_by == {"id", "string"}, f"test data should exercise both stop kinds, got {stopped_by}"


def test_two_turns_continue_the_cache_and_log_probs_match_forward(setup):
    params, forward, turns, cache, sampler = setup
    assert sampler._cache_size() == 1, "two calls of one shape must compile once"
    rows = [[] for _ in range(BATCH)]
    scored = [[] for _ in range(BATCH)]  # (index in the row's sequence, sampled log-prob, temperature-scaled)
    for tokens, mask, out in turns:
        for row in range(BATCH):
            rows[row].extend(tokens[row][mask[row].astype(bool)])
            for j in range(int(out.lengths[row])):
                scored[row].append((len(rows[row]), float(out.log_probs[row, j])))
                rows[row].append(int(out.tokens[row, j]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [len(r) for r in rows])
    width = max(len(r) for r in rows)
    full = np.zeros((BATCH, width), np.int32)
    full_mask = np.zeros((BATCH, width), np.int32)
    for row, seq in enumerate(rows):
        full[row, width - len(seq):] = seq
        full_mask[row, width - len(seq):] = 1
    logits = np.asarray(forward(params, full, full_mask), np.float64) / 0.8
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for row, seq in enumerate(rows):
        offset = width - len(seq)
        for index, sampled in scored[row]:
            np.testing.assert_allclose(sampled, log_probs[row, offset + index - 1, seq[index]], atol=2e-5)


def test_filter_logits_top_k_and_top_p_hand_worked():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))
    inf = -np.inf
    np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 2, 1.0)), [[False, True, False, True]])
    # sorted mass 0.4, 0.3, 0.2, 0.1: top-p 0.6 keeps {0.4, 0.3}; 0.75 keeps {0.4, 0.3, 0.2}
    np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 0, 0.6)), [[False, True, False, True]])
    np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 0, 0.75)), [[False, True, True, True]])
    np.testing.assert_array_equal(np.asarray(filter_logits(logits, 1, 1.0))[0, [0, 2, 3]], [inf, inf, inf])


def test_choose_greedy_and_sampling_frequencies():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]] * 4000))
    tokens, log_probs = choose(logits, jax.random.key(0), SamplerConfig(1, greedy=True))
    assert (np.asarray(tokens) == 1).all()
    np.testing.assert_allclose(log_probs, np.log(0.4), rtol=1e-6)
    tokens, _ = choose(logits, jax.random.key(1), SamplerConfig(1, top_p=0.75))
    freq = np.bincount(np.asarray(tokens), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0, 4 / 9, 2 / 9, 3 / 9], atol=0.03)
    tokens, log_probs = choose(logits, jax.random.key(2), SamplerConfig(1, temperature=0.5))
    tempered = np.array([0.1, 0.4, 0.2, 0.3]) ** 2 / np.sum(np.array([0.1, 0.4, 0.2, 0.3]) ** 2)
    np.testing.assert_allclose(np.bincount(np.asarray(tokens), minlength=4) / 4000, tempered, atol=0.03)
    np.testing.assert_allclose(log_probs, np.log(tempered[np.asarray(tokens)]), rtol=1e-5)


def test_rows_of_a_batch_sampled_in_slices_draw_what_they_draw_whole():
    logits = jax.random.normal(jax.random.key(3), (12, 40))
    config = SamplerConfig(1, temperature=0.7, top_p=0.9)
    whole, whole_lp = choose(logits, jax.random.key(4), config)
    np.testing.assert_array_equal(choose(logits, jax.random.key(4), config, (jnp.arange(12), 12))[0], whole)
    rows = np.array([[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]])  # two blocks of 6 rows, each split in halves
    for part in rows:
        tokens, log_probs = choose(logits[part], jax.random.key(4), config, (jnp.asarray(part), 12))
        np.testing.assert_array_equal(tokens, np.asarray(whole)[part])
        np.testing.assert_allclose(log_probs, np.asarray(whole_lp)[part], rtol=1e-6)
    assert not (np.asarray(choose(logits[rows[1]], jax.random.key(4), config)[0]) == np.asarray(whole)[rows[1]]).all()


def test_stop_string_automaton_matches_substring_search():
    pieces = ["</", "answer", ">", "</answer>", "a", "</ans", "wer>", "x", "<", "/", "swer", "an", ">\n", "r><"]
    stop = stop_string_automaton(pieces, ["</answer>", "r><"], 20)
    table, lengths = np.asarray(stop.transitions), np.asarray(stop.lengths)
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 20, 12)
        states = np.zeros(2, np.int64)
        text = ""
        for token in seq:
            states = table[np.arange(2), states, token]
            text += pieces[token] if token < len(pieces) else "?"
            assert list(states >= lengths) == ["</answer>" in text, "r><" in text], text


def test_sampler_config_errors_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplerConfig(4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplerConfig(0)
    with pytest.raises(ValueError, match="temperature"):
        SamplerConfig(4, temperature=0.0)


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
@pytest.mark.parametrize("route", ["cpu", "accelerator"])
def test_sampler_on_a_mesh_equals_single_device(setup, monkeypatch, shape, route):
    """Data or FSDP with tensor parallelism; on a TPU or GPU (the forced default branch) a decode step keeps its
    residual split like the weights' embed axis (``DECODE_RESIDUAL``) and each row's attention reads its cache."""
    params, _, turns, _, _ = setup
    tokens, mask, expected = turns[0]
    if route == "accelerator":
        monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cpu, default: default(*args))
    mesh = make_mesh(MeshConfig(*shape), jax.devices()[:4])
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(3))))
    config = SamplerConfig(max_new_tokens=NEW, temperature=0.8, stop_ids=(STOP_ID,), pad_id=0)
    sampler = make_sampler(graphdef, config, stop_string_automaton(PIECES, [STOP_STRING], CONFIG.vocab_size), mesh)
    with jax.set_mesh(mesh):
        sharded = shard_state(params, mesh)
        cache = init_cache(CONFIG, BATCH, SLOTS, mesh=mesh)
        tokens_, mask_ = shard_batch((tokens, mask), mesh)
        active = jax.device_put(jnp.array([True] * 5 + [False]), cache.lengths.sharding)
        out = sampler(sharded, tokens_, mask_, cache, jax.random.key(0), active)
    assert out.cache.keys.sharding.is_equivalent_to(cache_shardings(out.cache, mesh).keys, 5)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(expected.lengths))
    np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(expected.log_probs), atol=1e-5)


def test_turns_on_the_filled_slots_of_a_larger_cache_equal_the_whole_cache(setup, monkeypatch):
    """With 16-slot blocks, a 64-slot cache runs turn 1 on its first 16 slots (known statically: the cache is
    empty) and turn 2 on 32: the same tokens and log-probs as the 40-slot cache used whole, the keys written in
    the same slots, the rest empty."""
    params, _, turns, small, _ = setup
    monkeypatch.setattr(sampler_module, "CPU_CACHE_BLOCK", 16)
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(3))))
    config = SamplerConfig(max_new_tokens=NEW, temperature=0.8, stop_ids=(STOP_ID,), pad_id=0)
    sampler = make_sampler(graphdef, config, stop_string_automaton(PIECES, [STOP_STRING], CONFIG.vocab_size))
    cache = init_cache(CONFIG, BATCH, 64)
    active = jnp.array([True, True, True, True, True, False])
    for turn, (tokens, mask, expected) in enumerate(turns):
        assert int(cache.lengths.max()) + WIDTH + NEW <= 16 * (turn + 1)
        out = sampler(params, tokens, mask, cache, jax.random.key(turn), active, empty=turn == 0)
        cache = out.cache
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
        np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(expected.log_probs), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(small.lengths))
    np.testing.assert_allclose(np.asarray(cache.keys[:, :, :, :SLOTS]), np.asarray(small.keys), atol=1e-5)
    assert not np.asarray(cache.keys[:, :, :, SLOTS:]).any() and not np.asarray(cache.values[:, :, :, SLOTS:]).any()
    # an empty cache (a first turn) takes its 16-slot prefix without a switch over the 4 prefixes: one copy of
    # the turn's program (and of the conditionals inside it) instead of 4
    tokens, mask, _ = turns[0]
    cases = {empty: sampler.lower(params, tokens, mask, init_cache(CONFIG, BATCH, 64), jax.random.key(0), active,
                                  empty=empty).as_text().count("stablehlo.case") for empty in (False, True)}
    assert 0 < cases[True] < cases[False] / 3


@pytest.mark.parametrize("attention_chunk", [0, 2])
def test_the_accelerator_route_samples_what_the_cpu_route_samples(setup, monkeypatch, attention_chunk):
    """On a TPU or GPU (``lax.platform_dependent``'s default branch, forced here) the sampler runs on the whole
    cache and each layer reads its filled slots in 12-slot blocks (``cache_attention``; at most 30 of the 40 are
    filled), for all queries at once or 2 at a time: the same tokens, log-probs and cache as the CPU's route,
    turn after turn."""
    params, _, turns, small, _ = setup
    monkeypatch.setattr(cache_attention_module, "CACHE_BLOCK", 12)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cpu, default: default(*args))
    config = dataclasses.replace(CONFIG, attention_chunk=attention_chunk)
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(3))))
    config = SamplerConfig(max_new_tokens=NEW, temperature=0.8, stop_ids=(STOP_ID,), pad_id=0)
    sampler = make_sampler(graphdef, config, stop_string_automaton(PIECES, [STOP_STRING], CONFIG.vocab_size))
    cache = init_cache(CONFIG, BATCH, SLOTS)
    active = jnp.array([True, True, True, True, True, False])
    for turn, (tokens, mask, expected) in enumerate(turns):
        out = sampler(params, tokens, mask, cache, jax.random.key(turn), active)
        cache = out.cache
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
        np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(expected.log_probs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(small.lengths))
    np.testing.assert_allclose(np.asarray(cache.keys), np.asarray(small.keys), atol=1e-5)
