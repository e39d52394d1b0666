"""Trajectory scores: format penalty, group normalisation and token placement (starpo.md §7, §8.2).

RAGEN normalises the summed trajectory reward per group inside the context
manager, before filtering (``ContextManager._normalize_score_tensor``), and puts
it on the last column of the score tensor; with ``use_turn_scores`` each turn's
reward goes on that assistant turn's end instead and nothing is normalised.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from runtime.registry import Registry

GROUPINGS = ("state", "batch", "inductive")
STD_EPS = 1e-6
ASYM_CLIP_RANGE = (-1.0, 3.0)


def normalization_group_ids(grouping: str, group_ids: jax.Array, tag_ids: jax.Array) -> jax.Array:
    """Group index of every trajectory: initial state (``state``), env tag (``inductive``) or one group."""
    if grouping not in GROUPINGS:
        raise ValueError(f"agent_proxy.reward_normalization.grouping must be one of {GROUPINGS}, "
                         f"got {grouping!r}")
    if grouping == "state":
        return group_ids
    if grouping == "inductive":
        return tag_ids
    return jnp.zeros_like(group_ids)


# ``fn(x, group_ids, num_groups) -> normalised x``: one score normaliser per ``reward_normalization.method``.
NORMALIZATION_METHODS: Registry[Callable[[jax.Array, jax.Array, int], jax.Array]] = Registry(
    "score normaliser", "agent_proxy.reward_normalization.method")


def _centered(x: jax.Array, group_ids: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """``x − mean_g`` and the group sizes."""
    counts = jax.ops.segment_sum(jnp.ones_like(x), group_ids, num_groups)
    means = jax.ops.segment_sum(x, group_ids, num_groups) / jnp.maximum(counts, 1.0)
    return x - means[group_ids], counts


@NORMALIZATION_METHODS.register("identity")
def identity_scores(x: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    return x


@NORMALIZATION_METHODS.register("mean")
def mean_centered_scores(x: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    return _centered(x, group_ids, num_groups)[0]


@NORMALIZATION_METHODS.register("mean_std")
def standardized_scores(x: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    centered, counts = _centered(x, group_ids, num_groups)
    variances = jax.ops.segment_sum(jnp.square(centered), group_ids, num_groups) / jnp.maximum(counts - 1.0, 1.0)
    stds = jnp.sqrt(variances)[group_ids]
    return jnp.where(stds > STD_EPS, centered / (stds + STD_EPS), 0.0)


@NORMALIZATION_METHODS.register("asym_clip")
def asym_clipped_scores(x: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    return jnp.clip(standardized_scores(x, group_ids, num_groups), *ASYM_CLIP_RANGE)


def normalize_scores(scores: jax.Array, penalty: jax.Array, group_ids: jax.Array, num_groups: int,
                     method: str) -> jax.Array:
    """Adds the format penalty, then normalises within groups (starpo.md §8.2).

    ``mean``: ``x − mean_g``; ``mean_std``: ``(x − mean_g) / (std_g + 1e-6)`` with the unbiased
    std, or 0 when ``std_g ≤ 1e-6`` (also for a group of one); ``asym_clip``: ``mean_std``
    clamped to ``[−1, 3]``; ``identity``: ``x``. Normalisation is skipped (penalty still added)
    when there are as many non-empty groups as samples, e.g. validation with ``group_size`` 1.

    Args:
      scores: ``(B,)`` summed trajectory rewards.
      penalty: ``(B,)`` accumulated format penalty.
      group_ids: ``(B,)`` int group of each trajectory, in ``[0, num_groups)``.
      num_groups: static upper bound on the number of groups.
      method: a name registered in ``NORMALIZATION_METHODS``.
    """
    normalizer = NORMALIZATION_METHODS.get(method)
    x = jnp.asarray(scores, jnp.float32) + jnp.asarray(penalty, jnp.float32)
    normalized = normalizer(x, group_ids, num_groups)
    num_present = jnp.sum(jax.ops.segment_sum(jnp.ones_like(x), group_ids, num_groups) > 0)
    return jnp.where(num_present < x.shape[0], normalized, x)


def place_scores_on_last_token(scores: jax.Array, num_positions: int) -> jax.Array:
    """``(B, num_positions)`` token rewards holding each trajectory's score on the last position (starpo.md §7)."""
    last = jnp.arange(num_positions) == num_positions - 1
    return jnp.where(last[None, :], jnp.asarray(scores, jnp.float32)[:, None], 0.0)


def place_turn_scores(input_ids: jax.Array, turn_indicators: jax.Array, turn_scores: jax.Array,
                      turn_end_id: int, shift: int) -> jax.Array:
    """Per-turn rewards on each assistant turn's end token (RAGEN HEAD ``use_turn_scores``, starpo.md §7).

    Turn ``k``'s reward goes on the ``turn_end_id`` token (``<|im_end|>``) whose turn indicator is
    ``2k + 3``; a row without that token gets it on the last column instead (later turns overwrite
    earlier ones there, as the reference assigns in turn order). The tensor is then rolled right
    by ``shift`` (1 for Qwen, landing on the ``\\n`` after ``<|im_end|>``; the last column wraps to
    position 0) and aligned to the next-token layout by dropping position 0.

    Args:
      input_ids: ``(B, L)`` token ids of the whole chat.
      turn_indicators: ``(B, L)`` cumulative count of ``<|im_start|>`` tokens.
      turn_scores: ``(B, K)`` per-turn rewards, 0 for turns a trajectory did not reach.
      turn_end_id: id of the turn-end token.
      shift: 1 for Qwen's ``<|im_end|>\\n``, 0 for turn markers with no trailing newline.

    Returns:
      ``(B, L − 1)`` token-level scores.
    """
    num_positions = input_ids.shape[1]
    last_column = (jnp.arange(num_positions) == num_positions - 1)[None, :]
    placed = jnp.zeros(input_ids.shape, jnp.float32)
    for turn in range(turn_scores.shape[1]):
        position = (input_ids == turn_end_id) & (turn_indicators == 2 * turn + 3)
        position = jnp.where(jnp.any(position, axis=1, keepdims=True), position, last_column)
        placed = jnp.where(position, turn_scores[:, turn:turn + 1].astype(jnp.float32), placed)
    return jnp.roll(placed, shift, axis=1)[:, 1:]
