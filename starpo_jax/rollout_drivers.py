"""Rollout drivers: ``play(params, seed, key) -> (trajectory, rows)`` for one ``es_manager`` section.

``agent_proxy.rollout_driver`` names an entry of ``ROLLOUT_DRIVERS``: ``host`` (Python environments
stepped between compiled decoding calls, ``starpo_jax.rollout``) or ``fused`` (JAX environments stepped
inside one compiled program, ``starpo_jax.fused_rollout``). Both sample with the same mesh and KV-cache
sharding; group g plays from ``seed + g``; ``rows`` are the per-trajectory environment metrics.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
from jax.sharding import Mesh

import envs
from envs.base import TextEnvironment
from runtime.registry import Registry
from starpo_jax.config import EnvGroupsConfig, StarPOConfig
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, slot_metrics
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler


def rollout_settings(config: StarPOConfig) -> RolloutSettings:
    """The turn and length limits of ``config`` (``agent_proxy`` / ``rollout`` keys)."""
    proxy, rollout = config.agent_proxy, config.actor_rollout_ref.rollout
    return RolloutSettings(max_turn=proxy.max_turn, max_actions_per_turn=proxy.max_actions_per_turn,
                           enable_think=proxy.enable_think, format_penalty=config.es_manager.format_penalty,
                           max_model_len=rollout.max_model_len, train_on_sampled_ids=config.train_on_sampled_ids,
                           enable_response_mask=config.enable_response_mask, mask_alignment=config.mask_alignment,
                           max_context_window=proxy.max_context_window, use_turn_scores=proxy.use_turn_scores,
                           prompt_layout=proxy.prompt_layout, context_window_mode=proxy.context_window_mode)


def make_slots(groups: EnvGroupsConfig, seed: int, custom_envs: Mapping[str, envs.EnvEntry]) -> list:
    """``env_groups × group_size`` fresh slots, group-major; all rollouts of a group share a seed.

    Each tag's environment is the one its ``custom_envs`` entry configures; a host-only one
    (Countdown) keeps its state, so every slot gets its own.
    """
    slots = []
    group = 0
    for tag_id, (tag, n_groups) in enumerate(zip(groups.env_configs.tags, groups.env_configs.n_groups)):
        text_env = envs.make(tag, custom_envs)
        for _ in range(n_groups):
            for _ in range(groups.group_size):
                env = GymnaxHostEnv(text_env) if isinstance(text_env, TextEnvironment) else envs.make(tag, custom_envs)
                slots.append(reset_slot(env, seed + group, group, tag_id))
            group += 1
    return slots


def host_driver(config: StarPOConfig, groups: EnvGroupsConfig, graphdef, model_config,
                sampler_config: SamplerConfig, tokenizer, settings: RolloutSettings, mesh: Mesh) -> Callable:
    """Host-stepped environments; the sampler keeps its KV cache on ``mesh`` as the fused driver does."""
    sampler = make_sampler(graphdef, sampler_config, mesh=mesh)

    def play(params, seed: int, key):
        slots = make_slots(groups, seed, config.custom_envs)
        cache = init_cache(model_config, len(slots), settings.max_model_len + sampler_config.max_new_tokens,
                           mesh=mesh)
        return host_rollout(sampler, params, tokenizer, slots, cache, key, settings), list(map(slot_metrics, slots))

    return play


def fused_driver(config: StarPOConfig, groups: EnvGroupsConfig, graphdef, model_config,
                 sampler_config: SamplerConfig, tokenizer, settings: RolloutSettings, mesh: Mesh) -> Callable:
    """JAX environments stepped inside one compiled rollout program."""
    tables = [build_env_tables(envs.make(tag, config.custom_envs), tokenizer, settings)
              for tag in groups.env_configs.tags]
    sizes = [n * groups.group_size for n in groups.env_configs.n_groups]
    program = make_fused_rollout(graphdef, model_config, sampler_config, tables, sizes, tokenizer, settings, mesh,
                                 config.rollout_chunks)
    group_ids = np.repeat(np.arange(groups.env_groups), groups.group_size)

    def play(params, seed: int, key):
        out = fused_rollout(program, params, tokenizer, seed + group_ids, group_ids, key)
        return out.trajectory, out.metrics

    return play


# ``agent_proxy.rollout_driver`` names; a driver is ``(config, groups, graphdef, model_config, sampler_config,
# tokenizer, settings, mesh) -> play``.
ROLLOUT_DRIVERS: Registry[Callable[..., Callable]] = Registry("rollout driver", "agent_proxy.rollout_driver")
ROLLOUT_DRIVERS.register("host", host_driver)
ROLLOUT_DRIVERS.register("fused", fused_driver)


def make_player(config: StarPOConfig, groups: EnvGroupsConfig, graphdef, model_config, sampler_config: SamplerConfig,
                tokenizer, settings: RolloutSettings, mesh: Mesh) -> Callable:
    """``play(params, seed, key) -> (trajectory, rows)`` for ``groups`` with ``agent_proxy.rollout_driver``."""
    driver = ROLLOUT_DRIVERS[config.agent_proxy.rollout_driver]
    return driver(config, groups, graphdef, model_config, sampler_config, tokenizer, settings, mesh)
