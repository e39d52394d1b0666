"""Collapse diagnostics: the cross log-prob program and the metrics of ragen2.md §3.6–§3.7."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_state
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.collapse import (CollapseDetectionConfig, CollapseDetector, first_turn_set, reasoning_text,
                                 trajectory_set, turn_pairs)
from starpo_jax.collapse_metrics import MarginalStdEma, pair_metrics
from starpo_jax.collapse_scoring import make_cross_log_probs
from starpo_jax.env_manager import Slot
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.rollout import RolloutSettings, pack_trajectory
from starpo_jax.steps import model_token_log_probs
from starpo_jax.trajectory import Turn, render_chat, render_text

CONFIG = TransformerConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, initializer_range=1.0)
NUM_PROMPTS, SAMPLES_PER_PROMPT, REASONING = 6, 4, 5


def numpy_metrics(l_seq, lengths, columns, prompts, eps=1e-3):
    """The ragen2.md §3.7 table written out with NumPy loops."""
    n, big_n = l_seq.shape
    l_tok = l_seq / np.maximum(lengths, 1)[:, None]
    out = {}
    for name, m in (("tok", l_tok), ("seq", l_seq)):
        matched = np.array([m[i, columns[i]] for i in range(n)])
        marginal = np.array([np.log(np.exp(m[i] - m[i].max()).sum()) + m[i].max() - np.log(big_n) for i in range(n)])
        out[name] = matched, marginal
    (mt, gt), (ms, gs) = out["tok"], out["seq"]
    same = lambda a, b: tuple(prompts[a]) == tuple(prompts[b])
    hit = [same(int(np.argmax(l_tok[i])), columns[i]) for i in range(n)]
    chance = np.mean([sum(same(j, columns[i]) for j in range(big_n)) / big_n for i in range(n)])
    result = {"mi_estimate": mt.mean() - gt.mean(), "mi_seq_estimate": (ms - gs).mean(),
              "conditional_entropy_est": -mt.mean(), "reasoning_entropy_est": -gt.mean(),
              "reasoning_entropy_seq_est": -gs.mean(), "marginal_std": gt.std(),
              "mi_zscore": ((mt - gt) / (gt.std() + eps)).mean(), "mi_zscore_seq": ((ms - gs) / (gs.std() + eps)).mean(),
              "retrieval_accuracy": np.mean(hit), "retrieval_chance_level": chance, "mi_upper_bound": np.log(big_n)}
    for k in (2, 4, 8):
        k_eff = min(k, 8, big_n)
        top = [np.argsort(-l_tok[i], kind="stable")[:k_eff] for i in range(n)]
        result[f"retrieval_accuracy@{k}"] = np.mean([any(same(j, columns[i]) for j in top[i]) for i in range(n)])
        result[f"retrieval_chance_level@{k}"] = min(1.0, chance * k_eff)
    return result


def test_metrics_match_numpy_with_duplicate_prompts_and_ema():
    rng = np.random.default_rng(0)
    n, big_n = 12, 5
    l_seq = rng.normal(-20.0, 4.0, (n, big_n))
    lengths = rng.integers(1, 9, n)
    columns = rng.integers(0, big_n, n)
    prompts = [(1, 2), (3,), (1, 2), (4, 4), (5,)]  # columns 0 and 2 show the same prompt
    same = np.array([[a == b for b in prompts] for a in prompts])
    metrics, ema = pair_metrics(l_seq, lengths, columns, same)
    expected = numpy_metrics(l_seq, lengths, columns, prompts)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    assert metrics["retrieval_above_chance@4"] == pytest.approx(
        metrics["retrieval_accuracy@4"] - metrics["retrieval_chance_level@4"])
    assert ema.tok == pytest.approx(expected["marginal_std"], rel=1e-5)
    assert metrics["mi_zscore_ema"] == pytest.approx(expected["mi_zscore"], rel=1e-4)
    second, ema2 = pair_metrics(l_seq * 2.0, lengths, columns, same, ema=ema, ema_decay=0.9)
    assert ema2.tok == pytest.approx(0.9 * ema.tok + 0.1 * second["marginal_std"], rel=1e-5)
    assert pair_metrics(l_seq[:, :1], lengths, np.zeros(n, int), same[:1, :1]) == ({}, MarginalStdEma())


@pytest.fixture(scope="module")
def samples():
    """Prompts, each with reasonings sampled from the input-dependent model, and both models' states."""
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(CONFIG, rngs=nnx.Rngs(3)))
        collapsed = CausalLM(CONFIG, rngs=nnx.Rngs(3))
    kernel = collapsed.model.layers.self_attn.o_proj.kernel
    kernel[...] = jnp.zeros_like(kernel[...])  # no attention output: a token's state ignores the others
    agnostic = nnx.split(collapsed)[1]
    rng = np.random.default_rng(1)
    lengths = rng.integers(3, 8, NUM_PROMPTS)
    width = int(lengths.max())
    prompts = np.zeros((NUM_PROMPTS, width), np.int32)
    prompt_mask = np.zeros((NUM_PROMPTS, width), np.int32)
    for j, length in enumerate(lengths):
        prompts[j, width - length:] = rng.integers(1, CONFIG.vocab_size, length)
        prompt_mask[j, width - length:] = 1
    prompts[:, -1] = 7  # every prompt ends with the same forced "<think>" token
    rows = np.repeat(np.arange(NUM_PROMPTS), SAMPLES_PER_PROMPT)
    sample = make_sampler(graphdef, SamplerConfig(max_new_tokens=REASONING, pad_id=0))
    out = sample(params, jnp.asarray(prompts[rows]), jnp.asarray(prompt_mask[rows]),
                 init_cache(CONFIG, len(rows), width + REASONING), jax.random.key(0), jnp.ones(len(rows), bool))
    reasonings = np.asarray(out.tokens)
    reasoning_mask = (np.arange(REASONING)[None] < np.asarray(out.lengths)[:, None]).astype(np.int32)
    return graphdef, params, agnostic, prompts, prompt_mask, reasonings, reasoning_mask, rows


