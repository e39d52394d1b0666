"""RAGEN-2's 2048 (``game_2048``) as a gymnax environment: merge rules, spawn law, log reward (ragen2.md §7.3)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import spaces

from envs.base import TextEnvironment, check_positive_int, step_info
from envs.text_pieces import PieceRenderer, build_piece_renderer

GAME_2048_INSTRUCTION = (
    "You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding Up, Right, Down, or Left.\n"
    "If a move is invalid (no tiles move), a small penalty is applied. Respond with a single action.\n"
    "Example: <answer>Up</answer>\n"
)
ACTION_NAMES = ("Up", "Right", "Down", "Left")
SIZE = 4


@struct.dataclass
class Game2048State:
    grid: jax.Array  # (4, 4) int32 tile values, 0 = empty
    score: jax.Array  # running sum of merge values
    time: jax.Array


@struct.dataclass
class Game2048Params:
    """RAGEN's ``Game2048EnvConfig``; ``invalid_act_score`` is the raw reward of a move that changes nothing."""

    two_prob: float = 0.9
    use_log_reward: bool = True
    invalid_act_score: float = -0.1
    max_steps_in_episode: int = 2**30


def to_lines(grid: jax.Array, action) -> jax.Array:
    """The four lines of ``grid`` in the traversal order of ``action`` (Up, Right, Down, Left)."""
    return jnp.stack([grid.T, grid[:, ::-1], grid[::-1, :].T, grid])[action]


def from_lines(lines: jax.Array, action) -> jax.Array:
    """Inverse of ``to_lines``."""
    return jnp.stack([lines.T, lines[:, ::-1], lines.T[::-1, :], lines])[action]


def _compress(line: jax.Array) -> jax.Array:
    order = jnp.argsort(line == 0, stable=True)
    return line[order]


