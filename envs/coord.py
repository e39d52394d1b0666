"""RAGEN-2's coordinate observations: ``CoordSokoban`` and ``CoordFrozenLake`` (ragen2.md §7.1, §7.2).

``observation_format`` is ``grid`` (V1), ``coord`` (the coordinates block alone) or ``grid_coord``
(``"Coordinates: \\n" + block + "\\nGrid Map: \\n" + grid``). FrozenLake also takes RAGEN-2's ``success_rate``
and, an addition of ours, ``goal_offset``: a last coordinate line ``Goal from player: 2 down, 1 left``.
On the fused driver, Sokoban (any number of boxes) and FrozenLake render every format (coordinate lines as token
slots). FrozenLake's observation codes hide the start tile (it
shows as ``_``), so its coordinate formats add code 6 (``START_CODE``, drawn ``_``) for an unoccupied start.
"""

import jax
import jax.numpy as jnp
import numpy as np
from gymnax.environments import spaces

from envs.base import render_grid
from envs.text_pieces import build_piece_renderer
from envs.tokens import _row_texts, build_grid_renderer
from envs.frozen_lake import GRID_LOOKUP, START, FrozenLake, FrozenLakeParams, FrozenLakeState
from envs.sokoban import PLAYER_ON_TARGET, Sokoban
from envs.sokoban_generation import BOX, BOX_ON_TARGET, PLAYER, TARGET

FORMATS = ("grid", "coord", "grid_coord")
START_CODE = 6  # CoordFrozenLake's coordinate formats: the start tile while the player is elsewhere
PLAYER_LABELS = ("Player", "Player in hole", "Player on goal")  # observation codes 0, 4, 5
COORD_SOKOBAN_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n"
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). \n"
    "When you are exactly next to a box, you can push it by moving in the same direction. \n"
    "You cannot push a box through a wall, and you cannot pull a box.\n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)
COORD_FROZEN_LAKE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed coordinates "
    "for the start, goal, player, and any holes.\n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\n"
    "Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.\n"
    "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n"
)


def _check_format(observation_format: str) -> str:
    if observation_format not in FORMATS:
        raise ValueError(f"observation_format must be one of {FORMATS}, got {observation_format!r}")
    return observation_format


def _one_of(obs: np.ndarray, *codes: int) -> np.ndarray:
    """``np.isin(obs, codes)``, without its setup cost on a small board (rendering runs it every step)."""
    return np.logical_or.reduce([obs == code for code in codes])


def coordinate_block(shape, groups) -> str:
    """``Board size: …`` then ``{label}: (r, c), …`` for each non-empty ``(label, mask)`` group."""
    lines = [f"Board size: {shape[0]} rows x {shape[1]} cols (zero-indexed)."]
    for label, mask in groups:
        cells = np.argwhere(mask)
        if len(cells):
            lines.append(f"{label}: " + ", ".join(f"({r}, {c})" for r, c in cells))
    return "\n".join(lines)


def goal_offset_line(player: tuple[int, int], goal: tuple[int, int]) -> str:
    """``Goal from player: 2 down, 1 left`` (rows first; a zero part left out; ``here`` on the goal)."""
    (row, col), (goal_row, goal_col) = player, goal
    parts = ([f"{abs(goal_row - row)} {'down' if goal_row > row else 'up'}"] if goal_row != row else []) + \
            ([f"{abs(goal_col - col)} {'right' if goal_col > col else 'left'}"] if goal_col != col else [])
    return "Goal from player: " + (", ".join(parts) or "here")


def compose(observation_format: str, block: str, grid: str) -> str:
    if observation_format == "grid":
        return grid
    if observation_format == "coord":
        return block
    return "Coordinates: \n" + block + "\n" + "Grid Map: \n" + grid


