"""On-device Sokoban level generation: gym-sokoban's design (topology walk, reverse playing) in JAX.

1. ``room_topology``: a random walk carves 3x3 floor masks; the border becomes wall.
2. The player and ``num_boxes`` targets go on distinct random floor cells; boxes start on targets.
3. ``reverse_play``: from the solved state the player walks and *pulls* boxes (RAGEN keeps only the
   pull moves). Every state reached is solvable by replaying the pulls as pushes. Each state scores
   ``box_swaps * sum(Manhattan displacement)`` (0 while a target is covered) and the best is kept.
   gym-sokoban explores with a depth-first search; here random walks of ``search_depth - 2`` moves
   (the DFS's deepest scored state), ``walk_budget`` moves in all and biased towards pulls, give a
   fixed compute bound.
4. Up to ``tries`` topologies are drawn until one scores above 0 (gym-sokoban tries 4 times, then
   RAGEN reseeds without bound).
   A level whose tries all fail falls back to a fixed solvable room, so the bound stays fixed.
5. RAGEN's ``add_random_player_movement``: the player takes 1-3 non-backtracking steps.

Cell codes follow gym-sokoban: 0 wall, 1 floor, 2 target, 3 box on target, 4 box, 5 player.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER = 0, 1, 2, 3, 4, 5

MOVES = jnp.array([(-1, 0), (1, 0), (0, -1), (0, 1)], jnp.int32)  # up, down, left, right (CHANGE_COORDINATES)
WALK_DIRECTIONS = jnp.array([(1, 0), (0, 1), (-1, 0), (0, -1)], jnp.int32)
FLOOR_MASKS = jnp.array(
    [
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    ],
    jnp.int32,
)


class GeneratorConfig(NamedTuple):
    """Static settings of the generator (they fix array shapes and loop lengths)."""

    dim_room: tuple[int, int] = (6, 6)
    num_boxes: int = 1
    search_depth: int = 300
    num_gen_steps: int | None = None  # gym-sokoban default: int(1.7 * (H + W))
    p_change_directions: float = 0.35
    walk_budget: int = 2048
    pull_weight: float = 3.0
    tries: int = 16

    @property
    def num_steps(self) -> int:
        return self.num_gen_steps or int(1.7 * sum(self.dim_room))

    @property
    def draws_per_try(self) -> int:
        """Uniform numbers one try consumes: topology walk, placement, pull-walks."""
        height, width = self.dim_room
        return 3 * (self.num_steps + 1) + height * width + self.num_walkers * self.walk_length

    @property
    def walk_length(self) -> int:
        return max(self.search_depth - 2, 1)

    @property
    def num_walkers(self) -> int:
        return max(self.walk_budget // self.walk_length, 1)


class Level(NamedTuple):
    """A generated level: ``room_fixed`` (0/1/2), ``room_state`` (0-5), the player and the score.

    ``score`` is gym-sokoban's room score of the kept state; 0 marks the fixed fallback room.
    """

    room_fixed: jax.Array
    room_state: jax.Array
    player: jax.Array
    score: jax.Array


class _Walk(NamedTuple):
    """One pull-walk; positions are flat cell indices ``row * width + col``."""

    player: jax.Array
    boxes: jax.Array  # (num_boxes,); box i started on target i
    last_pull: jax.Array  # index of the last pulled box, -1 before the first pull
    swaps: jax.Array
    best_score: jax.Array
    best_player: jax.Array
    best_boxes: jax.Array


def room_topology(draws: jax.Array, cfg: GeneratorConfig) -> jax.Array:
    """Boolean floor map carved by gym-sokoban's random walk of 3x3 masks.

    Args:
        draws: ``3 * (num_steps + 1)`` uniform numbers in ``[0, 1)``.
        cfg: generator settings.
    """
    height, width = cfg.dim_room
    start, steps = draws[:3], draws[3:].reshape(-1, 3)
    direction = WALK_DIRECTIONS[_pick(start[0], 4)]
    position = 1 + _pick(start[1:], jnp.array([height - 1, width - 1]))
    upper = jnp.array([height - 2, width - 2])

    def carve(carry, u):
        level, position, direction = carry
        direction = jnp.where(u[0] < cfg.p_change_directions, WALK_DIRECTIONS[_pick(u[1], 4)], direction)
        position = jnp.clip(position + direction, 1, upper)
        corner = position - 1
        patch = jax.lax.dynamic_slice(level, corner, (3, 3)) + FLOOR_MASKS[_pick(u[2], len(FLOOR_MASKS))]
        return (jax.lax.dynamic_update_slice(level, patch, corner), position, direction), None

    level = jnp.zeros((height, width), jnp.int32)
    (level, _, _), _ = jax.lax.scan(carve, (level, position, direction), steps)
    interior = jnp.zeros((height, width), bool).at[1:-1, 1:-1].set(True)
    return (level > 0) & interior


def _pick(u: jax.Array, n) -> jax.Array:
    """Uniform integer in ``[0, n)`` from a uniform draw ``u`` in ``[0, 1)``."""
    return jnp.minimum((u * n).astype(jnp.int32), jnp.asarray(n) - 1)


def _weighted_pick(u: jax.Array, weights: jax.Array) -> jax.Array:
    """Index drawn with probability proportional to ``weights`` (any index if all are 0)."""
    cumulative = jnp.cumsum(weights)
    return jnp.minimum(jnp.sum(cumulative <= u * cumulative[-1]), len(weights) - 1)


def _manhattan(a: jax.Array, b: jax.Array, width: int) -> jax.Array:
    return jnp.abs(a // width - b // width) + jnp.abs(a % width - b % width)


def reverse_play(draws: jax.Array, floor: jax.Array, player: jax.Array, targets: jax.Array, cfg: GeneratorConfig) -> _Walk:
    """Best state found by ``cfg.num_walkers`` random pull-walks from the solved state.

    Args:
        draws: ``num_walkers * walk_length`` uniform numbers.
        floor: flat boolean floor map.
        player: flat player cell.
        targets: flat target cells; the walk starts with box i on target i.
        cfg: generator settings.
    """
    width = cfg.dim_room[1]
    moves = jnp.array([-width, width, -1, 1])

    def pull_step(walk: _Walk, u) -> tuple[_Walk, None]:
        ahead, behind = walk.player + moves, walk.player - moves
        free = floor[ahead] & ~jnp.any(ahead[:, None] == walk.boxes, -1)
        pulls = behind[:, None] == walk.boxes  # (4, num_boxes)
        direction = _weighted_pick(u, free * jnp.where(pulls.any(-1), cfg.pull_weight, 1.0))
        moving = free.any()
        pull = moving & pulls[direction].any()
        box = jnp.argmax(pulls[direction])
        boxes = jnp.where(pull & (jnp.arange(cfg.num_boxes) == box), walk.player, walk.boxes)
        player = jnp.where(moving, ahead[direction], walk.player)
        swaps = walk.swaps + (pull & (box != walk.last_pull))
        covered = jnp.any(targets[:, None] == boxes) | jnp.any(targets == player)
        score = jnp.where(covered, 0, swaps * _manhattan(boxes, targets, width).sum())
        better = score > walk.best_score
        return _Walk(
            player, boxes, jnp.where(pull, box, walk.last_pull), swaps,
            jnp.where(better, score, walk.best_score),
            jnp.where(better, player, walk.best_player),
            jnp.where(better, boxes, walk.best_boxes),
        ), None

    def walk_once(walk_draws):
        start = _Walk(player, targets, jnp.int32(-1), jnp.int32(0), jnp.int32(0), player, targets)
        return jax.lax.scan(pull_step, start, walk_draws)[0]

    walks = jax.vmap(walk_once)(draws.reshape(cfg.num_walkers, cfg.walk_length))
    best = jnp.argmax(walks.best_score)
    return jax.tree.map(lambda x: x[best], walks)


def _random_player_movement(draws, floor, player, boxes, move_probability, width) -> jax.Array:
    """RAGEN's ``add_random_player_movement``: 1-3 random steps that never revisit a cell (7 draws)."""
    moves = jnp.array([-width, width, -1, 1])

    def step(carry, inputs):
        player, visited, active = carry
        u_direction, u_continue = inputs
        ahead = player + moves
        blocked = jnp.any(ahead[:, None] == jnp.concatenate([boxes, visited]), -1)
        free = floor[ahead] & ~blocked
        moving = active & free.any()
        player = jnp.where(moving, ahead[_weighted_pick(u_direction, free.astype(jnp.float32))], player)
        visited = jnp.concatenate([visited[1:], player[None]])
        return (player, visited, moving & (u_continue <= 0.5)), None

    active = draws[0] <= move_probability
    visited = jnp.full((3,), player)
    return jax.lax.scan(step, (player, visited, active), (draws[1:4], draws[4:7]))[0][0]


