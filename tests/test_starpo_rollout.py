"""Host env manager rules (hand-worked) and the host rollout driver on a tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import envs
from envs.countdown import Countdown
from envs.text import env_prefix, turn_text
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.env_manager import GymnaxHostEnv, apply_context_window, reset_slot, run_turn, slot_metrics
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import render_chat


def bandit_slot(seed=0):
    return reset_slot(GymnaxHostEnv(envs.make("Bandit")), seed, group_id=3, tag_id=1)


def test_known_arm_ends_the_episode_without_penalty():
    slot = bandit_slot()
    run_turn(slot, "<think>t</think><answer>dragon</answer>", ["dragon"])
    assert slot.terminated and not slot.truncated and slot.success
    assert slot.penalty == 0 and slot.num_actions == 1 and slot.score in (0.0, 1.0)
    assert slot.history[0].reward == f"Reward:\n{slot.score}\n"
    assert slot.history[1].state.startswith("Dragon: ") and slot.history[1].actions_left == 0
    assert slot_metrics(slot) == {"success": 1.0, "num_actions": 1.0, "action_is_effective": 1.0,
                                  "action_is_valid": 1.0, "episodic_return": slot.score}


def test_low_arm_is_done_but_not_a_success():
    slot = bandit_slot()
    run_turn(slot, "<think>t</think><answer>Phoenix</answer>", ["Phoenix"])
    assert slot.terminated and slot.truncated and not slot.success and slot.score == pytest.approx(0.1)


def test_unknown_action_is_penalised_and_nothing_runs():
    slot = bandit_slot()
    run_turn(slot, "<think>t</think><answer>Unicorn</answer>", ["Unicorn"])
    assert not slot.terminated and slot.num_actions == 0
    assert slot.penalty == pytest.approx(-0.1) and slot.history[0].reward == "Reward:\n0\n"
    run_turn(slot, "no tags at all", [])
    assert slot.penalty == pytest.approx(-0.2)


def test_budget_cut_is_not_penalised():
    slot = reset_slot(GymnaxHostEnv(envs.make("FrozenLake")), 5, 0, 0)
    slot.num_actions = 8
    run_turn(slot, "r", ["Left", "Left", "Left"])
    assert slot.num_actions >= 9 and slot.penalty == 0
    if not slot.history[-2].reward.endswith("1\n"):
        assert slot.num_actions == 10 and slot.terminated and slot.truncated


def test_countdown_takes_the_raw_answer():
    env = Countdown()
    slot = reset_slot(env, 7, 0, 0)
    target, nums = env.target, env.nums
    run_turn(slot, "r", [" + ".join(map(str, nums))])
    assert slot.terminated and slot.score in (0.1, 1)
    assert slot.success == (sum(nums) == target)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    corpus = [env_prefix(envs.make(t)) + turn_text(1, "_P_O\nG___", 10) for t in ("Bandit", "FrozenLake")] * 5
    tokenizer = train_chat_tokenizer(corpus + ["<think>go</think><answer>Left || Up</answer>"] * 5,
                                     tmp_path_factory.mktemp("tok"), vocab_size=400)
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=8)
    with nnx.use_eager_sharding(False):
        model = CausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    sampler = make_sampler(graphdef, SamplerConfig(max_new_tokens=12, greedy=True,
                                                   stop_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id))
    return tokenizer, config, model, params, sampler


def play(setup, train_on_sampled_ids, seeds=(1, 2, 3), **settings):
    tokenizer, config, _, params, sampler = setup
    slots = [reset_slot(GymnaxHostEnv(envs.make("FrozenLake")), s, g, 0) for g, s in enumerate(seeds)]
    settings = RolloutSettings(**{**dict(max_turn=2, max_model_len=2048, train_on_sampled_ids=train_on_sampled_ids,
                                         mask_alignment="standard"), **settings})
    traj = host_rollout(sampler, params, tokenizer, slots, init_cache(config, len(slots), 2048), jax.random.key(0),
                        settings)
    return traj, slots


def test_sampled_ids_trajectory_is_what_the_cached_decoder_saw(setup):
    tokenizer, _, model, _, _ = setup
    traj, slots = play(setup, train_on_sampled_ids=True)
    assert all(len(s.history) == 3 for s in slots)
    logits, _ = model(jnp.asarray(traj.input_ids), jnp.asarray(traj.attention_mask))
    greedy = np.asarray(jnp.argmax(logits[:, :-1], -1))
    targets = traj.input_ids[:, 1:]
    forced = tokenizer.convert_tokens_to_ids("<think>")
    check = (traj.loss_mask > 0) & (targets != tokenizer.eos_token_id) & (targets != forced)
    assert check.sum() >= 3 * 2 * 8
    np.testing.assert_array_equal(greedy[check], targets[check])
    text = tokenizer.decode(traj.input_ids[0][traj.attention_mask[0] > 0])
    assert text.count("<|im_start|>assistant\n<think>") == 2 and text.endswith("<|im_end|>\n")


def test_reference_trajectory_is_the_rendered_chat(setup):
    tokenizer, *_ = setup
    traj, slots = play(setup, train_on_sampled_ids=False)
    text = tokenizer.decode(traj.input_ids[1][traj.attention_mask[1] > 0])
    assert text.startswith("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n")
    assert f"Reward:\n{slots[1].history[0].reward.split()[1]}\n\nTurn 2:\nState:\n" in text
    assert traj.group_ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(traj.penalty, [s.penalty for s in slots])
    assert all(p <= -0.1 for p in traj.penalty)


def test_context_window_cuts_history_rewards_and_infos_together():
    slot = reset_slot(GymnaxHostEnv(envs.make("FrozenLake")), 5, 0, 0)
    for _ in range(3):
        run_turn(slot, "r", [])
    slot.turn_rewards[1], slot.turn_rewards[2] = [0.5, 0.25], [2]
    slot.turn_infos[2] = {"action_is_valid": True}
    apply_context_window(slot, 2)
    assert len(slot.history) == 2 and slot.history[0].llm_response == "r" and slot.history[1].llm_response is None
    assert slot.turn_rewards == [[2]] and slot.score == 2.0 and slot.turn_scores == [2.0]
    assert slot_metrics(slot)["action_is_valid"] == 1.0
    messages = render_chat(slot.prefix, slot.history)
    assert "\nTurn 1:\nState:\n" in messages[1]["content"] and "Turn 3" not in str(messages)
    assert messages[-1]["content"].startswith("Reward:\n0\n\nTurn 2:\nState:\n")
    apply_context_window(slot, -1)
    assert len(slot.history) == 2


def test_context_window_rollout_prefills_the_cut_chat_each_turn(setup):
    """A used cache with its lengths reset decodes as a fresh one (what prefix reuse relies on), and a window of 2
    trains on the last played turn, numbered Turn 1, and scores only that turn."""
    tokenizer, config, _, params, sampler = setup
    first, second = ([tokenizer.encode(t, add_special_tokens=False)] * 2 for t in ("Turn 1: go left", "State: P_G"))
    fresh = sampler(params, jnp.asarray(second), jnp.ones((2, len(second[0]))), init_cache(config, 2, 256),
                    jax.random.key(1), jnp.ones(2, bool))
    used = sampler(params, jnp.asarray(first), jnp.ones((2, len(first[0]))), init_cache(config, 2, 256),
                   jax.random.key(1), jnp.ones(2, bool)).cache
    reset = used._replace(lengths=jnp.zeros_like(used.lengths))
    again = sampler(params, jnp.asarray(second), jnp.ones((2, len(second[0]))), reset, jax.random.key(1),
                    jnp.ones(2, bool))
    np.testing.assert_array_equal(again.tokens, fresh.tokens)
    cut, slots = play(setup, False, max_turn=3, max_context_window=2)
    for row, slot in enumerate(slots):
        text = tokenizer.decode(cut.input_ids[row][cut.attention_mask[row] > 0])
        assert text.count("<|im_start|>assistant") == 1 and "Turn 2" not in text and "\nTurn 1:\nState:\n" in text
        assert len(slot.turn_rewards) == 1 and cut.scores[row] == np.float32(sum(slot.turn_rewards[0]))


def test_turn_scores_sit_on_each_turn_end(setup):
    tokenizer = setup[0]
    traj, slots = play(setup, False, max_turn=3, use_turn_scores=True)
    end, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)[0]
    for row, slot in enumerate(slots):
        ids = traj.input_ids[row]
        start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        assistant_ends = [j for j in np.flatnonzero(ids == end) if tokenizer.decode(
            ids[np.flatnonzero(ids[:j] == start)[-1] + 1:j]).startswith("assistant")]
        assert len(assistant_ends) == len(slot.turn_scores) and ids[assistant_ends[0] + 1] == newline
        expected = np.zeros(len(ids) - 1, np.float32)
        for j, score in zip(assistant_ends, slot.turn_scores):
            expected[j] = score  # on the "\n" after <|im_end|> (token j + 1), i.e. next-token position j
        np.testing.assert_array_equal(traj.turn_rewards[row], expected)
    plain, _ = play(setup, False, max_turn=3)
    assert plain.turn_rewards is None
