"""RAGEN-2's Sudoku (``sudoku``, ragen2.md §7.4): puzzles generated and moves checked on device.

Generation differs from the reference on purpose: RAGEN fills the grid by backtracking under Python's
global ``random`` (``envs.reference_levels.reference_sudoku`` reproduces it exactly on the host); here a
complete grid is built from the pattern ``(r*b + r//b + c) % n + 1`` and randomised by the grid's
symmetries (bands, rows within bands, stacks, columns within stacks, digit relabelling, transposition),
then exactly ``int(n*n*f)`` cells are blanked (f = 0.4 / 0.5 / 0.6). Every grid is valid by construction
and the clue counts are exact; like the reference, uniqueness of the solution is not enforced.

Actions are free text (RAGEN's Sudoku has no ``action_lookup``): ``SudokuEnv`` parses them on the host with
the reference's six patterns, steps the jitted core with the move id and renders the ``with_feedback`` text.
Its ``device_env`` (``envs.sudoku_fused``) is the fused driver's twin: the patterns parsed and the text rendered
as tokens on device.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import check_positive_int, step_info
from envs.service import HostTextEnv

SUDOKU_INSTRUCTION = (
    "You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and 3x3 box contains the numbers "
    "1-9 without repetition.\nInitial cells are shown in [brackets] and cannot be modified. Empty cells are shown as "
    "dots (.).\nPlace numbers one at a time using the format: <answer>place 5 at row 2 col 3</answer> or "
    "<answer>2,3,5</answer>\nThe environment will provide feedback on valid/invalid moves and show conflicts if any "
    "occur.\n"
)
BLANK_FRACTION = {"easy": 0.4, "medium": 0.5, "hard": 0.6}
PATTERNS = tuple(re.compile(p) for p in (
    r"place\s+(\d+)\s+at\s+row\s+(\d+)\s+col\s+(\d+)", r"place\s+(\d+)\s+at\s+\((\d+),\s*(\d+)\)",
    r"place\s+(\d+)\s+at\s+(\d+),\s*(\d+)", r"(\d+)\s+at\s+(\d+),\s*(\d+)", r"\((\d+),\s*(\d+),\s*(\d+)\)",
    r"(\d+),\s*(\d+),\s*(\d+)"))
LEGEND = "Legend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty"
# Outcome codes of one move (``SudokuState.outcome``).
NONE, CORRECT, VALID, CANNOT_MODIFY, CONFLICT = range(5)


@struct.dataclass
class SudokuState:
    board: jax.Array  # (n, n) int32, 0 = empty
    initial: jax.Array  # (n, n) bool: clue cells
    solution: jax.Array  # (n, n) the complete grid the puzzle was blanked from
    num_steps: jax.Array
    outcome: jax.Array  # the last move's outcome code
    move: jax.Array  # (3,) the last move's (row, col, num), 0-based row and col
    conflicts_with: jax.Array  # (3,) bool: row, column, box of the last rejected move


@struct.dataclass
class SudokuParams:
    correct_placement_score: float = 1.0
    valid_placement_score: float = 0.5
    invalid_action_score: float = -0.1
    completion_bonus: float = 10.0
    max_steps: int = 81


def complete_grid(key: jax.Array, n: int) -> jax.Array:
    """A uniformly symmetry-randomised valid grid (pattern + band/stack/row/column/digit shuffles)."""
    b = math.isqrt(n)
    keys = jax.random.split(key, 6)

    def order(k_group, k_inner):
        groups = jax.random.permutation(k_group, b)
        inner = jax.vmap(lambda k: jax.random.permutation(k, b))(jax.random.split(k_inner, b))
        return (groups[:, None] * b + inner).ravel()

    rows, cols = order(keys[0], keys[1]), order(keys[2], keys[3])
    r, c = jnp.meshgrid(rows, cols, indexing="ij")
    pattern = (r * b + r // b + c) % n
    grid = jax.random.permutation(keys[4], n)[pattern] + 1
    return jnp.where(jax.random.bernoulli(keys[5]), grid.T, grid).astype(jnp.int32)


def cell_conflicts(board: jax.Array, row, col, num) -> jax.Array:
    """(3,) bool: whether ``num`` already stands in the row, column or box of (row, col), the cell excluded."""
    n = board.shape[0]
    b = math.isqrt(n)
    rr, cc = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    same = (board == num) & ~((rr == row) & (cc == col))
    box = (rr // b == row // b) & (cc // b == col // b)
    return jnp.stack([jnp.any(same & (rr == row)), jnp.any(same & (cc == col)), jnp.any(same & box)])


def conflict_mask(board: jax.Array) -> jax.Array:
    """(n, n) bool: filled cells whose value repeats in their row, column or box (counts per unit, O(n^3))."""
    n = board.shape[0]
    b = math.isqrt(n)
    onehot = (board[..., None] == jnp.arange(1, n + 1)).astype(jnp.int32)  # (row, col, value)
    rows, cols = onehot.sum(1), onehot.sum(0)
    boxes = onehot.reshape(b, b, b, b, n).sum((1, 3))  # (box row, box col, value)
    r, c = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    v = jnp.maximum(board - 1, 0)
    repeated = (rows[r, v] > 1) | (cols[c, v] > 1) | (boxes[r // b, c // b, v] > 1)
    return repeated & (board > 0)


def is_valid_grid(board: jax.Array) -> jax.Array:
    """Whether ``board`` is complete and every row, column and box holds 1..n once."""
    return jnp.all(board > 0) & ~jnp.any(conflict_mask(board))


class SudokuCore:
    """The jitted rules: gymnax-style ``reset_env`` / ``step_env`` on move ids ``(r*n + c)*n + num - 1``."""

    def __init__(self, grid_size: int = 9, difficulty: str = "easy", max_steps: int = 81):
        if grid_size not in (4, 9, 16):
            raise ValueError(f"grid_size must be 4, 9 or 16, got {grid_size!r}")
        if difficulty not in BLANK_FRACTION:
            raise ValueError(f"difficulty must be one of {tuple(BLANK_FRACTION)}, got {difficulty!r}")
        self.n, self.difficulty = grid_size, difficulty
        self.num_blanks = int(grid_size * grid_size * BLANK_FRACTION[difficulty])
        self.params = SudokuParams(max_steps=check_positive_int("max_steps", max_steps))

    @property
    def default_params(self) -> SudokuParams:
        return self.params

    @property
    def num_actions(self) -> int:
        return self.n ** 3

    def reset_env(self, key: jax.Array, params: SudokuParams):
        """``(board, state)`` of a fresh puzzle."""
        k_grid, k_blank = jax.random.split(key)
        solution = complete_grid(k_grid, self.n)
        blank = jnp.zeros(self.n * self.n, bool).at[jax.random.permutation(k_blank, self.n * self.n)[:self.num_blanks]]
        state = self.new_state(jnp.where(blank.set(True).reshape(self.n, self.n), 0, solution), solution)
        return state.board, state

    def new_state(self, puzzle: jax.Array, solution: jax.Array) -> SudokuState:
        """The state of a given puzzle (e.g. one of RAGEN's own, from ``reference_sudoku``)."""
        puzzle = jnp.asarray(puzzle, jnp.int32)
        zeros = jnp.zeros(3, jnp.int32)
        return SudokuState(puzzle, puzzle > 0, jnp.asarray(solution, jnp.int32), jnp.int32(0), jnp.int32(NONE), zeros,
                           zeros.astype(bool))

    def step_env(self, key: jax.Array, state: SudokuState, action, params: SudokuParams):
        """One placement; returns ``(board, state, reward, done, info)`` as gymnax does."""
        row, col, num = action // (self.n * self.n), (action // self.n) % self.n, action % self.n + 1
        steps = state.num_steps + 1
        fixed = state.initial[row, col]
        clash = cell_conflicts(state.board, row, col, num)
        placed = ~fixed & ~jnp.any(clash)
        board = jnp.where(placed, state.board.at[row, col].set(num), state.board)
        correct = num == state.solution[row, col]
        solved = placed & is_valid_grid(board)
        reward = jnp.where(placed, jnp.where(correct, params.correct_placement_score, params.valid_placement_score)
                           + jnp.where(solved, params.completion_bonus, 0.0), params.invalid_action_score)
        outcome = jnp.select([fixed, ~placed, correct], [CANNOT_MODIFY, CONFLICT, CORRECT], VALID)
        new = SudokuState(board, state.initial, state.solution, steps, outcome.astype(jnp.int32),
                          jnp.stack([row, col, num]).astype(jnp.int32), clash & ~fixed)
        done = placed & (solved | (steps >= params.max_steps))
        return board, new, reward.astype(jnp.float32), done, step_info(solved, placed, placed)

    def invalid_step(self, state: SudokuState) -> SudokuState:
        """A move that could not be parsed: only the step counter advances."""
        return state.replace(num_steps=state.num_steps + 1, outcome=jnp.int32(NONE))


def parse_move(action: str, n: int) -> tuple[int, int, int] | str:
    """``(row, col, num)`` (1-based row and col) by RAGEN's six patterns, or the error text."""
    text = action.lower().strip()
    for pattern in PATTERNS:
        match = pattern.search(text)
        if match:
            a, b, c = (int(g) for g in match.groups())
            num, row, col = (a, b, c) if ("place" in text or "at" in text) else (c, a, b)
            if not (1 <= row <= n and 1 <= col <= n and 1 <= num <= n):
                return out_of_range_text(n)
            return row, col, num
    return parse_error_text(action)


def out_of_range_text(n: int) -> str:
    return f"Values out of range: row and col must be in 1-{n}, number in 1-{n}"


def parse_error_text(action: str) -> str:
    return f"Could not parse action: '{action}'. Expected format: 'place 5 at row 2 col 3' or '2,3,5'"


def valid_numbers(board: np.ndarray, row: int, col: int) -> list[int]:
    n = board.shape[0]
    b = math.isqrt(n)
    box = board[row // b * b:row // b * b + b, col // b * b:col // b * b + b]
    used = set(board[row]) | set(board[:, col]) | set(box.ravel())
    return [v for v in range(1, n + 1) if v not in used]


def grid_text(board: np.ndarray, initial: np.ndarray, conflicts: np.ndarray) -> str:
    n = board.shape[0]
    b = math.isqrt(n)
    lines = []
    for r in range(n):
        if r and r % b == 0:
            lines.append("-" * (3 * n + b - 1))
        cells = []
        for c in range(n):
            v = int(board[r, c])
            cells.append(("| " if c and c % b == 0 else "")
                         + (" . " if v == 0 else f"[{v}]" if initial[r, c] else f"*{v}*" if conflicts[r, c] else f" {v} "))
        lines.append("".join(cells).rstrip())
    return "\n".join(lines)


def feedback_text(state, n: int, show_valid_numbers: bool) -> str:
    """``last_action_feedback`` of the last jitted move (empty before the first)."""
    outcome, (row, col, num) = int(state.outcome), (int(x) for x in state.move)
    where = f"({row + 1},{col + 1})"
    if outcome == CANNOT_MODIFY:
        return f"\u274c Cannot modify initial cell at {where}"
    if outcome == CONFLICT:
        b = math.isqrt(n)
        parts = [p for p, hit in zip((f"row {row + 1}", f"column {col + 1}", f"box ({row // b + 1},{col // b + 1})"),
                                     state.conflicts_with) if hit]
        text = f"\u274c Invalid placement: {num} conflicts with {', '.join(parts)}"
        if show_valid_numbers:
            text += f"\n   Valid numbers for {where}: {valid_numbers(np.asarray(state.board), row, col)}"
        return text
    text = {CORRECT: f"\u2713 Correct! Placed {num} at {where}",
            VALID: f"\u26a0 Placed {num} at {where} - Valid but not optimal"}.get(outcome, "")
    if text and bool(is_valid_grid(jnp.asarray(state.board))):
        text += "\n\U0001f389 Congratulations! Puzzle solved!"
    return text


def render_with_feedback(state, n: int, max_steps: int, feedback: str, show_conflicts: bool = True,
                         show_valid_numbers: bool = True) -> str:
    """RAGEN's ``with_feedback`` rendering of a (host) ``SudokuState``."""
    board, initial = np.asarray(state.board), np.asarray(state.initial)
    conflicts = np.asarray(conflict_mask(jnp.asarray(board))) if show_conflicts else np.zeros_like(initial)
    lines = ["=" * 50, "SUDOKU PUZZLE", "=" * 50, grid_text(board, initial, conflicts), "", LEGEND]
    if feedback:
        lines += ["", feedback]
    if conflicts.any():
        lines += ["", "\u26a0 CONFLICTS DETECTED:"]
        lines += [f"  - Cell ({r + 1},{c + 1}): {board[r, c]}" for r, c in np.argwhere(conflicts)]
    empty = np.argwhere(board == 0)
    if show_valid_numbers and 1 <= len(empty) <= 10:
        lines += ["", "\U0001f4a1 VALID NUMBERS FOR EMPTY CELLS:"]
        lines += [f"  - ({r + 1},{c + 1}): {valid_numbers(board, r, c)}" for r, c in empty if valid_numbers(board, r, c)]
    filled, given = int((board > 0).sum()), int(initial.sum())
    lines += ["", f"Progress: {filled}/{n * n} cells filled ({given} initial, {filled - given} placed)",
              f"Steps: {int(state.num_steps)}/{max_steps}"]
    return "\n".join(lines)


class SudokuEnv(HostTextEnv):
    """RAGEN's ``SudokuEnv`` for the host driver: text actions parsed here, moves checked by ``SudokuCore``.

    No ``action_names``: the state manager passes the action strings through, as RAGEN does without an
    ``action_lookup``. Only the ``with_feedback`` rendering of the RAGEN-2 tags is implemented.
    """

    tag = "SimpleSudoku"
    env_instruction = SUDOKU_INSTRUCTION
    max_actions_per_traj = 20
    max_tokens = 150

    def __init__(self, grid_size: int = 9, difficulty: str = "easy", render_format: str = "with_feedback",
                 show_conflicts: bool = True, show_valid_numbers: bool = True, max_steps: int = 81):
        if render_format != "with_feedback":
            raise ValueError(f"render_format={render_format!r} is not implemented: only 'with_feedback' "
                             "(the RAGEN-2 Sudoku tags' format)")
        self.core = SudokuCore(grid_size, difficulty, max_steps)
        self.show_conflicts, self.show_valid_numbers = bool(show_conflicts), bool(show_valid_numbers)
        self._reset, self._step = jax.jit(self.core.reset_env), jax.jit(self.core.step_env)
        self.state, self.feedback = None, ""

    def reset(self, seed: int) -> str:
        """A puzzle drawn from ``fold_in(key(seed), 0)``, as ``GymnaxHostEnv`` and the fused driver draw levels."""
        self.state = jax.device_get(self._reset(jax.random.fold_in(jax.random.key(seed), 0), self.core.params)[1])
        self.feedback = ""
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        move = parse_move(action, self.core.n)
        if isinstance(move, str):
            self.state = jax.device_get(self.core.invalid_step(self.state))
            self.feedback = f"\u274c Invalid action format: {move}"
            info = {"success": False, "action_is_valid": False, "action_is_effective": False}
            return self.render(), self.core.params.invalid_action_score, False, info
        row, col, num = move
        move_id = ((row - 1) * self.core.n + col - 1) * self.core.n + num - 1
        _, state, reward, done, info = jax.device_get(self._step(None, self.state, move_id, self.core.params))
        self.state = state
        self.feedback = feedback_text(state, self.core.n, self.show_valid_numbers)
        info = {k: bool(v) for k, v in info.items()}
        return self.render(), self.reward_value(float(reward)), bool(done), info

    def device_env(self):
        """The fused driver's on-device twin of this environment (``envs.sudoku_fused.SudokuDevice``)."""
        from envs.sudoku_fused import SudokuDevice
        return SudokuDevice(self)

    def reward_value(self, reward: float, params=None) -> float:
        """The configured Python double nearest to the float32 reward."""
        p = self.core.params
        values = (p.invalid_action_score, p.valid_placement_score, p.correct_placement_score,
                  p.valid_placement_score + p.completion_bonus, p.correct_placement_score + p.completion_bonus)
        return min(values, key=lambda v: abs(v - reward))

    def render(self) -> str:
        return render_with_feedback(self.state, self.core.n, self.core.params.max_steps, self.feedback,
                                    self.show_conflicts, self.show_valid_numbers)
