"""FrozenLake as a gymnax environment: gymnasium's slippery dynamics on RAGEN's random maps."""

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import spaces

from envs.base import TextEnvironment, check_positive_int, render_grid, step_info
from envs.tokens import GridRenderer, build_grid_renderer

FROZEN_LAKE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go "
    "to the target, I should go left then go up.</think><answer>Left || Up</answer>"
)
GRID_LOOKUP = {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "\u221a"}
GRID_VOCAB = {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "\u221a": "player on goal"}

# gymnasium's tiles (bytes of its ``desc``) and moves: 0 left, 1 down, 2 right, 3 up.
FROZEN, HOLE, START, GOAL = (ord(c) for c in "FHSG")
MOVES = jnp.array([(0, -1), (1, 0), (0, 1), (-1, 0)], jnp.int32)


@struct.dataclass
class FrozenLakeState:
    desc: jax.Array  # (size, size) uint8 tiles b"F", b"H", b"S", b"G" as in gymnasium
    position: jax.Array  # flat index ``row * size + col`` (gymnasium's ``s``)
    time: jax.Array


@struct.dataclass
class FrozenLakeParams:
    """``p`` is the probability that a tile is frozen; RAGEN imposes no step limit of its own."""

    p: float = 0.8
    is_slippery: bool = True
    success_rate: float = 1 / 3  # probability of the intended move; each perpendicular one has half the rest
    max_steps_in_episode: int = 2**30


def has_path(desc: jax.Array) -> jax.Array:
    """Whether the goal can be reached from the start without crossing a hole (flood fill)."""
    size = desc.shape[0]
    passable = desc != HOLE

    def grow(_, reach):
        padded = jnp.pad(reach, 1)
        near = padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
        return reach | (near & passable)

    reach = jax.lax.fori_loop(0, size * size, grow, desc == START)
    return jnp.any(reach & (desc == GOAL))


def generate_map(key: jax.Array, size: int, p) -> jax.Array:
    """RAGEN's ``generate_random_map``: F/H tiles, distinct start and goal, resampled until solvable."""

    def draw(carry):
        key, _, _ = carry
        key, sub = jax.random.split(key)
        u = jax.random.uniform(sub, (size * size + 4,))
        tiles = jnp.where(u[: size * size] < p, FROZEN, HOLE).astype(jnp.uint8)
        cells = jnp.minimum((u[size * size:] * size).astype(jnp.int32), size - 1)
        start, goal = cells[0] * size + cells[1], cells[2] * size + cells[3]
        desc = tiles.at[start].set(START).at[goal].set(GOAL).reshape(size, size)
        return key, desc, (start != goal) & has_path(desc)

    init = (key, jnp.zeros((size, size), jnp.uint8), jnp.bool_(False))
    return jax.lax.while_loop(lambda carry: ~carry[2], draw, init)[1]


class FrozenLake(TextEnvironment):
    """FrozenLake; actions 0-3 are Left, Down, Right, Up (RAGEN ids 1-4, gymnasium ids 0-3).

    When slippery, the agent moves in the intended direction or either perpendicular one, each with
    probability 1/3. Reaching the goal pays 1 and ends the episode; falling in a hole ends it.
    """

    tag = "FrozenLake"
    action_names = ("Left", "Down", "Right", "Up")
    env_instruction = FROZEN_LAKE_INSTRUCTION
    grid_vocab = GRID_VOCAB
    grid_lookup = GRID_LOOKUP
    max_actions_per_traj = 10
    prompt_lists_actions = True

    def __init__(self, size: int = 4, p: float = 0.8, is_slippery: bool = True):
        """RAGEN's ``FrozenLakeEnvConfig``: ``size``, ``p`` (probability a tile is frozen), ``is_slippery``."""
        self.size = check_positive_int("size", size)
        if self.size < 2:
            raise ValueError(f"size must be at least 2 (start and goal differ), got {size}")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p must be in (0, 1] (the probability that a tile is frozen), got {p}")
        self.params = FrozenLakeParams(p=float(p), is_slippery=bool(is_slippery))

    @property
    def default_params(self) -> FrozenLakeParams:
        return self.params

    def reset_env(self, key: jax.Array, params: FrozenLakeParams):
        desc = generate_map(key, self.size, params.p)
        position = jnp.argmax(desc.ravel() == START).astype(jnp.int32)
        state = FrozenLakeState(desc, position, jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: FrozenLakeState, action, params: FrozenLakeParams):
        tiles = state.desc.ravel()
        u = jax.random.uniform(key)
        drawn = jnp.where(u < (1 - params.success_rate) / 2, -1, jnp.where(u < (1 + params.success_rate) / 2, 0, 1))
        slip = jnp.where(params.is_slippery, drawn, 0)
        delta = MOVES[(action + slip) % 4]
        row, col = jnp.divmod(state.position, self.size)
        row = jnp.clip(row + delta[0], 0, self.size - 1)
        col = jnp.clip(col + delta[1], 0, self.size - 1)
        finished = (tiles[state.position] == HOLE) | (tiles[state.position] == GOAL)
        position = jnp.where(finished, state.position, row * self.size + col).astype(jnp.int32)
        tile = tiles[position]
        at_goal = tile == GOAL
        reward = jnp.where(finished, 0.0, at_goal.astype(jnp.float32))
        terminated = at_goal | (tile == HOLE)
        new_state = FrozenLakeState(state.desc, position, state.time + 1)
        info = step_info(at_goal, True, position != state.position)
        return self.get_obs(new_state), new_state, reward, terminated, info

    def get_obs(self, state: FrozenLakeState, params=None, key=None) -> jax.Array:
        """RAGEN's render codes: 0 player, 1 frozen or start, 2 hole, 3 goal, 4/5 player in hole/on goal."""
        desc = state.desc.ravel()
        codes = jnp.select([desc == HOLE, desc == GOAL], [2, 3], 1)
        player = jnp.select([desc[state.position] == HOLE, desc[state.position] == GOAL], [4, 5], 0)
        return codes.at[state.position].set(player).reshape(self.size, self.size).astype(jnp.int8)

    def is_terminated(self, state: FrozenLakeState, params) -> jax.Array:
        tile = state.desc.ravel()[state.position]
        return (tile == HOLE) | (tile == GOAL)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, 5, (self.size, self.size), jnp.int8)

    def render_text(self, state: FrozenLakeState) -> str:
        return render_grid(self.observe(state), self.grid_lookup)

    def step_reward_values(self, params) -> tuple[float, ...]:
        return (0.0, 1.0)

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int) -> GridRenderer:
        return build_grid_renderer(self, tokenizer)

    def reward_value(self, reward: float, params=None) -> float:
        """gymnasium returns ``float(tile == b"G")``: ``1.0`` or ``0.0``."""
        return float(round(reward))