def test_cross_log_probs_equal_scoring_each_pair_as_one_sequence(samples):
    graphdef, params, _, prompts, prompt_mask, reasonings, reasoning_mask, _ = samples
    reasoning_mask = reasoning_mask.copy()
    reasoning_mask[0, 3:] = 0  # a shorter reasoning: its pads must not count
    l_seq = np.asarray(make_cross_log_probs(graphdef, CONFIG, temperature=0.7)(
        params, prompts, prompt_mask, reasonings, reasoning_mask))
    score = jax.jit(lambda ids, mask: model_token_log_probs(nnx.merge(graphdef, params), ids, mask, 0.7)[0])
    for i in (0, 5, 13):
        for j in range(NUM_PROMPTS):
            ids = np.concatenate([prompts[j], reasonings[i]])[None]
            mask = np.concatenate([prompt_mask[j], reasoning_mask[i]])[None]
            log_probs = score(jnp.asarray(ids), jnp.asarray(mask))
            expected = float(np.sum(np.asarray(log_probs)[0, prompts.shape[1] - 1:] * reasoning_mask[i]))
            assert l_seq[i, j] == pytest.approx(expected, rel=1e-5, abs=1e-4), (i, j)


def test_cross_log_probs_sharded_equal_unsharded(samples):
    graphdef, params, _, prompts, prompt_mask, reasonings, reasoning_mask, _ = samples
    mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
    single = make_cross_log_probs(graphdef, CONFIG)(params, prompts, prompt_mask, reasonings, reasoning_mask)
    with jax.set_mesh(mesh):
        sharded = make_cross_log_probs(graphdef, CONFIG, mesh=mesh)(
            shard_state(params, mesh), prompts, prompt_mask, reasonings, reasoning_mask)
    assert sharded.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-4)


def test_input_agnostic_policy_scores_chance_retrieval_and_zero_mi_while_entropy_stays(samples):
    graphdef, params, agnostic, prompts, prompt_mask, reasonings, reasoning_mask, rows = samples
    cross = make_cross_log_probs(graphdef, CONFIG)
    same = np.array([[np.array_equal(a, b) for b in prompts] for a in prompts])
    lengths = reasoning_mask.sum(1)
    dependent, _ = pair_metrics(cross(params, prompts, prompt_mask, reasonings, reasoning_mask), lengths, rows, same)
    collapsed, _ = pair_metrics(cross(agnostic, prompts, prompt_mask, reasonings, reasoning_mask), lengths, rows, same)
    assert collapsed["retrieval_accuracy"] == pytest.approx(collapsed["retrieval_chance_level"], abs=1e-6)
    assert abs(collapsed["mi_estimate"]) < 1e-5 and abs(collapsed["mi_zscore"]) < 1e-2
    assert collapsed["reasoning_entropy_est"] > 1.0  # diverse reasoning, independent of the prompt
    assert dependent["retrieval_above_chance"] > 0.3
    assert dependent["mi_estimate"] > 0.1 and dependent["mi_zscore"] > 1.0


# --- sample sets from trajectories (ragen2.md §3.4–§3.5) and the detector ---------------------------------------

RESPONSES = ["<think>go left</think><answer>Left</answer>", "<think></think><answer>Up</answer>",
             "<think>push the box <answer>x</answer> down</think><answer>Down</answer>"]