class CoordSokoban(Sokoban):
    """RAGEN-2's Sokoban, rendered in one of its formats; the defaults are the ``CoordSokoban`` tag's."""

    tag = "CoordSokoban"
    env_instruction = COORD_SOKOBAN_INSTRUCTION
    max_tokens = 120

    def __init__(self, dim_room: tuple[int, int] = (6, 6), num_boxes: int = 1, search_depth: int = 300,
                 max_steps: int = 100, observation_format: str = "grid_coord", generator: str = "reverse_play"):
        super().__init__(dim_room, num_boxes, search_depth, generator=generator, max_steps=max_steps)
        self.observation_format = _check_format(observation_format)

    def render_text(self, state) -> str:
        return self.text_of_obs(np.asarray(jax.device_get(self.observe(state))))

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int, num_checks: int = 64):
        """The grid format's row tables, or the coordinate lines as slots (then the grid rows).

        Each listed cell is a slot that ends after its column's digits (``Boxes: (2, 3`` or ``), (4, 1``), and a
        closing slot (``)\n``) ends a non-empty line: a cut after a digit is a pre-token boundary, a cut after
        ``)`` before ``,`` would not be. A line has as many cell slots as it can list (``num_boxes``, or one).
        """
        if self.observation_format == "grid":
            return build_grid_renderer(self, tokenizer)
        height, width = self.dim_room
        cells = [(r, c) for r in range(height) for c in range(width)]
        grid = self.observation_format == "grid_coord"
        codes = {"Targets": (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET), "Boxes": (BOX,),
                 "Boxes on target": (BOX_ON_TARGET,), "Player": (PLAYER,), "Player on target": (PLAYER_ON_TARGET,)}
        lines = [(label, self.num_boxes if label.startswith(("Targets", "Boxes")) else 1) for label in codes]
        slots = [[("Coordinates: \n" if grid else "") + f"Board size: {height} rows x {width} cols (zero-indexed).\n"]]
        for label, most in lines:
            slots += [[""] + [f"{label}: ({r}, {c}" if j == 0 else f"), ({r}, {c}" for r, c in cells]
                      for j in range(most)]
            slots.append(["", ")\n" + ("Grid Map: \n" if grid and label.startswith("Player") else "")])
        symbols = [self.grid_lookup[code] for code in range(len(self.grid_lookup))]
        if grid:
            slots += [_row_texts(symbols, width, True)] * height  # one table for every row
        radix = len(symbols) ** jnp.arange(width - 2)

        def index_of(obs):
            flat = obs.ravel().astype(jnp.int32)
            index = []
            for label, most in lines:
                listed = jnp.isin(flat, jnp.asarray(codes[label]))
                rank, count = jnp.cumsum(listed) - 1, listed.sum()
                index += [jnp.where(j < count, 1 + jnp.argmax(listed & (rank == j)), 0) for j in range(most)]
                index.append((count > 0).astype(jnp.int32))
            rows = jnp.sum(obs[:, 1:-1].astype(jnp.int32) * radix, axis=1) if grid else jnp.zeros(0, jnp.int32)
            return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.stack(index).astype(jnp.int32), rows])

        return build_piece_renderer(self, tokenizer, slots, index_of, self._sample_obs(num_checks),
                                    self.text_of_obs)

    def _sample_obs(self, count: int) -> np.ndarray:
        """Random rooms: walled border, random interior walls, ``num_boxes`` targets and boxes and the player, with
        boxes and the player on targets in every combination."""
        height, width = self.dim_room
        k = self.num_boxes
        rng = np.random.default_rng(0)
        out = []
        for n in range(count):
            room = np.where(rng.random((height, width)) < 0.3, 0, 1).astype(np.int8)
            room[[0, -1], :], room[:, [0, -1]] = 0, 0
            inside = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
            picks = [inside[i] for i in rng.choice(len(inside), 2 * k + 1, replace=False)]
            targets, boxes, player = picks[:k], picks[k:2 * k], picks[-1]
            for t, b in zip(targets, boxes):
                room[t], room[b] = 2, 4
            room[player] = 5
            covered = rng.random(k) < 0.5 if n % 3 else np.arange(k) < n % 4
            for t, b, on in zip(targets, boxes, covered):
                if on:
                    room[t], room[b] = 3, 1
            free = [t for t, on in zip(targets, covered) if not on]
            if n % 3 == 2 and free:
                room[free[0]], room[player] = 6, 1
            out.append(room)
        return np.stack(out)

    def text_of_obs(self, obs: np.ndarray) -> str:
        """The observation text of ``get_obs`` codes (targets are the cells coded 2, 3 or 6)."""
        on = obs == PLAYER_ON_TARGET
        room = np.where(on, PLAYER, obs)
        fixed = np.where((obs == BOX_ON_TARGET) | on | (obs == TARGET), TARGET, np.where(obs == 0, 0, 1))
        target = fixed == TARGET
        block = coordinate_block(room.shape, [("Targets", target), ("Boxes", room == BOX),
                                              ("Boxes on target", room == BOX_ON_TARGET),
                                              ("Player", (room == PLAYER) & ~target),
                                              ("Player on target", (room == PLAYER) & target)])
        return compose(self.observation_format, block, render_grid(obs, self.grid_lookup))


