"""The reference's Sokoban level generator on the host: exhaustive reverse play (RAGEN / gym-sokoban).

RAGEN's ``ragen/env/sokoban/utils.py::generate_room`` (adapted from gym-sokoban) draws with Python's
``random`` and NumPy's legacy ``np.random``; here each level has its own ``random.Random(seed)`` and
``np.random.RandomState(seed)`` consuming the same draws in the same order, so a seed gives the
reference's room:

1. ``room_topology``: a random walk of ``num_steps`` 3x3 floor masks; the border becomes wall.
2. ``place_targets``: the player, then one target per box, on uniformly drawn free floor cells.
3. ``reverse_play``: a depth-first search from the solved state over pull moves (the player steps
   onto a free cell and pulls the box behind it), each state explored once, depth below
   ``search_depth``, at most 300,000 states; the kept state maximises ``box_swaps * displacement``
   (0 while a box or the player covers a target), the first found on ties.
4. Up to ``tries`` topologies until one scores above 0; RAGEN then reseeds without bound.
5. RAGEN's ``add_random_player_movement``: 1-3 random non-revisiting steps.

``variant="gym"`` is gym-sokoban's own ``generate_room`` instead: move and pull actions, ``ttl`` 300,
the parent's last pull carried down (so every pull counts as a box swap), no player movement.
Cell codes follow gym-sokoban: 0 wall, 1 floor, 2 target, 3 box on target, 4 box, 5 player.
"""

import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # the topology walk's
MASKS = tuple(np.array(m) for m in (
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
))
MAX_EXPLORED = 300_000
VARIANTS = ("ragen", "gym")


class HostLevel(NamedTuple):
    """``room_fixed`` (0/1/2), ``room_state`` (0-5), the player's (row, col) and the kept state's score."""

    room_fixed: np.ndarray
    room_state: np.ndarray
    player: np.ndarray
    score: int


def room_topology(rng: random.Random, dim: tuple[int, int], p_change_directions: float, num_steps: int) -> np.ndarray:
    """0/1 floor map carved by the reference's random walk."""
    height, width = dim
    direction = rng.sample(DIRECTIONS, 1)[0]
    position = np.array([rng.randint(1, height - 1), rng.randint(1, width - 1)])
    level = np.zeros(dim, int)
    for _ in range(num_steps):
        if rng.random() < p_change_directions:
            direction = rng.sample(DIRECTIONS, 1)[0]
        position = np.clip(position + direction, 1, (height - 2, width - 2))
        mask = rng.sample(MASKS, 1)[0]
        level[position[0] - 1:position[0] + 2, position[1] - 1:position[1] + 2] += mask
    level = (level > 0).astype(int)
    level[:, [0, width - 1]] = 0
    level[[0, height - 1], :] = 0
    return level


def place_targets(state: np.random.RandomState, floor: np.ndarray, num_boxes: int) -> tuple[int, list[int]] | None:
    """Flat player cell and target cells drawn as the reference does; None without enough floor."""
    free = list(np.flatnonzero(floor.ravel() == 1))
    if len(free) <= num_boxes + 1:
        return None
    player = int(free[state.randint(len(free))])
    taken, targets = {player}, []
    for _ in range(num_boxes):
        free = [c for c in np.flatnonzero(floor.ravel() == 1) if c not in taken]
        targets.append(int(free[state.randint(len(free))]))
        taken.add(targets[-1])
    return player, targets