def _fallback_level(cfg: GeneratorConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A fixed solvable room: targets on the first interior row, boxes below, player underneath."""
    height, width = cfg.dim_room
    floor = jnp.zeros((height, width), bool).at[1:-1, 1:-1].set(True).ravel()
    targets = width + 1 + jnp.arange(cfg.num_boxes)
    return floor, targets, jnp.int32(3 * width + 1), targets + width


def _attempt(draws: jax.Array, cfg: GeneratorConfig):
    height, width = cfg.dim_room
    n_topology = 3 * (cfg.num_steps + 1)
    floor = room_topology(draws[:n_topology], cfg).ravel()
    placement = draws[n_topology:n_topology + height * width]
    chosen = jax.lax.top_k(jnp.where(floor, placement, -1.0), cfg.num_boxes + 1)[1]
    walk = reverse_play(draws[n_topology + height * width:], floor, chosen[0], chosen[1:], cfg)
    score = jnp.where(floor.sum() > cfg.num_boxes + 1, walk.best_score, 0)
    return floor, chosen[1:], walk.best_player, walk.best_boxes, score


def generate_level(key: jax.Array, cfg: GeneratorConfig) -> Level:
    """Generates one solvable level (jit- and vmap-friendly)."""
    keys = jax.random.split(key, cfg.tries + 1)

    def keep_trying(carry):
        return (carry[0] < cfg.tries) & (carry[-1] <= 0)

    def attempt(carry):
        t = carry[0]
        return (t + 1, *_attempt(jax.random.uniform(keys[t], (cfg.draws_per_try,)), cfg))

    fallback = _fallback_level(cfg)
    _, *found, score = jax.lax.while_loop(keep_trying, attempt, (jnp.int32(0), *fallback, jnp.int32(0)))
    floor, targets, player, boxes = jax.tree.map(lambda a, b: jnp.where(score > 0, b, a), fallback, tuple(found))
    width = cfg.dim_room[1]
    move_probability = jnp.where(_manhattan(boxes, targets, width).sum() == 1, 0.8, 0.5)
    movement_draws = jax.random.uniform(keys[cfg.tries], (7,))
    player = _random_player_movement(movement_draws, floor, player, boxes, move_probability, width)
    return assemble_level(floor.reshape(cfg.dim_room), targets, boxes, player, score)


def assemble_level(floor, targets, boxes, player, score=jnp.int32(0)) -> Level:
    """Builds gym-sokoban's ``room_fixed``/``room_state`` grids from flat cell positions."""
    shape = floor.shape
    room_fixed = floor.astype(jnp.int8).ravel().at[targets].set(TARGET)
    room_state = room_fixed.at[boxes].set(jnp.where(room_fixed[boxes] == TARGET, BOX_ON_TARGET, BOX).astype(jnp.int8))
    room_state = room_state.at[player].set(PLAYER)
    position = jnp.stack([player // shape[1], player % shape[1]]).astype(jnp.int32)
    return Level(room_fixed.reshape(shape), room_state.reshape(shape), position, jnp.asarray(score, jnp.int32))
