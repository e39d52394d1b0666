"""Token rendering of text observations for the fused driver: a state text is a concatenation of slots.

Each slot has a fixed list of variants (e.g. one 2x2-cube face, one 2048 cell, the 2048 score); the environment
maps an observation to one variant index per slot on device. ``build_piece_renderer`` tokenises every variant
once and checks, over sample observations, alone and in context, that concatenating the variants' tokens equals
the tokenizer's encoding of the whole ``state + "\\n"`` text; it raises naming the environment and tokenizer
where a merge crosses a slot boundary.
"""

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.tokens import concat_rows


class PieceRenderer(NamedTuple):
    """Variant token tables of every slot; ``tokens`` renders one observation (jit/vmap-friendly)."""

    ids: jax.Array  # (total variants, max tokens) int32, 0-padded
    lengths: jax.Array  # (total variants,)
    offsets: jax.Array  # (num slots,) first row of each slot's variants
    index_of: Callable[[jax.Array], jax.Array]  # observation -> (num slots,) variant index per slot
    width: int  # the longest state: each slot's longest variant, summed (the rendered ids' length)

    def tokens(self, obs: jax.Array, actions_left=None) -> tuple[jax.Array, jax.Array]:
        """Token ids of ``state text + "\\n"`` (``width`` entries, 0-padded) and their count."""
        rows = self.offsets + self.index_of(obs)
        return concat_rows(self.ids[rows], self.lengths[rows], self.width)


def piece_tables(tokenizer, slots: Sequence[Sequence[str]], index_of: Callable) -> PieceRenderer:
    """Every slot variant tokenised on its own, unchecked (``build_piece_renderer`` checks them).

    A variant list passed (as the same object) for several slots, e.g. one per grid row, is stored once.
    """
    unique = list({id(slot): slot for slot in slots}.values())
    texts = [text for slot in unique for text in slot]
    encoded = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    table = np.zeros((len(encoded), max(1, max(len(e) for e in encoded))), np.int32)
    for i, ids in enumerate(encoded):
        table[i, :len(ids)] = ids
    starts = dict(zip((id(slot) for slot in unique), np.cumsum([0] + [len(slot) for slot in unique[:-1]])))
    offsets = [starts[id(slot)] for slot in slots]
    lengths = [len(e) for e in encoded]
    width = sum(max(lengths[start:start + len(slot)]) for start, slot in zip(offsets, slots))
    return PieceRenderer(jnp.asarray(table), jnp.asarray(lengths, jnp.int32), jnp.asarray(offsets, jnp.int32),
                         index_of, width)


def build_piece_renderer(env, tokenizer, slots: Sequence[Sequence[str]], index_of: Callable,
                         sample_obs: np.ndarray, text_of: Callable[[np.ndarray], str]) -> PieceRenderer:
    """Tables for ``slots``, verified on ``sample_obs`` against ``text_of(obs) + "\n"`` encoded whole.

    Raises:
        ValueError: naming the environment and tokenizer when the pieces do not concatenate to the
            whole encoding (alone or between ``State:\n`` and ``You have 10 actions left.``).
    """
    renderer = piece_tables(tokenizer, slots, index_of)
    indices = np.asarray(jax.vmap(index_of)(jnp.asarray(sample_obs)))
    for obs, index in zip(sample_obs, indices):
        text = text_of(obs) + "\n"
        if "".join(slot[i] for slot, i in zip(slots, index)) != text:
            raise ValueError(f"{env.tag}: the slot variants do not spell the rendered state {text!r}")
    check_state_tokens(env, tokenizer, renderer.tokens, sample_obs, text_of)
    return renderer


def check_state_tokens(env, tokenizer, tokens: Callable, sample_obs: np.ndarray,
                       text_of: Callable[[np.ndarray], str]) -> None:
    """Raises unless ``tokens(obs)`` is the encoding of ``text_of(obs) + "\n"``, alone and in context."""
    ids, lengths = (np.asarray(x) for x in jax.jit(jax.vmap(tokens))(jnp.asarray(sample_obs)))
    texts = [text_of(obs) + "\n" for obs in sample_obs]
    before, after = "State:\n", "You have 10 actions left."
    whole = tokenizer(texts + [before + t + after for t in texts] + [before, after], add_special_tokens=False)
    whole = [list(ids) for ids in whole["input_ids"]]
    before_ids, after_ids = whole[-2:]
    for k in range(len(texts)):
        pieces = [int(t) for t in ids[k, :lengths[k]]]
        if pieces != whole[k] or before_ids + pieces + after_ids != whole[len(texts) + k]:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"{env.tag} states cannot be rendered piece by piece with tokenizer {name!r}: its "
                             f"merges cross slot boundaries, e.g. in {texts[k]!r}; use the host driver")