def reverse_play(floor: np.ndarray, player: int, targets: list[int], search_depth: int,
                 variant: str = "ragen") -> tuple[int, int, tuple[int, ...]]:
    """The reference's depth-first reverse play from the solved state; returns (score, player, boxes).

    Box i starts on target i. A state is the player cell, the box cells and which boxes were
    ever pulled (the reference hashes the room, where a pulled box is coded 3, an unpulled one 4).
    """
    width = floor.shape[1]
    open_cells = floor.ravel() > 0
    steps = (-width, width, -1, 1)  # up, down, left, right
    actions = range(4) if variant == "ragen" else range(8)  # gym-sokoban also tries moves without pulling
    explored: set = set()
    best = [-1, player, tuple(targets)]

    def search(player, boxes, pulled, swaps, last_pull, ttl):
        ttl -= 1
        if ttl <= 0 or len(explored) >= MAX_EXPLORED:
            return
        key = (player, frozenset(zip(boxes, pulled)))
        if key in explored:
            return
        covered = any(t in boxes or t == player for t in targets)
        score = 0 if covered else swaps * sum(abs(b // width - t // width) + abs(b % width - t % width)
                                              for b, t in zip(boxes, targets))
        if score > best[0]:
            best[:] = [score, player, boxes]
        explored.add(key)
        for action in actions:
            step = steps[action % 4]
            ahead = player + step
            new_boxes, new_pulled, pull = boxes, pulled, last_pull
            if open_cells[ahead] and ahead not in boxes:
                behind = player - step
                if action < 4 and behind in boxes:
                    pull = boxes.index(behind)
                    new_boxes = boxes[:pull] + (player,) + boxes[pull + 1:]
                    new_pulled = pulled[:pull] + (True,) + pulled[pull + 1:]
                moved = ahead
            else:
                moved = player
            carried = pull if variant == "ragen" else last_pull
            search(moved, new_boxes, new_pulled, swaps + (pull != last_pull), carried, ttl)

    search(player, tuple(targets), (False,) * len(targets), 0, -1, search_depth if variant == "ragen" else 300)
    return best[0], best[1], best[2]


def random_player_movement(rng: random.Random, room_state: np.ndarray, room_fixed: np.ndarray,
                           move_probability: float) -> None:
    """RAGEN's ``add_random_player_movement`` in place: 1-3 steps onto free cells never visited."""
    if rng.random() > move_probability:
        return
    player = np.argwhere(room_state == 5)[0]
    visited = [tuple(player)]
    for taken in range(1, 4):
        valid = [player + step for step in ((-1, 0), (1, 0), (0, -1), (0, 1))
                 if room_state[tuple(player + step)] in (1, 2) and tuple(player + step) not in visited]
        if not valid:
            return
        ahead = rng.choice(valid)
        room_state[tuple(player)], room_state[tuple(ahead)] = room_fixed[tuple(player)], 5
        player = ahead
        visited.append(tuple(player))
        if taken >= 3 or rng.random() > 0.5:
            return


def generate_room(seed: int, dim: tuple[int, int] = (6, 6), num_boxes: int = 1, search_depth: int = 300,
                  num_steps: int | None = None, p_change_directions: float = 0.35, tries: int = 4,
                  variant: str = "ragen") -> HostLevel | None:
    """One level from ``seed`` as the reference draws it, or None where the reference raises (then reseeds)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    rng, state = random.Random(seed), np.random.RandomState(seed % 2**32)
    num_steps = int(1.7 * sum(dim)) if num_steps is None else num_steps
    for _ in range(tries):
        floor = room_topology(rng, dim, p_change_directions, num_steps)
        placed = place_targets(state, floor, num_boxes)
        if placed is None:
            return None
        player, targets = placed
        score, player, boxes = reverse_play(floor, player, targets, search_depth, variant)
        if score > 0:
            break
    if score <= 0:
        return None
    fixed = floor.ravel().copy()
    fixed[targets] = 2
    room = fixed.copy()
    room[list(boxes)] = 4
    room[player] = 5
    room_fixed, room_state = fixed.reshape(dim), room.reshape(dim)
    if variant == "ragen":
        displacement = sum(abs(b // dim[1] - t // dim[1]) + abs(b % dim[1] - t % dim[1]) for b, t in zip(boxes, targets))
        random_player_movement(rng, room_state, room_fixed, 0.8 if displacement == 1 else 0.5)
    return HostLevel(room_fixed.astype(np.int8), room_state.astype(np.int8),
                     np.argwhere(room_state == 5)[0].astype(np.int32), int(score))


def host_level(seed: int, dim: tuple[int, int], num_boxes: int, search_depth: int) -> HostLevel:
    """RAGEN's level for ``seed``, reseeding as its ``SokobanEnv.reset`` does until a room is generated.

    RAGEN reseeds with ``abs(hash(str(seed))) % 2**32``, which depends on the process's hash salt;
    the next seed here is the seed's own ``random.Random`` draw, so a seed always gives one level.
    """
    while (level := generate_room(seed, dim, num_boxes, search_depth)) is None:
        seed = random.Random(seed).getrandbits(32)
    return level


def reverse_play_level(key, dim: tuple[int, int], num_boxes: int, search_depth: int):
    """``host_level`` seeded from a JAX key, as a host callback (jit- and vmap-friendly)."""
    shapes = HostLevel(jax.ShapeDtypeStruct(dim, jnp.int8), jax.ShapeDtypeStruct(dim, jnp.int8),
                       jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))

    def generate(seed):
        level = host_level(int(seed), dim, num_boxes, search_depth)
        return level._replace(score=np.int32(level.score))

    return jax.pure_callback(generate, shapes, jax.random.bits(key, (), jnp.uint32), vmap_method="sequential")
