"""Rollout filters as a registry: which rows of the rollout batch train (starpo.md §11, ragen2.md §4).

``actor_rollout_ref.rollout.rollout_filter_strategy`` names an entry of ``ROLLOUT_FILTERS``:

- ``starpo_s``: the paper's filter (``filtering``): the top ``rollout_filter_ratio`` of groups by the std of
  their raw scores, a fixed count, so the batch shape never changes;
- ``top_p``, ``top_k``, ``top_k_abs``, ``min_p``: RAGEN-2's SNR-aware filter (``snr_filter``): an adaptive set
  of groups scored by ``rollout_filter_metric``, possibly empty (the step is then skipped), brought back to a
  multiple of ``lcm(env_groups, mini-batch sizes)`` rows by ``agent_proxy.batch_adjust_mode``.

An entry is ``fn(inputs: FilterInputs, config, step) -> FilteredRows``; registering a new name makes it a
valid strategy. Under RAGEN-2's turn-level ``context_window_mode`` the rows are turn-samples with
``inputs.episode_ids``: both built-in filters rank the episodes (``episodes.Episodes``) and keep every
turn-sample of the selected ones, then bring the row count to a multiple of the divisor as RAGEN-2 does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from runtime.registry import Registry
from starpo_jax.episodes import Episodes
from starpo_jax.filtering import filter_groups_by_reward_std
from starpo_jax.snr_filter import STRATEGIES, SnrFilterConfig, SnrSelection, adjust_batch_size

# RAGEN's V1 filter types, accepted by the SNR strategies as their V2 names (ragen2.md §4.10).
V1_FILTER_TYPES = {"std": "largest", "std_rev": "smallest"}
REWARD_METRICS = ("reward_variance", "reward", "reward_sum")


class FilterInputs(NamedTuple):
    """Per-trajectory inputs of a filter, group-major ``(env_groups · group_size,)``.

    ``raw``: score + penalty before normalisation (or the summed turn rewards with ``use_turn_scores``);
    ``normalized``: the trajectory reward after ``agent_proxy.reward_normalization`` (RAGEN-2's
    ``original_rm_scores``); ``lengths``: trained tokens of each trajectory; ``episode_ids``: each row's episode
    when rows are turn-samples (``Trajectory.episode_ids``), else None; ``entropies``: each row's mean token entropy
    under the current policy, Σ(H·loss_mask) / max(Σ loss_mask, 1) (only for the entropy metrics; an episode's is
    the mean over its turn-samples).
    """

    raw: np.ndarray
    normalized: np.ndarray
    lengths: np.ndarray
    episode_ids: np.ndarray | None = None
    entropies: np.ndarray | None = None


class FilteredRows(NamedTuple):
    """Rows of the full batch to train on (with repeats after ``copy``), their loss weight, the metrics and each
    row's pre-filter group std of the ranked reward (RAGEN-2's ``reward_std`` field, read by gradient analysis)."""

    rows: np.ndarray
    sample_mask: np.ndarray
    metrics: dict[str, float]
    reward_std: np.ndarray


def _row_std(rewards: np.ndarray, groups: Any, rows: np.ndarray) -> np.ndarray:
    """The unbiased std of each row's group (0 for groups of one), for ``rows``."""
    grouped = np.asarray(rewards, np.float64).reshape(groups.env_groups, groups.group_size)
    std = grouped.std(axis=1, ddof=1) if groups.group_size > 1 else np.zeros(groups.env_groups)
    return np.repeat(std, groups.group_size)[rows]


ROLLOUT_FILTERS: Registry[Callable[[FilterInputs, Any, int], FilteredRows]] = Registry(
    "rollout filter", "actor_rollout_ref.rollout.rollout_filter_strategy")


