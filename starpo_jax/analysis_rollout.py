"""The shape of RAGEN-2's separate gradient-analysis rollout (ragen2.md §5.1, ``agent_trainer.py:289-361``).

When ``trainer.gradient_analysis_env_groups`` or ``trainer.gradient_analysis_group_size`` differs from the
training shape, each analysis step plays a second rollout of that shape: a copy of the config whose
``es_manager.train`` has the analysis shape, its ``env_configs.n_groups`` rescaled per tag to the new group
count by largest-remainder rounding. Filters built from that copy select for its shape (same metric, strategy
and value) and bring it to ``lcm(analysis env_groups, mini-batch sizes)`` rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from starpo_jax.config import StarPOConfig


def scale_group_counts(base: Sequence[int], total: int) -> tuple[int, ...]:
    """``total`` groups shared over the tags in proportion to ``base`` (``_scale_env_config_group_counts``).

    Each tag gets ``⌊total · n / Σn⌋``; the groups left over go one each to the largest fractional parts, ties to
    the larger base count, then to the earlier tag.
    """
    raw = [total * n / sum(base) for n in base]
    scaled = [math.floor(x) for x in raw]
    order = sorted(range(len(base)), key=lambda i: (-(raw[i] - scaled[i]), -base[i]))
    for i in order[:total - sum(scaled)]:
        scaled[i] += 1
    return tuple(scaled)


def analysis_config(config: StarPOConfig) -> StarPOConfig | None:
    """``config`` with the analysis rollout's shape as ``es_manager.train``; ``None`` when it is the training's."""
    trainer, train = config.trainer, config.es_manager.train
    env_groups = trainer.gradient_analysis_env_groups or train.env_groups  # None: the training's (>= 1 checked)
    group_size = trainer.gradient_analysis_group_size or train.group_size
    if (env_groups, group_size) == (train.env_groups, train.group_size):
        return None
    env_configs = dataclasses.replace(train.env_configs,
                                      n_groups=scale_group_counts(train.env_configs.n_groups, env_groups))
    shaped = dataclasses.replace(train, env_groups=env_groups, group_size=group_size, env_configs=env_configs)
    return dataclasses.replace(config, es_manager=dataclasses.replace(config.es_manager, train=shaped))


def keep_all_config(config: StarPOConfig) -> StarPOConfig:
    """``config`` whose filter keeps every group (``top_p`` at 1, zero groups included), then adjusts the batch:
    the prefilter batch of ``trainer.gradient_analysis_log_prefilter``, with each row's group reward std."""
    rollout = dataclasses.replace(config.actor_rollout_ref.rollout, rollout_filter_strategy="top_p",
                                  rollout_filter_value=1.0, rollout_filter_include_zero=True,
                                  rollout_filter_metric="reward_variance")
    return dataclasses.replace(config, actor_rollout_ref=dataclasses.replace(config.actor_rollout_ref, rollout=rollout))
