"""Token-level rendering and parsing on device.

``GridRenderer`` turns a grid observation into exactly the token ids the tokenizer gives its text:
it tokenises every possible row once (rows end with ``"\\n"``, so the state block ``State:\\n{grid}\\n``
is their concatenation) and checks at construction, over random grids and in context, that
concatenating row tokens equals encoding the whole text.

``ResponseParser`` applies RAGEN's response rules (``envs.text.parse_actions``) to generated token
ids: ids are decoded through a token-to-bytes table, and the regex, literal stripping, ``||``
splitting, Unicode whitespace trimming and case-insensitive name lookup run as array code over the
UTF-8 bytes. On valid UTF-8 it agrees with the host parser.
"""

import itertools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.text import MAX_ACTIONS_PER_TURN, SPECIAL_TOKENS

MAX_ROW_TABLE = 1 << 20
WHITESPACE = tuple(chr(c).encode() for c in range(0x110000) if chr(c).isspace())
# Non-ASCII characters whose str.lower() is one ASCII character (the Kelvin sign -> "k").
ASCII_LOWERED = tuple(
    (chr(c).encode(), chr(c).lower().encode()) for c in range(0x80, 0x110000)
    if not 0xD800 <= c <= 0xDFFF and chr(c).lower().isascii()
)
assert all(len(lowered) == 1 for _, lowered in ASCII_LOWERED), "lower() maps a character to several ASCII ones"


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def _encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


# ----------------------------------------------------------------------------- grid rendering


