"""Sokoban as a gymnax environment with gym-sokoban's push semantics and rewards (RAGEN's base env)."""

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import spaces

from envs.base import TextEnvironment, check_positive_int, render_grid, step_info
from envs.sokoban_generation import BOX, BOX_ON_TARGET, FLOOR, MOVES, PLAYER, TARGET, GeneratorConfig, generate_level
from envs.sokoban_reverse_play import reverse_play_level
from envs.tokens import GridRenderer, build_grid_renderer

PLAYER_ON_TARGET = 6  # render-only code
GENERATORS = ("reverse_play", "pull_walk")

SOKOBAN_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. You cannot push a box "
    "through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>"
)
DEFAULT_GRID_LOOKUP = {0: "#", 1: "_", 2: "O", 3: "\u221a", 4: "X", 5: "P", 6: "S"}
DIFFERENT_GRID_LOOKUP = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}
CELL_MEANINGS = ("wall", "empty", "target", "box on target", "box", "player", "player on target")


def grid_vocab_of(grid_lookup: Mapping[int, str]) -> dict[str, str]:
    """The ``{symbol: meaning}`` legend of a Sokoban symbol set."""
    return {grid_lookup[code]: meaning for code, meaning in enumerate(CELL_MEANINGS)}


@struct.dataclass
class SokobanState:
    """gym-sokoban's room arrays plus counters (``time`` is ``num_env_steps``)."""

    room_fixed: jax.Array  # (H, W) int8: 0 wall, 1 floor, 2 target
    room_state: jax.Array  # (H, W) int8: 0-5 as gym-sokoban
    player: jax.Array  # (2,) int32 (row, col)
    boxes_on_target: jax.Array
    time: jax.Array


@struct.dataclass
class SokobanParams:
    """Rewards and step limit (gym-sokoban defaults; RAGEN sets ``max_steps=100``)."""

    max_steps_in_episode: int = 100
    penalty_for_step: float = -0.1
    penalty_box_off_target: float = -1.0
    reward_box_on_target: float = 1.0
    reward_finished: float = 10.0


