"""Sudoku on the fused driver (ragen2.md §7.4): free-text moves parsed, and the ``with_feedback`` text rendered as
token ids, on device.

Moves are free text, so there is no finite action vocabulary. ``SudokuParser`` decodes the answer through the
token-to-bytes table (``envs.tokens.answer_bytes``), splits RAGEN's ``||`` pieces and matches each against the
reference's six ``re.search`` patterns in array code. Every ``(\\d+)`` group spans a whole digit run (each one is
followed by a non-digit or ends the pattern), so a match is found by scanning from every start at once. A piece
becomes an action code: a move id ``(r*n + c)*n + num - 1``, ``n³`` for values out of range or ``n³ + 1`` when
no pattern matches. Each piece is passed through as one action, as on the host. ``\\d`` is Python's: any Unicode
decimal digit (Arabic-Indic, full-width, …), with its value, as ``int()`` reads it.

``SudokuRenderer`` renders the state as token slots (``envs.text_pieces``): the grid in box-wide chunks of
``(2n+1)^√n`` variants each (so 16x16 is host-only), the feedback, valid-number lines and progress counters. A
board never holds a conflict (a move that would make one is refused), so ``*N*`` cells and the conflict list
never show. The one free text, the unparseable action echoed in ``Could not parse action: '{action}'``, goes
through the tokenizer on the host (``jax.pure_callback``, each turn): BPE of arbitrary text is not a table
lookup. Its bytes (``ECHO_BYTES``) and tokens (``ECHO_TOKENS``) are bounded; a longer echo stops the run.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnvironment
from envs.sudoku import (CANNOT_MODIFY, CONFLICT, CORRECT, LEGEND, VALID, SudokuState, feedback_text,
                         is_valid_grid, out_of_range_text, parse_error_text, render_with_feedback)
from envs.text_pieces import check_state_tokens, piece_tables
from envs.tokens import (ParsedActions, ResponseParser, _occurrences, _spread, _whitespace, answer_bytes,
                         concat_rows, piece_spans, token_byte_table)

ECHO_BYTES, ECHO_TOKENS = 1024, 256
PARSE_ERROR, OUT_OF_RANGE = 5, 6  # outcome codes after SudokuState's
CAP = 1000  # digit-run values saturate here (any value >= CAP is out of range)
# ``\d`` of Python's ``re`` (Unicode category Nd: ASCII, Arabic-Indic, full-width… digits) and each one's value.
DECIMAL_DIGITS = tuple((chr(c).encode(), int(chr(c))) for c in range(0x110000)
                       if not 0xD800 <= c <= 0xDFFF and chr(c).isdecimal())
NUM, WS, WS_OPT = "num", "ws+", "ws*"
PATTERNS = (  # the six patterns of ``envs.sudoku.PATTERNS`` as element sequences
    (b"place", WS, NUM, WS, b"at", WS, b"row", WS, NUM, WS, b"col", WS, NUM),
    (b"place", WS, NUM, WS, b"at", WS, b"(", NUM, b",", WS_OPT, NUM, b")"),
    (b"place", WS, NUM, WS, b"at", WS, NUM, b",", WS_OPT, NUM),
    (NUM, WS, b"at", WS, NUM, b",", WS_OPT, NUM),
    (b"(", NUM, b",", WS_OPT, NUM, b",", WS_OPT, NUM, b")"),
    (NUM, b",", WS_OPT, NUM, b",", WS_OPT, NUM),
)


@struct.dataclass
class SudokuTurnState:
    core: SudokuState
    echo: jax.Array  # (ECHO_BYTES,) uint8: the last piece of this turn's answer (original case)
    echo_length: jax.Array  # its length in bytes (may exceed ECHO_BYTES)


class SudokuParser(NamedTuple):
    """The fused driver's parser for Sudoku (``parse``): action codes and the echo of the last piece to run."""

    base: ResponseParser
    n: int

    def parse(self, ids: jax.Array, length: jax.Array, actions_left) -> ParsedActions:
        answer, size, matched = answer_bytes(self.base, ids, length)
        spans = piece_spans(answer, size, self.base.max_actions)
        lowered = jnp.where((answer >= ord("A")) & (answer <= ord("Z")), answer + 32, answer).astype(jnp.uint8)
        codes = _piece_codes(lowered, size, spans, self.n)
        to_run = jnp.minimum(spans.num_parsed, jnp.maximum(actions_left, 0))
        action_ids = jnp.where(jnp.arange(self.base.max_actions) < to_run, codes, -1)
        last = jnp.maximum(to_run - 1, 0)
        lo, hi = spans.lo[last], spans.hi[last]
        where = lo + jnp.arange(ECHO_BYTES)
        echo = jnp.where(where < hi, answer[jnp.minimum(where, answer.shape[0] - 1)], 0).astype(jnp.uint8)
        return ParsedActions(action_ids.astype(jnp.int32), spans.num_parsed, spans.num_parsed, spans.num_parsed == 0,
                             matched, (echo, hi - lo))


