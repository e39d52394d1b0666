"""RAGEN-2's array-program environments (ragen2.md §7): exact texts, test vectors, rules and level laws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
import envs.bandit_v2
from bench.env_peers import Peer2048, PeerCube, PeerSudoku
from envs.coord import CoordFrozenLake, CoordSokoban, slipper_success_rate
from envs.frozen_lake import FrozenLakeState
from envs.game_2048 import Game2048, Game2048State, render_2048, valid_moves
from envs.reference_levels import reference_2048_grid, reference_cube_stickers, reference_sudoku
from envs.rubiks_cube import PERMUTATIONS, SOLVED, RubiksCube, solution_depth
from envs.sokoban import SokobanState
from envs.sudoku import SudokuCore, SudokuEnv, conflict_mask, is_valid_grid, parse_move, render_with_feedback
from envs.text import env_prefix
from starpo_jax.presets import load_config

V2 = envs.CUSTOM_ENVS_V2
HEAD = "You're a helpful assistant. "
SYSTEM = {
    "game_2048": "You're a helpful assistant. You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding "
                 "Up, Right, Down, or Left.\nIf a move is invalid (no tiles move), a small penalty is applied. Respond "
                 "with a single action.\nExample: <answer>Up</answer>\n\nYour available actions are:\nUp, Right, Down, "
                 "Left\nYou can make up to 700 actions, separated by the action separator \" || \"\n",
    "SimpleSudoku": "You're a helpful assistant. You are solving a Sudoku puzzle. Fill in the grid so that every row, "
                    "column, and 3x3 box contains the numbers 1-9 without repetition.\nInitial cells are shown in "
                    "[brackets] and cannot be modified. Empty cells are shown as dots (.).\nPlace numbers one at a time "
                    "using the format: <answer>place 5 at row 2 col 3</answer> or <answer>2,3,5</answer>\nThe "
                    "environment will provide feedback on valid/invalid moves and show conflicts if any occur.\n",
    "rubikscube": "You're a helpful assistant. You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore "
                  "the cube so that each of the faces consists of a single, unique color.\nAvailable actions use "
                  "standard Singmaster notation for face rotations: U, U', D, D', L, L', R, R', F, F', B, B'.\n- Faces: "
                  "U (Up), D (Down), L (Left), R (Right), F (Front), B (Back).\n- Modifiers: A letter alone means 90\u00b0 "
                  "clockwise (e.g., 'R'). A letter with prime (') means 90\u00b0 counter-clockwise (e.g., \"R'\").\n"
                  "Respond with a sequence of actions separated by \"||\".\nExample: <answer>U</answer>\n\nYour "
                  "available actions are:\nU, U', D, D', L, L', R, R', F, F', B, B'\nYou can make up to 20 actions, "
                  "separated by the action separator \" || \"\n",
    "CoordFrozenLake": "You're a helpful assistant. You are solving the FrozenLake puzzle. The observation includes both "
                       "a symbol grid and zero-indexed coordinates for the start, goal, player, and any holes.\n"
                       "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\nBeware "
                       "that the ice is slippery, so the agent might slide and end up in an unintended tile.\nRespond "
                       "with a sequence of actions such as <answer>Left || Up || Up</answer>.\n\nThe meaning of each "
                       "symbol in the state is:\nP: player, _: empty, O: hole, G: goal, X: player in hole, \u221a: "
                       "player on goal\nYour available actions are:\nLeft, Down, Right, Up\nYou can make up to 10 "
                       "actions, separated by the action separator \" || \"\n",
    "CoordSokoban": "You're a helpful assistant. You are solving the Sokoban puzzle. You are the player and you need to "
                    "push all boxes to targets.\nYou are provided with a symbol grid and the zero-indexed coordinates of "
                    "the player, each box, and each target. \nCoordinates range from the top-left corner (0, 0) to the "
                    "bottom-right corner (5, 5). \nWhen you are exactly next to a box, you can push it by moving in the "
                    "same direction. \nYou cannot push a box through a wall, and you cannot pull a box.\nThe answer "
                    "should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n\nThe meaning of "
                    "each symbol in the state is:\n#: wall, _: empty, O: target, \u221a: box on target, X: box, P: "
                    "player, S: player on target\nYour available actions are:\nUp, Down, Left, Right\nYou can make up "
                    "to 10 actions, separated by the action separator \" || \"\n",
}
GRID_2048_10000 = ("Current 2048 Grid:\nRow 1: [0, 0, 2, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [2, 0, 0, 0]\nRow 4: [0, 0, 0, "
                   "0]\n\nValid Actions: 0(Up), 1(Right), 2(Down), 3(Left).\nGoal: Merge same numbers to reach 2048.\n"
                   "Current Score: 0\nWhat is your next move?")
CUBE_10000 = ("=== Rubik's Cube 2x2 State ===\nStep: 0/20\n\nUp (U):    [W, W]\n [W, W]\nLeft (L):  [B, B]\n [O, O]\n"
              "Front (F): [O, O]\n [G, G]\nRight (R): [G, G]\n [R, R]\nBack (B):  [R, R]\n [B, B]\nDown (D):  [Y, Y]\n"
              " [Y, Y]\n\nAvailable Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?")
SUDOKU_10000 = ("==================================================\nSUDOKU PUZZLE\n============================"
                "======================\n[4][9][2]| [7][1][6]|  . [3][8]\n . [6] . | [2] .  . |  . [7][4]\n .  . [8]|"
                " [9][5][4]|  . [6] .\n-----------------------------\n . [5] . | [1] . [2]| [8][4][6]\n[2][8][7]| [4] ."
                " [5]| [3][1][9]\n .  .  . |  .  . [3]|  . [5] .\n-----------------------------\n[6] .  . |  . [8][7]| "
                "[4] .  .\n[3][1][4]|  .  . [9]|  . [8][5]\n[8][7][9]|  .  . [1]| [6] . [3]\n\nLegend: [N]=initial "
                "cell, N=user-placed, *N*=conflict, .=empty\n\nProgress: 49/81 cells filled (49 initial, 0 placed)\n"
                "Steps: 0/81")


@pytest.mark.parametrize("tag", sorted(SYSTEM))
def test_system_content_is_the_reference_text(tag):
    assert HEAD + env_prefix(envs.make(tag, V2)) == SYSTEM[tag]


def test_tags_carry_envs_yaml_budgets_and_configs():
    budgets = {"CoordSokoban": (10, 120), "CoordFrozenLake": (10, 120), "game_2048": (700, 8192),
               "rubikscube": (20, 96), "SimpleSudoku": (20, 150), "MediumSudoku": (30, 150)}
    for tag, (budget, max_tokens) in budgets.items():
        entry = V2[tag]
        assert (entry.max_actions_per_traj, entry.max_tokens) == (budget, max_tokens), tag
    assert envs.make("rubikscube", V2).default_params.scramble_depth == 1
    assert (envs.make("MediumSudoku", V2).core.num_blanks, envs.make("SimpleSudoku", V2).core.num_blanks) == (40, 32)
    assert float(envs.make("CoordFrozenLake", V2).default_params.success_rate) == 0.8
    assert float(envs.make("FrozenLake", V2).default_params.success_rate) == 0.8
    assert envs.make("FrozenLake").default_params.p == 0.8  # V1 keeps its tag


def test_v2_presets_define_the_ragen2_tags_and_task_settings():
    for name in ("v2-sokoban-starpo-s-ppo", "v2-2048-starpo-s-grpo", "v2-sudoku-starpo-ppo"):
        config = load_config(name)
        assert {tag: config.custom_envs[tag] for tag in envs.RAGEN2_ENVS} == envs.RAGEN2_ENVS
    config = load_config("v2-2048-starpo-s-ppo")
    assert (config.agent_proxy.max_turn, config.agent_proxy.max_actions_per_turn) == (800, 1)
    assert config.es_manager.train.env_configs.tags == ("game_2048",)
    lake = load_config("v2-frozenlake-slipper20-nofilter").custom_envs["CoordFrozenLake"]
    assert lake.env_config["success_rate"] == 0.8
    assert load_config("v2-frozenlake-starpo-ppo").custom_envs["CoordFrozenLake"].env_config["success_rate"] == 1.0


def test_seed_10000_vectors_from_the_reference_generators():
    peer = Peer2048()
    peer.reset(10000)
    assert peer.render() == GRID_2048_10000
    cube = PeerCube(scramble_depth=1)
    cube.reset(10000)
    assert cube.render() == CUBE_10000
    assert cube.step(0)[1:3] == (1.0, True)  # the scramble was U'; U solves it
    puzzle, solution = reference_sudoku(10000)
    state = jax.device_get(SudokuCore().new_state(puzzle, solution))
    assert render_with_feedback(state, 9, 81, "") == SUDOKU_10000
    assert bool(is_valid_grid(jnp.asarray(solution))) and (puzzle[puzzle > 0] == solution[puzzle > 0]).all()


def test_coord_sokoban_renders_the_spec_prompt_state():
    rows = ["######", "#___##", "#_X__#", "#_O#_#", "#P___#", "######"]
    codes = {"#": 0, "_": 1, "O": 2, "X": 4, "P": 5}
    room = np.array([[codes[ch] for ch in row] for row in rows], np.int8)
    fixed = np.where((room == 4) | (room == 5), 1, room).astype(np.int8)
    state = SokobanState(jnp.asarray(fixed), jnp.asarray(room), jnp.array([4, 1]), jnp.int32(0), jnp.int32(0))
    text = envs.make("CoordSokoban", V2).render_text(state)
    assert text == ("Coordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\nTargets: (3, 2)\nBoxes: (2, 2)\n"
                    "Player: (4, 1)\nGrid Map: \n" + "\n".join(rows))
    assert CoordSokoban(observation_format="coord").render_text(state) == text.split("\n", 1)[1].split("\nGrid")[0]
    with pytest.raises(ValueError, match="observation_format"):
        CoordSokoban(observation_format="pixels")


def test_coord_frozen_lake_lists_start_goal_player_holes():
    desc = np.frombuffer(b"SFFHFHFFFFFGHFFF", np.uint8).reshape(4, 4)
    env = CoordFrozenLake(observation_format="grid_coord")
    state = FrozenLakeState(jnp.asarray(desc), jnp.int32(5), jnp.int32(1))
    assert env.render_text(state) == (
        "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 0)\nGoal: (2, 3)\n"
        "Player in hole: (1, 1)\nHoles: (0, 3), (1, 1), (3, 0)\nGrid Map: \n___O\n_X__\n___G\nO___")


def test_goal_offset_line_ends_the_coordinate_block():
    desc = np.frombuffer(b"SFFHFHFFFFFGHFFF", np.uint8).reshape(4, 4)
    env = CoordFrozenLake(observation_format="coord", goal_offset=True)
    assert env.render_text(FrozenLakeState(jnp.asarray(desc), jnp.int32(7), jnp.int32(1))) == (
        "Board size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 0)\nGoal: (2, 3)\nPlayer: (1, 3)\n"
        "Holes: (0, 3), (1, 1), (3, 0)\nGoal from player: 1 down")
    assert env.render_text(FrozenLakeState(jnp.asarray(desc), jnp.int32(13), jnp.int32(1))).endswith(
        "Goal from player: 1 up, 2 right")
    assert env.render_text(FrozenLakeState(jnp.asarray(desc), jnp.int32(11), jnp.int32(1))).endswith(
        "Player on goal: (2, 3)\nHoles: (0, 3), (1, 1), (3, 0)\nGoal from player: here")
    with pytest.raises(ValueError, match="goal_offset"):
        CoordFrozenLake(observation_format="grid", goal_offset=True)


def test_frozen_lake_success_rate_slip_law_and_sweep_rates():
    env = CoordFrozenLake(success_rate=0.6)
    desc = jnp.asarray(np.frombuffer(b"FFFFFSFFFFFFFFFG", np.uint8).reshape(4, 4))
    state = FrozenLakeState(desc, jnp.int32(5), jnp.int32(0))
    keys = jax.random.split(jax.random.key(0), 4000)
    step = jax.jit(jax.vmap(env.step_env, (0, None, None, None)))
    moved = np.asarray(step(keys, state, 1, env.default_params)[1].position)  # intended: Down (to 9)
    freq = [np.mean(moved == cell) for cell in (6, 9, 4)]  # Right / Down / Left as in [a-1, a, a+1]
    np.testing.assert_allclose(freq, [0.2, 0.6, 0.2], atol=0.03)
    sure = CoordFrozenLake(success_rate=1.0)
    assert set(np.asarray(step(keys[:64], state, 1, sure.default_params)[1].position)) == {9}
    assert [slipper_success_rate(r) for r in ("50", 0.5, "50%", 100, 0, "2%")] == [0.5, 0.5, 0.5, 0.0, 1.0, 0.98]


@pytest.fixture(scope="module")
def game():
    env = Game2048()
    return env, jax.jit(jax.vmap(env.step_env, (0, 0, None, None)))


def test_2048_moves_rewards_and_texts_match_the_reference_rules(game):
    env, step = game
    rng = np.random.default_rng(0)
    grids = np.where(rng.random((64, 4, 4)) < 0.6, 2 ** rng.integers(1, 5, (64, 4, 4)), 0)
    states = Game2048State(jnp.asarray(grids, jnp.int32), jnp.zeros(64, jnp.int32), jnp.zeros(64, jnp.int32))
    peer = Peer2048()
    for action in range(4):
        _, new, reward, done, info = jax.device_get(step(jax.random.split(jax.random.key(1), 64), states, action,
                                                         env.default_params))
        for i in range(64):
            peer.grid = grids[i].astype(np.int64)
            moved_grid, merge_sum, moved = peer._move(peer.grid, action)
            assert bool(info["action_is_valid"][i]) == moved
            assert env.reward_value(float(reward[i])) == (np.log2(merge_sum + 1.0) * 0.1 if merge_sum else 0.0)
            if moved:  # one spawned tile on a cell the move left empty
                diff = new.grid[i] != moved_grid
                assert diff.sum() == 1 and moved_grid[diff] == 0 and new.grid[i][diff] in (2, 4)
                assert new.score[i] == merge_sum
            else:
                assert (new.grid[i] == grids[i]).all()
    full = jnp.asarray([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 4]], jnp.int32)
    state = Game2048State(full[None], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    _, after, _, done, _ = step(jax.random.split(jax.random.key(0), 1), state, 3, env.default_params)
    assert bool(done[0]) == (not np.any(np.asarray(valid_moves(after.grid[0]))))
    assert render_2048(np.concatenate([full.ravel(), [12], [0, 0, 0, 0]])).count("Valid Actions: None.") == 1


def test_2048_spawn_law_matches_the_reference_distribution(game):
    env, _ = game
    obs, _ = jax.jit(jax.vmap(env.reset_env, (0, None)))(jax.random.split(jax.random.key(3), 4000), env.default_params)
    grids = np.asarray(obs[:, :16])
    reference = np.stack([reference_2048_grid(s)[0].ravel() for s in range(4000)])
    for sample in (grids, reference):
        assert (np.count_nonzero(sample, axis=1) == 2).all()
        np.testing.assert_allclose(np.mean(sample[sample > 0] == 2), 0.9, atol=0.015)
        np.testing.assert_allclose(np.mean(sample > 0, axis=0), np.full(16, 2 / 16), atol=0.02)


def test_cube_moves_scrambles_and_bfs_depth():
    for base in range(0, 12, 2):
        prime, move = PERMUTATIONS[base + 1], PERMUTATIONS[base]
        np.testing.assert_array_equal(SOLVED[move][prime], SOLVED)  # X then X' is the identity
    env = RubiksCube(scramble_depth=3)
    obs, states = jax.jit(jax.vmap(env.reset_env, (0, None)))(jax.random.split(jax.random.key(0), 32),
                                                             env.default_params)
    for stickers in np.asarray(obs[:, :24]):
        assert solution_depth(stickers) <= 3 and sorted(np.bincount(stickers)) == [4] * 6
    assert solution_depth(reference_cube_stickers(10000, 5)) <= 5
    one = RubiksCube(scramble_depth=1)
    obs, _ = jax.jit(jax.vmap(one.reset_env, (0, None)))(jax.random.split(jax.random.key(1), 2400), one.default_params)
    moves = [next(a for a in range(12) if (SOLVED[PERMUTATIONS[a]] == s).all()) for s in np.asarray(obs[:, :24])]
    np.testing.assert_allclose(np.bincount(moves, minlength=12) / 2400, np.full(12, 1 / 12), atol=0.025)
    peer = PeerCube(scramble_depth=1)
    peer.reset(10000)
    state = jax.tree.map(lambda x: x[0], jax.vmap(one.reset_env, (0, None))(jax.random.split(jax.random.key(1), 1),
                                                                            one.default_params)[1])
    state = state.replace(stickers=jnp.asarray(peer.stickers, jnp.int32))
    assert one.render_text(state) == CUBE_10000
    _, solved, reward, done, info = one.step_env(None, state, 0, one.default_params)
    assert (float(reward), bool(done), bool(info["success"])) == (1.0, True, True)


@pytest.mark.parametrize("size,difficulty", [(4, "easy"), (9, "medium"), (16, "hard")])
def test_sudoku_generation_is_valid_with_exact_clue_counts(size, difficulty):
    core = SudokuCore(size, difficulty)
    _, states = jax.jit(jax.vmap(core.reset_env, (0, None)))(jax.random.split(jax.random.key(0), 16), core.params)
    assert bool(jnp.all(jax.vmap(is_valid_grid)(states.solution)))
    assert (np.asarray(states.initial).sum(axis=(1, 2)) == size * size - core.num_blanks).all()
    assert bool(jnp.all(jnp.where(states.initial, states.board == states.solution, states.board == 0)))
    assert len({np.asarray(s).tobytes() for s in states.solution}) == 16


def test_sudoku_parses_the_six_patterns():
    assert [parse_move(a, 9) for a in ("Place 5 at row 2 col 3", "place 5 at (2, 3)", "place 5 at 2,3", "5 at 2, 3",
                                       "(2,3,5)", " 2, 3,5 ")] == [(2, 3, 5)] * 6
    assert parse_move("row 2 col 3 = 5", 9).startswith("Could not parse action: 'row 2 col 3 = 5'.")
    assert "range" in parse_move("10,1,1", 9)


def test_sudoku_rewards_feedback_and_rendering():
    env = SudokuEnv()
    env.reset(0)
    puzzle, solution = reference_sudoku(10000)
    env.state = jax.device_get(env.core.new_state(puzzle, solution))
    peer = PeerSudoku()
    peer.reset(10000)
    _, reward, done, info = env.step("place 5 at row 1 col 1")
    assert (reward, done, info["action_is_valid"]) == (-0.1, False, False)
    assert peer.step("place 5 at row 1 col 1") == (-0.1, False)
    assert "\u274c Cannot modify initial cell at (1,1)" in env.render()
    _, reward, _, _ = env.step("2,1,6")  # 6 stands in row 2
    assert reward == -0.1 and "\u274c Invalid placement: 6 conflicts with row 2" in env.feedback
    r, c = 2, 1
    _, reward, _, info = env.step(f"{r},{c},{solution[r - 1, c - 1]}")
    assert (reward, info["action_is_valid"]) == (1.0, True) and env.feedback.startswith("\u2713 Correct! Placed")
    assert peer.step(f"{r},{c},{solution[r - 1, c - 1]}") == (1.0, False)
    assert "Progress: 50/81 cells filled (49 initial, 1 placed)\nSteps: 3/81" in env.render()
    _, reward, done, _ = env.step("nonsense")
    assert (reward, done) == (-0.1, False) and "\u274c Invalid action format: Could not parse" in env.render()
    empties = [tuple(rc) for rc in np.argwhere(np.asarray(env.state.board) == 0)]
    for r, c in empties[:-1]:
        env.step(f"{r + 1},{c + 1},{solution[r, c]}")
    assert "\U0001f4a1 VALID NUMBERS FOR EMPTY CELLS:\n  - " in env.render()
    r, c = empties[-1]
    _, reward, done, info = env.step(f"{r + 1},{c + 1},{solution[r, c]}")
    assert (reward, done, info["success"]) == (11.0, True, True) and "Congratulations" in env.render()


def test_bandit_v2_draws_the_split_pairs_and_pays_only_this_pair():
    env = envs.make("Bandit", V2)
    obs, states = jax.jit(jax.vmap(env.reset_env, (0, None)))(jax.random.split(jax.random.key(0), 2400),
                                                             env.default_params)
    np.testing.assert_allclose(np.bincount(np.asarray(states.pair), minlength=12) / 2400, np.full(12, 1 / 12),
                               atol=0.025)
    assert abs(np.mean(np.asarray(states.swapped)) - 0.5) < 0.04
    state = jax.tree.map(lambda x: x[0], states)
    lo, hi = (env.action_names[int(i)] for i in sorted(np.asarray(obs[0])))
    assert (lo, hi) == envs.bandit_v2.ARM_NAMES["train"][int(state.pair)]
    assert f"There are 2 arms, named {env.action_names[int(obs[0][0])]} and {env.action_names[int(obs[0][1])]}" \
        in env.render_text(state)
    step = jax.jit(jax.vmap(env.step_env, (0, None, None, None)))
    keys = jax.random.split(jax.random.key(1), 4000)
    high = 2 * int(state.pair) + 1
    _, after, reward, done, info = step(keys, state, high, env.default_params)
    assert abs(float(np.mean(np.asarray(reward))) - 0.25) < 0.03 and bool(info["success"].all()) and bool(done.all())
    assert env.render_text(jax.tree.map(lambda x: x[0], after)).startswith(f"{hi}: ")
    other = (high + 2) % 24
    _, _, reward, _, info = step(keys[:4], state, other, env.default_params)
    assert float(np.abs(reward).max()) == 0.0 and not bool(info["action_is_valid"].any())
    assert envs.make("BanditTest", V2).action_names[:2] == ("Receptionist", "Explorer")


def test_sudoku_conflicts_are_repeats_in_a_row_column_or_box():
    rng = np.random.default_rng(0)
    puzzle, solution = reference_sudoku(10000)
    for _ in range(10):
        board = solution.copy()
        mask = rng.random((9, 9)) < 0.3
        board[mask] = rng.integers(0, 10, mask.sum())
        want = np.zeros((9, 9), bool)
        for r, c in np.argwhere(board > 0):
            box = board[r // 3 * 3:r // 3 * 3 + 3, c // 3 * 3:c // 3 * 3 + 3]
            want[r, c] = (board[r] == board[r, c]).sum() > 1 or (board[:, c] == board[r, c]).sum() > 1 \
                or (box == board[r, c]).sum() > 1
        np.testing.assert_array_equal(np.asarray(conflict_mask(jnp.asarray(board))), want)
        assert bool(is_valid_grid(jnp.asarray(board))) == (not want.any() and (board > 0).all())
