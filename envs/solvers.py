"""Host-side solvers for demonstrations and tests: BFS for Sokoban; for FrozenLake the turn plan that
maximises the chance of reaching the goal within the remaining turns."""

import itertools
from collections import deque

import numpy as np

from envs.frozen_lake import GOAL, HOLE
from envs.sokoban_generation import BOX, BOX_ON_TARGET, PLAYER, TARGET, WALL

SOKOBAN_MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # Up, Down, Left, Right
FROZEN_LAKE_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # Left, Down, Right, Up


def solve_sokoban(room_fixed, room_state, max_depth: int | None = None) -> list[int] | None:
    """Shortest action sequence (0 Up, 1 Down, 2 Left, 3 Right) that puts every box on a target.

    Breadth-first search over (player, boxes) with gym-sokoban's push rules. Returns None when no
    solution exists within ``max_depth`` actions (unbounded by default).
    """
    fixed, state = np.asarray(room_fixed), np.asarray(room_state)
    walls = fixed == WALL
    targets = frozenset(zip(*np.nonzero(fixed == TARGET)))
    boxes = frozenset(zip(*np.nonzero((state == BOX) | (state == BOX_ON_TARGET))))
    player = tuple(int(i) for i in np.argwhere(state == PLAYER)[0])
    height, width = walls.shape

    def blocked(cell, boxes):
        row, col = cell
        return not (0 <= row < height and 0 <= col < width) or walls[cell] or cell in boxes

    start = (player, boxes)
    parents = {start: None}
    queue = deque([(start, 0)])
    while queue:
        (player, boxes), depth = queue.popleft()
        if boxes <= targets:
            return _unwind(parents, (player, boxes))
        if max_depth is not None and depth >= max_depth:
            continue
        for action, (dr, dc) in enumerate(SOKOBAN_MOVES):
            ahead = (player[0] + dr, player[1] + dc)
            if ahead in boxes:
                beyond = (ahead[0] + dr, ahead[1] + dc)
                if blocked(beyond, boxes):
                    continue
                nxt = (ahead, (boxes - {ahead}) | {beyond})
            elif blocked(ahead, boxes):
                continue
            else:
                nxt = (ahead, boxes)
            if nxt not in parents:
                parents[nxt] = ((player, boxes), action)
                queue.append((nxt, depth + 1))
    return None


def _unwind(parents, node) -> list[int]:
    actions = []
    while parents[node] is not None:
        node, action = parents[node]
        actions.append(action)
    return actions[::-1]


def frozen_lake_transitions(desc, position: int, action: int, is_slippery: bool = True) -> dict[int, float]:
    """gymnasium's ``P[s][a]`` as ``{next position: probability}`` (terminal tiles stay put)."""
    desc = np.asarray(desc)
    size = desc.shape[0]
    if desc.ravel()[position] in (HOLE, GOAL):
        return {position: 1.0}
    row, col = divmod(position, size)
    outcomes = {}
    for direction in ((action - 1) % 4, action, (action + 1) % 4) if is_slippery else (action,):
        dr, dc = FROZEN_LAKE_MOVES[direction]
        nxt = min(max(row + dr, 0), size - 1) * size + min(max(col + dc, 0), size - 1)
        outcomes[nxt] = outcomes.get(nxt, 0.0) + (1 / 3 if is_slippery else 1.0)
    return outcomes


def frozen_lake_matrices(desc, is_slippery: bool = True) -> np.ndarray:
    """``P[a, cell, next]``: gymnasium's transitions as four row-stochastic matrices (terminal tiles absorb)."""
    cells = np.asarray(desc).size
    matrices = np.zeros((4, cells, cells))
    for action in range(4):
        for cell in range(cells):
            for nxt, prob in frozen_lake_transitions(desc, cell, action, is_slippery).items():
                matrices[action, cell, nxt] = prob
    return matrices


def plan_frozen_lake(desc, position: int, turns: int, actions_per_turn: int,
                     is_slippery: bool = True) -> tuple[list[int], float]:
    """The turn of ``actions_per_turn`` actions that maximises P(goal within ``turns`` turns), and that probability.

    RAGEN's agent commits to a whole turn's actions before it sees the next state, so this is
    finite-horizon dynamic programming over turns whose choices are open-loop action sequences:
    ``V_t = max_seq P_seq V_{t-1}``, ``V_0 = [cell is the goal]``. Re-planned each turn it is
    the best policy of that form; ties go to the first sequence in lexicographic action order.
    """
    if turns < 1 or actions_per_turn < 1:
        raise ValueError(f"turns and actions_per_turn must be >= 1, got {turns} and {actions_per_turn}")
    matrices = frozen_lake_matrices(desc, is_slippery)
    sequences = list(itertools.product(range(4), repeat=actions_per_turn))
    moves = np.stack([np.linalg.multi_dot([np.eye(len(matrices[0])), *matrices[list(seq)]]) for seq in sequences])
    value = (np.asarray(desc).ravel() == GOAL).astype(float)
    for _ in range(turns - 1):
        value = (moves @ value).max(axis=0)
    first = moves[:, int(position)] @ value
    best = int(np.argmax(first))
    return list(sequences[best]), float(first[best])
