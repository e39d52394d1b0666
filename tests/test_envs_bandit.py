"""Bandit: RAGEN's text with its trailing spaces, arm order, reward statistics and success."""

import jax
import numpy as np
import pytest

import envs
from envs.registry import CUSTOM_ENVS
from envs.text import env_prefix
from runtime.config import split_section
from starpo_jax.custom_envs import SECTION, apply_overrides

NUM = 20_000


@pytest.fixture(scope="module")
def bandit():
    env = envs.make("Bandit")
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    return env, reset, step


def test_initial_text_is_ragen_character_for_character(bandit):
    env, reset, _ = bandit
    _, states = reset(jax.random.split(jax.random.key(0), 64), env.default_params)
    orders = set()
    for i in range(64):
        state = jax.tree.map(lambda x: x[i], states)
        first, second = ("Dragon", "Phoenix") if bool(state.swapped) else ("Phoenix", "Dragon")
        orders.add(first)
        expected = (
            "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
            "Game Rules: \n"
            f"1. There are 2 arms, named {first} and {second}\n"
            "2. Each arm has its own reward distribution, related to their names. \n"
            "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
            "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
            f"rewards on average? Choose between {first} and {second}, and output like <answer> {first} </answer> "
            f"or <answer> {second} </answer>.\n"
        )
        assert env.render_text(state) == expected
    assert orders == {"Dragon", "Phoenix"}
    assert env_prefix(env) == ""


def test_arm_order_is_a_fair_coin_and_rewards_follow_the_arms(bandit):
    env, reset, step = bandit
    keys = jax.random.split(jax.random.key(1), NUM)
    _, states = reset(keys, env.default_params)
    assert abs(np.mean(states.swapped) - 0.5) < 0.015
    actions = np.arange(NUM) % 2
    _, after, reward, done, info = step(keys, states, actions, env.default_params)
    reward = np.asarray(reward)
    assert np.all(done)
    np.testing.assert_allclose(reward[actions == 0], 0.1, rtol=1e-6)
    high = reward[actions == 1]
    assert set(np.unique(high)) == {0.0, 1.0} and abs(high.mean() - 0.25) < 0.015
    np.testing.assert_array_equal(np.asarray(info["success"]), actions == 1)
    low_state = jax.tree.map(lambda x: x[0], after)
    assert env.render_text(low_state) == "Phoenix: 0.1 points"
    index = int(np.argmax(high == 1.0)) * 2 + 1
    assert env.render_text(jax.tree.map(lambda x: x[index], after)) == "Dragon: 1.0 points"


def test_paper_low_arm_score_and_test_names(bandit):
    env, reset, step = bandit
    params = env.default_params.replace(lo_arm_score=0.15)
    keys = jax.random.split(jax.random.key(2), NUM)
    _, states = reset(keys, params)
    _, after, reward, _, _ = step(keys, states, np.zeros(NUM, int), params)
    np.testing.assert_allclose(np.asarray(reward), 0.15, rtol=1e-6)
    assert env.render_text(jax.tree.map(lambda x: x[0], after), params) == "Phoenix: 0.15 points"
    assert envs.make("BanditTest").action_names == ("Trader", "Librarian")
    assert envs.make("Bandit", lo_arm_name="Engineer", hi_arm_name="Teacher").action_names == ("Engineer", "Teacher")


def test_reward_settings_come_from_env_config(bandit):
    _, reset, _ = bandit
    entries = apply_overrides(CUSTOM_ENVS, split_section(
        ["custom_envs.Bandit.env_config.lo_arm_score=0.3", "custom_envs.Bandit.env_config.hi_arm_hiscore=2.0",
         "custom_envs.Bandit.env_config.hi_arm_loscore=-1.0", "custom_envs.Bandit.env_config.hi_arm_hiscore_prob=0.5"],
        SECTION)[0])
    env = envs.make("Bandit", entries)
    params = env.default_params
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    keys = jax.random.split(jax.random.key(3), 4000)
    _, states = reset(keys, params)
    actions = np.arange(4000) % 2
    _, after, reward, _, _ = step(keys, states, actions, params)
    reward = np.asarray(reward)
    np.testing.assert_allclose(reward[actions == 0], 0.3, rtol=1e-6)
    high = reward[actions == 1]
    assert set(np.unique(high)) == {-1.0, 2.0} and abs((high == 2.0).mean() - 0.5) < 0.04
    assert env.render_text(jax.tree.map(lambda x: x[0], after), params) == "Phoenix: 0.3 points"


@pytest.mark.parametrize("kwargs, field", [({"hi_arm_hiscore_prob": 1.5}, "hi_arm_hiscore_prob"),
                                           ({"lo_arm_score": float("nan")}, "lo_arm_score"),
                                           ({"hi_arm_hiscore": "high"}, "hi_arm_hiscore")])
def test_bad_reward_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        envs.make("Bandit", **kwargs)


def test_bad_arm_names_name_the_field():
    with pytest.raises(ValueError, match="hi_arm_name"):
        envs.make("Bandit", hi_arm_name="")
    with pytest.raises(ValueError, match="lo_arm_name"):
        envs.make("Bandit", lo_arm_name="Dragon")