def merge_line(line: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One line slid to its front: equal neighbours merge greedily from the front, each tile once.

    Returns the new line and the sum of the merged values.
    """
    values = _compress(line)
    merged, consumed = [], jnp.bool_(False)
    for i in range(values.shape[0] - 1):
        here = ~consumed & (values[i] > 0) & (values[i] == values[i + 1])
        merged.append(here)
        consumed = here
    merge = jnp.stack(merged + [jnp.bool_(False)])
    taken = jnp.concatenate([jnp.zeros(1, bool), merge[:-1]])
    out = jnp.where(merge, 2 * values, jnp.where(taken, 0, values))
    return _compress(out), jnp.sum(jnp.where(merge, 2 * values, 0))


def slide(grid: jax.Array, action) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(new grid, merge sum, moved)`` of one move, without spawning (RAGEN's ``_move_sim``)."""
    lines, merges = jax.vmap(merge_line)(to_lines(grid, action))
    new = from_lines(lines, action)
    return new, merges.sum(), jnp.any(new != grid)


def valid_moves(grid: jax.Array) -> jax.Array:
    """(4,) bool: the moves that change the grid, in action-id order."""
    return jax.vmap(lambda a: slide(grid, a)[2])(jnp.arange(4))


def spawn(key: jax.Array, grid: jax.Array, two_prob) -> jax.Array:
    """A 2 (probability ``two_prob``) or a 4 on an empty cell drawn uniformly (row-major order); none if full."""
    k_cell, k_value = jax.random.split(key)
    empty = grid.ravel() == 0
    count = empty.sum()
    pick = jax.random.randint(k_cell, (), 0, jnp.maximum(count, 1))
    cell = jnp.argmax(empty & (jnp.cumsum(empty) - 1 == pick))
    value = jnp.where(jax.random.uniform(k_value) < two_prob, 2, 4)
    return jnp.where(count > 0, grid.ravel().at[cell].set(value), grid.ravel()).reshape(grid.shape)


def log_reward(merge_sum: float) -> float:
    """RAGEN's ``float(np.log2(raw + 1.0)) * 0.1`` as a Python double."""
    return math.log2(merge_sum + 1.0) * 0.1


class Game2048(TextEnvironment):
    """2048 on a 4x4 grid; actions 0-3 are Up, Right, Down, Left (RAGEN's ``action_lookup``).

    A move that changes nothing is invalid (raw reward ``invalid_act_score``, no spawn). Otherwise a tile
    spawns, the merge sum m is added to the score and the reward is ``0.1 log2(m + 1)`` when m > 0 (0 when
    m = 0 or the move is invalid, with ``use_log_reward``; the raw reward otherwise). The episode ends when
    no move changes the grid; ``success`` is a terminal grid holding 2048.
    """

    tag = "game_2048"
    action_names = ACTION_NAMES
    env_instruction = GAME_2048_INSTRUCTION
    max_actions_per_traj = 700
    max_tokens = 8192
    prompt_lists_actions = True

    def __init__(self, two_prob: float = 0.9, use_log_reward: bool = True, size: int = SIZE):
        if check_positive_int("size", size) != SIZE:
            raise ValueError(f"size must be {SIZE} (RAGEN's instruction and renderer assume a 4x4 grid), got {size}")
        if not 0.0 <= two_prob <= 1.0:
            raise ValueError(f"two_prob must be a probability in [0, 1], got {two_prob!r}")
        self.params = Game2048Params(two_prob=float(two_prob), use_log_reward=bool(use_log_reward))

    @property
    def default_params(self) -> Game2048Params:
        return self.params

    def reset_env(self, key: jax.Array, params: Game2048Params):
        k1, k2 = jax.random.split(key)
        grid = spawn(k2, spawn(k1, jnp.zeros((SIZE, SIZE), jnp.int32), params.two_prob), params.two_prob)
        state = Game2048State(grid, jnp.int32(0), jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: Game2048State, action, params: Game2048Params):
        new, merge_sum, moved = slide(state.grid, action)
        grid = jnp.where(moved, spawn(key, new, params.two_prob), state.grid)
        score = state.score + jnp.where(moved, merge_sum, 0)
        terminal = moved & ~jnp.any(valid_moves(grid))
        raw = jnp.where(moved, merge_sum.astype(jnp.float32), params.invalid_act_score)
        log = jnp.where(raw > 0, 0.1 * jnp.log2(raw + 1.0), 0.0)
        reward = jnp.where(params.use_log_reward, log, raw).astype(jnp.float32)
        new_state = Game2048State(grid, score, state.time + 1)
        info = step_info(terminal & (jnp.max(grid) >= 2048), moved, moved)
        info.update(raw_reward=raw.astype(jnp.float32), score=score)  # RAGEN's per-step raw merge sum and running score
        return self.get_obs(new_state), new_state, reward, terminal, info

    def episode_metrics(self, state: Game2048State) -> dict[str, jax.Array]:
        """RAGEN-2's ``max_tile``: the largest tile of the grid the episode ends on."""
        return {"max_tile": jnp.max(state.grid)}

    def get_obs(self, state: Game2048State, params=None, key=None) -> jax.Array:
        """The 16 tiles, the score and the four valid-move flags: everything ``render`` shows."""
        flags = valid_moves(state.grid).astype(jnp.int32)
        return jnp.concatenate([state.grid.ravel(), state.score[None], flags])

    def is_terminated(self, state: Game2048State, params) -> jax.Array:
        return ~jnp.any(valid_moves(state.grid))

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, 2**31 - 1, (SIZE * SIZE + 5,), jnp.int32)

    def render_text(self, state: Game2048State) -> str:
        return render_2048(jax.device_get(self.observe(state)))

    def reward_value(self, reward: float, params=None) -> float:
        """The double RAGEN returns: the merge sum is recovered from the float32 log reward (a multiple of 4)."""
        params = params or self.default_params
        if not params.use_log_reward:
            return params.invalid_act_score if reward < 0 else float(round(reward))
        if reward <= 0:
            return 0.0
        return log_reward(4 * round((2.0 ** (reward * 10.0) - 1.0) / 4))

    def step_reward_values(self, params) -> tuple[float, ...]:
        """0 and ``0.1 log2(m + 1)`` for every merge sum m a game within the budget can make.

        Tiles sum to at most ``8 + 4 * max_actions_per_traj`` (two spawns, then one per move), and merge
        sums are multiples of 4 up to that.
        """
        bound = tile_sum_bound(self.max_actions_per_traj)
        values = [0.0] if params.use_log_reward else [params.invalid_act_score, 0.0]
        if params.use_log_reward:
            return tuple(values + [float(jnp.float32(log_reward(m))) for m in range(4, bound + 1, 4)])
        return tuple(values + [float(m) for m in range(4, bound + 1, 4)])


    def state_renderer(self, tokenizer, params, max_actions_per_traj: int, num_checks: int = 64) -> PieceRenderer:
        """Slots: each cell (with the row text before it), the valid-action line and the score.

        Within ``max_actions_per_traj`` moves tiles are at most the largest power of two under the tile-sum
        bound and the score at most ``bound * (log2(bound) - 1)`` (each merge into 2v adds 2v to the score
        and ``v (log2 v - 1)`` summed over tiles grows by exactly that).
        """
        bound = tile_sum_bound(max_actions_per_traj)
        top = int(math.log2(bound))
        tiles = [0] + [2 ** j for j in range(1, top + 1)]
        max_score = bound * (top - 1)
        slots = []
        for r in range(SIZE):
            head = "Current 2048 Grid:\nRow 1: [" if r == 0 else f"]\nRow {r + 1}: ["
            slots.append([f"{head}{v}" for v in tiles])
            slots += [[f", {v}" for v in tiles] for _ in range(SIZE - 1)]
        valid = []
        for mask in range(16):
            names = [f"{a}({ACTION_NAMES[a]})" for a in range(4) if mask >> a & 1]
            valid.append(f"]\n\nValid Actions: {', '.join(names) if names else 'None'}.\n"
                         "Goal: Merge same numbers to reach 2048.\nCurrent Score:")
        slots += [valid, [f" {s}\nWhat is your next move?\n" for s in range(0, max_score + 1, 4)]]

        def index_of(obs):
            cells = jnp.where(obs[:16] > 0, jnp.round(jnp.log2(jnp.maximum(obs[:16], 1))), 0).astype(jnp.int32)
            flags = jnp.sum(obs[17:] << jnp.arange(4))
            return jnp.concatenate([jnp.minimum(cells, top), flags[None], jnp.minimum(obs[16:17] // 4, max_score // 4)])

        rng = np.random.default_rng(0)
        grids = np.where(rng.random((num_checks, 16)) < 0.7, 2 ** rng.integers(1, top + 1, (num_checks, 16)), 0)
        sample = np.concatenate([grids, 4 * rng.integers(0, max_score // 4 + 1, (num_checks, 1)),
                                 rng.integers(0, 2, (num_checks, 4))], axis=1).astype(np.int32)
        return build_piece_renderer(self, tokenizer, slots, index_of, sample, render_2048)


def tile_sum_bound(max_actions: int) -> int:
    """The largest tile sum after ``max_actions`` moves: two spawns at reset, one per move, each at most 4."""
    return 8 + 4 * max_actions


def render_2048(obs) -> str:
    """RAGEN's ``render()`` from ``get_obs``'s vector."""
    grid, score, flags = obs[:16].reshape(SIZE, SIZE), int(obs[16]), obs[17:]
    lines = ["Current 2048 Grid:"]
    lines += [f"Row {i + 1}: [{', '.join(str(int(x)) for x in row)}]" for i, row in enumerate(grid)]
    valid = [f"{a}({ACTION_NAMES[a]})" for a in range(4) if flags[a]]
    lines += ["", f"Valid Actions: {', '.join(valid) if valid else 'None'}.",
              "Goal: Merge same numbers to reach 2048.", f"Current Score: {score}", "What is your next move?"]
    return "\n".join(lines)