class Sokoban(TextEnvironment):
    """Sokoban with RAGEN's level generation (host callback) or a faster on-device one.

    Actions 0-3 are Up, Down, Left, Right (RAGEN ids 1-4, gym-sokoban's push actions 1-4): push a
    box if one is adjacent and the cell behind it is free, otherwise move if the cell is free.

    Args:
        dim_room: grid (height, width), at least (5, 5).
        num_boxes: boxes (and targets) per level.
        search_depth: RAGEN's reverse-play depth; pull-walks are ``search_depth - 2`` moves long.
        grid_lookup: symbol of each cell code 0-6 (RAGEN's ``grid_lookup``).
        generator: ``reverse_play``: RAGEN's generator exactly (``envs.sokoban_reverse_play``, on the
          host through ``jax.pure_callback``); ``pull_walk``: random pull-walks on device
          (``envs.sokoban_generation``), faster, easier levels (bench/README.md).
        walk_budget: ``pull_walk`` only: pull-walk moves per generation try (default 2048).
        tries: ``pull_walk`` only: topologies drawn at most per level before the fixed fallback room (16).
        legend_from_config: list ``grid_lookup``'s symbols in the prompt instead of the defaults.
        max_steps: steps after which an unsolved episode ends (RAGEN's ``max_steps``).
    """

    tag = "SimpleSokoban"
    action_names = ("Up", "Down", "Left", "Right")
    env_instruction = SOKOBAN_INSTRUCTION
    max_actions_per_traj = 10
    prompt_lists_actions = True
    walled_grid = True

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        search_depth: int = 300,
        grid_lookup: Mapping[int, str] | None = None,
        generator: str = "reverse_play",
        walk_budget: int | None = None,
        tries: int | None = None,
        legend_from_config: bool = False,
        max_steps: int = 100,
    ):
        height, width = (check_positive_int("dim_room", d) for d in dim_room)
        num_boxes = check_positive_int("num_boxes", num_boxes)
        if height < 5 or width < 5:
            raise ValueError(f"dim_room must be at least (5, 5), got {tuple(dim_room)!r}")
        if num_boxes > width - 2:
            raise ValueError(f"num_boxes={num_boxes} does not fit a room of width {width}")
        if check_positive_int("search_depth", search_depth) < 3:
            raise ValueError(f"search_depth must be at least 3, got {search_depth}")
        self.params = SokobanParams(max_steps_in_episode=check_positive_int("max_steps", max_steps))
        self.grid_lookup = dict(grid_lookup or DEFAULT_GRID_LOOKUP)
        if sorted(self.grid_lookup) != list(range(7)):
            raise ValueError(f"grid_lookup must map the cell codes 0-6, got keys {sorted(self.grid_lookup)}")
        if generator not in GENERATORS:
            raise ValueError(f"generator must be one of {GENERATORS}, got {generator!r}")
        if generator == "reverse_play" and (walk_budget is not None or tries is not None):
            raise ValueError("walk_budget and tries configure generator='pull_walk', not 'reverse_play'")
        self.generator_kind = generator
        self.generator = GeneratorConfig(
            dim_room=(height, width),
            num_boxes=num_boxes,
            search_depth=search_depth,
            walk_budget=check_positive_int("walk_budget", 2048 if walk_budget is None else walk_budget),
            tries=check_positive_int("tries", 16 if tries is None else tries),
        )
        # RAGEN lists the default legend whatever ``grid_lookup`` is (starpo.md §4);
        # ``legend_from_config=True`` lists this environment's own symbols instead.
        self.grid_vocab = grid_vocab_of(self.grid_lookup if legend_from_config else DEFAULT_GRID_LOOKUP)

    @property
    def default_params(self) -> SokobanParams:
        return self.params

    @property
    def dim_room(self) -> tuple[int, int]:
        return self.generator.dim_room

    @property
    def num_boxes(self) -> int:
        return self.generator.num_boxes

    def reset_env(self, key: jax.Array, params: SokobanParams):
        if self.generator_kind == "reverse_play":
            level = reverse_play_level(key, self.dim_room, self.num_boxes, self.generator.search_depth)
        else:
            level = generate_level(key, self.generator)
        state = SokobanState(level.room_fixed, level.room_state, level.player, jnp.int32(0), jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: SokobanState, action, params: SokobanParams):
        fixed, room = state.room_fixed, state.room_state
        height, width = self.dim_room
        delta = MOVES[action]
        here = state.player
        ahead = jnp.clip(here + delta, 0, jnp.array([height - 1, width - 1]))
        beyond = here + 2 * delta
        beyond_inside = jnp.all((beyond >= 0) & (beyond < jnp.array([height, width])))
        # Cells are addressed with masks rather than scatters: elementwise code vectorises well.
        rows, cols = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
        at = lambda cell: (rows == cell[0]) & (cols == cell[1])
        at_here, at_ahead, at_beyond = at(here), at(ahead), at(beyond) & beyond_inside
        cell_of = lambda mask: jnp.max(jnp.where(mask, room, 0))
        ahead_cell, beyond_cell = cell_of(at_ahead), cell_of(at_beyond)
        is_free = lambda cell: (cell == FLOOR) | (cell == TARGET)
        push = beyond_inside & ((ahead_cell == BOX) | (ahead_cell == BOX_ON_TARGET)) & is_free(beyond_cell)
        moved = push | is_free(ahead_cell)

        box_code = jnp.where(fixed == TARGET, BOX_ON_TARGET, BOX)
        room = jnp.where(at_beyond & push, box_code, room)
        room = jnp.where(at_here & moved, fixed, room)
        room = jnp.where(at_ahead & moved, PLAYER, room).astype(state.room_state.dtype)
        player = jnp.where(moved, ahead, here)

        uncovered = (room == TARGET) | ((fixed == TARGET) & (room == PLAYER))
        boxes_on_target = self.num_boxes - uncovered.sum(dtype=jnp.int32)
        solved = boxes_on_target == self.num_boxes
        reward = (
            params.penalty_for_step
            + jnp.where(boxes_on_target > state.boxes_on_target, params.reward_box_on_target, 0.0)
            + jnp.where(boxes_on_target < state.boxes_on_target, params.penalty_box_off_target, 0.0)
            + jnp.where(solved, params.reward_finished, 0.0)
        ).astype(jnp.float32)
        new_state = SokobanState(fixed, room, player, boxes_on_target, state.time + 1)
        info = step_info(solved, True, moved)
        done = solved | (new_state.time >= params.max_steps_in_episode)
        return self.get_obs(new_state), new_state, reward, done, info

    def get_obs(self, state: SokobanState, params=None, key=None) -> jax.Array:
        """Cell codes as rendered: 0-5 as gym-sokoban, 6 for the player on a target."""
        on_target = (state.room_state == PLAYER) & (state.room_fixed == TARGET)
        return jnp.where(on_target, PLAYER_ON_TARGET, state.room_state).astype(jnp.int8)

    def is_terminated(self, state: SokobanState, params) -> jax.Array:
        return state.boxes_on_target == self.num_boxes

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, PLAYER_ON_TARGET, self.dim_room, jnp.int8)

    def render_text(self, state: SokobanState) -> str:
        return render_grid(self.observe(state), self.grid_lookup)

    def step_reward_values(self, params) -> tuple[float, ...]:
        return tuple(params.penalty_for_step + box + finish
                     for box in (0.0, params.reward_box_on_target, params.penalty_box_off_target)
                     for finish in (0.0, params.reward_finished))

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int) -> GridRenderer:
        return build_grid_renderer(self, tokenizer)

    def reward_value(self, reward: float, params=None):
        """Rebuilds gym-sokoban's double: ``-0.1``, then ``+ 1`` or ``+ -1``, then ``+ 10``."""
        finished = reward > 5
        box_change = round(reward + 0.1 - 10 * finished)
        value = -0.1
        if box_change:
            value += box_change
        if finished:
            value += 10
        return value

