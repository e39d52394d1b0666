"""Sokoban: generated levels are solvable and deterministic, and RAGEN's (gym-sokoban's rooms seed for seed);
steps match gym-sokoban; exact text."""

import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.registry import CUSTOM_ENVS
from envs.sokoban import SokobanState
from envs.sokoban_generation import assemble_level
from envs.sokoban_reverse_play import generate_room, host_level, reverse_play
from envs.solvers import solve_sokoban
from envs.text import env_prefix, turn_text
from runtime.config import split_section
from starpo_jax.custom_envs import SECTION, apply_overrides
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, run_turn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokobanEnv

NUM_LEVELS = 200

SPEC_GRID = "######\n#___##\n#_X__#\n#_O#_#\n#P___#\n######"
SYMBOL_CODES = {"#": 0, "_": 1, "O": 2, "\u221a": 3, "X": 4, "P": 5, "S": 6}


def state_from_text(text: str) -> SokobanState:
    """A Sokoban state drawn with RAGEN's default symbols (independent of the renderer)."""
    codes = np.array([[SYMBOL_CODES[c] for c in row] for row in text.split("\n")])
    fixed = np.where(np.isin(codes, (2, 3, 6)), 2, np.where(codes == 0, 0, 1))
    state = np.where(codes == 6, 5, codes)
    player = np.argwhere(state == 5)[0]
    return SokobanState(
        jnp.asarray(fixed, jnp.int8), jnp.asarray(state, jnp.int8), jnp.asarray(player, jnp.int32),
        jnp.int32(np.sum(codes == 3)), jnp.int32(0),
    )


@pytest.fixture(scope="module", params=["SimpleSokoban", "LargerSokoban"])
def generated(request):
    env = envs.make(request.param)
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
    keys = jax.random.split(jax.random.key(2024), NUM_LEVELS)
    _, states = reset(keys, env.default_params)
    return env, reset, keys, jax.device_get(states)


def test_generated_levels_are_well_formed_and_solvable(generated):
    env, _, _, states = generated
    height, width = env.dim_room
    for i in range(NUM_LEVELS):
        fixed, room = states.room_fixed[i], states.room_state[i]
        assert (fixed[0] == 0).all() and (fixed[-1] == 0).all() and (fixed[:, 0] == 0).all() and (fixed[:, -1] == 0).all()
        assert (fixed == 2).sum() == env.num_boxes
        assert np.isin(room, (3, 4)).sum() == env.num_boxes
        assert (room == 5).sum() == 1 and tuple(np.argwhere(room == 5)[0]) == tuple(states.player[i])
        assert (room == 3).sum() == 0, "a level must not start with a box on its target"
        solution = solve_sokoban(fixed, room)
        assert solution is not None and len(solution) > 0, f"level {i} of {env.tag} is unsolvable"
    assert states.room_fixed.shape == (NUM_LEVELS, height, width)


def test_generation_is_deterministic_per_key(generated):
    env, reset, keys, states = generated
    _, again = reset(keys, env.default_params)  # same batch shape: no recompilation
    np.testing.assert_array_equal(again.room_state, states.room_state)
    distinct = {bytes(room) for room in states.room_state}
    assert len(distinct) > 0.9 * NUM_LEVELS, "different keys must give different levels"


def gym_env_at(state, num_boxes: int) -> GymSokobanEnv:
    gym_env = GymSokobanEnv(dim_room=state.room_fixed.shape, num_boxes=num_boxes, max_steps=100, reset=False)
    gym_env.room_fixed = np.array(state.room_fixed, dtype=int)
    gym_env.room_state = np.array(state.room_state, dtype=int)
    gym_env.player_position = np.argwhere(gym_env.room_state == 5)[0]
    gym_env.num_env_steps, gym_env.reward_last, gym_env.boxes_on_target = 0, 0, 0
    return gym_env


