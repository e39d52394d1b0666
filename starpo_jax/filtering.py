"""StarPO-S rollout filter: keep the initial-state groups with the most reward variance (starpo.md §11).

Paper eq. 7 ranks each initial state ``s_0`` by ``U = Std_τ[R(τ)]`` over its ``group_size``
rollouts and keeps the top ``p`` of groups (``std``) or the bottom (``std_rev``). The number of
kept groups ``k = floor(p · env_groups)`` is static, so the result gathers to fixed shapes.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from runtime.registry import Registry

ZERO_STD_EPS = 1e-6
# ``fn(scores (env_groups, group_size), in_group_std (env_groups,), kept) -> (kept,) group ids to keep``.
FILTER_TYPES: Registry[Callable[[jax.Array, jax.Array, int], jax.Array]] = Registry(
    "rollout filter", "actor_rollout_ref.rollout.rollout_filter_type")


@FILTER_TYPES.register("std")
def top_std_groups(scores: jax.Array, in_group_std: jax.Array, kept: int) -> jax.Array:
    """The ``kept`` groups with the largest reward std (ties: lower group id first)."""
    return jnp.argsort(-in_group_std, stable=True)[:kept]


@FILTER_TYPES.register("std_rev")
def bottom_std_groups(scores: jax.Array, in_group_std: jax.Array, kept: int) -> jax.Array:
    """The ``kept`` groups with the smallest reward std (ties: lower group id first)."""
    return jnp.argsort(in_group_std, stable=True)[:kept]


class GroupFilter(NamedTuple):
    """Which groups and samples survive the filter.

    Attributes:
      group_indices: ``(k,)`` kept group ids in ascending order (the batch keeps its order).
      sample_indices: ``(k · group_size,)`` rows of the flat ``(env_groups · group_size)`` batch to
        gather, group-major like the reference layout.
      sample_mask: ``(k · group_size,)`` 1.0 for gathered rows that train, 0.0 for rows of a
        zero-std group when ``drop_zero_std`` is set (multiply the loss mask by it).
      keep_mask: ``(env_groups · group_size,)`` the same selection as a mask over the full batch.
      metrics: ``rollout/in_group_std|max|mean`` and ``rollout/chosen_in_group_std|max|mean``.
    """

    group_indices: jax.Array
    sample_indices: jax.Array
    sample_mask: jax.Array
    keep_mask: jax.Array
    metrics: dict[str, jax.Array]


def num_kept_groups(env_groups: int, ratio: float) -> int:
    """``floor(ratio · env_groups)`` as the reference's ``int(ratio * num_groups)``."""
    return int(ratio * env_groups)


def filter_groups_by_reward_std(scores: jax.Array, ratio: float, filter_type: str = "std",
                                drop_zero_std: bool = False) -> GroupFilter:
    """Ranks groups by the unbiased std of their trajectory scores and keeps ``floor(ratio · G)``.

    Ties are broken by group id (lower first) for both filter types (starpo.md §22.13); zero-std groups
    fill the remaining slots unless ``drop_zero_std``, which zeroes their ``sample_mask`` (std ≤ 1e-6).
    ``ratio == 1`` keeps every group; it also accepts ``group_size`` 1, whose std is reported as 0
    (the reference logs NaN).

    Args:
      scores: ``(env_groups, group_size)`` score (+ penalty) of each trajectory, group-major.
      ratio: ``actor_rollout_ref.rollout.rollout_filter_ratio`` in ``(0, 1]``.
      filter_type: a ``FILTER_TYPES`` name: ``std`` keeps the largest stds, ``std_rev`` the smallest.
      drop_zero_std: mask out kept groups whose rewards do not vary.
    """
    select = FILTER_TYPES.get(filter_type)
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape (env_groups, group_size), got {scores.shape}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"actor_rollout_ref.rollout.rollout_filter_ratio must be in (0, 1], got {ratio}")
    if ratio < 1.0 and scores.shape[1] < 2:
        raise ValueError(f"es_manager.train.group_size must be >= 2 to filter groups by reward std, "
                         f"got {scores.shape[1]}")
    env_groups, group_size = scores.shape
    kept = num_kept_groups(env_groups, ratio)
    if kept < 1:
        raise ValueError(f"actor_rollout_ref.rollout.rollout_filter_ratio={ratio} keeps no group of {env_groups}")
    scores = jnp.asarray(scores, jnp.float32)
    in_group_std = jnp.std(scores, axis=1, ddof=1) if group_size > 1 else jnp.zeros((env_groups,), jnp.float32)
    in_group_max = jnp.max(scores, axis=1)
    in_group_mean = jnp.mean(scores, axis=1)
    group_indices = jnp.sort(select(scores, in_group_std, kept))
    sample_indices = (group_indices[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    group_weight = jnp.ones((kept,), jnp.float32)
    if drop_zero_std:
        group_weight = (in_group_std[group_indices] > ZERO_STD_EPS).astype(jnp.float32)
    sample_mask = jnp.repeat(group_weight, group_size)
    keep_mask = jnp.zeros((env_groups,), jnp.float32).at[group_indices].set(group_weight)
    metrics = {
        "rollout/in_group_std": jnp.mean(in_group_std),
        "rollout/in_group_max": jnp.mean(in_group_max),
        "rollout/in_group_mean": jnp.mean(in_group_mean),
        "rollout/chosen_in_group_std": jnp.mean(in_group_std[group_indices]),
        "rollout/chosen_in_group_max": jnp.mean(in_group_max[group_indices]),
        "rollout/chosen_in_group_mean": jnp.mean(in_group_mean[group_indices]),
    }
    return GroupFilter(group_indices, sample_indices, sample_mask, jnp.repeat(keep_mask, group_size), metrics)
