"""RAGEN-2's task configs (``config/_2_sokoban.yaml`` … ``_10_rubikscube.yaml``, ragen2.md §7-8) as presets.

Each set is the V2 base's agent limits (``max_turn`` 5, ``max_actions_per_turn`` 2) plus the task's own keys;
``starpo_jax.presets`` composes them with an algorithm as ``v2-{task}-{algorithm}``. ``max_context_window``
settings of the 2048 and cube configs are left out: under ``context_window_mode: full`` they have no effect
(ragen2.md §7.3). Service tasks (WebShop, search, Lean, DeepCoder) need their data or servers and have no
preset. The FrozenLake slipper sweep (``docs/experiment_frozen_lake_slipper_sweep.md``) gets its ``nofilter``
arm, ``v2-frozenlake-slipper{rate}-nofilter``; its ``filter`` arm needs RAGEN-2's top-p group filter.
"""

from __future__ import annotations

from typing import Mapping

import dataclasses

from envs.coord import slipper_success_rate
from envs.registry import RAGEN2_ENVS, EnvEntry
from runtime.preset import Preset


def define_tags(entries: Mapping[str, EnvEntry]) -> Preset:
    """A preset adding ``entries`` to ``custom_envs``."""
    return Preset({f"custom_envs.{tag}": entry for tag, entry in entries.items()})


def with_env_config(tag: str, **env_config) -> Preset:
    """``custom_envs.<tag>`` (a RAGEN-2 tag) with ``env_config`` keys changed."""
    entry = RAGEN2_ENVS[tag]
    return Preset({f"custom_envs.{tag}": dataclasses.replace(entry, env_config={**entry.env_config, **env_config})})


# Every RAGEN-2 preset defines all of RAGEN-2's new tags (``launch.evaluate --envs`` may name any of them).
V2_BASE = define_tags(RAGEN2_ENVS) + Preset({"agent_proxy.max_turn": 5, "agent_proxy.max_actions_per_turn": 2})


def tags(*names: str) -> Preset:
    """Train and validate on the ``custom_envs`` tags ``names``."""
    return Preset({"es_manager.train.env_configs.tags": names, "es_manager.val.env_configs.tags": names})


TASKS: dict[str, Preset] = {
    "sokoban": V2_BASE + tags("CoordSokoban"),
    "frozenlake": V2_BASE + tags("CoordFrozenLake") + with_env_config("CoordFrozenLake", success_rate=1.0),
    "countdown": V2_BASE + Preset({"agent_proxy.max_turn": 1}) + tags("Countdown"),
    "metamathqa": V2_BASE + tags("MetamathQA"),
    "sudoku": V2_BASE + tags("SimpleSudoku") + Preset({
        "es_manager.train.env_groups": 8, "es_manager.train.group_size": 16, "es_manager.train.env_configs.n_groups": (8,),
        "es_manager.val.env_groups": 32, "es_manager.val.group_size": 16, "es_manager.val.env_configs.n_groups": (32,)}),
    "2048": V2_BASE + tags("game_2048") + Preset({
        "agent_proxy.max_turn": 800, "agent_proxy.max_actions_per_turn": 1,
        "actor_rollout_ref.rollout.max_model_len": 8192, "actor_rollout_ref.rollout.response_length": 256}),
    "rubikscube": V2_BASE + tags("rubikscube") + Preset({
        "agent_proxy.max_turn": 25, "agent_proxy.max_actions_per_turn": 4,
        "actor_rollout_ref.rollout.response_length": 500, "actor_rollout_ref.rollout.val_kwargs.temperature": 0.5}),
}
SLIPPER_RATES = (100, 50, 20, 10, 5, 2, 0)


def slipper_sweep(rate) -> Preset:
    """One sweep run: CoordFrozenLake with ``success_rate = 1 - rate``, GAE, no entropy bonus or KL, no filter."""
    return V2_BASE + tags("CoordFrozenLake") + with_env_config(
        "CoordFrozenLake", success_rate=slipper_success_rate(rate)) + Preset({
            "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.entropy_coeff": 0.0,
            "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.kl_loss_coef": 0.0,
            "actor_rollout_ref.rollout.rollout_filter_ratio": 1.0, "trainer.total_training_steps": 400})


SLIPPER_PRESETS: dict[str, Preset] = {
    f"v2-frozenlake-slipper{rate}-nofilter": slipper_sweep(rate) for rate in SLIPPER_RATES}
