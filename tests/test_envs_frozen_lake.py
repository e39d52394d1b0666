"""FrozenLake: solvable maps, gymnasium's dynamics and slip statistics, RAGEN's text, the solver."""

import itertools

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.frozen_lake import FrozenLakeState
from envs.solvers import plan_frozen_lake

NUM_MAPS = 1000


def state_of(rows: list[str], position: int) -> FrozenLakeState:
    desc = np.array([[ord(c) for c in row] for row in rows], np.uint8)
    return FrozenLakeState(jnp.asarray(desc), jnp.int32(position), jnp.int32(0))


def reachable(desc: np.ndarray) -> bool:
    """Independent depth-first search from S to G over non-hole tiles."""
    size = desc.shape[0]
    start = tuple(np.argwhere(desc == "S")[0])
    stack, seen = [start], {start}
    while stack:
        row, col = stack.pop()
        if desc[row, col] == "G":
            return True
        for nxt in ((row + 1, col), (row - 1, col), (row, col + 1), (row, col - 1)):
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in seen and desc[nxt] != "H":
                seen.add(nxt)
                stack.append(nxt)
    return False


@pytest.fixture(scope="module")
def maps():
    env = envs.make("FrozenLake")
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
    _, states = reset(jax.random.split(jax.random.key(11), NUM_MAPS), env.default_params)
    return env, reset, jax.device_get(states)


def test_every_map_has_a_path_and_distinct_start_and_goal(maps):
    _, _, states = maps
    tiles = []
    for desc, position in zip(states.desc, states.position):
        desc = np.vectorize(chr)(desc)
        assert (desc == "S").sum() == 1 and (desc == "G").sum() == 1
        assert desc.ravel()[position] == "S"
        assert reachable(desc)
        tiles.extend(desc[np.isin(desc, ("F", "H"))])
    frozen = np.mean(np.array(tiles) == "F")
    assert 0.78 < frozen < 0.9, frozen  # p = 0.8, nudged up by rejecting maps without a path


def test_map_generation_is_deterministic(maps):
    env, reset, states = maps
    _, again = reset(jax.random.split(jax.random.key(11), NUM_MAPS), env.default_params)
    np.testing.assert_array_equal(again.desc, states.desc)


def test_slip_frequencies_match_gymnasium_probabilities():
    env = envs.make("FrozenLake")
    rows = ["FFFF", "FSFF", "FFFF", "FFFG"]
    state = state_of(rows, 5)
    num = 30_000
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, None, None, None)))
    gym_env = gymnasium.make("FrozenLake-v1", desc=rows, is_slippery=True).unwrapped
    for action in range(4):
        _, next_states, _, _, _ = step(jax.random.split(jax.random.key(action), num), state, action, env.default_params)
        counts = np.bincount(np.asarray(next_states.position), minlength=16) / num
        expected = np.zeros(16)
        for prob, nxt, _, _ in gym_env.P[5][action]:
            expected[nxt] += prob
        np.testing.assert_allclose(counts, expected, atol=0.015)
        assert expected.max() == pytest.approx(1 / 3)


