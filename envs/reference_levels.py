"""RAGEN's own level generators on the host, level for level (NumPy / Python RNGs as the reference seeds them).

The jitted environments draw levels from the same distributions with JAX keys (2048 spawns, cube scrambles)
or from a documented different one (Sudoku, see ``envs.sudoku``); evaluation sets that must be RAGEN's exact
levels come from these functions and enter the jitted environments through their state constructors.
"""

import math
import random

import numpy as np

from envs.rubiks_cube import PERMUTATIONS, SOLVED
from envs.sudoku import BLANK_FRACTION


def reference_spawn(grid: np.ndarray, rng: np.random.Generator, two_prob: float = 0.9) -> None:
    """``Game2048Env._spawn_tile``: an empty cell by ``integers(0, n_empty)``, a 2 if ``random() < two_prob``."""
    empties = list(zip(*np.where(grid == 0)))
    if empties:
        r, c = empties[rng.integers(0, len(empties))]
        grid[r, c] = 2 if rng.random() < two_prob else 4


def reference_2048_grid(seed: int, two_prob: float = 0.9) -> tuple[np.ndarray, np.random.Generator]:
    """``Game2048Env.reset(seed)``'s grid (two spawns from ``default_rng(seed)``) and the generator it goes on with."""
    rng = np.random.default_rng(seed)
    grid = np.zeros((4, 4), np.int64)
    reference_spawn(grid, rng, two_prob)
    reference_spawn(grid, rng, two_prob)
    return grid, rng


def reference_cube_stickers(seed: int, scramble_depth: int) -> np.ndarray:
    """``RubiksCube2x2Env.reset(seed)``'s stickers: reference move ids ``integers(1, 13)`` from ``default_rng``."""
    rng = np.random.default_rng(seed)
    stickers = SOLVED.copy()
    for _ in range(scramble_depth):
        stickers = stickers[PERMUTATIONS[int(rng.integers(1, 13)) - 1]]
    return stickers


def reference_sudoku(seed: int, grid_size: int = 9, difficulty: str = "easy") -> tuple[np.ndarray, np.ndarray]:
    """``(puzzle, solution)`` of ``SudokuEnv.reset(seed)``: backtracking fill, then ``int(n*n*f)`` blanks.

    Seeds Python's and NumPy's global RNGs as the reference does (and leaves them seeded, as it does).
    """
    random.seed(seed)
    np.random.seed(seed)
    n, b = grid_size, math.isqrt(grid_size)
    grid = np.zeros((n, n), np.int64)

    def fits(r, c, v):
        box = grid[r // b * b:r // b * b + b, c // b * b:c // b * b + b]
        return v not in grid[r] and v not in grid[:, c] and v not in box

    def fill():
        empty = np.argwhere(grid == 0)
        if len(empty) == 0:
            return True
        r, c = empty[0]
        numbers = list(range(1, n + 1))
        random.shuffle(numbers)
        for v in numbers:
            if fits(r, c, v):
                grid[r, c] = v
                if fill():
                    return True
                grid[r, c] = 0
        return False

    fill()
    solution = grid.copy()
    cells = [(r, c) for r in range(n) for c in range(n)]
    random.shuffle(cells)
    for r, c in cells[:int(n * n * BLANK_FRACTION[difficulty])]:
        grid[r, c] = 0
    return grid, solution