def played_slot(prefix: str, responses, group: int) -> Slot:
    history = [Turn(f"state {t}", 3 - t, response, "Reward:\n0\n") for t, response in enumerate(responses)]
    return Slot(types.SimpleNamespace(max_tokens=100), group, 0, prefix, history + [Turn("end", 0)])


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    corpus = [render_text_of(played_slot(p, RESPONSES, 0)) for p in ("first task", "second task")]
    tokenizer = train_chat_tokenizer(corpus * 20, tmp_path_factory.mktemp("tok"), vocab_size=300)
    slots = [played_slot("first task", RESPONSES, 0), played_slot("first task", RESPONSES[1:], 0),
             played_slot("second task", RESPONSES[::-1], 1)]
    return tokenizer, slots, pack_trajectory(tokenizer, slots, RolloutSettings(bucket=8))


def render_text_of(slot):
    return " ".join(message["content"] for message in render_chat(slot.prefix, slot.history))


def test_reasoning_text_is_the_first_think_block_without_special_strings():
    assert reasoning_text(RESPONSES[0]) == "go left"
    assert reasoning_text(RESPONSES[1]) == ""
    assert reasoning_text(RESPONSES[2]) == "push the box x down"
    assert reasoning_text("<think>no closing tag<answer>Up</answer>") == ""


def test_turn_pairs_cut_the_trained_chat_at_each_forced_think(chat):
    tokenizer, slots, traj = chat
    pairs, totals = turn_pairs(tokenizer, traj)
    assert totals == [3, 2, 3]
    assert [[p is not None for p in turns] for turns in pairs] == [[True, False, True], [False, True], [True, False, True]]
    slot = slots[0]
    for t in (0, 2):
        history = slot.history[:t] + [Turn(slot.history[t].state, slot.history[t].actions_left)]
        prompt = render_text(tokenizer, render_chat(slot.prefix, history), for_update=False)
        assert pairs[0][t].prompt == tuple(tokenizer.encode(prompt, add_special_tokens=False))
        assert pairs[0][t].reasoning == tuple(tokenizer.encode(reasoning_text(RESPONSES[t]), add_special_tokens=False))


def test_first_turn_set_has_one_column_per_group_and_refuses_differing_prompts(chat):
    tokenizer, _, traj = chat
    pairs, _ = turn_pairs(tokenizer, traj)
    samples = first_turn_set(pairs, [5, 5, 2], None, np.random.default_rng(0))
    assert samples.columns == [1, 0] and samples.prompts == [pairs[2][0].prompt, pairs[0][0].prompt]  # row 1 invalid
    assert len(first_turn_set(pairs, [5, 5, 2], 1, np.random.default_rng(0)).reasonings) == 1
    with pytest.raises(ValueError, match="group 5"):
        first_turn_set(pairs, [5, 3, 5], None, np.random.default_rng(0))


def test_trajectory_set_draws_uniformly_over_trajectories_with_replacement(chat):
    tokenizer, _, traj = chat
    pairs, _ = turn_pairs(tokenizer, traj)
    kept = [[p for p in turns if p is not None] for turns in pairs]
    expected, rng = [], np.random.default_rng(3)
    for _ in range(min(4, 5)):
        m = int(rng.integers(3))
        expected.append(kept[m][int(rng.integers(len(kept[m])))])
    samples = trajectory_set(pairs, 4, np.random.default_rng(3))
    assert samples.reasonings == [p.reasoning for p in expected] and samples.columns == [0, 1, 2, 3]
    assert len(trajectory_set(pairs, None, np.random.default_rng(3)).reasonings) == 5


def test_detector_cadence_metric_names_and_ema(chat):
    tokenizer, _, traj = chat
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_layers=1,
                               num_heads=2, num_kv_heads=1, head_dim=8)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    detector = CollapseDetector(CollapseDetectionConfig(compute_freq=2, first_turn_enabled=True, multi_turn_enabled=True), graphdef, config, tokenizer)
    assert detector(params, traj, 0) == {} and detector(params, traj, 3) == {}
    first = detector(params, traj, 1)
    assert first["collapse/valid_thinking_rate"] == pytest.approx(5 / 8)
    assert first["collapse/first_turn_num_valid"] == 2 and first["collapse/first_turn_valid_rate"] == pytest.approx(2 / 3)
    for family in ("collapse_first_turn_sample", "collapse_trajectory_sample"):
        assert {f"{family}/mi_zscore_ema", f"{family}/retrieval_accuracy@8"} <= set(first)
    assert first["collapse_first_turn_sample/mi_upper_bound"] == pytest.approx(np.log(2))
    second = detector(params, traj, 2)
    family = "collapse_first_turn_sample"
    assert second[f"{family}/marginal_std_ema"] == pytest.approx(
        0.9 * first[f"{family}/marginal_std_ema"] + 0.1 * second[f"{family}/marginal_std"], rel=1e-5)
    assert second["timing_s/collapse_total"] >= first["timing_s/collapse_total"] > 0
    with pytest.raises(ValueError, match="collapse_detection.num_samples"):
        CollapseDetectionConfig(num_samples=0)