@ROLLOUT_FILTERS.register("starpo_s")
def starpo_s_filter(inputs: FilterInputs, config: Any, step: int) -> FilteredRows:
    """StarPO-S: ``floor(ratio · env_groups)`` groups by raw-score std (``rollout_filter_type`` std / std_rev)."""
    groups, rollout = config.es_manager.train, config.actor_rollout_ref.rollout
    episodes = Episodes(inputs.episode_ids, len(inputs.raw))
    inputs = episodes.reduce_inputs(inputs)
    kept = filter_groups_by_reward_std(inputs.raw.reshape(groups.env_groups, groups.group_size),
                                       rollout.rollout_filter_ratio, rollout.rollout_filter_type,
                                       rollout.rollout_filter_drop_zero_std)
    count = len(kept.group_indices)
    metrics = {k: float(v) for k, v in kept.metrics.items()}
    metrics |= {"rollout/filter_kept_count": float(count), "rollout/filter_kept_ratio": count / groups.env_groups}
    rows = np.asarray(kept.sample_indices)
    out = FilteredRows(rows, np.asarray(kept.sample_mask), metrics, _row_std(inputs.raw, groups, rows))
    return _adjusted_turn_samples(out, episodes, config, step) if episodes.turn_level else out


def snr_config(rollout: Any) -> SnrFilterConfig:
    """The ``rollout_filter_*`` keys as a ``SnrFilterConfig`` (``std`` / ``std_rev`` read as largest / smallest)."""
    return SnrFilterConfig(
        strategy=rollout.rollout_filter_strategy, value=rollout.rollout_filter_value,
        filter_type=V1_FILTER_TYPES.get(rollout.rollout_filter_type, rollout.rollout_filter_type),
        include_zero=rollout.rollout_filter_include_zero, top_p_prob_mode=rollout.rollout_filter_top_p_prob_mode,
        selection_eps=rollout.rollout_filter_selection_eps, metric=rollout.rollout_filter_metric)


def batch_divisor(config: Any) -> int:
    """RAGEN-2's ``lcm(env_groups, ppo_mini_batch_size, n_gpus)``, with the critic's mini-batch when it trains."""
    sizes = [config.es_manager.train.env_groups, config.actor_rollout_ref.actor.ppo_mini_batch_size]
    if config.use_critic:
        sizes.append(config.critic.ppo_mini_batch_size)
    return math.lcm(*sizes)


def snr_filter(inputs: FilterInputs, config: Any, step: int) -> FilteredRows:
    """RAGEN-2's filter: score groups, keep an adaptive set, adjust the row count (ragen2.md §4.3-§4.5)."""
    groups = config.es_manager.train
    filter_config = snr_config(config.actor_rollout_ref.rollout)
    episodes = Episodes(inputs.episode_ids, len(inputs.raw))
    inputs = episodes.reduce_inputs(inputs)
    rewards = inputs.raw if config.agent_proxy.use_turn_scores else inputs.normalized
    values = {"length": inputs.lengths, "entropy": inputs.entropies,
              "entropy_variance": inputs.entropies}.get(filter_config.metric, rewards)
    shape = (groups.env_groups, groups.group_size)
    selection = SnrSelection(filter_config, np.asarray(values, np.float64).reshape(shape),
                             np.asarray(rewards, np.float64).reshape(shape))
    rows = np.flatnonzero(selection.row_mask)
    kept = FilteredRows(rows, np.ones(len(rows), np.float32), selection.metrics, selection.reward_std[rows])
    return _adjusted_turn_samples(kept, episodes, config, step)


def _adjusted_turn_samples(kept: FilteredRows, episodes: Episodes, config: Any, step: int) -> FilteredRows:
    """Every row (turn-sample) of the kept episodes, brought to a multiple of ``batch_divisor`` by
    ``agent_proxy.batch_adjust_mode``; one episode per row gives the kept rows themselves, adjusted."""
    weight, std = np.zeros(len(episodes), np.float32), np.zeros(len(episodes))
    weight[kept.rows], std[kept.rows] = kept.sample_mask, kept.reward_std
    rng = np.random.default_rng([config.seed.train, step])
    rows = adjust_batch_size(episodes.rows_of(kept.rows), batch_divisor(config), config.agent_proxy.batch_adjust_mode,
                             rng)
    return FilteredRows(rows, episodes.broadcast(weight)[rows], kept.metrics, episodes.broadcast(std)[rows])


for _strategy in STRATEGIES:
    ROLLOUT_FILTERS.register(_strategy, snr_filter)