def test_steps_match_gym_sokoban(generated):
    env, _, _, states = generated
    num_levels, horizon = 24, 40
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, size=(horizon, num_levels))
    # Also replay each level's solution first so pushes onto targets and the +10 are exercised.
    for i in range(num_levels):
        solution = solve_sokoban(states.room_fixed[i], states.room_state[i])
        actions[: len(solution), i] = solution[:horizon]
    step = jax.jit(jax.vmap(env.step_env, in_axes=(None, 0, 0, None)))
    ours = jax.tree.map(lambda x: jnp.asarray(x[:num_levels]), states)
    gyms = [gym_env_at(jax.tree.map(lambda x: x[i], states), env.num_boxes) for i in range(num_levels)]
    finished = np.zeros(num_levels, bool)
    for t in range(horizon):
        _, ours, reward, done, info = step(jax.random.key(t), ours, jnp.asarray(actions[t]), env.default_params)
        for i, gym_env in enumerate(gyms):
            if finished[i]:
                continue
            before = gym_env.player_position.copy()
            _, gym_reward, gym_done, _ = gym_env.step(int(actions[t, i]) + 1, observation_mode="tiny_rgb_array")
            np.testing.assert_array_equal(np.asarray(ours.room_state[i]), gym_env.room_state)
            assert float(reward[i]) == pytest.approx(gym_reward, abs=1e-6)
            assert bool(done[i]) == bool(gym_done and gym_env._check_if_all_boxes_on_target())
            assert bool(info["success"][i]) == (gym_env.boxes_on_target == env.num_boxes)
            assert bool(info["action_is_effective"][i]) == (not np.array_equal(before, gym_env.player_position))
            assert env.reward_value(float(reward[i])) == gym_reward
            finished[i] = gym_done
    assert finished.any(), "no level was solved; the +10 path went untested"


def test_hand_worked_push_rewards():
    env = envs.make("SimpleSokoban")
    state = state_from_text("######\n#P_XO#\n#____#\n#____#\n#____#\n######")
    step = jax.jit(env.step_env)
    params = env.default_params
    _, state, reward, done, info = step(jax.random.key(0), state, 0, params)  # Up: wall
    assert float(reward) == pytest.approx(-0.1) and not bool(info["action_is_effective"]) and not bool(done)
    _, state, reward, done, _ = step(jax.random.key(0), state, 3, params)  # Right: move
    assert float(reward) == pytest.approx(-0.1) and env.render_text(state).split("\n")[1] == "#_PXO#"
    _, state, reward, done, info = step(jax.random.key(0), state, 3, params)  # push onto target
    assert float(reward) == pytest.approx(10.9) and bool(done) and bool(info["success"])
    assert env.render_text(state).split("\n")[1] == "#__P\u221a#"
    assert env.reward_value(float(reward)) == -0.1 + 1 + 10
    _, blocked, reward, _, info = step(jax.random.key(0), state, 3, params)  # box against the wall
    assert env.render_text(blocked) == env.render_text(state) and not bool(info["action_is_effective"])


def test_render_matches_ragen_text():
    state = state_from_text(SPEC_GRID)
    assert envs.make("SimpleSokoban").render_text(state) == SPEC_GRID
    different = SPEC_GRID.translate(str.maketrans("#_OXP", "W.GBA"))
    assert envs.make("SokobanDifferentGridVocab").render_text(state) == different
    on_target = state_from_text("#####\n#S_X#\n#_\u221a_#\n#####")
    assert envs.make("SimpleSokoban").render_text(on_target) == "#####\n#S_X#\n#_\u221a_#\n#####"


def test_first_user_message_matches_spec_example():
    env = envs.make("SimpleSokoban")
    expected = (
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
        "When you are right next to a box, you can push it by moving in the same direction. You cannot push a "
        "box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
        "<answer>Right || Right || Up</answer>\n"
        "The meaning of each symbol in the state is:\n"
        "#: wall, _: empty, O: target, \u221a: box on target, X: box, P: player, S: player on target\n"
        "Your available actions are:\n"
        "Up, Down, Left, Right\n"
        'You can make up to 10 actions, separated by the action separator " || "\n'
        "\nTurn 1:\n"
        "State:\n" + SPEC_GRID + "\n"
        "You have 10 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] "
        "</answer> with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n"
    )
    state_text = env.render_text(state_from_text(SPEC_GRID))
    assert env_prefix(env) + turn_text(1, state_text, 10) == expected
    # The quirk: the DifferentGridVocab prompt lists the default symbols.
    assert env_prefix(envs.make("SokobanDifferentGridVocab")) == env_prefix(env)
    fixed = env_prefix(envs.make("SokobanDifferentGridVocab", legend_from_config=True))
    assert "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target\n" in fixed


