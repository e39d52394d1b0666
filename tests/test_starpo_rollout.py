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
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, run_turn, slot_metrics
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler


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
                                  "action_is_valid": 1.0}


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


def play(setup, train_on_sampled_ids, seeds=(1, 2, 3)):
    tokenizer, config, _, params, sampler = setup
    slots = [reset_slot(GymnaxHostEnv(envs.make("FrozenLake")), s, g, 0) for g, s in enumerate(seeds)]
    settings = RolloutSettings(max_turn=2, max_model_len=2048, train_on_sampled_ids=train_on_sampled_ids,
                               mask_alignment="standard")
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