class CoordFrozenLake(FrozenLake):
    """RAGEN-2's FrozenLake: ``p`` 0.9, gymnasium's ``success_rate`` slip law and the coordinate formats.

    The defaults are the ``CoordFrozenLake`` tag's. ``goal_offset`` (ours, off by default) ends the coordinate block
    with the goal's offset from the player (``goal_offset_line``): where the goal lies becomes a line to read rather
    than two coordinates to compare (the embedded demo's lake stage, ``launch.demo_starpo``).
    """

    tag = "CoordFrozenLake"
    env_instruction = COORD_FROZEN_LAKE_INSTRUCTION
    max_tokens = 120

    def __init__(self, size: int = 4, p: float = 0.9, is_slippery: bool = True, success_rate: float = 0.8,
                 observation_format: str = "grid_coord", goal_offset: bool = False):
        super().__init__(size, p, is_slippery)
        if not 0.0 <= success_rate <= 1.0:
            raise ValueError(f"success_rate must be a probability in [0, 1], got {success_rate!r}")
        self.params = FrozenLakeParams(p=self.params.p, is_slippery=self.params.is_slippery,
                                       success_rate=float(success_rate))
        self.observation_format = _check_format(observation_format)
        if goal_offset and self.observation_format == "grid":
            raise ValueError("goal_offset=True adds a coordinate line: it needs observation_format 'coord' or "
                             "'grid_coord', got 'grid'")
        self.goal_offset = bool(goal_offset)
        if self.observation_format != "grid":
            self.grid_lookup = {**GRID_LOOKUP, START_CODE: "_"}

    def get_obs(self, state, params=None, key=None) -> jax.Array:
        """FrozenLake's codes, plus ``START_CODE`` on an unoccupied start tile in the coordinate formats."""
        codes = super().get_obs(state, params, key)
        if self.observation_format == "grid":
            return codes
        start = (state.desc == START) & (codes == 1)
        return jnp.where(start, START_CODE, codes).astype(jnp.int8)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, max(self.grid_lookup), (self.size, self.size), jnp.int8)

    def render_text(self, state) -> str:
        return self.text_of_obs(np.asarray(jax.device_get(self.observe(state))))

    def text_of_obs(self, obs: np.ndarray) -> str:
        """The observation text of ``get_obs`` codes (the start is the player's cell when no code 6 shows)."""
        player = _one_of(obs, 0, 4, 5)
        start = obs == START_CODE if (obs == START_CODE).any() else player
        label = PLAYER_LABELS[(0, 4, 5).index(int(obs[player][0]))]
        goal = _one_of(obs, 3, 5)
        block = coordinate_block(obs.shape, [("Start", start), ("Goal", goal), (label, player),
                                             ("Holes", _one_of(obs, 2, 4))])
        if self.goal_offset:
            block += "\n" + goal_offset_line(tuple(np.argwhere(player)[0]), tuple(np.argwhere(goal)[0]))
        return compose(self.observation_format, block, render_grid(obs, self.grid_lookup))

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int, num_checks: int = 64):
        """The grid format's row tables, or the coordinate lines as slots (one per hole cell, then the goal offset),
        then the grid rows."""
        if self.observation_format == "grid":
            return build_grid_renderer(self, tokenizer)
        size = self.size
        cells = [(r, c) for r in range(size) for c in range(size)]
        grid = self.observation_format == "grid_coord"
        head = ("Coordinates: \n" if grid else "") + f"Board size: {size} rows x {size} cols (zero-indexed).\n"
        slots = [[f"{head}Start: ({r}, {c})\n" for r, c in cells], [f"Goal: ({r}, {c})\n" for r, c in cells],
                 [f"{label}: ({r}, {c})\n" for label in PLAYER_LABELS for r, c in cells], ["", "Holes:"]]
        slots += [["", f" ({r}, {c}),", f" ({r}, {c})\n"] for r, c in cells]  # a hole, then the last hole
        span = range(1 - size, size)
        if self.goal_offset:
            slots += [[goal_offset_line((0, 0), (dr, dc)) + "\n" for dr in span for dc in span]]
        symbols = [self.grid_lookup[code] for code in range(len(self.grid_lookup))]
        if grid:
            slots += [["Grid Map: \n"]] + [_row_texts(symbols, size, False)] * size  # one table for every row
        radix = len(symbols) ** jnp.arange(size)

        def index_of(obs):
            flat = obs.ravel().astype(jnp.int32)
            player = jnp.argmax((flat == 0) | (flat == 4) | (flat == 5))
            start = jnp.where(jnp.any(flat == START_CODE), jnp.argmax(flat == START_CODE), player)
            goal = jnp.argmax((flat == 3) | (flat == 5))
            label = jnp.select([flat[player] == 4, flat[player] == 5], [1, 2], 0)
            holes = ((flat == 2) | (flat == 4)).astype(jnp.int32)
            later = jnp.cumsum(holes[::-1])[::-1] - holes
            items = holes * jnp.where(later == 0, 2, 1)
            head = jnp.stack([start, goal, label * len(cells) + player, jnp.any(holes > 0).astype(jnp.int32)])
            rows = jnp.sum(obs.astype(jnp.int32) * radix, axis=1) if grid else jnp.zeros(0, jnp.int32)
            offset = (goal // size - player // size + size - 1) * len(span) + goal % size - player % size + size - 1
            offset = offset[None] if self.goal_offset else jnp.zeros(0, jnp.int32)
            return jnp.concatenate([head, items, offset, jnp.zeros(int(grid), jnp.int32), rows])

        return build_piece_renderer(self, tokenizer, slots, index_of, self._sample_obs(num_checks), self.text_of_obs)

    def _sample_obs(self, count: int) -> np.ndarray:
        """Random maps (about a third holes) with the player anywhere: on the start, a hole, the goal or ice."""
        rng = np.random.default_rng(0)
        states = []
        for k in range(count):
            desc = np.where(rng.random(self.size * self.size) < 0.3, ord("H"), ord("F")).astype(np.uint8)
            start, goal = rng.choice(desc.size, 2, replace=False)
            desc[start], desc[goal] = START, ord("G")
            position = start if k % 4 == 0 else rng.integers(desc.size)
            states.append(FrozenLakeState(jnp.asarray(desc.reshape(self.size, self.size)), jnp.int32(position),
                                          jnp.int32(0)))
        batch = jax.tree.map(lambda *x: jnp.stack(x), *states)
        return np.asarray(jax.vmap(self.get_obs)(batch))

    def step_reward_values(self, params) -> tuple[float, ...]:
        return (0.0, 1.0)


def slipper_success_rate(slipper_rate) -> float:
    """``success_rate`` of a slipper-sweep rate: ``50``, ``0.5`` and ``"50%"`` all mean half (``1 - rate``)."""
    text = str(slipper_rate).strip().rstrip("%")
    rate = float(text)
    if str(slipper_rate).strip().endswith("%") or rate > 1:
        rate /= 100
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"slipper_rate must be in [0, 100]%, got {slipper_rate!r}")
    return float(f"{1 - rate:.6f}")