class GridRenderer(NamedTuple):
    """Row token tables for one grid format; ``render_tokens`` applies them to observations."""

    row_tokens: jax.Array  # (num_rows, max_row_tokens) int32, padded with 0
    row_lengths: jax.Array  # (num_rows,) int32
    num_symbols: int
    walled: bool  # rows are "wall + interior + wall": only the interior is looked up

    def tokens(self, obs: jax.Array, actions_left: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The state renderer interface (``TextEnvironment.state_renderer``): ``render_tokens`` of ``obs``."""
        return render_tokens(self, obs)


def _row_texts(symbols: Sequence[str], width: int, walled: bool) -> list[str]:
    inner = width - 2 if walled else width
    rows = []
    for combo in itertools.product(range(len(symbols)), repeat=inner):
        cells = "".join(symbols[c] for c in reversed(combo))  # least significant digit first
        rows.append((symbols[0] + cells + symbols[0] if walled else cells) + "\n")
    return rows


def render_tokens(renderer: GridRenderer, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token ids of ``grid text + "\\n"`` for one observation (jit/vmap-friendly).

    Returns ``(ids, length)``; ``ids`` has ``height * max_row_tokens`` entries, valid up to ``length``.
    """
    cells = obs[:, 1:-1] if renderer.walled else obs
    radix = renderer.num_symbols ** jnp.arange(cells.shape[1])
    codes = jnp.sum(cells.astype(jnp.int32) * radix, axis=1)
    return concat_rows(renderer.row_tokens[codes], renderer.row_lengths[codes])


def concat_rows(tokens: jax.Array, lengths: jax.Array, total: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The rows of 0-padded ``tokens`` (valid up to ``lengths``) laid end to end: ``(ids, total length)``.

    ``ids`` has ``total`` entries (default: every row at full width), which must bound ``lengths.sum()``.
    """
    starts = jnp.cumsum(lengths) - lengths
    width = tokens.shape[1]
    total = tokens.shape[0] * width if total is None else total
    slots = jnp.where(jnp.arange(width) < lengths[:, None], starts[:, None] + jnp.arange(width), total)
    ids = jnp.zeros(total + 1, jnp.int32).at[slots.ravel()].set(tokens.ravel())[:total]
    return ids, lengths.sum()


def build_grid_renderer(env, tokenizer, num_checks: int = 256, seed: int = 0) -> GridRenderer:
    """Row tables for ``env``'s grid symbols, verified against ``tokenizer`` on random grids.

    Raises:
        ValueError: naming the format and tokenizer when the tokenizer merges across rows (so no
            row-by-row renderer can be exact), or when the row table would be too large.
    """
    symbols = [env.grid_lookup[c] for c in range(len(env.grid_lookup))]
    height, width = env.observation_space(env.default_params).shape
    walled = env.walled_grid
    fmt = f"{env.tag} grid {''.join(symbols)!r}"
    name = _tokenizer_name(tokenizer)
    inner = width - 2 if walled else width
    if len(symbols) ** inner > MAX_ROW_TABLE:
        raise ValueError(f"{fmt}: rows of width {width} need {len(symbols)}**{inner} table entries (> {MAX_ROW_TABLE})")

    rng = np.random.default_rng(seed)
    grids = rng.integers(0, len(symbols), size=(num_checks, height, width))
    if walled:
        grids[:, [0, -1], :] = 0
        grids[:, :, [0, -1]] = 0
    lines = [["".join(symbols[c] for c in row) + "\n" for row in grid] for grid in grids]
    before, after = "State:\n", "You have 10 actions left."
    whole = _encode(tokenizer, ["".join(grid) for grid in lines])
    in_context = _encode(tokenizer, [before + "".join(grid) + after for grid in lines])
    by_row = _encode(tokenizer, [line for grid in lines for line in grid] + [before, after])
    before_ids, after_ids = by_row[-2:]
    for i, grid in enumerate(lines):
        rows = sum(by_row[i * height:(i + 1) * height], [])
        if rows != whole[i] or before_ids + rows + after_ids != in_context[i]:
            raise ValueError(
                f"format {fmt} cannot be rendered row by row with tokenizer {name!r}: its merges cross row "
                f"or context boundaries, e.g. for the grid {''.join(grid)!r}"
            )
    rows = _encode(tokenizer, _row_texts(symbols, width, walled))
    table = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, ids in enumerate(rows):
        table[i, : len(ids)] = ids
    return GridRenderer(jnp.asarray(table), jnp.asarray([len(r) for r in rows], jnp.int32), len(symbols), walled)


# ----------------------------------------------------------------------------- byte decoding


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_byte_table(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes, lengths)`` per token id as ``decode(skip_special_tokens=True)`` produces them.

    Supports byte-level BPE tokenizers (GPT-2, Qwen2.5, Llama-3); special tokens decode to nothing.
    """
    alphabet = _byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    pieces = []
    for token_id in range(len(tokenizer)):
        if token_id in special or (token_id in added and added[token_id].special):
            pieces.append(b"")
        elif token_id in added:
            pieces.append(added[token_id].content.encode())
        else:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if token is None or any(c not in alphabet for c in token):
                raise ValueError(
                    f"tokenizer {_tokenizer_name(tokenizer)!r} is not byte-level BPE (token {token_id}: {token!r}); "
                    "the on-device parser needs a token-to-bytes table"
                )
            pieces.append(bytes(alphabet[c] for c in token))
    max_len = max(len(p) for p in pieces)
    table = np.zeros((len(pieces), max(max_len, 1)), np.uint8)
    for i, piece in enumerate(pieces):
        table[i, : len(piece)] = np.frombuffer(piece, np.uint8)
    return table, np.array([len(p) for p in pieces], np.int32)


# ----------------------------------------------------------------------------- parsing on device


class ResponseParser(NamedTuple):
    """Tables for parsing generated ids: token bytes, lower-cased action names, tag prefix."""

    token_bytes: jax.Array  # (vocab, max_token_bytes) uint8
    token_lengths: jax.Array  # (vocab,)
    names: jax.Array  # (num_actions, max_name_bytes) uint8, lower-cased
    name_lengths: jax.Array
    enable_think: bool
    max_actions: int

    def parse(self, ids: jax.Array, length: jax.Array, actions_left=None) -> "ParsedActions":
        """``parse_tokens`` of one response (the fused driver's parser interface)."""
        return parse_tokens(self, ids, length, actions_left)


class ParsedActions(NamedTuple):
    """Device parse of one response; mirrors ``envs.text.TurnActions``."""

    action_ids: jax.Array  # (max_actions,) ids to execute in order (valid, within budget), then -1
    num_valid: jax.Array  # known action names among the parsed ones, before the budget cut
    num_parsed: jax.Array  # non-empty pieces of the answer, at most ``max_actions``
    format_penalty: jax.Array
    matched: jax.Array
    context: Any = None  # what an environment's ``begin_turn`` reads off the response (Sudoku: its pieces)


def build_response_parser(tokenizer, action_names: Sequence[str], enable_think: bool = True,
                          max_actions: int = MAX_ACTIONS_PER_TURN) -> ResponseParser:
    """Tables for ``parse_tokens``; action names must be ASCII (all of RAGEN's are)."""
    if not action_names:
        raise ValueError("action_names must not be empty: the device parser maps names to ids")
    for name in action_names:
        if not name.isascii() or not name.strip() or "||" in name:
            raise ValueError(f"action_names must be non-empty ASCII names without '||', got {name!r}")
    table, lengths = token_byte_table(tokenizer)
    encoded = [name.lower().encode() for name in action_names]
    names = np.zeros((len(encoded), max(len(n) for n in encoded)), np.uint8)
    for i, name in enumerate(encoded):
        names[i, : len(name)] = np.frombuffer(name, np.uint8)
    name_lengths = np.array([len(n) for n in encoded], np.int32)
    return ResponseParser(jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(names), jnp.asarray(name_lengths),
                          enable_think, max_actions)


def _occurrences(buf: jax.Array, n: jax.Array, pattern: bytes) -> jax.Array:
    """Boolean mask of positions where ``pattern`` starts inside ``buf[:n]``."""
    if not isinstance(pattern, bytes):
        raise TypeError(f"pattern must be bytes, got {type(pattern).__name__}")
    size = buf.shape[0]
    padded = jnp.concatenate([buf, jnp.zeros(len(pattern), buf.dtype)])
    hit = jnp.ones(size, bool)
    for k, byte in enumerate(pattern):
        hit &= padded[k:k + size] == byte
    return hit & (jnp.arange(size) + len(pattern) <= n)


def _spread(starts: jax.Array, width: int) -> jax.Array:
    """Marks ``width`` positions from every start."""
    out = starts
    for k in range(1, width):
        out = out | jnp.concatenate([jnp.zeros(k, bool), starts[:-k]])
    return out


def _whitespace(buf: jax.Array, n: jax.Array) -> jax.Array:
    """Bytes belonging to a Unicode whitespace character (``str.isspace``, regex ``\\s``)."""
    size = buf.shape[0]
    padded = jnp.concatenate([buf, jnp.zeros(2, buf.dtype)]).astype(jnp.int32)
    covered = jnp.zeros(size, bool)
    for length in sorted({len(char) for char in WHITESPACE}):
        codes = [int.from_bytes(char, "big") for char in WHITESPACE if len(char) == length]
        window = sum(padded[k:k + size] << (8 * (length - 1 - k)) for k in range(length))
        starts = jnp.isin(window, jnp.array(codes)) & (jnp.arange(size) + length <= n)
        covered |= _spread(starts, length)
    return covered


def _compact(buf: jax.Array, n: jax.Array, drop: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Removes the ``drop`` bytes, shifting the rest left."""
    size = buf.shape[0]
    keep = ~drop & (jnp.arange(size) < n)
    slots = jnp.where(keep, jnp.cumsum(keep) - 1, size)
    return jnp.zeros(size + 1, buf.dtype).at[slots].set(buf)[:size], keep.sum()


def _first(mask: jax.Array) -> jax.Array:
    """Index of the first True, or ``len(mask)`` if none."""
    return jnp.where(mask.any(), jnp.argmax(mask), mask.shape[0])


def _decode(parser: ResponseParser, ids: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    lengths = jnp.where(jnp.arange(ids.shape[0]) < length, parser.token_lengths[ids], 0)
    starts = jnp.cumsum(lengths) - lengths
    width = parser.token_bytes.shape[1]
    size = ids.shape[0] * width
    slots = jnp.where(jnp.arange(width) < lengths[:, None], starts[:, None] + jnp.arange(width), size)
    buf = jnp.zeros(size + 1, jnp.uint8).at[slots.ravel()].set(parser.token_bytes[ids].ravel())[:size]
    return buf, lengths.sum()


def answer_bytes(parser: ResponseParser, ids: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The answer group of ``forced tag + decode(ids[:length])`` with RAGEN's literal removals, original case.

    Returns ``(bytes, length, matched)``; ``bytes`` is 0 past ``length``.
    """
    body, body_len = _decode(parser, ids, length)
    prefix = np.frombuffer(b"<think>" if parser.enable_think else b"<answer>", np.uint8)
    text = jnp.concatenate([jnp.asarray(prefix), body])
    n = body_len + len(prefix)
    size = text.shape[0]
    positions = jnp.arange(size)
    answer_open = _occurrences(text, n, b"<answer>")
    answer_close = _occurrences(text, n, b"</answer>")
    if parser.enable_think:
        think_open = _first(_occurrences(text, n, b"<think>"))
        content = ~_whitespace(text, n)
        next_content = jax.lax.cummin(jnp.where(content, positions, size), reverse=True)
        after_close = jnp.concatenate([next_content, jnp.full(8, size)])[positions + 8]
        followed = answer_open[jnp.minimum(after_close, size - 1)] & (after_close < size)
        think_close = _occurrences(text, n, b"</think>") & followed & (positions >= think_open + 7)
        close = _first(think_close)
        start = jnp.where(close < size, after_close[jnp.minimum(close, size - 1)], size)
    else:
        start = _first(answer_open)
    end = _first(answer_close & (positions >= start + 8))
    matched = (start < size) & (end < size)

    # The answer group, then the literal removals of ``_parse_response`` in order.
    answer = jnp.where(positions < end - start - 8, text[jnp.minimum(positions + start + 8, size - 1)], 0)
    answer_len = jnp.where(matched, end - start - 8, 0)
    for literal in (token.encode() for token in SPECIAL_TOKENS):
        answer, answer_len = _compact(answer, answer_len, _spread(_occurrences(answer, answer_len, literal), len(literal)))
    return answer, answer_len, matched


def parse_tokens(parser: ResponseParser, ids: jax.Array, length: jax.Array, actions_left=None) -> ParsedActions:
    """RAGEN's parse of ``forced tag + decode(ids[:length])``: actions to run and the penalty flag."""
    answer, answer_len, matched = answer_bytes(parser, ids, length)
    for char, lowered in ASCII_LOWERED:
        hits = _occurrences(answer, answer_len, char)
        answer = jnp.where(hits, lowered[0], answer)
        answer, answer_len = _compact(answer, answer_len, _spread(hits, len(char)) & ~hits)
    answer = jnp.where((answer >= ord("A")) & (answer <= ord("Z")), answer + 32, answer).astype(jnp.uint8)
    return _split_and_match(parser, answer, answer_len, actions_left, matched)


class PieceSpans(NamedTuple):
    """The answer's ``||`` pieces, each stripped of Unicode whitespace: ``answer[lo[k]:hi[k]]`` for rank k."""

    lo: jax.Array  # (max_actions,) first byte of the k-th non-empty piece
    hi: jax.Array  # (max_actions,) one past its last byte
    num_parsed: jax.Array  # non-empty pieces, at most ``max_actions``


def _pieces(answer: jax.Array, n: jax.Array):
    """Per segment (indexed by its number of separators before it): stripped bounds and whether non-empty."""
    size = answer.shape[0]
    positions = jnp.arange(size)
    bar = (answer == ord("|")) & (positions < n)
    run_start = jax.lax.cummax(jnp.where(bar & ~jnp.concatenate([jnp.zeros(1, bool), bar[:-1]]), positions, 0))
    next_bar = jnp.concatenate([bar[1:], jnp.zeros(1, bool)])
    sep_start = bar & next_bar & ((positions - run_start) % 2 == 0)
    separator = _spread(sep_start, 2)
    piece = jnp.cumsum(sep_start)
    content = (positions < n) & ~separator & ~_whitespace(answer, n)
    segment = jnp.where(content, piece, size)
    lo = jax.ops.segment_min(jnp.where(content, positions, size), segment, num_segments=size + 1)[:size]
    hi = jax.ops.segment_max(jnp.where(content, positions + 1, -1), segment, num_segments=size + 1)[:size]
    return lo, hi, hi > lo


def piece_spans(answer: jax.Array, n: jax.Array, max_actions: int) -> PieceSpans:
    """``[piece.strip() for piece in answer.split("||") if piece.strip()][:max_actions]`` as byte spans."""
    lo, hi, nonempty = _pieces(answer, n)
    rank = jnp.cumsum(nonempty) - 1
    index = jax.vmap(lambda r: jnp.argmax(nonempty & (rank == r)))(jnp.arange(max_actions))
    num_parsed = jnp.minimum(nonempty.sum(), max_actions)
    inside = jnp.arange(max_actions) < num_parsed
    return PieceSpans(jnp.where(inside, lo[index], 0), jnp.where(inside, hi[index], 0), num_parsed)


def _split_and_match(parser: ResponseParser, answer, n, actions_left, matched) -> ParsedActions:
    size = answer.shape[0]
    spans = piece_spans(answer, n, parser.max_actions)
    num_parsed = spans.num_parsed
    name_width = parser.names.shape[1]

    def action_of(r):
        start, span = spans.lo[r], spans.hi[r] - spans.lo[r]
        window = answer[jnp.minimum(start + jnp.arange(name_width), size - 1)]
        inside = jnp.arange(name_width)[None] < parser.name_lengths[:, None]
        equal = jnp.all(jnp.where(inside, window[None] == parser.names, True), axis=1) & (span == parser.name_lengths)
        return jnp.where((r < num_parsed) & equal.any(), jnp.argmax(equal), -1)

    slots = jax.vmap(action_of)(jnp.arange(parser.max_actions))
    valid = slots >= 0
    num_valid = valid.sum()
    order = jnp.argsort(~valid, stable=True)
    action_ids = jnp.where(jnp.arange(parser.max_actions) < num_valid, slots[order], -1)
    if actions_left is not None:
        budget = jnp.maximum(actions_left, 0)
        action_ids = jnp.where(jnp.arange(parser.max_actions) < budget, action_ids, -1)
    penalty = (num_valid != num_parsed) | (num_valid == 0)
    return ParsedActions(action_ids.astype(jnp.int32), num_valid, num_parsed, penalty, matched)
