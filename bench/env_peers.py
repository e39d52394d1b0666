"""Plain single-environment Python/NumPy peers of RAGEN-2's 2048, 2x2 cube and Sudoku (stepped one at a time).

Each follows the reference class's rules line for line in the way RAGEN's own classes run them (NumPy arrays,
Python loops), starting from RAGEN's exact levels (``envs.reference_levels``). The tests check them against
the spec's seed-10000 texts and the jitted environments; ``bench_envs_v2.py`` times them.
"""

import math

import numpy as np

from envs.game_2048 import render_2048
from envs.reference_levels import reference_2048_grid, reference_spawn, reference_cube_stickers, reference_sudoku
from envs.rubiks_cube import PERMUTATIONS, render_cube
from envs.sudoku import parse_move


class Peer2048:
    """RAGEN's ``Game2048Env`` rules (``_compress_and_merge`` per line, spawn from ``default_rng``)."""

    def reset(self, seed: int) -> None:
        (self.grid, self.rng), self.score = reference_2048_grid(seed), 0

    def _move(self, grid, action):
        lines = [grid.T, grid[:, ::-1], grid[::-1, :].T, grid][action]
        total, out = 0, []
        for line in lines:
            values, merged, i = [int(v) for v in line if v], [], 0
            while i < len(values):
                if i + 1 < len(values) and values[i] == values[i + 1]:
                    merged.append(2 * values[i])
                    total += 2 * values[i]
                    i += 2
                else:
                    merged.append(values[i])
                    i += 1
            out.append(merged + [0] * (4 - len(merged)))
        out = np.array(out, np.int64)
        new = [out.T, out[:, ::-1], out.T[::-1, :], out][action]
        return new, total, not np.array_equal(new, grid)

    def valid_actions(self):
        return [a for a in range(4) if self._move(self.grid, a)[2]]

    def step(self, action: int):
        new, merge_sum, moved = self._move(self.grid, action)
        done, success = False, False
        if moved:
            self.grid = new
            reference_spawn(self.grid, self.rng)
            self.score += merge_sum
            done = not np.any(self.grid == 0) and not self.valid_actions()
            success = done and self.grid.max() >= 2048
        reward = math.log2(merge_sum + 1.0) * 0.1 if moved and merge_sum > 0 else 0.0
        info = {"success": success, "action_is_valid": moved, "action_is_effective": moved}
        return self.render(), reward, done, info

    def render(self) -> str:
        flags = [int(a in self.valid_actions()) for a in range(4)]
        return render_2048(np.concatenate([self.grid.ravel(), [self.score], flags]))


class PeerCube:
    """RAGEN's ``RubiksCube2x2Env``: the same permutations applied with NumPy fancy indexing."""

    def __init__(self, scramble_depth: int = 1, max_steps: int = 20):
        self.depth, self.max_steps = scramble_depth, max_steps

    def reset(self, seed: int) -> None:
        self.stickers, self.steps = reference_cube_stickers(seed, self.depth), 0

    def step(self, action: int):
        self.stickers = self.stickers[PERMUTATIONS[action]]
        self.steps += 1
        solved = all(len(set(self.stickers[4 * f:4 * f + 4])) == 1 for f in range(6))
        info = {"success": solved, "action_is_valid": True, "action_is_effective": True}
        return self.render(), float(solved), solved or self.steps >= self.max_steps, info

    def render(self) -> str:
        return render_cube(np.concatenate([self.stickers, [self.steps]]), self.max_steps)


class PeerSudoku:
    """RAGEN's ``SudokuEnv`` step: parse, initial-cell and row/column/box checks, rewards (no rendering)."""

    def reset(self, seed: int, grid_size: int = 9, difficulty: str = "easy") -> None:
        self.board, self.solution = reference_sudoku(seed, grid_size, difficulty)
        self.initial, self.n, self.steps = self.board > 0, grid_size, 0

    def step(self, action: str):
        self.steps += 1
        move = parse_move(action, self.n)
        if isinstance(move, str) or self.initial[move[0] - 1, move[1] - 1]:
            return -0.1, False
        row, col, num = move[0] - 1, move[1] - 1, move[2]
        b = math.isqrt(self.n)
        others = self.board.copy()
        others[row, col] = 0
        box = others[row // b * b:row // b * b + b, col // b * b:col // b * b + b]
        if num in others[row] or num in others[:, col] or num in box:
            return -0.1, False
        self.board[row, col] = num
        solved = bool(np.all(self.board > 0))
        reward = (1.0 if num == self.solution[row, col] else 0.5) + (10.0 if solved else 0.0)
        return reward, solved or self.steps >= 81