def test_scripted_sequences_match_gymnasium_without_slip(maps):
    env, _, states = maps
    params = env.default_params.replace(is_slippery=False)
    step = jax.jit(env.step_env)
    rng = np.random.default_rng(1)
    for i in range(20):
        desc = ["".join(map(chr, row)) for row in states.desc[i]]
        gym_env = gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=False).unwrapped
        gym_env.reset(seed=0)
        state = jax.tree.map(lambda x: x[i], states)
        for action in rng.integers(0, 4, size=12):
            gym_s, gym_reward, gym_terminated, _, _ = gym_env.step(int(action))
            _, state, reward, terminated, info = step(jax.random.key(0), state, int(action), params)
            assert int(state.position) == gym_s
            assert env.reward_value(float(reward)) == gym_reward
            assert bool(terminated) == gym_terminated
            assert bool(info["success"]) == (desc[gym_s // 4][gym_s % 4] == "G")
            if gym_terminated:
                break


def test_hole_and_goal_end_the_episode(maps):
    env = maps[0]
    params = env.default_params.replace(is_slippery=False)
    step = jax.jit(env.step_env)
    state = state_of(["SHFF", "FFFF", "FFFF", "GFFF"], 0)
    _, in_hole, reward, terminated, info = step(jax.random.key(0), state, 2, params)  # Right
    assert bool(terminated) and float(reward) == 0.0 and not bool(info["success"])
    assert env.render_text(in_hole) == "_X__\n____\n____\nG___"
    state = state_of(["FFFF", "FFFF", "SFFF", "GFFF"], 8)
    _, at_goal, reward, terminated, info = step(jax.random.key(0), state, 1, params)  # Down
    assert bool(terminated) and float(reward) == 1.0 and bool(info["success"])
    assert env.render_text(at_goal) == "____\n____\n____\n\u221a___"
    assert env.render_text(state) == "____\n____\nP___\nG___"


def test_turn_planner_maximises_the_goal_probability_over_the_turns_left():
    """Brute force on gymnasium's own table: every open-loop turn of k actions, re-chosen each turn."""
    rows = ["SFFH", "FHFF", "FFHF", "HFFG"]
    desc = np.array([[ord(c) for c in row] for row in rows], np.uint8)
    table = gymnasium.make("FrozenLake-v1", desc=rows, is_slippery=True).unwrapped.P
    terminal = {i for i, tile in enumerate("".join(rows)) if tile in "HG"}

    def after(cell, actions):
        """{cell: probability} after playing ``actions`` open loop; holes and the goal absorb."""
        if not actions or cell in terminal:
            return {cell: 1.0}
        out = {}
        for p, nxt, _, _ in table[cell][actions[0]]:
            for end, q in after(nxt, actions[1:]).items():
                out[end] = out.get(end, 0.0) + p * q
        return out

    def value(cell, turns, k):
        if "".join(rows)[cell] == "G":
            return 1.0
        if turns == 0 or cell in terminal:
            return 0.0
        return max(sum(p * value(end, turns - 1, k) for end, p in after(cell, seq).items())
                   for seq in itertools.product(range(4), repeat=k))

    for cell, turns, k in [(0, 1, 3), (0, 3, 2), (0, 2, 3), (6, 2, 2), (14, 1, 1)]:
        actions, prob = plan_frozen_lake(desc, cell, turns, k)
        assert len(actions) == k and prob == pytest.approx(value(cell, turns, k), abs=1e-12)
        chosen = sum(p * value(end, turns - 1, k) for end, p in after(cell, tuple(actions)).items())
        assert chosen == pytest.approx(prob, abs=1e-12)
    assert plan_frozen_lake(desc, 0, 3, 3)[1] > plan_frozen_lake(desc, 0, 2, 3)[1] > plan_frozen_lake(desc, 0, 1, 3)[1] == 0
    with pytest.raises(ValueError, match="turns and actions_per_turn must be >= 1, got 0 and 2"):
        plan_frozen_lake(desc, 0, 0, 2)


def test_bad_size_names_the_field():
    with pytest.raises(ValueError, match="size"):
        envs.make("FrozenLake", size=1)


def test_env_config_sets_slip_and_frozen_probability():
    """RAGEN's ``FrozenLakeEnvConfig`` keys: without slip every move goes where it was meant; ``p=1`` has no holes."""
    env = envs.make("FrozenLake", is_slippery=False, p=1.0)
    state = state_of(["SFFF", "FFFF", "FFFF", "FFFG"], 5)
    step = jax.jit(env.step_env)
    for action, expected in [(0, 4), (1, 9), (2, 6), (3, 1)]:
        for k in range(8):
            assert int(step(jax.random.key(k), state, action, env.default_params)[1].position) == expected
    maps = jax.vmap(lambda k: env.reset_env(k, env.default_params)[1].desc)(jax.random.split(jax.random.key(0), 64))
    assert not np.any(np.asarray(maps) == ord("H"))
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\]"):
        envs.make("FrozenLake", p=0.0)
