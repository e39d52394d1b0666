"""gymnax API: ``jax.vmap`` over 1,024 environments with auto-reset compiles once and resets done envs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs

NUM_ENVS = 1024


@pytest.mark.parametrize("tag", ["FrozenLake", "Bandit"])
def test_vmapped_auto_reset_traces_once(tag):
    env = envs.make(tag)
    params = env.default_params
    traces = []

    def step(key, state, action):
        traces.append(1)
        return jax.vmap(env.step, in_axes=(0, 0, 0, None))(jax.random.split(key, NUM_ENVS), state, action, params)

    step = jax.jit(step)
    reset = jax.jit(lambda key: jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, NUM_ENVS), params))
    _, state = reset(jax.random.key(0))
    rng = np.random.default_rng(0)
    resets = 0
    for t in range(6):
        actions = jnp.asarray(rng.integers(0, env.num_actions, NUM_ENVS))
        obs, state, reward, terminated, truncated, info = step(jax.random.key(t + 1), state, actions)
        done = np.asarray(terminated | truncated)
        resets += done.sum()
        np.testing.assert_array_equal(np.asarray(state.time)[done], 0)
        assert obs.shape[0] == NUM_ENVS and set(info) >= {"success", "action_is_valid", "action_is_effective"}
    assert len(traces) == 1
    assert resets > 0