def test_assemble_level_round_trip():
    floor = jnp.zeros((5, 5), bool).at[1:4, 1:4].set(True)
    level = jax.jit(assemble_level)(floor, jnp.array([6]), jnp.array([12]), jnp.int32(18))
    text = envs.make("SimpleSokoban").render_text(SokobanState(level.room_fixed, level.room_state, level.player, 0, 0))
    assert text == "#####\n#O__#\n#_X_#\n#__P#\n#####"


def test_max_steps_ends_an_unsolved_episode_through_env_config():
    entries = apply_overrides(CUSTOM_ENVS, split_section(["custom_envs.SimpleSokoban.env_config.max_steps=3"],
                                                         SECTION)[0])
    env = envs.make("SimpleSokoban", entries)
    assert env.default_params.max_steps_in_episode == 3
    assert envs.make("SimpleSokoban").default_params.max_steps_in_episode == 100
    slot = reset_slot(GymnaxHostEnv(env), 0, 0, 0)
    slot.env.state = state_from_text("######\n#P_XO#\n#____#\n#____#\n#____#\n######")
    run_turn(slot, "", ["Up", "Up"])  # two bumps into the wall: still playing
    assert not slot.done
    run_turn(slot, "", ["Up", "Right", "Right"])  # the third step ends the episode before the push
    assert slot.done and not slot.success and slot.num_actions == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_steps": 0}, "max_steps"), ({"dim_room": (4, 6)}, "dim_room"), ({"num_boxes": 0}, "num_boxes"),
     ({"search_depth": 2}, "search_depth"), ({"num_boxes": 5}, "num_boxes"), ({"grid_lookup": {0: "#"}}, "grid_lookup")],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        envs.make("SimpleSokoban", **kwargs)


def test_unknown_tag_is_rejected():
    with pytest.raises(ValueError, match="Sokobann"):
        envs.make("Sokobann")


def test_reverse_play_is_gym_sokobans_generate_room_seed_for_seed():
    """The host generator's gym variant draws exactly gym-sokoban's rooms (same RNG calls, same DFS)."""
    from gym_sokoban.envs.room_utils import generate_room as gym_generate_room
    for dim, num_boxes in (((6, 6), 1), ((8, 8), 2)):
        for seed in range(12):
            random.seed(seed)
            np.random.seed(seed)
            fixed, state, _ = gym_generate_room(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes)
            ours = generate_room(seed, dim, num_boxes, variant="gym")
            np.testing.assert_array_equal(ours.room_fixed, fixed)
            np.testing.assert_array_equal(ours.room_state, state)


def test_reverse_play_hand_worked_corridor():
    """Box on target c2 of a corridor, player on c3: RAGEN pulls right twice (1 swap x 2 cells = 2);
    gym-sokoban counts every pull as a swap (2 x 2 = 4); search_depth 3 stops after one pull."""
    floor = np.zeros((3, 7), int)
    floor[1, 1:6] = 1
    cell = lambda col: 7 + col
    assert reverse_play(floor, cell(3), [cell(2)], 300) == (2, cell(5), (cell(4),))
    assert reverse_play(floor, cell(3), [cell(2)], 300, "gym") == (4, cell(5), (cell(4),))
    assert reverse_play(floor, cell(3), [cell(2)], 3) == (1, cell(4), (cell(3),))


def test_environment_levels_are_ragens_for_the_keys_seed():
    env = envs.make("LargerSokoban")
    keys = jax.random.split(jax.random.key(7), 4)
    _, states = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))(keys, env.default_params)
    for key, room in zip(keys, np.asarray(states.room_state)):
        seed = int(jax.random.bits(key, (), jnp.uint32))
        np.testing.assert_array_equal(room, host_level(seed, (8, 8), 2, 10).room_state)
    with pytest.raises(ValueError, match="walk_budget and tries configure generator='pull_walk'"):
        envs.make("SimpleSokoban", tries=3)
    with pytest.raises(ValueError, match="generator must be one of"):
        envs.make("SimpleSokoban", generator="dfs")