def _decimal_digits(buf: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Python's ``\\d`` over UTF-8 bytes: first bytes of decimal digits, all their bytes, and their values."""
    size = buf.shape[0]
    padded = jnp.concatenate([buf, jnp.zeros(3, buf.dtype)]).astype(jnp.uint32)
    lead, covered, value = jnp.zeros(size, bool), jnp.zeros(size, bool), jnp.zeros(size, jnp.int32)
    for width in (1, 2, 3, 4):
        table = np.array(sorted((int.from_bytes(c, "big"), v) for c, v in DECIMAL_DIGITS if len(c) == width), np.uint32)
        if not len(table):
            continue
        window = sum(padded[k:k + size] << (8 * (width - 1 - k)) for k in range(width))
        row = jnp.minimum(jnp.searchsorted(jnp.asarray(table[:, 0]), window), len(table) - 1)
        hit = (jnp.asarray(table[:, 0])[row] == window) & (jnp.arange(size) + width <= n)
        lead, covered = lead | hit, covered | _spread(hit, width)
        value = jnp.where(hit, jnp.asarray(table[:, 1].astype(np.int32))[row], value)
    return lead, covered, value


def _piece_codes(text: jax.Array, size: jax.Array, spans, n: int) -> jax.Array:
    """The action code of every piece ``text[lo:hi]`` (lower-cased answer bytes)."""
    length = text.shape[0]
    positions = jnp.arange(length)
    clip = lambda i: jnp.minimum(i, length - 1)
    digit, covered, digit_value = _decimal_digits(text, size)
    space = _whitespace(text, size)
    space_end = jax.lax.cummin(jnp.where(space, length, positions), reverse=True)
    run_end = jax.lax.cummin(jnp.where(covered, length, positions), reverse=True)

    def value_step(carry, x):  # the value of the digit run starting here, saturated at CAP
        value, power = carry
        lead, inside, d = x
        new = (jnp.where(lead, jnp.minimum(d * power + value, CAP), jnp.where(inside, value, 0)),
               jnp.where(lead, jnp.minimum(power * 10, CAP), jnp.where(inside, power, 1)))
        return new, new[0]

    values = jax.lax.scan(value_step, (jnp.int32(0), jnp.int32(1)), (digit, covered, digit_value), reverse=True)[1]

    def code(lo, hi):
        found, groups = jnp.bool_(False), jnp.zeros(3, jnp.int32)
        for pattern in PATTERNS:
            pos, ok, got = positions, (positions >= lo) & (positions < hi), []
            for element in pattern:
                if element == NUM:
                    ok &= digit[clip(pos)] & (pos < hi)  # a digit's first byte
                    got.append(values[clip(pos)])
                    pos = run_end[clip(pos)]
                elif element in (WS, WS_OPT):
                    after = jnp.where(pos < hi, space_end[clip(pos)], pos)
                    ok &= (after > pos) if element == WS else True
                    pos = after
                else:
                    ok &= _occurrences(text, hi, element)[clip(pos)] & (pos + len(element) <= hi)
                    pos = pos + len(element)
            start = jnp.argmax(ok)
            hit = ok.any() & ~found
            groups = jnp.where(hit, jnp.stack(got)[:, start], groups)
            found = found | ok.any()
        named = jnp.any((_occurrences(text, hi, b"place") | _occurrences(text, hi, b"at")) & (positions >= lo))
        num, row, col = jnp.where(named, groups, groups[jnp.array([2, 0, 1])])
        in_range = (jnp.minimum(jnp.minimum(num, row), col) >= 1) & (jnp.maximum(jnp.maximum(num, row), col) <= n)
        move = ((row - 1) * n + col - 1) * n + num - 1
        return jnp.where(found, jnp.where(in_range, move, n ** 3), n ** 3 + 1)

    return jax.vmap(code)(spans.lo, spans.hi)


def _join(pieces) -> tuple[jax.Array, jax.Array]:
    """1-D token pieces ``(ids, length)`` laid end to end."""
    total = sum(ids.shape[0] for ids, _ in pieces)
    out, at = jnp.zeros(total + 1, jnp.int32), jnp.int32(0)
    for ids, count in pieces:
        k = jnp.arange(ids.shape[0])
        out = out.at[jnp.where(k < count, at + k, total)].set(ids)
        at = at + count
    return out[:total], at


class SudokuRenderer(NamedTuple):
    """Slot tables in groups (each group as wide as its widest variant) and the feedback echo's host encoder."""

    groups: tuple  # envs.text_pieces.PieceRenderer per group of consecutive slots (their ``index_of`` unused)
    sizes: tuple[int, ...]  # slots per group
    index_of: Callable  # observation -> the variant index of every slot
    echo_at: int  # the group the echo precedes
    echo: Callable  # (bytes, length, shown) -> (ids[ECHO_TOKENS], length)
    n: int

    def tokens(self, obs: jax.Array, actions_left=None) -> tuple[jax.Array, jax.Array]:
        at = 2 * self.n ** 2
        index, pieces, start = self.index_of(obs), [], 0
        for g, (table, size) in enumerate(zip(self.groups, self.sizes)):
            if g == self.echo_at:
                pieces.append(self.echo(obs[at + 9:].astype(jnp.uint8), obs[at + 8], obs[at] == PARSE_ERROR))
            rows = table.offsets + index[start:start + size]
            pieces.append(concat_rows(table.ids[rows], table.lengths[rows]))
            start += size
        return _join(pieces)


def echo_text(action: str) -> str:
    """The feedback piece of an unparseable action (with the blank line that follows it)."""
    return f"\u274c Invalid action format: {parse_error_text(action)}\n\n"


def _echo_encoder(tokenizer, tag: str) -> Callable:
    def host(echo, length, shown):
        shape = np.shape(shown)
        echo, length, shown = (np.asarray(echo).reshape(-1, ECHO_BYTES), np.asarray(length).ravel(),
                               np.broadcast_to(shown, shape).ravel())
        ids, counts = np.zeros((len(shown), ECHO_TOKENS), np.int32), np.zeros(len(shown), np.int32)
        for i in np.flatnonzero(shown):
            if length[i] > ECHO_BYTES:
                raise ValueError(f"{tag}: an unparseable action of {length[i]} bytes is echoed in the next state; "
                                 f"the fused driver echoes at most {ECHO_BYTES}: use agent_proxy.rollout_driver=host")
            text = echo_text(bytes(echo[i, :length[i]]).decode("utf-8", "replace"))
            got = tokenizer.encode(text, add_special_tokens=False)
            if len(got) > ECHO_TOKENS:
                raise ValueError(f"{tag}: an echoed action needs {len(got)} tokens, the fused driver allows "
                                 f"{ECHO_TOKENS}: use agent_proxy.rollout_driver=host")
            ids[i, :len(got)], counts[i] = got, len(got)
        return ids.reshape(shape + (ECHO_TOKENS,)), counts.reshape(shape)

    result = (jax.ShapeDtypeStruct((ECHO_TOKENS,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    return lambda echo, length, shown: jax.pure_callback(host, result, echo, length, shown,
                                                         vmap_method="broadcast_all")


def _numbers(mask: int, n: int) -> str:
    return str([v for v in range(1, n + 1) if mask >> (v - 1) & 1])


class SudokuDevice(TextEnvironment):
    """``SudokuEnv``'s twin for the fused driver: actions are ``SudokuParser`` codes, the state holds the echo."""

    def __init__(self, host):
        self.core, self.n, self.show_valid_numbers = host.core, host.core.n, host.show_valid_numbers
        self.show_conflicts, self.host = host.show_conflicts, host
        for name in ("tag", "env_instruction", "grid_vocab", "prompt_lists_actions", "max_actions_per_traj",
                     "max_tokens"):
            setattr(self, name, getattr(host, name))

    @property
    def default_params(self):
        return self.core.params

    @property
    def num_actions(self) -> int:
        return self.n ** 3 + 2

    def reset_env(self, key, params):
        _, core = self.core.reset_env(key, params)
        state = SudokuTurnState(core, jnp.zeros(ECHO_BYTES, jnp.uint8), jnp.int32(0))
        return self.get_obs(state), state

    def begin_turn(self, state: SudokuTurnState, context) -> SudokuTurnState:
        """Keeps the echo of this turn's last piece (``SudokuParser``'s context)."""
        echo, length = context
        return state.replace(echo=echo, echo_length=length.astype(jnp.int32))

    def step_env(self, key, state: SudokuTurnState, action, params):
        moves = self.n ** 3
        _, moved, reward, done, info = self.core.step_env(key, state.core, jnp.minimum(action, moves - 1), params)
        bad = action >= moves
        outcome = jnp.where(action == moves, OUT_OF_RANGE, PARSE_ERROR).astype(jnp.int32)
        failed = self.core.invalid_step(state.core).replace(outcome=outcome)
        new = state.replace(core=jax.tree.map(lambda a, b: jnp.where(bad, a, b), failed, moved))
        reward = jnp.where(bad, jnp.float32(params.invalid_action_score), reward)
        return self.get_obs(new), new, reward, done & ~bad, {k: v & ~bad for k, v in info.items()}

    def get_obs(self, state: SudokuTurnState, params=None, key=None) -> jax.Array:
        """Board, clue mask, ``[outcome, row, col, num, 3 conflict flags, steps, echo length]``, echo bytes."""
        c = state.core
        head = jnp.concatenate([c.outcome[None], c.move, c.conflicts_with, c.num_steps[None],
                                state.echo_length[None]]).astype(jnp.int32)
        return jnp.concatenate([c.board.ravel(), c.initial.ravel().astype(jnp.int32), head,
                                state.echo.astype(jnp.int32)])

    def render_text(self, state) -> str:
        return self.text_of_obs(np.asarray(jax.device_get(self.observe(state))))

    def text_of_obs(self, obs: np.ndarray) -> str:
        """``SudokuEnv.render()`` of the state ``obs`` packs."""
        n, nn = self.n, self.n ** 2
        outcome, r, c, num, *flags, steps, length = (int(x) for x in obs[2 * nn:2 * nn + 9])
        board = obs[:nn].reshape(n, n)
        state = SudokuState(board, obs[nn:2 * nn].reshape(n, n) > 0, board, steps, outcome, np.array([r, c, num]),
                            np.array(flags, bool))
        if outcome == PARSE_ERROR:
            feedback = echo_text(bytes(obs[2 * nn + 9:][:length].astype(np.uint8)).decode("utf-8", "replace"))[:-2]
        elif outcome == OUT_OF_RANGE:
            feedback = f"\u274c Invalid action format: {out_of_range_text(n)}"
        else:
            feedback = feedback_text(state, n, self.show_valid_numbers)
        return render_with_feedback(state, n, self.core.params.max_steps, feedback, self.show_conflicts,
                                    self.show_valid_numbers)

    def step_reward_values(self, params) -> tuple[float, ...]:
        p = params
        return (p.invalid_action_score, p.valid_placement_score, p.correct_placement_score,
                p.valid_placement_score + p.completion_bonus, p.correct_placement_score + p.completion_bonus)

    def reward_value(self, reward: float, params=None) -> float:
        return self.host.reward_value(reward)

    def response_parser(self, tokenizer, enable_think: bool, max_actions: int) -> SudokuParser:
        table, lengths = token_byte_table(tokenizer)
        base = ResponseParser(jnp.asarray(table), jnp.asarray(lengths), jnp.zeros((1, 1), jnp.uint8),
                              jnp.zeros(1, jnp.int32), enable_think, max_actions)
        return SudokuParser(base, self.n)

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int, num_checks: int = 48) -> SudokuRenderer:
        """Token slots of the ``with_feedback`` text, checked against the tokenizer on sample states."""
        n, nn = self.n, self.n ** 2
        b = math.isqrt(n)
        base = 2 * n + 1
        if base ** b > 1 << 16:
            raise ValueError(f"{self.tag}: grid_size={n} has no on-device renderer ({base}**{b} variants per box "
                             "chunk): use agent_proxy.rollout_driver=host")
        cells = [" . "] + [f"[{v}]" for v in range(1, n + 1)] + [f" {v} " for v in range(1, n + 1)]
        combos = ["".join(cells[k] for k in reversed(combo)) for combo in np.ndindex(*(base,) * b)]
        separator = "-" * (3 * n + b - 1)
        first, middle = [t + "|" for t in combos], [" " + t + "|" for t in combos]
        ends = {end: [(" " + t).rstrip() + end for t in combos] for end in ("\n", f"\n{separator}\n", "\n\n")}
        rows = []
        for r in range(n):
            end = "\n\n" if r == n - 1 else f"\n{separator}\n" if (r + 1) % b == 0 else "\n"
            rows += [first] + [middle] * (b - 2) + [ends[end]]
        where = [(r, c) for r in range(n) for c in range(n)]
        done = "\n\U0001f389 Congratulations! Puzzle solved!"
        feedback = [""] + [f"\u274c Cannot modify initial cell at ({r + 1},{c + 1})\n\n" for r, c in where]
        feedback += [f"\u2713 Correct! Placed {v} at ({r + 1},{c + 1}){done * s}\n\n"
                     for r, c in where for v in range(1, n + 1) for s in (0, 1)]
        feedback += [f"\u26a0 Placed {v} at ({r + 1},{c + 1}) - Valid but not optimal{done * s}\n\n"
                     for r, c in where for v in range(1, n + 1) for s in (0, 1)]
        feedback += [f"\u274c Invalid action format: {out_of_range_text(n)}\n\n"]
        units = lambda r, c, f: ", ".join(u for u, bit in zip(
            (f"row {r + 1}", f"column {c + 1}", f"box ({r // b + 1},{c // b + 1})"), (1, 2, 4)) if f & bit)
        shown = self.show_valid_numbers
        feedback += [f"\u274c Invalid placement: {v} conflicts with {units(r, c, f)}"
                     + (f"\n   Valid numbers for ({r + 1},{c + 1}):" if shown else "\n\n")
                     for r, c in where for v in range(1, n + 1) for f in range(1, 8)]
        lists = [""] + [f" {_numbers(m, n)}\n\n" for m in range(1 << n)]
        head_slots = [["=" * 50 + "\nSUDOKU PUZZLE\n" + "=" * 50 + "\n"], *rows, [LEGEND + "\n\n"], feedback, lists]
        header = "\U0001f4a1 VALID NUMBERS FOR EMPTY CELLS:\n"
        line_cells = [""] + [f"  - ({r + 1},{c + 1}):" for r, c in where]
        line_lists = [""] + [f" {_numbers(m, n)}\n" + "\n" * last for m in range(1, 1 << n) for last in (0, 1)]
        budget = max_actions_per_traj
        tail_slots = [["", header, header + "\n"], *[line_cells, line_lists] * 10,
                      [f"Progress: {f}/{nn} cells filled (" for f in range(nn + 1)],
                      [f"{g} initial, {p} placed)\nSteps:" for g in range(nn + 1) for p in range(nn + 1)],
                      [f" {s}/{self.core.params.max_steps}\n" for s in range(budget + 1)]]
        offsets = np.cumsum([1, nn, 2 * n ** 3, 2 * n ** 3, 1])

        def unpack(obs):
            board = obs[:nn].reshape(n, n)
            outcome, r, c, num, cr, cc, cb, steps = (obs[2 * nn + k] for k in range(8))
            onehot = board[..., None] == jnp.arange(1, n + 1)
            used = (onehot.any(1)[:, None] | onehot.any(0)[None]
                    | jnp.repeat(jnp.repeat(onehot.reshape(b, b, b, b, n).any((1, 3)), b, 0), b, 1))
            masks = jnp.sum(~used * (1 << jnp.arange(n)), axis=-1)  # valid numbers of every cell, as bits
            return board, obs[nn:2 * nn].reshape(n, n) > 0, outcome, r, c, num, cr + 2 * cc + 4 * cb, steps, masks

        def head_index(obs):
            board, initial, outcome, r, c, num, flags, _, masks = unpack(obs)
            code = jnp.where(board == 0, 0, jnp.where(initial, board, n + board))
            chunks = jnp.sum(code.reshape(n, b, b) * base ** jnp.arange(b), axis=-1).ravel()
            move = (r * n + c) * n + num - 1
            solved = is_valid_grid(board).astype(jnp.int32)
            index = jnp.select([outcome == CANNOT_MODIFY, outcome == CORRECT, outcome == VALID,
                                outcome == OUT_OF_RANGE, outcome == CONFLICT],
                               [offsets[0] + r * n + c, offsets[1] + 2 * move + solved,
                                offsets[2] + 2 * move + solved, offsets[3], offsets[4] + 7 * move + flags - 1], 0)
            valid_list = jnp.where((outcome == CONFLICT) & shown, 1 + masks[r, c], 0)
            return jnp.concatenate([jnp.zeros(1, jnp.int32), chunks, jnp.stack([0, index, valid_list])])

        def tail_index(obs):
            board, initial, _, _, _, _, _, steps, masks = unpack(obs)
            empty = (board == 0).sum()
            show = shown & (empty >= 1) & (empty <= 10)
            listed = ((board == 0) & (masks > 0)).ravel()
            count, rank = listed.sum(), jnp.cumsum(listed) - 1
            lines = []
            for k in range(10):
                cell = jnp.argmax(listed & (rank == k))
                present = show & (k < count)
                lines += [jnp.where(present, 1 + cell, 0),
                          jnp.where(present, 1 + 2 * (masks.ravel()[cell] - 1) + (k == count - 1), 0)]
            filled, given = (board > 0).sum(), initial.sum()
            return jnp.stack([jnp.where(show, jnp.where(count > 0, 1, 2), 0), *lines, filled,
                              given * (nn + 1) + filled - given, jnp.minimum(steps, budget)]).astype(jnp.int32)

        groups = [head_slots[:1], head_slots[1:-3], *([slot] for slot in head_slots[-3:]), tail_slots[:1],
                  tail_slots[1:-3], *([slot] for slot in tail_slots[-3:])]
        renderer = SudokuRenderer(tuple(piece_tables(tokenizer, group, None) for group in groups),
                                  tuple(len(group) for group in groups),
                                  lambda obs: jnp.concatenate([head_index(obs), tail_index(obs)]), 5,
                                  _echo_encoder(tokenizer, self.tag), n)
        check_state_tokens(self, tokenizer, renderer.tokens, self._sample_obs(num_checks), self.text_of_obs)
        return renderer

    def _sample_obs(self, count: int) -> np.ndarray:
        """States after one random move on puzzles with 0 to 12 blanks and on fresh ones; echoes of free text."""
        n, params = self.n, self.core.params
        rng = np.random.default_rng(0)
        keys = jax.random.split(jax.random.key(0), count)
        _, states = jax.vmap(self.reset_env, (0, None))(keys, params)
        solution = np.asarray(states.core.solution)
        board = np.asarray(states.core.board).copy()
        for k in range(count // 2):  # near-complete boards show the valid-number lines
            board[k] = solution[k] * (rng.random((n, n)) > rng.integers(0, 13) / (n * n))
        initial = (board > 0) & (rng.random(board.shape) < 0.8)
        texts = ["Up", "I'm not sure, maybe 3", "place nine at row 2", "\u00e9t\u00e9 || 7"]
        echo = np.zeros((count, ECHO_BYTES), np.uint8)
        lengths = np.zeros(count, np.int32)
        for k in range(count):
            raw = texts[k % len(texts)].encode()
            echo[k, :len(raw)], lengths[k] = np.frombuffer(raw, np.uint8), len(raw)
        states = states.replace(core=states.core.replace(board=jnp.asarray(board), initial=jnp.asarray(initial)),
                                echo=jnp.asarray(echo), echo_length=jnp.asarray(lengths))
        moves = rng.integers(0, n ** 3 + 2, count)
        moves[::5] = n ** 3 + 1
        step = jax.vmap(self.step_env, (None, 0, 0, None))
        return np.asarray(step(jax.random.key(0), states, jnp.asarray(moves), params)[0])
